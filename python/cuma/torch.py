# SPDX-License-Identifier: Apache-2.0
"""cuma as PyTorch's CUDA allocator, and PyTorch-style statistics.

::

    import cuma
    cuma.torch.enable("release_delay_ms:2000")   # before CUDA is initialised
    ...
    print(cuma.torch.memory_summary())
    cuma.torch.empty_cache()
    cuma.torch.compact(model, optimizer=opt)   # between steps: scattered tensors to dense pages

whatif() replays a PyTorch memory snapshot (this process's, a dict or a file) through
`cuma replay` and tells what PyTorch reserved against what cuma would reserve.

enable() needs a CUDA build of PyTorch 2.x (``torch.cuda.memory.CUDAPluggableAllocator``) and
a libcuma with the CUDA backends. memory_stats(), memory_summary(), memory_snapshot() and
empty_cache() work on the default heaps without PyTorch, on any backend (the simulated one
included). compact() moves a model's parameters, gradients, buffers and optimizer state into
dense pages; pool_buffers() puts a module's buffers in a fixed-size pool; empty() makes a tensor
over a block of any cuma heap (_torch_place.py).

PyTorch is imported lazily: importing this module does not import torch.
"""

import ctypes
import json
import os
import threading
import warnings

from . import _alloc_conf, _lib
from ._whatif import whatif
from .heap import _apply_default_conf, _device_arg
from ._torch_place import compact, empty, pool_buffers

__all__ = [
    "enable",
    "is_enabled",
    "wired_hooks",
    "memory_stats",
    "memory_summary",
    "memory_snapshot",
    "empty_cache",
    "whatif",
    "compact",
    "pool_buffers",
    "empty",
]

_lock = threading.Lock()
_allocator = None  # the CUDAPluggableAllocator once enabled (kept alive: PyTorch holds a copy)
_conf_at_enable = None
_hooks = []

# PyTorch's optional allocator hooks and the libcuma functions behind them. PyTorch 2.x sets
# them on the C++ allocator object (alloc.allocator().set_init_fn(fn_ptr), ...); some builds
# and forks spell them with a leading underscore or on the Python wrapper, so every spelling
# is tried and missing ones are skipped.
_HOOKS = (
    ("init_fn", "cuma_torch_init"),
    ("reset_fn", "cuma_torch_reset"),
    ("memory_fraction_fn", "cuma_torch_memory_fraction"),
    ("record_stream_fn", "cuma_torch_record_stream"),
)


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("cuma.torch.enable(): PyTorch is not installed (%s)" % e) from e
    return torch


def is_enabled():
    """Whether enable() switched this process's PyTorch to cuma."""
    return _allocator is not None


def wired_hooks():
    """The optional PyTorch hooks enable() could wire (e.g. ["init_fn", "reset_fn", ...])."""
    return list(_hooks)


