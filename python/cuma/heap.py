# SPDX-License-Identifier: Apache-2.0
"""cuma heaps from Python: :class:`Heap` (a heap you own) and the process-wide default heaps.

Pointers are plain ints (device addresses); streams are ints (a cudaStream_t's value, 0 for
the default stream), None, or an object with a ``cuda_stream`` (torch.cuda.Stream) or ``ptr``
(cupy) attribute holding one.

Thread safety: every method may be called from any thread at any time, concurrently, and
:meth:`Heap.close` too: it refuses new calls (HeapClosedError), waits for the calls under way
and only then destroys the C heap, which must not race with any other call on it (cuma.h).
ctypes releases the GIL during each C call, so threads allocate in parallel.
"""

import json
import numbers
import operator
import os
import sys
import threading
import warnings
import weakref
import ctypes

from . import _lib, _pystack
from ._args import (  # noqa: F401  (re-exported: allocator.py and torch.py import them from here)
    MAX_DEVICES,
    _c_string,
    _callback_id_arg,
    _device_arg,
    _int_arg,
    _ptr_arg,
    _size_arg,
    _stream_arg,
    _u64_arg,
)
from ._callbacks import _TRAMPOLINES, _AllocFrame, _call_guarded, _deliver_fatal, _install_unraisablehook
from ._guard import _Guard, _in_use
from ._pool import Pool
from .errors import ConfigError, HeapClosedError

__all__ = [
    "Heap",
    "default_heap",
    "on_oom",
    "remove_oom",
    "on_pressure",
    "remove_pressure",
    "ledger",
    "ledger_path",
    "shutdown_default_heaps",
    "check_config",
    "config_keys",
    "config_table",
    "ConfigKey",
    "MAX_DEVICES",
]

OOM_PASS = 0
OOM_RETRY = 1


def _keeps_stacks(handle):
    """Whether the heap logs each allocation's call stack (trace_stacks:on with a trace that
    opened): its allocations then pass the Python stack (cuma_alloc_with_stack). Read once."""
    lib = _lib.lib()
    stats = json.loads(_lib.read_json_text(lambda buf, n, needed: lib.cuma_stats_json(handle, buf, n, needed)))
    return stats.get("config", {}).get("trace_stacks") is True


def _wants_retry(result):
    """An OOM callback's answer: True, 1 or "retry" ask for a retry; anything else passes.

    Numbers from numpy or PyTorch count like Python's (``return freed > 0`` with a numpy
    ``freed`` gives numpy.bool_, a 0-d tensor gives a tensor): a bool-like answer through
    its ``item()``, an integer through ``__index__``."""
    if isinstance(result, bool):
        return result
    if isinstance(result, str):
        return result.strip().lower() == "retry"
    if isinstance(result, numbers.Integral):
        return operator.index(result) == OOM_RETRY
    item = getattr(result, "item", None)
    if callable(item):
        # Before __index__: numpy.bool_'s __index__ is deprecated, and item() gives a
        # 0-d tensor's or array's value as the Python bool or int it stands for.
        try:
            value = item()
        except Exception:
            return False  # not a single value (a tensor of several): not an answer
        return isinstance(value, (bool, int)) and _wants_retry(value)
    if hasattr(result, "__index__"):
        try:
            return operator.index(result) == OOM_RETRY
        except Exception:
            return False
    return False


