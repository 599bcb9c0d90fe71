// SPDX-License-Identifier: Apache-2.0
#include "tcache.h"
#include "heap.h"
#include "tcache_fast.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define TL_HEAPS 8

_Thread_local cuma_tl_slot cuma_tl_last __attribute__((tls_model("initial-exec")));

/* The calling thread's caches, one per heap it used (at most TL_HEAPS get one). */
static _Thread_local cuma_tl_slot tl[TL_HEAPS];
typedef cuma_tl_slot tl_slot;

/* Registry of live heaps: a thread that exits flushes its caches only into heaps that still
 * exist. Lock order: registry_lock, then a heap's lock. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t id;
    cuma_heap *heap;
} * registry;
static size_t nregistry, capregistry;
static uint64_t next_heap_id = 1;
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

uint64_t cuma_tcache_register_heap(cuma_heap *h) {
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    uint64_t id = next_heap_id++;
    if (nregistry == capregistry) {
        size_t nc = capregistry ? capregistry * 2 : 16;
        void *n = realloc(registry, nc * sizeof *registry);
        if (n) registry = n, capregistry = nc;
    }
    if (nregistry < capregistry) {
        registry[nregistry].id = id, registry[nregistry].heap = h;
        nregistry++;
    } else {
        id = 0; /* no registry entry: this heap gets no thread caches */
    }
    cuma_mutex_unlock(&registry_lock);
    return id;
}

void cuma_tcache_unregister_heap(cuma_heap *h) {
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    for (size_t i = 0; i < nregistry; i++)
        if (registry[i].heap == h && registry[i].id == h->id) {
            registry[i] = registry[--nregistry];
            break;
        }
    cuma_mutex_unlock(&registry_lock);
}

void cuma_tcache_prefork(void) {
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
}

void cuma_tcache_postfork(void) {
    cuma_mutex_unlock(&registry_lock);
}

static void flush_one(cuma_heap *h, cuma_tcache *tc, uint64_t older_than,
                      void (*give)(cuma_heap *, cuma_block *));

static void free_tc(cuma_tcache *tc) {
    free(tc->tab);
    free(tc);
}

static void unlink_tc(cuma_heap *h, cuma_tcache *tc) {
    for (cuma_tcache **p = &h->tcaches; *p; p = &(*p)->next)
        if (*p == tc) {
            *p = tc->next;
            return;
        }
}

/* A thread ends: its caches' blocks go back to their heaps, if those still live. */
static void on_thread_exit(void *unused) {
    (void)unused;
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    for (unsigned i = 0; i < TL_HEAPS; i++) {
        tl_slot *s = &tl[i];
        if (!s->tc) continue;
        for (size_t r = 0; r < nregistry; r++) {
            if (registry[r].id != s->heap_id || registry[r].heap != s->heap) continue;
            cuma_heap *h = s->heap;
            cuma_mutex_lock(&h->lock, CUMA_RANK_ARENA);
            flush_one(h, s->tc, UINT64_MAX, cuma_heap_give_cached);
            unlink_tc(h, s->tc);
            cuma_tcache_sums_retire(h, s->tc);
            cuma_mutex_unlock(&h->lock);
            free_tc(s->tc);
            break;
        }
        s->tc = NULL, s->heap = NULL;
    }
    cuma_tl_last.tc = NULL, cuma_tl_last.heap = NULL;
    cuma_mutex_unlock(&registry_lock);
}

static void make_key(void) {
    pthread_key_create(&exit_key, on_thread_exit);
}

