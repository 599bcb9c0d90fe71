// SPDX-License-Identifier: Apache-2.0
/* The CUMA_CONF grammar: "key:value,key:value". One table describes every key, so parsing,
 * `cuma config` and the JSON dump cannot disagree. */
#include "settings/backends.h"
#include "settings/config.h"
#include "settings/policies.h"
#include "util/error.h"
#include "util/marks.h"
#include "util/strbuf.h"
#include "trace/writer.h"

#include <ctype.h>
#include <stdarg.h>
#include <strings.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The policy key's choices and description from settings/policies.h. */
#define POLICY_CHOICE(name, what) #name "|"
#define POLICY_WHAT(name, what)   #name " (" what "), "
/* The backend key's description from settings/backends.h. */
#define BACKEND_WHAT(kind, name, family, what) ", " #name " (" what ")"

enum kind {
    K_SIZE,
    K_SIZE_OR_NONE,
    K_MS,
    K_FRACTION,
    K_BOOL,
    K_NAME,
    K_INT,
    K_PATH,
    K_WORD,
    K_PRIO
};

typedef struct key_desc {
    const char *key;
    enum kind kind;
    size_t offset;
    const char *def;     /* default, in the grammar's own spelling */
    const char *choices; /* K_NAME: "a|b|c" */
    const char *meaning;
} key_desc;

#define F(field) offsetof(cuma_settings, field)

