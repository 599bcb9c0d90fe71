// SPDX-License-Identifier: Apache-2.0
/*
 * fakecuda_mem.c - memory side of the fake CUDA driver: physical memory
 * (one sparse memfd per device), cuMemCreate handles, address reservations,
 * mappings, cuMemAlloc / cuMemAllocManaged, memset / memcpy, cuMemGetInfo.
 * See fakecuda.c for the model.
 */
#include "fakecuda_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define RESERVE_FLAGS (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

struct fc_extent { /* free range of a device's memfd */
    uint64_t off, len;
};

struct fc_resv { /* cuMemAddressReserve range */
    uint64_t base, size;
    long nmaps;
};

struct fc_map { /* cuMemMap mapping */
    uint64_t addr, size;
    uint32_t slot;
    int dev;
};

struct fc_block { /* cuMemAlloc / cuMemAllocManaged allocation */
    uint64_t addr, size, off;
    int dev;
    int managed;
};

struct fc_slot { /* cuMemCreate handle */
    uint64_t off, size;
    uint32_t gen, next_free;
    int in_use, released, dev;
    int rdma; /* created gpuDirectRDMACapable */
    long maps;
};

static struct fc_vec g_resv = {NULL, 0, 0, sizeof(struct fc_resv)};
static struct fc_vec g_maps = {NULL, 0, 0, sizeof(struct fc_map)};
static struct fc_vec g_blocks = {NULL, 0, 0, sizeof(struct fc_block)};

/* The address of the block or reservation freed last: the next one placed without a hint goes
 * there when it fits, as the real driver reuses a freed address at once. Code that keys anything
 * on device addresses must then cope with one address meaning two allocations in quick
 * succession. 0: none. Guarded by fc_mu. */
static uint64_t g_last_freed_va;

/* fakecuda_set_free_hook's function and argument. Guarded by fc_mu; called without it. */
static void (*g_free_hook)(unsigned long long, unsigned long long, void *);
static void *g_free_hook_arg;

void fakecuda_set_free_hook(void (*fn)(unsigned long long addr, unsigned long long size, void *arg),
                            void *arg) {
    fc_lock();
    g_free_hook = fn;
    g_free_hook_arg = arg;
    fc_unlock();
}

/* Runs the free hook for a range just freed; fc_mu held on entry, released on return. */
static void free_hook_unlock(uint64_t addr, uint64_t size) {
    void (*fn)(unsigned long long, unsigned long long, void *) = g_free_hook;
    void *arg = g_free_hook_arg;
    fc_unlock();
    if (fn) fn(addr, size, arg);
}
static struct fc_slot *g_slots;
static uint32_t g_nslots, g_capslots, g_free_head = UINT32_MAX;

/* ---- sorted vector -------------------------------------------------------- */

void fc_vec_init(struct fc_vec *v, size_t esz) {
    v->data = NULL;
    v->n = v->cap = 0;
    v->esz = esz;
}

void *fc_vec_at(const struct fc_vec *v, size_t i) {
    return v->data + i * v->esz;
}

static uint64_t vec_key(const struct fc_vec *v, size_t i) {
    uint64_t k;
    memcpy(&k, fc_vec_at(v, i), sizeof k);
    return k;
}

size_t fc_vec_lower(const struct fc_vec *v, uint64_t key) {
    size_t lo = 0, hi = v->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (vec_key(v, mid) < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int fc_vec_insert(struct fc_vec *v, size_t i, const void *elem) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        unsigned char *d = realloc(v->data, cap * v->esz);
        if (!d) return -1;
        v->data = d;
        v->cap = cap;
    }
    memmove(v->data + (i + 1) * v->esz, v->data + i * v->esz, (v->n - i) * v->esz);
    memcpy(v->data + i * v->esz, elem, v->esz);
    v->n++;
    return 0;
}

void fc_vec_erase(struct fc_vec *v, size_t i, size_t count) {
    memmove(v->data + i * v->esz, v->data + (i + count) * v->esz, (v->n - i - count) * v->esz);
    v->n -= count;
}

/* Index of the last element whose key is <= key, or SIZE_MAX. */
static size_t vec_floor(const struct fc_vec *v, uint64_t key) {
    size_t i = key == UINT64_MAX ? v->n : fc_vec_lower(v, key + 1);
    return i ? i - 1 : SIZE_MAX;
}

