// SPDX-License-Identifier: Apache-2.0
/* cuma: a GPU memory manager.
 *
 * A heap hands out device memory for one device. It places allocations in a large virtual
 * range, maps physical pages only under live bytes, caches idle pages for reuse and gives
 * them back to the device by policy (idle delay, cache cap, trim, out-of-memory).
 *
 * Thread safety: every function that takes a cuma_heap may be called from any thread at any
 * time, concurrently, except cuma_heap_destroy, which must not race with any other call on the
 * same heap. Functions without a heap are thread-safe.
 *
 * fork(): a child process gets every heap in a consistent state, whatever the parent's other
 * threads were doing (the locks are held across the fork), without their release threads: its
 * heaps give idle memory back from their own calls, and cuma_heap_destroy works. The one thing
 * a lock cannot hold still is a thread cache's lock-free fast path: a parent's thread inside one
 * at the fork leaves that block (or its counters) half moved in the child, which cuma_validate
 * then reports; the heap goes on working. A heap whose memory the child shares with the parent
 * (CUDA memory, a simulated device with host_backing) refuses cuma_alloc, cuma_free, cuma_trim,
 * cuma_poll, cuma_set_limit (and _memory_fraction), cuma_record_stream and cuma_snapshot_json
 * in the child with CUMA_ERR_UNSUPPORTED (handing out or giving back a page would change the
 * parent's memory; the snapshot would list the parent's blocks);
 * cuma_heap_destroy frees the child's copy. Trace logs stay the parent's: a child logs nothing. A
 * heap on a simulated device without host backing is fully usable in the child, except that a heap
 * in the ledger grows only in the process whose slot it has.
 *
 * Errors: every call returns a cuma_status; on failure cuma_last_error() returns a message
 * for the calling thread that names what was wrong (the key, the value, the pointer).
 */
#ifndef CUMA_CUMA_H
#define CUMA_CUMA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUMA_VERSION_MAJOR 0
#define CUMA_VERSION_MINOR 1
#define CUMA_VERSION_PATCH 0

/* One status enum for the whole library. */
typedef enum cuma_status {
    CUMA_OK = 0,
    CUMA_ERR_INVALID = 1,     /* a bad argument: NULL handle, size 0, size that overflows */
    CUMA_ERR_OOM = 2,         /* out of memory after every recovery step */
    CUMA_ERR_LIMIT = 3,       /* the request would exceed the heap's configured limit */
    CUMA_ERR_BAD_POINTER = 4, /* free of a pointer the heap did not hand out, or already freed */
    CUMA_ERR_CONFIG = 5,      /* unknown configuration key or bad value */
    CUMA_ERR_BACKEND = 6,     /* the device backend (driver) failed */
    CUMA_ERR_NO_DEVICE = 7,   /* no driver or no such device */
    CUMA_ERR_UNSUPPORTED = 8, /* the backend cannot do this */
    CUMA_ERR_CORRUPT = 9,     /* cuma_validate found a broken invariant */
    CUMA_ERR_IO = 10,         /* a file could not be read or written */
    CUMA_ERR_PARSE = 11,      /* malformed input (trace line, JSON) */
} cuma_status;

/* A short constant description of a status ("out of memory"). Never NULL. */
const char *cuma_status_string(cuma_status s);

/* The message of the calling thread's last failed call (empty if none). Valid until the
 * thread's next cuma call. */
const char *cuma_last_error(void);

/* A stream: a CUstream / cudaStream_t on CUDA backends, any opaque value on the simulated
 * device. NULL is the default stream. CU_STREAM_PER_THREAD (cudaStreamPerThread) is the calling
 * thread's own default stream: each thread's counts as a stream of its own. */
typedef void *cuma_stream;

/* Opaque heap handle: one per device. Thread-safe (see above). */
typedef struct cuma_heap cuma_heap;