static const key_desc keys[] = {
    {"backend", K_NAME, F(backend), "auto", CUMA_BACKEND_CHOICES,
     "device backend: auto (vmm on a GPU with virtual memory management, else "
     "segment)" CUMA_BACKEND_LIST(
         BACKEND_WHAT) ". Without a usable CUDA driver the CUDA backends (auto included) fail with "
                       "CUMA_ERR_NO_DEVICE, unless backend_fallback:sim"},
    {"backend_fallback", K_NAME, F(backend_fallback), "none", "none|sim",
     "what a CUDA backend (auto included) does where no CUDA driver can be used (none installed, "
     "cuInit fails, a libcuma built without them): none = fail with CUMA_ERR_NO_DEVICE; sim = run "
     "on the simulated device, whose pointers are not GPU memory (the stats say "
     "\"backend_fallback\":true). A missing device ordinal on a working driver is always an error"},
    {"policy", K_NAME, F(policy), "tlsf", CUMA_POLICY_LIST(POLICY_CHOICE) "bestfit",
     "placement in the virtual range: " CUMA_POLICY_LIST(POLICY_WHAT) "bestfit (alias of tlsf)"},
    {"capacity", K_SIZE, F(capacity), "80G", NULL, "simulated device size"},
    {"page_size", K_SIZE, F(page_size), "2M", NULL,
     "physical page size: the sim's page; on backend:vmm the device's recommended granularity, "
     "or this value when it is a larger multiple of it"},
    {"limit", K_SIZE_OR_NONE, F(limit), "none", NULL,
     "hard limit on reserved (physical) bytes; none = the device size; at most the device size, "
     "except on backend:managed, whose managed memory oversubscribes up to this limit"},
    {"memory_fraction", K_FRACTION, F(memory_fraction), "0", NULL,
     "limit as a fraction of device memory (0 = none); the smaller of limit and this wins"},
    {"max_cached", K_SIZE_OR_NONE, F(max_cached), "none", NULL,
     "most bytes of idle pages kept in the cache; beyond it the oldest go back at once"},
    {"release_delay_ms", K_MS, F(release_delay_ms), "1000", NULL,
     "idle pages go back to the device after this many milliseconds; never = keep; 0 also "
     "turns the thread caches off"},
    {"free_watermark", K_SIZE, F(free_watermark), "0", NULL,
     "device pressure: while the device's free memory (as the driver counts it, other programs "
     "included) is below this, idle pages go back at once, oldest first, until it is above again "
     "(the release thread looks every 10 ms while the heap holds idle pages); for GPUs shared "
     "with programs outside cuma's ledger; 0 = off"},
    {"fragmentation_threshold", K_FRACTION, F(fragmentation_threshold), "0.05", NULL,
     "idle pages past the release delay stay while the cache is at most this share of the "
     "memory in use (avoids churn; an idle heap keeps nothing); 0 = release every one"},
    {"remap_threshold", K_FRACTION, F(remap_threshold), "0", NULL,
     "while idle pages are at most this share of the memory in use, a page that needs backing "
     "is created instead of moved from another address (a move is an unmap and a map): up to "
     "this much more memory for fewer driver calls; 0 = always move (the least memory)"},
    {"page_call_budget", K_FRACTION, F(page_call_budget), "0.01", NULL,
     "share of the wall time the page calls (create, map, unmap, release: tens of microseconds "
     "each on a GPU) may take: over it, idle pages are kept where they are (up to a quarter of "
     "the memory in use) so that fewer move; 0 = off (with sim_clock:manual only on the sim with "
     "sim_call_us)"},
    {"growth", K_BOOL, F(growth), "on", NULL,
     "grow on demand; off = map `preallocate` bytes at creation and never grow beyond it"},
    {"preallocate", K_SIZE, F(preallocate), "0", NULL,
     "bytes of pages created at creation and never released (TensorFlow's memory_limit style)"},
    {"virtual_size", K_SIZE, F(virtual_size), "0", NULL,
     "size of the reserved virtual range; 0 = 4 x device size, rounded to a power of two"},
    {"segment_size", K_SIZE, F(segment_size), "20M", NULL,
     "segment backend: smallest segment asked of cuMemAlloc"},
    {"host_backing", K_BOOL, F(host_backing), "off", NULL,
     "sim: back simulated pages with host memory so data can be written and read"},
    {"sim_clock", K_NAME, F(sim_clock_manual), "real", "real|manual",
     "the heap's clock: real = the backend's (monotonic); manual = moved only by cuma_sim_set_time "
     "(replays, on any backend)"},
    {"sim_segments", K_BOOL, F(sim_segments), "off", NULL,
     "sim: simulate a device without virtual memory management, so the heap runs in segment "
     "mode (whole segments, as backend:segment does with cuMemAlloc)"},
    {"sim_lag_ms", K_INT, F(sim_lag_ms), "0", NULL,
     "sim: the simulated device runs this many milliseconds behind the host (work recorded on "
     "a stream completes that long after; on the heap's clock), as a GPU does while the host "
     "queues kernels ahead; 0 = at once"},
    {"early_remap", K_BOOL, F(early_remap), "on", NULL,
     "a page whose old address still has work pending on the stream that needs it may be mapped "
     "at the new address at once (the old mapping goes when the work is done) instead of "
     "creating a page; off = only pages whose work is done move"},
    {"stream_order", K_BOOL, F(stream_order), "off", NULL,
     "with early_remap and several streams, a page whose old address has work pending on one "
     "stream may back memory of another, which is then made to wait on the device for that "
     "work (cuStreamWaitEvent: the host does not wait) instead of creating a page; off = "
     "another stream's pending pages are never shared (the default: memory a synchronous "
     "allocation returns must be ready on every stream)"},
    {"sim_call_us", K_INT, F(sim_call_us), "0", NULL,
     "sim: host time each page created, mapped, unmapped or released takes, as a GPU driver's "
     "calls do (tens of microseconds); with sim_clock:manual the calls spin no time but count "
     "it on the device's clock, which pacing reads; 0 = none"},
    {"managed_fallback", K_BOOL, F(managed_fallback), "off", NULL,
     "serve a request from managed memory when the device is full, the limit is reached or the "
     "request is larger than the virtual range (after the cache release, the ledger and the OOM "
     "callbacks); managed memory, which the driver can move to the host, counts in "
     "managed_bytes, not in reserved bytes or the limit"},
    {"release_thread", K_BOOL, F(release_thread), "on", NULL,
     "a background thread gives idle pages back when their delay ends, also while the program "
     "makes no allocator call (not with sim_clock:manual, whose time only moves when told)"},
    {"tcache", K_BOOL, F(tcache), "on", NULL,
     "per-thread caches of freed blocks: the fast path, without the heap lock"},
    {"tcache_bytes", K_SIZE, F(tcache_bytes), "32M", NULL, "most bytes one thread's cache holds"},
    {"tcache_max", K_SIZE, F(tcache_max), "1M", NULL, "largest block a thread cache holds"},
    {"tcache_age_ms", K_MS, F(tcache_age_ms), "50", NULL,
     "blocks idle in a thread cache longer than this (at most release_delay_ms) go back to the "
     "heap, and from there to the device release_delay_ms after they were freed; 0 turns the "
     "thread caches off"},
    {"arenas", K_INT, F(arenas), "4", NULL,
     "most arenas (each with its own lock, placement and page cache over its own virtual range) "
     "a heap spreads threads over when their slow paths keep colliding on one lock (1 to 8); 1 = "
     "one lock for every thread. A single thread, or threads that rarely collide, stay in one "
     "arena; "
     "a heap with preallocate keeps one"},
    {"device", K_INT, F(device), "0", NULL, "CUDA device ordinal"},
    {"trace", K_PATH, F(trace), "none", NULL,
     "log every allocation, failed allocation and free to this file as RMM's CSV event log "
     "(gzip when it ends in .gz), for `cuma replay`; the thread caches are off meanwhile, so "
     "every call is seen in order; %p in the name is the process id, %d the device, %% a '%'; "
     "a file another heap or process is writing, or this process wrote before, is not "
     "overwritten: the log goes to NAME.1.csv.gz, NAME.2.csv.gz, ... instead (said on stderr, "
     "and the stats name it); none (or empty) = no log (./none is a file of that name)"},
    {"trace_stacks", K_BOOL, F(trace_stacks), "off", NULL,
     "with trace: also record each allocation's call stack (up to 32 return addresses, captured "
     "before the heap lock; about a microsecond an allocation; the program's Python frames "
     "instead when it allocates through the cuma package) in LOG.stacks beside the log, "
     "symbolised when the log is read (`cuma leaks LOG` names the functions and lines, with "
     "addr2line where binutils is installed); nothing without trace"},
    {"oom_dump", K_PATH, F(oom_dump), "none", NULL,
     "when an allocation fails after every recovery step, write the heap's statistics and "
     "snapshot (what holds the memory, as cuma_snapshot_json) with the request and the error to "
     "this JSON file, at most once every 10 s (a later failure replaces it only after that); %p "
     "is the process id, "
     "%d the device; none = no file"},
    {"ledger", K_WORD, F(ledger), "auto", NULL,
     "the cross-process ledger through which heaps on one device share it by priority "
     "(include/cuma/ledger.h, `cuma ps`): auto = the user's ledger for CUDA devices, none for "
     "the simulated one; on = the user's ledger; off (or none) = no ledger; @GROUP = the ledger "
     "every member of "
     "that Unix group shares (/dev/shm/cuma-gGID, mode 0660: jobs of several users on one GPU), "
     "@GROUP+NAME a named one of the group; any other name = a ledger of that name (letters, "
     "digits, _ - .), e.g. for a group of simulated heaps"},
    {"priority", K_PRIO, F(priority), "0", NULL,
     "this heap's priority in the ledger (-1000 to 1000, higher wins): heaps of lower priority "
     "give their cache back and are asked to shrink to their guarantee when it needs memory"},
    {"guarantee", K_SIZE, F(guarantee), "0", NULL,
     "device memory no other heap in the ledger may take from this one; the guarantees on a "
     "device add up to its size at most"},
    {"pressure_timeout_ms", K_MS, F(pressure_timeout_ms), "1000", NULL,
     "how long an allocation that does not fit waits for other heaps in the ledger to give "
     "memory back before the OOM callbacks; 0 = do not ask them (never is refused: a request "
     "no heap answers would wait forever)"},
    {"nvtx", K_BOOL, F(nvtx), "off", NULL,
     "mark the slow paths (page calls, releases, the out-of-memory ladder and its rungs, fence "
     "waits, the ledger) as NVTX ranges in a \"cuma\" domain, for Nsight Systems (`nsys profile`; "
     "docs/NSIGHT.md); without a tool attached they cost a call each; refused by a libcuma built "
     "without the CUDA toolkit's nvtx3 headers"},
};

