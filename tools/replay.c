// SPDX-License-Identifier: Apache-2.0
/* `cuma replay`: replays RMM event logs and PyTorch memory snapshots on the simulated device.
 *
 * Each trace is replayed twice on fresh heaps with the same settings:
 *  1. measuring: the heap's clock follows the trace's timestamps, so time-based release acts as
 *     it would have in the recorded run, and the stats are read after every event to get the
 *     peaks, the time integrals of reserved and requested bytes, and the driver-call counts;
 *  2. timing: the same alloc/free calls with nothing else in the loop but a clock update every
 *     1024 events, timed as a whole, for ns per operation.
 * The trace is parsed before either pass, so parsing is never timed. With --timeline DIR, pass 1
 * also hands every state it reads to a timeline writer (timeline.c), which keeps a few per
 * slice of time; pass 2 is untouched by it.
 */
#include "cli.h"
#include "progress.h"
#include "replay.h"
#include "timeline.h"

#include "cuma/cuma.h"
#include "cuma/sim.h"
#include "trace/trace.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The replay owns the clock and the backend; the user's settings come after and win. */
#define BASE_CONF             "backend:sim,sim_clock:manual"
#define DEFAULT_RELEASE_DELAY 1000 /* ms; the core's default, used if nothing says otherwise */
#define CLOCK_STRIDE          1024 /* pass 2 moves the clock once per this many events */

typedef struct options {
    char *user_conf; /* --conf and --policy pieces, comma-joined in command-line order */
    uint64_t scale;
    int json;
    const char *timeline_dir; /* --timeline: where the .timeline.csv files go (NULL: none) */
    uint64_t max_events;      /* --max-events: the reader's limit a trace */
    int device;               /* --device: a snapshot's device (-1: the one with most events) */
    int torch;                /* --policy pytorch: the PyTorch allocator model, no heap */
    const char *torch_text;   /* --pytorch-conf, as given */
    cuma_tm_conf torch_conf;  /* the model's settings: --pytorch-conf and --capacity */
    const char *compare;      /* --compare: policies, comma-separated (NULL: none) */
} options;

/* What one trace's replay measured. Integrals are in byte-microseconds. */
typedef struct result {
    const char *path;
    size_t events;
    uint64_t allocs, frees;    /* cuma_alloc / cuma_free calls made in pass 1 */
    uint64_t failed_allocs;    /* cuma_alloc calls that failed in pass 1 */
    uint64_t skipped_failures; /* `allocate failure` lines: nothing to replay */
    uint64_t unmatched_frees;  /* frees of pointers the trace never allocated */
    uint64_t orphan_frees;     /* frees of allocations that failed in the replay */
    uint64_t zero_allocs;      /* allocations of 0 bytes: nothing to replay */
    uint64_t peak_requested, peak_reserved, end_reserved;
    double int_requested, int_reserved;
    uint64_t span_us;         /* the clock's last time: the span the integrals cover */
    const cuma_trace *trace;  /* its format and recorded figures */
    int64_t release_delay_ms; /* -1: the heap never releases by time */
    int64_t lag_ms;           /* sim_lag_ms: the simulated device runs this far behind */
    int device;               /* a CUDA backend: its events may complete late too */
    char policy[32];
    cuma_stats final; /* the heap's stats after the end-of-trace release */
    int measured;     /* pass 1 ran to the end: the figures are worth printing */
    uint64_t ops;     /* calls made in pass 2 */
    double ns_per_op;
} result;

/* ---- small helpers ----------------------------------------------------------------------- */

/* Appends `piece` to the comma-separated list *list (NULL = empty). */
static int append_conf(char **list, const char *piece) {
    if (!*piece) return 0;
    size_t old = *list ? strlen(*list) : 0, add = strlen(piece);
    char *s = realloc(*list, old + add + 2);
    if (!s) return -1;
    if (old) s[old++] = ',';
    memcpy(s + old, piece, add + 1);
    *list = s;
    return 0;
}

const char *replay_base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

#define base_name replay_base_name

/* size * scale, or 0 when the product does not fit a size_t (counted as a failed alloc). */
static size_t scaled(uint64_t size, uint64_t scale) {
    if (size > SIZE_MAX / scale) return 0;
    return (size_t)(size * scale);
}

