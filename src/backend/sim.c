// SPDX-License-Identifier: Apache-2.0
/* The simulated device: a capacity, a page granularity, streams that tests can hold busy, and a
 * clock that replays can drive. With host backing, pages are pieces of one sparse memfd mapped
 * into a PROT_NONE reservation, so data written through one mapping survives unmap and remap
 * elsewhere, as on a GPU. (A replay's manual clock belongs to the heap, not to this backend.)
 * Without it, addresses are numbers nobody dereferences and the simulator costs no memory, which
 * lets a replay simulate an 80 GiB device anywhere. */
#include "backend.h"
#include "util/error.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef struct sim_stream {
    cuma_stream handle;
    bool held;
    uint64_t releases; /* how often it was released: events recorded before complete */
} sim_stream;

typedef struct sim_event {
    uint32_t stream;   /* index into streams */
    uint32_t next;     /* free list */
    uint64_t releases; /* the stream's release count at record time */
    uint64_t due;      /* sim_lag_ms: complete from this time on (0: at once) */
    bool held;         /* the stream was held at record time */
} sim_event;

/* Invariants: used_pages + foreign_pages <= npages; a page index is either on free_pages or
 * handed out; events on the free list are not referenced by the core. Guarded by the heap lock
 * (or the arenas' shared-backend mutex), except used_pages and foreign_pages: atomic, because
 * mem_info reads them from any thread. */
typedef struct sim {
    cuma_backend be;
    bool backing;
    pid_t owner; /* the process that made it: with backing, its memfd is shared with children */
    uint64_t npages, next_fresh;
    _Atomic uint64_t used_pages;
    _Atomic uint64_t foreign_pages; /* held by "another program" (cuma_sim_take_memory) */
    uint64_t *free_pages;
    uint64_t nfree;
    int fd;
    sim_stream *streams;
    uint32_t nstreams, capstreams;
    sim_event *events;
    uint32_t nevents, capevents, free_event;
    uint64_t managed_bytes;
    /* sim_lag_ms: how far the simulated device runs behind the host. The clock is the heap's
     * manual one when it has one (set once, before any event; read atomically because the
     * heap writes it under its own locks), else the monotonic clock. Constant after setup. */
    uint64_t lag_ns;
    uint64_t stream_waits; /* stream_wait calls */
    const _Atomic uint64_t *clock;
    uint64_t call_ns; /* sim_call_us: host time each page created, mapped, unmapped or released
                       * takes (spent spinning, as a driver call would), constant */
    /* With the heap's manual clock and call_ns: what the calls took so far. They spin no host
     * time; now_ns is the manual clock plus this, so page_call_budget paces on a clock the
     * program drives (written under the heap's lock, read by now_ns from any thread). */
    _Atomic uint64_t spent_ns;
} sim;

#define NO_EVENT UINT32_MAX

static const cuma_backend_ops sim_ops;

static sim *as_sim(cuma_backend *be) {
    return be->ops == &sim_ops ? (sim *)be : NULL;
}

static _Atomic uint64_t fake_next = 1ull << 44;

static cuma_status sim_reserve(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr) {
    sim *s = (sim *)be;
    if (!s->backing) {
        /* Distinct per heap, aligned, never dereferenced. */
        uint64_t a = atomic_fetch_add(&fake_next, size + align);
        *addr = (a + align - 1) & ~(align - 1);
        return CUMA_OK;
    }
    void *p =
        mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return cuma_fail(CUMA_ERR_OOM, "sim: cannot reserve %llu bytes of address space: %s",
                         (unsigned long long)size, strerror(errno));
    uint64_t a = ((uint64_t)(uintptr_t)p + align - 1) & ~(align - 1);
    if (a > (uint64_t)(uintptr_t)p) munmap(p, a - (uint64_t)(uintptr_t)p);
    uint64_t tail = (uint64_t)(uintptr_t)p + size + align - (a + size);
    if (tail) munmap((void *)(uintptr_t)(a + size), tail);
    *addr = a;
    return CUMA_OK;
}

static void sim_unreserve(cuma_backend *be, uint64_t addr, uint64_t size) {
    if (((sim *)be)->backing) munmap((void *)(uintptr_t)addr, size);
}

static uint64_t sim_now(cuma_backend *be);