#define NKEYS (sizeof keys / sizeof keys[0])

/* The number grammars are written out rather than left to strtod/strtoull, which also take
 * what no setting documents and a user rarely means: hex ("0x1p30", "0x10"), "inf", "nan",
 * exponents in byte counts, a leading '+' or whitespace, and (strtoull) a '-' that wraps. */

static bool all_digits(const char *p, const char *end) {
    if (p == end) return false;
    for (; p < end; p++)
        if (*p < '0' || *p > '9') return false;
    return true;
}

/* A size: DIGITS[.DIGITS][K|M|G|T[B|iB]] (suffixes in any case, powers of 1024), a whole
 * number of bytes below 2^64 - 1 (the largest value means "unlimited" inside). Computed in
 * integers: a double would round 9007199254740993 to its neighbour. */
bool cuma_parse_size(const char *text, uint64_t *out) {
    if (!text) return false;
    const char *p = text, *int_end = p;
    while (*int_end >= '0' && *int_end <= '9') int_end++;
    if (int_end == p) return false;
    const char *frac = int_end, *frac_end = int_end;
    if (*frac == '.') {
        frac++;
        frac_end = frac;
        while (*frac_end >= '0' && *frac_end <= '9') frac_end++;
        if (frac_end == frac) return false;
    }
    const char *end = frac_end;
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 0:
        break;
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    default:
        return false;
    }
    if (shift) {
        end++;
        if (toupper((unsigned char)*end) == 'B' ||
            (*end == 'i' && toupper((unsigned char)end[1]) == 'B'))
            end += *end == 'i' ? 2 : 1;
    }
    if (*end) return false;
    uint64_t whole = 0;
    for (const char *q = p; q < int_end; q++) {
        unsigned d = (unsigned)(*q - '0');
        if (whole > (UINT64_MAX - d) / 10) return false;
        whole = whole * 10 + d;
    }
    /* The fraction's bytes: f / 10^k * 2^shift, whole only when 5^k divides f and what is
     * left of 2^k divides the rest. Trailing zeros change nothing; over 19 digits is no size. */
    uint64_t frac_bytes = 0;
    if (frac != frac_end) {
        while (frac_end > frac && frac_end[-1] == '0') frac_end--;
        unsigned k = (unsigned)(frac_end - frac);
        if (k > 19) return false;
        uint64_t f = 0;
        for (const char *q = frac; q < frac_end; q++) f = f * 10 + (uint64_t)(*q - '0');
        for (unsigned i = 0; i < k; i++) {
            if (f % 5) return false;
            f /= 5;
        }
        /* f < 2^k now, k <= 19, shift <= 40: no overflow. */
        if (k <= shift) {
            frac_bytes = f << (shift - k);
        } else {
            if (f & ((1ull << (k - shift)) - 1)) return false;
            frac_bytes = f >> (k - shift);
        }
    }
    if (shift && whole > (UINT64_MAX >> shift)) return false;
    uint64_t v = whole << shift;
    if (v > UINT64_MAX - 1 - frac_bytes) return false; /* UINT64_MAX is CUMA_UNLIMITED */
    *out = v + frac_bytes;
    return true;
}