/* ---- helpers --------------------------------------------------------------- */

static int aligned(uint64_t x) {
    return (x & (fc_cfg.gran - 1)) == 0;
}
static int valid_dev(int dev) {
    return dev >= 0 && dev < fc_cfg.ndev;
}
static int charge_ok(const struct fc_device *d, uint64_t size) {
    uint64_t taken = d->used + fc_ctx_charge(d);
    return taken <= fc_cfg.capacity && size <= fc_cfg.capacity - taken;
}

int fc_mem_init_device(struct fc_device *d) {
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0) return -1;
    uint64_t cap = fc_cfg.capacity;
    const uint64_t limit = (uint64_t)INT64_MAX;
    uint64_t sizes[3] = {cap <= limit / 16 ? cap * 16 : cap, cap <= limit / 2 ? cap * 2 : cap, cap};
    uint64_t size = 0;
    for (int i = 0; i < 3 && !size; i++)
        if (sizes[i] <= limit && ftruncate(fd, (off_t)sizes[i]) == 0) size = sizes[i];
    if (!size) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    d->memfd = fd;
    d->file_size = size;
    d->used = 0;
    fc_vec_init(&d->free_ext, sizeof(struct fc_extent));
    struct fc_extent all = {0, size};
    if (fc_vec_insert(&d->free_ext, 0, &all) != 0) {
        close(fd);
        errno = ENOMEM;
        return -1;
    }
    return 0;
}

/* First fit over the device's free extents. */
static int phys_alloc(struct fc_device *d, uint64_t size, uint64_t *off) {
    for (size_t i = 0; i < d->free_ext.n; i++) {
        struct fc_extent *e = fc_vec_at(&d->free_ext, i);
        if (e->len < size) continue;
        *off = e->off;
        e->off += size;
        e->len -= size;
        if (e->len == 0) fc_vec_erase(&d->free_ext, i, 1);
        return 0;
    }
    return -1;
}

static void phys_free(struct fc_device *d, uint64_t off, uint64_t size) {
    if (fallocate(d->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)size))
        fc_die("fallocate(PUNCH_HOLE) failed: %s", strerror(errno));
    struct fc_vec *v = &d->free_ext;
    size_t i = fc_vec_lower(v, off);
    struct fc_extent *prev = i > 0 ? fc_vec_at(v, i - 1) : NULL;
    struct fc_extent *next = i < v->n ? fc_vec_at(v, i) : NULL;
    int join_prev = prev && prev->off + prev->len == off;
    int join_next = next && off + size == next->off;
    if (join_prev && join_next) {
        prev->len += size + next->len;
        fc_vec_erase(v, i, 1);
    } else if (join_prev) {
        prev->len += size;
    } else if (join_next) {
        next->off = off;
        next->len += size;
    } else {
        struct fc_extent e = {off, size};
        if (fc_vec_insert(v, i, &e) != 0) fc_die("out of host memory tracking free extents");
    }
}

/* Reserve `size` bytes of PROT_NONE address space aligned to `align`. */
static void *va_reserve(uint64_t size, uint64_t align, uint64_t hint) {
    if (!hint) hint = g_last_freed_va;
    if (hint && hint % align == 0) {
        void *p = mmap((void *)(uintptr_t)hint, size, PROT_NONE,
                       RESERVE_FLAGS | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == (void *)(uintptr_t)hint) return p;
        if (p != MAP_FAILED) munmap(p, size);
    }
    if (size > UINT64_MAX - align) return NULL;
    uint64_t total = size + align;
    void *p = mmap(NULL, total, PROT_NONE, RESERVE_FLAGS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uint64_t base = (uint64_t)(uintptr_t)p;
    uint64_t a = (base + align - 1) & ~(align - 1);
    if (a > base) munmap(p, a - base);
    uint64_t tail = base + total - (a + size);
    if (tail) munmap((void *)(uintptr_t)(a + size), tail);
    return (void *)(uintptr_t)a;
}

/* Turn [addr, addr+size) back into inaccessible reserved address space. */
static void va_to_reserved(uint64_t addr, uint64_t size) {
    void *p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, RESERVE_FLAGS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED)
        fc_die("cannot restore reservation at %#llx: %s", (unsigned long long)addr,
               strerror(errno));
}

