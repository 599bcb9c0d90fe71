# SPDX-License-Identifier: Apache-2.0
"""cuma: a GPU memory manager, from Python.

The package is pure Python over ctypes; it needs libcuma.so (found next to the package,
through $CUMA_LIBRARY, in the source tree's build/lib, or on the library path) and nothing
else. PyTorch is optional and imported only by the helpers that need it.

- :class:`Heap`: a heap of your own on any backend (``cuma.Heap("backend:sim,capacity:1G")``);
  :meth:`Heap.pool` gives a :class:`Pool` of fixed-size blocks carved from it once.
- :func:`default_heap`, :func:`on_oom`: the process-wide heaps (the ones PyTorch uses).
- :func:`on_pressure`, :func:`ledger`: jobs sharing a GPU (the cross-process ledger): a callback
  for when a job of higher priority needs memory (:func:`remove_pressure` removes it), and the
  live heaps of the ledger (:func:`ledger_path`: where it lives).
- :mod:`cuma.torch`: ``enable()`` makes cuma PyTorch's CUDA allocator; ``memory_stats()``,
  ``memory_summary()``, ``empty_cache()``; ``whatif()`` replays a PyTorch memory snapshot and
  tells what PyTorch reserved against what cuma would; ``compact(model, optimizer=opt)`` moves a
  model's scattered tensors into dense pages, ``pool_buffers(module, pool)`` puts its buffers in
  a pool.
- :class:`CudaMemoryAllocator`: raw device memory from the default heaps.
- :mod:`cuma.adaptive`: ``find_batch_size``, ``DynamicBatcher``, ``safe_forward``, ``is_oom``,
  ``set_memory_growth``, ``set_memory_limit``.
- :func:`config_keys`, :func:`check_config`: the CUMA_CONF settings.
- Errors: :class:`CumaError` and subclasses (``OutOfMemoryError`` is also a MemoryError).
"""

from .errors import (
    BackendError,
    BadPointerError,
    ConfigError,
    CorruptionError,
    CumaError,
    CumaIOError,
    HeapClosedError,
    InvalidArgumentError,
    LibraryNotFoundError,
    LimitExceededError,
    NoDeviceError,
    OutOfMemoryError,
    ParseError,
    UnsupportedError,
)
from .heap import (
    ConfigKey,
    Heap,
    check_config,
    config_keys,
    config_table,
    default_heap,
    ledger,
    ledger_path,
    on_oom,
    on_pressure,
    remove_oom,
    remove_pressure,
    shutdown_default_heaps,
)
from ._pool import Pool
from .allocator import CudaMemoryAllocator
from . import adaptive
from . import torch

__version__ = "0.1.0"


def library_path():
    """The path libcuma was loaded from (loads it if needed)."""
    from . import _lib

    return _lib.path()


__all__ = [
    "Heap",
    "Pool",
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
    "CudaMemoryAllocator",
    "library_path",
    "adaptive",
    "torch",
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
    "HeapClosedError",
    "ParseError",
    "LibraryNotFoundError",
]
