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
 *
 * The header's robust mutex is kept valid in every file large enough to hold it: a process that
 * scribbles over the lock itself can stall every heap of the user, which no check can prevent.
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
                     e[k].page_size == atomic_load(&s->stat[LEDGER_ST_PAGE_SIZE]) &&
                     e[k].arenas == atomic_load(&s->stat[LEDGER_ST_ARENAS]),
                 "entry %zu's figures are not slot %u's", k, e[k].slot);
        FZ_CHECK(e[k].fragmentation >= 0 && e[k].fragmentation <= 1, "entry %zu: fragmentation %g",
                 k, e[k].fragmentation);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_once();
    fz_reader r = {data, size, 0};
    uint8_t how = fz_u8(&r);
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