static struct fc_slot *slot_lookup(CUmemGenericAllocationHandle h) {
    uint64_t lo = h & 0xffffffffu;
    if (lo == 0 || lo > g_nslots) return NULL;
    struct fc_slot *s = &g_slots[lo - 1];
    if (!s->in_use || s->gen != (uint32_t)(h >> 32)) return NULL;
    return s;
}

static int slot_new(uint32_t *idx) {
    if (g_free_head != UINT32_MAX) {
        *idx = g_free_head;
        g_free_head = g_slots[*idx].next_free;
        return 0;
    }
    if (g_nslots == g_capslots) {
        uint32_t cap = g_capslots ? g_capslots * 2 : 64;
        if (cap >= UINT32_MAX / 2) return -1;
        struct fc_slot *s = realloc(g_slots, cap * sizeof *s);
        if (!s) return -1;
        g_slots = s;
        g_capslots = cap;
    }
    *idx = g_nslots++;
    g_slots[*idx].gen = 1;
    return 0;
}

/* Free a handle's physical memory and its slot (released and unmapped). */
static void slot_destroy(uint32_t idx) {
    struct fc_slot *s = &g_slots[idx];
    phys_free(&fc_dev[s->dev], s->off, s->size);
    fc_dev[s->dev].used -= s->size;
    s->in_use = 0;
    s->gen = s->gen + 1 ? s->gen + 1 : 1;
    s->next_free = g_free_head;
    g_free_head = idx;
}

/* The reservation containing [p, p+size), or NULL. */
static struct fc_resv *resv_containing(uint64_t p, uint64_t size) {
    size_t i = vec_floor(&g_resv, p);
    if (i == SIZE_MAX) return NULL;
    struct fc_resv *r = fc_vec_at(&g_resv, i);
    return p - r->base < r->size && size <= r->size - (p - r->base) ? r : NULL;
}

/* If [p, p+size) is covered by back-to-back mappings, set [*first, *last)
 * to their indices and return 0; else -1. */
static int map_cover(uint64_t p, uint64_t size, size_t *first, size_t *last) {
    size_t i = vec_floor(&g_maps, p);
    if (i == SIZE_MAX) return -1;
    const struct fc_map *m = fc_vec_at(&g_maps, i);
    if (p - m->addr >= m->size) return -1;
    uint64_t cur = m->addr + m->size, end = p + size;
    size_t j = i + 1;
    while (cur < end) {
        if (j >= g_maps.n) return -1;
        m = fc_vec_at(&g_maps, j);
        if (m->addr != cur) return -1;
        cur += m->size;
        j++;
    }
    *first = i;
    *last = j;
    return 0;
}

/* Is [p, p+n) inside one cuMemAlloc/managed block or fully mapped? */
static int range_known(uint64_t p, uint64_t n) {
    if (p == 0 || p > UINT64_MAX - n) return 0;
    size_t i = vec_floor(&g_blocks, p);
    if (i != SIZE_MAX) {
        const struct fc_block *b = fc_vec_at(&g_blocks, i);
        if (p - b->addr < b->size && n <= b->size - (p - b->addr)) return 1;
    }
    size_t f, l;
    return map_cover(p, n, &f, &l) == 0;
}

static int check_prop(const CUmemAllocationProp *prop, CUresult *rc) {
    static const unsigned char zero[sizeof prop->allocFlags.reserved] = {0};
    /* Handle types this Linux fake can export: none, or a POSIX file descriptor. Allocation
     * flags: no compression, RDMA only where the device reports it, no usage bits, reserved
     * bytes zero; no Windows metadata. Anything else is refused, as a strict driver would. */
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        (prop->requestedHandleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ||
        prop->win32HandleMetaData || prop->allocFlags.compressionType ||
        prop->allocFlags.gpuDirectRDMACapable > 1 ||
        (prop->allocFlags.gpuDirectRDMACapable && fc_cfg.no_rdma) || prop->allocFlags.usage ||
        memcmp(prop->allocFlags.reserved, zero, sizeof zero)) {
        *rc = CUDA_ERROR_INVALID_VALUE;
        return -1;
    }
    if (!valid_dev(prop->location.id)) {
        *rc = CUDA_ERROR_INVALID_DEVICE;
        return -1;
    }
    return 0;
}

