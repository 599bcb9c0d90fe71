// SPDX-License-Identifier: Apache-2.0
/*
 * test_fakecuda.h - shared by the self test of the fake CUDA driver
 * (test_fakecuda.c: main, devices, contexts and memory; test_fakecuda_streams.c:
 * streams, events, threads, exports and the re-executed environment modes).
 *
 * Check macros, the helpers the sections use, and the few globals defined
 * once in test_fakecuda.c.
 */
#ifndef TEST_FAKECUDA_H
#define TEST_FAKECUDA_H

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

/* Defined once in test_fakecuda.c. */
extern const char *g_section;
extern CUcontext g_ctx0, g_ctx1;

void fail(int line, const char *what, const char *detail);

static inline const char *rc_name(CUresult rc) {
    const char *s = NULL;
    if (cuGetErrorName(rc, &s) != CUDA_SUCCESS || !s) return "(unknown CUresult)";
    return s;
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

static inline CUmemAllocationProp prop_for(int dev) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

static inline CUmemGenericAllocationHandle create(int dev, size_t size) {
    CUmemAllocationProp p = prop_for(dev);
    CUmemGenericAllocationHandle h = 0;
    OK(cuMemCreate(&h, size, &p, 0));
    CHECK(h != 0);
    return h;
}

static inline CUresult set_access(CUdeviceptr ptr, size_t size, int dev, CUmemAccess_flags f) {
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = dev;
    d.flags = f;
    return cuMemSetAccess(ptr, size, &d, 1);
}

static inline CUdeviceptr reserve(size_t size) {
    CUdeviceptr p = 0;
    OK(cuMemAddressReserve(&p, size, 0, 0, 0));
    CHECK(p != 0 && p % GRAN == 0);
    return p;
}

static inline unsigned char *H(CUdeviceptr p) {
    return (unsigned char *)(uintptr_t)p;
}

static inline void fill(CUdeviceptr p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i += 4096) H(p)[i] = (unsigned char)(seed + i / 4096);
}

static inline int check_fill(CUdeviceptr p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i += 4096)
        if (H(p)[i] != (unsigned char)(seed + i / 4096)) return 0;
    return 1;
}

/* Fork a child that reads or writes *p. Returns the child's fatal signal,
 * 0 if it survived, or -1 if it died some other way (a sanitizer's own
 * SEGV handler exits with an error code instead of the signal). */
static inline int child_touch(CUdeviceptr p, int write) {
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
static inline long long memfd_blocks(int dev) {
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
static inline int addr_occupied(CUdeviceptr p, size_t size) {
    void *q = mmap(H(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (q == MAP_FAILED) return errno == EEXIST;
    munmap(q, size);
    return 0;
}

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- sections defined in test_fakecuda_streams.c ----------------------- */

void test_streams(void);
void test_lag_and_default_streams(void);
void test_capture(void);
void test_proc_address(void);
void test_exports_and_counters(void);
void test_threads(void);
void test_env_modes(void);
int run_mode(const char *mode);

#endif /* TEST_FAKECUDA_H */