/* Heap creation settings. A zero-initialised struct means defaults.
 * Settings are applied in this order, later ones winning: built-in defaults, the CUMA_CONF
 * environment variable (unless CUMA_CONFIG_NO_ENV is set), then `conf`.
 * `conf` uses the CUMA_CONF grammar: "key:value,key:value"; sizes are decimal with an optional
 * fraction and K/M/G/T suffix (powers of 1024, optionally followed by B or iB) and must come to
 * a whole number of bytes ("1.5G"); integers are decimal digits; fractions are decimal ("0.05",
 * "1e-3"). Hex, inf, nan, a '+' sign and exponents in sizes are refused, naming the key.
 * `cuma config` or cuma_config_describe() lists every key. */
typedef struct cuma_config {
    const char *conf; /* settings string; NULL = none */
    unsigned flags;   /* CUMA_CONFIG_* */
    int device;       /* device ordinal for CUDA backends; ignored by the simulated device */
} cuma_config;

#define CUMA_CONFIG_NO_ENV 1u /* ignore CUMA_CONF */

/* Writes a table of every configuration key, its default and its meaning into buf (at most
 * len bytes, NUL-terminated); *needed (may be NULL) gets the full length without the NUL. */
cuma_status cuma_config_describe(char *buf, size_t len, size_t *needed);

/* Checks a settings string without creating a heap. */
cuma_status cuma_config_check(const char *conf);

/* The one reader of the settings grammar, for code that needs a key of a settings string
 * (tools, the Python package) instead of splitting the string itself, so that every reader
 * refuses a malformed string with the same message. `origin` names where conf came from in
 * messages ("CUMA_CONF"; NULL: "config"). Both write text into buf (at most len bytes,
 * NUL-terminated), with *needed (may be NULL) the full length without the NUL, as
 * cuma_config_describe; CUMA_ERR_CONFIG naming the item when conf has a malformed item, an
 * unknown key or a bad value, or key is unknown. */

/* The value `key` takes under conf after the defaults (CUMA_CONF is not read), as JSON the way
 * the stats' settings show it: a number, true or false, a string, or null (none). */
cuma_status cuma_config_get(const char *conf, const char *origin, const char *key, char *buf,
                            size_t len, size_t *needed);

/* conf, each item checked and trimmed, with every item of `key` left out and, unless value is
 * NULL, "key:value" added at the end (where it wins). */
cuma_status cuma_config_set(const char *conf, const char *origin, const char *key,
                            const char *value, char *buf, size_t len, size_t *needed);

/* The process-wide heap of a device, created on first use from CUMA_CONF with that device
 * ordinal (backend:auto when CUMA_CONF names no backend; without a CUDA driver
 * CUMA_ERR_NO_DEVICE, as for cuma_heap_create, unless CUMA_CONF asks for the simulated device). The
 * framework entry points (PyTorch, LD_PRELOAD) use these. Thread-safe; the heap lives until
 * cuma_default_heaps_shutdown() or process exit. */
cuma_status cuma_default_heap(int device, cuma_heap **out);

/* Destroys every default heap (tests; a framework's shutdown). */
void cuma_default_heaps_shutdown(void);

/* Makes `conf` (the CUMA_CONF grammar, at most 4000 bytes) the settings of the default heaps
 * created from now on, in place of CUMA_CONF; NULL goes back to CUMA_CONF. Nothing else
 * changes: heaps that exist keep theirs, cuma_heap_create still reads CUMA_CONF, and the
 * environment (so child processes) is left as it is. Checked (CUMA_ERR_CONFIG names the key)
 * and copied. Thread-safe. The Python package's set_memory_limit/set_memory_growth and
 * CudaMemoryAllocator(conf) use it. */
cuma_status cuma_default_settings_set(const char *conf);

/* Creates a heap. cfg may be NULL: defaults, then CUMA_CONF. When no settings string names a
 * backend, the heap takes backend:auto (vmm, else segment). Where no CUDA driver can be used,
 * every CUDA backend (auto included) is CUMA_ERR_NO_DEVICE, with cuma_last_error() naming the
 * driver's reason and the settings that give the simulated device: backend:sim, or
 * backend_fallback:sim, which runs the heap on it only where no driver can be used (the stats
 * JSON then says "backend_fallback":true). A device ordinal a working driver does not have is
 * CUMA_ERR_NO_DEVICE whatever the fallback. */
