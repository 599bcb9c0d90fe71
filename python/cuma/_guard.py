# SPDX-License-Identifier: Apache-2.0
"""The use count that lets Heap.close() race with the heap's other calls."""

import _thread
import functools
import threading

from .errors import CumaError, HeapClosedError


class _Guard:
    """Counts the calls under way on one heap, so that close() can wait for them: the C heap
    must not be destroyed while a call is inside it (a freed heap read by another thread
    crashed the interpreter, 7 of 10 runs).

    _inside holds the thread id of every call under way, once per call (a callback inside an
    allocation is a call inside a call): list.append and list.remove are atomic, so the calls'
    path takes no lock (a lock and a thread-local depth doubled the cost of alloc+free). A
    thread found in it is inside a call on the heap: its close() would wait for itself and is
    refused instead.

    Invariants: _state (written under _cv) goes OPEN -> CLOSING -> CLOSED, or back from
    CLOSING to OPEN when the closing thread is interrupted while it waits. A call adds its id
    first and reads _state after, so once CLOSING is set every new call sees it: one whose
    thread has no call under way takes its id out again and is refused, one whose thread has
    one goes on (it cannot outlive that outer call). So _inside empties and stays empty, and
    close() waits for that; a call that leaves while _state is not OPEN wakes it."""

    OPEN, CLOSING, CLOSED = 0, 1, 2

    __slots__ = ("_inside", "_state", "_cv")

    def __init__(self):
        self._inside = []
        self._state = _Guard.OPEN
        self._cv = threading.Condition(threading.Lock())

    @property
    def open(self):
        return self._state == _Guard.OPEN

    def try_enter(self):
        """Counts a call in; False (counting nothing) once close() has begun, except for a call
        made inside one under way on the same thread (an OOM callback freeing memory of the
        heap): that one cannot outlive the outer call, which the heap is not destroyed under."""
        me = _thread.get_ident()
        inside = self._inside
        inside.append(me)
        if self._state and inside.count(me) == 1:
            self._leave(me)
            return False
        return True

    def exit(self):
        self._leave(_thread.get_ident())

    def _leave(self, me):
        self._inside.remove(me)
        if self._state:
            with self._cv:
                self._cv.notify_all()  # close() waits for the last one

    def begin_close(self):
        """Refuses new calls and waits for those under way. True: the caller destroys the heap,
        then calls end_close(); False: another close() did (or does) it, and it is done."""
        if _thread.get_ident() in self._inside:
            raise CumaError(
                "Heap.close() was called from inside a call on the same heap (an OOM or pressure "
                "callback of it): it would wait for that call, which waits for the callback; close "
                "the heap after the call has returned"
            )
        with self._cv:
            while True:
                if self._state == _Guard.CLOSED:
                    return False
                if self._state == _Guard.OPEN:
                    break
                self._cv.wait()  # another thread is closing it: done when it is
            self._state = _Guard.CLOSING
            try:
                while self._inside:
                    self._cv.wait()
            except BaseException:  # Ctrl-C while waiting: the heap stays open, as it was
                self._state = _Guard.OPEN
                self._cv.notify_all()
                raise
            return True

    def reopen(self):
        """Undoes a begin_close() whose destruction did not happen."""
        with self._cv:
            self._state = _Guard.OPEN
            self._cv.notify_all()

    def end_close(self):
        with self._cv:
            self._state = _Guard.CLOSED
            self._cv.notify_all()


def _in_use(method):
    """Runs a Heap method as one use of the heap (see _Guard)."""

    what = "Heap.%s" % method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        g = self._guard
        if not g.try_enter():
            raise HeapClosedError("%s: the heap is closed (Heap.close() was called)" % what)
        try:
            return method(self, *args, **kwargs)
        finally:
            g.exit()

    return call