/* ---- virtual memory management ------------------------------------------- */

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
    FC_ENTER(MemGetAllocationGranularity);
    if (fc_cfg.no_vmm) return CUDA_ERROR_NOT_SUPPORTED;
    if (!granularity || !prop ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    if (check_prop(prop, &rc) != 0) return rc;
    *granularity =
        (size_t)(option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED ? fc_cfg.rec_gran : fc_cfg.gran);
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    FC_ENTER(MemAddressReserve);
    if (!ptr || size == 0 || !aligned(size) || (alignment & (alignment - 1)) || flags)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t align = alignment > fc_cfg.gran ? alignment : fc_cfg.gran;
    fc_lock();
    void *p = va_reserve(size, align, addr);
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (p) {
        struct fc_resv r = {(uint64_t)(uintptr_t)p, size, 0};
        if (fc_vec_insert(&g_resv, fc_vec_lower(&g_resv, r.base), &r) == 0) {
            fc_live_n.reservations++;
            *ptr = (CUdeviceptr)r.base;
            rc = CUDA_SUCCESS;
        } else {
            munmap(p, size);
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    FC_ENTER(MemAddressFree);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    size_t i = fc_vec_lower(&g_resv, ptr);
    if (i < g_resv.n) {
        struct fc_resv *r = fc_vec_at(&g_resv, i);
        if (r->base == ptr && r->size == size && r->nmaps == 0) {
            munmap((void *)(uintptr_t)ptr, size);
            fc_vec_erase(&g_resv, i, 1);
            fc_live_n.reservations--;
            g_last_freed_va = ptr;
            rc = CUDA_SUCCESS;
        }
    }
    if (rc != CUDA_SUCCESS) {
        fc_unlock();
        return rc;
    }
    free_hook_unlock(ptr, size);
    return rc;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    FC_ENTER(MemCreate);
    fc_vmm_call("cuMemCreate", 0);
    if (fc_cfg.no_vmm) return CUDA_ERROR_NOT_SUPPORTED;
    if (!handle || !prop || size == 0 || !aligned(size) || flags) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    if (check_prop(prop, &rc) != 0) return rc;
    struct fc_device *d = &fc_dev[prop->location.id];
    uint64_t off;
    uint32_t idx;
    fc_lock();
    if (!charge_ok(d, size) || phys_alloc(d, size, &off) != 0) {
        fc_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (slot_new(&idx) != 0) {
        phys_free(d, off, size);
        fc_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fc_slot *s = &g_slots[idx];
    s->off = off;
    s->size = size;
    s->in_use = 1;
    s->released = 0;
    s->dev = prop->location.id;
    s->maps = 0;
    s->rdma = prop->allocFlags.gpuDirectRDMACapable;
    d->used += size;
    fc_live_n.handles++;
    fc_live_n.rdma_handles += s->rdma;
    *handle = ((uint64_t)s->gen << 32) | (idx + 1);
    fc_unlock();
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    FC_ENTER(MemRelease);
    fc_vmm_call("cuMemRelease", 0);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    struct fc_slot *s = slot_lookup(handle);
    if (s && !s->released) {
        s->released = 1;
        fc_live_n.handles--;
        fc_live_n.rdma_handles -= s->rdma;
        if (s->maps == 0) slot_destroy((uint32_t)(s - g_slots));
        rc = CUDA_SUCCESS;
    }
    fc_unlock();
    return rc;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    FC_ENTER(MemMap);
    fc_vmm_call("cuMemMap", 0);
    if (flags || ptr == 0 || size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) ||
        ptr > UINT64_MAX - size)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    struct fc_slot *s = slot_lookup(handle);
    struct fc_resv *r = resv_containing(ptr, size);
    if (!s || s->released || offset > s->size || size > s->size - offset || !r) goto out;
    size_t i = fc_vec_lower(&g_maps, ptr);
    if (i > 0) {
        const struct fc_map *prev = fc_vec_at(&g_maps, i - 1);
        if (prev->addr + prev->size > ptr) goto out;
    }
    if (i < g_maps.n && ((const struct fc_map *)fc_vec_at(&g_maps, i))->addr < ptr + size) goto out;
    rc = CUDA_ERROR_OUT_OF_MEMORY;
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   fc_dev[s->dev].memfd, (off_t)(s->off + offset));
    if (p == MAP_FAILED) {
        va_to_reserved(ptr, size);
        goto out;
    }
    struct fc_map m = {ptr, size, (uint32_t)(s - g_slots), s->dev};
    if (fc_vec_insert(&g_maps, i, &m) != 0) {
        va_to_reserved(ptr, size);
        goto out;
    }
    r->nmaps++;
    s->maps++;
    fc_live_n.mappings++;
    rc = CUDA_SUCCESS;
out:
    fc_unlock();
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    FC_ENTER(MemUnmap);
    fc_vmm_call("cuMemUnmap", 1);
    if (ptr == 0 || size == 0 || ptr > UINT64_MAX - size) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    size_t first, last;
    if (map_cover(ptr, size, &first, &last) != 0) goto out;
    const struct fc_map *mf = fc_vec_at(&g_maps, first);
    const struct fc_map *ml = fc_vec_at(&g_maps, last - 1);
    if (mf->addr != ptr || ml->addr + ml->size != ptr + size) goto out;
    va_to_reserved(ptr, size);
    for (size_t k = first; k < last; k++) {
        const struct fc_map *m = fc_vec_at(&g_maps, k);
        struct fc_resv *r = resv_containing(m->addr, m->size);
        if (!r) fc_die("internal error: mapping outside any reservation");
        r->nmaps--;
        struct fc_slot *s = &g_slots[m->slot];
        if (--s->maps == 0 && s->released) slot_destroy(m->slot);
    }
    fc_vec_erase(&g_maps, first, last - first);
    fc_live_n.mappings -= (long)(last - first);
    rc = CUDA_SUCCESS;
out:
    fc_unlock();
    return rc;
}

static int access_prot(CUmemAccess_flags f) {
    switch (f) {
    case CU_MEM_ACCESS_FLAGS_PROT_NONE:
        return PROT_NONE;
    case CU_MEM_ACCESS_FLAGS_PROT_READ:
        return PROT_READ;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
        return PROT_READ | PROT_WRITE;
    default:
        return -1;
    }
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    FC_ENTER(MemSetAccess);
    fc_vmm_call("cuMemSetAccess", 1);
    if (!desc || count == 0 || ptr == 0 || size == 0 || !aligned(ptr) || !aligned(size) ||
        ptr > UINT64_MAX - size)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < count; k++) {
        if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE || access_prot(desc[k].flags) < 0)
            return CUDA_ERROR_INVALID_VALUE;
        if (!valid_dev(desc[k].location.id)) return CUDA_ERROR_INVALID_DEVICE;
    }
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    size_t first, last;
    if (map_cover(ptr, size, &first, &last) != 0) goto out;
    rc = CUDA_SUCCESS;
    for (size_t i = first; i < last && rc == CUDA_SUCCESS; i++) {
        const struct fc_map *m = fc_vec_at(&g_maps, i);
        int prot = -1;
        /* The CPU stands in for the device that owns the memory. */
        for (size_t k = 0; k < count; k++)
            if (desc[k].location.id == m->dev) prot = access_prot(desc[k].flags);
        if (prot < 0) continue;
        uint64_t lo = m->addr > ptr ? m->addr : ptr;
        uint64_t hi = m->addr + m->size < ptr + size ? m->addr + m->size : ptr + size;
        if (mprotect((void *)(uintptr_t)lo, hi - lo, prot) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
out:
    fc_unlock();
    return rc;
}

/* ---- cuMemAlloc / cuMemAllocManaged / cuMemFree -------------------------- */

static CUresult block_alloc(CUdeviceptr *dptr, size_t bytesize, int managed) {
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (bytesize > (managed ? fc_cfg.host_memory : fc_cfg.capacity))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t size = (bytesize + fc_cfg.gran - 1) & ~(fc_cfg.gran - 1);
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc != CUDA_SUCCESS) goto out;
    struct fc_device *d = &fc_dev[dev];
    rc = CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t off = 0;
    if (managed ? size > fc_cfg.host_memory - fc_managed_used
                : !charge_ok(d, size) || phys_alloc(d, size, &off) != 0)
        goto out;
    void *p = va_reserve(size, fc_cfg.gran, 0);
    void *q = MAP_FAILED;
    if (p && managed)
        q = mmap(p, size, PROT_READ | PROT_WRITE, RESERVE_FLAGS | MAP_FIXED, -1, 0);
    else if (p)
        q = mmap(p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, d->memfd, (off_t)off);
    struct fc_block b = {(uint64_t)(uintptr_t)p, size, off, dev, managed};
    if (q == MAP_FAILED || fc_vec_insert(&g_blocks, fc_vec_lower(&g_blocks, b.addr), &b) != 0) {
        if (p) munmap(p, size);
        if (!managed) phys_free(d, off, size);
        goto out;
    }
    if (managed) {
        fc_managed_used += size;
        fc_live_n.managed++;
    } else {
        d->used += size;
        fc_live_n.allocs++;
    }
    *dptr = (CUdeviceptr)b.addr;
    rc = CUDA_SUCCESS;
out:
    fc_unlock();
    return rc;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    FC_ENTER(MemAlloc);
    CUresult rc = fc_capture_unsafe(); /* a potentially unsafe call under stream capture */
    return rc != CUDA_SUCCESS ? rc : block_alloc(dptr, bytesize, 0);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    FC_ENTER(MemAllocManaged);
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fc_capture_unsafe(); /* potentially unsafe under capture, as cuMemAlloc */
    return rc != CUDA_SUCCESS ? rc : block_alloc(dptr, bytesize, 1);
}

static CUresult free_block(CUdeviceptr dptr);

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    FC_ENTER(MemFree);
    CUresult rc = fc_capture_unsafe();
    return rc != CUDA_SUCCESS ? rc : free_block(dptr);
}