class Heap:
    """A cuma heap for one device.

    ``Heap(conf)`` creates a heap of its own from a settings string ("key:value,..."; see
    :func:`config_keys`), applied after the CUMA_CONF environment variable unless
    ``use_env=False``. Any backend works, the simulated device included::

        with cuma.Heap("backend:sim,capacity:1G") as h:
            p = h.alloc(1 << 20)
            h.free(p)

    :func:`default_heap` returns the process-wide heap of a device instead (the one PyTorch
    uses after cuma.torch.enable()); closing that one does nothing.
    """

    def __init__(self, conf=None, device=0, use_env=True):
        if conf is not None and not isinstance(conf, str):
            raise TypeError("conf must be a str like 'backend:sim,capacity:1G', not %s" % type(conf).__name__)
        device = _device_arg(device)
        self._init_common(device, owned=True)
        lib = _lib.lib()
        conf_bytes = _c_string(conf, "Heap: conf", ConfigError) if conf is not None else None
        cfg = _lib.Config(conf_bytes, 0 if use_env else 1, device)
        handle = ctypes.c_void_p()
        _lib.check(lib.cuma_heap_create(ctypes.byref(cfg), ctypes.byref(handle)))
        self._h = handle.value
        self._stacks = _keeps_stacks(self._h)

    def _init_common(self, device, owned):
        self._h = None
        self._owned = owned
        self.device = device
        self._guard = _Guard()
        self._cb_lock = threading.Lock()
        self._callbacks = {}  # id -> (ctypes function, cell holding the Python callable)
        self._retired = []  # ctypes functions of removed callbacks (see remove_oom)
        self._tls = threading.local()  # .frame: the Heap.alloc in progress on this thread
        self._pools = weakref.WeakSet()  # the open Pools of this heap (the C heap frees them)
        # trace_stacks:on: alloc() passes the program's Python stack (fixed when the heap is made)
        self._stacks = False

    @classmethod
    def _borrow(cls, handle, device):
        self = cls.__new__(cls)
        self._init_common(device, owned=False)
        self._h = handle
        self._stacks = _keeps_stacks(handle)
        return self

    # --- life cycle ---

    @property
    def handle(self):
        """The C cuma_heap pointer as an int (for other ctypes/C code)."""
        return self._handle()

    @property
    def closed(self):
        return not self._guard.open

    def _handle(self):
        if self._h is None:
            raise HeapClosedError("the heap is closed (Heap.close() was called)")
        return self._h

    def close(self):
        """Destroys the heap: every page goes back to the device; pointers from it become
        invalid. Idempotent.

        Safe while other threads use the heap: from the moment close() begins, every new call
        on it raises HeapClosedError (a ValueError); close() waits for the calls already under
        way (an allocation that waits for OOM callbacks or for other heaps in the ledger can
        take up to pressure_timeout_ms and a second more), then destroys it. Called from inside
        a call on the same heap (one of its OOM or pressure callbacks), it would wait for
        itself: it raises CumaError instead and leaves the heap open.

        Does nothing for a default heap: it is shared with everything else in the process and
        lives until :func:`shutdown_default_heaps` (its OOM callbacks stay registered)."""
        if not self._owned:
            return
        if not self._guard.begin_close():
            return
        try:
            h, self._h = self._h, None
            _detach_pools(self)
            if h is not None:
                _lib.lib().cuma_heap_destroy(h)
            with self._cb_lock:
                _drop_callbacks(self)
        finally:
            self._guard.end_close()

    def __enter__(self):
        if not self._guard.open:
            raise HeapClosedError("with Heap: the heap is closed (Heap.close() was called)")
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if getattr(self, "_owned", False) and getattr(self, "_h", None) is not None:
                self.close()
        except Exception:
            pass  # interpreter shutdown: the library may be gone already

    def __repr__(self):
        if self._h is None or not self._guard.open:
            return "<cuma.Heap closed>"
        kind = "default heap" if not self._owned else "heap"
        return "<cuma.Heap %s of device %d at %#x>" % (kind, self.device, self._h)

    # --- allocation ---

    @_in_use
    def alloc(self, size, stream=0):
        """Allocates ``size`` bytes usable on ``stream``; returns the device address (int).

        Raises OutOfMemoryError (a MemoryError) when the heap cannot serve it after every
        recovery step (cache release, the OOM callbacks, managed fallback where configured).
        A KeyboardInterrupt or SystemExit raised in an OOM callback is raised from here once
        the C call has returned (the callbacks after it are skipped; memory served anyway is
        freed first)."""
        size = _size_arg(size)
        stream = _stream_arg(stream)
        h = self._handle()
        out = ctypes.c_void_p()
        frame = _AllocFrame()
        # An OOM callback may allocate on this heap itself: that inner call gets a record
        # of its own, and the outer one gets its record back when the inner one returns.
        outer = getattr(self._tls, "frame", None)
        self._tls.frame = frame
        try:
            if self._stacks:
                where = _pystack.python_stack()
                st = _lib.lib().cuma_alloc_with_stack(h, size, stream, ctypes.byref(out), where)
            else:
                st = _lib.lib().cuma_alloc(h, size, stream, ctypes.byref(out))
            msg = _lib.last_error() if st else None
        finally:
            self._tls.frame = outer
        errors = frame.errors
        if frame.fatal is not None:
            if not st and out.value:
                try:
                    _lib.lib().cuma_free(h, out.value, stream)  # the caller never sees it
                except Exception:
                    pass
            raise frame.fatal
        if st:
            exc = _lib.error_for_status(st, msg)
            raise exc from (errors[0] if errors else None)
        for e in errors:
            warnings.warn("cuma OOM callback raised %r (allocation succeeded anyway)" % (e,), RuntimeWarning, 2)
        return out.value

    @_in_use
    def free(self, ptr, stream=0):
        """Frees a pointer from :meth:`alloc`. ``stream`` is the stream the memory was last
        used on (0/None: the allocation's stream). None or 0 is a no-op. A pointer the heap
        did not hand out, or a second free, raises BadPointerError and changes nothing."""
        ptr = _ptr_arg(ptr)
        stream = _stream_arg(stream)
        h = self._handle()
        if ptr is None:
            return
        _lib.check(_lib.lib().cuma_free(h, ptr, stream))

    @_in_use
    def record_stream(self, ptr, stream):
        """Notes that ``stream`` also uses the allocation at ``ptr``: its memory is not reused
        until the work issued on ``stream`` up to the free has completed."""
        ptr = _ptr_arg(ptr)
        if ptr is None:
            raise ValueError("record_stream: ptr must be a live allocation, not 0/None")
        stream = _stream_arg(stream)
        _lib.check(_lib.lib().cuma_record_stream(self._handle(), ptr, stream))

    @_in_use
    def retire_stream(self, stream):
        """Tells the heap that ``stream`` is about to be destroyed (call it before the stream
        goes): one last fence is recorded on it and its place in the heap's stream table is
        reused once that work is done. Without it, a program that makes and destroys streams
        one after another finds allocations on new streams refused after 256 of them."""
        stream = _stream_arg(stream)
        if stream is None:
            raise ValueError("retire_stream: the default stream is never destroyed")
        _lib.check(_lib.lib().cuma_stream_retire(self._handle(), stream))

    @_in_use
    def block_size(self, ptr):
        """The rounded size the heap reserved for the live allocation at ``ptr``."""
        ptr = _ptr_arg(ptr)
        if ptr is None:
            raise ValueError("block_size: ptr must be a live allocation, not 0/None")
        out = ctypes.c_size_t()
        _lib.check(_lib.lib().cuma_block_size(self._handle(), ptr, ctypes.byref(out)))
        return out.value

    @_in_use
    def pool(self, size, count, stream=0):
        """A :class:`cuma.Pool` of ``count`` blocks of ``size`` bytes, carved from this heap at
        once as one allocation usable on ``stream`` and kept until the pool is closed:
        ``pool.alloc()`` / ``pool.free(ptr)`` take constant time without the heap's lock. For
        intermediate results of one fixed size (batch-norm statistics, scratch). Raises
        InvalidArgumentError for size 0, count 0 or a size * count that overflows, and
        OutOfMemoryError (or LimitExceededError) when the heap cannot hold the carve. Closing
        the heap frees its pools."""
        return Pool(self, size, count, stream)

    # --- release policy and limits ---

    @_in_use
    def trim(self, keep_bytes=0):
        """Returns cached memory to the device until at most ``keep_bytes`` of cached pages
        remain (0: the whole cache, like torch.cuda.empty_cache())."""
        keep_bytes = _u64_arg(keep_bytes, "keep_bytes")
        _lib.check(_lib.lib().cuma_trim(self._handle(), keep_bytes))

    @_in_use
    def poll(self):
        """Runs the time-based release policy now (idle pages past release_delay_ms go back)."""
        _lib.check(_lib.lib().cuma_poll(self._handle()))

    @_in_use
    def next_release(self):
        """When the release policy will next give memory back (ns on the heap's clock), or
        None when nothing is waiting."""
        out = ctypes.c_uint64()
        _lib.check(_lib.lib().cuma_next_release(self._handle(), ctypes.byref(out)))
        return None if out.value == (1 << 64) - 1 else out.value

    @_in_use
    def set_limit(self, nbytes):
        """Sets the hard limit on reserved bytes (0 or None: no limit beyond the device)."""
        nbytes = 0 if nbytes is None else _u64_arg(nbytes, "nbytes")
        _lib.check(_lib.lib().cuma_set_limit(self._handle(), nbytes))

    @_in_use
    def set_memory_fraction(self, fraction):
        """Sets the limit as a fraction of the device's memory, in (0, 1]."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError("fraction must be a number, not %s" % type(fraction).__name__)
        if not (0 < fraction <= 1):
            raise ValueError("fraction must be in (0, 1], got %r" % (fraction,))
        _lib.check(_lib.lib().cuma_set_memory_fraction(self._handle(), float(fraction)))

    # --- observation ---

    @_in_use
    def stats(self):
        """Counters, gauges, backend and configuration as a dict (cuma_stats_json)."""
        h = self._handle()
        lib = _lib.lib()
        return json.loads(_lib.read_json_text(lambda buf, n, needed: lib.cuma_stats_json(h, buf, n, needed)))

    @_in_use
    def snapshot(self):
        """What holds the heap's memory now, as a dict (cuma_snapshot_json): "live" blocks
        (count, bytes, requested, "by_size" power-of-two buckets and the 32 "largest" with
        address, size, requested bytes, stream and arena), blocks freed into thread caches
        ("thread_cached") or waiting on record_stream fences ("deferred"), "managed" fallbacks,
        and "free": largest free block, cached, mapped and reserved bytes as in stats()."""
        h = self._handle()
        lib = _lib.lib()
        return json.loads(_lib.read_json_text(lambda buf, n, needed: lib.cuma_snapshot_json(h, buf, n, needed)))

    @_in_use
    def reset_peaks(self):
        """Resets the peak_* gauges to the current values."""
        _lib.check(_lib.lib().cuma_reset_peaks(self._handle()))

    @_in_use
    def validate(self):
        """Checks every invariant of the heap; raises CorruptionError naming a broken one."""
        _lib.check(_lib.lib().cuma_validate(self._handle()))

    # --- out of memory ---

    @_in_use
    def on_oom(self, callback):
        """Registers ``callback(size, stream)`` to run when an allocation of ``size`` bytes
        failed even after the cache was released; callbacks run in registration order.

        The callback may free memory (also on this heap). Returning True, 1 or "retry" (or a
        numpy/PyTorch bool or integer equal to them) has the allocation retried; anything else
        lets the next callback (or the failure) follow. An exception in a callback counts as
        "pass": it becomes the ``__cause__`` of the OutOfMemoryError if the allocation fails,
        a RuntimeWarning otherwise. A KeyboardInterrupt or SystemExit is not swallowed: it is
        raised from :meth:`alloc` (when the allocation came from elsewhere, e.g. PyTorch's
        allocator, a KeyboardInterrupt is raised again in the main thread and anything else
        becomes a RuntimeWarning). Returns an id for :meth:`remove_oom`. At most 16 callbacks
        per heap.

        A heap's callbacks run on one thread at a time: another thread that runs out meanwhile
        waits for them, tries again with what they freed, then runs them itself; if they are
        still running after a second (the running callback may need the GIL that a C
        extension holds on the waiting thread), it fails as if they had freed nothing. An
        allocation made inside a callback, on any heap, never waits for other callbacks: it
        fails instead.

        A Ctrl-C that arrives while the main thread is in C (that wait, say) is raised by
        Python at the first line of the next callback it runs, before any ``try`` there, and
        ctypes would drop it ("Exception ignored on calling ctypes callback function"). With
        the first callback, cuma wraps ``sys.unraisablehook`` (once, calling the hook it
        replaced for everything else) to take such a KeyboardInterrupt or SystemExit to where
        the callback would have sent it. A hook set after that which does not call the one it
        replaced drops it again."""
        if not callable(callback):
            raise TypeError("callback must be callable, not %s" % type(callback).__name__)
        h = self._handle()
        _install_unraisablehook()
        tls = self._tls  # not self: no reference cycle, so a dropped heap closes at once
        cell = [callback]  # emptied by remove_oom: the thunk outlives the removal, the callable not

        def trampoline(user, heap, size, stream):
            cb = cell[0]
            if cb is None:
                return OOM_PASS  # removed while an allocation was about to call it
            return _call_guarded(
                tls, "cuma OOM callback", cb,
                lambda: OOM_RETRY if _wants_retry(cb(size, stream or 0)) else OOM_PASS, OOM_PASS)

        _TRAMPOLINES.add(trampoline.__code__)
        fn = _lib.OOM_CALLBACK(trampoline)
        cb_id = ctypes.c_int()
        with self._cb_lock:
            _lib.check(_lib.lib().cuma_add_oom_callback(h, fn, None, ctypes.byref(cb_id)))
            self._callbacks[cb_id.value] = (fn, cell)
        return cb_id.value

    @_in_use
    def remove_oom(self, callback_id):
        """Removes a callback registered by :meth:`on_oom` (by the id it returned). The
        callable (and whatever it holds) is released at once."""
        callback_id = _callback_id_arg(callback_id)
        with self._cb_lock:
            _lib.check(_lib.lib().cuma_remove_oom_callback(self._handle(), callback_id))
            _retire(self, callback_id)

    # --- compaction ---

    def _mover_fn(self, move):
        """The C mover for ``move(old, new, size)`` and the cell it reads (emptied when the
        mover is replaced: the thunk may outlive it, the callable not)."""
        if not callable(move):
            raise TypeError("move must be callable, not %s" % type(move).__name__)
        _install_unraisablehook()
        tls = self._tls  # not self: no reference cycle (see on_oom)
        cell = [move]

        def trampoline(user, old, new, size, stream):
            mv = cell[0]
            if mv is None:
                return False  # replaced while a compaction was about to call it
            # A failed or refused move keeps the block where it is.
            return _call_guarded(tls, "cuma mover", mv, lambda: bool(mv(old or 0, new or 0, size)), False)

        _TRAMPOLINES.add(trampoline.__code__)
        return _lib.MOVE_CALLBACK(trampoline), cell

    def _compact_call(self, call):
        """Runs a compaction C call with a frame for the movers' exceptions; its result dict."""
        res = _lib.CompactResult()
        frame = _AllocFrame()
        outer = getattr(self._tls, "frame", None)
        self._tls.frame = frame
        try:
            st = call(ctypes.byref(res))
            msg = _lib.last_error() if st else None
        finally:
            self._tls.frame = outer
        if frame.fatal is not None:
            raise frame.fatal
        if st:
            raise _lib.error_for_status(st, msg) from (frame.errors[0] if frame.errors else None)
        for e in frame.errors:
            warnings.warn("cuma mover raised %r (that block stayed where it was)" % (e,), RuntimeWarning, 3)
        return {f: getattr(res, f) for f, _ in _lib.CompactResult._fields_}

    @_in_use
    def compact(self, move):
        """Moves live blocks out of the pages only they keep mapped (cuma_compact; see
        cuma/compact.h), whatever the fragmentation.

        For each block the heap chooses a new place and calls ``move(old, new, size)``: copy
        ``size`` bytes from address ``old`` to ``new`` (on the block's stream) and point your
        references at ``new``, then return True; return False (or anything false) to keep the
        block at ``old``, e.g. for an address you do not know. The old place is freed as
        :meth:`free` would. An exception in ``move`` keeps that block in place and becomes a
        RuntimeWarning; a KeyboardInterrupt or SystemExit keeps the rest in place too and is
        raised from here. Returns a dict: blocks_moved, bytes_moved, blocks_refused,
        pages_emptied (pages the moves left idle), pages_released (given back to the device
        at the end). Raises UnsupportedError in segment mode and under policy:buddy."""
        fn, cell = self._mover_fn(move)
        h = self._handle()
        try:
            return self._compact_call(lambda res: _lib.lib().cuma_compact(h, fn, None, res))
        finally:
            cell[0] = None

    @_in_use
    def set_mover(self, move):
        """Registers ``move(old, new, size)`` (as for :meth:`compact`) for the automatic
        compactions, or None to remove it: :meth:`compact_if_needed`, and an allocation that
        runs out of memory even after the cache went back (before the OOM callbacks). Both
        compact only while the stats' fragmentation is over the fragmentation_threshold
        setting. An exception in ``move`` during an allocation follows the rules of
        :meth:`on_oom`'s callbacks (a KeyboardInterrupt is raised from :meth:`alloc`)."""
        h = self._handle()
        if move is None:
            with self._cb_lock:
                _lib.check(_lib.lib().cuma_set_mover(h, _lib.MOVE_CALLBACK(), None))  # NULL
                _retire(self, "mover")
            return
        fn, cell = self._mover_fn(move)
        with self._cb_lock:
            _lib.check(_lib.lib().cuma_set_mover(h, fn, None))
            _retire(self, "mover")  # another thread may still be inside the old one: kept
            self._callbacks["mover"] = (fn, cell)

    @_in_use
    def compact_if_needed(self):
        """Compacts with the mover :meth:`set_mover` registered when the fragmentation is over
        the threshold (call it at a step boundary); the dict of :meth:`compact`, all zero when
        nothing ran."""
        h = self._handle()
        return self._compact_call(lambda res: _lib.lib().cuma_compact_if_needed(h, res))

    # --- other processes (the cross-process ledger) ---

    @_in_use
    def on_pressure(self, callback):
        """Registers ``callback(nbytes)`` to run when a heap of higher priority on the same
        device (in the ledger: settings ``ledger``, ``priority``, ``guarantee``) needs
        ``nbytes`` that this heap holds in use beyond its guarantee. It runs on the heap's
        release thread, once per request: free what you can (drop caches, halve the batch at
        the next step). Its idle cache has gone back already. An exception in it becomes a
        RuntimeWarning. No Python caller is there to receive a KeyboardInterrupt raised in it:
        it is raised again in the main thread (``_thread.interrupt_main``); a SystemExit or
        other BaseException becomes a RuntimeWarning (as sys.exit() in a thread other than the
        main one ends no process either). Returns an id for :meth:`remove_pressure`. At most
        16 per heap."""
        if not callable(callback):
            raise TypeError("callback must be callable, not %s" % type(callback).__name__)
        h = self._handle()
        _install_unraisablehook()
        cell = [callback]  # emptied by remove_pressure (see on_oom)
        guard = self._guard  # not self (see on_oom)

        def trampoline(user, heap, nbytes):
            cb = cell[0]
            if cb is None:
                return
            # A use of the heap like any call: close() waits for it, and a close() from inside
            # the callback is refused rather than destroying the heap under its release thread.
            # Once close() has begun, the request is dropped: the heap gives everything back.
            if not guard.try_enter():
                return
            try:
                cb(int(nbytes))
            except Exception as e:
                warnings.warn("cuma pressure callback %r raised %r" % (cb, e), RuntimeWarning)
            except BaseException as e:  # never let an exception unwind through C
                _deliver_fatal(e, "cuma pressure callback %r" % (cb,))
            finally:
                guard.exit()

        _TRAMPOLINES.add(trampoline.__code__)
        fn = _lib.PRESSURE_CALLBACK(trampoline)
        cb_id = ctypes.c_int()
        with self._cb_lock:
            _lib.check(_lib.lib().cuma_add_pressure_callback(h, fn, None, ctypes.byref(cb_id)))
            self._callbacks[("pressure", cb_id.value)] = (fn, cell)
        return cb_id.value

    @_in_use
    def remove_pressure(self, callback_id):
        """Removes a callback registered by :meth:`on_pressure` (by the id it returned). The
        callable (and whatever it holds) is released at once."""
        callback_id = _callback_id_arg(callback_id)
        with self._cb_lock:
            _lib.check(_lib.lib().cuma_remove_pressure_callback(self._handle(), callback_id))
            _retire(self, ("pressure", callback_id))

    # --- simulated device controls (backend:sim only; UnsupportedError elsewhere) ---

    @_in_use
    def sim_set_time(self, ns):
        """Sets the simulated clock (needs sim_clock:manual)."""
        _lib.check(_lib.lib().cuma_sim_set_time(self._handle(), _u64_arg(ns, "ns")))

    @_in_use
    def sim_time(self):
        """The heap's clock in nanoseconds (any backend)."""
        out = ctypes.c_uint64()
        _lib.check(_lib.lib().cuma_sim_get_time(self._handle(), ctypes.byref(out)))
        return out.value

    @_in_use
    def sim_hold_stream(self, stream):
        """Holds a simulated stream busy: work recorded on it stays incomplete."""
        _lib.check(_lib.lib().cuma_sim_hold_stream(self._handle(), _stream_arg(stream)))

    @_in_use
    def sim_release_stream(self, stream):
        """Completes everything recorded on a held simulated stream."""
        _lib.check(_lib.lib().cuma_sim_release_stream(self._handle(), _stream_arg(stream)))