/* sim_call_us: a page call of a real driver takes tens of microseconds of host time. */
static void spend(sim *s, uint64_t pages) {
    if (!s->call_ns) return;
    if (s->clock) {
        atomic_fetch_add_explicit(&s->spent_ns, s->call_ns * pages, memory_order_relaxed);
        return;
    }
    uint64_t until = sim_now(NULL) + s->call_ns * pages;
    while (sim_now(NULL) < until) {
    }
}

static cuma_status sim_page_create(cuma_backend *be, uint64_t *handle) {
    sim *s = (sim *)be;
    spend(s, 1);
    if (s->used_pages + s->foreign_pages >= s->npages)
        return cuma_fail(CUMA_ERR_OOM, "sim: device full (%llu pages of %llu bytes)",
                         (unsigned long long)s->npages, (unsigned long long)be->page_size);
    s->used_pages++;
    *handle = s->nfree ? s->free_pages[--s->nfree] : s->next_fresh++;
    return CUMA_OK;
}

static void sim_page_release(cuma_backend *be, uint64_t handle) {
    sim *s = (sim *)be;
    spend(s, 1);
    /* The memfd is shared with a forked child: only its maker may drop pages' contents (a child
     * destroying its copy of the heap must not wipe the parent's live data). */
    if (s->backing && getpid() == s->owner)
        fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)(handle * be->page_size), (off_t)be->page_size);
    s->free_pages[s->nfree++] = handle;
    s->used_pages--;
}

static cuma_status sim_unmap(cuma_backend *be, uint64_t addr, uint32_t n);

static cuma_status sim_map(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n) {
    sim *s = (sim *)be;
    spend(s, n);
    if (!s->backing) return CUMA_OK;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t at = addr + k * be->page_size;
        void *p = mmap((void *)(uintptr_t)at, be->page_size, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, s->fd, (off_t)(handles[k] * be->page_size));
        if (p == MAP_FAILED) {
            cuma_status st = cuma_fail(CUMA_ERR_BACKEND, "sim: map at 0x%llx failed: %s",
                                       (unsigned long long)at, strerror(errno));
            if (k) sim_unmap(be, addr, k); /* all or nothing */
            return st;
        }
    }
    return CUMA_OK;
}

static cuma_status sim_unmap(cuma_backend *be, uint64_t addr, uint32_t n) {
    sim *s = (sim *)be;
    spend(s, n);
    if (!s->backing) return CUMA_OK;
    void *p = mmap((void *)(uintptr_t)addr, n * be->page_size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED)
        return cuma_fail(CUMA_ERR_BACKEND, "sim: unmap at 0x%llx failed: %s",
                         (unsigned long long)addr, strerror(errno));
    return CUMA_OK;
}

/* Segments are charged in pages against the capacity, like pages are. */
static cuma_status sim_seg_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    sim *s = (sim *)be;
    uint64_t pages = (size + be->page_size - 1) / be->page_size;
    if (s->used_pages + s->foreign_pages + pages > s->npages)
        return cuma_fail(CUMA_ERR_OOM, "sim: device full: a %llu-byte segment does not fit",
                         (unsigned long long)size);
    if (s->backing) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            return cuma_fail(CUMA_ERR_OOM, "sim: segment of %llu bytes: %s",
                             (unsigned long long)size, strerror(errno));
        *addr = (uint64_t)(uintptr_t)p;
    } else {
        *addr = atomic_fetch_add(&fake_next, (size + 0x1fffff) & ~0x1fffffull);
    }
    s->used_pages += pages;
    return CUMA_OK;
}

static void sim_seg_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    sim *s = (sim *)be;
    if (s->backing) munmap((void *)(uintptr_t)addr, size);
    s->used_pages -= (size + be->page_size - 1) / be->page_size;
}

static cuma_status sim_managed_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    sim *s = (sim *)be;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED)
        return cuma_fail(CUMA_ERR_OOM, "sim: managed allocation of %llu bytes failed",
                         (unsigned long long)size);
    s->managed_bytes += size;
    *addr = (uint64_t)(uintptr_t)p;
    return CUMA_OK;
}

static void sim_managed_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    ((sim *)be)->managed_bytes -= size;
    munmap((void *)(uintptr_t)addr, size);
}

static cuma_status sim_mem_info(cuma_backend *be, uint64_t *fr, uint64_t *total) {
    sim *s = (sim *)be;
    *total = be->capacity;
    uint64_t held = s->used_pages + s->foreign_pages;
    *fr = held < s->npages ? (s->npages - held) * be->page_size : 0;
    return CUMA_OK;
}

