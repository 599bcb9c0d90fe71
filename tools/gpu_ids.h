// SPDX-License-Identifier: Apache-2.0
/* The node's NVIDIA GPUs as DCGM exporter labels them, read from the driver's files in /proc, so
 * that the exporter's series carry the same `gpu` and `device` labels beside `UUID`. */
#ifndef CUMA_TOOLS_GPU_IDS_H
#define CUMA_TOOLS_GPU_IDS_H

#include <stddef.h>

#define GPU_IDS_MAX 64

/* One GPU. Invariants: uuid is "GPU-..." (never empty); minor >= 0; index is the GPU's place
 * (from 0) among the node's GPUs ordered by bus location, unique among them. */
typedef struct gpu_id {
    char uuid[64];
    char bus[32]; /* "0000:18:00.0" */
    int minor;    /* of the device node /dev/nvidiaN: DCGM's device="nvidiaN" */
    int index;    /* DCGM's gpu="N" (NVML's index: the order of the PCI bus locations) */
} gpu_id;

typedef struct gpu_table {
    gpu_id id[GPU_IDS_MAX];
    size_t n;
} gpu_table;

/* Reads dir/<bus location>/information for every GPU (dir NULL: $CUMA_NVIDIA_PROC, else
 * /proc/driver/nvidia/gpus); a file without a UUID, bus location or minor number is left out.
 * Returns how many went into t (GPU_IDS_MAX at most); 0 when there is no such directory (no
 * NVIDIA driver, or a container that does not show it). */
size_t gpu_ids_read(const char *dir, gpu_table *t);

/* The GPU of that UUID in t, or NULL. */
const gpu_id *gpu_ids_find(const gpu_table *t, const char *uuid);

#endif
