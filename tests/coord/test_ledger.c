// SPDX-License-Identifier: Apache-2.0
/* The cross-process ledger: admission between heaps of one device, pressure requests answered
 * by giving the cache back and by pressure callbacks, priorities and guarantees, dead processes
 * (their slots, a lock held at death), a victim that does not answer (timeout), a ledger that is
 * not ours or not a ledger, and the snapshot the tools read. Heaps on the simulated device in a
 * ledger named for this run, so that runs side by side do not meet. */
#include "child.h"
#include "coord/pressure.h"
#include "heap/heap.h"
#include "cuma/ledger.h"
#include "cuma/sim.h"

#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static char ledger_name[64];
static char ledger_shm[128]; /* its shm_open name, for the abort handler */
static pid_t main_pid;

/* The children child_holding made, which wait to be killed: a failed check kills them too, so
 * that the failure is reported now, not when ctest's timeout ends the pipe they keep open. */
static volatile pid_t kids[32];
static volatile int nkids;

/* A failed check aborts: the run's ledger goes with it (in the children too, it stays). */
static void on_abort(int sig) {
    if (getpid() == main_pid) {
        shm_unlink(ledger_shm);
        for (int i = 0; i < nkids; i++)
            if (kids[i] > 0) kill(kids[i], SIGKILL);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void unlink_ledger(const char *name) {
    char path[128];
    CHECK_OK(cuma_ledger_path(name, path, sizeof path));
    shm_unlink(path + strlen("/dev/shm"));
}

/* A sim heap of 64M pages of 2M in this run's ledger, with extra settings. */
static cuma_heap *ledger_heap(const char *extra) {
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,ledger:%s,release_delay_ms:100000,tcache:off,arenas:1%s%s",
             ledger_name, *extra ? "," : "", extra);
    return heap_make(conf);
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static size_t live(cuma_ledger_entry *e, size_t max) {
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger_name, e, max, &n));
    return n;
}

/* Waits (5 s at most) until the ledger shows `cached` idle bytes for the heap in `slot` of
 * process `pid`: a heap publishes from its release thread, a few ms after the fact. */
static void wait_cached(int pid, int slot, uint64_t cached) {
    cuma_ledger_entry e[16];
    for (int i = 0; i < 5000; i++) {
        size_t n = live(e, 16);
        for (size_t k = 0; k < n && k < 16; k++)
            if (e[k].pid == pid && (slot < 0 || (int)e[k].slot == slot) && e[k].cached == cached)
                return;
        usleep(1000);
    }
    CHECK(!"the ledger never showed the heap's idle bytes");
}

/* Until the heap's count of bytes given to others' requests reaches `bytes`. The count lands
 * after the pages go (the release thread counts what its answer gave once it is done), so a
 * requester may have its memory, and go on, before the giver's figure says so. */
static void wait_given(cuma_heap *h, uint64_t bytes) {
    for (int i = 0; i < 10000; i++) {
        if (heap_stats(h).pressure_given_bytes >= bytes) return;
        usleep(1000);
    }
    fprintf(stderr, "given: %llu bytes, wanted %llu\n",
            (unsigned long long)heap_stats(h).pressure_given_bytes, (unsigned long long)bytes);
    CHECK(!"the heap never counted what it gave");
}

/* The heap's slot in the ledger (its stats JSON says). */
static int heap_slot(cuma_heap *h) {
    char js[8192];
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    const char *p = strstr(js, "\"slot\":");
    CHECK(p);
    return atoi(p + 7);
}

/* The stats' count of growths admitted without the ledger's lock. */
static uint64_t stale_admissions(cuma_heap *h) {
    char js[8192];
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    const char *p = strstr(js, "\"stale_admissions\":");
    CHECK(p);
    return strtoull(p + strlen("\"stale_admissions\":"), NULL, 10);
}

static const cuma_ledger_entry *find_pid(const cuma_ledger_entry *e, size_t n, int pid) {
    for (size_t i = 0; i < n; i++)
        if (e[i].pid == pid) return &e[i];
    return NULL;
}

/* Two heaps of one process share the device through the ledger: one cannot take what the
 * other holds in use; the other's idle cache is given back on request. */
