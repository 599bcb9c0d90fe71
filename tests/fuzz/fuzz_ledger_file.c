// SPDX-License-Identifier: Apache-2.0
/* The ledger's file in shared memory (src/coord/ledger_file.c, ledger.c) read by
 * cuma_ledger_snapshot after someone scribbled over it.
 *
 * The first byte chooses how the file is made; the file has a name of this process's own, so
 * that no real heap's ledger is touched, and is removed after each input.
 * - raw (bit 0 clear): the rest of the input is the file, optionally zero-extended to a chosen
 *   size (bits 4-5: as is, a header, the full layout);
 * - slots (bit 0 set): a valid header of this build's layout, and the rest of the input laid
 *   over the slots from the first one on; bit 2 then spoils one header field.
 * Bit 1 makes the file readable by the group, which the ledger must refuse. Bits 6-7 choose how
 * many entries the caller has room for.
 * - live (bit 3 set, bit 0 clear): the ledger is made by two heaps joining it (this process's
 *   handles), and the rest of the input is a script: the heaps' calls (admit, give back,
 *   publish, ask, reclaim, validate, snapshot) between which a second writer changes the file
 *   under them: truncates it (into the header, the slots, to nothing), writes bytes anywhere,
 *   restores its size or a valid header.
 *
 * Invariants checked in live mode: nothing crashes or hangs (no SIGBUS on a truncated file, no
 * loop over a slot count the writer chose); an admission is CUMA_OK or CUMA_ERR_OOM with a
 * message; a heap's own figures (cuma_ledger_self) stay what it did, whatever the file says;
 * a snapshot fails with a message or counts at most LEDGER_SLOTS heaps; validate fails only
 * with CUMA_ERR_CORRUPT.
 *
 * Invariants checked:
 * - the snapshot returns CUMA_OK, or an error with a message; CUMA_ERR_IO for a file others can
 *   read; CUMA_OK for a file with this build's header;
 * - the entries are in slot order, at most max of them, with NUL-terminated strings, a
 *   fragmentation within [0, 1], and the figures of the slot they came from; *n counts exactly
 *   the slots marked live after the call;
 * - the call changes a slot only to clear it whole (a dead process's), and only a live one; a slot
 *   left live has a positive pid unless another PID namespace wrote it (kill(0 or -n) would ask
 *   about process groups).
 */
#include "fuzz.h"

#include "coord/ledger.h"
#include "util/error.h"
#include "coord/ledger_shm.h"
#include "cuma/ledger.h"

#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static char name[32], path[128];
static uint64_t pidns;

static void init_once(void) {
    if (*name) return;
    snprintf(name, sizeof name, "fz-%d", (int)getpid());
    FZ_CHECK(cuma_ledger_path(name, path, sizeof path) == CUMA_OK, "ledger path of %s", name);
    struct stat sb;
    pidns = stat("/proc/self/ns/pid", &sb) ? 0 : (uint64_t)sb.st_ino;
}

/* Spoils one of the header fields that say which layout the file has. */
static void spoil_header(ledger_shm *m, fz_reader *r) {
    uint8_t which = fz_u8(r);
    uint32_t v = fz_u32(r);
    switch (which % 6) {
    case 0:
        atomic_store(&m->magic, LEDGER_MAGIC ^ ((uint64_t)v | 1));
        break;
    case 1:
        m->version = v == LEDGER_VERSION ? v + 1 : v;
        break;
    case 2:
        m->nslots = v == LEDGER_SLOTS ? v + 1 : v;
        break;
    case 3:
        m->slot_size = v == sizeof(ledger_slot) ? v + 1 : v;
        break;
    case 4:
        m->header_size = v == sizeof(ledger_shm) ? v + 1 : v;
        break;
    default:
        m->size = v == LEDGER_BYTES ? v + 1ull : v;
    }
}

static bool cleared(const ledger_slot *s) {
    static const ledger_slot zero;
    return !memcmp(s, &zero, offsetof(ledger_slot, spare));
}

