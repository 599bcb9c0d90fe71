# SPDX-License-Identifier: Apache-2.0
"""Exceptions raised by cuma.

Every failure of a libcuma call raises a :class:`CumaError` subclass chosen by the call's
status; the message is libcuma's own (``cuma_last_error()``), which names what was wrong: the
configuration key, the pointer, the sizes involved. Classes also derive from the closest
built-in exception, so generic handlers keep working (``except MemoryError`` catches an
out-of-memory, ``except ValueError`` a bad setting).
"""

__all__ = [
    "CumaError",
    "InvalidArgumentError",
    "OutOfMemoryError",
    "LimitExceededError",
    "BadPointerError",
    "ConfigError",
    "BackendError",
    "NoDeviceError",
    "UnsupportedError",
    "CorruptionError",
    "CumaIOError",
    "ParseError",
    "LibraryNotFoundError",
    "HeapClosedError",
    "error_for_status",
]


class CumaError(RuntimeError):
    """Base class of every cuma error. ``status`` is the cuma_status number (0 if none)."""

    status = 0

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(CumaError, ValueError):
    """CUMA_ERR_INVALID: libcuma rejected an argument."""

    status = 1


class OutOfMemoryError(CumaError, MemoryError):
    """CUMA_ERR_OOM: out of memory after every recovery step (cache release, OOM callbacks,
    managed fallback). Also a MemoryError."""

    status = 2


class LimitExceededError(OutOfMemoryError):
    """CUMA_ERR_LIMIT: the request would go over the heap's configured limit. An
    OutOfMemoryError (and so a MemoryError) too."""

    status = 3


class BadPointerError(CumaError, ValueError):
    """CUMA_ERR_BAD_POINTER: a pointer the heap did not hand out, or freed twice."""

    status = 4


class ConfigError(CumaError, ValueError):
    """CUMA_ERR_CONFIG: unknown configuration key or bad value (the message names the key)."""

    status = 5


class BackendError(CumaError):
    """CUMA_ERR_BACKEND: the device backend (driver) failed."""

    status = 6


class NoDeviceError(CumaError):
    """CUMA_ERR_NO_DEVICE: no driver, or no such device."""

    status = 7


class UnsupportedError(CumaError):
    """CUMA_ERR_UNSUPPORTED: the backend cannot do this."""

    status = 8


class CorruptionError(CumaError):
    """CUMA_ERR_CORRUPT: validate() found a broken heap invariant."""

    status = 9


class CumaIOError(CumaError):
    """CUMA_ERR_IO: a file could not be read or written."""

    status = 10


class ParseError(CumaError, ValueError):
    """CUMA_ERR_PARSE: malformed input (trace line, JSON)."""

    status = 11


class HeapClosedError(CumaError, ValueError):
    """A call on a :class:`cuma.Heap` after (or while) :meth:`cuma.Heap.close` closed it, or
    on a default heap after :func:`cuma.shutdown_default_heaps`. A ValueError, as a call on a
    closed file is."""


class LibraryNotFoundError(CumaError):
    """libcuma.so could not be found or loaded; the message lists every place tried.

    Raised on first use, not at ``import cuma``, so that code which only imports the package
    (or only uses the pure-Python helpers in cuma.adaptive) works without the library."""


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        OutOfMemoryError,
        LimitExceededError,
        BadPointerError,
        ConfigError,
        BackendError,
        NoDeviceError,
        UnsupportedError,
        CorruptionError,
        CumaIOError,
        ParseError,
    )
}


def error_for_status(status, message):
    """The exception (not raised) for a failed cuma_status with libcuma's message."""
    cls = _BY_STATUS.get(status, CumaError)
    return cls(message, status)