cuma_status cuma_heap_create(const cuma_config *cfg, cuma_heap **out);

/* Destroys a heap: every page goes back to the device and the virtual range is freed. Live
 * allocations become invalid. Must not race with other calls on the heap. NULL is a no-op. */
void cuma_heap_destroy(cuma_heap *heap);

/* Allocates `size` bytes usable on `stream` (256-byte aligned at least). On out-of-memory the
 * heap releases its cache, retries, compacts with the mover of cuma_set_mover (cuma/compact.h)
 * if one is set and fragmentation is over its threshold, calls the OOM callbacks, retries,
 * falls back to managed memory where configured, and only then fails with CUMA_ERR_OOM (or
 * CUMA_ERR_LIMIT). A size
 * larger than the heap's virtual range (or, without one, the device) is CUMA_ERR_OOM at once
 * unless managed memory serves it. */
cuma_status cuma_alloc(cuma_heap *heap, size_t size, cuma_stream stream, void **ptr);

/* cuma_alloc for a caller that knows the allocation's call stack better than its return
 * addresses do (an interpreter's bindings: the Python package passes the program's Python
 * frames). In a heap logging with trace_stacks:on, `stack` is recorded as the allocation's
 * stack in LOG.stacks in place of the native one: one frame a line, innermost first, each
 * "FILE\tLINE\tNAME" (LINE decimal, 0 when unknown; a missing field is empty), lines apart by
 * '\n'; at most 32 frames and 1024 bytes of a file or name are kept. NULL or "" records the
 * native stack, as cuma_alloc does. In any other heap, exactly cuma_alloc. */
cuma_status cuma_alloc_with_stack(cuma_heap *heap, size_t size, cuma_stream stream, void **ptr,
                                  const char *stack);

/* Frees a pointer returned by cuma_alloc. The memory is reusable at once by later work on
 * `stream` (pass the stream the memory was last used on; NULL means the stream it was
 * allocated on) and by other streams once that stream's work issued so far is complete.
 * A pointer the heap did not hand out, a pointer inside a block and a second free give
 * CUMA_ERR_BAD_POINTER and change nothing. NULL is a no-op. */
cuma_status cuma_free(cuma_heap *heap, void *ptr, cuma_stream stream);

/* Frees a pointer whose last use may be on any stream, as cudaFree promises a program (the
 * driver's waits for the whole device): nobody, the stream it was allocated on included, reuses
 * the memory before the work issued so far on the default stream is complete, and on its
 * allocation stream (and streams cuma_record_stream added). On CUDA the default stream is the
 * legacy stream, whose work waits for every blocking stream's (every thread's per-thread stream
 * among them), so this covers work on any stream but one created cudaStreamNonBlocking. The host
 * does not wait. Errors as cuma_free's. */
cuma_status cuma_free_device_wide(cuma_heap *heap, void *ptr);

/* Notes that `stream` also uses the allocation: its memory is not reused by anyone until the
 * work issued on `stream` up to the free has completed. */
cuma_status cuma_record_stream(cuma_heap *heap, void *ptr, cuma_stream stream);

/* Tells the heap that `stream` is about to be destroyed: call it before cuStreamDestroy /
 * cudaStreamDestroy, while the handle is still valid. The heap records one last event on the
 * stream and never uses the handle again (the driver may give it to a new stream), and the
 * stream's place in the heap's table is reused once that work is done: without it, a program
 * that makes and destroys streams one after another finds every allocation on a new stream
 * refused after 256 of them (CUMA_ERR_UNSUPPORTED). Memory allocated on the stream stays valid;
 * a later free of it with stream NULL is ordered after the stream's last work. A stream the heap
 * never saw is a no-op; NULL is CUMA_ERR_INVALID. The LD_PRELOAD shim calls it for you. */
cuma_status cuma_stream_retire(cuma_heap *heap, cuma_stream stream);

/* Returns cached memory to the device until at most `keep_bytes` of cached pages remain
 * (0: release the whole cache, like torch.cuda.empty_cache()). Pages whose last users'
 * work is still running are kept. */
cuma_status cuma_trim(cuma_heap *heap, size_t keep_bytes);