static void check_entries(const ledger_shm *m, const ledger_slot *before,
                          const cuma_ledger_entry *e, size_t got, size_t n) {
    size_t live = 0;
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        const ledger_slot *s = &m->slot[i], *b = &before[i];
        bool same = !memcmp(s, b, sizeof *s);
        FZ_CHECK(same || (atomic_load(&b->state) == 1 && cleared(s)),
                 "slot %u (state %u, pid %d) changed, but not by being cleared", i,
                 (unsigned)atomic_load(&b->state), b->pid);
        if (atomic_load(&s->state) != 1) continue;
        live++;
        FZ_CHECK(s->pid > 0 || (s->pidns && pidns && s->pidns != pidns),
                 "slot %u kept with pid %d of this namespace", i, s->pid);
    }
    FZ_CHECK(n == live, "snapshot counted %zu heaps, %zu slots are live", n, live);
    for (size_t k = 0; k < got; k++) {
        FZ_CHECK(e[k].slot < LEDGER_SLOTS && (!k || e[k].slot > e[k - 1].slot),
                 "entry %zu is slot %u after slot %u", k, e[k].slot, k ? e[k - 1].slot : 0);
        const ledger_slot *s = &m->slot[e[k].slot];
        FZ_CHECK(atomic_load(&s->state) == 1, "entry %zu is a free slot", k);
        FZ_CHECK(memchr(e[k].process, 0, sizeof e[k].process) &&
                     memchr(e[k].device, 0, sizeof e[k].device) &&
                     memchr(e[k].backend, 0, sizeof e[k].backend),
                 "entry %zu has an unterminated string", k);
        FZ_CHECK(!strncmp(e[k].device, s->device, sizeof e[k].device - 1) &&
                     !strncmp(e[k].process, s->process, sizeof e[k].process - 1),
                 "entry %zu's names are not its slot's", k);
        FZ_CHECK(e[k].pid == s->pid && e[k].priority == s->priority &&
                     e[k].capacity == s->capacity && e[k].guarantee == s->guarantee &&
                     e[k].reserved == atomic_load(&s->reserved) &&
                     e[k].requested == atomic_load(&s->requested) &&
                     e[k].page_size == atomic_load(ledger_figure(s, LEDGER_FIG_page_size)) &&
                     e[k].arenas == atomic_load(ledger_figure(s, LEDGER_FIG_arenas)),
                 "entry %zu's figures are not slot %u's", k, e[k].slot);
        FZ_CHECK(e[k].fragmentation >= 0 && e[k].fragmentation <= 1, "entry %zu: fragmentation %g",
                 k, e[k].fragmentation);
    }
}

#define LIVE_OPS 64

static cuma_ledger *live_join(int priority) {
    cuma_ledger_join_info in = {.name = name,
                                .device = "fuzz-device",
                                .backend = "sim",
                                .capacity = 1ull << 30,
                                .priority = priority};
    cuma_ledger *l = NULL;
    cuma_status st = cuma_ledger_join(&in, &l);
    FZ_CHECK(st == CUMA_OK || *cuma_last_error(), "join failed (%d) without a message", (int)st);
    return st ? NULL : l;
}

