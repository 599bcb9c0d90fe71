# SPDX-License-Identifier: Apache-2.0
"""The program's Python call stack for a heap that logs with trace_stacks:on.

The native stack of an allocation made through the package shows only ctypes and the
interpreter; :func:`python_stack` gives the Python frames instead, in the text form
cuma_alloc_with_stack takes ("FILE\\tLINE\\tNAME" lines, innermost first), with the package's
own frames left out. Only heaps that keep stacks ask for it (Heap.alloc checks a flag read once
per heap), so nothing here runs on the path of a heap that does not.

The walk reads each frame's code object and the offset of its current instruction, which is
cheap; line numbers and text are not (a frame's line is found by scanning its code's line
table), so the text is cached per distinct walk: a training loop repeats a few stacks, each
built once. The cache is keyed by the code objects' ids, not the objects, whose hash is
computed anew from their contents on every lookup; each entry keeps its code objects alive, so
an id in it cannot be reused by another.
"""

import os
import sys

MAX_FRAMES = 32  # as many as LOG.stacks keeps of a stack (CUMA_STACK_FRAMES)
_WALK = MAX_FRAMES + 8  # the package's own frames do not count against the 32
_CACHE_MAX = 4096  # distinct stacks cached; past it the cache starts over

_STEPS = range(_WALK)
_cache = {}  # walk (id(code), offset, ...) -> (text, the code objects)

# Python 3.10+: a frame's line from its code and instruction offset (co_lines), so the walk
# need not ask each frame for f_lineno. Before, the walk takes f_lineno itself.
_BY_OFFSET = hasattr((lambda: None).__code__, "co_lines")


def _line(code, offset):
    if not _BY_OFFSET:
        return offset  # the walk recorded the line itself
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or 0
    return 0


def _text(codes, offsets):
    """The cuma_alloc_with_stack text of a walk."""
    lines = []
    for code, offset in zip(codes, offsets):
        file = code.co_filename
        if os.path.dirname(file) == _PACKAGE:
            continue
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+: Class.method
        lines.append("%s\t%d\t%s" % (_clean(file), _line(code, offset), _clean(name)))
        if len(lines) == MAX_FRAMES:
            break
    return "\n".join(lines).encode("utf-8", "backslashreplace")


def _clean(s):
    # Tabs and newlines part the fields and frames; a NUL would end the C string.
    return s.replace("\t", " ").replace("\n", " ").replace("\0", " ")


# The package's modules were all found through one sys.path entry, so their code objects'
# file names share this directory, spelt the same way (relative or not).
_PACKAGE = os.path.dirname(_text.__code__.co_filename)


def python_stack(skip=1):
    """The calling thread's Python stack as bytes for cuma_alloc_with_stack, starting `skip`
    frames above this function's caller (1: the caller's caller); b"" when every frame is the
    package's own."""
    try:
        f = sys._getframe(skip + 1)
    except ValueError:
        return b""
    # The fewer bytecodes a frame takes here the better: this loop is most of the cost.
    key = []
    append = key.append
    if _BY_OFFSET:
        for _ in _STEPS:
            append(id(f.f_code))
            append(f.f_lasti)
            f = f.f_back
            if f is None:
                break
    else:
        for _ in _STEPS:
            append(id(f.f_code))
            append(f.f_lineno)
            f = f.f_back
            if f is None:
                break
    n = len(key) // 2
    key = tuple(key)
    hit = _cache.get(key)
    if hit is not None:
        return hit[0]
    # A miss: walk again for the code objects themselves (the stack is the same one).
    codes, offsets = [], key[1::2]
    f = sys._getframe(skip + 1)
    while f is not None and len(codes) < n:
        codes.append(f.f_code)
        f = f.f_back
    text = _text(codes, offsets)
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[key] = (text, tuple(codes))
    return text