static uint64_t sim_now(cuma_backend *be) {
    const sim *s = be ? as_sim(be) : NULL;
    if (s && s->clock && s->call_ns)
        return atomic_load_explicit(s->clock, memory_order_relaxed) +
               atomic_load_explicit(&s->spent_ns, memory_order_relaxed);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t sim_clock(const sim *s) {
    return s->clock ? atomic_load_explicit(s->clock, memory_order_relaxed) : sim_now(NULL);
}

static int stream_slot(sim *s, cuma_stream h) {
    for (uint32_t i = 0; i < s->nstreams; i++)
        if (s->streams[i].handle == h) return (int)i;
    if (s->nstreams == s->capstreams) {
        uint32_t nc = s->capstreams ? s->capstreams * 2 : 16;
        sim_stream *n = realloc(s->streams, nc * sizeof *n);
        if (!n) return -1;
        s->streams = n, s->capstreams = nc;
    }
    s->streams[s->nstreams] = (sim_stream){h, false, 0};
    return (int)s->nstreams++;
}

static cuma_status sim_event_record(cuma_backend *be, cuma_stream stream, uint64_t *event) {
    sim *s = (sim *)be;
    int si = stream_slot(s, stream);
    if (si < 0) return cuma_fail(CUMA_ERR_OOM, "sim: no host memory for a stream");
    uint32_t e = s->free_event;
    if (e != NO_EVENT) {
        s->free_event = s->events[e].next;
    } else {
        if (s->nevents == s->capevents) {
            uint32_t nc = s->capevents ? s->capevents * 2 : 64;
            sim_event *n = realloc(s->events, nc * sizeof *n);
            if (!n) return cuma_fail(CUMA_ERR_OOM, "sim: no host memory for an event");
            s->events = n, s->capevents = nc;
        }
        e = s->nevents++;
    }
    uint64_t due = s->lag_ns ? sim_clock(s) + s->lag_ns : 0;
    s->events[e] =
        (sim_event){(uint32_t)si, NO_EVENT, s->streams[si].releases, due, s->streams[si].held};
    *event = e;
    return CUMA_OK;
}

/* Held-stream rule only: the stream was not held, or has been released since. */
static bool unheld(const sim *s, const sim_event *e) {
    return !e->held || s->streams[e->stream].releases > e->releases;
}

static int sim_event_query(cuma_backend *be, uint64_t event) {
    sim *s = (sim *)be;
    if (event >= s->nevents) return -1;
    const sim_event *e = &s->events[event];
    return unheld(s, e) && (!e->due || sim_clock(s) >= e->due);
}

static cuma_status sim_event_wait(cuma_backend *be, uint64_t event) {
    sim *s = (sim *)be;
    if (event >= s->nevents)
        return cuma_fail(CUMA_ERR_INVALID, "sim: no event %llu", (unsigned long long)event);
    sim_event *e = &s->events[event];
    if (!unheld(s, e))
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "sim: waiting on a held stream would never end");
    /* A lagging device catches up while the host waits: the host's clock does not move (a
     * manual clock cannot), the work is simply done. */
    e->due = 0;
    return CUMA_OK;
}

/* The simulated device runs every stream the same lag behind, so work queued after the wait
 * already runs after the event's; a held stream's event is not passed on (tests hold the
 * stream that frees, not the one that waits). Counted, for the tests. */
static cuma_status sim_stream_wait(cuma_backend *be, cuma_stream stream, uint64_t event) {
    sim *s = (sim *)be;
    (void)stream;
    if (event >= s->nevents)
        return cuma_fail(CUMA_ERR_INVALID, "sim: no event %llu", (unsigned long long)event);
    s->stream_waits++;
    return CUMA_OK;
}

static void sim_event_release(cuma_backend *be, uint64_t event) {
    sim *s = (sim *)be;
    if (event >= s->nevents) return;
    s->events[event].next = s->free_event;
    s->free_event = (uint32_t)event;
}

static void sim_destroy(cuma_backend *be) {
    sim *s = (sim *)be;
    if (s->fd >= 0) close(s->fd);
    free(s->free_pages);
    free(s->streams);
    free(s->events);
    free(s);
}

