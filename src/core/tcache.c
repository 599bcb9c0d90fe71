#include "tcache.h"
#include "heap.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define TL_HEAPS 8

_Thread_local cuma_tl_slot cuma_tl_last;

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
    pthread_mutex_lock(&registry_lock);
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
    pthread_mutex_unlock(&registry_lock);
    return id;
}

void cuma_tcache_unregister_heap(cuma_heap *h) {
    pthread_mutex_lock(&registry_lock);
    for (size_t i = 0; i < nregistry; i++)
        if (registry[i].heap == h && registry[i].id == h->id) {
            registry[i] = registry[--nregistry];
            break;
        }
    pthread_mutex_unlock(&registry_lock);
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
    pthread_mutex_lock(&registry_lock);
    for (unsigned i = 0; i < TL_HEAPS; i++) {
        tl_slot *s = &tl[i];
        if (!s->tc) continue;
        for (size_t r = 0; r < nregistry; r++) {
            if (registry[r].id != s->heap_id || registry[r].heap != s->heap) continue;
            cuma_heap *h = s->heap;
            pthread_mutex_lock(&h->lock);
            flush_one(h, s->tc, UINT64_MAX, cuma_heap_give_cached);
            unlink_tc(h, s->tc);
            cuma_tcache_sums_retire(h, s->tc);
            pthread_mutex_unlock(&h->lock);
            free_tc(s->tc);
            break;
        }
        s->tc = NULL, s->heap = NULL;
    }
    cuma_tl_last.tc = NULL, cuma_tl_last.heap = NULL;
    pthread_mutex_unlock(&registry_lock);
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
        pthread_mutex_lock(&registry_lock);
        for (unsigned i = 0; i < TL_HEAPS && free_slot == TL_HEAPS; i++) {
            bool alive = false;
            for (size_t r = 0; r < nregistry && !alive; r++)
                alive = registry[r].id == tl[i].heap_id && registry[r].heap == tl[i].heap;
            if (!alive) free_slot = i;
        }
        pthread_mutex_unlock(&registry_lock);
        if (free_slot == TL_HEAPS) return NULL;
    }
    cuma_tcache *tc = calloc(1, sizeof *tc);
    if (!tc) return NULL;
    tc->heap = h, tc->heap_id = h->id;
    pthread_once(&exit_once, make_key);
    pthread_setspecific(exit_key, tc); /* any non-NULL value makes the destructor run */
    pthread_mutex_lock(&h->lock);
    tc->next = h->tcaches;
    h->tcaches = tc;
    pthread_mutex_unlock(&h->lock);
    tl[free_slot] = (tl_slot){h, h->id, tc};
    cuma_tl_last = tl[free_slot];
    return tc;
}

static unsigned bin_of(uint64_t n, unsigned stream) {
    return (unsigned)(((n >> 9) * 0x9E3779B97F4A7C15ull + stream * 0xC2B2AE3D27D4EB4Full) >> 57) &
           (CUMA_TC_BINS - 1);
}

/* The owner's pointer table: 4-way set-associative by address, no probing and no shifting. An
 * entry that finds every way taken is not recorded and its free takes the slow path, which is
 * always correct (the heap's own table knows every block). */
/* Hashed by offset from the heap's base, so that which blocks collide (and so which frees take
 * the slow path) does not depend on where the heap's range happens to lie: replays repeat. */
static uint32_t key_slot(const cuma_tcache *tc, uint64_t key, uint32_t cap) {
    uint64_t x = ((key - tc->heap->base) >> 9) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)((x ^ (x >> 29)) >> 20) & (cap - 4);
}

static cuma_tc_entry *tab_find(cuma_tcache *tc, uint64_t key) {
    if (!tc->tabcap) return NULL;
    cuma_tc_entry *e = &tc->tab[key_slot(tc, key, tc->tabcap)];
    for (int w = 0; w < 4; w++)
        if (e[w].key == key) return &e[w];
    return NULL;
}

static void tab_remove(cuma_tcache *tc, cuma_tc_entry *e) {
    e->key = 0;
    tc->tabn--;
}