def _retire(heap, key):
    """Unregisters a removed callback on the Python side (the caller holds heap._cb_lock).

    Its ctypes function stays alive until the heap is closed: the heap calls a copy of its
    callback list without its lock, so another thread's allocation (or the release thread)
    may still be inside it, or about to enter it, after the removal returned. The user's
    callable is dropped now (the cell the function reads is emptied), so only the small
    thunk is kept, not what the callable captured."""
    entry = heap._callbacks.pop(key, None)
    if entry is not None:
        fn, cell = entry
        cell[0] = None
        heap._retired.append(fn)


def _detach_pools(heap):
    """The C heap is about to free the pools still on it: their wrappers forget them (no call
    on the heap, so none on a pool, is under way)."""
    for p in list(heap._pools):
        p._detach()
    heap._pools.clear()


def _drop_callbacks(heap):
    """Forgets every callback of a heap that C no longer calls (closed or shut down)."""
    for fn, cell in heap._callbacks.values():
        cell[0] = None
    heap._callbacks.clear()
    heap._retired.clear()


# --- the process-wide default heaps ---

_defaults_lock = threading.Lock()
_defaults = {}  # device -> Heap wrapper; keeps module-level OOM callbacks alive
# Held from "do default heaps exist, and with which settings?" until the heap made from the
# settings exists, so that two threads asking for different settings cannot both pass the
# check (the one that comes second gets the RuntimeError). Taken before _defaults_lock.
_conf_lock = threading.RLock()  # _fix_default_settings holds it around _apply_default_conf
# The settings this package gave the default heaps (cuma_default_settings_set) in place of
# CUMA_CONF, or None: CUMA_CONF. Written under _conf_lock. The environment is never written:
# it would change every Heap(...) made later in the process, and its children.
_default_settings = None