static void test_admission_and_cache(void) {
    cuma_heap *a = ledger_heap(""), *b = ledger_heap("pressure_timeout_ms:3000");
    void *pa, *pb;
    CHECK_OK(cuma_alloc(a, 48 * MB, NULL, &pa));
    CHECK(heap_stats(b).ledger_room_bytes == 16 * MB && heap_stats(a).ledger_room_bytes == 16 * MB);
    /* 16M left and a holds the rest in use at the same priority: no point waiting. */
    /* It did not wait: it never asked (pressure_asks below), not "it was quick". */
    CHECK_ST(cuma_alloc(b, 32 * MB, NULL, &pb), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "out of memory"));
    cuma_stats sb = heap_stats(b);
    /* Pages made before the denial stay idle in its cache, where pressure can reach them. */
    CHECK(sb.ledger_denials >= 1 && sb.reserved_bytes == sb.cached_bytes && sb.pressure_asks == 0);
    CHECK_OK(cuma_alloc(b, 16 * MB, NULL, &pb)); /* what is left fits */
    CHECK_OK(cuma_free(b, pb, NULL));
    CHECK_OK(cuma_trim(b, 0));
    /* a's 48M go idle (its cache keeps them); b asks, a's release thread gives them back. */
    CHECK_OK(cuma_free(a, pa, NULL));
    CHECK(heap_stats(a).cached_bytes == 48 * MB);
    wait_cached(getpid(), heap_slot(a), 48 * MB); /* a publishes what is idle */
    CHECK_OK(cuma_alloc(b, 32 * MB, NULL, &pb));
    wait_given(a, 16 * MB);
    cuma_stats sa = heap_stats(a);
    sb = heap_stats(b);
    CHECK(sb.pressure_asks == 1 && sb.reserved_bytes == 32 * MB);
    CHECK(sa.pressure_given_bytes >= 16 * MB && sa.reserved_bytes <= 32 * MB);
    CHECK(sa.pressure_callbacks == 0); /* idle memory only: nobody was asked to shrink */
    cuma_ledger_entry e[8];
    size_t n = live(e, 8);
    CHECK(n == 2);
    uint64_t sum = e[0].reserved + e[1].reserved;
    CHECK(sum == sa.reserved_bytes + sb.reserved_bytes && sum <= 64 * MB);
    CHECK(e[0].pid == getpid() && !strcmp(e[0].device, "sim") && e[0].capacity == 64 * MB);
    CHECK_OK(cuma_validate(a));
    CHECK_OK(cuma_validate(b));
    CHECK_OK(cuma_free(b, pb, NULL));
    cuma_heap_destroy(a);
    cuma_heap_destroy(b);
    CHECK(live(e, 8) == 0); /* slots go with their heaps */
}

typedef struct victim {
    cuma_heap *h;
    void *blocks[20];
    int nblocks;
    _Atomic int calls;
    _Atomic uint64_t asked;
} victim;

/* The low-priority job halves its work: it frees blocks until it gave what was asked. */
static void shrink_cb(void *user, cuma_heap *heap, uint64_t bytes) {
    victim *v = user;
    CHECK(heap == v->h);
    atomic_fetch_add(&v->calls, 1);
    atomic_store(&v->asked, bytes);
    uint64_t freed = 0;
    while (freed < bytes && v->nblocks > 0) {
        CHECK_OK(cuma_free(heap, v->blocks[--v->nblocks], NULL));
        freed += 4 * MB;
    }
}

/* A heap of higher priority makes one of lower priority shrink to its guarantee (its pressure
 * callback frees memory in use); the guarantee itself is never asked for. */
static void test_priority_shrink(void) {
    victim v = {0};
    v.h = ledger_heap("priority:-1,guarantee:8M");
    CHECK_OK(cuma_add_pressure_callback(v.h, shrink_cb, &v, NULL));
    for (; v.nblocks < 10; v.nblocks++)
        CHECK_OK(cuma_alloc(v.h, 4 * MB, NULL, &v.blocks[v.nblocks]));
    cuma_heap *hi = ledger_heap("priority:5,pressure_timeout_ms:3000");
    void *p;
    CHECK_OK(cuma_alloc(hi, 40 * MB, NULL, &p)); /* 24M free + 16M of the victim's */
    CHECK(atomic_load(&v.calls) == 1);
    /* Asked for at most what it holds beyond its guarantee: 40M - 8M. */
    CHECK(atomic_load(&v.asked) <= 32 * MB && atomic_load(&v.asked) >= 16 * MB);
    cuma_stats sv = heap_stats(v.h), sh = heap_stats(hi);
    CHECK(sv.pressure_callbacks == 1 && sv.reserved_bytes >= 8 * MB);
    CHECK(sv.reserved_bytes + sh.reserved_bytes <= 64 * MB);
    /* The victim cannot take it back while the other holds it... */
    void *q;
    CHECK_ST(cuma_alloc(v.h, 24 * MB, NULL, &q), CUMA_ERR_OOM);
    /* ...and the high-priority heap cannot take the victim's guarantee. */
    CHECK_OK(cuma_free(v.h, v.blocks[--v.nblocks], NULL));
    while (v.nblocks > 0) CHECK_OK(cuma_free(v.h, v.blocks[--v.nblocks], NULL));
    CHECK_OK(cuma_trim(v.h, 0));
    CHECK(heap_stats(v.h).reserved_bytes == 0);
    CHECK_ST(cuma_alloc(hi, 24 * MB - 1, NULL, &q), CUMA_ERR_OOM); /* 40 + 24 > 64 - 8 */
    CHECK_OK(cuma_alloc(hi, 16 * MB, NULL, &q));
    CHECK_OK(cuma_validate(v.h));
    CHECK_OK(cuma_validate(hi));
    CHECK_OK(cuma_free(hi, q, NULL));
    CHECK_OK(cuma_free(hi, p, NULL));
    cuma_heap_destroy(hi);
    cuma_heap_destroy(v.h);
}