/* An integer: [-]DIGITS in decimal (the '-' only where negatives are allowed), in [lo, hi]. */
static bool parse_int(const char *v, long long lo, long long hi, long long *out) {
    const char *digits = v + (*v == '-' && lo < 0);
    if (!all_digits(digits, digits + strlen(digits))) return false;
    errno = 0;
    char *end;
    long long x = strtoll(v, &end, 10);
    if (*end || errno || x < lo || x > hi) return false;
    *out = x;
    return true;
}

/* A fraction: decimal digits with an optional point and an optional decimal exponent
 * ("0.05", ".5", "1", "1e-3"), no sign, no hex, no inf or nan, in [0, 1]. */
static bool parse_fraction(const char *v, double *out) {
    const char *p = v;
    size_t mantissa_digits = 0;
    while (*p >= '0' && *p <= '9') p++, mantissa_digits++;
    if (*p == '.') {
        p++;
        while (*p >= '0' && *p <= '9') p++, mantissa_digits++;
    }
    if (!mantissa_digits) return false;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '-' || *p == '+') p++;
        const char *e = p;
        while (*p >= '0' && *p <= '9') p++;
        if (p == e) return false;
    }
    if (*p) return false;
    char *end;
    double x = strtod(v, &end);
    if (*end || !isfinite(x) || x < 0 || x > 1) return false;
    *out = x;
    return true;
}

static bool parse_bool(const char *v, bool *out) {
    static const char *yes[] = {"on", "true", "1", "yes"}, *no[] = {"off", "false", "0", "no"};
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(v, yes[i])) return *out = true, true;
        if (!strcasecmp(v, no[i])) return *out = false, true;
    }
    return false;
}