/* Traces carry the stream as a number; on the simulated device any value is a stream. */
static cuma_stream stream_of(const cuma_trace_event *e) {
    return (cuma_stream)(uintptr_t)e->stream;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The text after `"key":` in flat JSON, or NULL. The heap's stats JSON has each settings key
 * once; this is not a general JSON reader and does not need to be. */
static const char *json_value(const char *json, const char *key) {
    size_t klen = strlen(key);
    for (const char *p = json; (p = strchr(p, '"')) != NULL; p++) {
        if (strncmp(p + 1, key, klen) || p[1 + klen] != '"') continue;
        const char *v = p + 2 + klen;
        while (*v == ' ') v++;
        if (*v != ':') continue;
        for (v++; *v == ' ';) v++;
        return v;
    }
    return NULL;
}

/* The heap's stats JSON in a malloc'ed string, or NULL. A first call only measures. */
static char *stats_json(cuma_heap *h) {
    char probe[1];
    size_t needed = 0;
    cuma_stats_json(h, probe, sizeof probe, &needed);
    char *buf = malloc(needed + 1);
    if (buf && cuma_stats_json(h, buf, needed + 1, NULL) == CUMA_OK) return buf;
    free(buf);
    return NULL;
}

/* The value of a settings key as JSON: the heap's (its stats), so CUMA_CONF and defaults count
 * too, else conf's after the defaults (cuma_config_get, the one reader of the grammar). */
static const char *setting(const char *json, const char *conf, const char *key, char *buf,
                           size_t len) {
    const char *v = json ? json_value(json, key) : NULL;
    if (v) return v;
    return cuma_config_get(conf, "--conf", key, buf, len, NULL) == CUMA_OK ? buf : NULL;
}

/* Reads the release delay, the lag, the backend and the policy the heap really runs with. */
static void heap_settings(cuma_heap *h, const char *conf, result *r) {
    r->release_delay_ms = DEFAULT_RELEASE_DELAY;
    snprintf(r->policy, sizeof r->policy, "default");
    char *json = stats_json(h), buf[64];
    const char *v;
    if ((v = setting(json, conf, "release_delay_ms", buf, sizeof buf)) != NULL)
        r->release_delay_ms = strtoll(v, NULL, 10);
    v = setting(json, conf, "sim_lag_ms", buf, sizeof buf);
    r->lag_ms = v ? strtoll(v, NULL, 10) : 0;
    v = setting(json, conf, "backend", buf, sizeof buf);
    r->device = v && strncmp(v, "\"sim\"", 5);
    if ((v = setting(json, conf, "policy", buf, sizeof buf)) != NULL && *v == '"')
        snprintf(r->policy, sizeof r->policy, "%.*s", (int)strcspn(v + 1, "\""), v + 1);
    free(json);
}

static int make_heap(const char *conf, const char *path, cuma_heap **h) {
    cuma_config cfg = {.conf = conf, .flags = 0};
    cuma_status st = cuma_heap_create(&cfg, h);
    if (st == CUMA_OK) return CUMA_EXIT_OK;
    cli_eprintf("cuma replay: %s: cannot create the heap: %s\n", path, cuma_last_error());
    return st == CUMA_ERR_CONFIG ? CUMA_EXIT_USAGE : CUMA_EXIT_FAIL;
}

static int heap_error(const char *path, size_t i, const char *what) {
    cli_eprintf("cuma replay: %s: event %zu: %s: %s\n", path, i, what, cuma_last_error());
    return CUMA_EXIT_FAIL;
}

/* ---- pass 1: measure --------------------------------------------------------------------- */

/* tl (NULL: no --timeline) gets every state the stats are read in, with the replay's own
 * requested bytes, the figure the ratios are made of. */
static int measure(const cuma_trace *t, const char *conf, uint64_t scale, void **ptrs, result *r,
                   tl_writer *tl) {
    cuma_heap *h;
    int rc = make_heap(conf, t->path, &h);
    if (rc != CUMA_EXIT_OK) return rc;
    heap_settings(h, conf, r);

    uint64_t now_us = 0, requested = 0, reserved = 0, retry_ns = 0;
    cuma_stats s;
    cli_progress prog;
    cli_progress_init(&prog, base_name(t->path), t->n);
    for (size_t i = 0; i < t->n && rc == CUMA_EXIT_OK; i++) {
        cli_progress_step(&prog, i);
        const cuma_trace_event *e = &t->ev[i];
        /* Threads interleave, so a time may step back; the heap's clock may not. */
        uint64_t when = e->time_us > now_us ? e->time_us : now_us;
        /* Idle memory goes back while the program runs (the heap's release thread wakes at
         * cuma_next_release): let every release that falls before this event happen at its
         * own time, so the gap is integrated at the levels the device really saw. */
        uint64_t next_ns;
        while (cuma_next_release(h, &next_ns) == CUMA_OK) {
            if (next_ns < retry_ns) next_ns = retry_ns;
            if (next_ns >= when * 1000) break;
            uint64_t at_us = (next_ns + 999) / 1000;
            if (at_us < now_us) at_us = now_us;
            if (at_us >= when) break;
            r->int_requested += (double)requested * (double)(at_us - now_us);
            r->int_reserved += (double)reserved * (double)(at_us - now_us);
            now_us = at_us;
            if (cuma_sim_set_time(h, now_us * 1000) != CUMA_OK || cuma_poll(h) != CUMA_OK ||
                cuma_get_stats(h, &s) != CUMA_OK) {
                rc = heap_error(t->path, i, "release between events");
                break;
            }
            reserved = s.reserved_bytes;
            if (tl) tl_add(tl, now_us, requested, reserved, s.cached_bytes, s.mapped_bytes);
            uint64_t again;
            if (cuma_next_release(h, &again) == CUMA_OK && again <= next_ns) {
                if (!r->lag_ms && !r->device) {
                    rc = heap_error(t->path, i, "the release deadline did not move after a poll");
                    break;
                }
                /* A due page whose fence the lagging device (simulated, or a GPU whose events
                 * complete late) has not passed yet stays: the release thread looks again a
                 * millisecond later. */
                retry_ns = now_us * 1000 + 1000000;
            }
        }
        /* The levels after the previous event held until this one. */
        r->int_requested += (double)requested * (double)(when - now_us);
        r->int_reserved += (double)reserved * (double)(when - now_us);
        now_us = when;
        if (cuma_sim_set_time(h, now_us * 1000) != CUMA_OK) {
            rc = heap_error(t->path, i, "cuma_sim_set_time");
            break;
        }
        if (e->action == CUMA_TRACE_ALLOC) {
            size_t size = scaled(e->size, scale);
            ptrs[i] = NULL;
            if (e->size == 0) {
                r->zero_allocs++;
            } else {
                r->allocs++;
                if (size && cuma_alloc(h, size, stream_of(e), &ptrs[i]) == CUMA_OK) {
                    requested += size;
                } else {
                    ptrs[i] = NULL;
                    r->failed_allocs++;
                }
            }
        } else if (e->action == CUMA_TRACE_FREE) {
            if (e->match < 0) {
                r->unmatched_frees++;
            } else if (!ptrs[e->match]) {
                r->orphan_frees++; /* its allocation failed (or was of 0 bytes) */
            } else {
                r->frees++;
                /* The free's stream is the one the memory was last used on (0: the
                 * allocation's), as the log's writer and cuma_free both mean it. */
                if (cuma_free(h, ptrs[e->match], stream_of(e)) != CUMA_OK)
                    rc = heap_error(t->path, i, "cuma_free of a live allocation failed");
                requested -= scaled(t->ev[e->match].size, scale);
            }
        } else {
            r->skipped_failures++;
        }
        if (cuma_get_stats(h, &s) != CUMA_OK) {
            rc = heap_error(t->path, i, "cuma_get_stats");
            break;
        }
        reserved = s.reserved_bytes;
        if (tl) tl_add(tl, now_us, requested, reserved, s.cached_bytes, s.mapped_bytes);
        if (requested > r->peak_requested) r->peak_requested = requested;
        if (reserved > r->peak_reserved) r->peak_reserved = reserved;
    }
    cli_progress_done(&prog);

    if (rc == CUMA_EXIT_OK) {
        /* Let the idle delay run out after the last event, then see what the heap kept. */
        uint64_t delay_ms = r->release_delay_ms > 0 ? (uint64_t)r->release_delay_ms : 0;
        uint64_t end_ns = now_us * 1000 + (delay_ms + (uint64_t)r->lag_ms + 1) * 1000000;
        if (cuma_sim_set_time(h, end_ns) != CUMA_OK || cuma_poll(h) != CUMA_OK ||
            cuma_get_stats(h, &r->final) != CUMA_OK) {
            rc = heap_error(t->path, t->n, "end-of-trace release");
        } else {
            r->measured = 1;
            r->span_us = now_us;
            r->end_reserved = r->final.reserved_bytes;
            /* A transient peak inside one call is real device memory too. */
            if (r->final.peak_reserved_bytes > r->peak_reserved)
                r->peak_reserved = r->final.peak_reserved_bytes;
        }
    }
    if (rc == CUMA_EXIT_OK && cuma_validate(h) != CUMA_OK) {
        cli_eprintf("cuma replay: %s: heap check failed after the replay: %s\n", t->path,
                    cuma_last_error());
        rc = CUMA_EXIT_FAIL;
    }
    cuma_heap_destroy(h);
    return rc;
}

/* ---- pass 2: time ------------------------------------------------------------------------ */

static int time_ops(const cuma_trace *t, const char *conf, uint64_t scale, void **ptrs, result *r) {
    cuma_heap *h;
    int rc = make_heap(conf, t->path, &h);
    if (rc != CUMA_EXIT_OK) return rc;
    memset(ptrs, 0, t->n * sizeof *ptrs);
    const uint64_t max_size = SIZE_MAX / scale;
    uint64_t clock_us = 0, ops = 0, bad = 0;

    double t0 = now_ns();
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        /* Often enough for time-based release to act much as in pass 1, rarely enough to
         * cost nothing measurable. */
        if ((i & (CLOCK_STRIDE - 1)) == 0) {
            if (e->time_us > clock_us) clock_us = e->time_us;
            bad += cuma_sim_set_time(h, clock_us * 1000) != CUMA_OK;
        }
        if (e->action == CUMA_TRACE_ALLOC) {
            if (e->size == 0 || e->size > max_size) continue;
            ops++;
            if (cuma_alloc(h, (size_t)(e->size * scale), stream_of(e), &ptrs[i]) != CUMA_OK)
                ptrs[i] = NULL;
        } else if (e->action == CUMA_TRACE_FREE && e->match >= 0 && ptrs[e->match]) {
            ops++;
            bad += cuma_free(h, ptrs[e->match], stream_of(e)) != CUMA_OK;
        }
    }
    double elapsed = now_ns() - t0;

    cuma_heap_destroy(h);
    r->ops = ops;
    r->ns_per_op = ops ? elapsed / (double)ops : 0;
    if (bad) {
        cli_eprintf("cuma replay: %s: %llu clock or free calls failed in the timing pass\n",
                    t->path, (unsigned long long)bad);
        rc = CUMA_EXIT_FAIL;
    }
    return rc;
}