static void count_cb(void *user, cuma_heap *heap, uint64_t bytes) {
    (void)heap, (void)bytes;
    atomic_fetch_add((_Atomic int *)user, 1);
}

/* Cache first: a heap of low priority whose idle cache covers a request gives that and is not
 * asked to free memory in use (its pressure callback ran for a 90M request that its 100M of idle
 * cache covered). */
static void test_cache_first(void) {
    char conf[256];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:256M,ledger:%s,release_delay_ms:100000,tcache:off,arenas:1,"
             "priority:-1",
             ledger_name);
    cuma_heap *low = heap_make(conf);
    _Atomic int calls = 0;
    CHECK_OK(cuma_add_pressure_callback(low, count_cb, &calls, NULL));
    void *idle, *used, *p;
    CHECK_OK(cuma_alloc(low, 100 * MB, NULL, &used)); /* in use, beyond its (no) guarantee */
    CHECK_OK(cuma_alloc(low, 100 * MB, NULL, &idle));
    CHECK_OK(cuma_free(low, idle, NULL));
    wait_cached(getpid(), heap_slot(low), 100 * MB);
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:256M,ledger:%s,release_delay_ms:100000,tcache:off,arenas:1,"
             "priority:5,pressure_timeout_ms:3000",
             ledger_name);
    cuma_heap *hi = heap_make(conf);
    CHECK_OK(cuma_alloc(hi, 90 * MB, NULL, &p)); /* 56M free + 34M of low's cache */
    wait_given(low, 34 * MB);
    usleep(50000); /* a late callback would run within the release thread's next polls */
    cuma_stats sl = heap_stats(low);
    fprintf(stderr, "cache first: %d callbacks, %llu bytes given\n", atomic_load(&calls),
            (unsigned long long)sl.pressure_given_bytes);
    CHECK(atomic_load(&calls) == 0 && sl.pressure_callbacks == 0);
    CHECK(sl.pressure_given_bytes >= 34 * MB && sl.requested_bytes == 100 * MB);
    CHECK_OK(cuma_free(hi, p, NULL));
    CHECK_OK(cuma_free(low, used, NULL));
    cuma_heap_destroy(hi);
    cuma_heap_destroy(low);
}

/* Guarantees add up to the device at most; a heap takes nothing of another's guarantee, and a
 * heap under its guarantee gets memory back from a heap of higher priority. */
static void test_guarantees(void) {
    /* A heap of high priority holds 40M idle before g joins with a guarantee of 40M. */
    cuma_heap *hi = ledger_heap("priority:100");
    void *p[10], *q;
    for (int i = 0; i < 10; i++) CHECK_OK(cuma_alloc(hi, 4 * MB, NULL, &p[i]));
    for (int i = 0; i < 10; i++) CHECK_OK(cuma_free(hi, p[i], NULL));
    cuma_heap *g = ledger_heap("guarantee:40M,pressure_timeout_ms:3000");
    char conf[256];
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,ledger:%s,guarantee:32M", ledger_name);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *x = NULL;
    CHECK_ST(cuma_heap_create(&cfg, &x), CUMA_ERR_LIMIT); /* 40 + 32 > 64 */
    CHECK(strstr(cuma_last_error(), "guarantee") && strstr(cuma_last_error(), ledger_name));
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,ledger:%s,guarantee:1G", ledger_name);
    CHECK_ST(cuma_heap_create(&cfg, &x), CUMA_ERR_CONFIG);
    /* What the ledger would still admit: nothing for hi (g's guarantee is the rest), and for g
     * what is free now (hi's cache comes on request). */
    CHECK(heap_stats(hi).ledger_room_bytes == 0 && heap_stats(g).ledger_room_bytes == 24 * MB);
    /* hi may not grow into g's unused guarantee (its own cache serves it, nothing more)... */
    for (int i = 0; i < 10; i++) CHECK_OK(cuma_alloc(hi, 4 * MB, NULL, &p[i]));
    CHECK_ST(cuma_alloc(hi, 4 * MB, NULL, &q), CUMA_ERR_OOM);
    CHECK(heap_stats(hi).ledger_denials >= 1);
    for (int i = 0; i < 10; i++) CHECK_OK(cuma_free(hi, p[i], NULL));
    wait_cached(getpid(), heap_slot(hi), 40 * MB);
    /* ...and g, under its guarantee, gets hi's idle cache although hi's priority is higher. */
    CHECK_OK(cuma_alloc(g, 40 * MB, NULL, &q));
    CHECK(heap_stats(g).reserved_bytes == 40 * MB && heap_stats(g).pressure_asks == 1);
    CHECK(heap_stats(hi).reserved_bytes <= 24 * MB);
    CHECK_OK(cuma_validate(g));
    CHECK_OK(cuma_validate(hi));
    CHECK_OK(cuma_free(g, q, NULL));
    cuma_heap_destroy(hi);
    cuma_heap_destroy(g);
}

enum { LOCK_NONE, LOCK_DIE, LOCK_STOP };

/* A child process: a heap in the ledger holding `mb` in use (freed to the cache when `idle`),
 * then it tells the parent and waits to be killed; or takes the ledger's lock and dies, or
 * stops, holding it. */
