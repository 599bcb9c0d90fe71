// SPDX-License-Identifier: Apache-2.0
/* The one interface between the device-independent core and a device.
 *
 * The core manages addresses and sizes only; everything that touches device memory, streams or
 * time goes through these calls. A backend is either page-mapped (reserve a virtual range,
 * create physical pages, map them anywhere in the range) or segment-based (whole segments from
 * the driver, no remapping); `caps` says which.
 *
 * Thread safety: the core calls a backend under its heap lock, except now_ns and mem_info, which
 * may be called from any thread at any time (so they must not touch state the other calls
 * change). A backend needs no lock of its own: a heap with several arenas (each with its own
 * lock) shares one backend through cuma_backend_locked.
 */
#ifndef CUMA_BACKEND_BACKEND_H
#define CUMA_BACKEND_BACKEND_H

#include "settings/backends.h"
#include "settings/config.h"
#include "cuma/cuma.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define CUMA_CAP_VMM         1u  /* reserve/page_create/map/unmap work */
#define CUMA_CAP_SEGMENTS    2u  /* seg_alloc/seg_free work */
#define CUMA_CAP_MANAGED     4u  /* managed_alloc/managed_free work */
#define CUMA_CAP_HOST_ACCESS 8u  /* device addresses can be dereferenced by the host (tests) */
#define CUMA_CAP_ALIAS       16u /* a page may be mapped at a second address (early remaps) */
/* The device's memory is the process's own, so a forked child may go on using its copy of the
 * heap (a simulated device without host backing: addresses and pages are only bookkeeping).
 * Without it the child's heap refuses to work: its memory is the parent's (src/heap/fork.c). */
#define CUMA_CAP_FORK_PRIVATE 32u
/* Its memory may exceed the device's (managed memory, which the driver pages between host and
 * device): a limit the settings give above the device size holds, and the ledger does not count
 * it as device memory that other heaps could have. */
#define CUMA_CAP_OVERSUBSCRIBE 64u

/* What device a backend drives: the core and the shims test this, never the name, which is
 * for people (the stats, `cuma ps`, messages) and may change. A wrapper (locked, ledger) has the
 * kind of the backend it wraps. One per line of CUMA_BACKEND_LIST (settings/backends.h). */
#define CUMA_BACKEND_KIND_ENUM(kind, name, family, what) CUMA_BACKEND_##kind,
typedef enum cuma_backend_kind { CUMA_BACKEND_LIST(CUMA_BACKEND_KIND_ENUM) } cuma_backend_kind;
#undef CUMA_BACKEND_KIND_ENUM

/* The kind's name ("sim", "vmm", ...), as the settings and the stats spell it. */
const char *cuma_backend_kind_name(cuma_backend_kind kind);

/* The kind a `backend` setting names; false for "auto" and for anything not in the list. */
bool cuma_backend_kind_find(const char *name, cuma_backend_kind *kind);

typedef struct cuma_backend cuma_backend;

typedef struct cuma_backend_ops {
    /* Virtual range: size is a multiple of the page size; *addr aligned to `align`. */
    cuma_status (*reserve)(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr);
    void (*unreserve)(cuma_backend *be, uint64_t addr, uint64_t size);
    /* A physical page of page_size bytes; CUMA_ERR_OOM when the device is full. */
    cuma_status (*page_create)(cuma_backend *be, uint64_t *handle);
    void (*page_release)(cuma_backend *be, uint64_t handle);
    /* Maps n pages at addr, addr + page_size, ... (inside the reserved range) and makes the
     * run accessible: all of it or, on failure, none. One access call for the run: on CUDA,
     * cuMemSetAccess is the costly part of a map, and a block's new pages come in runs. */
    cuma_status (*map)(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n);
    /* Unmaps n mapped pages at addr, addr + page_size, ... (one call where the driver takes a
     * range). On failure some may stay mapped: a CUDA backend remembers them and unmaps them
     * before anything is mapped there again, or at destroy. */
    cuma_status (*unmap)(cuma_backend *be, uint64_t addr, uint32_t n);
    /* Whole segments (no VMM). */
    cuma_status (*seg_alloc)(cuma_backend *be, uint64_t size, uint64_t *addr);
    void (*seg_free)(cuma_backend *be, uint64_t addr, uint64_t size);
    /* Managed (oversubscribable) memory. */
    cuma_status (*managed_alloc)(cuma_backend *be, uint64_t size, uint64_t *addr);
    void (*managed_free)(cuma_backend *be, uint64_t addr, uint64_t size);
    /* Device memory as the driver sees it. */
    cuma_status (*mem_info)(cuma_backend *be, uint64_t *free_bytes, uint64_t *total_bytes);
    /* Events: record on a stream (the backend pools them), query (1 done, 0 not yet,
     * negative on error), wait (CUMA_OK when done; CUMA_ERR_UNSUPPORTED where waiting
     * would never end, as on a held simulated stream), release back to the pool. */
    cuma_status (*event_record)(cuma_backend *be, cuma_stream stream, uint64_t *event);
    int (*event_query)(cuma_backend *be, uint64_t event);
    cuma_status (*event_wait)(cuma_backend *be, uint64_t event);
    void (*event_release)(cuma_backend *be, uint64_t event);
    /* Nanoseconds on the backend's monotonic clock (a heap with sim_clock:manual uses its own;
     * the sim then counts from it: cuma_simbe_costed_clock). */
    uint64_t (*now_ns)(cuma_backend *be);
    void (*destroy)(cuma_backend *be);
    /* Makes work queued on `stream` from now on wait on the device for a recorded event (of
     * any stream), the host not waiting: memory freed on another stream may then serve it
     * before that work is done. NULL where the backend cannot; CUMA_ERR_UNSUPPORTED while the
     * stream captures a graph (the wait would be a node of it). */
    cuma_status (*stream_wait)(cuma_backend *be, cuma_stream stream, uint64_t event);
    /* Whether work queued on `stream` now would go into a graph being captured (also true when
     * the backend cannot tell): a wait queued before the capture does not order the graph's
     * work, which runs whenever and wherever the graph is launched. NULL: nothing captures. */
    bool (*stream_capturing)(cuma_backend *be, cuma_stream stream);
} cuma_backend_ops;

