// SPDX-License-Identifier: Apache-2.0
/* How the shim behaves while libraries load (what tests/shim/test_preload.c cannot show):
 *   scope PLUGIN SHIM  a library opened RTLD_LOCAL that holds libcuda in its own scope finds the
 *                      driver through dlsym(RTLD_DEFAULT, ...): cuInit (the driver's) and
 *                      cuMemAlloc_v2 (the shim's when SHIM is 1); this program links no libcuda.
 *   ctor PLUGIN        a library whose constructor allocates through the driver is opened by one
 *                      thread while the main thread makes the process's first allocation: glibc
 *                      holds its loader lock through the constructor, so a lock the shim held
 *                      across its own dlopen of the driver would deadlock the two (ctest's
 *                      timeout then fails the test). Links the fake libcuda, as a program does. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef WITH_DRIVER
#include <cuda.h>
#endif

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c);                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#ifndef WITH_DRIVER
static const char *file_of(void *p) {
    Dl_info in;
    return p && dladdr(p, &in) && in.dli_fname ? in.dli_fname : "";
}

static int scope(const char *plugin, int shim) {
    void *h = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
    CHECK(h);
    void *(*lookup)(const char *) = (void *(*)(const char *))dlsym(h, "plugin_lookup");
    CHECK(lookup);
    void *init = lookup("cuInit"), *alloc = lookup("cuMemAlloc_v2");
    printf("cuInit from %s\ncuMemAlloc_v2 from %s\n", file_of(init), file_of(alloc));
    CHECK(init && strstr(file_of(init), "libcuda"));
    CHECK(alloc && strstr(file_of(alloc), shim ? "cuma_preload" : "libcuda"));
    return 0;
}
#else
static void *opener(void *plugin) {
    return dlopen(plugin, RTLD_NOW);
}

static int ctor(const char *plugin) {
    CHECK(cuInit(0) == CUDA_SUCCESS);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, opener, (void *)plugin) == 0);
    usleep(100 * 1000); /* the other thread is inside the plugin's constructor now */
    CUdevice d;
    CUcontext c;
    CUdeviceptr p;
    CHECK(cuDeviceGet(&d, 0) == CUDA_SUCCESS);
    CHECK(cuDevicePrimaryCtxRetain(&c, d) == CUDA_SUCCESS);
    CHECK(cuCtxSetCurrent(c) == CUDA_SUCCESS);
    CHECK(cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS); /* the process's first allocation */
    void *h = NULL;
    CHECK(pthread_join(t, &h) == 0 && h);
    int (*result)(void) = (int (*)(void))dlsym(h, "plugin_ctor_result");
    CHECK(result && result() == CUDA_SUCCESS);
    CHECK(cuMemFree_v2(p) == CUDA_SUCCESS);
    printf("constructor and first allocation both done\n");
    return 0;
}
#endif

int main(int argc, char **argv) {
#ifndef WITH_DRIVER
    if (argc == 4 && !strcmp(argv[1], "scope")) return scope(argv[2], atoi(argv[3]));
#else
    if (argc == 3 && !strcmp(argv[1], "ctor")) return ctor(argv[2]);
#endif
    fprintf(stderr, "usage: %s scope PLUGIN SHIM | ctor PLUGIN\n", argv[0]);
    return 2;
}