static pid_t child_holding(const char *extra, int mb, bool idle, int lock_mode) {
    int fd;
    pid_t pid = child_fork(&fd);
    if (pid == 0) {
        cuma_heap *h = ledger_heap(extra);
        void *p;
        CHECK_OK(cuma_alloc(h, (size_t)mb * MB, NULL, &p));
        if (idle) CHECK_OK(cuma_free(h, p, NULL));
        if (lock_mode != LOCK_NONE) CHECK_OK(cuma_ledger_test_hold_lock(cuma_heap_ledger(h)));
        char c = 1;
        CHECK(write(fd, &c, 1) == 1);
        if (lock_mode == LOCK_DIE) _exit(0);
        if (lock_mode == LOCK_STOP) raise(SIGSTOP);
        for (;;) pause();
    }
    if (nkids < 32) kids[nkids++] = pid;
    char c;
    CHECK(read(fd, &c, 1) == 1);
    close(fd);
    return pid;
}

static bool is_zombie(pid_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool z = fgets(buf, sizeof buf, f) && strrchr(buf, ')') && strrchr(buf, ')')[2] == 'Z';
    fclose(f);
    return z;
}

/* A child waited for: its pid may be another process's now. */
static void forget_kid(pid_t pid) {
    for (int i = 0; i < nkids; i++)
        if (kids[i] == pid) kids[i] = 0;
}

static void reap_child(pid_t pid) {
    kill(pid, SIGKILL);
    CHECK(waitpid(pid, NULL, 0) == pid);
    forget_kid(pid);
}

/* Other processes: a victim of lower priority gives its cache back; one that is stopped does not
 * answer and the request times out; a dead one's slot is reclaimed, also when it died holding
 * the ledger's lock. */
static void test_processes(void) {
    cuma_ledger_entry e[8];
    pid_t c = child_holding("priority:-5", 48, true, LOCK_NONE);
    size_t n = live(e, 8);
    CHECK(n == 1 && e[0].pid == c && e[0].reserved == 48 * MB && e[0].priority == -5);
    cuma_heap *h = ledger_heap("priority:5,pressure_timeout_ms:3000");
    void *p;
    wait_cached(c, -1, 48 * MB);
    CHECK_OK(cuma_alloc(h, 40 * MB, NULL, &p));
    /* The victim counts what it gave (cuma_ledger_gave) after its release, which admitted this
     * allocation already: under load the count comes a moment later (it failed in 1 of a
     * loaded run's ASan phases when read at once). */
    const cuma_ledger_entry *ce = NULL;
    for (int i = 0; i < 20000; i++) {
        n = live(e, 8);
        ce = find_pid(e, n, c);
        if (ce && ce->pressure_given_bytes >= 24 * MB) break;
        usleep(1000);
    }
    CHECK(ce && ce->pressure_given_bytes >= 24 * MB && ce->reserved <= 24 * MB);
    CHECK(heap_stats(h).pressure_asks == 1);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    /* Killed and not yet waited for (a zombie: kill(pid, 0) still succeeds): its slot goes. */
    kill(c, SIGKILL);
    for (int i = 0; i < 2000 && !is_zombie(c); i++) usleep(1000);
    CHECK(is_zombie(c));
    n = live(e, 8);
    CHECK(!find_pid(e, n, c));
    CHECK(waitpid(c, NULL, 0) == c);
    forget_kid(c);

    /* A victim that holds its cache and does not run: the request times out. */
    c = child_holding("priority:-5", 48, true, LOCK_NONE);
    wait_cached(c, -1, 48 * MB);
    kill(c, SIGSTOP);
    int wst;
    CHECK(waitpid(c, &wst, WUNTRACED) == c && WIFSTOPPED(wst)); /* stopped, not stopping */
    cuma_heap_destroy(h);
    h = ledger_heap("priority:5,pressure_timeout_ms:200");
    uint64_t t0 = now_ms();
    CHECK_ST(cuma_alloc(h, 40 * MB, NULL, &p), CUMA_ERR_OOM);
    uint64_t waited = now_ms() - t0;
    fprintf(stderr, "stopped victim: the request gave up after %llu ms\n",
            (unsigned long long)waited);
    CHECK(waited >= 200 && waited < 30000); /* gave up, and not before its timeout */
    CHECK(heap_stats(h).pressure_asks == 1);
    n = live(e, 8);
    CHECK((ce = find_pid(e, n, getpid())) && ce->want == 0); /* withdrawn */
    kill(c, SIGCONT);
    reap_child(c);
    /* Dead: its 48M are the device's again at once. */
    CHECK_OK(cuma_alloc(h, 40 * MB, NULL, &p));
    CHECK(live(e, 8) == 1);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));

    /* Killed holding the lock: the next locker goes on and frees its slot. */
    c = child_holding("", 32, false, LOCK_DIE);
    CHECK(waitpid(c, NULL, 0) == c);
    forget_kid(c);
    CHECK_OK(cuma_alloc(h, 48 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));

    /* Stopped holding the lock (the lock's generation stands still): after a bounded wait the
     * others go on in stale mode, admitting against an unlocked read, counted in the stats;
     * a heap still joins; no allocation fails for the lock (it failed every growth after 2 s).
     * Once the holder is gone, the lock is taken again. */
    cuma_ledger_read_info info;
    CHECK_OK(cuma_ledger_snapshot_info(ledger_name, e, 8, &n, &info));
    CHECK(info.flags == 0 && info.stuck_ns == 0); /* under the lock */
    c = child_holding("", 8, false, LOCK_STOP);
    CHECK(waitpid(c, &wst, WUNTRACED) == c && WIFSTOPPED(wst));
    uint64_t t1 = now_ms();
    CHECK_OK(cuma_alloc(h, 32 * MB, NULL, &p));
    fprintf(stderr, "stopped lock holder: the first allocation went on after %llu ms\n",
            (unsigned long long)(now_ms() - t1));
    CHECK(stale_admissions(h) >= 1);
    cuma_heap *late = ledger_heap(""); /* joins without the lock */
    void *lp;
    CHECK_OK(cuma_alloc(late, 8 * MB, NULL, &lp));
    CHECK(stale_admissions(late) >= 1);
    CHECK(live(e, 8) == 3); /* the tools read the ledger as it is */
    /* ...and are told it was read without the lock, and for how long it has stood still: at
     * least the allocation's wait of LEDGER_STALL_MS (2 s). */
    CHECK_OK(cuma_ledger_snapshot_info(ledger_name, e, 8, &n, &info));
    CHECK(n == 3 && (info.flags & CUMA_LEDGER_READ_UNLOCKED));
    CHECK(info.stuck_ns >= 2000000000u);
    uint64_t stuck_before = info.stuck_ns;
    CHECK_OK(cuma_ledger_snapshot_info(ledger_name, e, 8, &n, &info));
    CHECK((info.flags & CUMA_LEDGER_READ_UNLOCKED) && info.stuck_ns >= stuck_before);
    CHECK_OK(cuma_free(late, lp, NULL));
    cuma_heap_destroy(late);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    reap_child(c);
    uint64_t before = stale_admissions(h);
    CHECK_OK(cuma_alloc(h, 48 * MB, NULL, &p));
    CHECK(stale_admissions(h) == before); /* the lock again */
    CHECK_OK(cuma_ledger_snapshot_info(ledger_name, e, 8, &n, &info));
    CHECK(n == 1 && e[0].pid == getpid());
    CHECK(info.flags == 0 && info.stuck_ns == 0); /* locked again, the holder's slot reclaimed */
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
}