static CUresult free_block(CUdeviceptr dptr) {
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    fc_lock();
    size_t i = fc_vec_lower(&g_blocks, dptr);
    if (i < g_blocks.n) {
        struct fc_block b;
        memcpy(&b, fc_vec_at(&g_blocks, i), sizeof b);
        if (b.addr == dptr) {
            munmap((void *)(uintptr_t)b.addr, b.size);
            if (b.managed) {
                fc_managed_used -= b.size;
                fc_live_n.managed--;
            } else {
                phys_free(&fc_dev[b.dev], b.off, b.size);
                fc_dev[b.dev].used -= b.size;
                fc_live_n.allocs--;
            }
            fc_vec_erase(&g_blocks, i, 1);
            g_last_freed_va = b.addr;
            rc = CUDA_SUCCESS;
            free_hook_unlock(b.addr, b.size);
            return rc;
        }
    }
    fc_unlock();
    return rc;
}

/* ---- a reset of the primary context ---------------------------------------- */

/* Everything of device dev's context goes, as with the driver: its cuMemAlloc and managed blocks,
 * its physical handles (released or not) and every mapping of them, so that the old addresses
 * and handles are errors from now on (a CPU access to an old mapping faults, as a kernel's
 * would). Reservations stay: they are the process's address space, not the context's, and their
 * owner frees them as before. What was still live is counted in fc_reclaimed_n: code that gives
 * its memory back before the reset leaves nothing there. */