static bool tab_grow(cuma_tcache *tc) {
    uint32_t ncap = tc->tabcap ? tc->tabcap * 2 : 1024;
    if (ncap > (1u << 20)) return false;
    cuma_tc_entry *n = calloc(ncap, sizeof *n);
    if (!n) return false;
    for (uint32_t i = 0; i < tc->tabcap; i++) {
        if (!tc->tab[i].key) continue;
        cuma_tc_entry *d = &n[key_slot(tc, tc->tab[i].key, ncap)];
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

static void tab_put(cuma_tcache *tc, uint64_t key, cuma_block *b, uint64_t gen) {
    if (tc->tabn * 2 >= tc->tabcap && !tab_grow(tc) && !tc->tabcap) return;
    cuma_tc_entry *e = &tc->tab[key_slot(tc, key, tc->tabcap)], *slot = NULL;
    for (int w = 0; w < 4; w++) {
        if (e[w].key == key) {
            e[w] = (cuma_tc_entry){key, b, gen};
            return;
        }
        if (!e[w].key && !slot) slot = &e[w];
    }
    if (!slot) return; /* every way taken: its free takes the slow path */
    tc->tabn++;
    *slot = (cuma_tc_entry){key, b, gen};
}

static int stream_index(const cuma_tcache *tc, cuma_stream s) {
    for (unsigned i = 0; i < tc->nstreams; i++)
        if (tc->streams[i].handle == s) return tc->streams[i].index;
    return -1;
}

void cuma_tcache_note_stream(cuma_tcache *tc, cuma_stream handle, unsigned index) {
    if (stream_index(tc, handle) >= 0 || tc->nstreams == CUMA_TC_STREAMS) return;
    tc->streams[tc->nstreams].handle = handle;
    tc->streams[tc->nstreams].index = (uint16_t)index;
    tc->nstreams++;
}

void cuma_tcache_note_alloc(cuma_tcache *tc, cuma_block *b, uint64_t addr) {
    tab_put(tc, addr, b, atomic_load_explicit(&b->gen, memory_order_relaxed));
}

/* Counters are the owner's: a load and a store, no read-modify-write. */
#define BUMP(field, d)                                                                             \
    atomic_store_explicit(&tc->field,                                                              \
                          atomic_load_explicit(&tc->field, memory_order_relaxed) + (d),            \
                          memory_order_relaxed)

static void note_peaks(cuma_tcache *tc) {
    cuma_heap *h = tc->heap->primary;
    int64_t req = atomic_load_explicit(&h->req_global, memory_order_relaxed) +
                  atomic_load_explicit(&tc->requested, memory_order_relaxed);
    uint64_t peak = atomic_load_explicit(&h->peak_req, memory_order_relaxed);
    while (req > 0 && (uint64_t)req > peak &&
           !atomic_compare_exchange_weak_explicit(&h->peak_req, &peak, (uint64_t)req,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

bool cuma_tcache_alloc(cuma_tcache *tc, uint64_t size, uint64_t n, cuma_stream stream, void **ptr) {
    int si = stream_index(tc, stream);
    if (si < 0) return false;
    cuma_tc_bin *bin = &tc->bins[bin_of(n, (unsigned)si)];
    if (bin->size != n || bin->stream != si || !bin->n) return false;
    cuma_block *b = NULL;
    while (bin->n && !b) {
        b = atomic_exchange_explicit(&bin->slot[--bin->n], NULL, memory_order_acquire);
        tc->held -= n; /* popped, or taken by a flush */
    }
    if (!b) return false;
    cuma_heap *h = tc->heap;
    if (h->vmm && ((b->off + size - 1) >> h->pages.shift) !=
                      ((b->off + b->mapped_len - 1) >> h->pages.shift)) {
        /* The request ends on another page than the block's mapped bytes: the slow path must
         * change page references. Put it back. */
        atomic_store_explicit(&bin->slot[bin->n++], b, memory_order_release);
        tc->held += n;
        return false;
    }
    b->req = size;
    b->stream = (uint16_t)si;
    uint64_t g = atomic_load_explicit(&b->gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&b->gen, g, memory_order_release);
    uint64_t addr = h->base + b->off;
    /* The slot its last free emptied is in the right set for this address: take it again
     * unless the table was rebuilt since or someone else took it. */
    cuma_tc_entry *e = tc->tab + b->tc_slot;
    if (b->tc_tabgen == tc->tabgen && b->tc_slot < tc->tabcap && !e->key) {
        *e = (cuma_tc_entry){addr, b, g};
        tc->tabn++;
    } else {
        tab_put(tc, addr, b, g);
    }
    BUMP(requested, (int64_t)size);
    BUMP(allocated, (int64_t)n);
    BUMP(allocs, 1);
    note_peaks(tc);
    *ptr = (void *)(uintptr_t)addr;
    return true;
}

cuma_tc_result cuma_tcache_free(cuma_tcache *tc, uint64_t addr, cuma_stream stream) {
    cuma_tc_entry *e = tab_find(tc, addr);
    if (!e) return CUMA_TC_MISS;
    cuma_block *b = e->b;
    uint64_t g = e->gen;
    if (atomic_load_explicit(&b->gen, memory_order_acquire) != g) {
        tab_remove(tc, e); /* freed by another thread meanwhile: the slow path sorts it out */
        return CUMA_TC_MISS;
    }
    if (b->extra[0] != CUMA_NO_STREAM || b->extra_all) return CUMA_TC_MISS; /* deferred */
    int si = stream ? stream_index(tc, stream) : b->stream;
    if (si < 0) return CUMA_TC_MISS;
    cuma_heap *h = tc->heap;
    uint64_t n = b->size;
    cuma_tc_bin *bin = &tc->bins[bin_of(n, (unsigned)si)];
    bool to_bin = n <= h->tc_max && tc->held + n <= h->tc_bytes && bin->n < CUMA_TC_DEPTH &&
                  (!bin->n || (bin->size == n && bin->stream == si));
    if (!atomic_compare_exchange_strong_explicit(&b->gen, &g, g + 1, memory_order_acq_rel,
                                                 memory_order_relaxed)) {
        tab_remove(tc, e);
        return CUMA_TC_MISS;
    }
    BUMP(requested, -(int64_t)b->req);
    BUMP(allocated, -(int64_t)n);
    BUMP(frees, 1);
    b->tc_slot = (uint32_t)(e - tc->tab), b->tc_tabgen = tc->tabgen;
    tab_remove(tc, e);
    b->stream = (uint16_t)si; /* the stream it was last used on: its fence when flushed */
    uint64_t now = atomic_load_explicit(&h->coarse_now, memory_order_relaxed);
    if (!to_bin) {
        if (!tc->npending) atomic_store_explicit(&tc->pending_stamp, now, memory_order_relaxed);
        atomic_store_explicit(&tc->pending[tc->npending++], b, memory_order_release);
        return tc->npending == CUMA_TC_PENDING ? CUMA_TC_DRAIN : CUMA_TC_DONE;
    }
    if (!bin->n) bin->size = n, bin->stream = (uint16_t)si;
    atomic_store_explicit(&bin->stamp, now, memory_order_relaxed);
    atomic_store_explicit(&bin->slot[bin->n++], b, memory_order_release);
    tc->held += n;
    return CUMA_TC_DONE;
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
    h->c.requested += (uint64_t)atomic_load_explicit(&tc->requested, memory_order_relaxed);
    h->c.allocated += (uint64_t)atomic_load_explicit(&tc->allocated, memory_order_relaxed);
    h->c.active += atomic_load_explicit(&tc->allocs, memory_order_relaxed) -
                   atomic_load_explicit(&tc->frees, memory_order_relaxed);
    h->c.allocs += atomic_load_explicit(&tc->allocs, memory_order_relaxed);
    h->c.frees += atomic_load_explicit(&tc->frees, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->primary->req_global,
                              atomic_load_explicit(&tc->requested, memory_order_relaxed),
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&h->primary->alloc_global,
                              atomic_load_explicit(&tc->allocated, memory_order_relaxed),
                              memory_order_relaxed);
}
