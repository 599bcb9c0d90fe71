// SPDX-License-Identifier: Apache-2.0
/* The NVIDIA driver's /proc/driver/nvidia/gpus/<bus>/information, which nvidia-container-toolkit
 * also shows inside containers: "GPU UUID:", "Bus Location:" and "Device Minor:" lines. Reading
 * them needs no NVML, which cuma does not load. */
#include "gpu_ids.h"

#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* The value after "key:" on a line, its white space trimmed, into out. */
static int field(const char *line, const char *key, char *out, size_t len) {
    size_t k = strlen(key);
    if (strncmp(line, key, k) || line[k] != ':') return 0;
    const char *v = line + k + 1;
    while (*v == ' ' || *v == '\t') v++;
    size_t n = strcspn(v, "\r\n");
    while (n && isspace((unsigned char)v[n - 1])) n--;
    if (!n || n >= len) return 0;
    memcpy(out, v, n);
    out[n] = 0;
    return 1;
}

static int read_one(const char *path, gpu_id *g) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[256], minor[16] = "";
    memset(g, 0, sizeof *g);
    while (fgets(line, sizeof line, f)) {
        (void)(field(line, "GPU UUID", g->uuid, sizeof g->uuid) ||
               field(line, "Bus Location", g->bus, sizeof g->bus) ||
               field(line, "Device Minor", minor, sizeof minor));
    }
    fclose(f);
    char *end;
    long m = strtol(minor, &end, 10);
    if (!minor[0] || *end || m < 0 || m > 1 << 20) return 0;
    g->minor = (int)m;
    return !strncmp(g->uuid, "GPU-", 4) && g->bus[0];
}

static int by_bus(const void *a, const void *b) {
    return strcasecmp(((const gpu_id *)a)->bus, ((const gpu_id *)b)->bus);
}

size_t gpu_ids_read(const char *dir, gpu_table *t) {
    gpu_id *out = t->id;
    if (!dir) dir = getenv("CUMA_NVIDIA_PROC");
    if (!dir || !*dir) dir = "/proc/driver/nvidia/gpus";
    DIR *d = opendir(dir);
    t->n = 0;
    if (!d) return 0;
    size_t n = 0;
    t->n = 0;
    struct dirent *e;
    while (n < GPU_IDS_MAX && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[512];
        if ((size_t)snprintf(path, sizeof path, "%s/%s/information", dir, e->d_name) >= sizeof path)
            continue;
        if (read_one(path, &out[n])) n++;
    }
    closedir(d);
    qsort(out, n, sizeof *out, by_bus);
    for (size_t i = 0; i < n; i++) out[i].index = (int)i;
    return t->n = n;
}

const gpu_id *gpu_ids_find(const gpu_table *t, const char *uuid) {
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->id[i].uuid, uuid)) return &t->id[i];
    return NULL;
}