/* ---- output ------------------------------------------------------------------------------ */

static double ratio(double num, double den) {
    return den > 0 ? num / den : 0;
}

#define MIB(x) ((double)(x) / (1024.0 * 1024.0))

void replay_json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

/* The replay's reserved bytes averaged over the trace's span (0 for a trace of one instant). */
static uint64_t time_avg_reserved(const result *r) {
    return r->span_us ? (uint64_t)(r->int_reserved / (double)r->span_us) : 0;
}

/* Where the trace came from, and what a snapshot or profiler trace says PyTorch itself
 * reserved (null where the trace does not say: a profiler trace's CPU events). */
void replay_json_source(const cuma_trace *t, uint64_t time_avg) {
    int snap = t->format == CUMA_TRACE_TORCH_SNAPSHOT;
    int prof = t->format == CUMA_TRACE_TORCH_PROFILER;
    printf(",\"format\":\"%s\",\"time_avg_reserved_bytes\":%llu,\"synthetic_times\":%s",
           snap   ? "torch_snapshot"
           : prof ? "torch_profiler"
                  : "rmm_csv",
           (unsigned long long)time_avg, t->synthetic_times ? "true" : "false");
    if (!snap && !prof) return;
    uint64_t preseg_bytes = 0;
    for (size_t i = 0; i < t->npreseg; i++) preseg_bytes += t->preseg[i].size;
    printf(",\"device\":%d,\"preexisting_blocks\":%zu,\"preexisting_segments\":%zu,"
           "\"preexisting_segment_bytes\":%llu,\"recorded_peak_reserved_bytes\":",
           t->device, t->preexisting, t->npreseg, (unsigned long long)preseg_bytes);
    if (t->recorded.valid)
        printf("%llu", (unsigned long long)t->recorded.peak_reserved);
    else
        printf("null");
    printf(",\"recorded_time_avg_reserved_bytes\":");
    if (t->recorded.valid && t->recorded.has_time_avg && !t->synthetic_times)
        printf("%llu", (unsigned long long)t->recorded.time_avg_reserved);
    else
        printf("null");
}