/* Runs the time-based release policy now (idle pages older than release_delay_ms go back).
 * The heap also does this on its own slow paths and, if configured, in a background thread. */
cuma_status cuma_poll(cuma_heap *heap);

/* When the release policy will next give memory back, on the heap's clock (ns; see
 * cuma_sim_get_time): the moment the oldest idle page reaches release_delay_ms. UINT64_MAX
 * when nothing is waiting. A program without a release thread can call cuma_poll then. */
cuma_status cuma_next_release(cuma_heap *heap, uint64_t *ns);

/* Sets the hard limit on reserved bytes (0 = no limit beyond the device). Capped at the device
 * size, except on backend:managed, whose managed memory oversubscribes up to any limit set. */
cuma_status cuma_set_limit(cuma_heap *heap, uint64_t bytes);

/* Sets the limit as a fraction of the device's total memory, in (0, 1]. */
cuma_status cuma_set_memory_fraction(cuma_heap *heap, double fraction);

/* The statistics of a heap: one line per figure, the one list from which struct cuma_stats,
 * its JSON (cuma_stats_json), the ledger's copy of a heap's figures (cuma/ledger.h), the
 * exporter's families, `cuma stats` and Python's keys are expanded, so that a new figure is one
 * line here. One in the ledger also needs its word (0 to 23 are taken; ledger_shm.h says where
 * three more fit in the file) and a field of the same name in cuma_ledger_entry and in Python's
 * _lib.LedgerEntry: the build fails without the first, python/tests/test_stats_fields.py
 * without the second.
 *
 *   X(type, name, kind, where, help)
 *
 * type: uint64_t or double. name: the figure's one name everywhere (C field, JSON key, ledger
 * entry field, Python key; the exporter's family is cuma_NAME, with _total after a counter and
 * _ratio after a ratio). kind: CUMA_STAT_GAUGE (a value now) or CUMA_STAT_COUNTER (a count since
 * the heap was made, which only grows), | its unit: CUMA_STAT_COUNT, _BYTES, _NS or _RATIO (a
 * double from 0 to 1). where: CUMA_STAT_HERE (this process only), CUMA_STAT_LEDGER(w) (also
 * published in the ledger, in word w of the heap's slot: the file's layout, so a word is never
 * reused) or CUMA_STAT_EXPORTED(w) (that, and a family of `cuma exporter`). A uint64_t figure of
 * UINT64_MAX is unknown: the JSON leaves it out. The list is also the layout of cuma_stats, which
 * programs built against an older header read by its old offsets (cuma_get_stats_sized): a new
 * figure goes at the end, never between others.
 *
 * Sums of live allocations: a block freed after cuma_record_stream stays live in these (and in
 * active_allocs) until the work of its recorded streams is done, as PyTorch counts it: its
 * memory cannot be reused before. peak_requested_bytes is exact with one thread; with several,
 * each thread's allocations count with the others' as of their last call that took a lock (what
 * they did in their caches since, lags). Pools (cuma/pool.h): each pool's carve is one live
 * allocation, in allocated_bytes and active_allocs; the blocks handed out of it are not
 * allocations (num_allocs and active_allocs do not count them). The ledger's figures are zero
 * when the heap is in none. */
