// SPDX-License-Identifier: Apache-2.0
/* The layout of cuma_stats as programs built against older headers know it, and
 * cuma_get_stats_sized: a program built against an older cuma.h passes its smaller struct and
 * gets the figures it knows, nothing written past them; one built against a newer cuma.h gets
 * this library's figures and the rest as unknown (all bits set). A figure added in the middle of
 * the list, or one moved or removed, fails here: new figures go at the end. */
#include "check.h"

#include <stdint.h>
#include <string.h>

/* The list as released, in order. Append new figures here as they are appended to the list. */
static const char *const released[] = {
    "requested_bytes",
    "peak_requested_bytes",
    "allocated_bytes",
    "peak_allocated_bytes",
    "reserved_bytes",
    "peak_reserved_bytes",
    "mapped_bytes",
    "cached_bytes",
    "stranded_bytes",
    "managed_bytes",
    "virtual_bytes",
    "limit_bytes",
    "device_total_bytes",
    "device_free_bytes",
    "page_size",
    "active_allocs",
    "num_allocs",
    "num_frees",
    "failed_allocs",
    "alloc_retries",
    "ooms",
    "oom_callbacks",
    "managed_fallbacks",
    "page_creates",
    "page_releases",
    "maps",
    "unmaps",
    "map_runs",
    "unmap_runs",
    "page_call_ns",
    "remap_keep",
    "early_remaps",
    "remap_waits",
    "events_recorded",
    "event_queries",
    "stream_waits",
    "trims",
    "watermark_released_bytes",
    "fragmentation",
    "arenas",
    "ledger_denials",
    "pressure_asks",
    "pressure_given_bytes",
    "pressure_callbacks",
    "ledger_room_bytes",
    "pools",
    "pool_bytes",
    "pool_blocks",
    "pool_blocks_in_use",
    "compactions",
    "compact_moved_bytes",
    "compact_freed_pages",
};
#define NRELEASED (sizeof released / sizeof *released)

static void test_order(void) {
    size_t n;
    const cuma_stat_field *f = cuma_stat_fields(&n);
    CHECK(n >= NRELEASED);
    CHECK(n * sizeof(uint64_t) == sizeof(cuma_stats));
    for (size_t i = 0; i < NRELEASED; i++) {
        if (strcmp(f[i].name, released[i]) || f[i].offset != i * sizeof(uint64_t))
            fprintf(stderr, "figure %zu is %s at offset %zu; released as %s at %zu\n", i, f[i].name,
                    f[i].offset, released[i], i * sizeof(uint64_t));
        CHECK(!strcmp(f[i].name, released[i]) && f[i].offset == i * sizeof(uint64_t));
    }
}

static void test_sized(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M,sim_clock:manual");
    void *p;
    CHECK_OK(cuma_alloc(h, 3 << 20, NULL, &p));
    cuma_stats full;
    CHECK_OK(cuma_get_stats(h, &full)); /* the macro: this header's size */
    CHECK(full.requested_bytes == 3 << 20 && full.active_allocs == 1);
    /* The function of programs built before the size: the 52 figures they had room for at most,
     * and not a byte more when the list grows. */
    _Alignas(cuma_stats) unsigned char unsized[52 * sizeof(uint64_t) + 64];
    memset(unsized, 0x5a, sizeof unsized);
    CHECK_OK((cuma_get_stats)(h, (cuma_stats *)(void *)unsized));
    uint64_t first;
    memcpy(&first, unsized, sizeof first);
    CHECK(first == 3 << 20);
    for (size_t i = 52 * sizeof(uint64_t); i < sizeof unsized; i++) CHECK(unsized[i] == 0x5a);

    /* An older program's struct: the first figures, and not a byte past them. */
    size_t n;
    const cuma_stat_field *f = cuma_stat_fields(&n);
    size_t old = f[1].offset + sizeof(uint64_t); /* requested and peak requested only */
    _Alignas(cuma_stats) unsigned char buf[sizeof(cuma_stats) + 64];
    memset(buf, 0x5a, sizeof buf);
    CHECK_OK(cuma_get_stats_sized(h, (cuma_stats *)(void *)buf, old));
    uint64_t v[2];
    memcpy(v, buf, sizeof v);
    CHECK(v[0] == 3 << 20 && v[1] == 3 << 20);
    for (size_t i = old; i < sizeof buf; i++) CHECK(buf[i] == 0x5a);

    /* A newer program's struct: this library's figures, then unknown. */
    memset(buf, 0, sizeof buf);
    CHECK_OK(cuma_get_stats_sized(h, (cuma_stats *)(void *)buf, sizeof buf));
    memcpy(v, buf, sizeof v);
    CHECK(v[0] == 3 << 20);
    for (size_t i = sizeof(cuma_stats); i < sizeof buf; i++) CHECK(buf[i] == 0xff);

    CHECK_ST(cuma_get_stats_sized(h, &full, 0), CUMA_ERR_INVALID);
    CHECK_ST(cuma_get_stats_sized(h, &full, 12), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "size 12") != NULL);
    CHECK_ST(cuma_get_stats_sized(NULL, &full, sizeof full), CUMA_ERR_INVALID);
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
}

int main(void) {
    test_order();
    test_sized();
    printf("test_stats_layout: all passed\n");
    return 0;
}
