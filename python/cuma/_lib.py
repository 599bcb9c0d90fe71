# SPDX-License-Identifier: Apache-2.0
"""Finding and loading libcuma.so, and the ctypes prototypes of the C API.

The library is loaded on first use, not at import, so ``import cuma`` never fails for want
of it; the first call that needs it raises :class:`cuma.LibraryNotFoundError` listing every
place that was tried. Places, in order:

1. ``$CUMA_LIBRARY``: a file, or a directory holding libcuma.so. An explicit setting wins
   over anything found by looking around, so that a stale copy cannot shadow it: when it is
   set, nothing else is tried, and a setting that names no loadable libcuma (no such file, a
   file the loader refuses, an old library lacking functions) is an error naming the path
   and the reason.
2. next to the package: ``cuma/libcuma.so``, then the directory that holds ``cuma/``
   (an installed copy of the package beside the library);
3. the build tree when running from the source checkout: ``<repo>/build/lib``;
4. the system: ``ctypes.util.find_library("cuma")``, then ``libcuma.so`` / ``libcuma.so.0``
   through the dynamic loader's own search (LD_LIBRARY_PATH, ldconfig cache).
"""

import ctypes
import ctypes.util
import os
import threading

from .errors import LibraryNotFoundError, error_for_status

_NAMES = ("libcuma.so", "libcuma.so.0")

_lock = threading.Lock()
_lib = None
_path = None

# The OOM callback type of cuma.h: int (*)(void *user, cuma_heap *heap, size_t size,
# cuma_stream stream). ctypes takes the GIL when C calls it, from any thread.
OOM_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

# The pressure callback of cuma/ledger.h: void (*)(void *user, cuma_heap *heap, uint64_t bytes),
# called from the heap's release thread.
PRESSURE_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)


# The mover of cuma/compact.h: bool (*)(void *user, void *old_ptr, void *new_ptr, size_t size,
# cuma_stream stream), called on the thread that compacts (cuma_compact, or an allocation that
# ran out of memory) with no heap lock held.
MOVE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class CompactResult(ctypes.Structure):
    """struct cuma_compact_result of cuma/compact.h."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("blocks_moved", "bytes_moved", "blocks_refused", "pages_emptied", "pages_released")
    ]


class LedgerEntry(ctypes.Structure):
    """cuma_ledger_entry of cuma/ledger.h (same field order). Its allocator figures are the
    ledger's figures of the list in cuma.h; tests check these names and offsets against the
    library's own (cuma_stat_fields)."""

    _fields_ = [
        ("pid", ctypes.c_int),
        ("priority", ctypes.c_int),
        ("slot", ctypes.c_uint),
        ("process", ctypes.c_char * 32),
        ("device", ctypes.c_char * 64),
    ] + [
        (name, ctypes.c_uint64)
        for name in (
            "capacity",
            "guarantee",
            "limit",
            "reserved",
            "cached",
            "requested",
            "peak_reserved",
            "want",
            "ledger_denials",
            "pressure_asks",
            "pressure_given_bytes",
            "pressure_callbacks",
            "age_ns",
        )
    ] + [("backend", ctypes.c_char * 16)] + [
        (name, ctypes.c_uint64)
        for name in (
            "page_size",
            "allocated_bytes",
            "peak_requested_bytes",
            "mapped_bytes",
            "managed_bytes",
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
            "trims",
            "page_call_ns",
            "arenas",
        )
    ] + [("fragmentation", ctypes.c_double), ("stats_age_ns", ctypes.c_uint64)] + [
        (name, ctypes.c_char * 64) for name in ("pod", "pod_namespace", "container")
    ] + [(name, ctypes.c_uint64) for name in ("compactions", "compact_moved_bytes", "compact_freed_pages")]