def enable(conf=None):
    """Makes cuma PyTorch's CUDA allocator for this process.

    ``conf`` (optional) becomes the settings of the default heaps, which are created on first
    use, in place of CUMA_CONF (the environment is not changed: other heaps and child processes
    still read CUMA_CONF). Must be called before CUDA is initialised (the first CUDA tensor,
    but also torch.cuda.set_device(), current_device() or get_device_name() initialise it):
    PyTorch refuses to swap an initialised allocator. An allocation cuma cannot serve raises
    torch.cuda.OutOfMemoryError (a RuntimeError) where libcuma_torch_c10 was built for this
    PyTorch (see _entry_points), else a plain RuntimeError; either way its text starts with
    "CUDA out of memory." and gives cuma's reason, and cuma.adaptive.is_oom() recognises it.
    Raises RuntimeError, saying exactly why, when this
    PyTorch has no CUDA or no CUDAPluggableAllocator (PyTorch < 2.0, CPU-only builds), when
    PyTorch's CUDA is initialised already, or when the settings put the default heaps on the
    simulated device (its addresses are not device memory: PyTorch's kernels would fault on
    them). No heap is made here (no CUDA context either): the first CUDA tensor makes its
    device's, and a libcuma without the CUDA backends fails it, saying so. The settings are
    fixed from here on.
    Calling it again with the same (or no) settings does nothing. Returns the allocator.

    PYTORCH_CUDA_ALLOC_CONF is read: options with a cuma equivalent become cuma settings
    (``per_process_memory_fraction`` -> ``memory_fraction``; ``expandable_segments`` is what cuma
    always does), the rest are ignored with a RuntimeWarning that says why; ``conf`` and
    CUMA_CONF win over translated settings. The table is in cuma/_alloc_conf.py. Unless they
    name it, ``stream_order:on`` is set too: PyTorch uses memory on its allocation stream, so a
    page with work pending on another stream may back it once that stream's work is ordered
    before it on the device (_alloc_conf.py says why)."""
    global _allocator, _conf_at_enable, _hooks
    torch = _import_torch()
    with _lock:
        if _allocator is not None:
            if conf is not None and conf != _conf_at_enable:
                raise RuntimeError(
                    "cuma.torch.enable(%r): cuma is already PyTorch's allocator with settings %r; "
                    "settings cannot change once tensors may exist" % (conf, _conf_at_enable)
                )
            return _allocator
        problems = []
        if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
            problems.append("this PyTorch (%s) is built without CUDA (torch.version.cuda is None)" % torch.__version__)
        mem = getattr(torch.cuda, "memory", None)
        if mem is None or not hasattr(mem, "CUDAPluggableAllocator") or not hasattr(mem, "change_current_allocator"):
            problems.append(
                "this PyTorch (%s) has no torch.cuda.memory.CUDAPluggableAllocator / change_current_allocator "
                "(added in PyTorch 2.0)" % torch.__version__
            )
        if problems:
            raise RuntimeError("cuma.torch.enable(): cannot make cuma PyTorch's allocator: " + "; ".join(problems))
        if torch.cuda.is_initialized():
            # PyTorch initialises its allocator with CUDA and then refuses to swap it: checked
            # here, before cuma's settings or heaps are touched, so that nothing is left behind.
            raise RuntimeError(
                "cuma.torch.enable(): PyTorch's CUDA, and its allocator with it, is initialised already "
                "(a CUDA tensor, torch.cuda.set_device(), current_device(), get_device_name() ...), and "
                "PyTorch does not swap an initialised allocator; call enable() before any of them"
            )
        # PYTORCH_CUDA_ALLOC_CONF: its options with a cuma equivalent join the settings, the
        # others are warned about (_alloc_conf.py has the table); stream_order:on goes under
        # them (PyTorch's contract is stream-ordered), except over default heaps that exist
        # already, which keep the settings they were made with.
        from .heap import (
            _conf_value,
            _created_default_heaps,
            _default_conf,
            _fix_default_settings,
            _unfix_default_settings,
            check_config,
            default_heap,
        )

        created = _created_default_heaps()
        defaults = () if conf is None and created else _alloc_conf.TORCH_DEFAULTS
        # No heap is made here: that would initialise the driver and take a context on device
        # 0 in every process (each rank of a job on 8 GPUs, a parent about to fork), where
        # PyTorch's own allocator touches no device before its first tensor. The settings are
        # checked now (a malformed one raises ConfigError), set only once nothing can refuse,
        # and a heap is made at the first tensor.
        new = _alloc_conf.apply(os.environ, conf, defaults)
        settings = new if new is not None else _default_conf()
        if settings is not None:
            check_config(settings)
        sim = [default_heap(d).stats().get("backend", "") for d in created]  # existing ones only
        sim = [b for b in sim if b.startswith("sim")]
        if _conf_value(settings, "backend") == "sim" or _conf_value(settings, "backend_fallback") == "sim":
            sim.append("sim")
        if sim:
            raise RuntimeError(
                "cuma.torch.enable(): the default heaps would be on the simulated device (backend %r, or "
                "backend_fallback:sim): its addresses are not device memory. Run where a CUDA driver is "
                "present with a CUDA backend (backend:auto, the default, or backend:vmm)" % sim[0]
            )
        lib_path, malloc_name = _entry_points(getattr(torch, "__version__", None), torch)
        alloc = mem.CUDAPluggableAllocator(lib_path, malloc_name, "cuma_torch_free")
        hooks = _wire_hooks(alloc)
        # Set and fixed at once, so that no other thread's settings come between, and undone
        # if PyTorch refuses: a failed enable() leaves the settings as they were.
        before = _fix_default_settings(new, "cuma.torch.enable()")
        try:
            mem.change_current_allocator(alloc)
        except BaseException as e:
            _unfix_default_settings(before)
            if not isinstance(e, RuntimeError):
                raise
            raise RuntimeError(
                "cuma.torch.enable(): PyTorch refused to switch allocators (%s); call enable() before "
                "CUDA is initialised (the first CUDA tensor, torch.cuda.set_device(), ...)" % e
            ) from e
        _allocator = alloc
        _conf_at_enable = conf
        _hooks = hooks
        return alloc