#define CUMA_STATS_FIELDS(X)                                                                       \
    X(uint64_t, requested_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                \
      "Sum of the sizes asked for by live allocations.")                                           \
    X(uint64_t, peak_requested_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_LEDGER(2),      \
      "Highest requested_bytes since creation or cuma_reset_peaks.")                               \
    X(uint64_t, allocated_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_EXPORTED(1),         \
      "Bytes of live allocations after rounding.")                                                 \
    X(uint64_t, peak_allocated_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,           \
      "Highest allocated_bytes since creation or cuma_reset_peaks.")                               \
    X(uint64_t, reserved_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                 \
      "Physical memory held from the device: mapped + cached.")                                    \
    X(uint64_t, peak_reserved_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,            \
      "Highest reserved_bytes since creation or cuma_reset_peaks.")                                \
    /* Less the pages that only blocks in thread caches hold. */                                   \
    X(uint64_t, mapped_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_EXPORTED(3),            \
      "Bytes of pages under at least one live byte.")                                              \
    /* And the pages that only blocks freed into thread caches hold (segment mode: those blocks'   \
     * bytes): reusable at once and releasable, so not fragmentation. */                           \
    X(uint64_t, cached_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                   \
      "Idle pages kept for reuse.")                                                                \
    /* The gaps between and around live blocks in pages they keep mapped, usable only by a request \
     * that fits in a gap: what really is fragmentation (segment mode: free bytes of segments in   \
     * use). The exporter derives it from mapped_bytes and fragmentation. */                       \
    X(uint64_t, stranded_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                 \
      "In-use (mapped) bytes that no live allocation asked for: free, but usable only by "         \
      "requests that fit in the gaps (cached bytes are not among them).")                          \
    X(uint64_t, managed_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_EXPORTED(4),           \
      "Bytes of live allocations served from managed memory.")                                     \
    X(uint64_t, virtual_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                  \
      "Size of the reserved virtual ranges (one per arena).")                                      \
    X(uint64_t, limit_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                    \
      "Effective limit on reserved bytes (device size if none; more only on backend:managed).")    \
    X(uint64_t, device_total_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,             \
      "Device memory as the backend reports it.")                                                  \
    X(uint64_t, device_free_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,              \
      "Free device memory as the backend reports it.")                                             \
    X(uint64_t, page_size, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_LEDGER(0),                 \
      "Size of the heap's physical pages.")                                                        \
    X(uint64_t, active_allocs, CUMA_STAT_GAUGE | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(5),           \
      "Live allocations.")                                                                         \
    X(uint64_t, num_allocs, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(6),            \
      "Successful allocations.")                                                                   \
    X(uint64_t, num_frees, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(7), "Frees.")   \
    X(uint64_t, failed_allocs, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(8),         \
      "Allocations that returned an error.")                                                       \
    /* As PyTorch counts its num_alloc_retries: whether or not the retry succeeded. */             \
    X(uint64_t, alloc_retries, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(9),         \
      "Allocations that did not fit at once and went down the out-of-memory ladder (cache "        \
      "released, then the others' memory, callbacks, managed memory).")                            \
    /* Managed memory may still serve them. */                                                     \
    X(uint64_t, ooms, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(10),                 \
      "Allocations still out of memory after the cache releases (those that reach the OOM "        \
      "callbacks, whether or not the heap has any).")                                              \
    X(uint64_t, oom_callbacks, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(11),        \
      "OOM callback invocations.")                                                                 \
    X(uint64_t, managed_fallbacks, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(12),    \
      "Allocations served from managed memory.")                                                   \
    X(uint64_t, page_creates, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(13),         \
      "Physical pages (or segments) obtained from the device.")                                    \
    X(uint64_t, page_releases, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(14),        \
      "Physical pages (or segments) given back.")                                                  \
    X(uint64_t, maps, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_LEDGER(15), "Pages mapped.")  \
    X(uint64_t, unmaps, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_LEDGER(16),                 \
      "Pages unmapped.")                                                                           \
    X(uint64_t, map_runs, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                     \
      "Map calls: runs of consecutive pages made accessible at once.")                             \
    X(uint64_t, unmap_runs, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                   \
      "Unmap calls: runs of adjacent pages (moved pages' old places, released pages).")            \
    /* On a manual clock only the sim's sim_call_us. */                                            \
    X(uint64_t, page_call_ns, CUMA_STAT_COUNTER | CUMA_STAT_NS, CUMA_STAT_LEDGER(18),              \
      "Time spent in the device's page calls.")                                                    \
    X(double, remap_keep, CUMA_STAT_GAUGE | CUMA_STAT_RATIO, CUMA_STAT_HERE,                       \
      "Idle share of the memory in use that pacing keeps in place now.")                           \
    /* The old mapping goes when that work is done. */                                             \
    X(uint64_t, early_remaps, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                 \
      "Idle pages mapped at a new address while the device still had work on their old one, "      \
      "from the same stream.")                                                                     \
    X(uint64_t, remap_waits, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                  \
      "Times the host waited for such work: its address was needed again, or its page by "         \
      "another stream.")                                                                           \
    X(uint64_t, events_recorded, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,              \
      "Stream events recorded to fence reuse.")                                                    \
    X(uint64_t, event_queries, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                \
      "Times the device was asked whether such an event is done.")                                 \
    X(uint64_t, stream_waits, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                 \
      "Waits queued on the device: a stream ordered after another's work (stream_order:on).")      \
    X(uint64_t, trims, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_LEDGER(17),                  \
      "cuma_trim calls and OOM cache releases.")                                                   \
    X(uint64_t, watermark_released_bytes, CUMA_STAT_COUNTER | CUMA_STAT_BYTES, CUMA_STAT_HERE,     \
      "Idle bytes given back because the device's free memory was under free_watermark.")          \
    /* stranded_bytes / mapped_bytes; the ledger keeps it in parts per million. */                 \
    X(double, fragmentation, CUMA_STAT_GAUGE | CUMA_STAT_RATIO, CUMA_STAT_EXPORTED(20),            \
      "Share of the in-use (mapped) bytes that no live allocation asked for: gaps between live "   \
      "blocks (0 to 1; 0 with nothing live, however much is cached).")                             \
    /* 1 until threads kept colliding: the `arenas` key. */                                        \
    X(uint64_t, arenas, CUMA_STAT_GAUGE | CUMA_STAT_COUNT, CUMA_STAT_LEDGER(19),                   \
      "Arenas the heap has made.")                                                                 \
    X(uint64_t, ledger_denials, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,               \
      "Growths the ledger refused (others held the memory).")                                      \
    X(uint64_t, pressure_asks, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,                \
      "Requests for other heaps' memory this heap posted.")                                        \
    X(uint64_t, pressure_given_bytes, CUMA_STAT_COUNTER | CUMA_STAT_BYTES, CUMA_STAT_HERE,         \
      "Bytes the heap gave back on other heaps' pressure requests.")                               \
    X(uint64_t, pressure_callbacks, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_HERE,           \
      "Pressure callbacks the heap ran.")                                                          \
    /* The device less what the other heaps hold or are guaranteed (and, above this heap's         \
     * guarantee, what heaps of higher priority wait for) and less what it holds. */               \
    X(uint64_t, ledger_room_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,              \
      "Device memory the ledger would still let the heap take now (unknown outside a ledger).")    \
    X(uint64_t, pools, CUMA_STAT_GAUGE | CUMA_STAT_COUNT, CUMA_STAT_HERE,                          \
      "Fixed-size pools that exist (cuma/pool.h).")                                                \
    X(uint64_t, pool_bytes, CUMA_STAT_GAUGE | CUMA_STAT_BYTES, CUMA_STAT_HERE,                     \
      "Bytes the pools' carves hold: count * stride of each pool.")                                \
    X(uint64_t, pool_blocks, CUMA_STAT_GAUGE | CUMA_STAT_COUNT, CUMA_STAT_HERE,                    \
      "Blocks in all pools.")                                                                      \
    X(uint64_t, pool_blocks_in_use, CUMA_STAT_GAUGE | CUMA_STAT_COUNT, CUMA_STAT_HERE,             \
      "Pool blocks handed out by cuma_pool_alloc and not freed.")                                  \
    /* Explicit runs, cuma_compact_if_needed's and the out-of-memory rung's. */                    \
    X(uint64_t, compactions, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(21),          \
      "Compactions run (cuma/compact.h).")                                                         \
    X(uint64_t, compact_moved_bytes, CUMA_STAT_COUNTER | CUMA_STAT_BYTES, CUMA_STAT_EXPORTED(22),  \
      "Bytes compactions' movers copied.")                                                         \
    X(uint64_t, compact_freed_pages, CUMA_STAT_COUNTER | CUMA_STAT_COUNT, CUMA_STAT_EXPORTED(23),  \
      "Pages compactions emptied.")

