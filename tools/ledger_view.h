// SPDX-License-Identifier: Apache-2.0
/* What `cuma ps`, `cuma top`, `cuma stats` and `cuma exporter` share: one read of a ledger, its
 * heaps sorted by device then reserved bytes and summed per device, the JSON document of ps and
 * stats, and the formatting helpers their outputs need (sizes, names made printable, JSON
 * strings, options). */
#ifndef CUMA_TOOLS_LEDGER_VIEW_H
#define CUMA_TOOLS_LEDGER_VIEW_H

#include "cuma/ledger.h"

#include <stddef.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>

/* The heaps heaps[first .. first + count) of one device, and their sums. */
typedef struct view_device {
    const char *device; /* the first heap's device string */
    size_t first, count;
    uint64_t capacity;   /* the largest any heap reports (they agree unless the ledger is odd) */
    uint64_t reserved;   /* held by all heaps */
    uint64_t cached;     /* idle in their caches */
    uint64_t guaranteed; /* sum of guarantees */
    uint64_t free;       /* capacity minus what heaps hold or are guaranteed, as admission counts */
} view_device;

typedef struct ledger_view {
    char path[128]; /* the ledger's file, for messages */
    cuma_ledger_entry *heaps;
    size_t nheaps;
    view_device *devices;
    size_t ndevices;
    char notice[384]; /* why the ledger is not in /dev/shm (squatted there), or "" */
    /* Read without the ledger's lock, which a process holds and does not run (stopped?): the
     * figures are current but not guaranteed consistent, dead processes' slots not reclaimed.
     * stuck_ns: how long the lock had stood still then (cuma_ledger_read_info). */
    int unlocked;
    uint64_t stuck_ns;
    int missing;     /* the read failed because the file does not exist */
    char error[512]; /* why the read failed */
} ledger_view;

/* Reads ledger `name` (NULL: the user's default). 0, or -1 with v->error (and v->missing when
 * no heap has created the ledger); v is valid for view_free either way. -2 when the name is not
 * a valid ledger name (a usage error; v->error says why). */
int view_read(ledger_view *v, const char *name);
void view_free(ledger_view *v);

/* The warning lines ps, top and stats print above their table: the notice, and that the read
 * was made without the lock. */
void view_print_warnings(FILE *f, const ledger_view *v);

/* reserved - cached, never below zero (cached is published later than reserved changes). */
uint64_t view_in_use(const cuma_ledger_entry *e);

/* Whether the heap's release thread has published its allocator figures (backend aside, the
 * fields from page_size on); until then they are zeros that mean nothing. */
int view_has_stats(const cuma_ledger_entry *e);

/* The JSON document of `cuma ps --json`: the ledger (its notice, whether it was read without
 * the lock: "unlocked", and then "lock_stuck_ns"), and per device its totals (over all its
 * heaps) and the heaps for which keep[i] is set (keep NULL: all; a device none of whose heaps is
 * kept is left out). `extra` (may be NULL) appends fields to each heap's object, each preceded
 * by a comma. */
void view_json(FILE *f, const ledger_view *v, const unsigned char *keep,
               void (*extra)(FILE *f, const cuma_ledger_entry *e));

/* "512 B", "12.0 MiB", "1.50 GiB": binary units, 3 significant digits or so. */
const char *view_size(uint64_t bytes, char *buf, size_t len);
/* A signed change of a size: "+4.0 MiB", "-512 B", "0". */
const char *view_delta(int64_t bytes, char *buf, size_t len);

/* `in` with invalid UTF-8 bytes and control characters replaced by '?' (process names are
 * whatever a program set with prctl; outputs must stay one line and valid UTF-8). */
void view_clean(const char *in, char *out, size_t len);

/* `s` as a JSON string literal (quoted, escaped). */
void view_json_string(FILE *f, const char *s);

/* Set by SIGINT or SIGTERM once view_catch_stop ran. */
extern volatile sig_atomic_t view_stop;

/* Catches SIGINT and SIGTERM (they set view_stop) and blocks them, so that they are delivered
 * only inside a wait that takes *wait_mask (pselect, ppoll): one that comes between a check of
 * view_stop and the wait still ends the wait, and a long sleep does not ignore it. */
void view_catch_stop(sigset_t *wait_mask);

#endif
