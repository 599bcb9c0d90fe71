# SPDX-License-Identifier: Apache-2.0
"""Surviving out-of-memory: find a batch size that fits, shrink batches on the fly, split a
forward pass, keep activations off the device while memory is tight, and TensorFlow-style memory
settings.

These helpers work with any allocator (PyTorch's own, or cuma after cuma.torch.enable()) and
recognise every common out-of-memory error (:func:`is_oom`). Any other error passes through
unchanged. PyTorch is imported only when a helper needs it.

Memory is released between tries *after* the failed attempt's exception is gone: a live
traceback holds the frames, and so the tensors, of the attempt that ran out of memory.

This is the public module; each concern lives in a private module of its own, and every
name is re-exported here (the private helpers too, so that ``cuma.adaptive._cpu_copy`` and
the like keep working):

- :mod:`cuma._oom`: :func:`is_oom` and :func:`release_memory`, used by all the others;
- :mod:`cuma._find_batch_size`: :func:`find_batch_size` and :data:`DEFAULT_BATCH_LIMIT`;
- :mod:`cuma._batch`: what a batch is and how it is split (the plans shared by
  DynamicBatcher and safe_forward), and the size check every helper makes;
- :mod:`cuma._dynamic_batcher`: :class:`DynamicBatcher`;
- :mod:`cuma._safe_forward`: :func:`safe_forward`, with its output joining and CPU copy;
- :mod:`cuma._memory_settings`: :func:`set_memory_growth` and :func:`set_memory_limit`;
- :mod:`cuma._memory_guard`: :class:`MemoryGuard` (activations offloaded or recomputed while
  memory is tight).

The helpers look each other up in those modules, not here: to replace one for a test
(``release_memory``, say), patch it where it is used (``cuma._find_batch_size``,
``cuma._dynamic_batcher``, ``cuma._safe_forward``), or pass ``release=``.
"""

from ._oom import _OOM_TEXTS, is_oom, release_memory  # noqa: F401  (_OOM_TEXTS: old import path)
from ._find_batch_size import DEFAULT_BATCH_LIMIT, find_batch_size
from ._batch import (  # noqa: F401  (private: re-exported for the old import paths)
    _SPLIT,
    _WHOLE,
    _collated_size,
    _common_size,
    _field_size,
    _fields_size,
    _has_array,
    _is_array,
    _is_record,
    _most_common,
    _plan_dim,
    _plan_field,
    _positive_int,
    _readings,
    _rebuild,
    _seal,
    _split,
    _uses_default_collate,
)
from ._dynamic_batcher import DynamicBatcher, _Step  # noqa: F401
from ._safe_forward import (  # noqa: F401
    _all_equal,
    _call,
    _concat,
    _cpu_copy,
    _describe,
    _join,
    _map_tensors,
    _tensors_in,
    safe_forward,
)
from ._memory_settings import set_memory_growth, set_memory_limit
from ._memory_guard import MemoryGuard

__all__ = [
    "is_oom",
    "release_memory",
    "find_batch_size",
    "DEFAULT_BATCH_LIMIT",
    "DynamicBatcher",
    "safe_forward",
    "set_memory_growth",
    "set_memory_limit",
    "MemoryGuard",
]