/* A figure's kind: gauge or counter (bit 0), and its unit (bits 1 and 2). */
#define CUMA_STAT_GAUGE      0u
#define CUMA_STAT_COUNTER    1u
#define CUMA_STAT_COUNT      0u
#define CUMA_STAT_BYTES      2u
#define CUMA_STAT_NS         4u
#define CUMA_STAT_RATIO      6u
#define CUMA_STAT_UNIT(kind) ((kind)&6u)

/* A `where` of the list, for an expansion: the ledger word (-1 outside the ledger), whether
 * the exporter shows it, and CUMA_STAT_IF_LEDGER(where, x...): x only for figures in the
 * ledger. */
#define CUMA_STAT_WORD(where)                 CUMA_STAT_WORD_##where
#define CUMA_STAT_WORD_CUMA_STAT_HERE         (-1)
#define CUMA_STAT_WORD_CUMA_STAT_LEDGER(w)    (w)
#define CUMA_STAT_WORD_CUMA_STAT_EXPORTED(w)  (w)
#define CUMA_STAT_SHOWN(where)                CUMA_STAT_SHOWN_##where
#define CUMA_STAT_SHOWN_CUMA_STAT_HERE        0
#define CUMA_STAT_SHOWN_CUMA_STAT_LEDGER(w)   0
#define CUMA_STAT_SHOWN_CUMA_STAT_EXPORTED(w) 1
#define CUMA_STAT_IF_LEDGER(where, ...)       CUMA_STAT_IF_##where(__VA_ARGS__)
#define CUMA_STAT_IF_CUMA_STAT_HERE(...)
#define CUMA_STAT_IF_CUMA_STAT_LEDGER(w)   CUMA_STAT_KEEP
#define CUMA_STAT_IF_CUMA_STAT_EXPORTED(w) CUMA_STAT_KEEP
#define CUMA_STAT_KEEP(...)                __VA_ARGS__