/* Files at the ledger's name that are not a ledger of ours are refused with the path named. */
static void test_bad_files(void) {
    char name[80], path[128], conf[256];
    snprintf(name, sizeof name, "%s-bad", ledger_name);
    CHECK_OK(cuma_ledger_path(name, path, sizeof path));
    const char *shm = path + strlen("/dev/shm");
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,ledger:%s", name);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *x = NULL;
    /* Readable by others. */
    int fd = shm_open(shm, O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0);
    CHECK(fchmod(fd, 0644) == 0);
    CHECK_ST(cuma_heap_create(&cfg, &x), CUMA_ERR_IO);
    CHECK(strstr(cuma_last_error(), "mode 0600") && strstr(cuma_last_error(), path));
    CHECK(fchmod(fd, 0600) == 0);
    /* Too small and not empty (a file of zeros is one whose maker died: made again), then the
     * right size with another layout's version. */
    CHECK(write(fd, "not a ledger, no", 16) == 16);
    CHECK_ST(cuma_heap_create(&cfg, &x), CUMA_ERR_CORRUPT);
    {
        struct stat sb;
        CHECK(fstat(fd, &sb) == 0 && sb.st_size == 16); /* left as it was */
    }
    cuma_heap *good = ledger_heap("");
    size_t size, size_n;
    {
        char gp[128];
        struct stat sb;
        CHECK_OK(cuma_ledger_path(ledger_name, gp, sizeof gp));
        CHECK(stat(gp, &sb) == 0);
        size = (size_t)sb.st_size;
    }
    cuma_heap_destroy(good);
    CHECK(ftruncate(fd, (off_t)size) == 0);
    uint64_t *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED);
    m[0] = 0x3152474c414d5543ull; /* the magic, then version 99 */
    m[1] = 99;
    CHECK_ST(cuma_heap_create(&cfg, &x), CUMA_ERR_CORRUPT);
    CHECK(strstr(cuma_last_error(), "layout version 99"));
    /* No magic at all (a creator of an older cuma that died before finishing): a reader is
     * told it is being made; the next heap makes it again. */
    memset(m, 0, size);
    CHECK_ST(cuma_ledger_snapshot(name, NULL, 0, &size_n), CUMA_ERR_IO);
    CHECK(strstr(cuma_last_error(), "being made") && strstr(cuma_last_error(), path));
    CHECK_OK(cuma_heap_create(&cfg, &x));
    cuma_heap_destroy(x);
    munmap(m, size);
    close(fd);
    shm_unlink(shm);
    /* Names: a bad one is a config error; a ledger nobody made cannot be read. */
    CHECK_ST(cuma_config_check("ledger:a/b"), CUMA_ERR_CONFIG);
    CHECK_ST(cuma_config_check("priority:1001"), CUMA_ERR_CONFIG);
    CHECK_OK(cuma_config_check("priority:-1000,guarantee:1G,ledger:off"));
    size_t n;
    CHECK_ST(cuma_ledger_snapshot("cuma-test-nobody-made-this", NULL, 0, &n), CUMA_ERR_IO);
    CHECK(strstr(cuma_last_error(), "cuma-test-nobody-made-this"));
}