def _default_conf():
    """The settings string default heaps are created from now (None: none)."""
    return _default_settings if _default_settings is not None else os.environ.get("CUMA_CONF")


def _set_default_settings(conf):
    """Makes ``conf`` the settings of default heaps created from now on, in place of CUMA_CONF
    (None: CUMA_CONF again). The caller holds _conf_lock."""
    global _default_settings
    arg = None if conf is None else _c_string(conf, "default heap settings", ConfigError)
    _lib.check(_lib.lib().cuma_default_settings_set(arg))
    _default_settings = conf


def default_heap(device=0):
    """The process-wide heap of ``device``, created on first use from CUMA_CONF, or from the
    settings given through cuma (set_memory_limit, set_memory_growth, CudaMemoryAllocator(conf),
    cuma.torch.enable(conf)), which replace CUMA_CONF for the default heaps only (backend:auto
    when they name none; without a CUDA driver NoDeviceError unless they say backend:sim or
    backend_fallback:sim, and the stats' "backend_fallback" says so). The same heap PyTorch uses
    after cuma.torch.enable()."""
    device = _device_arg(device)
    with _defaults_lock:
        w = _defaults.get(device)
        out = ctypes.c_void_p()
        _lib.check(_lib.lib().cuma_default_heap(device, ctypes.byref(out)))
        if w is not None and w._h == out.value:
            return w
        # First use, or the C heaps were shut down and recreated behind our back.
        w = Heap._borrow(out.value, device)
        _defaults[device] = w
        return w


