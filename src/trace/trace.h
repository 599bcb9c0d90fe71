// SPDX-License-Identifier: Apache-2.0
/* Reader of the traces `cuma replay` consumes: RAPIDS RMM's CSV event log, PyTorch's CUDA
 * memory snapshots (a pickle from torch.cuda.memory._dump_snapshot(), read by
 * snapshot_pickle.c) and torch.profiler Chrome traces with memory events (JSON from
 * export_chrome_trace(), read by chrome_trace.c); see cuma_trace_load_opts. The format is told
 * by the content: a (decompressed) first byte 0x80, pickle's PROTO, is a snapshot; a first
 * byte '{' or '[' after a UTF-8 byte-order mark and white space is a Chrome trace; anything
 * else is CSV.
 *
 *   Thread,Time,Action,Pointer,Size,Stream
 *   0,00:00:00:000108,allocate,0x7f0000000400,472,0
 *
 * Time is HH:MM:SS:micro (HH:MM:SS.micro is accepted too); Action is `allocate`, `free` or
 * `allocate failure`; Pointer is hex with 0x; Size is decimal; Stream is decimal or 0x-hex.
 * Plain and gzip-compressed files are both read (zlib detects which).
 *
 * Thread safety: cuma_trace_load and cuma_trace_free touch only their arguments, so distinct
 * traces may be loaded and freed from several threads at once.
 */
#ifndef CUMA_TRACE_TRACE_H
#define CUMA_TRACE_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "cuma/cuma.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CUMA_TRACE_ALLOC = 0,
    CUMA_TRACE_FREE = 1,
    CUMA_TRACE_ALLOC_FAIL = 2,
} cuma_trace_action;

/* One line of the log. Times are kept as written: lines from several threads interleave, so
 * a time may go backwards; a consumer that needs a monotonic clock clamps it. */
typedef struct cuma_trace_event {
    uint64_t time_us; /* microseconds since the start of the log */
    uint64_t ptr;     /* identifies the block only; reused after its free */
    uint64_t size;    /* bytes */
    uint64_t stream;  /* 0 is the default stream */
    uint32_t thread;  /* thread id; ids wider than 32 bits are folded (high ^ low half) */
    uint32_t action;  /* cuma_trace_action */
    /* For a FREE: the index of the ALLOC it frees, or -1 when the pointer was not live (never
     * allocated in the log, or already freed). For an ALLOC: the index of the FREE that frees
     * it, or -1 when it is still live at the end. -1 for an ALLOC_FAIL. */
    int64_t match;
} cuma_trace_event;

typedef enum {
    CUMA_TRACE_RMM_CSV = 0,
    CUMA_TRACE_TORCH_SNAPSHOT = 1,
    CUMA_TRACE_TORCH_PROFILER = 2, /* a torch.profiler Chrome trace */
} cuma_trace_format;

/* What a PyTorch snapshot says its own allocator reserved from the driver (segment_alloc,
 * segment_free, segment_map, segment_unmap, and the segments alive at the dump), or what a
 * profiler trace's CUDA memory events say in "Total Reserved". */
typedef struct cuma_trace_recorded {
    int valid; /* 0: the trace carries no such figures (RMM CSV, a profiler trace's CPU events) */
    uint64_t peak_reserved;     /* bytes */
    uint64_t time_avg_reserved; /* bytes, averaged over the trace's time span; 0 without times */
    int has_time_avg;           /* time_avg_reserved means something */
} cuma_trace_recorded;

/* One frame of a call stack: file and function name are offsets of NUL-terminated text in
 * cuma_trace_stacks.text ("" when the recording had none), line 0 when unknown. */
typedef struct cuma_trace_frame {
    uint32_t file, name;
    uint32_t line;
} cuma_trace_frame;

/* The call stacks of a trace's allocations, each distinct frame and each distinct stack stored
 * once. Stack s (0 <= s < nstacks) is frame[ix[start[s]]], ..., frame[ix[start[s + 1] - 1]],
 * innermost (the allocator) first, outermost (main) last. Stack 0 is the empty stack: "no
 * stack recorded". Invariants (cuma_trace_stacks_validate): nstacks >= 1 when text is set;
 * start[0] == 0 == start[1]; start is non-decreasing up to start[nstacks] == nix; every
 * ix[] < nframes; every frame's file and name are below text_len and text[text_len - 1] is
 * NUL. */
typedef struct cuma_trace_stacks {
    char *text;
    size_t text_len;
    cuma_trace_frame *frame;
    uint32_t nframes;
    uint32_t *ix;
    size_t nix;
    size_t *start; /* nstacks + 1 entries */
    uint32_t nstacks;
} cuma_trace_stacks;

/* A segment PyTorch reserved before recording started and kept through it: in the snapshot's
 * dump, and named by no segment_alloc/segment_free/segment_map/segment_unmap event of the trace
 * (expandable ones are left out). The PyTorch model starts with these as its cache. */
typedef struct cuma_trace_segment {
    uint64_t addr, size; /* bytes; addr + size does not overflow */
    uint64_t stream;
} cuma_trace_segment;