static void print_json(const result *r, const options *o, const char *conf) {
    const cuma_stats *s = &r->final;
    printf("{\"trace\":");
    replay_json_string(base_name(r->path));
    printf(",\"path\":");
    replay_json_string(r->path);
    printf(",\"events\":%zu,\"allocs\":%llu,\"frees\":%llu,\"failed_allocs\":%llu,"
           "\"heap_failed_allocs\":%llu,\"trace_alloc_failures\":%llu,\"unmatched_frees\":%llu,"
           "\"orphan_frees\":%llu,\"zero_size_allocs\":%llu,",
           r->events, (unsigned long long)r->allocs, (unsigned long long)r->frees,
           (unsigned long long)r->failed_allocs, (unsigned long long)s->failed_allocs,
           (unsigned long long)r->skipped_failures, (unsigned long long)r->unmatched_frees,
           (unsigned long long)r->orphan_frees, (unsigned long long)r->zero_allocs);
    printf("\"peak_requested_bytes\":%llu,\"peak_reserved_bytes\":%llu,\"overhead_ratio\":%.4f,"
           "\"time_avg_ratio\":%.4f,\"end_reserved_bytes\":%llu,",
           (unsigned long long)r->peak_requested, (unsigned long long)r->peak_reserved,
           ratio((double)r->peak_reserved, (double)r->peak_requested),
           ratio(r->int_reserved, r->int_requested), (unsigned long long)r->end_reserved);
    printf("\"page_creates\":%llu,\"page_releases\":%llu,\"maps\":%llu,\"unmaps\":%llu,"
           "\"map_runs\":%llu,\"unmap_runs\":%llu,"
           "\"early_remaps\":%llu,\"remap_waits\":%llu,"
           "\"events_recorded\":%llu,\"event_queries\":%llu,\"stream_waits\":%llu,"
           "\"num_alloc_retries\":%llu,\"release_delay_ms\":%lld,\"sim_lag_ms\":%lld,"
           "\"ops\":%llu,\"ns_per_op\":%.1f,\"policy\":",
           (unsigned long long)s->page_creates, (unsigned long long)s->page_releases,
           (unsigned long long)s->maps, (unsigned long long)s->unmaps,
           (unsigned long long)s->map_runs, (unsigned long long)s->unmap_runs,
           (unsigned long long)s->early_remaps, (unsigned long long)s->remap_waits,
           (unsigned long long)s->events_recorded, (unsigned long long)s->event_queries,
           (unsigned long long)s->stream_waits, (unsigned long long)s->alloc_retries,
           (long long)r->release_delay_ms, (long long)r->lag_ms, (unsigned long long)r->ops,
           r->ns_per_op);
    replay_json_string(r->policy);
    printf(",\"scale\":%llu,\"conf\":", (unsigned long long)o->scale);
    replay_json_string(conf);
    replay_json_source(r->trace, time_avg_reserved(r));
    printf("}\n");
}