void fc_mem_reset_device_locked(int dev) {
    for (size_t i = 0; i < g_maps.n;) {
        const struct fc_map *m = fc_vec_at(&g_maps, i);
        if (m->dev != dev) {
            i++;
            continue;
        }
        struct fc_resv *r = resv_containing(m->addr, m->size);
        if (!r) fc_die("internal error: mapping outside any reservation");
        va_to_reserved(m->addr, m->size);
        r->nmaps--;
        g_slots[m->slot].maps--;
        fc_vec_erase(&g_maps, i, 1);
        fc_live_n.mappings--;
        fc_reclaimed_n.mappings++;
    }
    for (uint32_t k = 0; k < g_nslots; k++) {
        struct fc_slot *s = &g_slots[k];
        if (!s->in_use || s->dev != dev) continue;
        if (s->maps != 0) fc_die("internal error: a handle of a reset device is still mapped");
        if (!s->released) {
            fc_live_n.handles--;
            fc_live_n.rdma_handles -= s->rdma;
            fc_reclaimed_n.handles++;
        }
        slot_destroy(k);
    }
    for (size_t i = 0; i < g_blocks.n;) {
        struct fc_block b;
        memcpy(&b, fc_vec_at(&g_blocks, i), sizeof b);
        if (b.dev != dev) {
            i++;
            continue;
        }
        munmap((void *)(uintptr_t)b.addr, b.size);
        if (b.managed) {
            fc_managed_used -= b.size;
            fc_live_n.managed--;
            fc_reclaimed_n.managed++;
        } else {
            phys_free(&fc_dev[dev], b.off, b.size);
            fc_dev[dev].used -= b.size;
            fc_live_n.allocs--;
            fc_reclaimed_n.allocs++;
        }
        fc_vec_erase(&g_blocks, i, 1);
    }
}