cuma_tcache *cuma_tcache_get_slow(cuma_heap *h) {
    if (!h->tc_on || !h->id) return NULL;
    unsigned free_slot = TL_HEAPS;
    for (unsigned i = 0; i < TL_HEAPS; i++) {
        if (tl[i].heap == h && tl[i].heap_id == h->id && tl[i].tc) {
            cuma_tl_last = tl[i];
            return tl[i].tc;
        }
        /* A slot whose heap is gone (or was replaced at the same address) is free again; its
         * cache was freed with its heap. */
        if (free_slot == TL_HEAPS && (!tl[i].tc || tl[i].heap == h)) free_slot = i;
    }
    if (free_slot == TL_HEAPS) {
        /* Every slot names a heap: free those whose heap was destroyed since. */
        cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
        for (unsigned i = 0; i < TL_HEAPS && free_slot == TL_HEAPS; i++) {
            bool alive = false;
            for (size_t r = 0; r < nregistry && !alive; r++)
                alive = registry[r].id == tl[i].heap_id && registry[r].heap == tl[i].heap;
            if (!alive) free_slot = i;
        }
        cuma_mutex_unlock(&registry_lock);
        if (free_slot == TL_HEAPS) return NULL;
    }
    cuma_tcache *tc = calloc(1, sizeof *tc);
    if (!tc) return NULL;
    tc->heap = h, tc->heap_id = h->id;
    tc->primary = h->primary;
    tc->base = h->base, tc->max_block = h->tc_max, tc->max_bytes = h->tc_bytes;
    tc->page_shift = h->phys.refs ? h->phys.shift : 0;
    pthread_once(&exit_once, make_key);
    pthread_setspecific(exit_key, tc); /* any non-NULL value makes the destructor run */
    cuma_mutex_lock(&h->lock, CUMA_RANK_ARENA);
    tc->next = h->tcaches;
    h->tcaches = tc;
    /* The release thread ages caches only once one exists: one that sleeps past the first
     * block's age (a second, with nothing else due) would keep a large batched free mapped. */
    if (h->thread_running && h->tc_age_ns != INT64_MAX &&
        h->thread_wake_at >
            atomic_load_explicit(&h->coarse_now, memory_order_relaxed) + (uint64_t)h->tc_age_ns)
        pthread_cond_signal(&h->wake);
    cuma_mutex_unlock(&h->lock);
    tl[free_slot] = (tl_slot){h, h->id, tc};
    cuma_tl_last = tl[free_slot];
    return tc;
}

static bool tab_grow(cuma_tcache *tc) {
    uint32_t ncap = tc->tabcap ? tc->tabcap * 2 : 1024;
    if (ncap > (1u << 20)) return false;
    cuma_tc_entry *n = calloc(ncap, sizeof *n);
    if (!n) return false;
    for (uint32_t i = 0; i < tc->tabcap; i++) {
        if (!tc->tab[i].key) continue;
        cuma_tc_entry *d = &n[cuma_tc_key_slot(tc, tc->tab[i].key, ncap)];
        int w = 0;
        while (w < 4 && d[w].key) w++;
        if (w < 4)
            d[w] = tc->tab[i];
        else
            tc->tabn--; /* dropped: that block's free takes the slow path */
    }
    free(tc->tab);
    tc->tab = n, tc->tabcap = ncap;
    tc->tabgen++;
    return true;
}

void cuma_tcache_tab_put(cuma_tcache *tc, uint64_t key, cuma_block *b, uint64_t gen) {
    if (tc->tabn * 2 >= tc->tabcap && !tab_grow(tc) && !tc->tabcap) return;
    /* A full set is not rare at half load (five keys of a set of four: 5 % of insertions at
     * two per set on average), and each costs a slow free: the table doubles instead, once
     * per insertion, while it may. */
    for (int tries = 0; tries < 2; tries++) {
        cuma_tc_entry *e = &tc->tab[cuma_tc_key_slot(tc, key, tc->tabcap)], *slot = NULL;
        for (int w = 0; w < 4; w++) {
            if (e[w].key == key) {
                e[w] = (cuma_tc_entry){key, b, gen};
                return;
            }
            if (!e[w].key && !slot) slot = &e[w];
        }
        if (slot) {
            tc->tabn++;
            *slot = (cuma_tc_entry){key, b, gen};
            return;
        }
        if (tries || !tab_grow(tc)) return; /* every way taken: its free takes the slow path */
    }
}