static void print_row(const result *r, int *header_done) {
    if (!*header_done) {
        printf("%-24s %8s %9s %9s %8s %8s %9s %8s %7s %8s\n", "trace", "events", "req MiB",
               "res MiB", "overhead", "time-avg", "end MiB", "creates", "failed", "ns/op");
        *header_done = 1;
    }
    printf("%-24s %8zu %9.1f %9.1f %8.4f %8.4f %9.1f %8llu %7llu %8.1f\n", base_name(r->path),
           r->events, MIB(r->peak_requested), MIB(r->peak_reserved),
           ratio((double)r->peak_reserved, (double)r->peak_requested),
           ratio(r->int_reserved, r->int_requested), MIB(r->end_reserved),
           (unsigned long long)r->final.page_creates, (unsigned long long)r->failed_allocs,
           r->ns_per_op);
    const cuma_trace *t = r->trace;
    if (t->format == CUMA_TRACE_TORCH_SNAPSHOT ||
        (t->format == CUMA_TRACE_TORCH_PROFILER && t->recorded.valid)) {
        printf("  %s: device %d, recorded by PyTorch: peak reserved %.1f MiB", base_name(r->path),
               t->device, MIB(t->recorded.peak_reserved));
        if (t->recorded.has_time_avg && !t->synthetic_times)
            printf(", time-avg reserved %.1f MiB", MIB(t->recorded.time_avg_reserved));
        printf("; replayed: peak reserved %.1f MiB, time-avg reserved %.1f MiB\n",
               MIB(r->peak_reserved), MIB(time_avg_reserved(r)));
    }
    /* Said on stderr so the table stays machine-readable by column. */
    if (r->unmatched_frees || r->skipped_failures || r->zero_allocs)
        cli_eprintf("cuma replay: %s: skipped %llu unmatched frees, %llu allocate failures, %llu "
                    "zero-size allocations\n",
                    base_name(r->path), (unsigned long long)r->unmatched_frees,
                    (unsigned long long)r->skipped_failures, (unsigned long long)r->zero_allocs);
}

/* ---- driver ------------------------------------------------------------------------------ */

/* The timeline's slices span the times pass 1 sets on the clock: from the first event to the
 * latest time of any (threads interleave, so the last line is not always the latest). */
static int open_timeline(tl_writer *tl, const char *dir, const cuma_trace *t) {
    uint64_t t0 = t->n ? t->ev[0].time_us : 0, end = t0;
    for (size_t i = 0; i < t->n; i++)
        if (t->ev[i].time_us > end) end = t->ev[i].time_us;
    return tl_open(tl, dir, t->path, t0, end - t0) ? CUMA_EXIT_USAGE : CUMA_EXIT_OK;
}

/* DIR exists as a directory afterwards (made if missing, one level), or a message says why. */
static int timeline_dir_ok(const char *dir) {
    struct stat st;
    if (stat(dir, &st) && mkdir(dir, 0777) && errno != EEXIST) {
        cli_eprintf("cuma replay: --timeline: cannot make %s: %s\n", dir, strerror(errno));
        return 0;
    }
    if (stat(dir, &st) || !S_ISDIR(st.st_mode)) {
        cli_eprintf("cuma replay: --timeline: %s is not a directory\n", dir);
        return 0;
    }
    return 1;
}

/* Pass 1 alone on the default settings, its timeline written to a private temporary directory
 * and read back: `cuma plot --html` draws the same sampled rows `cuma replay --timeline` would
 * write, so the report and the SVG figure never disagree. */
int replay_timeline(const cuma_trace *t, tl_series *out) {
    const char *tmp = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/cuma-plot-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        cli_eprintf("cuma plot: cannot make a temporary directory %s: %s\n", dir, strerror(errno));
        return CUMA_EXIT_FAIL;
    }
    size_t len;
    const char *stem = tl_stem(t->path, &len);
    char path[4200];
    snprintf(path, sizeof path, "%s/%.*s.timeline.csv", dir, (int)len, stem);
    void **ptrs = calloc(t->n ? t->n : 1, sizeof *ptrs);
    result r = {.path = t->path, .events = t->n, .trace = t};
    tl_writer tl = {0};
    int rc = ptrs ? open_timeline(&tl, dir, t) : CUMA_EXIT_FAIL;
    if (!ptrs) cli_eprintf("cuma plot: %s: out of memory\n", t->path);
    if (rc == CUMA_EXIT_OK) rc = measure(t, BASE_CONF, 1, ptrs, &r, &tl);
    if (tl.f && tl_close(&tl, r.measured) && rc == CUMA_EXIT_OK) rc = CUMA_EXIT_FAIL;
    if (rc == CUMA_EXIT_OK) rc = tl_read("cuma plot", path, out);
    remove(path);
    rmdir(dir);
    free(ptrs);
    return rc;
}