def _created_default_heaps():
    """{device: handle} of the default heaps that exist now (creates none)."""
    lib = _lib.lib()
    out = {}
    for d in range(MAX_DEVICES):
        h = lib.cuma_torch_created_heap(d)
        if h:
            out[d] = h
    return out


def on_oom(callback, device=0):
    """Registers ``callback(size, stream)`` on the default heap of ``device`` (an int, or an
    iterable of ints for several devices); see :meth:`Heap.on_oom`. Returns the callback id
    (a list of ids for several devices)."""
    if isinstance(device, (list, tuple, range, set, frozenset)):
        return [default_heap(d).on_oom(callback) for d in device]
    return default_heap(device).on_oom(callback)


def on_pressure(callback, device=0):
    """Registers ``callback(nbytes)`` on the default heap of ``device``; see
    :meth:`Heap.on_pressure`. Returns the callback id (for :func:`remove_pressure`)."""
    return default_heap(device).on_pressure(callback)


def remove_pressure(callback_id, device=0):
    """Removes a callback that :func:`on_pressure` registered on ``device``'s default heap."""
    default_heap(device).remove_pressure(callback_id)


def ledger(name=None):
    """The live heaps of the cross-process ledger (None: this user's; else the name the
    ``ledger`` setting gives), as a list of dicts: pid, process, device, priority, guarantee,
    limit, capacity, reserved, cached, requested, peak_reserved, want, ledger_denials,
    pressure_asks, pressure_given_bytes, pressure_callbacks (as in Heap.stats()), age_ns, slot,
    and the allocator figures each heap's release thread publishes every 100 ms (backend, and the figures of Heap.stats() that the ledger
    carries, under the same names: page_size, allocated_bytes, peak_requested_bytes,
    mapped_bytes, managed_bytes, active_allocs, num_allocs, num_frees, failed_allocs,
    alloc_retries, ooms, oom_callbacks, managed_fallbacks, page_creates, page_releases, maps,
    unmaps, trims, page_call_ns, arenas, fragmentation, compactions, compact_moved_bytes,
    compact_freed_pages;
    stats_age_ns says how old they are, None before the first), and pod, pod_namespace, container (the process's POD_NAME, POD_NAMESPACE and
    CONTAINER_NAME when it joined; "" outside Kubernetes). Raises CumaIOError (naming the path) when no heap has made that ledger."""
    if name is not None and not isinstance(name, str):
        raise TypeError("name must be a str or None, not %s" % type(name).__name__)
    lib = _lib.lib()
    arg = _c_string(name, "ledger: name") if name is not None else None
    n = ctypes.c_size_t()
    cap = 64
    while True:
        buf = (_lib.LedgerEntry * cap)()
        _lib.check(lib.cuma_ledger_snapshot(arg, buf, cap, ctypes.byref(n)))
        if n.value <= cap:
            break
        cap = n.value + 16  # more heaps joined meanwhile: read again with room
    out = []
    for e in buf[: n.value]:
        d = {f: getattr(e, f) for f, _ in _lib.LedgerEntry._fields_}
        d["process"] = e.process.decode(errors="replace")
        d["device"] = e.device.decode(errors="replace")
        d["backend"] = e.backend.decode(errors="replace")
        for k in ("pod", "pod_namespace", "container"):
            d[k] = getattr(e, k).decode(errors="replace")
        if d["stats_age_ns"] == 2**64 - 1:
            d["stats_age_ns"] = None
        out.append(d)
    return out


