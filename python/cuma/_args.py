# SPDX-License-Identifier: Apache-2.0
"""Argument checks for the C API: bad Python arguments fail here, with Python exceptions, before
any C call (ctypes would wrap an int past its C type, or cut a str at a NUL)."""

import operator

MAX_DEVICES = 64  # default heaps exist for device ordinals 0..63 (src/shim/default_heap.h)


def _c_string(value, name, error=ValueError):
    """A str for a C ``const char *`` parameter, as bytes. A NUL inside would end the string
    there for C, which would read "limit:1M\\0junk" as "limit:1M" without a word: refused,
    naming the argument (``error`` is the exception class)."""
    data = value.encode()
    at = data.find(b"\0")
    if at >= 0:
        raise error(
            "%s contains a NUL character (at byte %d), where C would cut it short: %r" % (name, at, value)
        )
    return data


def _int_arg(value, name, minimum=0):
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError("%s must be an int, not %s" % (name, type(value).__name__))
    v = operator.index(value)
    if v < minimum:
        raise ValueError("%s must be >= %d, got %d" % (name, minimum, v))
    return v


def _u64_arg(value, name):
    """A byte count or time for a uint64_t/size_t parameter: ctypes would silently wrap a
    value of 2**64 or more to its low 64 bits."""
    v = _int_arg(value, name, 0)
    if v >= 1 << 64:
        raise ValueError("%s %d does not fit in 64 bits" % (name, v))
    return v


def _callback_id_arg(value):
    """A callback id (a C int): ctypes would wrap 2**32 + id to id and remove another
    callback than the one named."""
    v = _int_arg(value, "callback_id", 0)
    if v >= 1 << 31:
        raise ValueError("callback_id %d is not an id from on_oom/on_pressure" % v)
    return v


def _size_arg(size, name="size"):
    v = _int_arg(size, name, 0)
    if v == 0:
        raise ValueError("%s must be > 0, got 0" % name)
    if v >= 1 << 64:
        raise ValueError("%s %d does not fit in 64 bits" % (name, v))
    return v


def _ptr_arg(ptr):
    if ptr is None:
        return None
    v = _int_arg(ptr, "ptr", 0)
    if v >= 1 << 64:
        raise ValueError("ptr %#x does not fit in 64 bits" % v)
    return v or None


def _stream_arg(stream):
    """A stream argument as the integer value of the handle (None for the default stream)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        if not isinstance(stream, (int,)) and hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    if isinstance(stream, bool) or not hasattr(stream, "__index__"):
        raise TypeError(
            "stream must be an int handle, None, or an object with a cuda_stream/ptr attribute, not %s"
            % type(stream).__name__
        )
    v = operator.index(stream)
    if v < 0 or v >= 1 << 64:
        raise ValueError("stream handle %d is not a valid pointer value" % v)
    return v or None


def _device_arg(device):
    v = _int_arg(device, "device", 0)
    if v >= MAX_DEVICES:
        raise ValueError("device must be in 0..%d, got %d" % (MAX_DEVICES - 1, v))
    return v