/* The trace replayed on a cuma heap with settings conf. */
static int replay_heap(cuma_trace *tp, const char *conf, const options *o, int *header_done) {
    cuma_trace t = *tp;
    const char *path = t.path;
    /* One slot per event, indexed like the trace, so matching a free costs one load. */
    void **ptrs = calloc(t.n ? t.n : 1, sizeof *ptrs);
    if (!ptrs) {
        cli_eprintf("cuma replay: %s: out of memory\n", path);
        return CUMA_EXIT_FAIL;
    }
    result r = {.path = path, .events = t.n, .trace = &t};
    tl_writer tl = {0};
    int rc = o->timeline_dir ? open_timeline(&tl, o->timeline_dir, &t) : CUMA_EXIT_OK;
    if (rc == CUMA_EXIT_OK) rc = measure(&t, conf, o->scale, ptrs, &r, tl.f ? &tl : NULL);
    /* A pass 1 that stopped early leaves no file: it would pass for a whole timeline. */
    if (tl.f && tl_close(&tl, r.measured) && rc == CUMA_EXIT_OK) rc = CUMA_EXIT_FAIL;
    if (rc == CUMA_EXIT_OK) rc = time_ops(&t, conf, o->scale, ptrs, &r);
    /* After a failed heap check the figures are still printed (without a timing): they help
     * to find what went wrong. */
    if (r.measured) {
        if (o->json)
            print_json(&r, o, conf);
        else
            print_row(&r, header_done);
        fflush(stdout);
    }
    free(ptrs);
    return rc;
}

/* The lag of the simulated device the heap would run on (sim_lag_ms under CUMA_CONF and conf,
 * as the heap reads them), for the model's events (cuma_tm_conf.lag_us). */
static uint64_t model_lag_us(const char *conf) {
    const char *env = getenv("CUMA_CONF");
    char buf[32], *both = NULL;
    if (env && *env && !append_conf(&both, env) && append_conf(&both, conf)) {
        free(both);
        both = NULL;
    }
    cuma_status st =
        cuma_config_get(both ? both : conf, "--conf", "sim_lag_ms", buf, sizeof buf, NULL);
    if (st != CUMA_OK && both) /* a bad CUMA_CONF is the heap's to report */
        st = cuma_config_get(conf, "--conf", "sim_lag_ms", buf, sizeof buf, NULL);
    free(both);
    long long ms = st == CUMA_OK ? strtoll(buf, NULL, 10) : 0;
    return ms > 0 ? (uint64_t)ms * 1000 : 0;
}

/* Whether the settings list names `key` (its items are "key:value"). */
static int names_key(const char *list, const char *key) {
    size_t klen = strlen(key);
    for (const char *p = list; p && *p;) {
        while (*p == ' ' || *p == ',') p++;
        if (!strncmp(p, key, klen) && (p[klen] == ':' || p[klen] == ' ')) return 1;
        p += strcspn(p, ",");
    }
    return 0;
}

/* The settings a trace is replayed with: conf, and for a PyTorch snapshot stream_order:on
 * under it (malloc'ed; NULL: out of memory). PyTorch's contract is stream-ordered (memory is
 * used on its allocation stream, other streams are ordered after it and record_stream), which
 * is what stream_order:on gives; an RMM log may come from any cuma heap (the `trace` setting),
 * whose memory must be ready on every stream, so it keeps the default. CUMA_CONF or conf
 * naming stream_order wins. */
static char *trace_conf(const cuma_trace *t, const char *conf) {
    char *out = NULL;
    if (t->format == CUMA_TRACE_TORCH_SNAPSHOT && !names_key(conf, "stream_order") &&
        !names_key(getenv("CUMA_CONF"), "stream_order") && append_conf(&out, "stream_order:on"))
        return NULL;
    if (append_conf(&out, conf)) {
        free(out);
        return NULL;
    }
    return out ? out : strdup("");
}

/* Whether the policy name of len bytes at p is the PyTorch model's (pytorch, pytorch_expandable).
 */
static int is_torch(const char *p, size_t len) {
    return (len == 7 && !strncmp(p, "pytorch", 7)) ||
           (len == 18 && !strncmp(p, "pytorch_expandable", 18));
}

/* conf with policy:NAME after it (malloc'ed), or NULL. */
static char *with_policy(const char *conf, const char *name, size_t len) {
    size_t n = strlen(conf);
    char *s = malloc(n + len + 9);
    if (s) snprintf(s, n + len + 9, "%s,policy:%.*s", conf, (int)len, name);
    return s;
}

/* --compare: the trace once per policy named, each a JSON line or row with its policy. */
static int replay_compare(cuma_trace *t, const char *conf, const options *o, int *header_done) {
    int worst = CUMA_EXIT_OK;
    for (const char *p = o->compare; *p;) {
        size_t len = strcspn(p, ",");
        int rc;
        if (is_torch(p, len)) {
            cuma_tm_conf c = o->torch_conf;
            if (len > 7) c.expandable = 1;
            rc = replay_torch(t, &c, o->torch_text, o->json, header_done);
        } else {
            char *c = with_policy(conf, p, len);
            rc = c ? replay_heap(t, c, o, header_done) : CUMA_EXIT_FAIL;
            free(c);
        }
        if (rc > worst) worst = rc;
        p += len + (p[len] == ',');
    }
    return worst;
}