typedef struct cuma_trace {
    char *path;           /* as passed to cuma_trace_load (owned copy) */
    cuma_trace_event *ev; /* n events in file order */
    size_t n;
    size_t unmatched_frees; /* FREE events with match == -1 */
    uint32_t format;        /* cuma_trace_format */
    int device;             /* a snapshot or profiler trace: the device whose events these are
                             * (-1: a profiler trace's CPU events); 0 for CSV */
    int synthetic_times;    /* the file had no times: events are spaced evenly, so time-based
                             * figures (release by time, time averages) mean nothing */
    size_t preexisting;     /* ALLOC events added at time 0 for blocks alive before recording */
    /* A snapshot's segments from before recording (cuma_trace_segment), sorted by address and
     * disjoint; NULL when none. Blocks from before (the first `preexisting` events) keep their
     * recorded addresses, so those inside one of them show where they sat in it. */
    cuma_trace_segment *preseg;
    size_t npreseg;
    cuma_trace_recorded recorded;
    /* With cuma_trace_opts.stacks on a snapshot: per event the stack of the allocation (an
     * ALLOC's own, 0 for other events and for blocks whose stack the file lacks); NULL
     * otherwise. An RMM CSV log has them when LOG.stacks is beside it (the trace_stacks setting):
     * native frames, symbolised when read (stack_file.c). */
    uint32_t *stack;
    cuma_trace_stacks stacks;
} cuma_trace;

/* How to load: cuma_trace_load_opts. */
typedef struct cuma_trace_opts {
    size_t max_events; /* 0: CUMA_TRACE_MAX_EVENTS */
    int device;        /* a snapshot's or profiler trace's device; -1: the one with the most
                        * events (a profiler trace: of its CUDA devices, else its CPU events) */
    int stacks;        /* keep a snapshot's call stacks (cuma_trace.stack); off: never read */
} cuma_trace_opts;

/* The largest hour a Time field may have (over a year of logging); a larger one is malformed. */
#define CUMA_TRACE_MAX_HOURS 9999u

/* cuma_trace_load's limit on events: 16 Mi events, 768 MiB of events at most (the bundled
 * PyTorch traces have 116 k to 207 k). A compressed file can expand a thousandfold, so the
 * reader stops at a limit instead of at the host's memory. */
#define CUMA_TRACE_MAX_EVENTS ((size_t)1 << 24)

/* Reads a whole log into *out (which is overwritten; free it with cuma_trace_free).
 * CUMA_ERR_IO: the file cannot be opened or read (the message names the path and the cause).
 * CUMA_ERR_PARSE: an empty file, a missing header, or a malformed line (a time over
 * CUMA_TRACE_MAX_HOURS hours too); the message reads "FILE:LINE: what is wrong (the offending
 * text)". CUMA_ERR_LIMIT: more than CUMA_TRACE_MAX_EVENTS events ("FILE:LINE: more than N
 * events ..."). CUMA_ERR_OOM: host memory ran out. On failure *out is left empty. */
cuma_status cuma_trace_load(const char *path, cuma_trace *out);

/* cuma_trace_load with another limit on events (1 to SIZE_MAX / 96; CUMA_ERR_INVALID else). The
 * memory a load takes is about 48 bytes an event, plus 16 a live allocation. */
cuma_status cuma_trace_load_max(const char *path, size_t max_events, cuma_trace *out);

/* cuma_trace_load with options. A snapshot's events: alloc -> ALLOC; free_completed -> FREE,
 * or free_requested when no free_completed of the block follows; oom -> ALLOC_FAIL; the rest
 * (segment_*, snapshot, ...) only feed `recorded`. Blocks alive before recording (active in the
 * dump's segments but never allocated in the trace, or freed without an allocation) are
 * ALLOCs at time 0; the dump's segments that no segment event names are `preseg` (reserved
 * before recording). Times are microseconds since the first event. CUMA_ERR_PARSE also for a
 * pickle the reader refuses (pickle.h) or one that is no snapshot; CUMA_ERR_INVALID for a
 * device the snapshot does not have.
 *
 * A Chrome trace's memory events (chrome_trace.h says which fields are read), in time order
 * (ties in file order): "[memory]" with a positive "Bytes" -> ALLOC at "Addr", with a negative
 * one -> FREE of "Addr" (0 bytes: nothing), "[OutOfMemory]" -> ALLOC_FAIL; times are
 * microseconds since the first of them. Only one device's events: a CUDA device ("Device
 * Type" 1, "Device Id" the device), or the CPU's ("Device Type" 0, device -1) when there are no
 * CUDA events and no device was asked for. An address whose first event is a free is a block
 * alive before profiling: an ALLOC at time 0 of that free's size, as for snapshots. `recorded`
 * is the largest "Total Reserved" and its time average (CUDA events only). CUMA_ERR_PARSE also
 * for a trace without memory events; CUMA_ERR_INVALID for a device it does not have. */
cuma_status cuma_trace_load_opts(const char *path, const cuma_trace_opts *o, cuma_trace *out);

/* Sets every event's match and t->unmatched_frees from the actions and pointers, as the CSV
 * reader links them. CUMA_ERR_OOM. */
cuma_status cuma_trace_link(cuma_trace *t);

/* Checks cuma_trace_stacks' invariants, and that every t->stack[] is below nstacks;
 * CUMA_ERR_CORRUPT naming the first broken one. A trace without stacks passes. */
cuma_status cuma_trace_stacks_validate(const cuma_trace *t);

/* Writes t as a PyTorch memory snapshot pickle (snapshot_writer.c says which fields) that
 * cuma_trace_load reads back as the same allocations, frees and call stacks, and PyTorch's
 * memory_viz opens. CUMA_ERR_IO (the message names the path), CUMA_ERR_OOM, CUMA_ERR_INVALID
 * (a device over 1023, an address or size over 2^63-1: the event is named). A failed write leaves
 * no file. */
cuma_status cuma_trace_write_snapshot(const cuma_trace *t, const char *path);

/* Frees what cuma_trace_load allocated and empties *t. NULL and an empty trace are fine. */
void cuma_trace_free(cuma_trace *t);

/* "allocate", "free", "allocate failure" (the log's spelling), or "?" for another value. */
const char *cuma_trace_action_name(uint32_t action);

#ifdef __cplusplus
}
#endif
#endif