def _entry_points(torch_version=None, torch=None):
    """The library PyTorch should load and its allocation function.

    First libcuma_torch_c10-<torch_version>.so (next to libcuma.so, built where PyTorch's C++
    headers were found), whose allocation raises PyTorch's own torch.cuda.OutOfMemoryError (a
    RuntimeError) when cuma has no room, so that PyTorch's recovery paths and callers catching
    that type work as with PyTorch's allocator. It is compiled against one PyTorch's ABI, hence
    the version in its name: another PyTorch never loads it. Where there is none for this
    version and `torch` (the module) is given, one built for it at run time (cuma/_torch_c10.py:
    once per PyTorch and libcuma, with the system C++ compiler, into a per-user cache; nothing,
    silently, without a compiler or PyTorch's headers). Then libcuma_torch.so, whose allocation
    raises a RuntimeError starting "CUDA out of memory." with cuma's reason. PyTorch keeps a
    NULL from a pluggable allocator as a tensor without storage, which fails later saying
    nothing of memory, so the plain C entry point is only the fallback for a libcuma built
    without a C++ compiler (with a warning)."""
    lib_path = _lib.path()
    lib_dir = os.path.dirname(lib_path)
    if torch_version:
        c10 = os.path.join(lib_dir, "libcuma_torch_c10-%s.so" % torch_version)
        if not os.path.exists(c10) and torch is not None:
            from . import _torch_c10

            c10 = _torch_c10.library(torch, lib_path) or c10
        if os.path.exists(c10):
            try:
                ctypes.CDLL(c10)  # PyTorch's dlopen would fail the same way, with less to say
                return c10, "cuma_torch_raising_malloc"
            except OSError as e:
                # One built for this version elsewhere (another C++ ABI, a pip build beside a
                # source build of the same version): one built here, against this PyTorch,
                # may load where it did not.
                if torch is not None:
                    from . import _torch_c10

                    built = _torch_c10.library(torch, lib_path)
                    if built and built != c10:
                        try:
                            ctypes.CDLL(built)
                            return built, "cuma_torch_raising_malloc"
                        except OSError:
                            pass
                warnings.warn(
                    "cuma.torch.enable(): %s cannot be loaded (%s): out-of-memory errors will be a "
                    "RuntimeError, not torch.cuda.OutOfMemoryError" % (c10, e),
                    RuntimeWarning,
                    stacklevel=3,
                )
    raising = os.path.join(lib_dir, "libcuma_torch.so")
    if os.path.exists(raising):
        return raising, "cuma_torch_raising_malloc"
    warnings.warn(
        "cuma.torch.enable(): %s is missing (libcuma was built without a C++ compiler): a failed "
        "allocation will not raise an out-of-memory error in PyTorch, only print its reason on "
        "stderr" % raising,
        RuntimeWarning,
        stacklevel=3,
    )
    return lib_path, "cuma_torch_malloc"


def _wire_hooks(alloc):
    lib = _lib.lib()
    targets = []
    get_cpp = getattr(alloc, "allocator", None)
    if callable(get_cpp):
        try:
            targets.append(get_cpp())
        except Exception:
            pass
    targets.append(alloc)
    wired = []
    for hook, symbol in _HOOKS:
        fn_ptr = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        for target in targets:
            setter = getattr(target, "set_" + hook, None) or getattr(target, "_set_" + hook, None)
            if setter is None:
                continue
            setter(fn_ptr)
            wired.append(hook)
            break
    return wired


def empty_cache():
    """Gives every default heap's cached memory back to the device (what PyTorch's
    torch.cuda.empty_cache() does through the reset hook once cuma is enabled)."""
    _lib.lib().cuma_torch_reset()


def _raw_stats(device):
    lib = _lib.lib()
    size = 8192
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.cuma_torch_stats_json(device, buf, size)
        if n < 0:
            _lib.check(-n)
        if n < size:
            return json.loads(buf.value.decode("utf-8", "replace"))
        size = n + 1


# PyTorch's memory_stats() keys that mean the same thing in cuma, and where they come from.
# PyTorch counts "allocated" bytes after its rounding (cuma: allocated_bytes, after the
# placement policy's rounding), "requested" bytes as asked for, "reserved" bytes held from the
# device (cuma: mapped + cached pages), "active" bytes as allocated plus blocks waiting on
# stream events (cuma keeps those in allocated_bytes until their events complete).
_TORCH_KEYS = (
    ("allocated_bytes.all.current", "allocated_bytes"),
    ("allocated_bytes.all.peak", "peak_allocated_bytes"),
    ("reserved_bytes.all.current", "reserved_bytes"),
    ("reserved_bytes.all.peak", "peak_reserved_bytes"),
    ("active_bytes.all.current", "allocated_bytes"),
    ("active_bytes.all.peak", "peak_allocated_bytes"),
    ("requested_bytes.all.current", "requested_bytes"),
    ("requested_bytes.all.peak", "peak_requested_bytes"),
    ("allocation.all.current", "active_allocs"),
    ("allocation.all.allocated", "num_allocs"),
    ("allocation.all.freed", "num_frees"),
    ("active.all.current", "active_allocs"),
    ("num_alloc_retries", "alloc_retries"),
    ("num_ooms", "ooms"),
    ("num_device_alloc", "page_creates"),
    ("num_device_free", "page_releases"),
)