/* Pitch as current GPUs give it: rows padded to 512 bytes. */
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    FC_ENTER(MemAllocPitch);
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    if (WidthInBytes > SIZE_MAX - 511) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    if (Height > SIZE_MAX / pitch) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = block_alloc(dptr, pitch * Height, 0);
    if (rc == CUDA_SUCCESS) *pPitch = pitch;
    return rc;
}

/* The stream-ordered allocator, simplified: the memory is allocated and freed at once (the
 * stream is checked), which is what a real driver does when the stream has no work pending. */

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    FC_ENTER(MemAllocAsync);
    CUresult rc = fc_stream_check("cuMemAllocAsync", hStream);
    return rc != CUDA_SUCCESS ? rc : block_alloc(dptr, bytesize, 0);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    FC_ENTER(MemFreeAsync);
    CUresult rc = fc_stream_check("cuMemFreeAsync", hStream);
    return rc != CUDA_SUCCESS ? rc : free_block(dptr);
}

FC_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
FC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return cuMemAllocAsync(dptr, bytesize, hStream ? hStream : CU_STREAM_PER_THREAD);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return cuMemFreeAsync(dptr, hStream ? hStream : CU_STREAM_PER_THREAD);
}

CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    FC_ENTER(MemGetInfo);
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        uint64_t taken = fc_dev[dev].used + fc_ctx_charge(&fc_dev[dev]);
        *free = (size_t)(taken < fc_cfg.capacity ? fc_cfg.capacity - taken : 0);
        *total = (size_t)fc_cfg.capacity;
    }
    fc_unlock();
    return rc;
}

/* ---- memset / memcpy -------------------------------------------------------- */

/* Validate a device range for a synchronous copy; the copy itself happens
 * without the lock and faults if the range is not accessible. */
static CUresult check_device_range(CUdeviceptr p, size_t n) {
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS && n && !range_known(p, n)) rc = CUDA_ERROR_INVALID_VALUE;
    fc_unlock();
    return rc;
}

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    FC_ENTER(MemsetD8);
    CUresult rc = check_device_range(dstDevice, N);
    if (rc == CUDA_SUCCESS && N) memset((void *)(uintptr_t)dstDevice, uc, N);
    return rc;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    FC_ENTER(MemcpyHtoD);
    if (ByteCount && !srcHost) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_device_range(dstDevice, ByteCount);
    if (rc == CUDA_SUCCESS && ByteCount) memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
    return rc;
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    FC_ENTER(MemcpyDtoH);
    if (ByteCount && !dstHost) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_device_range(srcDevice, ByteCount);
    if (rc == CUDA_SUCCESS && ByteCount)
        memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
    return rc;
}

/* Per-thread-default-stream variants (code built with
 * CUDA_API_PER_THREAD_DEFAULT_STREAM links to these names). */
FC_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N);
FC_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t n);
FC_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t n);
CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return cuMemsetD8_v2(dstDevice, uc, N);
}
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t n) {
    return cuMemcpyHtoD_v2(dstDevice, srcHost, n);
}
CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t n) {
    return cuMemcpyDtoH_v2(dstHost, srcDevice, n);
}