/* A ledger scribbled over (a broken process, a stray write): slots of random bytes, some marked
 * live with pids that are no process (0, negative, dead), some with this process's pid and
 * absurd sizes, two from another PID namespace. Nothing crashes; the dead go at the next look; live
 * nonsense makes the device look full (sums saturate), never empty; once it is gone, everything
 * works again. Seeded. */
static void test_garbage_slots(void) {
    uint64_t seed = test_seed(), s = seed;
    cuma_heap *h = ledger_heap("pressure_timeout_ms:20");
    char path[128];
    CHECK_OK(cuma_ledger_path(ledger_name, path, sizeof path));
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    size_t hdr, slot, devoff, nsoff;
    cuma_ledger_test_layout(&hdr, &slot, &devoff, &nsoff);
    size_t size = hdr + 256 * slot;
    unsigned char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED);
    cuma_ledger_entry e[256];
    size_t n = live(e, 256);
    CHECK(n == 1);
    unsigned mine = e[0].slot;
    uint64_t my_start = 0;
    {
        char buf[1024];
        FILE *f = fopen("/proc/self/stat", "r");
        CHECK(f && fgets(buf, sizeof buf, f));
        fclose(f);
        char *q = strrchr(buf, ')') + 2; /* field 3 */
        for (int fld = 3; fld < 22; fld++) q = strchr(q, ' ') + 1;
        my_start = strtoull(q, NULL, 10);
        CHECK(my_start > 0);
    }
    for (unsigned i = 0; i < 256; i++) {
        if (i == mine) continue;
        unsigned char *p = m + hdr + (size_t)i * slot;
        for (size_t k = 0; k < slot; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            p[k] = (unsigned char)s;
        }
        uint32_t state = i % 3 ? 1 : (uint32_t)s;
        int32_t pid = i % 5 == 0   ? 0
                      : i % 5 == 1 ? -(int32_t)i
                      : i % 5 == 2 ? 999999999
                                   : (int32_t)s;
        if (i == 7 || i == 9) { /* this live process, its start time right: it stays */
            state = 1;
            pid = (int32_t)getpid();
            memcpy(p + 8, &my_start, 8);
            if (i == 7) memcpy(p + devoff, "sim", 4); /* and on this device, with nonsense sizes */
        }
        memcpy(p, &state, 4);
        memcpy(p + 4, &pid, 4);
        /* Judged by pid (namespace unknown), but for two slots of another PID namespace, which
         * nobody here can judge: they stay. */
        uint64_t ns = i == 11 || i == 13 ? 0x5eed0000ull + i : 0;
        if (i == 11 || i == 13) state = 1, memcpy(p, &state, 4);
        memcpy(p + nsoff, &ns, 8);
    }
    n = live(e, 256); /* reaps the dead, copies the rest without trusting their strings */
    size_t mine_seen = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(strlen(e[i].process) < sizeof e[i].process &&
              strlen(e[i].device) < sizeof e[i].device);
        mine_seen += e[i].pid == getpid();
    }
    CHECK(mine_seen == 3 && n == 5);
    fprintf(stderr, "garbage slots: %zu of 255 still look live after the first look\n", n - 1);
    /* Whatever the nonsense on this device says, an allocation fails or succeeds cleanly. */
    void *p;
    uint64_t claimed = 0;
    for (size_t i = 0; i < n; i++)
        if (e[i].slot != mine && !strcmp(e[i].device, "sim"))
            claimed += e[i].reserved > e[i].guarantee ? e[i].reserved : e[i].guarantee;
    cuma_status st = cuma_alloc(h, 4 * MB, NULL, &p);
    CHECK(st == CUMA_OK || st == CUMA_ERR_OOM);
    if (claimed > 60 * MB) CHECK(st == CUMA_ERR_OOM); /* huge or wrapping sums: full, not empty */
    if (!st) CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_validate(h));
    /* The ones that claim this live process hold nothing real: an operator would remove them
     * (here: zeroed); then the device is the heap's again. */
    for (unsigned i = 0; i < 256; i++)
        if (i != mine) memset(m + hdr + (size_t)i * slot, 0, slot);
    CHECK(live(e, 256) == 1);
    CHECK_OK(cuma_alloc(h, 48 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_validate(h));
    munmap(m, size);
    close(fd);
    cuma_heap_destroy(h);
}

