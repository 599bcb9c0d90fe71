# SPDX-License-Identifier: Apache-2.0
"""Fixed-size pools from Python: :class:`Pool`, made by :meth:`cuma.Heap.pool` (cuma/pool.h).

A pool carves ``count`` blocks of ``size`` bytes from its heap once, as one allocation, and
hands them out and takes them back in constant time without the heap's lock; the heap never
gives the carve back while the pool exists. Blocks are plain ints (device addresses), like
:meth:`cuma.Heap.alloc`'s; a freed block is handed out again at once, without a stream fence,
so use the blocks on the pool's stream.

Thread safety: every method may be called from any thread, concurrently, close() too: it
refuses new calls, waits for those under way, and then destroys the pool (the C call must not
race with others on the pool). Closing the heap frees its pools with it.
"""

import ctypes

from . import _lib
from ._args import _ptr_arg, _stream_arg, _u64_arg
from ._guard import _Guard
from .errors import CumaError, HeapClosedError

__all__ = ["Pool"]


class Pool:
    """A pool of ``count`` blocks of one size on a :class:`cuma.Heap` (``heap.pool(size,
    count)``). ``alloc()`` returns a block's address, ``free(ptr)`` gives it back, ``close()``
    gives the carve back to the heap (refused with InvalidArgumentError while blocks are out;
    the pool stays usable). A context manager: ``with heap.pool(4096, 64) as pool: ...``.

    Errors are the package's: an empty pool raises OutOfMemoryError (a MemoryError); a pointer
    that is not a block of this pool, or a block already free, BadPointerError; size 0, count 0
    or a size * count that overflows, InvalidArgumentError; a call after close() (the pool's or
    the heap's), HeapClosedError."""

    def __init__(self, heap, size, count, stream=0):
        size = _u64_arg(size, "size")  # 0 goes to C, which names it (InvalidArgumentError)
        count = _u64_arg(count, "count")
        stream = _stream_arg(stream)
        self._heap = heap
        self._guard = _Guard()
        self._p = None
        out = ctypes.c_void_p()
        _lib.check(_lib.lib().cuma_pool_create(heap._handle(), size, count, stream, ctypes.byref(out)))
        self._p = out.value
        self.size = size
        heap._pools.add(self)

    # --- calls: each is a use of the heap (its close() waits for it) and of the pool ---

    def _call(self, what, fn, *args):
        heap = self._heap
        if not heap._guard.try_enter():
            raise HeapClosedError("Pool.%s: the pool's heap is closed (Heap.close() was called)" % what)
        try:
            if not self._guard.try_enter():
                raise HeapClosedError("Pool.%s: the pool is closed (Pool.close() was called)" % what)
            try:
                if self._p is None:
                    raise HeapClosedError("Pool.%s: the pool is closed" % what)
                return fn(self._p, *args)
            finally:
                self._guard.exit()
        finally:
            heap._guard.exit()

    def alloc(self):
        """Hands out a free block; returns its address (int, 256-byte aligned). Raises
        OutOfMemoryError when every block is out (the pool does not grow)."""

        def run(p):
            out = ctypes.c_void_p()
            _lib.check(_lib.lib().cuma_pool_alloc(p, ctypes.byref(out)))
            return out.value

        return self._call("alloc", run)

    def free(self, ptr):
        """Gives a block back. None or 0 is a no-op. A pointer that is not the start of one of
        this pool's blocks, or a block already free, raises BadPointerError and changes
        nothing."""
        ptr = _ptr_arg(ptr)
        if ptr is None:
            return
        self._call("free", lambda p: _lib.check(_lib.lib().cuma_pool_free(p, ptr)))

    def _info(self):
        def run(p):
            bs, n, used = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
            _lib.check(_lib.lib().cuma_pool_info(p, ctypes.byref(bs), ctypes.byref(n), ctypes.byref(used)))
            return bs.value, n.value, used.value

        return self._call("info", run)

    @property
    def block_size(self):
        """Bytes between one block and the next: the size rounded up to 256."""
        return self._info()[0]

    @property
    def count(self):
        """How many blocks the pool has."""
        return self._info()[1]

    @property
    def in_use(self):
        """How many blocks are handed out now."""
        return self._info()[2]

    def validate(self):
        """Checks the pool's invariants; raises CorruptionError naming a broken one."""
        self._call("validate", lambda p: _lib.check(_lib.lib().cuma_pool_validate(p)))

    # --- life cycle ---

    @property
    def closed(self):
        return self._p is None or not self._guard.open

    def close(self):
        """Gives the pool's memory back to the heap. Idempotent; does nothing once the heap is
        closed (the heap freed its pools). While blocks are out it raises InvalidArgumentError
        saying how many, and the pool stays open and usable."""
        heap = self._heap
        if not heap._guard.try_enter():
            return  # the heap is closed or closing: it frees the pool itself
        try:
            if not self._guard.begin_close():
                return
            destroyed = False
            try:
                if self._p is not None:
                    _lib.check(_lib.lib().cuma_pool_destroy(self._p))
                    self._p = None
                destroyed = True
            finally:
                if destroyed:
                    heap._pools.discard(self)
                    self._guard.end_close()
                else:
                    self._guard.reopen()
        finally:
            heap._guard.exit()

    def _detach(self):
        """The heap is being destroyed (no call on it, so none on the pool, is under way): the
        C pool goes with it."""
        self._p = None
        if self._guard.begin_close():
            self._guard.end_close()

    def __enter__(self):
        if self.closed:
            raise HeapClosedError("with Pool: the pool is closed")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        try:  # an exception is on its way out: blocks left out must not replace it
            self.close()
        except CumaError:
            pass  # the pool stays on the heap until the blocks are freed or the heap closes
        return False

    def __del__(self):
        try:
            if getattr(self, "_p", None) is not None:
                self.close()
        except Exception:
            pass  # blocks still out, or interpreter shutdown: the heap frees it

    def __repr__(self):
        if self.closed:
            return "<cuma.Pool closed>"
        try:
            bs, n, used = self._info()
        except CumaError:
            return "<cuma.Pool closed>"
        return "<cuma.Pool of %d blocks of %d bytes, %d in use, at %#x>" % (n, bs, used, self._p)
