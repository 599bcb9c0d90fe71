# SPDX-License-Identifier: Apache-2.0
"""Recognising out-of-memory errors, and releasing memory between tries: the two things every
helper of :mod:`cuma.adaptive` does when a try runs out of memory.

Kept apart from the helpers that retry (find_batch_size, DynamicBatcher, safe_forward), which
all import them from here; :mod:`cuma.adaptive` re-exports both as public API. PyTorch is
never imported here: :func:`is_oom` looks only at a torch already loaded, and
:func:`release_memory` empties only a CUDA cache already in use.
"""

import gc
import sys

# Texts that mean "out of memory" in errors of no out-of-memory type (matched in lower case):
# PyTorch before 1.13 and other libraries ("CUDA out of memory", "HIP out of memory", "MPS
# backend out of memory"), PyTorch's CPU allocator (its POSIX and its Windows wording), and
# the CUDA/ROCm libraries' failures to allocate their own memory, which PyTorch raises as a
# plain RuntimeError naming the status. Each names a failed allocation and nothing else.
_OOM_TEXTS = (
    "out of memory",
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cusparse_status_alloc_failed",
    "cusolver_status_alloc_failed",
    "cufft_alloc_failed",
    "hipblas_status_alloc_failed",
)


def is_oom(exc):
    """Whether an exception means "out of memory": MemoryError (cuma.OutOfMemoryError is
    one), torch.OutOfMemoryError and torch.cuda.OutOfMemoryError (where this PyTorch has
    them), and a RuntimeError whose message says so: "out of memory" (older PyTorch, other
    libraries), PyTorch's CPU allocator failing ("DefaultCPUAllocator: can't allocate
    memory"), or a CUDA library unable to allocate its memory (CUBLAS_STATUS_ALLOC_FAILED,
    CUDNN_STATUS_ALLOC_FAILED, CUDNN_STATUS_NOT_ENOUGH_WORKSPACE, and the cuSPARSE, cuSOLVER,
    cuFFT and hipBLAS equivalents). Nothing else counts."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        for cls in (getattr(torch, "OutOfMemoryError", None), getattr(cuda, "OutOfMemoryError", None)):
            if isinstance(cls, type) and isinstance(exc, cls):
                return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(text in msg for text in _OOM_TEXTS)


def release_memory():
    """The default release between tries: collects garbage (tensors kept alive by reference
    cycles), then empties the CUDA cache: cuma's when cuma.torch is enabled, else PyTorch's
    when CUDA is in use. Without CUDA it is just gc.collect()."""
    gc.collect()
    from . import torch as cuma_torch

    if cuma_torch.is_enabled():
        cuma_torch.empty_cache()
        return
    torch = sys.modules.get("torch")  # never import torch just to release nothing
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