static bool name_in(const char *v, const char *choices) {
    size_t n = strlen(v);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return true;
        if (!bar) break;
        p = bar + 1;
    }
    return false;
}

static const char *kind_hint(enum kind k) {
    switch (k) {
    case K_SIZE:
        return "a size like 512, 64K, 2M or 80G";
    case K_SIZE_OR_NONE:
        return "a size like 2M or 80G, or none";
    case K_MS:
        return "milliseconds (an integer from 0 to 9223372036854) or never";
    case K_FRACTION:
        return "a number between 0 and 1";
    case K_BOOL:
        return "on or off";
    case K_INT:
        return "an integer";
    case K_NAME:
        return "one of the listed names";
    case K_PATH:
        return "a file path of at most 255 bytes, without commas, whose only %-sequences are %p, "
               "%d and %%, or none";
    case K_WORD:
        return "auto, on, off (or none), a name of 1 to 48 letters, digits, '_', '-' or '.', "
               "@GROUP or "
               "@GROUP+NAME";
    case K_PRIO:
        return "an integer from -1000 to 1000";
    }
    return "";
}

static cuma_status set_value(cuma_settings *s, const key_desc *d, const char *v,
                             const char *origin) {
    char *field = (char *)s + d->offset;
    bool ok = false;
    switch (d->kind) {
    case K_SIZE:
        ok = cuma_parse_size(v, (uint64_t *)field);
        break;
    case K_SIZE_OR_NONE:
        if (!strcasecmp(v, "none") || !strcasecmp(v, "unlimited"))
            *(uint64_t *)field = CUMA_UNLIMITED, ok = true;
        else
            ok = cuma_parse_size(v, (uint64_t *)field);
        break;
    case K_MS: {
        if (!strcasecmp(v, "never")) {
            *(int64_t *)field = -1, ok = true;
            break;
        }
        long long x;
        /* Kept in nanoseconds as int64: at most about 106 days. */
        ok = parse_int(v, 0, INT64_MAX / 1000000, &x);
        if (ok) *(int64_t *)field = x;
        break;
    }
    case K_FRACTION: {
        double x;
        ok = parse_fraction(v, &x);
        if (ok) *(double *)field = x;
        break;
    }
    case K_BOOL:
        ok = parse_bool(v, (bool *)field);
        break;
    case K_INT:
    case K_PRIO: {
        long lo = d->kind == K_PRIO ? -1000 : 0, hi = d->kind == K_PRIO ? 1000 : 1023;
        long long x;
        ok = parse_int(v, lo, hi, &x);
        if (ok) *(int *)field = (int)x;
        break;
    }
    case K_WORD:
        /* none means no ledger, as it means no limit or no log for the other keys. */
        if (!strcmp(v, "none")) v = "off";
        /* Whether a group exists is the ledger's to say, when a heap joins it. */
        ok = strlen(v) < sizeof s->ledger && cuma_ledger_name_valid(v);
        if (ok) snprintf(field, sizeof s->ledger, "%s", v);
        break;
    case K_PATH:
        if (!strcmp(v, "none")) v = "";
        /* Every path setting is a char[256], as trace is. */
        ok = strlen(v) < sizeof s->trace && cuma_trace_pattern_valid(v);
        if (ok) snprintf(field, sizeof s->trace, "%s", v);
        break;
    case K_NAME:
        ok = name_in(v, d->choices);
        if (!ok) break;
        if (d->offset == F(sim_clock_manual)) {
            s->sim_clock_manual = !strcmp(v, "manual");
        } else {
            if (!strcmp(v, "bestfit")) v = "tlsf";
            snprintf(field, 16, "%s", v);
        }
        break;
    }
    if (ok && d->offset == F(backend) && strcmp(origin, "defaults")) s->backend_named = true;
    if (ok) return CUMA_OK;
    if (d->kind == K_NAME)
        return cuma_fail(CUMA_ERR_CONFIG, "%s: bad value '%s' for key '%s': expected one of %s",
                         origin, v, d->key, d->choices);
    return cuma_fail(CUMA_ERR_CONFIG, "%s: bad value '%s' for key '%s': expected %s", origin, v,
                     d->key, kind_hint(d->kind));
}

