// SPDX-License-Identifier: Apache-2.0
/* Physical pages under the virtual range: a page is mapped while at least one live allocation
 * overlaps it (a reference count per virtual page) and idles in the cache when the count drops
 * to zero.
 *
 * An idle page stays mapped where it was (so a block placed there again costs no driver call)
 * until another virtual page needs backing (it is then moved: unmap, map) or the release policy
 * gives it back. The cache is one list, newest first: a page that needs backing takes the
 * oldest idle page (its address, freed longest ago, is the least likely to be wanted again
 * soon), and so does the release policy once it has idled its delay. A page is unmapped only
 * after the work of the streams that last freed memory in it is complete (its fence).
 *
 * A GPU runs behind the host, so the newest idle pages usually still have work pending. When
 * none is done but one's pending work is all on the stream that needs a page, that page is
 * mapped at the new place at once and its old mapping stays until the work completes (a ghost:
 * the stream runs the old work before the new, so both never touch it at once). A ghost's
 * virtual page is backed by nothing the allocator may hand out; backing it again first unmaps
 * the ghost (its work done), takes its page back (idle there, same stream), or waits.
 *
 * Driver calls are what a move costs: the pages one call backs are mapped in runs (one access
 * call a run) and the old places of those it moves unmapped in runs. remap_threshold, and
 * pacing when the calls take more than page_call_budget of the wall time, keep some idle pages
 * where they are (a new page is created instead) so that fewer move.
 *
 * Not thread-safe: the heap lock protects everything here.
 */
#ifndef CUMA_PHYS_PAGES_H
#define CUMA_PHYS_PAGES_H

#include "backend/backend.h"
#include "place/streams.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define CUMA_NIL UINT32_MAX

/* One physical page. Invariants: va == CUMA_NIL or phys_of[va] == index + 1; cached iff on
 * the cache list iff (va == CUMA_NIL or live[va] == 0); an unmapped page is always cached. */
typedef struct cuma_phys {
    uint64_t handle;
    uint64_t idle_since; /* ns, when it joined the cache */
    uint64_t fence_seq;
    uint32_t va;         /* virtual page it is mapped at, or CUMA_NIL */
    uint32_t prev, next; /* cache list, or free-slot list */
    uint16_t fence_stream;
    uint8_t cached;
    uint8_t pinned;  /* preallocated: never given back */
    uint8_t used;    /* slot holds a page */
    uint16_t nghost; /* ghost mappings of this page */
    /* Its fence is covered: the page was backed anew (an early remap, or reused in place) for
     * a stream whose later work runs after that fence (its own work, or another stream's it
     * was ordered after: cuma_fence_order), and no free has tagged it since. The next free's
     * tag, if it is the last live byte's, replaces the fence instead of joining it: that block
     * was used on that stream after the fence, and a free names the stream of the last use.
     * Joined, the tag and a pending one of another stream made a MULTI tag, which no stream
     * can be ordered after (20 ms behind, most idle pages of the offloading traces were). */
    uint8_t covered;
} cuma_phys;

/* A mapping kept for pending work after its page moved on. Invariant: phys_of[va] == CUMA_GHOST
 * | its index; live[va] == 0; phys[phys].used; the fence is one stream's, never MULTI. */
typedef struct cuma_ghost {
    uint64_t fseq;
    uint32_t va, phys;
    uint16_t fstream;
} cuma_ghost;

#define CUMA_GHOST 0x80000000u /* phys_of: a ghost mapping; its index in the low bits */

/* Invariants (cuma_pages_validate): nreserved == slots in use == nmapped + ncached;
 * nreserved <= *shared <= limit_pages unless the limit was lowered below it (*shared sums
 * nreserved over the heap's arenas: cuma_validate); live[v] > 0 implies
 * phys_of[v] != 0 and is no ghost; the cache list is ordered by idle_since, newest first;
 * the ring of ages holds one time per cached page not pinned, oldest first, never
 * decreasing; nghost sums to nghosts. */
