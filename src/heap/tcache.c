// SPDX-License-Identifier: Apache-2.0
#include "heap/tcache.h"
#include "heap/heap.h"
#include "heap/tcache_fast.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define TL_HEAPS 8

_Thread_local cuma_tl_slot cuma_tl_last __attribute__((tls_model("initial-exec")));

/* The calling thread's caches, one per arena it used (at most TL_HEAPS get one). */
static _Thread_local cuma_tl_slot tl[TL_HEAPS];
typedef cuma_tl_slot tl_slot;

/* Registry of live arenas: a thread that exits flushes its caches only into arenas that still
 * exist. Lock order: registry_lock, then an arena's lock. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t id;
    cuma_arena *arena;
} * registry;
static size_t nregistry, capregistry;
static uint64_t next_arena_id = 1;
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

uint64_t cuma_tcache_register_arena(cuma_arena *a) {
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    uint64_t id = next_arena_id++;
    if (nregistry == capregistry) {
        size_t nc = capregistry ? capregistry * 2 : 16;
        void *n = realloc(registry, nc * sizeof *registry);
        if (n) registry = n, capregistry = nc;
    }
    if (nregistry < capregistry) {
        registry[nregistry].id = id, registry[nregistry].arena = a;
        nregistry++;
    } else {
        id = 0; /* no registry entry: this arena gets no thread caches */
    }
    cuma_mutex_unlock(&registry_lock);
    return id;
}