def ledger_path(name=None):
    """Where the ledger lives in shared memory (/dev/shm/cuma-UID[-NAME])."""
    if name is not None and not isinstance(name, str):
        raise TypeError("name must be a str or None, not %s" % type(name).__name__)
    buf = ctypes.create_string_buffer(256)
    _lib.check(_lib.lib().cuma_ledger_path(_c_string(name, "ledger_path: name") if name else None, buf, 256))
    return buf.value.decode()


def remove_oom(callback_id, device=0):
    """Removes a callback that :func:`on_oom` registered on ``device``'s default heap."""
    default_heap(device).remove_oom(callback_id)


def shutdown_default_heaps(force=False):
    """Destroys every default heap (their memory goes back to the device). For tests and an
    orderly shutdown only: nothing may use a default heap concurrently or afterwards through
    old pointers, and PyTorch must not be using cuma any more: after cuma.torch.enable() it
    raises RuntimeError (PyTorch cannot be switched back, and its live tensors would lose their
    memory) unless ``force`` is true. The next use creates fresh
    heaps (from CUMA_CONF, or the settings given through cuma, as it is then). Calls under way through this package's wrappers
    (:func:`default_heap`'s Heap) are waited for, and later ones raise HeapClosedError; called
    from inside one (an OOM callback of a default heap), it raises CumaError instead."""
    torch_side = sys.modules.get("cuma.torch")
    if not force and torch_side is not None and torch_side.is_enabled():
        raise RuntimeError(
            "cuma.shutdown_default_heaps(): PyTorch allocates from the default heaps "
            "(cuma.torch.enable()) and cannot be switched back; closing them would take the memory "
            "of every live CUDA tensor (force=True does it anyway)"
        )
    with _defaults_lock:
        closing = []
        try:
            for w in _defaults.values():
                if w._guard.begin_close():
                    closing.append(w)
        except BaseException:  # refused (or interrupted): the heaps stay as they were
            for w in closing:
                w._guard.reopen()
            raise
        try:
            _lib.lib().cuma_default_heaps_shutdown()
            for w in closing:
                w._h = None
                _detach_pools(w)
                with w._cb_lock:
                    _drop_callbacks(w)
            _defaults.clear()
        finally:
            for w in closing:
                w._guard.end_close()