/* Counters and gauges of one heap; all sizes in bytes. The fields are the list's, in its
 * order. */
typedef struct cuma_stats {
#define CUMA_STAT_MEMBER(type, name, kind, where, help) type name;
    CUMA_STATS_FIELDS(CUMA_STAT_MEMBER)
#undef CUMA_STAT_MEMBER
} cuma_stats;

/* The list at run time (for Python and other readers that do not compile the header): one
 * entry per figure in the list's order, and their number in *n. */
typedef struct cuma_stat_field {
    const char *name, *help;
    unsigned kind;        /* CUMA_STAT_GAUGE or _COUNTER | its unit */
    unsigned is_double;   /* 1: a double, 0: a uint64_t */
    size_t offset;        /* in cuma_stats */
    size_t ledger_offset; /* in cuma_ledger_entry (cuma/ledger.h), SIZE_MAX outside the ledger */
    int ledger_word;      /* the word of the ledger slot, -1 outside the ledger */
    unsigned exported;    /* 1: a family of `cuma exporter` */
} cuma_stat_field;
const cuma_stat_field *cuma_stat_fields(size_t *n);

/* The heap's figures into *out. A program passes the size of the struct its cuma.h declares
 * (the macro does that), and the heap fills that many bytes: built against an older cuma.h, it
 * reads the figures it knows from a newer library (new figures go at the end of the list for
 * that: tests/unit/test_stats_layout.c holds the order); built against a newer one, the figures
 * the library lacks read as unknown (all bits set: UINT64_MAX, or a NaN for a double). size 0
 * or not a multiple of 8 is CUMA_ERR_INVALID. `out` must be a cuma_stats pointer for the
 * macro's sizeof (not NULL or a void pointer). The function cuma_get_stats, without the size,
 * is for programs built before the size was passed: it fills the 52 figures the struct had then
 * and never more, however the list grows. A program built against this header needs a library
 * with cuma_get_stats_sized. */
cuma_status cuma_get_stats_sized(cuma_heap *heap, cuma_stats *out, size_t size);
cuma_status cuma_get_stats(cuma_heap *heap, cuma_stats *out);
#define cuma_get_stats(heap, out) cuma_get_stats_sized((heap), (out), sizeof *(out))

/* Resets the peak_* gauges to the current values. */
cuma_status cuma_reset_peaks(cuma_heap *heap);

/* The stats, configuration and backend of a heap as one JSON object, into buf (at most len
 * bytes, NUL-terminated); *needed (may be NULL) gets the full length without the NUL. */