def memory_stats(device=0):
    """The default heap's statistics as a flat dict: PyTorch's key names where they mean the
    same thing ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_ooms",
    "num_device_alloc" = pages created, ...), plus every cuma value under "cuma.<name>" and
    the settings under "cuma.config.<key>". Creates the default heap if needed."""
    device = _device_arg(device)
    raw = _raw_stats(device)
    out = {}
    for tkey, ckey in _TORCH_KEYS:
        if ckey in raw:
            out[tkey] = raw[ckey]
    for k, v in raw.items():
        if k == "config" and isinstance(v, dict):
            for ck, cv in v.items():
                out["cuma.config." + ck] = cv
        else:
            out["cuma." + k] = v
    return out


def memory_snapshot(device=0):
    """What holds the default heap's memory now, as a dict (cuma.Heap.snapshot()): the live
    blocks by size with the 32 largest (address, size, requested bytes, stream), blocks in
    thread caches or waiting on record_stream, managed fallbacks and the free figures.
    torch.cuda.memory._snapshot() does not work under a pluggable allocator; this is what to
    print when a job runs out of memory. Creates the default heap if needed."""
    from .heap import default_heap

    return default_heap(_device_arg(device)).snapshot()


def _fmt_bytes(n):
    if not isinstance(n, (int, float)):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.2f %s" % (n, unit))
        n /= 1024.0
    return str(n)


def memory_summary(device=0):
    """A readable table of the default heap's memory (like torch.cuda.memory_summary())."""
    s = memory_stats(device)
    rows = [
        ("Requested memory", s.get("requested_bytes.all.current"), s.get("requested_bytes.all.peak")),
        ("Allocated memory", s.get("allocated_bytes.all.current"), s.get("allocated_bytes.all.peak")),
        ("Reserved memory", s.get("reserved_bytes.all.current"), s.get("reserved_bytes.all.peak")),
        ("  mapped (under live bytes)", s.get("cuma.mapped_bytes"), None),
        ("  cached (idle pages)", s.get("cuma.cached_bytes"), None),
        ("Managed fallback memory", s.get("cuma.managed_bytes"), None),
        ("Limit", s.get("cuma.limit_bytes"), None),
        ("Device total / free", s.get("cuma.device_total_bytes"), s.get("cuma.device_free_bytes")),
    ]
    counts = [
        ("Live allocations", s.get("allocation.all.current")),
        ("Allocations / frees", "%s / %s" % (s.get("allocation.all.allocated"), s.get("allocation.all.freed"))),
        ("Alloc retries (cache released)", s.get("num_alloc_retries")),
        ("OOMs (after cache release) / failed", "%s / %s" % (s.get("num_ooms"), s.get("cuma.failed_allocs"))),
        ("Pages created / released", "%s / %s" % (s.get("num_device_alloc"), s.get("num_device_free"))),
        ("Page maps / unmaps", "%s / %s" % (s.get("cuma.maps"), s.get("cuma.unmaps"))),
        ("Stranded (in-use pages, not live)", "%s (%.2f%% of in use)" % (
            _fmt_bytes(s.get("cuma.stranded_bytes")), 100.0 * (s.get("cuma.fragmentation") or 0.0))),
    ]
    if s.get("cuma.ledger"):  # sharing the GPU with other jobs: what passed between them
        counts.append(("Ledger denials / asks of others", "%s / %s" % (
            s.get("cuma.ledger_denials"), s.get("cuma.pressure_asks"))))
        counts.append(("Given to others / callbacks", "%s / %s" % (
            _fmt_bytes(s.get("cuma.pressure_given_bytes")), s.get("cuma.pressure_callbacks"))))
    width = 74
    line = "|" + "=" * (width - 2) + "|"
    lines = [
        line,
        "| %-*s |" % (width - 4, ("cuma memory summary, device %d, policy %s" % (device, s.get("cuma.policy")))[: width - 4]),
        "| %-*s |" % (width - 4, ("backend: %s" % s.get("cuma.backend"))[: width - 4]),
        line,
        "| %-34s | %16s | %16s |" % ("Metric", "Current", "Peak / other"),
        "|" + "-" * (width - 2) + "|",
    ]
    for name, cur, peak in rows:
        lines.append("| %-34s | %16s | %16s |" % (name, _fmt_bytes(cur), "" if peak is None else _fmt_bytes(peak)))
    lines.append("|" + "-" * (width - 2) + "|")
    for name, val in counts:
        lines.append("| %-34s | %35s |" % (name, val))
    lines.append(line)
    return "\n".join(lines)