void cuma_settings_default(cuma_settings *s) {
    memset(s, 0, sizeof *s);
    for (size_t i = 0; i < NKEYS; i++) {
        cuma_status st = set_value(s, &keys[i], keys[i].def, "defaults");
        (void)st; /* the table's defaults are tested by test_config */
    }
}

static char *trim(char *p) {
    while (isspace((unsigned char)*p)) p++;
    char *e = p + strlen(p);
    while (e > p && isspace((unsigned char)e[-1])) *--e = 0;
    return p;
}

/* The key's row of the table, or NULL with the message every reader gives for an unknown key. */
static const key_desc *find_key(const char *key, const char *origin) {
    for (size_t i = 0; i < NKEYS; i++)
        if (!strcmp(keys[i].key, key)) return &keys[i];
    cuma_fail(CUMA_ERR_CONFIG, "%s: unknown key '%s' (see `cuma config`)", origin, key);
    return NULL;
}

/* Called for each item of a settings string, its key known and its value trimmed. */
typedef cuma_status (*item_fn)(void *ctx, const key_desc *d, const char *value, const char *origin);

/* The one reader of the grammar: splits conf at commas, trims, splits each item at its first
 * colon and finds the key, then hands the item to fn; the first error ends the walk. */
static cuma_status each_item(const char *conf, const char *origin, item_fn fn, void *ctx) {
    if (!conf) return CUMA_OK;
    size_t n = strlen(conf);
    if (n > 4096)
        return cuma_fail(CUMA_ERR_CONFIG, "%s: settings string longer than 4096 bytes", origin);
    char buf[4097];
    memcpy(buf, conf, n + 1);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        item = trim(item);
        if (!*item) continue;
        char *colon = strchr(item, ':');
        if (!colon) return cuma_fail(CUMA_ERR_CONFIG, "%s: '%s' is not key:value", origin, item);
        *colon = 0;
        const key_desc *d = find_key(trim(item), origin);
        if (!d) return CUMA_ERR_CONFIG;
        cuma_status st = fn(ctx, d, trim(colon + 1), origin);
        if (st) return st;
    }
    return CUMA_OK;
}

static cuma_status apply_item(void *ctx, const key_desc *d, const char *value, const char *origin) {
    return set_value(ctx, d, value, origin);
}

cuma_status cuma_settings_parse(cuma_settings *s, const char *conf, const char *origin) {
    return each_item(conf, origin, apply_item, s);
}

static bool pow2(uint64_t x) {
    return x && !(x & (x - 1));
}

cuma_status cuma_settings_validate(const cuma_settings *s) {
    if (!pow2(s->page_size) || s->page_size < 4096)
        return cuma_fail(CUMA_ERR_CONFIG, "page_size %llu is not a power of two >= 4K",
                         (unsigned long long)s->page_size);
    if (s->capacity < s->page_size || s->capacity % s->page_size)
        return cuma_fail(CUMA_ERR_CONFIG,
                         "capacity %llu is not a positive multiple of page_size %llu",
                         (unsigned long long)s->capacity, (unsigned long long)s->page_size);
    if (s->virtual_size && s->virtual_size < s->capacity)
        return cuma_fail(CUMA_ERR_CONFIG, "virtual_size %llu is smaller than capacity %llu",
                         (unsigned long long)s->virtual_size, (unsigned long long)s->capacity);
    if (s->capacity > (1ull << 46))
        return cuma_fail(CUMA_ERR_CONFIG, "capacity %llu is over 64T",
                         (unsigned long long)s->capacity);
    if (s->virtual_size > (1ull << 47))
        return cuma_fail(CUMA_ERR_CONFIG, "virtual_size %llu is over 128T",
                         (unsigned long long)s->virtual_size);
    if (s->limit != CUMA_UNLIMITED && s->limit < s->page_size)
        return cuma_fail(CUMA_ERR_CONFIG, "limit %llu is smaller than one page",
                         (unsigned long long)s->limit);
    if (!s->growth && !s->preallocate)
        return cuma_fail(CUMA_ERR_CONFIG, "growth:off needs preallocate:SIZE");
    if (s->pressure_timeout_ms < 0)
        return cuma_fail(CUMA_ERR_CONFIG,
                         "pressure_timeout_ms: never would wait forever for memory nobody gives; "
                         "give milliseconds (0 = do not ask)");
    if (s->free_watermark && (!s->release_thread || s->sim_clock_manual))
        return cuma_fail(CUMA_ERR_CONFIG,
                         "free_watermark needs the release thread, which %s turns off: it is the "
                         "thread that watches the device's free memory",
                         !s->release_thread ? "release_thread:off" : "sim_clock:manual");
    if (s->arenas < 1 || s->arenas > CUMA_MAX_ARENAS)
        return cuma_fail(CUMA_ERR_CONFIG, "arenas %d is not between 1 and %d", s->arenas,
                         CUMA_MAX_ARENAS);
    if (s->nvtx && cuma_marks_missing())
        return cuma_fail(CUMA_ERR_CONFIG, "nvtx:on: %s", cuma_marks_missing());
    return CUMA_OK;
}

