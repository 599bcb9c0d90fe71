// SPDX-License-Identifier: Apache-2.0
/* The parsed settings of a heap: the CUMA_CONF grammar, with one table of keys in config.c. */
#ifndef CUMA_SETTINGS_CONFIG_H
#define CUMA_SETTINGS_CONFIG_H

#include "cuma/cuma.h"

#include <stdbool.h>
#include <stdint.h>

#define CUMA_UNLIMITED  UINT64_MAX
#define CUMA_MAX_ARENAS 8

/* Invariants (cuma_settings_validate): page_size is a power of two >= 4 KiB; capacity is a
 * multiple of page_size; 0 <= memory_fraction <= 1; 0 <= fragmentation_threshold <= 1;
 * 0 <= remap_threshold <= 1;
 * virtual_size == 0 (derived) or >= capacity; backend, backend_fallback and policy are known
 * names; nvtx only where this libcuma can push ranges. */
typedef struct cuma_settings {
    char backend[16];               /* sim, vmm, segment, managed, auto */
    bool backend_named;             /* a settings string named the backend (else: implicit auto) */
    char backend_fallback[16];      /* none, sim: where no CUDA driver can be used */
    char policy[16];                /* tlsf (good fit, default), buddy */
    uint64_t capacity;              /* sim: device size */
    uint64_t page_size;             /* sim: page granularity; CUDA: 0 = the device's */
    uint64_t limit;                 /* CUMA_UNLIMITED = none */
    double memory_fraction;         /* 0 = none */
    uint64_t max_cached;            /* CUMA_UNLIMITED = no cap */
    int64_t release_delay_ms;       /* -1 = never by time */
    uint64_t free_watermark;        /* device pressure below this much free memory; 0 = off */
    double fragmentation_threshold; /* see config.c */
    double remap_threshold;         /* idle share below which backing creates, not moves */
    double page_call_budget;        /* pacing: share of wall time for page calls */
    bool growth;                    /* grow on demand; false = preallocate and stay */
    uint64_t preallocate;           /* bytes mapped at creation and never released */
    uint64_t virtual_size;          /* 0 = derived from capacity */
    uint64_t segment_size;          /* segment backend: smallest segment */
    bool host_backing;              /* sim: back pages with host memory */
    bool sim_clock_manual;          /* sim: clock driven by cuma_sim_set_time */
    bool sim_segments;              /* sim: a device without virtual memory management */
    int sim_lag_ms;                 /* sim: work completes this long after it is recorded */
    int sim_call_us;                /* sim: host time of each page call */
    bool early_remap;               /* share pending idle pages with their own stream */
    bool stream_order;              /* ... and with others, ordered after it on the device */
    bool managed_fallback;          /* serve from managed memory when the device is full */
    bool release_thread;            /* background thread that gives idle pages back on time */
    bool tcache;                    /* per-thread caches (the fast path) */
    uint64_t tcache_bytes;          /* most bytes one thread's cache holds */
    uint64_t tcache_max;            /* largest block a thread cache holds */
    int64_t tcache_age_ms;          /* blocks idle longer go back to the heap */
    int arenas;                     /* most arenas threads spread over under contention */
    char trace[256];                /* log of every call to this file; "" = none */
    char oom_dump[256];             /* what holds the memory, written at a failure; "" = none */
    char ledger[104];               /* auto, on, off, a ledger's name, @GROUP or @GROUP+NAME */
    int priority;                   /* in the ledger: higher wins */
    uint64_t guarantee;             /* in the ledger: device bytes nobody takes from the heap */
    int64_t pressure_timeout_ms;    /* how long a growth waits for others to give memory */
    bool nvtx;                      /* slow paths as NVTX ranges (util/marks.h) */
    bool trace_stacks;              /* with trace: allocations' call stacks in LOG.stacks */
    int device;
} cuma_settings;

/* Fills defaults. */
void cuma_settings_default(cuma_settings *s);

/* Applies a settings string on top of s. On error s may be partly updated; the message names
 * the key and the value. `origin` names where the string came from ("CUMA_CONF"). */
cuma_status cuma_settings_parse(cuma_settings *s, const char *conf, const char *origin);

/* Defaults, then CUMA_CONF unless cfg says not to, then cfg->conf. */
cuma_status cuma_settings_from_config(cuma_settings *s, const cuma_config *cfg);

cuma_status cuma_settings_validate(const cuma_settings *s);

/* Writes the settings as a JSON object body (no braces) into buf; returns the length that
 * was needed (like snprintf). */
size_t cuma_settings_json(const cuma_settings *s, char *buf, size_t len);

/* Parses a size ("512", "2M", "1.5G"); false on a bad one. */
bool cuma_parse_size(const char *text, uint64_t *out);

/* Whether a `ledger` setting names a ledger: 1 to 48 letters, digits, '_', '-' or '.', @GROUP or
 * @GROUP+NAME (each part so). The one grammar of the config parser and the ledger's files. */
bool cuma_ledger_name_valid(const char *name);

#endif