static const cuma_backend_ops sim_ops = {
    .reserve = sim_reserve,
    .unreserve = sim_unreserve,
    .page_create = sim_page_create,
    .page_release = sim_page_release,
    .map = sim_map,
    .unmap = sim_unmap,
    .seg_alloc = sim_seg_alloc,
    .seg_free = sim_seg_free,
    .managed_alloc = sim_managed_alloc,
    .managed_free = sim_managed_free,
    .mem_info = sim_mem_info,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_wait = sim_event_wait,
    .event_release = sim_event_release,
    .now_ns = sim_now,
    .destroy = sim_destroy,
    .stream_wait = sim_stream_wait,
};

cuma_status cuma_sim_backend_create(const cuma_settings *set, cuma_backend **out) {
    sim *s = calloc(1, sizeof *s);
    if (!s) return cuma_fail(CUMA_ERR_OOM, "sim: no host memory");
    s->be.ops = &sim_ops;
    s->be.kind = CUMA_BACKEND_SIM;
    s->be.name = cuma_backend_kind_name(CUMA_BACKEND_SIM);
    s->be.caps = (set->sim_segments ? CUMA_CAP_SEGMENTS : CUMA_CAP_VMM | CUMA_CAP_ALIAS) |
                 CUMA_CAP_MANAGED |
                 (set->host_backing ? CUMA_CAP_HOST_ACCESS : CUMA_CAP_FORK_PRIVATE);
    s->be.page_size = set->page_size;
    s->be.capacity = set->capacity;
    snprintf(s->be.device_id, sizeof s->be.device_id, "sim");
    s->backing = set->host_backing;
    s->owner = getpid();
    s->lag_ns = (uint64_t)set->sim_lag_ms * 1000000ull;
    s->call_ns = (uint64_t)set->sim_call_us * 1000ull;
    s->npages = set->capacity / set->page_size;
    s->free_pages = malloc(s->npages * sizeof *s->free_pages);
    s->free_event = NO_EVENT;
    s->fd = -1;
    if (!s->free_pages) {
        uint64_t n = s->npages;
        free(s);
        return cuma_fail(CUMA_ERR_OOM, "sim: no host memory for %llu pages", (unsigned long long)n);
    }
    if (s->backing) {
        s->fd = memfd_create("cuma-sim", MFD_CLOEXEC);
        if (s->fd < 0 || ftruncate(s->fd, (off_t)set->capacity)) {
            cuma_status st =
                cuma_fail(CUMA_ERR_BACKEND, "sim: host backing of %llu bytes failed: %s",
                          (unsigned long long)set->capacity, strerror(errno));
            sim_destroy(&s->be);
            return st;
        }
    }
    *out = &s->be;
    return CUMA_OK;
}

cuma_status cuma_simbe_hold(cuma_backend *be, cuma_stream stream, bool hold) {
    sim *s = as_sim(be);
    if (!s)
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "sim stream control: the heap is on backend %s, not sim", be->name);
    int si = stream_slot(s, stream);
    if (si < 0) return cuma_fail(CUMA_ERR_OOM, "sim: no host memory for a stream");
    if (!hold && s->streams[si].held) s->streams[si].releases++;
    s->streams[si].held = hold;
    return CUMA_OK;
}

cuma_status cuma_simbe_take(cuma_backend *be, uint64_t bytes) {
    sim *s = as_sim(be);
    if (!s)
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "cuma_sim_take_memory: the heap is on backend %s, not sim", be->name);
    uint64_t pages = bytes / be->page_size + (bytes % be->page_size != 0);
    if (pages > s->npages || pages + s->used_pages > s->npages)
        return cuma_fail(CUMA_ERR_OOM,
                         "cuma_sim_take_memory: %llu bytes do not fit next to the heap's %llu on "
                         "a %llu-byte device",
                         (unsigned long long)bytes,
                         (unsigned long long)(s->used_pages * be->page_size),
                         (unsigned long long)be->capacity);
    s->foreign_pages = pages;
    return CUMA_OK;
}

cuma_status cuma_simbe_set_clock(cuma_backend *be, const _Atomic uint64_t *clock) {
    sim *s = as_sim(be);
    if (!s) return cuma_fail(CUMA_ERR_UNSUPPORTED, "sim clock: backend %s is not sim", be->name);
    s->clock = clock;
    return CUMA_OK;
}

bool cuma_simbe_costed_clock(cuma_backend *be) {
    const sim *s = as_sim(cuma_backend_unwrap(be));
    return s && s->clock && s->call_ns;
}