cuma_status cuma_settings_from_config(cuma_settings *s, const cuma_config *cfg) {
    cuma_settings_default(s);
    cuma_status st = CUMA_OK;
    if (!cfg || !(cfg->flags & CUMA_CONFIG_NO_ENV))
        st = cuma_settings_parse(s, getenv("CUMA_CONF"), "CUMA_CONF");
    if (!st && cfg) st = cuma_settings_parse(s, cfg->conf, "config");
    if (!st && cfg && cfg->device) s->device = cfg->device;
    if (!st) st = cuma_settings_validate(s);
    return st;
}

cuma_status cuma_config_check(const char *conf) {
    cuma_settings s;
    cuma_settings_default(&s);
    cuma_status st = cuma_settings_parse(&s, conf, "config");
    return st ? st : cuma_settings_validate(&s);
}

/* Ends a call that wrote text into the caller's buffer: *needed the length without the NUL. */
static cuma_status text_done(const cuma_strbuf *o, size_t *needed) {
    if (needed) *needed = o->used;
    if (!o->buf || o->used >= o->len)
        return cuma_fail(CUMA_ERR_INVALID, "buffer of %zu bytes too small, %zu needed", o->len,
                         o->used + 1);
    return CUMA_OK;
}

cuma_status cuma_config_describe(char *buf, size_t len, size_t *needed) {
    cuma_strbuf o = {buf, len, 0};
    if (buf && len) buf[0] = 0;
    cuma_strbuf_put(&o, "%-24s %-8s %s\n", "KEY", "DEFAULT", "MEANING");
    for (size_t i = 0; i < NKEYS; i++) {
        cuma_strbuf_put(&o, "%-24s %-8s %s", keys[i].key, keys[i].def, keys[i].meaning);
        if (keys[i].kind == K_NAME) cuma_strbuf_put(&o, " [%s]", keys[i].choices);
        cuma_strbuf_put(&o, "\n");
    }
    return text_done(&o, needed);
}

/* The value of d's field in s as JSON (the stats' "settings" spell them so). */
static void put_value(cuma_strbuf *o, const cuma_settings *s, const key_desc *d) {
    const char *field = (const char *)s + d->offset;
    switch (d->kind) {
    case K_SIZE:
        cuma_strbuf_put(o, "%llu", (unsigned long long)*(const uint64_t *)field);
        break;
    case K_SIZE_OR_NONE: {
        uint64_t v = *(const uint64_t *)field;
        if (v == CUMA_UNLIMITED)
            cuma_strbuf_put(o, "null");
        else
            cuma_strbuf_put(o, "%llu", (unsigned long long)v);
        break;
    }
    case K_MS:
        cuma_strbuf_put(o, "%lld", (long long)*(const int64_t *)field);
        break;
    case K_FRACTION: {
        /* The shortest form that reads back as the same double: %g's 6 digits made
         * remap_threshold:0.1234567 read 0.123457 in the stats. */
        double v = *(const double *)field;
        char t[32];
        for (int digits = 6; digits <= 17; digits++) {
            snprintf(t, sizeof t, "%.*g", digits, v);
            if (strtod(t, NULL) == v) break;
        }
        cuma_strbuf_put(o, "%s", t);
        break;
    }
    case K_BOOL:
        cuma_strbuf_put(o, "%s", *(const bool *)field ? "true" : "false");
        break;
    case K_INT:
    case K_PRIO:
        cuma_strbuf_put(o, "%d", *(const int *)field);
        break;
    case K_WORD:
        cuma_strbuf_json_string(o, field);
        break;
    case K_PATH:
        if (*field)
            cuma_strbuf_json_string(o, field);
        else
            cuma_strbuf_put(o, "null");
        break;
    case K_NAME:
        if (d->offset == F(sim_clock_manual))
            cuma_strbuf_put(o, "\"%s\"", s->sim_clock_manual ? "manual" : "real");
        else
            cuma_strbuf_put(o, "\"%s\"", field);
        break;
    }
}