void cuma_tcache_note_stream(cuma_tcache *tc, cuma_stream handle, unsigned index) {
    uint64_t g = atomic_load_explicit(&tc->heap->stream_gen, memory_order_relaxed);
    if (tc->stream_gen != g) tc->nstreams = 0, tc->stream_gen = g;
    if (cuma_tc_stream_index(tc, handle) >= 0 || tc->nstreams == CUMA_TC_STREAMS) return;
    tc->streams[tc->nstreams].handle = handle;
    tc->streams[tc->nstreams].index = (uint16_t)index;
    tc->nstreams++;
}

void cuma_tcache_note_alloc(cuma_tcache *tc, cuma_block *b, uint64_t addr) {
    cuma_tcache_tab_put(tc, addr, b, atomic_load_explicit(&b->gen, memory_order_relaxed));
}

void cuma_tcache_drain(cuma_heap *h, cuma_tcache *tc, void (*give)(cuma_heap *, cuma_block *)) {
    for (unsigned k = 0; k < tc->npending; k++) {
        cuma_block *b = atomic_exchange_explicit(&tc->pending[k], NULL, memory_order_acquire);
        if (b) give(h, b); /* NULL: a flusher took it already */
    }
    tc->npending = 0;
}

static void flush_one(cuma_heap *h, cuma_tcache *tc, uint64_t older_than,
                      void (*give)(cuma_heap *, cuma_block *)) {
    if (older_than == UINT64_MAX ||
        atomic_load_explicit(&tc->pending_stamp, memory_order_relaxed) < older_than) {
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++) {
            if (!atomic_load_explicit(&tc->pending[k], memory_order_relaxed)) continue;
            cuma_block *b = atomic_exchange_explicit(&tc->pending[k], NULL, memory_order_acquire);
            if (b) give(h, b);
        }
    }
    for (unsigned i = 0; i < CUMA_TC_BINS; i++) {
        cuma_tc_bin *bin = &tc->bins[i];
        if (older_than != UINT64_MAX &&
            atomic_load_explicit(&bin->stamp, memory_order_relaxed) >= older_than)
            continue;
        for (unsigned k = 0; k < CUMA_TC_DEPTH; k++) {
            if (!atomic_load_explicit(&bin->slot[k], memory_order_relaxed)) continue;
            cuma_block *b = atomic_exchange_explicit(&bin->slot[k], NULL, memory_order_acquire);
            if (b) give(h, b);
        }
    }
}

void cuma_tcache_flush_all(cuma_heap *h, uint64_t older_than,
                           void (*give)(cuma_heap *, cuma_block *)) {
    for (cuma_tcache *tc = h->tcaches; tc; tc = tc->next) flush_one(h, tc, older_than, give);
}

uint64_t cuma_tcache_oldest(cuma_heap *h) {
    uint64_t oldest = UINT64_MAX;
    for (cuma_tcache *tc = h->tcaches; tc; tc = tc->next) {
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++) {
            if (!atomic_load_explicit(&tc->pending[k], memory_order_relaxed)) continue;
            uint64_t st = atomic_load_explicit(&tc->pending_stamp, memory_order_relaxed);
            if (st < oldest) oldest = st;
            break;
        }
        for (unsigned i = 0; i < CUMA_TC_BINS; i++) {
            cuma_tc_bin *bin = &tc->bins[i];
            bool any = false;
            for (unsigned k = 0; k < CUMA_TC_DEPTH && !any; k++)
                any = atomic_load_explicit(&bin->slot[k], memory_order_relaxed) != NULL;
            uint64_t st = atomic_load_explicit(&bin->stamp, memory_order_relaxed);
            if (any && st < oldest) oldest = st;
        }
    }
    return oldest;
}

/* Pages that several blocks overlap, with how many of the cached blocks do: a page is the caches'
 * alone when they are all its blocks. Fixed-size, on the stack: past it a shared page counts as
 * in use (the figure errs towards in use). */
enum { SHARED_PAGES = 256 };
typedef struct shared_pages {
    uint32_t page[SHARED_PAGES], count[SHARED_PAGES];
    unsigned n;
} shared_pages;

static void note_shared(shared_pages *sp, uint32_t v) {
    for (unsigned i = 0; i < sp->n; i++)
        if (sp->page[i] == v) {
            sp->count[i]++;
            return;
        }
    if (sp->n < SHARED_PAGES) sp->page[sp->n] = v, sp->count[sp->n++] = 1;
}