cuma_status cuma_stats_json(cuma_heap *heap, char *buf, size_t len, size_t *needed);

/* What holds the heap's memory now, as one JSON object, into buf with cuma_stats_json's protocol
 * (at most len bytes, NUL-terminated; *needed gets the full length without the NUL, also when buf
 * is too small or NULL, which fail with CUMA_ERR_INVALID). Over every arena:
 *   "live": blocks the program holds: "count", "bytes" (block sizes), "requested", "by_size"
 *     (non-empty power-of-two buckets [{"le", "count", "bytes"}], "le" the bucket's upper bound)
 *     and "largest": the 32 largest [{"addr": "0x..", "size", "requested", "stream": "0x.." or
 *     0 for the default stream, "arena"}], by size descending, then address ascending;
 *   "thread_cached": blocks the program freed into a thread cache ("count", "bytes"): not live;
 *     the pages only they hold count in "free"'s cached_bytes, as in cuma_stats;
 *   "deferred": freed blocks waiting for the streams cuma_record_stream added ("count", "bytes",
 *     "requested"); cuma_get_stats still counts them, so live + deferred give its requested_bytes
 *     and active_allocs;
 *   "managed": managed-memory fallbacks ("count", "bytes");
 *   "free": "largest_block" (the largest free block of address space in any arena: in page mode
 *     a virtual range, not memory the device has), "cached_bytes", "mapped_bytes",
 *     "reserved_bytes" as in cuma_stats;
 * plus "arenas" and "page_size". Each arena is read under its lock in turn, so the figures are
 * exact while no other thread is inside cuma_alloc or cuma_free on this heap (as cuma_validate).
 * Needs no memory of its own. Refused (CUMA_ERR_UNSUPPORTED) in a forked child whose heap's
 * memory is the parent's, like cuma_alloc. */
cuma_status cuma_snapshot_json(cuma_heap *heap, char *buf, size_t len, size_t *needed);

/* Walks every structure of the heap and checks its invariants. CUMA_OK, or CUMA_ERR_CORRUPT
 * with cuma_last_error() naming the broken invariant. Thread caches hand blocks out without the
 * heap lock, so the check is exact only while no other thread is inside cuma_alloc or cuma_free
 * on this heap (tests call it between phases). */
cuma_status cuma_validate(cuma_heap *heap);

/* Out-of-memory callback: called (without heap locks held) when an allocation of `size`
 * bytes failed even after the cache was released. It may free memory (also through
 * cuma_free on this heap). Return CUMA_OOM_RETRY to have the allocation retried, or
 * CUMA_OOM_PASS to let the next callback (or the failure) follow. A heap's callbacks run on one
 * thread at a time: another thread that runs out meanwhile waits for them (at most a second, in
 * case it holds something they need), tries again with what they freed, and only then calls them
 * itself; a thread that is itself inside callbacks (of any heap) does not wait, and fails as if
 * they freed nothing. An allocation a callback makes on the same heap fails without calling the
 * callbacks again. */
#define CUMA_OOM_PASS  0
#define CUMA_OOM_RETRY 1
typedef int (*cuma_oom_fn)(void *user, cuma_heap *heap, size_t size, cuma_stream stream);

/* Registers a callback; callbacks run in registration order. *id (may be NULL) gets a
 * handle for cuma_remove_oom_callback. At most 16 per heap. cuma_remove_oom_callback returns
 * once no run of the heap's callbacks that could still call the removed one is in progress, so
 * its `user` may be freed then (do not remove one from a thread a running callback waits for);
 * removed from inside one of the heap's callbacks, it may still be called once by a run already
 * in progress. */
cuma_status cuma_add_oom_callback(cuma_heap *heap, cuma_oom_fn fn, void *user, int *id);
cuma_status cuma_remove_oom_callback(cuma_heap *heap, int id);

/* Size of the block behind a live pointer (the rounded size the heap reserved for it). */
cuma_status cuma_block_size(cuma_heap *heap, const void *ptr, size_t *size);

#ifdef __cplusplus
}
#endif
#endif