/* ledger:auto leaves a simulated heap out; a guarantee without a ledger is refused. */
static void test_auto(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M");
    char js[8192];
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    CHECK(strstr(js, "\"ledger\":null") && heap_stats(h).ledger_room_bytes == UINT64_MAX);
    cuma_heap_destroy(h);
    h = ledger_heap("priority:3,guarantee:2M");
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    CHECK(strstr(js, "\"priority\":3,\"guarantee\":2097152"));
    cuma_heap_destroy(h);
}

/* When the heap's release thread means to run the release policy next (heap clock). */
static uint64_t thread_plan(cuma_heap *h) {
    pthread_mutex_lock(&h->first.lock);
    uint64_t at = h->first.thread_wake_at;
    pthread_mutex_unlock(&h->first.lock);
    return at;
}

/* The release thread looks at the ledger every few ms but runs the release policy only when it
 * is due: a free must still bring its plan forward when its memory is due before the policy's
 * next run. The thread of an idle heap plans a run a second away; a page freed then with a
 * 100 ms delay must move the plan before that second (checked on the plan, heap clock, not on
 * how fast the memory came back), and goes back no earlier than its delay. An attempt whose main
 * thread was held up past the first plan (a loaded machine) says so and tries again; a thread
 * that keeps its plan fails every attempt. */
static bool release_on_time_once(int attempt) {
    cuma_heap *h = ledger_heap("release_delay_ms:100,fragmentation_threshold:0");
    usleep(50000); /* the thread settles into its long sleep */
    uint64_t first = thread_plan(h), t;
    CHECK_OK(cuma_sim_get_time(h, &t));
    bool ok = false;
    if (first != 0 && first > t + 200000000ull) {
        void *p;
        CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
        CHECK_OK(cuma_free(h, p, NULL));
        uint64_t t0 = now_ms(), at, tn = t;
        while ((at = thread_plan(h)) >= first && tn < first + 2000000000ull) {
            usleep(1000);
            CHECK_OK(cuma_sim_get_time(h, &tn));
        }
        ok = at < first;
        while (heap_stats(h).reserved_bytes && now_ms() - t0 < 20000) usleep(2000);
        uint64_t took = now_ms() - t0;
        fprintf(stderr,
                "attempt %d: the release thread %s; the memory went back %llu ms after its free "
                "(delay 100 ms)\n",
                attempt, ok ? "planned its run anew" : "kept its plan a second away",
                (unsigned long long)took);
        CHECK(heap_stats(h).reserved_bytes == 0);
        CHECK(took >= 90); /* not before its delay */
        cuma_ledger_entry e[4];
        wait_cached(getpid(), heap_slot(h), 0);
        CHECK(live(e, 4) == 1 && e[0].reserved == 0);
    } else {
        fprintf(stderr, "attempt %d: held up past the thread's first plan, no test\n", attempt);
    }
    cuma_heap_destroy(h);
    return ok;
}

static void test_release_on_time(void) {
    bool ok = false;
    for (int attempt = 1; attempt <= 3 && !ok; attempt++) ok = release_on_time_once(attempt);
    CHECK(ok);
}

/* A requester that stops while it waits (Ctrl-Z, a debugger, a suspended job) never withdraws
 * its request: it must hold nobody back past its timeout. Another heap of the same priority
 * stops throwing its cache away, and one of lower priority may grow again. */
static void noop_pressure(void *user, cuma_heap *h, uint64_t bytes) {
    (void)user, (void)h, (void)bytes; /* a job that is asked, and does not give */
}

static void test_stale_request(void) {
    cuma_heap *low = ledger_heap("priority:-1");
    CHECK_OK(cuma_add_pressure_callback(low, noop_pressure, NULL, NULL));
    void *p, *q;
    CHECK_OK(cuma_alloc(low, 40 * MB, NULL, &p)); /* in use, beyond its (no) guarantee */
    int fd;
    pid_t c = child_fork(&fd);
    if (c == 0) {
        cuma_heap *r = ledger_heap("pressure_timeout_ms:300");
        char ch = 1;
        CHECK(write(fd, &ch, 1) == 1);
        void *x; /* 24M free, low could give 40: asks, and waits up to 300 ms */
        (void)cuma_alloc(r, 32 * MB, NULL, &x);
        _exit(0);
    }
    char ch;
    CHECK(read(fd, &ch, 1) == 1);
    close(fd);
    cuma_ledger_entry e[8];
    size_t n = 0;
    const cuma_ledger_entry *ce = NULL;
    for (int i = 0; i < 3000 && !ce; i++) { /* until its request is posted */
        n = live(e, 8);
        ce = find_pid(e, n, c);
        if (ce && !ce->want) ce = NULL;
        if (!ce) usleep(1000);
    }
    CHECK(ce);
    kill(c, SIGSTOP);
    int wst;
    CHECK(waitpid(c, &wst, WUNTRACED) == c && WIFSTOPPED(wst));
    /* While the request counts, the lower-priority heap may not grow into what it waits for. */
    cuma_status st = cuma_alloc(low, 16 * MB, NULL, &q);
    n = live(e, 8);
    ce = find_pid(e, n, c);
    if (ce && ce->want) CHECK(st == CUMA_ERR_OOM);
    if (!st) CHECK_OK(cuma_free(low, q, NULL));
    usleep(500000); /* past its 300 ms */
    n = live(e, 8);
    CHECK((ce = find_pid(e, n, c)) && ce->want == 0); /* still there, its request expired */
    /* Now it grows into the free 24M: the stopped request holds nobody back. */
    CHECK_OK(cuma_alloc(low, 16 * MB, NULL, &q));
    CHECK_OK(cuma_free(low, q, NULL));
    /* And a heap of the stopped one's priority keeps its cache: nobody asks for it. */
    cuma_heap *same = ledger_heap("");
    void *r;
    CHECK_OK(cuma_alloc(same, 8 * MB, NULL, &r));
    CHECK_OK(cuma_free(same, r, NULL));
    wait_cached(getpid(), heap_slot(same), 8 * MB);
    usleep(30000);
    CHECK(heap_stats(same).cached_bytes == 8 * MB && heap_stats(same).pressure_given_bytes == 0);
    kill(c, SIGKILL);
    CHECK(waitpid(c, NULL, 0) == c);
    forget_kid(c);
    CHECK_OK(cuma_free(low, p, NULL));
    cuma_heap_destroy(same);
    cuma_heap_destroy(low);
}