/* One cached block: its bytes where the layer counts no blocks over its units (segments);
 * else the units (pages) it alone holds, and the shared ones noted. */
static uint64_t idle_of(cuma_heap *h, const cuma_block *b, shared_pages *sp) {
    const uint32_t *refs = h->phys.refs;
    if (!refs) return b->size;
    if (!b->mapped_len) return 0;
    uint64_t ps = 1ull << h->phys.shift, own = 0;
    uint64_t v0 = b->off / ps, v1 = (b->off + b->mapped_len - 1) / ps;
    for (uint64_t v = v0; v <= v1 && v < h->phys.nrefs; v++) {
        if (refs[v] == 1)
            own += ps;
        else if (refs[v] > 1)
            note_shared(sp, (uint32_t)v);
    }
    return own;
}

uint64_t cuma_tcache_idle_bytes(cuma_heap *h) {
    shared_pages sp;
    sp.n = 0;
    uint64_t bytes = 0;
    for (cuma_tcache *tc = h->tcaches; tc; tc = tc->next) {
        for (unsigned i = 0; i < CUMA_TC_BINS; i++)
            for (unsigned k = 0; k < CUMA_TC_DEPTH; k++) {
                cuma_block *b = atomic_load_explicit(&tc->bins[i].slot[k], memory_order_acquire);
                if (b) bytes += idle_of(h, b, &sp);
            }
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++) {
            cuma_block *b = atomic_load_explicit(&tc->pending[k], memory_order_acquire);
            if (b) bytes += idle_of(h, b, &sp);
        }
    }
    for (unsigned i = 0; i < sp.n; i++)
        if (sp.count[i] == h->phys.refs[sp.page[i]]) bytes += 1ull << h->phys.shift;
    return bytes;
}

void cuma_tcache_destroy_all(cuma_heap *h) {
    while (h->tcaches) {
        cuma_tcache *tc = h->tcaches;
        h->tcaches = tc->next;
        free_tc(tc);
    }
}

void cuma_tcache_sums(cuma_heap *h, int64_t *requested, int64_t *allocated, int64_t *active,
                      uint64_t *allocs, uint64_t *frees) {
    *requested = *allocated = *active = 0;
    *allocs = *frees = 0;
    for (cuma_tcache *tc = h->tcaches; tc; tc = tc->next) {
        *requested += atomic_load_explicit(&tc->requested, memory_order_relaxed);
        *allocated += atomic_load_explicit(&tc->allocated, memory_order_relaxed);
        /* A cache's own hand-outs minus its own takings back: its share of the live count. */
        *active += (int64_t)(atomic_load_explicit(&tc->allocs, memory_order_relaxed) -
                             atomic_load_explicit(&tc->frees, memory_order_relaxed));
        *allocs += atomic_load_explicit(&tc->allocs, memory_order_relaxed);
        *frees += atomic_load_explicit(&tc->frees, memory_order_relaxed);
    }
}

/* A cache leaves its heap (its thread ended): its counters move into the heap's. */
void cuma_tcache_sums_retire(cuma_heap *h, cuma_tcache *tc) {
    int64_t share = atomic_load_explicit(&tc->requested, memory_order_relaxed);
    h->c.requested += (uint64_t)share;
    atomic_store_explicit(&h->pub[CUMA_PUB_TREQ],
                          atomic_load_explicit(&h->pub[CUMA_PUB_TREQ], memory_order_relaxed) -
                              share,
                          memory_order_relaxed);
    h->c.allocated += (uint64_t)atomic_load_explicit(&tc->allocated, memory_order_relaxed);
    h->c.active += atomic_load_explicit(&tc->allocs, memory_order_relaxed) -
                   atomic_load_explicit(&tc->frees, memory_order_relaxed);
    h->c.allocs += atomic_load_explicit(&tc->allocs, memory_order_relaxed);
    h->c.frees += atomic_load_explicit(&tc->frees, memory_order_relaxed);
    cuma_heap_publish(h);
}
