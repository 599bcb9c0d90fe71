// SPDX-License-Identifier: Apache-2.0
/* A C program that leaks from a known function, logged with trace:LOG,trace_stacks:on for
 * check_leaks_native.py: each of 12 iterations leaky_cache() keeps 1 MiB it never frees and
 * forward() takes 3 MiB it frees before the iteration ends.
 *
 * usage: leak_native LOG */
#include "cuma/cuma.h"

#include <stdio.h>

#define MB (1024u * 1024u)

static cuma_heap *heap;

__attribute__((noinline)) static void *leaky_cache(void) {
    void *p = NULL;
    cuma_alloc(heap, MB, NULL, &p); /* LEAK */
    return p;
}

__attribute__((noinline)) static void forward(void) {
    void *a = NULL;
    cuma_alloc(heap, 3 * MB, NULL, &a); /* ACTIVATIONS */
    cuma_free(heap, a, NULL);
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:256M,release_thread:off,trace:%s,trace_stacks:on", argv[1]);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    if (cuma_heap_create(&cfg, &heap)) {
        fprintf(stderr, "leak_native: %s\n", cuma_last_error());
        return 1;
    }
    for (int i = 0; i < 12; i++) {
        forward();
        if (!leaky_cache()) return 1;
    }
    return 0; /* the log and its stacks are closed at exit, the leak still live */
}