# Who fixed the default heaps' settings before any heap exists (cuma.torch.enable(), which must
# not create one: that would take a CUDA context on device 0 in every process); None: nobody.
_settings_fixed_by = None


def _fix_default_settings(conf, who):
    """Makes ``conf`` (None: leaves them) the default heaps' settings, as _apply_default_conf
    does but without making a heap, and fixes them: from now on other settings are refused, as
    if a heap existed. Returns what _unfix_default_settings needs to undo it."""
    global _settings_fixed_by
    with _conf_lock:
        before = _default_settings
        _apply_default_conf(conf, who, device=None)
        _settings_fixed_by = who
        return before


def _unfix_default_settings(before):
    """Undoes _fix_default_settings (its caller failed before any heap was made)."""
    global _settings_fixed_by
    with _conf_lock:
        _settings_fixed_by = None
        if not _created_default_heaps():
            _set_default_settings(before)


def _apply_default_conf(conf, who, device=0):
    """Makes ``conf`` the settings of the default heaps, in place of CUMA_CONF (which stays as
    it is for every other heap and for child processes), and creates ``device``'s default
    heap from it (none when ``device`` is None); refuses (with a RuntimeError) when default
    heaps exist already, or their settings were fixed, and the settings differ, since they
    would silently not apply to them."""
    if conf is None:
        return
    if not isinstance(conf, str):
        raise TypeError("%s: conf must be a str like 'limit:8G', not %s" % (who, type(conf).__name__))
    _c_string(conf, "%s: conf" % who, ConfigError)
    check_config(conf)
    with _conf_lock:
        current = _default_conf()
        if current != conf:
            if _settings_fixed_by is not None:
                raise RuntimeError(
                    "%s: %s fixed the default heaps' settings (%r), and PyTorch's memory comes from "
                    "them: %r would apply to some of them and not others" % (who, _settings_fixed_by, current, conf)
                )
            if _created_default_heaps():
                raise RuntimeError(
                    "%s: the default heaps already exist (created with settings %r), so %r would not "
                    "apply to them; pass the settings before the first allocation, or call "
                    "cuma.shutdown_default_heaps() first" % (who, current, conf)
                )
            _set_default_settings(conf)
        # Made before the lock is let go: from here on, other settings see a heap and fail
        # (without one, the caller fixes the settings under this lock: _fix_default_settings).
        if device is not None:
            default_heap(device)


