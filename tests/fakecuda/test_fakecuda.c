/*
 * test_fakecuda.c - self test of the fake CUDA driver (tests/fakecuda).
 *
 * Runs with FAKECUDA_DEVICES=2, FAKECUDA_CAPACITY=64M, FAKECUDA_GRANULARITY=2M
 * (set below, before the library reads its configuration). Every check
 * aborts with the section, line and failed expression. Some checks fork a
 * child that must die (SIGSEGV on an inaccessible page, SIGABRT on a
 * synchronize that waits for held work); some re-execute this binary with a
 * different environment ("no-vmm", "no-device", "bad-env" modes).
 */
#include "fakecuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define MiB  ((size_t)1 << 20)
#define GRAN (2 * MiB)
#define CAP  (64 * MiB)

static const char *g_section = "init";

static const char *rc_name(CUresult rc) {
    const char *s = NULL;
    if (cuGetErrorName(rc, &s) != CUDA_SUCCESS || !s) return "(unknown CUresult)";
    return s;
}

static void fail(int line, const char *what, const char *detail) {
    fprintf(stderr, "test_fakecuda: [%s] line %d: check failed: %s%s%s\n", g_section, line, what,
            detail ? " -- " : "", detail ? detail : "");
    abort();
}

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) fail(__LINE__, #cond, NULL);                                                  \
    } while (0)
#define CHECK_RC(call, want)                                                                       \
    do {                                                                                           \
        CUresult rc_ = (call);                                                                     \
        if (rc_ != (want)) {                                                                       \
            char msg_[160];                                                                        \
            snprintf(msg_, sizeof msg_, "got %s (%d), want %s", rc_name(rc_), (int)rc_,            \
                     rc_name(want));                                                               \
            fail(__LINE__, #call, msg_);                                                           \
        }                                                                                          \
    } while (0)
#define OK(call) CHECK_RC(call, CUDA_SUCCESS)

/* ---- helpers ------------------------------------------------------------ */

static CUmemAllocationProp prop_for(int dev) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

static CUmemGenericAllocationHandle create(int dev, size_t size) {
    CUmemAllocationProp p = prop_for(dev);
    CUmemGenericAllocationHandle h = 0;
    OK(cuMemCreate(&h, size, &p, 0));
    CHECK(h != 0);
    return h;
}

static CUresult set_access(CUdeviceptr ptr, size_t size, int dev, CUmemAccess_flags f) {
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = dev;
    d.flags = f;
    return cuMemSetAccess(ptr, size, &d, 1);
}

static CUdeviceptr reserve(size_t size) {
    CUdeviceptr p = 0;
    OK(cuMemAddressReserve(&p, size, 0, 0, 0));
    CHECK(p != 0 && p % GRAN == 0);
    return p;
}

static unsigned char *H(CUdeviceptr p) {
    return (unsigned char *)(uintptr_t)p;
}

static void fill(CUdeviceptr p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i += 4096) H(p)[i] = (unsigned char)(seed + i / 4096);
}

static int check_fill(CUdeviceptr p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i += 4096)
        if (H(p)[i] != (unsigned char)(seed + i / 4096)) return 0;
    return 1;
}

/* Fork a child that reads or writes *p. Returns the child's fatal signal,
 * 0 if it survived, or -1 if it died some other way (a sanitizer's own
 * SEGV handler exits with an error code instead of the signal). */