void cuma_tcache_unregister_arena(cuma_arena *a) {
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    for (size_t i = 0; i < nregistry; i++)
        if (registry[i].arena == a && registry[i].id == a->id) {
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

static void flush_one(cuma_arena *a, cuma_tcache *tc, uint64_t older_than, cuma_tc_give give);

static void free_tc(cuma_tcache *tc) {
    free(tc->tab);
    free(tc);
}

static void unlink_tc(cuma_arena *a, cuma_tcache *tc) {
    for (cuma_tcache **p = &a->tcaches; *p; p = &(*p)->next)
        if (*p == tc) {
            *p = tc->next;
            return;
        }
}

/* A thread ends: its caches' blocks go back to their arenas, if those still live. */
static void on_thread_exit(void *unused) {
    (void)unused;
    cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
    for (unsigned i = 0; i < TL_HEAPS; i++) {
        tl_slot *s = &tl[i];
        if (!s->tc) continue;
        for (size_t r = 0; r < nregistry; r++) {
            if (registry[r].id != s->arena_id || registry[r].arena != s->arena) continue;
            cuma_arena *a = s->arena;
            cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
            flush_one(a, s->tc, UINT64_MAX, cuma_arena_give_cached);
            unlink_tc(a, s->tc);
            cuma_tcache_sums_retire(a, s->tc);
            cuma_mutex_unlock(&a->lock);
            free_tc(s->tc);
            break;
        }
        s->tc = NULL, s->arena = NULL;
    }
    cuma_tl_last.tc = NULL, cuma_tl_last.arena = NULL;
    cuma_mutex_unlock(&registry_lock);
}

static void make_key(void) {
    pthread_key_create(&exit_key, on_thread_exit);
}

cuma_tcache *cuma_tcache_get_slow(cuma_arena *a) {
    if (!a->tc_on || !a->id) return NULL;
    unsigned free_slot = TL_HEAPS;
    for (unsigned i = 0; i < TL_HEAPS; i++) {
        if (tl[i].arena == a && tl[i].arena_id == a->id && tl[i].tc) {
            cuma_tl_last = tl[i];
            return tl[i].tc;
        }
        /* A slot whose arena is gone (or was replaced at the same address) is free again; its
         * cache was freed with its arena. */
        if (free_slot == TL_HEAPS && (!tl[i].tc || tl[i].arena == a)) free_slot = i;
    }
    if (free_slot == TL_HEAPS) {
        /* Every slot names an arena: free those whose arena was destroyed since. */
        cuma_mutex_lock(&registry_lock, CUMA_RANK_TCACHE_REG);
        for (unsigned i = 0; i < TL_HEAPS && free_slot == TL_HEAPS; i++) {
            bool alive = false;
            for (size_t r = 0; r < nregistry && !alive; r++)
                alive = registry[r].id == tl[i].arena_id && registry[r].arena == tl[i].arena;
            if (!alive) free_slot = i;
        }
        cuma_mutex_unlock(&registry_lock);
        if (free_slot == TL_HEAPS) return NULL;
    }
    cuma_tcache *tc = calloc(1, sizeof *tc);
    if (!tc) return NULL;
    tc->arena = a, tc->arena_id = a->id;
    tc->heap = a->heap;
    tc->base = a->base, tc->max_block = a->tc_max, tc->max_bytes = a->tc_bytes;
    tc->page_shift = a->phys.refs ? a->phys.shift : 0;
    pthread_once(&exit_once, make_key);
    pthread_setspecific(exit_key, tc); /* any non-NULL value makes the destructor run */
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    tc->next = a->tcaches;
    a->tcaches = tc;
    /* The release thread ages caches only once one exists: one that sleeps past the first
     * block's age (a second, with nothing else due) would keep a large batched free mapped. */
    if (a->thread_running && a->tc_age_ns != INT64_MAX &&
        a->thread_wake_at >
            atomic_load_explicit(&a->coarse_now, memory_order_relaxed) + (uint64_t)a->tc_age_ns)
        pthread_cond_signal(&a->wake);
    cuma_mutex_unlock(&a->lock);
    tl[free_slot] = (tl_slot){a, a->id, tc};
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
    uint64_t g = atomic_load_explicit(&tc->arena->stream_gen, memory_order_relaxed);
    if (tc->stream_gen != g) tc->nstreams = 0, tc->stream_gen = g;
    if (cuma_tc_stream_index(tc, handle) >= 0 || tc->nstreams == CUMA_TC_STREAMS) return;
    tc->streams[tc->nstreams].handle = handle;
    tc->streams[tc->nstreams].index = (uint16_t)index;
    tc->nstreams++;
}

void cuma_tcache_note_alloc(cuma_tcache *tc, cuma_block *b, uint64_t addr) {
    cuma_tcache_tab_put(tc, addr, b, atomic_load_explicit(&b->gen, memory_order_relaxed));
}

void cuma_tcache_drain(cuma_arena *a, cuma_tcache *tc, cuma_tc_give give) {
    for (unsigned k = 0; k < tc->npending; k++) {
        cuma_block *b = atomic_exchange_explicit(&tc->pending[k], NULL, memory_order_acquire);
        if (b) give(a, b, UINT64_MAX); /* NULL: a flusher took it already */
    }
    tc->npending = 0;
}

static void flush_one(cuma_arena *a, cuma_tcache *tc, uint64_t older_than, cuma_tc_give give) {
    if (older_than == UINT64_MAX ||
        atomic_load_explicit(&tc->pending_stamp, memory_order_relaxed) < older_than) {
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++) {
            if (!atomic_load_explicit(&tc->pending[k], memory_order_relaxed)) continue;
            cuma_block *b = atomic_exchange_explicit(&tc->pending[k], NULL, memory_order_acquire);
            if (b) give(a, b, UINT64_MAX); /* frees: they wait for no reuse */
        }
    }
    for (unsigned i = 0; i < CUMA_TC_BINS; i++) {
        cuma_tc_bin *bin = &tc->bins[i];
        /* The bin's last push: its blocks have been idle since then at least. */
        uint64_t st = atomic_load_explicit(&bin->stamp, memory_order_relaxed);
        if (older_than != UINT64_MAX && st >= older_than) continue;
        for (unsigned k = 0; k < CUMA_TC_DEPTH; k++) {
            if (!atomic_load_explicit(&bin->slot[k], memory_order_relaxed)) continue;
            cuma_block *b = atomic_exchange_explicit(&bin->slot[k], NULL, memory_order_acquire);
            if (b) give(a, b, st);
        }
    }
}

void cuma_tcache_flush_all(cuma_arena *a, uint64_t older_than, cuma_tc_give give) {
    for (cuma_tcache *tc = a->tcaches; tc; tc = tc->next) flush_one(a, tc, older_than, give);
}

uint64_t cuma_tcache_oldest(cuma_arena *a) {
    uint64_t oldest = UINT64_MAX;
    for (cuma_tcache *tc = a->tcaches; tc; tc = tc->next) {
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
static uint64_t idle_of(cuma_arena *a, const cuma_block *b, shared_pages *sp) {
    const uint32_t *refs = a->phys.refs;
    if (!refs) return b->size;
    if (!b->mapped_len) return 0;
    uint64_t ps = 1ull << a->phys.shift, own = 0;
    uint64_t v0 = b->off / ps, v1 = (b->off + b->mapped_len - 1) / ps;
    for (uint64_t v = v0; v <= v1 && v < a->phys.nrefs; v++) {
        if (refs[v] == 1)
            own += ps;
        else if (refs[v] > 1)
            note_shared(sp, (uint32_t)v);
    }
    return own;
}

uint64_t cuma_tcache_idle_bytes(cuma_arena *a) {
    shared_pages sp;
    sp.n = 0;
    uint64_t bytes = 0;
    for (cuma_tcache *tc = a->tcaches; tc; tc = tc->next) {
        for (unsigned i = 0; i < CUMA_TC_BINS; i++)
            for (unsigned k = 0; k < CUMA_TC_DEPTH; k++) {
                cuma_block *b = atomic_load_explicit(&tc->bins[i].slot[k], memory_order_acquire);
                if (b) bytes += idle_of(a, b, &sp);
            }
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++) {
            cuma_block *b = atomic_load_explicit(&tc->pending[k], memory_order_acquire);
            if (b) bytes += idle_of(a, b, &sp);
        }
    }
    for (unsigned i = 0; i < sp.n; i++)
        if (sp.count[i] == a->phys.refs[sp.page[i]]) bytes += 1ull << a->phys.shift;
    return bytes;
}

void cuma_tcache_destroy_all(cuma_arena *a) {
    while (a->tcaches) {
        cuma_tcache *tc = a->tcaches;
        a->tcaches = tc->next;
        free_tc(tc);
    }
}

void cuma_tcache_sums(cuma_arena *a, int64_t *requested, int64_t *allocated, int64_t *active,
                      uint64_t *allocs, uint64_t *frees) {
    *requested = *allocated = *active = 0;
    *allocs = *frees = 0;
    for (cuma_tcache *tc = a->tcaches; tc; tc = tc->next) {
        *requested += atomic_load_explicit(&tc->requested, memory_order_relaxed);
        *allocated += atomic_load_explicit(&tc->allocated, memory_order_relaxed);
        /* A cache's own hand-outs minus its own takings back: its share of the live count. */
        *active += (int64_t)(atomic_load_explicit(&tc->allocs, memory_order_relaxed) -
                             atomic_load_explicit(&tc->frees, memory_order_relaxed));
        *allocs += atomic_load_explicit(&tc->allocs, memory_order_relaxed);
        *frees += atomic_load_explicit(&tc->frees, memory_order_relaxed);
    }
}

/* A cache leaves its arena (its thread ended): its counters move into the arena's. */
void cuma_tcache_sums_retire(cuma_arena *a, cuma_tcache *tc) {
    int64_t share = atomic_load_explicit(&tc->requested, memory_order_relaxed);
    a->c.requested += (uint64_t)share;
    atomic_store_explicit(&a->pub[CUMA_PUB_TREQ],
                          atomic_load_explicit(&a->pub[CUMA_PUB_TREQ], memory_order_relaxed) -
                              share,
                          memory_order_relaxed);
    a->c.allocated += (uint64_t)atomic_load_explicit(&tc->allocated, memory_order_relaxed);
    a->c.active += atomic_load_explicit(&tc->allocs, memory_order_relaxed) -
                   atomic_load_explicit(&tc->frees, memory_order_relaxed);
    a->c.allocs += atomic_load_explicit(&tc->allocs, memory_order_relaxed);
    a->c.frees += atomic_load_explicit(&tc->frees, memory_order_relaxed);
    cuma_arena_publish(a);
}