# --- configuration ---


def check_config(conf):
    """Checks a settings string without creating a heap; raises ConfigError naming the key."""
    if not isinstance(conf, str):
        raise TypeError("conf must be a str, not %s" % type(conf).__name__)
    _lib.check(_lib.lib().cuma_config_check(_c_string(conf, "check_config: conf", ConfigError)))


class ConfigKey(tuple):
    """One configuration key: (name, default, meaning, choices); choices is a tuple of names
    for keys that take one (e.g. backend), else empty."""

    __slots__ = ()

    def __new__(cls, name, default, meaning, choices=()):
        return tuple.__new__(cls, (name, default, meaning, tuple(choices)))

    name = property(lambda self: self[0])
    default = property(lambda self: self[1])
    meaning = property(lambda self: self[2])
    choices = property(lambda self: self[3])

    def __repr__(self):
        return "ConfigKey(name=%r, default=%r, choices=%r)" % (self.name, self.default, self.choices)


def config_table():
    """cuma_config_describe's table as text (what `cuma config` prints)."""
    lib = _lib.lib()
    return _lib.read_json_text(lambda buf, n, needed: lib.cuma_config_describe(buf, n, needed))


def config_keys():
    """Every configuration key as a list of :class:`ConfigKey`, in the table's order."""
    keys = []
    for line in config_table().splitlines()[1:]:  # first line is the header
        parts = line.split(None, 2)
        if len(parts) < 3:
            continue
        name, default, meaning = parts
        choices = ()
        if meaning.endswith("]") and " [" in meaning:
            meaning, _, ch = meaning.rpartition(" [")
            choices = tuple(ch[:-1].split("|"))
        keys.append(ConfigKey(name, default, meaning, choices))
    return keys


def _conf_origin():
    """Where the default heaps' settings come from, as libcuma's messages name it."""
    return "CUMA_CONF" if _default_settings is None else "default heap settings"


def _conf_value(conf, key):
    """The value ``key`` takes under the settings string ``conf`` after the defaults (None for
    none), read by libcuma (cuma_config_get), which refuses a malformed string as a heap would."""
    lib = _lib.lib()
    c_conf = _c_string(conf, "default heap settings", ConfigError) if conf is not None else None
    args = (c_conf, _conf_origin().encode(), key.encode())
    return json.loads(_lib.read_json_text(lambda buf, n, needed: lib.cuma_config_get(*args, buf, n, needed)))


def _conf_with(conf, key, value):
    """``conf`` with every item of ``key`` left out and, unless ``value`` is None,
    ``key:value`` added where it wins (cuma_config_set)."""
    lib = _lib.lib()
    args = (
        _c_string(conf, "default heap settings", ConfigError) if conf is not None else None,
        _conf_origin().encode(),
        key.encode(),
        None if value is None else _c_string(value, "%s's value" % key, ConfigError),
    )
    return _lib.read_json_text(lambda buf, n, needed: lib.cuma_config_set(*args, buf, n, needed))


def _update_default_conf(updates, removals=()):
    """Merges key changes into the default heaps' settings (CUMA_CONF until settings were
    given), checked before they are set; returns the new string. The caller holds _conf_lock."""
    conf = _default_conf()
    for k in removals:
        conf = _conf_with(conf, k, None)
    for k, v in updates.items():
        conf = _conf_with(conf, k, v)
    check_config(conf)
    _set_default_settings(conf)
    return conf