typedef struct cuma_pages {
    cuma_backend *be;
    cuma_streams *ss;
    uint64_t base; /* address of virtual page 0 */
    uint64_t page_size;
    unsigned shift;
    uint32_t nva;      /* virtual pages */
    uint32_t *live;    /* per virtual page: live allocations overlapping it */
    uint32_t *phys_of; /* per virtual page: physical slot + 1, 0 = unmapped, or CUMA_GHOST | g */
    cuma_phys *phys;
    uint32_t nslots, capslots, free_slot;
    uint32_t head, tail; /* cache list */
    uint64_t ncached, nmapped, nreserved, npinned;
    /* The ages of the idle memory, apart from which pages hold it: a ring of nages times (one
     * per idle page that is not pinned), oldest at ages[age_lo], in time order (memory a thread
     * cache held joins at the time it went idle there, usually among the newest). A
     * page taken from the cache for reuse (in place or moved) takes the newest age with it, a
     * page released the oldest, so the delay counts how long that much memory has not been
     * needed, whichever physical pages moved; the release still gives back the coldest pages
     * (the list's tail). Capacity capslots, so that a push never allocates. */
    uint64_t *ages;
    uint64_t nages;
    uint32_t age_lo;
    /* Pages held by every arena of the heap, which limit_pages bounds: own_reserved of the
     * heap's first arena (atomic: arenas change it under their own locks); `shared` points
     * at it and is constant once the heap is built. */
    _Atomic uint64_t own_reserved;
    _Atomic uint64_t *shared;
    uint64_t limit_pages;
    double remap_threshold; /* settings' remap_threshold: no moves while ncached <= it x nmapped */
    /* Pacing (page_call_budget): the time the backend's page calls take, on its own clock
     * (timed unless the heap runs on a manual clock), and the share of the memory in use that
     * idle pages may hold unmoved, raised while the calls take more than the budget of the
     * wall time and lowered while they take much less. keep <= PACE_MAX_KEEP. */
    bool timed;
    double budget;
    double keep;
    uint64_t call_ns;                /* time in page calls, in all */
    uint64_t win_start, win_call_ns; /* the current pacing window: start, call_ns then */
    bool limit_is_device; /* the limit is the device size: hitting it is OOM, not LIMIT */
    cuma_ghost *ghosts;
    uint32_t nghosts, capghosts;
    uint64_t creates, releases, maps, unmaps;
    uint64_t map_runs;     /* backend map calls: runs of consecutive pages mapped together */
    uint64_t unmap_runs;   /* backend unmap calls (moved pages' old places, released pages) */
    uint64_t early_remaps; /* ghosts made: pages mapped anew before their old work was done */
    bool marks;            /* nvtx:on: the page calls are NVTX ranges (marks.h); constant */
    /* stream_order:on and a backend that can: another stream's pending page may be shared, the
     * stream that takes it ordered after that work on the device (cuma_fence_order); constant */
    bool order;
    /* times backing a ghost's virtual page, or giving another stream bytes of a page with
     * ghosts, waited for the device */
    uint64_t remap_waits;
    uint64_t ordered;     /* early remaps of another stream's page (cuma_fence_order) */
} cuma_pages;

cuma_status cuma_pages_init(cuma_pages *pp, cuma_backend *be, cuma_streams *ss, uint64_t base,
                            uint64_t va_size);
/* Settings of the remap policy: remap_threshold, page_call_budget, and whether calls are timed
 * (not on a manual clock, whose replays must not depend on how fast this machine is). */
void cuma_pages_policy(cuma_pages *pp, double remap_threshold, double budget, bool timed);
/* Releases every page and unmaps everything (the caller frees the range). */
void cuma_pages_destroy(cuma_pages *pp);

/* References the pages under [off, off+len) (offsets from base), backing those that had no
 * live byte, for work on stream index `stream` (CUMA_PAGES_NO_STREAM: unknown, so no page with
 * pending work is shared). On failure nothing changed; CUMA_ERR_LIMIT or CUMA_ERR_OOM (device
 * full), or CUMA_ERR_BACKEND. */
#define CUMA_PAGES_NO_STREAM (-1)
cuma_status cuma_pages_ref(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, int stream);

/* Drops the references of [off, off+len); pages left without a live byte join the cache with
 * the given fence (joined with the page's own, or in place of it where that is covered). */
void cuma_pages_unref(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, uint16_t fstream,
                      uint64_t fseq);
/* The same for memory idle since `since` (<= now: a block that sat in a thread cache): its pages
 * age from then. */
void cuma_pages_unref_aged(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, uint64_t since,
                           uint16_t fstream, uint64_t fseq);

/* Gives back idle pages: those idle for at least delay_ns (delay_ns < 0: none by age) while more
 * than age_keep pages idle, then the oldest while more than max_cached pages idle. Pages whose
 * fence is not complete stay. Returns pages released. */
uint64_t cuma_pages_release(cuma_pages *pp, uint64_t now, int64_t delay_ns, uint64_t max_cached,
                            uint64_t age_keep, bool wait);

/* Unmaps the ghosts whose work completed, waiting for it with `wait` where the backend can (ref
 * and release do it first thing). */
void cuma_pages_reap(cuma_pages *pp, bool wait);

/* Creates `n` pinned pages into the cache (preallocation): never given back. */
cuma_status cuma_pages_prefill(cuma_pages *pp, uint64_t n, uint64_t now);

/* Oldest age of the idle memory (UINT64_MAX if none), to schedule the next release. */
uint64_t cuma_pages_oldest_idle(const cuma_pages *pp);

bool cuma_pages_validate(const cuma_pages *pp, const char **why);

#endif