static int replay_one(const char *path, const char *conf, const options *o, int *header_done) {
    cuma_trace t;
    cuma_trace_opts lo = {.max_events = (size_t)o->max_events, .device = o->device};
    if (cuma_trace_load_opts(path, &lo, &t) != CUMA_OK) {
        cli_eprintf("cuma replay: %s\n", cuma_last_error());
        return CUMA_EXIT_USAGE;
    }
    if (t.synthetic_times)
        cli_eprintf("cuma replay: %s: warning: the snapshot has no time_us: events are spaced "
                    "1 ms apart, so time-based release and time averages mean nothing\n",
                    path);
    if (t.format == CUMA_TRACE_TORCH_PROFILER && t.device < 0)
        cli_eprintf("cuma replay: %s: no CUDA memory events: replaying the CPU allocator's\n",
                    path);
    int rc;
    char *tconf = trace_conf(&t, conf);
    if (!tconf) {
        cli_eprintf("cuma replay: out of memory\n");
        rc = CUMA_EXIT_FAIL;
    } else if (o->compare) {
        rc = replay_compare(&t, tconf, o, header_done);
    } else if (o->torch) {
        rc = replay_torch(&t, &o->torch_conf, o->torch_text, o->json, header_done);
    } else {
        rc = replay_heap(&t, tconf, o, header_done);
    }
    free(tconf);
    cuma_trace_free(&t);
    return rc;
}

/* --policy NAME is --conf policy:NAME; the core checks the name with the rest. */
static int add_policy(options *o, const char *name) {
    char piece[64];
    if (!strcmp(name, "pytorch") || !strcmp(name, "pytorch_expandable")) {
        o->torch = 1;
        if (name[7]) o->torch_conf.expandable = 1;
        return CUMA_EXIT_OK;
    }
    if (!*name || strchr(name, ',') || strlen(name) > 40)
        return cli_usage_error("replay", CUMA_REPLAY_USAGE, "bad policy name '%s'", name);
    snprintf(piece, sizeof piece, "policy:%s", name);
    return append_conf(&o->user_conf, piece) ? CUMA_EXIT_FAIL : CUMA_EXIT_OK;
}

/* The largest --max-events: 2^32 events, 192 GiB of them (the reader takes up to SIZE_MAX / 96). */
#define MAX_EVENTS_CAP (1ull << 32)

static int parse_scale(const char *s, uint64_t *out) {
    char *end;
    if (*s < '0' || *s > '9') return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || v == 0 || v == ULLONG_MAX) return -1;
    *out = v;
    return 0;
}

/* "80G", "512M", "1048576": bytes (K, M, G, T are powers of 1024). */
static int parse_bytes(const char *s, uint64_t *out) {
    char *end;
    if (*s < '0' || *s > '9') return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10;
    if (*end == 'M' || *end == 'm') shift = 20;
    if (*end == 'G' || *end == 'g') shift = 30;
    if (*end == 'T' || *end == 't') shift = 40;
    if (shift) end++;
    if (*end || errno || v == 0 || v > (UINT64_MAX >> shift)) return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

/* Options may come before, between or after the traces (as with most GNU tools); "--" ends
 * them. The traces are collected in *traces, in order. */
static int parse_args(int argc, char **argv, options *o, char **traces, int *ntraces) {
    int only_traces = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        int missing = 0, rc = CUMA_EXIT_OK;
        if (only_traces || a[0] != '-' || !a[1]) {
            traces[(*ntraces)++] = argv[i];
        } else if (!strcmp(a, "--")) {
            only_traces = 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if ((v = cli_option(argc, argv, &i, "--conf", &missing)) != NULL) {
            if (append_conf(&o->user_conf, v)) rc = CUMA_EXIT_FAIL;
        } else if ((v = cli_option(argc, argv, &i, "--policy", &missing)) != NULL) {
            rc = add_policy(o, v);
        } else if ((v = cli_option(argc, argv, &i, "--pytorch-conf", &missing)) != NULL) {
            o->torch_text = v;
            if (cuma_tm_conf_parse(&o->torch_conf, v) != CUMA_OK)
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE, "--pytorch-conf: %s",
                                     cuma_last_error());
        } else if ((v = cli_option(argc, argv, &i, "--capacity", &missing)) != NULL) {
            if (parse_bytes(v, &o->torch_conf.capacity))
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--capacity wants bytes (a positive integer, K/M/G/T "
                                     "suffix for KiB..TiB), not '%s'",
                                     v);
        } else if ((v = cli_option(argc, argv, &i, "--compare", &missing)) != NULL) {
            if (!*v || strstr(v, ",,") || v[0] == ',' || v[strlen(v) - 1] == ',' || strlen(v) > 200)
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--compare wants policy names, comma-separated, not '%s'", v);
            o->compare = v;
        } else if ((v = cli_option(argc, argv, &i, "--timeline", &missing)) != NULL) {
            if (!*v)
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE, "--timeline wants a directory");
            o->timeline_dir = v;
        } else if ((v = cli_option(argc, argv, &i, "--max-events", &missing)) != NULL) {
            if (parse_scale(v, &o->max_events) || o->max_events > MAX_EVENTS_CAP)
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--max-events wants an integer from 1 to %llu, not '%s'",
                                     (unsigned long long)MAX_EVENTS_CAP, v);
        } else if ((v = cli_option(argc, argv, &i, "--device", &missing)) != NULL) {
            uint64_t d;
            /* parse_scale takes 1 and up; a device may be 0. */
            if (!strcmp(v, "0"))
                o->device = 0;
            else if (!parse_scale(v, &d) && d < 1024)
                o->device = (int)d;
            else
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--device wants a device number from 0 to 1023, not '%s'", v);
        } else if ((v = cli_option(argc, argv, &i, "--scale", &missing)) != NULL) {
            if (parse_scale(v, &o->scale))
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--scale wants a positive integer, not '%s'", v);
        } else if (missing) {
            rc = cli_usage_error("replay", CUMA_REPLAY_USAGE, "%s needs a value", a);
        } else {
            rc = cli_usage_error("replay", CUMA_REPLAY_USAGE, "unknown option '%s'", a);
        }
        if (rc != CUMA_EXIT_OK) return rc;
    }
    if (*ntraces == 0) return cli_usage_error("replay", CUMA_REPLAY_USAGE, "no trace given");
    return CUMA_EXIT_OK;
}