/* Fields are set by the backend's constructor and constant afterwards. */
struct cuma_backend {
    const cuma_backend_ops *ops;
    cuma_backend_kind kind;
    const char *name; /* the kind's name as the stats show it: "sim", "vmm", ... */
    unsigned caps;
    uint64_t page_size;  /* granularity of page_create/map */
    uint64_t capacity;   /* device memory in bytes */
    char device_id[64];  /* UUID or "sim" */
    cuma_backend *inner; /* a wrapper's (locked, ledger): the backend it calls; else NULL */
    /* The handle that names each calling thread's own default stream (CU_STREAM_PER_THREAD), or
     * NULL where the device has none: the stream table tells threads' streams apart by it. */
    cuma_stream per_thread_stream;
};

/* Creates the backend the settings name ("auto" picks the best available). Where no CUDA driver
 * can be used, a CUDA backend is CUMA_ERR_NO_DEVICE, with a message that names the driver's
 * reason and the settings that give the simulated device. */
cuma_status cuma_backend_create(const cuma_settings *s, cuma_backend **out);

/* cuma_backend_create, except that where no CUDA driver can be used and s->backend_fallback is
 * "sim", it is the simulated device, with *fell_back set (a heap's creation). */
cuma_status cuma_backend_create_or_fallback(const cuma_settings *s, cuma_backend **out,
                                            bool *fell_back);

/* Each family's constructor (CUMA_BACKEND_LIST): the backend of that family the settings name.
 * A family with several kinds is declared once per kind, which C allows. The CUDA family (the
 * cuda_*.c files) is CUMA_ERR_NO_DEVICE in a libcuma built without cuda.h or without a usable
 * driver. */
#define CUMA_BACKEND_CREATE_DECL(kind, name, family, what)                                         \
    cuma_status cuma_##family##_backend_create(const cuma_settings *s, cuma_backend **out);
CUMA_BACKEND_LIST(CUMA_BACKEND_CREATE_DECL)
#undef CUMA_BACKEND_CREATE_DECL

/* Wraps a backend for several arenas of one heap: its calls then run under one mutex (except
 * now_ns and mem_info). Destroying the wrapper destroys the backend. */
cuma_status cuma_backend_locked(cuma_backend *inner, cuma_backend **out);
/* The device backend under any wrappers (be itself when it is no wrapper). */
cuma_backend *cuma_backend_unwrap(cuma_backend *be);
/* From now on the wrapper's calls take its mutex (before: one caller, the first arena, under its
 * own lock). Call with that lock held, before a second arena calls the backend. */
void cuma_backend_share(cuma_backend *be);
/* Holds a wrapper's mutex around a call on the backend it holds (no-ops for other backends). */
void cuma_backend_lock(cuma_backend *be);
void cuma_backend_unlock(cuma_backend *be);

/* Sim controls behind include/cuma/sim.h; CUMA_ERR_UNSUPPORTED if be is not a sim. */
cuma_status cuma_simbe_hold(cuma_backend *be, cuma_stream stream, bool hold);
/* The clock sim_lag_ms counts on: a heap's manual clock (read atomically from any thread). */
/* Another program holds `bytes` of the simulated device (rounded up to pages; replaces what it
 * held): the device's free memory and what the heap can take shrink by them. */
cuma_status cuma_simbe_take(cuma_backend *be, uint64_t bytes);
cuma_status cuma_simbe_set_clock(cuma_backend *be, const _Atomic uint64_t *clock);
/* Whether be is a sim on a heap's manual clock whose page calls cost time (sim_call_us): its
 * now_ns is then that clock plus the calls' cost, which pacing can measure. */
bool cuma_simbe_costed_clock(cuma_backend *be);

#endif
