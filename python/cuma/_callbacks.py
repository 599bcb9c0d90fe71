# SPDX-License-Identifier: Apache-2.0
"""Callbacks from C into Python (OOM callbacks, movers): where their exceptions go. ctypes
cannot return an exception through C, so a trampoline hands its callable's exception to the
Heap call that entered C on this thread (an _AllocFrame), or, when there is none, warns or
raises a KeyboardInterrupt again in the main thread."""

import _thread
import ctypes
import signal
import sys
import threading
import time
import warnings


class _AllocFrame:
    """What the OOM callbacks of one Heap.alloc call left for it: their exceptions (a cause
    or a warning) and a KeyboardInterrupt/SystemExit to re-raise once C has returned."""

    __slots__ = ("errors", "fatal")

    def __init__(self):
        self.errors = []
        self.fatal = None


def _deliver_fatal(exc, what):
    """A KeyboardInterrupt, SystemExit or other BaseException raised by a callback that no
    Python caller can receive (it ran on a C thread, or under a C call that was not
    Heap.alloc): a KeyboardInterrupt is raised again in the main thread; anything else
    becomes a RuntimeWarning, as a SystemExit in a thread other than the main one ends no
    process in Python either."""
    if isinstance(exc, KeyboardInterrupt):
        if threading.current_thread() is threading.main_thread():
            # Raised again at once, the interrupt would hit this very callback (the main
            # thread looks for it at its next bytecode, still in here) and be lost in ctypes;
            # a helper raises it once the main thread is out of the callbacks.
            threading.Thread(target=_interrupt_main_later, args=(threading.get_ident(),), daemon=True).start()
        else:
            _interrupt_main()
        return
    warnings.warn("%s raised %r, which cannot reach a Python caller from there" % (what, exc), RuntimeWarning)


_TRAMPOLINES = set()  # the code objects of the callback trampolines (one per kind)


# --- an interrupt raised before a trampoline's try ---
#
# A signal that arrived while the main thread was in C is handled at the first bytecode
# Python runs there: a trampoline's first line, outside its try. The exception escapes to
# ctypes, which cannot return it through C and hands it to sys.unraisablehook; a wrapper
# takes a KeyboardInterrupt or SystemExit from there to where the trampoline's own except
# clause would have sent it.

_hook_lock = threading.Lock()
_previous_unraisablehook = None  # the hook cuma's wrapper replaced; set once


def _install_unraisablehook():
    """Wraps sys.unraisablehook, once per process (the first callback registered): the
    hook found then gets every report the wrapper does not take. A hook the user sets later
    replaces the wrapper, as any hook replaces another; one that calls the hook it replaced
    keeps it working."""
    global _previous_unraisablehook
    with _hook_lock:
        if _previous_unraisablehook is None:
            _previous_unraisablehook = sys.unraisablehook
            sys.unraisablehook = _unraisablehook


def _unraisablehook(args):
    try:
        if _take_escaped_fatal(args):
            return
    except Exception:
        pass  # the report is not lost: the previous hook prints it as before
    (_previous_unraisablehook or sys.__unraisablehook__)(args)


_HOOK_CODE = _unraisablehook.__code__


def _trampoline_tls(args):
    """(whether the unraisable exception escaped a trampoline, the trampoline's tls or None).

    ctypes names the callable as the report's object up to Python 3.12; from 3.13 the object
    is None and only the traceback, which starts in the trampoline, says where it came from."""
    fn = args.object
    code = getattr(fn, "__code__", None)
    if code is not None and code in _TRAMPOLINES:
        cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
        cell = cells.get("tls")
        return True, (cell.cell_contents if cell is not None else None)
    tb = args.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code in _TRAMPOLINES:
            return True, tb.tb_frame.f_locals.get("tls")
        tb = tb.tb_next
    return False, None


def _take_escaped_fatal(args):
    """Whether the report was a KeyboardInterrupt or SystemExit that escaped a trampoline,
    now handed on as the trampoline would have: to its Heap.alloc, or _deliver_fatal."""
    exc = args.exc_value
    if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return False
    escaped, tls = _trampoline_tls(args)
    if not escaped:
        return False
    frame = getattr(tls, "frame", None) if tls is not None else None  # this thread's, as there
    if frame is not None:
        if frame.fatal is None:
            frame.fatal = exc
    else:
        _deliver_fatal(exc, "cuma callback")
    return True


def _interrupt_main_later(main_ident, wait_s=5.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main_ident)
        # Inside cuma's unraisablehook counts as inside a callback: an interrupt raised there
        # is lost like one raised in a trampoline.
        while frame is not None and frame.f_code not in _TRAMPOLINES and frame.f_code is not _HOOK_CODE:
            frame = frame.f_back
        if frame is None:  # back in the code that called C (or beyond): it gets the interrupt
            break
        time.sleep(0.001)
    _interrupt_main()


def _interrupt_main():
    """Raises KeyboardInterrupt in the main thread. Through the SIGINT handler where Python's
    (or the program's own) is installed, as a Ctrl-C would; where SIGINT is ignored or left to
    the system (a job that a shell without job control started in the background, or nohup'd
    with SIGINT ignored), interrupt_main() does nothing, so the exception is set on the main
    thread directly: it raised in a callback, and ignoring the signal must not drop it."""
    try:
        handled = callable(signal.getsignal(signal.SIGINT))
    except ValueError:  # not a signal this platform has
        handled = False
    if handled:
        _thread.interrupt_main()
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(threading.main_thread().ident), ctypes.py_object(KeyboardInterrupt)
    )


def _call_guarded(tls, label, owner, call, default):
    """What a trampoline returns for call() (the user's callable `owner`, named `label` in
    messages): default when this thread's frame carries a KeyboardInterrupt or SystemExit on
    its way to the caller already, or when call raises; an Exception goes to the frame's
    errors (a warning without a frame), any other BaseException to the frame's fatal (or
    _deliver_fatal). tls is the trampoline's (heap's) thread-local."""
    frame = getattr(tls, "frame", None)  # this thread's Heap call, if C came from there
    if frame is not None and frame.fatal is not None:
        return default  # Ctrl-C or exit on its way to the caller: run nothing more
    try:
        return call()
    except Exception as e:  # the callable's own failure
        if frame is not None:
            frame.errors.append(e)
        else:
            warnings.warn("%s %r raised %r" % (label, owner, e), RuntimeWarning)
    except BaseException as e:  # never let an exception unwind through C
        if frame is not None:
            frame.fatal = e
        else:
            _deliver_fatal(e, "%s %r" % (label, owner))
    return default