int cuma_cmd_replay(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_REPLAY_USAGE)) return CUMA_EXIT_OK;
    options o = {.scale = 1, .max_events = CUMA_TRACE_MAX_EVENTS, .device = -1};
    cuma_tm_conf_default(&o.torch_conf);
    int ntraces = 0;
    char **traces = malloc((size_t)argc * sizeof *traces), *conf = NULL;
    int rc = traces ? parse_args(argc, argv, &o, traces, &ntraces) : CUMA_EXIT_FAIL;
    if (rc == CUMA_EXIT_OK &&
        (append_conf(&conf, BASE_CONF) || (o.user_conf && append_conf(&conf, o.user_conf))))
        rc = CUMA_EXIT_FAIL;
    if (!traces || rc == CUMA_EXIT_FAIL) cli_eprintf("cuma replay: out of memory\n");
    /* Check the settings once, before any trace is read, so a typo costs nothing. */
    if (rc == CUMA_EXIT_OK && cuma_config_check(conf) != CUMA_OK) {
        cli_eprintf("cuma replay: bad settings (--conf, --policy): %s\n", cuma_last_error());
        rc = CUMA_EXIT_USAGE;
    }
    if (rc == CUMA_EXIT_OK) o.torch_conf.lag_us = model_lag_us(conf);
    if (rc == CUMA_EXIT_OK && o.torch && !o.compare && (o.scale != 1 || o.timeline_dir))
        rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                             "--policy pytorch (the model) takes no --scale or --timeline");
    /* Every heap policy --compare names is checked before anything runs. */
    for (const char *p = o.compare; rc == CUMA_EXIT_OK && p && *p;) {
        size_t len = strcspn(p, ",");
        if (!is_torch(p, len)) {
            char *c = with_policy(conf, p, len);
            if (!c) {
                rc = CUMA_EXIT_FAIL;
            } else if (cuma_config_check(c) != CUMA_OK) {
                cli_eprintf("cuma replay: --compare: %s\n", cuma_last_error());
                rc = CUMA_EXIT_USAGE;
            }
            free(c);
        }
        p += len + (p[len] == ',');
    }
    if (rc == CUMA_EXIT_OK && o.timeline_dir && !timeline_dir_ok(o.timeline_dir))
        rc = CUMA_EXIT_USAGE;
    /* Two traces of one name (a/x.csv.gz, b/x.csv) would write one timeline file: refused before
     * anything is replayed, naming both. */
    for (int i = 0; rc == CUMA_EXIT_OK && o.timeline_dir && i < ntraces; i++)
        for (int j = 0; rc == CUMA_EXIT_OK && j < i; j++) {
            size_t li, lj;
            const char *si = tl_stem(traces[i], &li), *sj = tl_stem(traces[j], &lj);
            if (li == lj && !memcmp(si, sj, li))
                rc = cli_usage_error("replay", CUMA_REPLAY_USAGE,
                                     "--timeline: %s and %s would both write %s/%.*s.timeline.csv",
                                     traces[j], traces[i], o.timeline_dir, (int)li, si);
        }
    /* Every trace is replayed even after a bad one: the others' figures still count. */
    int header_done = 0, worst = CUMA_EXIT_OK;
    for (int i = 0; rc == CUMA_EXIT_OK && i < ntraces; i++) {
        int r = replay_one(traces[i], conf, &o, &header_done);
        if (r > worst) worst = r;
    }
    if (worst > rc) rc = worst;
    free(traces);
    free(conf);
    free(o.user_conf);
    return rc;
}
