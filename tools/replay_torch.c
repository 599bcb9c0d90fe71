// SPDX-License-Identifier: Apache-2.0
/* `cuma replay --policy pytorch`: a trace replayed on the model of PyTorch's caching allocator
 * (src/trace/torch_model.h) instead of a cuma heap, printed with the fields the heap replay
 * prints where they mean the same (peaks, ratios, failed allocations; segments for pages). */
#include "cli.h"
#include "replay.h"

#include "cuma/cuma.h"

#include <stdio.h>

#define MIB(x) ((double)(x) / (1024.0 * 1024.0))

static double ratio(double num, double den) {
    return den > 0 ? num / den : 0;
}

static void print_json(const cuma_trace *t, const cuma_tm_result *r, const cuma_tm_conf *c,
                       const char *conf_text, uint64_t avg) {
    const cuma_tm_stats *s = &r->st;
    printf("{\"trace\":");
    replay_json_string(replay_base_name(t->path));
    printf(",\"path\":");
    replay_json_string(t->path);
    printf(",\"events\":%zu,\"allocs\":%llu,\"frees\":%llu,\"failed_allocs\":%llu,"
           "\"trace_alloc_failures\":%llu,\"unmatched_frees\":%llu,\"orphan_frees\":%llu,"
           "\"zero_size_allocs\":%llu,",
           t->n, (unsigned long long)s->allocs, (unsigned long long)s->frees,
           (unsigned long long)s->failed_allocs, (unsigned long long)r->trace_failures,
           (unsigned long long)r->unmatched_frees, (unsigned long long)r->orphan_frees,
           (unsigned long long)r->zero_allocs);
    printf("\"peak_requested_bytes\":%llu,\"peak_allocated_bytes\":%llu,"
           "\"peak_reserved_bytes\":%llu,\"overhead_ratio\":%.4f,\"time_avg_ratio\":%.4f,"
           "\"end_reserved_bytes\":%llu,\"segments_created\":%llu,\"segments_released\":%llu,"
           "\"oversize_releases\":%llu,\"num_alloc_retries\":%llu,\"gc_releases\":%llu,"
           "\"segments_seeded\":%llu,\"blocks_placed\":%llu,\"deferred_frees\":%llu,"
           "\"sim_lag_ms\":%llu,",
           (unsigned long long)s->peak_requested, (unsigned long long)s->peak_allocated,
           (unsigned long long)s->peak_reserved,
           ratio((double)s->peak_reserved, (double)s->peak_requested),
           ratio(r->int_reserved, r->int_requested), (unsigned long long)r->end_reserved,
           (unsigned long long)s->segments_created, (unsigned long long)s->segments_released,
           (unsigned long long)s->oversize_releases, (unsigned long long)s->full_releases,
           (unsigned long long)s->gc_releases, (unsigned long long)s->segments_seeded,
           (unsigned long long)s->blocks_placed, (unsigned long long)s->deferred_frees,
           (unsigned long long)(c->lag_us / 1000));
    printf("\"capacity_bytes\":%llu,\"policy\":\"%s\",\"pytorch_conf\":",
           (unsigned long long)c->capacity, c->expandable ? "pytorch_expandable" : "pytorch");
    replay_json_string(conf_text ? conf_text : "");
    replay_json_source(t, avg);
    printf("}\n");
}

static void print_row(const cuma_trace *t, const cuma_tm_result *r, const cuma_tm_conf *c,
                      uint64_t avg, int *header_done) {
    const cuma_tm_stats *s = &r->st;
    if (!*header_done) {
        printf("%-24s %8s %9s %9s %8s %8s %9s %8s %7s %8s\n", "trace", "events", "req MiB",
               "res MiB", "overhead", "time-avg", "end MiB", "creates", "failed", "ns/op");
        *header_done = 1;
    }
    printf("%-24s %8zu %9.1f %9.1f %8.4f %8.4f %9.1f %8llu %7llu %8s\n", replay_base_name(t->path),
           t->n, MIB(s->peak_requested), MIB(s->peak_reserved),
           ratio((double)s->peak_reserved, (double)s->peak_requested),
           ratio(r->int_reserved, r->int_requested), MIB(r->end_reserved),
           (unsigned long long)s->segments_created, (unsigned long long)s->failed_allocs, "-");
    if (t->format == CUMA_TRACE_TORCH_SNAPSHOT ||
        (t->format == CUMA_TRACE_TORCH_PROFILER && t->recorded.valid))
        printf("  %s: policy %s (model): peak reserved %.1f MiB, time-avg %.1f MiB; "
               "recorded by PyTorch: peak reserved %.1f MiB\n",
               replay_base_name(t->path), c->expandable ? "pytorch_expandable" : "pytorch",
               MIB(s->peak_reserved), MIB(avg), MIB(t->recorded.peak_reserved));
}

int replay_torch(const cuma_trace *t, const cuma_tm_conf *c, const char *conf_text, int json,
                 int *header_done) {
    cuma_tm_result r;
    cuma_status st = cuma_tm_replay(t, c, &r);
    if (st != CUMA_OK) {
        cli_eprintf("cuma replay: %s: %s\n", t->path, cuma_last_error());
        return CUMA_EXIT_FAIL;
    }
    uint64_t avg = r.span_us ? (uint64_t)(r.int_reserved / (double)r.span_us) : 0;
    if (json)
        print_json(t, &r, c, conf_text, avg);
    else
        print_row(t, &r, c, avg, header_done);
    fflush(stdout);
    return CUMA_EXIT_OK;
}