/* A heap inherited through fork is its parent's: the child can neither grow it in the ledger nor
 * free the parent's slot (nor change its figures). */
static void test_fork_inherits_no_slot(void) {
    cuma_heap *h = ledger_heap("release_thread:off");
    void *p;
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_alloc(h, 16 * MB, NULL, &p));
    pid_t c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        void *x;
        cuma_status st = cuma_alloc(h, 16 * MB, NULL, &x); /* needs new pages: refused */
        if (st == CUMA_OK || !strstr(cuma_last_error(), "fork")) _exit(3);
        cuma_heap_destroy(h); /* leaves nothing of the parent's */
        _exit(0);
    }
    int wst;
    CHECK(waitpid(c, &wst, 0) == c && WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    cuma_ledger_entry e[4];
    CHECK(live(e, 4) == 1 && e[0].pid == getpid() && e[0].reserved == 16 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
    CHECK(live(e, 4) == 0);
}

/* A heap that cannot answer (no release thread) holds its cache where nobody can ask for it: a
 * requester does not wait for it. */
static void test_no_answer_no_wait(void) {
    cuma_heap *a = ledger_heap("release_thread:off");
    cuma_heap *b = ledger_heap("pressure_timeout_ms:3000");
    void *p;
    CHECK_OK(cuma_alloc(a, 48 * MB, NULL, &p));
    CHECK_OK(cuma_free(a, p, NULL));
    CHECK_ST(cuma_alloc(b, 32 * MB, NULL, &p), CUMA_ERR_OOM);
    CHECK(heap_stats(b).pressure_asks == 0); /* never asked, so never waited */
    cuma_heap_destroy(b);
    cuma_heap_destroy(a);
}

/* usage: test_ledger [inprocess]: `inprocess` leaves out the tests that fork while the process
 * has threads (ThreadSanitizer cannot follow a child that starts threads then). */
/* A heap in a ledger on its own clock (sim_clock:manual) hands that clock to the simulated
 * device under the ledger's wrapper, as a heap outside a ledger does: page calls that cost
 * sim_call_us are counted on it, exactly, and nothing is left in the error message. (The heap
 * told the device by its name, which the wrapper shares, and gave the clock to the wrapper,
 * which refused it: page_call_ns stayed 0 and pacing was off.) */
static void test_manual_clock(void) {
    cuma_heap *h = ledger_heap("sim_clock:manual,sim_call_us:20");
    CHECK(!*cuma_last_error());
    CHECK_OK(cuma_sim_set_time(h, 1000000000ull));
    void *p;
    CHECK_OK(cuma_alloc(h, 8u << 20, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats s = heap_stats(h);
    CHECK(s.page_creates > 0 && s.maps > 0);
    CHECK(s.page_call_ns == 20000ull * (s.page_creates + s.page_releases + s.maps + s.unmaps));
    cuma_heap_destroy(h);
}

int main(int argc, char **argv) {
    bool forks = !(argc > 1 && !strcmp(argv[1], "inprocess"));
    snprintf(ledger_name, sizeof ledger_name, "test-%d", (int)getpid());
    unlink_ledger(ledger_name);
    main_pid = getpid();
    {
        char path[128];
        CHECK_OK(cuma_ledger_path(ledger_name, path, sizeof path));
        snprintf(ledger_shm, sizeof ledger_shm, "%s", path + strlen("/dev/shm"));
    }
    signal(SIGABRT, on_abort);
    test_auto();
    test_manual_clock();
    test_release_on_time();
    test_no_answer_no_wait();
    test_fork_inherits_no_slot();
    test_admission_and_cache();
    test_priority_shrink();
    test_guarantees();
    test_cache_first();
    if (forks) {
        test_processes();
        test_stale_request();
    }
    test_bad_files();
    test_garbage_slots();
    unlink_ledger(ledger_name);
    printf("test_ledger: ok\n");
    return 0;
}