static int child_touch(CUdeviceptr p, int write) {
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = SIG_DFL;
        sigaction(SIGSEGV, &sa, NULL);
        sigaction(SIGBUS, &sa, NULL);
        volatile unsigned char *q = H(p);
        if (write)
            q[0] = 0x5a;
        else
            (void)q[0];
        _exit(0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    if (WIFSIGNALED(st)) return WTERMSIG(st);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

#define CHECK_FAULTS(p, w)                                                                         \
    do {                                                                                           \
        int sig_ = child_touch(p, w);                                                              \
        CHECK(sig_ == SIGSEGV || (UNDER_SANITIZER && sig_ != 0));                                  \
    } while (0)
#define CHECK_NO_FAULT(p, w) CHECK(child_touch(p, w) == 0)

/* st_blocks of device `dev`'s memfd (found through /proc/self/fd). */
static long long memfd_blocks(int dev) {
    int seen = 0;
    for (int fd = 0; fd < 4096; fd++) {
        char path[64], link[256];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(path, link, sizeof link - 1);
        if (n <= 0) continue;
        link[n] = '\0';
        if (strncmp(link, "/memfd:fakecuda", 15) != 0) continue;
        if (seen++ == dev) {
            struct stat sb;
            CHECK(fstat(fd, &sb) == 0);
            return (long long)sb.st_blocks;
        }
    }
    fail(__LINE__, "memfd of the device not found", NULL);
    return 0;
}

/* Is [p, p+size) still occupied in the address space (e.g. reserved)? */
static int addr_occupied(CUdeviceptr p, size_t size) {
    void *q = mmap(H(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (q == MAP_FAILED) return errno == EEXIST;
    munmap(q, size);
    return 0;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static CUcontext g_ctx0, g_ctx1;

/* ---- sections ------------------------------------------------------------- */

static void test_preinit(void) {
    g_section = "preinit";
    int v = 0, n = 0;
    OK(cuDriverGetVersion(&v));
    CHECK(v == 13000);
    CUdeviceptr p;
    size_t a, b;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED); /* call #1 */
    CHECK_RC(cuMemAlloc(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuMemGetInfo(&a, &b), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuMemAddressReserve(&p, GRAN, 0, 0, 0), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuStreamQuery(NULL), CUDA_ERROR_NOT_INITIALIZED);
    const char *s = NULL;
    OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    CHECK(s && strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    OK(cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &s));
    CHECK(s && strlen(s) > 0);
    CHECK_RC(cuGetErrorString((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    CHECK(s == NULL);
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(cuGetProcAddress("cuInit", &fn, 13000, 0, &st)); /* works before cuInit */
    CHECK(fn == (void *)cuInit && st == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(fakecuda_calls("cuDeviceGetCount") == 1);
    CHECK_RC(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    OK(cuInit(0));
}

static void test_env_fail(void) {
    g_section = "FAKECUDA_FAIL";
    int n = 0;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_OUT_OF_MEMORY); /* call #2 */
    CHECK(n == 0);                                            /* no side effect */
    OK(cuDeviceGetCount(&n));
    CHECK(n == 2);
    CHECK(fakecuda_calls("cuDeviceGetCount") == 3);
}

static void test_devices(void) {
    g_section = "devices";
    CUdevice d;
    OK(cuDeviceGet(&d, 1));
    CHECK(d == 1);
    CHECK_RC(cuDeviceGet(&d, 2), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDeviceGet(&d, -1), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDeviceGet(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    char name[64];
    OK(cuDeviceGetName(name, sizeof name, 1));
    CHECK(strcmp(name, "cuma fake device 1") == 0);
    OK(cuDeviceGetName(name, 5, 0));
    CHECK(strcmp(name, "cuma") == 0);
    CHECK_RC(cuDeviceGetName(name, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetName(name, 64, 2), CUDA_ERROR_INVALID_DEVICE);

    CUuuid u0, u0b, u1;
    OK(cuDeviceGetUuid(&u0, 0));
    OK(cuDeviceGetUuid(&u0b, 0));
    OK(cuDeviceGetUuid(&u1, 1));
    CHECK(memcmp(&u0, &u0b, sizeof u0) == 0);
    CHECK(memcmp(&u0, &u1, sizeof u0) != 0);
    CHECK_RC(cuDeviceGetUuid(&u0, 9), CUDA_ERROR_INVALID_DEVICE);

    static const struct {
        CUdevice_attribute a;
        int want;
    } attrs[] = {
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1},
        {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0},
        {CU_DEVICE_ATTRIBUTE_MAX_PITCH, 0}, /* unknown to the fake -> 0 */
    };
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++) {
        int v = -1;
        OK(cuDeviceGetAttribute(&v, attrs[i].a, 0));
        CHECK(v == attrs[i].want);
    }
    int bus0, bus1, v;
    OK(cuDeviceGetAttribute(&bus0, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
    OK(cuDeviceGetAttribute(&bus1, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1));
    CHECK(bus0 != bus1);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 1));
    CHECK_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 2), CUDA_ERROR_INVALID_DEVICE);

    size_t total = 0;
    OK(cuDeviceTotalMem(&total, 1));
    CHECK(total == CAP);
    int can = -1;
    OK(cuDeviceCanAccessPeer(&can, 0, 1));
    CHECK(can == 1);
    OK(cuDeviceCanAccessPeer(&can, 1, 1));
    CHECK(can == 0);
}

static void *thread_get_ctx(void *arg) {
    CUcontext c = (CUcontext)arg;
    if (cuCtxGetCurrent(&c) != CUDA_SUCCESS) return (void *)1;
    return c; /* must be NULL: the current context is per thread */
}

static void test_contexts(void) {
    g_section = "contexts";
    CUcontext c = (CUcontext)1;
    CUdevice d;
    CUdeviceptr p;
    size_t fr, tot;
    CUstream s;
    OK(cuCtxGetCurrent(&c));
    CHECK(c == NULL);
    CHECK_RC(cuCtxGetDevice(&d), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuMemGetInfo(&fr, &tot), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuDevicePrimaryCtxRelease(1), CUDA_ERROR_INVALID_CONTEXT); /* not retained */
    int junk;
    CHECK_RC(cuCtxSetCurrent((CUcontext)&junk), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuDevicePrimaryCtxRetain(&g_ctx0, 0));
    OK(cuDevicePrimaryCtxRetain(&g_ctx1, 1));
    CHECK(g_ctx0 && g_ctx1 && g_ctx0 != g_ctx1);
    CHECK_RC(cuDevicePrimaryCtxRetain(&c, 3), CUDA_ERROR_INVALID_DEVICE);
    OK(cuCtxSetCurrent(g_ctx1));
    OK(cuCtxGetDevice(&d));
    CHECK(d == 1);
    OK(cuCtxSetCurrent(g_ctx0));
    OK(cuCtxGetCurrent(&c));
    CHECK(c == g_ctx0);
    OK(cuCtxGetDevice(&d));
    CHECK(d == 0);
    pthread_t t;
    void *res = (void *)1;
    CHECK(pthread_create(&t, NULL, thread_get_ctx, g_ctx0) == 0);
    CHECK(pthread_join(t, &res) == 0);
    CHECK(res == NULL);
}

static void test_vmm(void) {
    g_section = "vmm";
    CUmemAllocationProp prop = prop_for(0);
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g == GRAN);
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(g == GRAN);
    CHECK_RC(cuMemGetAllocationGranularity(&g, &prop, (CUmemAllocationGranularity_flags)7),
             CUDA_ERROR_INVALID_VALUE);
    CUmemAllocationProp bad = prop_for(5);
    CHECK_RC(cuMemGetAllocationGranularity(&g, &bad, 0), CUDA_ERROR_INVALID_DEVICE);

    CUdeviceptr r = 0;
    CHECK_RC(cuMemAddressReserve(&r, GRAN + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, GRAN, 3 * GRAN, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, GRAN, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAddressReserve(&r, GRAN, 64 * MiB, 0, 0));
    CHECK(r % (64 * MiB) == 0);
    OK(cuMemAddressFree(r, GRAN));
    CHECK_RC(cuMemAddressFree(r, GRAN), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr r2 = 0;
    OK(cuMemAddressReserve(&r2, 2 * GRAN, 0, r, 0)); /* the hint is free: honoured */
    CHECK(r2 == r);
    OK(cuMemAddressFree(r2, 2 * GRAN));

    CUmemGenericAllocationHandle h = 0, h2;
    CHECK_RC(cuMemCreate(&h, 3 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemCreate(&h, GRAN, &prop, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemCreate(&h, GRAN, &bad, 0), CUDA_ERROR_INVALID_DEVICE);
    bad = prop_for(0);
    bad.type = CU_MEM_ALLOCATION_TYPE_MANAGED;
    CHECK_RC(cuMemCreate(&h, GRAN, &bad, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(h == 0);

    const size_t RS = 32 * MiB;
    CUdeviceptr base = reserve(RS);
    h = create(0, 2 * GRAN);
    h2 = create(0, 2 * GRAN);
    CHECK(fakecuda_live("handles") == 2 && fakecuda_live("reservations") == 1);
    /* argument checks */
    CHECK_RC(cuMemMap(base + 4096, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 4096, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, 3 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, 2 * GRAN, GRAN, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 0, h ^ 0x40000000ull, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 0, h, 1), CUDA_ERROR_INVALID_VALUE);
    /* outside the reservation: straddling its end, and not reserved at all */
    CHECK_RC(cuMemMap(base + RS - GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base + RS, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_live("mappings") == 0);

    OK(cuMemMap(base, 2 * GRAN, 0, h, 0));
    CHECK_RC(cuMemMap(base + GRAN, 2 * GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* overlap */
    CHECK_RC(cuMemMap(base, GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);            /* overlap */
    OK(cuMemMap(base + 2 * GRAN, 2 * GRAN, 0, h2, 0));                             /* adjacent */
    CHECK(fakecuda_live("mappings") == 2);

    /* inaccessible until cuMemSetAccess */
    CHECK_FAULTS(base, 0);
    OK(set_access(base, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    fill(base, 2 * GRAN, 7);
    CHECK(check_fill(base, 2 * GRAN, 7));
    CHECK_FAULTS(base + 2 * GRAN, 0); /* h2's mapping still inaccessible */
    /* SetAccess needs a fully mapped range and valid descriptors */
    CHECK_RC(set_access(base, 6 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(set_access(base + 8 * GRAN, GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(set_access(base, GRAN, 7, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(set_access(base, GRAN, 0, (CUmemAccess_flags)2), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc hostdesc = {{CU_MEM_LOCATION_TYPE_HOST, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
    CHECK_RC(cuMemSetAccess(base, GRAN, &hostdesc, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemSetAccess(base, GRAN, &hostdesc, 0), CUDA_ERROR_INVALID_VALUE);
    /* one call spanning two mappings; read-only faults on write */
    OK(set_access(base, 4 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READ));
    CHECK_FAULTS(base + 3 * GRAN, 1);
    CHECK_FAULTS(base, 1);
    CHECK_NO_FAULT(base, 0);
    CHECK(check_fill(base, 2 * GRAN, 7));
    /* the CPU gets the access of the device owning the memory (device 0) */
    CUmemAccessDesc two[2] = {
        {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE},
        {{CU_MEM_LOCATION_TYPE_DEVICE, 1}, CU_MEM_ACCESS_FLAGS_PROT_NONE}};
    OK(cuMemSetAccess(base, 4 * GRAN, two, 2));
    CHECK_NO_FAULT(base + 3 * GRAN, 1);
    OK(set_access(base, 4 * GRAN, 1, CU_MEM_ACCESS_FLAGS_PROT_NONE)); /* peer only */
    CHECK_NO_FAULT(base, 1);

    /* memset / memcpy on mapped memory, range checks */
    unsigned char buf[8192], back[8192];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 31);
    OK(cuMemcpyHtoD(base + 2 * GRAN - 4096, buf, sizeof buf)); /* crosses h -> h2 */
    OK(cuMemcpyDtoH(back, base + 2 * GRAN - 4096, sizeof back));
    CHECK(memcmp(buf, back, sizeof buf) == 0);
    OK(cuMemsetD8(base + 3 * GRAN, 0xA5, 100));
    CHECK(H(base + 3 * GRAN)[99] == 0xA5 && H(base + 3 * GRAN)[100] != 0xA5);
    CHECK_RC(cuMemsetD8(base + 4 * GRAN - 10, 0, 20), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyDtoH(back, base + 8 * GRAN, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)buf, back, 16), CUDA_ERROR_INVALID_VALUE);
    fill(base, 2 * GRAN, 7); /* restore the pattern the copies overwrote */

    /* unmap must cover whole mappings */
    CHECK_RC(cuMemUnmap(base, GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base + GRAN, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base, 3 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base, 6 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressFree(base, RS), CUDA_ERROR_INVALID_VALUE); /* still mapped */
    OK(cuMemUnmap(base, 4 * GRAN));                                 /* two whole mappings at once */
    CHECK(fakecuda_live("mappings") == 0);
    CHECK_FAULTS(base, 0);                /* the reservation is inaccessible again... */
    CHECK(addr_occupied(base, 4 * GRAN)); /* ...but still reserved */

    /* data survives unmap + remap at another address, also at an offset */
    OK(cuMemMap(base + 8 * GRAN, 2 * GRAN, 0, h, 0));
    OK(cuMemMap(base + 4 * GRAN, GRAN, GRAN, h, 0)); /* second half of h */
    OK(set_access(base + 8 * GRAN, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    OK(set_access(base + 4 * GRAN, GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CHECK(check_fill(base + 8 * GRAN, 2 * GRAN, 7));
    CHECK(H(base + 4 * GRAN)[0] == H(base + 9 * GRAN)[0]);
    H(base + 4 * GRAN)[4096] = 0xEE; /* two mappings of one handle share memory */
    CHECK(H(base + 9 * GRAN)[4096] == 0xEE);
    CHECK_RC(cuMemAddressFree(base, RS), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(base + 8 * GRAN, 2 * GRAN));
    OK(cuMemUnmap(base + 4 * GRAN, GRAN));
    CHECK_RC(cuMemAddressFree(base, RS - GRAN), CUDA_ERROR_INVALID_VALUE); /* wrong size */
    OK(cuMemRelease(h));
    OK(cuMemRelease(h2));
    OK(cuMemAddressFree(base, RS));
    CHECK(!addr_occupied(base, RS));
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("reservations") == 0);
    CHECK(fakecuda_used_bytes(0) == 0);
}

static void test_release_while_mapped(void) {
    g_section = "release while mapped";
    CUdeviceptr base = reserve(8 * GRAN);
    long long blocks0 = memfd_blocks(0);
    CUmemGenericAllocationHandle h = create(0, 2 * GRAN);
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN);
    OK(cuMemMap(base, 2 * GRAN, 0, h, 0));
    OK(cuMemMap(base + 4 * GRAN, 2 * GRAN, 0, h, 0));
    OK(set_access(base, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    memset(H(base), 0x3c, 2 * GRAN);
    CHECK(memfd_blocks(0) >= blocks0 + (long long)(2 * GRAN / 512));
    OK(cuMemRelease(h));
    CHECK(fakecuda_live("handles") == 0);
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN); /* still mapped: still charged */
    CHECK(H(base)[2 * GRAN - 1] == 0x3c);
    CHECK_RC(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base + 2 * GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(base, 2 * GRAN));
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN); /* one mapping left */
    OK(cuMemUnmap(base + 4 * GRAN, 2 * GRAN));
    CHECK(fakecuda_used_bytes(0) == 0);
    CHECK(memfd_blocks(0) <= blocks0); /* hole punched: host memory returned */
    CHECK_RC(cuMemMap(base, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* stale handle */
    OK(cuMemAddressFree(base, 8 * GRAN));
}

static void test_capacity(void) {
    g_section = "capacity";
    enum { N = CAP / GRAN };
    CUmemGenericAllocationHandle hs[N], extra = 12345;
    for (int i = 0; i < N; i++) hs[i] = create(0, GRAN);
    CUmemAllocationProp prop = prop_for(0);
    CHECK_RC(cuMemCreate(&extra, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(extra == 12345);
    CHECK(fakecuda_used_bytes(0) == CAP && fakecuda_used_bytes(1) == 0);
    size_t fr = 1, tot = 0;
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == 0 && tot == CAP);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RC(cuMemAllocManaged(&p, 1, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_OUT_OF_MEMORY);
    CUmemGenericAllocationHandle other = create(1, GRAN); /* device 1 is separate */
    OK(cuMemRelease(other));
    /* free every other granule; bigger handles still fit (no fragmentation OOM) */
    for (int i = 0; i < N; i += 2) OK(cuMemRelease(hs[i]));
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP / 2);
    for (int i = 0; i < N; i += 4) hs[i] = create(0, 2 * GRAN);
    CHECK_RC(cuMemCreate(&extra, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    for (int i = 0; i < N; i++)
        if (i % 2 == 1 || i % 4 == 0) OK(cuMemRelease(hs[i]));
    CHECK(fakecuda_used_bytes(0) == 0);
    CHECK_RC(cuMemCreate(&extra, CAP + GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
}

static void test_alloc(void) {
    g_section = "cuMemAlloc/managed";
    CUdeviceptr p = 0, m = 0, q = 0;
    CHECK_RC(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAlloc(&p, 1000));
    CHECK(p % GRAN == 0 && fakecuda_used_bytes(0) == GRAN && fakecuda_live("allocs") == 1);
    H(p)[GRAN - 1] = 1; /* read-write right away, whole rounded size */
    OK(cuMemsetD8(p, 0xab, 1000));
    CHECK(H(p)[0] == 0xab && H(p)[999] == 0xab);
    unsigned char in[300], out[300];
    for (int i = 0; i < 300; i++) in[i] = (unsigned char)i;
    OK(cuMemcpyHtoD(p + 100, in, sizeof in));
    OK(cuMemcpyDtoH(out, p + 100, sizeof out));
    CHECK(memcmp(in, out, sizeof in) == 0);
    CHECK_RC(cuMemcpyDtoH(out, p + GRAN - 10, 20), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyHtoD(p, NULL, 20), CUDA_ERROR_INVALID_VALUE);
    size_t fr, tot;
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP - GRAN && tot == CAP);
    CHECK_RC(cuMemFree(p + 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree(0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAllocManaged(&m, GRAN, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAllocManaged(&m, 3 * MiB, CU_MEM_ATTACH_GLOBAL));
    CHECK(fakecuda_used_bytes(0) == 3 * GRAN && fakecuda_live("managed") == 1);
    H(m)[3 * MiB - 1] = 9;
    OK(cuMemsetD8(m, 1, 3 * MiB));
    OK(cuCtxSetCurrent(g_ctx1)); /* charged to the current context's device */
    OK(cuMemAlloc(&q, 5 * MiB));
    CHECK(fakecuda_used_bytes(1) == 3 * GRAN && fakecuda_used_bytes(0) == 3 * GRAN);
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP - 3 * GRAN);
    OK(cuMemFree(q));
    OK(cuCtxSetCurrent(g_ctx0));
    OK(cuMemFree(p));
    CHECK_RC(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree(m));
    CHECK(fakecuda_live("allocs") == 0 && fakecuda_live("managed") == 0);
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 0);
}

static void test_fault_injection(void) {
    g_section = "fault injection";
    CUmemAllocationProp prop = prop_for(0);
    CUmemGenericAllocationHandle h[4];
    CHECK(fakecuda_set_fail("cuMemCreate:3") == 0);
    for (int i = 0; i < 4; i++) {
        h[i] = 777;
        CHECK_RC(cuMemCreate(&h[i], GRAN, &prop, 0),
                 i == 2 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS);
    }
    CHECK(h[2] == 777 && fakecuda_live("handles") == 3);
    CHECK(fakecuda_used_bytes(0) == 3 * GRAN);
    CUdeviceptr r = reserve(2 * GRAN);
    CHECK(fakecuda_set_fail("cuMemMap:*,cuMemRelease:1") == 0);
    for (int i = 0; i < 3; i++) CHECK_RC(cuMemMap(r, GRAN, 0, h[0], 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("mappings") == 0);
    CHECK_RC(cuMemRelease(h[0]), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("handles") == 3);
    OK(cuMemRelease(h[0]));
    CHECK(fakecuda_set_fail(NULL) == 0);
    OK(cuMemMap(r, GRAN, 0, h[1], 0));
    OK(cuMemUnmap(r, GRAN));
    OK(cuMemRelease(h[1]));
    OK(cuMemRelease(h[3]));
    OK(cuMemAddressFree(r, 2 * GRAN));

    /* bad specs are rejected and leave the previous spec in place */
    CHECK(fakecuda_set_fail("cuMemAlloc_v2:2") == 0);
    static const char *const bad[] = {
        "bogus:1",        "cuMemCreate", "cuMemCreate:",   "cuMemCreate:0",  "cuMemCreate:x",
        "cuMemCreate:1,", ":1",          "cuMemCreate:1x", "cuMemCreate:-1", "cuMemCreate:*1",
        "cuMemCreate:1,,"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) CHECK(fakecuda_set_fail(bad[i]) == -1);
    CUdeviceptr p, p2;
    OK(cuMemAlloc(&p, 1));
    CHECK_RC(cuMemAlloc(&p2, 1), CUDA_ERROR_OUT_OF_MEMORY);
    /* an injected cuMemFree has no side effect */
    CHECK(fakecuda_set_fail("cuMemFree:1") == 0);
    CHECK_RC(cuMemFree(p), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("allocs") == 1);
    OK(cuMemFree(p));
    /* set_fail resets positions; reset_counters does not */
    int n;
    OK(cuDeviceGetCount(&n));
    CHECK(fakecuda_set_fail("cuDeviceGetCount:2") == 0);
    OK(cuDeviceGetCount(&n));
    fakecuda_reset_counters();
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuDeviceGetCount(&n));
    CHECK(fakecuda_set_fail("") == 0);
}

struct delayed {
    CUstream s;
    int ms;
};

static void *release_later(void *arg) {
    struct delayed *d = arg;
    struct timespec ts = {0, d->ms * 1000000L};
    nanosleep(&ts, NULL);
    fakecuda_stream_release(d->s);
    return NULL;
}

static void *destroy_then_release_later(void *arg) {
    struct delayed *d = arg;
    struct timespec ts = {0, d->ms * 1000000L};
    nanosleep(&ts, NULL);
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS || cuStreamDestroy(d->s) != CUDA_SUCCESS)
        return (void *)1;
    nanosleep(&ts, NULL);
    fakecuda_stream_release(d->s); /* frees the stream the main thread waits on */
    return NULL;
}

/* Hold s, run sync() while another thread releases s after 50 ms. */
static void check_blocks_until_release(CUstream s, CUevent e, int which) {
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    struct delayed d = {s, 50};
    pthread_t t;
    double t0 = now_ms();
    CHECK(pthread_create(&t, NULL, release_later, &d) == 0);
    if (which == 0) OK(cuEventSynchronize(e));
    if (which == 1) OK(cuStreamSynchronize(s));
    if (which == 2) OK(cuCtxSynchronize());
    double waited = now_ms() - t0;
    CHECK(waited >= 40);
    CHECK(waited < 800); /* woken by the release, not by the 1000 ms timeout */
    CHECK(pthread_join(t, NULL) == 0);
    OK(cuEventQuery(e));
}

/* Does fakecuda_stream_release(s) abort (s is not a live stream)? */
static int child_release_aborts(CUstream s) {
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        if (!freopen("/dev/null", "w", stderr)) _exit(3);
        fakecuda_stream_release(s);
        _exit(0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}

static void test_streams(void) {
    g_section = "streams/events";
    CUstream s, s2;
    CUevent e, e2;
    CHECK_RC(cuStreamCreate(&s, 4), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    OK(cuEventCreate(&e, 0));
    OK(cuEventCreate(&e2, CU_EVENT_DISABLE_TIMING));
    CHECK(fakecuda_live("streams") == 2 && fakecuda_live("events") == 2);
    OK(cuEventQuery(e)); /* never recorded: complete */
    OK(cuEventSynchronize(e));
    OK(cuEventRecord(e, s));
    OK(cuEventQuery(e));
    OK(cuStreamQuery(s));

    fakecuda_stream_hold(s);
    CHECK_RC(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    OK(cuEventRecord(e, s));
    OK(cuEventRecord(e2, s2));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    OK(cuEventQuery(e2));
    OK(cuStreamWaitEvent(s2, e, 0));
    fakecuda_stream_release(s);
    OK(cuEventQuery(e));
    OK(cuStreamQuery(s));
    /* re-recording on an idle stream replaces the pending record */
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    OK(cuEventRecord(e, s2));
    OK(cuEventQuery(e));
    fakecuda_stream_release(s);

    /* pseudo streams: NULL == CU_STREAM_LEGACY, per-thread is separate */
    fakecuda_stream_hold(NULL);
    OK(cuEventRecord(e, NULL));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK_RC(cuStreamQuery(CU_STREAM_LEGACY), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(CU_STREAM_PER_THREAD));
    fakecuda_stream_release(CU_STREAM_LEGACY);
    OK(cuEventQuery(e));
    CUresult (*query_ptsz)(CUstream) =
        (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "cuStreamQuery_ptsz");
    CHECK(query_ptsz != NULL);
    fakecuda_stream_hold(CU_STREAM_PER_THREAD);
    CHECK_RC(query_ptsz(NULL), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(NULL));
    fakecuda_stream_release(CU_STREAM_PER_THREAD);

    /* handle validation */
    int junk;
    CHECK_RC(cuStreamWaitEvent(s, (CUevent)&junk, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamWaitEvent((CUstream)&junk, e, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamWaitEvent(s, e, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventRecord((CUevent)&junk, s), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamQuery((CUstream)&junk), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamDestroy(NULL), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamDestroy(CU_STREAM_LEGACY), CUDA_ERROR_INVALID_HANDLE);
    OK(cuCtxSetCurrent(g_ctx1));
    CUevent e1;
    OK(cuEventCreate(&e1, 0));
    CHECK_RC(cuEventRecord(e1, s), CUDA_ERROR_INVALID_HANDLE); /* other device's stream */
    OK(cuStreamWaitEvent(NULL, e, 0));                         /* cross-device wait is fine */
    OK(cuEventDestroy(e1));
    OK(cuCtxSetCurrent(g_ctx0));

    /* synchronize blocks until another thread releases the stream */
    check_blocks_until_release(s, e, 0);
    check_blocks_until_release(s, e, 1);
    check_blocks_until_release(s2, e, 2);

    /* a waiter survives its stream being destroyed and freed meanwhile */
    CUstream s3;
    OK(cuStreamCreate(&s3, 0));
    fakecuda_stream_hold(s3);
    struct delayed d3 = {s3, 30};
    pthread_t t3;
    void *res3 = (void *)1;
    CHECK(pthread_create(&t3, NULL, destroy_then_release_later, &d3) == 0);
    OK(cuStreamSynchronize(s3));
    CHECK(pthread_join(t3, &res3) == 0 && res3 == NULL);

    /* destroying a held stream keeps its work in flight until release */
    fakecuda_stream_hold(s2);
    OK(cuEventRecord(e2, s2));
    OK(cuStreamDestroy(s2));
    CHECK(fakecuda_live("streams") == 1);
    CHECK_RC(cuStreamQuery(s2), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuEventQuery(e2), CUDA_ERROR_NOT_READY);
    fakecuda_stream_release(s2);
    OK(cuEventQuery(e2));
    CHECK(child_release_aborts(s2)); /* the released zombie is gone */

    /* waiting on held work that is never released aborts the process */
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        if (!freopen("/dev/null", "w", stderr)) _exit(3);
        cuEventSynchronize(e);
        _exit(0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
    fakecuda_stream_release(s);

    OK(cuStreamDestroy(s));
    CHECK_RC(cuStreamDestroy(s), CUDA_ERROR_INVALID_HANDLE);
    OK(cuEventDestroy(e));
    OK(cuEventDestroy(e2));
    CHECK_RC(cuEventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
    CHECK(fakecuda_live("streams") == 0 && fakecuda_live("events") == 0);
}

static void test_proc_address(void) {
    g_section = "cuGetProcAddress";
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(cuGetProcAddress("cuMemGetInfo", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    CHECK(fn == (void *)cuMemGetInfo_v2 && st == CU_GET_PROC_ADDRESS_SUCCESS);
    size_t fr = 0, tot = 0;
    OK(((CUresult(*)(size_t *, size_t *))fn)(&fr, &tot));
    CHECK(tot == CAP);
    OK(cuGetProcAddress("cuMemCreate", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                        &st));
    CHECK(fn == (void *)cuMemCreate && st == CU_GET_PROC_ADDRESS_SUCCESS);
    OK(cuGetProcAddress("cuMemCreate", &fn, 10000, 0, &st));
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    OK(cuGetProcAddress("cuStreamDestroy", &fn, 3000, 0, &st));
    CHECK(fn && fn == dlsym(RTLD_DEFAULT, "cuStreamDestroy") && st == CU_GET_PROC_ADDRESS_SUCCESS);
    OK(cuGetProcAddress("cuStreamDestroy", &fn, 13000, 0, &st));
    CHECK(fn == (void *)cuStreamDestroy_v2);
    OK(cuGetProcAddress("cuDeviceGetUuid", &fn, 11040, 0, &st));
    CHECK(fn == (void *)cuDeviceGetUuid_v2);
    OK(cuGetProcAddress("cuGetProcAddress", &fn, 12000, 0, NULL));
    CHECK(fn == (void *)cuGetProcAddress_v2);
    OK(cuGetProcAddress("cuNoSuchFunction", &fn, 13000, 0, &st));
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    OK(cuGetProcAddress("cuMemAlloc_v2", &fn, 13000, 0, &st)); /* base names only */
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    CHECK_RC(cuGetProcAddress("cuMemAlloc", &fn, 13010, 0, &st), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGetProcAddress("cuMemAlloc", &fn, 13000, 8, &st), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGetProcAddress(NULL, &fn, 13000, 0, &st), CUDA_ERROR_INVALID_VALUE);
}

static void test_exports_and_counters(void) {
    g_section = "exports/counters";
    char present[] =
        "cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetCount cuDeviceGetName "
        "cuDeviceGetUuid cuDeviceGetUuid_v2 cuDeviceGetAttribute cuDeviceTotalMem_v2 "
        "cuDeviceCanAccessPeer cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease "
        "cuDevicePrimaryCtxRelease_v2 cuCtxSetCurrent cuCtxGetCurrent cuCtxGetDevice "
        "cuCtxSynchronize cuMemGetInfo_v2 cuMemAlloc_v2 cuMemFree_v2 cuMemAllocManaged "
        "cuMemAddressReserve cuMemAddressFree cuMemCreate cuMemRelease cuMemMap "
        "cuMemUnmap cuMemSetAccess cuMemGetAllocationGranularity cuStreamCreate "
        "cuStreamDestroy cuStreamDestroy_v2 cuStreamSynchronize cuStreamQuery "
        "cuStreamWaitEvent cuEventCreate cuEventDestroy cuEventDestroy_v2 cuEventRecord "
        "cuEventQuery cuEventSynchronize cuMemsetD8_v2 cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 "
        "cuGetErrorString cuGetErrorName cuGetProcAddress_v2 cuStreamSynchronize_ptsz "
        "cuEventRecord_ptsz cuMemcpyHtoD_v2_ptds fakecuda_stream_hold "
        "fakecuda_stream_release fakecuda_set_fail fakecuda_calls "
        "fakecuda_reset_counters fakecuda_live fakecuda_used_bytes ";
    for (char *save = NULL, *name = strtok_r(present, " ", &save); name;
         name = strtok_r(NULL, " ", &save)) {
        if (!dlsym(RTLD_DEFAULT, name)) fail(__LINE__, "exported symbol missing", name);
    }
    /* legacy 32-bit ABI names and internals are not exported */
    static const char *const absent[] = {"cuMemAlloc", "cuMemGetInfo", "cuMemFree", "fc_enter",
                                         "fc_cfg"};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++) {
        if (dlsym(RTLD_DEFAULT, absent[i]))
            fail(__LINE__, "symbol must not be exported", absent[i]);
    }

    fakecuda_reset_counters();
    CHECK(fakecuda_calls("cuMemAlloc") == 0 && fakecuda_calls("cuStreamDestroy") == 0);
    CUdeviceptr p;
    for (int i = 0; i < 3; i++) CHECK_RC(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_calls("cuMemAlloc") == 3 && fakecuda_calls("cuMemAlloc_v2") == 3);
    CUresult (*plain_destroy)(CUstream) =
        (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "cuStreamDestroy");
    CHECK_RC(plain_destroy(NULL), CUDA_ERROR_INVALID_HANDLE);
    CHECK(fakecuda_calls("cuStreamDestroy") == 1); /* alias counted once */
    fakecuda_reset_counters();
    CHECK(fakecuda_calls("cuMemAlloc") == 0);
}

struct worker_arg {
    int id;
};

static void *worker(void *arg) {
    int id = ((struct worker_arg *)arg)->id;
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS) return (void *)1;
    CUmemAllocationProp prop = prop_for(0);
    CUmemAccessDesc d = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    for (int it = 0; it < 100; it++) {
        CUdeviceptr r;
        CUmemGenericAllocationHandle h;
        CUstream s;
        CUevent e;
        if (cuMemAddressReserve(&r, 2 * GRAN, 0, 0, 0) || cuMemCreate(&h, GRAN, &prop, 0) ||
            cuMemMap(r + GRAN, GRAN, 0, h, 0) || cuMemSetAccess(r + GRAN, GRAN, &d, 1))
            return (void *)2;
        H(r + GRAN)[it] = (unsigned char)id;
        if (H(r + GRAN)[it] != (unsigned char)id) return (void *)3;
        if (cuMemUnmap(r + GRAN, GRAN) || cuMemRelease(h) || cuMemAddressFree(r, 2 * GRAN))
            return (void *)4;
        if (cuStreamCreate(&s, 0) || cuEventCreate(&e, 0)) return (void *)5;
        fakecuda_stream_hold(s);
        if (cuEventRecord(e, s) != CUDA_SUCCESS || cuEventQuery(e) != CUDA_ERROR_NOT_READY)
            return (void *)6;
        fakecuda_stream_release(s);
        if (cuEventSynchronize(e) || cuEventDestroy(e) || cuStreamDestroy(s)) return (void *)7;
    }
    return NULL;
}

static void test_threads(void) {
    g_section = "threads";
    enum { T = 4 };
    pthread_t t[T];
    struct worker_arg a[T];
    for (int i = 0; i < T; i++) {
        a[i].id = i + 1;
        CHECK(pthread_create(&t[i], NULL, worker, &a[i]) == 0);
    }
    for (int i = 0; i < T; i++) {
        void *res = (void *)-1;
        CHECK(pthread_join(t[i], &res) == 0);
        CHECK(res == NULL);
    }
}

static void test_final(void) {
    g_section = "final";
    static const char *const kinds[] = {"handles", "mappings", "reservations", "allocs",
                                        "managed", "streams",  "events"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        if (fakecuda_live(kinds[i]) != 0) fail(__LINE__, "leaked objects of kind", kinds[i]);
    }
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 0);
    OK(cuDevicePrimaryCtxRelease(1));
    OK(cuDevicePrimaryCtxRelease(0));
    CHECK_RC(cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc(&p, 1), CUDA_ERROR_INVALID_CONTEXT); /* primary context inactive */
    CHECK_RC(cuCtxSetCurrent(g_ctx0), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxSetCurrent(NULL));
}

/* ---- modes run in a re-executed child with a different environment ------- */

static int run_mode(const char *mode) {
    if (strcmp(mode, "no-vmm") == 0) {
        g_section = "FAKECUDA_NO_VMM";
        OK(cuInit(0));
        int v = -1;
        OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
        CHECK(v == 0);
        CUmemAllocationProp prop = prop_for(0);
        CUmemGenericAllocationHandle h;
        size_t g;
        CHECK_RC(cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        CHECK_RC(cuMemGetAllocationGranularity(&g, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        return 0;
    }
    if (strcmp(mode, "no-peer") == 0) {
        g_section = "FAKECUDA_NO_PEER";
        OK(cuInit(0));
        int can = -1;
        OK(cuDeviceCanAccessPeer(&can, 0, 1));
        CHECK(can == 0);
        return 0;
    }
    if (strcmp(mode, "no-device") == 0) {
        g_section = "FAKECUDA_DEVICES=0";
        CHECK_RC(cuInit(0), CUDA_ERROR_NO_DEVICE);
        int n;
        CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
        return 0;
    }
    if (strcmp(mode, "bad-env") == 0) {
        cuInit(0); /* must abort on FAKECUDA_CAPACITY=12Q */
        return 0;
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}

/* Re-execute this binary in `mode` with one extra environment variable;
 * returns the wait status. */
static int spawn_mode(const char *mode, const char *var, const char *val) {
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        unsetenv("FAKECUDA_FAIL");
        setenv(var, val, 1);
        if (strcmp(mode, "bad-env") == 0 && !freopen("/dev/null", "w", stderr)) _exit(3);
        execl("/proc/self/exe", "test_fakecuda", mode, (char *)NULL);
        _exit(127);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    return st;
}

static void test_env_modes(void) {
    g_section = "environment modes";
    int st = spawn_mode("no-vmm", "FAKECUDA_NO_VMM", "1");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("no-peer", "FAKECUDA_NO_PEER", "1");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("no-device", "FAKECUDA_DEVICES", "0");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("bad-env", "FAKECUDA_CAPACITY", "12Q");
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
}

int main(int argc, char **argv) {
    if (argc > 1) return run_mode(argv[1]); /* environment set by spawn_mode */
    setenv("FAKECUDA_DEVICES", "2", 1);
    setenv("FAKECUDA_CAPACITY", "64M", 1);
    setenv("FAKECUDA_GRANULARITY", "2M", 1);
    setenv("FAKECUDA_SYNC_TIMEOUT_MS", "1000", 1);
    setenv("FAKECUDA_FAIL", "cuDeviceGetCount:2", 1);
    unsetenv("FAKECUDA_NO_VMM");
    unsetenv("FAKECUDA_NO_PEER");
    test_preinit();
    test_env_fail();
    test_devices();
    test_contexts();
    test_vmm();
    test_release_while_mapped();
    test_capacity();
    test_alloc();
    test_fault_injection();
    test_streams();
    test_proc_address();
    test_exports_and_counters();
    test_threads();
    test_env_modes();
    test_final();
    printf("test_fakecuda: all checks passed\n");
    return 0;
}