class StatField(ctypes.Structure):
    """struct cuma_stat_field of cuma.h: one figure of the list of statistics."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("help", ctypes.c_char_p),
        ("kind", ctypes.c_uint),
        ("is_double", ctypes.c_uint),
        ("offset", ctypes.c_size_t),
        ("ledger_offset", ctypes.c_size_t),
        ("ledger_word", ctypes.c_int),
        ("exported", ctypes.c_uint),
    ]


# The kind bits of cuma.h: counter (else gauge), and the unit.
STAT_COUNTER = 1
STAT_UNITS = {0: "count", 2: "bytes", 4: "ns", 6: "ratio"}


def stat_fields():
    """The library's list of statistics (cuma_stat_fields), in its order, as dicts: name,
    help, kind ("counter" or "gauge"), unit ("count", "bytes", "ns", "ratio"), ledger (its
    field of a cuma.ledger() entry is of the same name), exported (a family of `cuma
    exporter`)."""
    n = ctypes.c_size_t()
    p = lib().cuma_stat_fields(ctypes.byref(n))
    return [
        {
            "name": p[i].name.decode(),
            "help": p[i].help.decode(),
            "kind": "counter" if p[i].kind & STAT_COUNTER else "gauge",
            "unit": STAT_UNITS[p[i].kind & 6],
            "ledger": p[i].ledger_word >= 0,
            "ledger_offset": p[i].ledger_offset if p[i].ledger_word >= 0 else None,
            "exported": bool(p[i].exported),
        }
        for i in range(n.value)
    ]


class Config(ctypes.Structure):
    """struct cuma_config."""

    _fields_ = [("conf", ctypes.c_char_p), ("flags", ctypes.c_uint), ("device", ctypes.c_int)]


def _env_candidates(env):
    """(description, path) pairs that $CUMA_LIBRARY names."""
    if os.path.isdir(env):
        for n in _NAMES:
            yield "$CUMA_LIBRARY directory", os.path.join(env, n)
    else:
        yield "$CUMA_LIBRARY", env


def _candidates():
    """(description, path or bare name) pairs searched when $CUMA_LIBRARY is not set, in
    order."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    for d, what in ((pkg, "package directory"), (os.path.dirname(pkg), "next to the package")):
        for n in _NAMES:
            yield what, os.path.join(d, n)
    try:  # installed by `make install`: the library folder relative to the package
        from . import _installed

        for n in _NAMES:
            yield "install prefix", os.path.normpath(os.path.join(pkg, _installed.LIBDIR, n))
    except ImportError:
        pass
    repo = os.path.dirname(os.path.dirname(pkg))  # python/cuma -> python -> repo
    for n in _NAMES:
        yield "source tree build", os.path.join(repo, "build", "lib", n)
    found = ctypes.util.find_library("cuma")
    if found:
        yield "ctypes.util.find_library", found
    for n in _NAMES:
        yield "dynamic loader search", n


def _prototype(lib):
    c = ctypes
    vp, sz, st = c.c_void_p, c.c_size_t, c.c_int
    protos = {
        "cuma_status_string": (c.c_char_p, [st]),
        "cuma_last_error": (c.c_char_p, []),
        "cuma_config_describe": (st, [c.c_char_p, sz, c.POINTER(sz)]),
        "cuma_config_check": (st, [c.c_char_p]),
        "cuma_config_get": (st, [c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, sz, c.POINTER(sz)]),
        "cuma_config_set": (st, [c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, sz, c.POINTER(sz)]),
        "cuma_default_heap": (st, [c.c_int, c.POINTER(vp)]),
        "cuma_default_heaps_shutdown": (None, []),
        "cuma_default_settings_set": (st, [c.c_char_p]),
        "cuma_heap_create": (st, [c.POINTER(Config), c.POINTER(vp)]),
        "cuma_heap_destroy": (None, [vp]),
        "cuma_alloc": (st, [vp, sz, vp, c.POINTER(vp)]),
        "cuma_alloc_with_stack": (st, [vp, sz, vp, c.POINTER(vp), c.c_char_p]),
        "cuma_free": (st, [vp, vp, vp]),
        "cuma_record_stream": (st, [vp, vp, vp]),
        "cuma_stream_retire": (st, [vp, vp]),
        "cuma_trim": (st, [vp, sz]),
        "cuma_poll": (st, [vp]),
        "cuma_next_release": (st, [vp, c.POINTER(c.c_uint64)]),
        "cuma_set_limit": (st, [vp, c.c_uint64]),
        "cuma_set_memory_fraction": (st, [vp, c.c_double]),
        "cuma_reset_peaks": (st, [vp]),
        "cuma_stats_json": (st, [vp, c.c_char_p, sz, c.POINTER(sz)]),
        "cuma_stat_fields": (c.POINTER(StatField), [c.POINTER(sz)]),
        "cuma_snapshot_json": (st, [vp, c.c_char_p, sz, c.POINTER(sz)]),
        "cuma_validate": (st, [vp]),
        "cuma_add_oom_callback": (st, [vp, OOM_CALLBACK, vp, c.POINTER(c.c_int)]),
        "cuma_remove_oom_callback": (st, [vp, c.c_int]),
        "cuma_add_pressure_callback": (st, [vp, PRESSURE_CALLBACK, vp, c.POINTER(c.c_int)]),
        "cuma_remove_pressure_callback": (st, [vp, c.c_int]),
        "cuma_ledger_snapshot": (st, [c.c_char_p, c.POINTER(LedgerEntry), sz, c.POINTER(sz)]),
        "cuma_ledger_path": (st, [c.c_char_p, c.c_char_p, sz]),
        "cuma_block_size": (st, [vp, vp, c.POINTER(sz)]),
        "cuma_compact": (st, [vp, MOVE_CALLBACK, vp, c.POINTER(CompactResult)]),
        "cuma_compact_if_needed": (st, [vp, c.POINTER(CompactResult)]),
        "cuma_set_mover": (st, [vp, MOVE_CALLBACK, vp]),
        "cuma_pool_create": (st, [vp, sz, sz, vp, c.POINTER(vp)]),
        "cuma_pool_destroy": (st, [vp]),
        "cuma_pool_alloc": (st, [vp, c.POINTER(vp)]),
        "cuma_pool_free": (st, [vp, vp]),
        "cuma_pool_info": (st, [vp, c.POINTER(sz), c.POINTER(sz), c.POINTER(sz)]),
        "cuma_pool_validate": (st, [vp]),
        "cuma_sim_set_time": (st, [vp, c.c_uint64]),
        "cuma_sim_get_time": (st, [vp, c.POINTER(c.c_uint64)]),
        "cuma_sim_hold_stream": (st, [vp, vp]),
        "cuma_sim_release_stream": (st, [vp, vp]),
        "cuma_torch_malloc": (vp, [c.c_ssize_t, c.c_int, vp]),
        "cuma_torch_free": (None, [vp, c.c_ssize_t, c.c_int, vp]),
        "cuma_torch_init": (None, [c.c_int]),
        "cuma_torch_reset": (None, []),
        "cuma_torch_memory_fraction": (None, [c.c_double, c.c_int]),
        "cuma_torch_record_stream": (None, [vp, vp]),
        "cuma_torch_stats_json": (c.c_int, [c.c_int, c.c_char_p, sz]),
        "cuma_torch_created_heap": (vp, [c.c_int]),
        "cuma_torch_disown": (st, [vp]),
        "cuma_torch_disowned": (c.c_bool, [vp]),
    }
    missing = []
    for name, (res, args) in protos.items():
        fn = getattr(lib, name, None)
        if fn is None:
            missing.append(name)
            continue
        fn.restype = res
        fn.argtypes = args
    return missing