size_t cuma_settings_json(const cuma_settings *s, char *buf, size_t len) {
    cuma_strbuf o = {buf, len, 0};
    for (size_t i = 0; i < NKEYS; i++) {
        cuma_strbuf_put(&o, "%s\"%s\":", i ? "," : "", keys[i].key);
        put_value(&o, s, &keys[i]);
    }
    return o.used;
}

cuma_status cuma_config_get(const char *conf, const char *origin, const char *key, char *buf,
                            size_t len, size_t *needed) {
    if (needed) *needed = 0;
    if (buf && len) buf[0] = 0;
    if (!origin) origin = "config";
    if (!key) return cuma_fail(CUMA_ERR_INVALID, "cuma_config_get: key is NULL");
    const key_desc *d = find_key(key, "cuma_config_get");
    if (!d) return CUMA_ERR_CONFIG;
    cuma_settings s;
    cuma_settings_default(&s);
    cuma_status st = cuma_settings_parse(&s, conf, origin);
    if (st) return st;
    cuma_strbuf o = {buf, len, 0};
    put_value(&o, &s, d);
    return text_done(&o, needed);
}

/* cuma_config_set's walk: each item is checked as a heap would apply it, and copied unless it
 * is the key being set. */
typedef struct rewrite {
    cuma_settings scratch;
    const key_desc *key;
    cuma_strbuf out;
} rewrite;

static cuma_status copy_item(void *ctx, const key_desc *d, const char *value, const char *origin) {
    rewrite *r = ctx;
    cuma_status st = set_value(&r->scratch, d, value, origin);
    if (!st && d != r->key)
        cuma_strbuf_put(&r->out, "%s%s:%s", r->out.used ? "," : "", d->key, value);
    return st;
}

cuma_status cuma_config_set(const char *conf, const char *origin, const char *key,
                            const char *value, char *buf, size_t len, size_t *needed) {
    if (needed) *needed = 0;
    if (buf && len) buf[0] = 0;
    if (!origin) origin = "config";
    if (!key) return cuma_fail(CUMA_ERR_INVALID, "cuma_config_set: key is NULL");
    rewrite r = {.key = find_key(key, "cuma_config_set"), .out = {buf, len, 0}};
    if (!r.key) return CUMA_ERR_CONFIG;
    cuma_settings_default(&r.scratch);
    cuma_status st = each_item(conf, origin, copy_item, &r);
    if (st || !value) return st ? st : text_done(&r.out, needed);
    /* One item, never two: a comma would bring in another key. */
    size_t n = strlen(value);
    char v[4097];
    if (n >= sizeof v || strchr(value, ','))
        return cuma_fail(CUMA_ERR_CONFIG,
                         "cuma_config_set: bad value '%.64s' for key '%s': expected one value, "
                         "without commas, of at most 4096 bytes",
                         value, key);
    memcpy(v, value, n + 1);
    char *t = trim(v);
    st = set_value(&r.scratch, r.key, t, "cuma_config_set");
    if (st) return st;
    cuma_strbuf_put(&r.out, "%s%s:%s", r.out.used ? "," : "", key, t);
    return text_done(&r.out, needed);
}

/* A name part of the `ledger` setting. */
static bool valid_name(const char *n) {
    size_t len = strlen(n);
    if (!len || len > 48) return false;
    for (const char *p = n; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '_' || *p == '-' || *p == '.'))
            return false;
    return true;
}

bool cuma_ledger_name_valid(const char *name) {
    if (name[0] != '@') return valid_name(name);
    const char *plus = strchr(name + 1, '+');
    if (!plus) return valid_name(name + 1);
    char group[49];
    size_t glen = (size_t)(plus - name - 1);
    if (!glen || glen >= sizeof group) return false;
    memcpy(group, name + 1, glen);
    group[glen] = 0;
    return valid_name(group) && valid_name(plus + 1);
}