/* Two heaps, and a second writer changing the file between their calls. */
static void run_live(fz_reader *r) {
    cuma_ledger *h[2] = {live_join(0), live_join(1)};
    FZ_CHECK(h[0] && h[1], "joining a fresh ledger failed: %s", cuma_last_error());
    uint64_t held[2] = {0, 0};
    int fd = open(path, O_RDWR | O_CLOEXEC);
    FZ_CHECK(fd >= 0, "open %s", path);
    for (int op = 0; op < LIVE_OPS && fz_more(r); op++) {
        uint8_t code = fz_u8(r);
        unsigned k = code >> 7;
        uint32_t v = fz_u32(r);
        switch (code % 12) {
        case 0: /* the writer truncates: to v within the layout, or a little past it */
            FZ_CHECK(!ftruncate(fd, (off_t)(v % (LEDGER_BYTES + 64))), "ftruncate");
            break;
        case 1: { /* the writer writes up to 16 input bytes at v */
            uint8_t buf[16];
            size_t n = fz_u8(r) % 17;
            for (size_t i = 0; i < n; i++) buf[i] = fz_u8(r);
            if (n) FZ_CHECK(pwrite(fd, buf, n, (off_t)(v % LEDGER_BYTES)) == (ssize_t)n, "pwrite");
            break;
        }
        case 2: /* the writer gives the file its size back (zeros where it was cut) */
            FZ_CHECK(!ftruncate(fd, (off_t)LEDGER_BYTES), "ftruncate");
            break;
        case 3: { /* the writer writes a valid header */
            ledger_shm hd;
            memset(&hd, 0, sizeof hd);
            cuma_ledger_init_header(&hd);
            FZ_CHECK(pwrite(fd, &hd, sizeof hd, 0) == (ssize_t)sizeof hd, "pwrite header");
            break;
        }
        case 4: { /* admit */
            uint64_t bytes = (uint64_t)(v % 512) << 20;
            cuma_status st = cuma_ledger_admit(h[k], bytes);
            FZ_CHECK(st == CUMA_OK || (st == CUMA_ERR_OOM && *cuma_last_error()),
                     "admit of %llu gave %d", (unsigned long long)bytes, (int)st);
            if (!st) held[k] += bytes;
            break;
        }
        case 5: { /* give back */
            uint64_t bytes = held[k] ? (v % (held[k] + 1)) : 0;
            cuma_ledger_unadmit(h[k], bytes);
            held[k] -= bytes;
            break;
        }
        case 6:
            cuma_ledger_publish(h[k], v, v / 2, v & 3);
            break;
        case 7: {
            bool cache, fresh;
            uint64_t shrink;
            (void)cuma_ledger_asked(h[k], &cache, &shrink, &fresh);
            break;
        }
        case 8:
            (void)cuma_ledger_reclaim(h[k], (uint64_t)(v % 64) << 20, 0, NULL, NULL);
            break;
        case 9: {
            cuma_status st = cuma_ledger_validate(h[k], held[k]);
            FZ_CHECK(st == CUMA_OK || st == CUMA_ERR_CORRUPT, "validate gave %d", (int)st);
            break;
        }
        case 10: {
            cuma_ledger_entry e[4];
            size_t n = SIZE_MAX;
            cuma_status st = cuma_ledger_snapshot(name, e, 4, &n);
            FZ_CHECK(st ? (*cuma_last_error() && n == 0) : n <= LEDGER_SLOTS,
                     "snapshot gave %d with %zu heaps", (int)st, n);
            break;
        }
        default:
            (void)cuma_ledger_room(h[k]);
        }
        cuma_clear_error();
        cuma_ledger_entry self;
        cuma_ledger_self(h[k], &self);
        FZ_CHECK(self.reserved == held[k], "heap %u holds %llu, its slot says %llu", k,
                 (unsigned long long)held[k], (unsigned long long)self.reserved);
    }
    close(fd);
    cuma_ledger_leave(h[0]);
    cuma_ledger_leave(h[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_once();
    fz_reader r = {data, size, 0};
    uint8_t how = fz_u8(&r);
    if ((how & 9) == 8) {
        unlink(path);
        run_live(&r);
        unlink(path);
        return 0;
    }
    bool slots = how & 1, spoil = slots && (how & 4), group = how & 2;
    static const size_t maxes[4] = {0, 1, 3, LEDGER_SLOTS};
    size_t max = maxes[how >> 6];

    unlink(path);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    FZ_CHECK(fd >= 0, "cannot create %s", path);
    size_t rest = size - r.at, fsize = rest;
    if (slots) {
        fsize = LEDGER_BYTES;
    } else if ((how >> 4) % 4 == 1 && fsize < sizeof(ledger_shm)) {
        fsize = sizeof(ledger_shm);
    } else if ((how >> 4) % 4 == 2) {
        fsize = LEDGER_BYTES;
    }
    FZ_CHECK(!ftruncate(fd, (off_t)fsize), "ftruncate");
    unsigned char *map = NULL;
    if (fsize) {
        map = mmap(NULL, fsize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        FZ_CHECK(map != MAP_FAILED, "mmap of %zu bytes", fsize);
    }
    ledger_shm *m = (ledger_shm *)map;
    if (slots) {
        cuma_ledger_init_header(m);
        if (spoil) spoil_header(m, &r);
        size_t room = LEDGER_SLOTS * sizeof(ledger_slot), k = size - r.at;
        memcpy(m->slot, data + r.at, k < room ? k : room);
    } else {
        if (rest) memcpy(map, data + r.at, rest < fsize ? rest : fsize);
    }
    if (group) FZ_CHECK(!fchmod(fd, 0640), "chmod");

    bool whole = fsize == LEDGER_BYTES;
    ledger_slot *before = NULL;
    if (whole) {
        before = malloc(LEDGER_SLOTS * sizeof *before);
        FZ_CHECK(before, "no memory");
        memcpy(before, m->slot, LEDGER_SLOTS * sizeof *before);
    }
    cuma_ledger_entry *e = max ? malloc(max * sizeof *e) : NULL;
    size_t n = SIZE_MAX;
    cuma_status st = cuma_ledger_snapshot(name, e, max, &n);
    /* The mapping keeps the file for the checks; a failing one leaves nothing in /dev/shm. */
    unlink(path);
    if (group) FZ_CHECK(st == CUMA_ERR_IO, "a file the group can read gave %d", (int)st);
    if (slots && !spoil && !group)
        FZ_CHECK(st == CUMA_OK, "a ledger with a good header gave %d", (int)st);
    if (st != CUMA_OK) {
        FZ_CHECK(*cuma_last_error() && n == 0, "failure %d without a message, or n %zu", (int)st,
                 n);
    } else {
        FZ_CHECK(whole, "a %zu-byte file read as a ledger", fsize);
        check_entries(m, before, e, n < max ? n : max, n);
    }
    free(e);
    free(before);
    if (map) munmap(map, fsize);
    close(fd);
    return 0;
}