def lib():
    """The loaded libcuma (a ctypes.CDLL with prototypes set); loads it on first call."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        env = os.environ.get("CUMA_LIBRARY")
        for what, path in _env_candidates(env) if env else _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append("%s: %s (no such file)" % (what, path))
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s: %s (%s)" % (what, path, e))
                continue
            missing = _prototype(handle)
            if missing:
                # An old or foreign libcuma: say so instead of failing later on one symbol.
                tried.append("%s: %s (lacks %s)" % (what, path, ", ".join(missing)))
                continue
            _path = getattr(handle, "_name", path)
            if os.sep in _path:
                _path = os.path.abspath(_path)
            _lib = handle
            return _lib
        if env:
            raise LibraryNotFoundError(
                "CUMA_LIBRARY=%s names no usable libcuma, and an explicit setting is not replaced by "
                "a copy found elsewhere; point it at a libcuma.so built from this version (or a folder "
                "holding one), or unset it to search the usual places. Tried:\n  %s" % (env, "\n  ".join(tried))
            )
        raise LibraryNotFoundError(
            "libcuma.so not found; build it (cmake -S . -B build && cmake --build build) and set "
            "CUMA_LIBRARY=/path/to/libcuma.so, or copy it next to the cuma package. Tried:\n  "
            + "\n  ".join(tried)
        )


def path():
    """The file libcuma was loaded from (loading it if needed).

    A bare name ("libcuma.so", found through the loader's search) is resolved through
    /proc/self/maps, since PyTorch's CUDAPluggableAllocator wants a path it can dlopen to the
    same library."""
    lib()
    if os.sep in _path:
        return _path
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(p).startswith("libcuma.so"):
                    return p
    except OSError:
        pass
    return _path


def last_error():
    """The calling thread's libcuma error message (str)."""
    msg = lib().cuma_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status, what=None):
    """Raises the CumaError subclass for a failed status, with libcuma's message."""
    if status == 0:
        return
    msg = last_error()
    if not msg:
        s = lib().cuma_status_string(status)
        msg = s.decode() if s else "status %d" % status
        if what:
            msg = "%s: %s" % (what, msg)
    raise error_for_status(status, msg)


def read_json_text(call):
    """Runs a C function of the shape call(buf, len, needed_ptr) -> status that fills a
    buffer, growing the buffer until the text fits. Returns the text."""
    size = 8192
    while True:
        buf = ctypes.create_string_buffer(size)
        needed = ctypes.c_size_t(0)
        st = call(buf, size, ctypes.byref(needed))
        if st == 0:
            return buf.value.decode("utf-8", "replace")
        if needed.value + 1 > size:
            size = needed.value + 1
            continue
        check(st)
