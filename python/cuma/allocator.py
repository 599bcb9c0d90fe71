# SPDX-License-Identifier: Apache-2.0
"""CudaMemoryAllocator: the default heaps behind an allocator-object interface."""

from .heap import _apply_default_conf, _device_arg, _int_arg, _ptr_arg, default_heap

__all__ = ["CudaMemoryAllocator"]


class CudaMemoryAllocator:
    """Raw device memory from the process-wide default heaps: the same heaps PyTorch uses
    after :func:`cuma.torch.enable`, so memory handed to other libraries (CuPy, custom
    kernels) and PyTorch's tensors share one pool and one limit.

    ``conf`` (optional) becomes the settings of default heaps not created yet, in place of
    CUMA_CONF (the environment is not changed: Heap(...) and child processes still read
    CUMA_CONF); it is applied at the first allocation (or install()) and refused with
    RuntimeError if default heaps already exist with other settings. Thread-safe like the
    heaps."""

    def __init__(self, conf=None):
        if conf is not None and not isinstance(conf, str):
            raise TypeError("conf must be a str like 'limit:8G', not %s" % type(conf).__name__)
        self.conf = conf
        self._configured = conf is None

    def _configure(self, device):
        if not self._configured:
            _apply_default_conf(self.conf, "CudaMemoryAllocator", device)
            self._configured = True

    def allocate(self, size, device=0, stream=0):
        """Allocates ``size`` bytes on ``device`` for ``stream``; returns the address (int).
        Size 0 returns 0 (no memory, like PyTorch's empty tensors). Raises
        cuma.OutOfMemoryError (a MemoryError) when the heap cannot serve it."""
        size = _int_arg(size, "size", 0)
        self._configure(_device_arg(device))
        heap = default_heap(device)
        if size == 0:
            return 0
        return heap.alloc(size, stream)

    def free(self, ptr, device=0, stream=0):
        """Frees an address from :meth:`allocate` (0/None is a no-op)."""
        ptr = _ptr_arg(ptr)
        if ptr is None:
            return
        default_heap(device).free(ptr, stream)

    def install(self):
        """Makes cuma PyTorch's allocator: cuma.torch.enable(conf)."""
        from . import torch as cuma_torch

        return cuma_torch.enable(self.conf)

    def stats(self, device=0):
        """The default heap's statistics (cuma's own names; see cuma.torch.memory_stats for
        PyTorch's)."""
        return default_heap(device).stats()

    def __repr__(self):
        return "CudaMemoryAllocator(conf=%r)" % (self.conf,)
