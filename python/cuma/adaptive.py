"""Surviving out-of-memory: find a batch size that fits, shrink batches on the fly, split a
forward pass, and TensorFlow-style memory settings.

These helpers work with any allocator (PyTorch's own, or cuma after cuma.torch.enable()) and
recognise every common out-of-memory error (:func:`is_oom`). Any other error passes through
unchanged. PyTorch is imported only when a helper needs it.

Memory is released between tries *after* the failed attempt's exception is gone: a live
traceback holds the frames, and so the tensors, of the attempt that ran out of memory.
"""

import collections
import copy
import gc
import itertools
import os
import sys
import warnings

__all__ = [
    "is_oom",
    "release_memory",
    "find_batch_size",
    "DEFAULT_BATCH_LIMIT",
    "DynamicBatcher",
    "safe_forward",
    "set_memory_growth",
    "set_memory_limit",
]

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


def _positive_int(v, name):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("%s must be an int, not %s" % (name, type(v).__name__))
    if v < 1:
        raise ValueError("%s must be >= 1, got %d" % (name, v))
    return v


# --- find_batch_size ---

DEFAULT_BATCH_LIMIT = 1 << 20  # find_batch_size's cap when it is given no limit


def find_batch_size(step_fn, start, limit=None, release=None):
    """The largest batch size for which ``step_fn(batch_size)`` runs without running out of
    memory: doubles from ``start`` until a size fails (or ``limit`` is reached), then
    searches between the last size that ran and the first that failed.

    ``limit=None`` caps the search at :data:`DEFAULT_BATCH_LIMIT` (2**20 = 1048576), or at
    ``start`` if that is larger: a step whose memory use stops growing with the batch size
    (one that never takes more than a small data set holds, say) never runs out of memory,
    and without a cap the doubling would never end. When every size up to the cap runs, the
    cap is returned (about 20 tries from 1).

    ``release()`` runs between tries (default: :func:`release_memory`). Raises RuntimeError
    (from the OOM) if even ``start`` fails; any error that is not an OOM propagates as is.
    Assumes that if a size fits, every smaller one does."""
    if not callable(step_fn):
        raise TypeError("step_fn must be callable")
    start = _positive_int(start, "start")
    if limit is None:
        limit = max(DEFAULT_BATCH_LIMIT, start)
    else:
        limit = _positive_int(limit, "limit")
        if limit < start:
            raise ValueError("limit %d is below start %d" % (limit, start))
    release = release or release_memory

    def fits(bs):
        try:
            step_fn(bs)
            ok = True
        except BaseException as e:
            if not is_oom(e):
                raise
            if bs == start:
                raise RuntimeError(
                    "find_batch_size: even the start batch size %d runs out of memory: %s" % (start, e)
                ) from e
            ok = False
        release()  # the failed attempt's exception and frames are gone by now
        return ok

    fits(start)
    good, bad = start, None
    while good < limit:
        nxt = min(good * 2, limit)
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
            break
    if bad is None:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


# --- splitting batches, shared by DynamicBatcher (dim 0) and safe_forward (any dim) ---
#
# A batch is split by a *plan* worked out once (DynamicBatcher: per batch from the source;
# safe_forward: per call) and applied to every piece, so that what is split never depends on
# a piece's size: a value that is not per-sample stays whole in every piece even where its
# length happens to equal some piece's. A plan is _SPLIT (slice along the batch dimension: a
# tensor/array, or a list/tuple of per-sample values), _WHOLE (the same value goes into
# every piece), or a container of plans: ("dict", {key: plan}) or ("seq", [plan per item]).

_SPLIT = "split"
_WHOLE = "whole"


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "__getitem__") and len(getattr(x, "shape", ())) > 0


def _is_record(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")  # a namedtuple


def _has_array(x):
    if _is_array(x):
        return True
    if isinstance(x, dict):
        return any(_has_array(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_array(v) for v in x)
    return False


def _most_common(sizes):
    """The most frequent of ``sizes``; a tie goes to the one that comes first."""
    counts = collections.Counter(sizes)
    top = max(counts.values())
    return next(s for s in sizes if counts[s] == top)


def _common_size(seq):
    """The leading size that every item of a list/tuple has, each a tensor/array, list, tuple
    or dict (a list counts by its length, a nested structure by its own batch size): the
    shape of default_collate's output for a batch of tuple or list samples (a list of
    fields). None when the items are something else or their sizes differ."""
    if not seq or not all(_is_array(x) or isinstance(x, (dict, list, tuple)) for x in seq):
        return None
    sizes = {_field_size(x) for x in seq}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _collated_size(seq):
    """_common_size for a whole list batch, which must hold a tensor/array among its own
    items, as default_collate's list of fields does (the stacked fields). A list of tuple or
    dict samples holds tensors only inside its items, and their common size (a tuple
    sample's length, say) says nothing about the batch."""
    return _common_size(seq) if any(_is_array(x) for x in seq) else None


def _field_size(v):
    """The leading size of one item of a nested list read as default_collate's fields: a
    tensor's/array's first dimension, a nested structure's batch size, or a list's length;
    None for anything else (a str, a number)."""
    readings = _readings(v, collated=True)
    return readings[0] if readings else None


def _readings(v, collated):
    """The batch sizes one field can stand for. A nested list or tuple has two readings: a
    list of per-sample values (its length: the images of torchvision's detection batches,
    collate_fn=lambda b: tuple(zip(*b))), or nested fields (its items' common leading size:
    default_collate's output for a tuple inside each sample). Under default_collate only the
    second exists, as long as the items share a size."""
    if _is_array(v):
        return [int(v.shape[0])]
    if isinstance(v, dict) or _is_record(v):
        n = _fields_size(list(v.values()) if isinstance(v, dict) else list(v), collated)
        return [] if n is None else [n]
    if isinstance(v, (list, tuple)):
        common = _common_size(v)
        if common is None or common == len(v):
            return [len(v)]
        return [common] if collated else [len(v), common]
    return []


def _fields_size(items, collated=False):
    """The batch size of parallel fields: the leading size of the first tensor/array among
    them, as before fields were sized by a vote (a vote lets a shared table or bank that
    outnumbers the batch tensors decide). Without one: the size that most fields can stand
    for (see _readings; a field counts once per size), the fields holding a tensor/array
    voting first (a per-batch list of names must not outvote them); a tie goes to the
    first reading met, a list's length before its items' size, so that a tensor is not cut
    along a dimension that may not be the batch's. None if no field has a size."""
    for v in items:
        if _is_array(v):
            return int(v.shape[0])
    for votes_now in (_has_array, lambda v: True):
        votes = []
        for v in items:
            if votes_now(v):
                votes.extend(dict.fromkeys(_readings(v, collated)))
        if votes:
            return _most_common(votes)
    return None


def _seal(kind, subs):
    """A container plan, or _WHOLE when nothing in it is split."""
    plans = subs.values() if kind == "dict" else subs
    return _WHOLE if all(p == _WHOLE for p in plans) else (kind, subs)


def _plan_field(v, n, collated=False):
    """The plan for one field of a batch of ``n`` samples split along dim 0."""
    if _is_array(v):
        return _SPLIT if int(v.shape[0]) == n else _WHOLE
    if isinstance(v, dict):
        return _seal("dict", {k: _plan_field(x, n, collated) for k, x in v.items()})
    if _is_record(v):
        return _seal("seq", [_plan_field(x, n, collated) for x in v])
    if isinstance(v, (list, tuple)):
        nested, per_sample = _common_size(v) == n, len(v) == n
        # Both readings fit (3 images of 3 channels): default_collate's output is nested
        # fields; anything else is sliced as per-sample values, which cuts no tensor along a
        # dimension that may not be the batch's.
        if nested and (collated or not per_sample):
            return _seal("seq", [_plan_field(x, n, collated) for x in v])
        if per_sample:
            return _SPLIT  # e.g. the strings default_collate keeps as a list, or images
    return _WHOLE


def _plan_dim(x, dim, n):
    """safe_forward's plan: every tensor/array of size ``n`` along ``dim`` is split."""
    if _is_array(x):
        return _SPLIT if len(x.shape) > dim and int(x.shape[dim]) == n else _WHOLE
    if isinstance(x, dict):
        return _seal("dict", {k: _plan_dim(v, dim, n) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return _seal("seq", [_plan_dim(v, dim, n) for v in x])
    return _WHOLE


def _rebuild(template, items):
    if _is_record(template):
        return type(template)(*items)
    return type(template)(items)


def _split(x, plan, k, dim=0):
    """(the first k samples, the rest) of ``x`` by its plan."""
    if plan == _WHOLE:
        return x, x
    if plan == _SPLIT:
        if _is_array(x):
            lead = (slice(None),) * dim
            return x[lead + (slice(None, k),)], x[lead + (slice(k, None),)]
        return x[:k], x[k:]
    kind, subs = plan
    if kind == "dict":
        pairs = {key: _split(v, subs[key], k, dim) for key, v in x.items()}
        return type(x)((key, p[0]) for key, p in pairs.items()), type(x)((key, p[1]) for key, p in pairs.items())
    pairs = [_split(v, p, k, dim) for v, p in zip(x, subs)]
    return _rebuild(x, [p[0] for p in pairs]), _rebuild(x, [p[1] for p in pairs])


def _uses_default_collate(source):
    """Whether ``source`` is a DataLoader that batches with PyTorch's default_collate, whose
    list batches are always parallel fields (or a list of strings)."""
    fn = getattr(source, "collate_fn", None)
    data = sys.modules.get("torch.utils.data")  # a DataLoader exists only if this is loaded
    if fn is None or data is None:
        return False
    collate_mod = getattr(getattr(data, "_utils", None), "collate", None)
    known = (getattr(data, "default_collate", None), getattr(collate_mod, "default_collate", None))
    return any(k is not None and fn is k for k in known)


# --- DynamicBatcher ---


class _Step:
    """Context manager of DynamicBatcher.step(): a clean exit counts a clean step; an OOM
    inside is swallowed and the batcher re-yields the same samples in smaller batches."""

    def __init__(self, batcher):
        self._b = batcher

    def __enter__(self):
        return self._b

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self._b._mark_clean()
            return False
        if not is_oom(exc):
            return False
        # At the smallest batch there is nothing left to try: the OOM goes to the caller.
        return self._b._shrink()


class DynamicBatcher:
    """Iterates the batches of ``loader_or_iterable`` in pieces of at most ``batch_size``
    samples, halving the size on out-of-memory and growing it back when memory allows::

        batcher = DynamicBatcher(loader, batch_size=64)
        for batch in batcher:
            with batcher.step():          # an OOM in here is caught: the same samples
                loss = model(batch).sum() # come back next, split in halves
                loss.backward()

    or, handling the error yourself, ``except OOM: batcher.report_oom()``.

    A batch larger than the current size is served in several pieces; pieces are never
    merged across source batches, and every sample is served exactly once, whole. A batch
    from the source is split along dim 0 as follows:

    - a tensor or array: sliced;
    - parallel fields: a dict, a tuple or namedtuple, or a list of fields (below), split
      together. The batch size is the leading size of the first tensor or array among the
      fields (put the per-sample tensor first: when most of them have another size, a
      UserWarning says so, once). Without one, it is the size most fields agree on, where a
      nested list or tuple can stand for two: its length (a list of per-sample values, such
      as the images and targets of torchvision's detection batches, ``collate_fn=lambda b:
      tuple(zip(*b))``) or its items' common leading size (nested fields, as default_collate
      makes them); a tie goes to the length. Each field of that size is split: a tensor, a
      list of per-sample values (default_collate keeps strings as such a list), a nested
      structure; a nested list that fits both readings is sliced as per-sample values (no
      tensor is cut along a dimension that may not be the batch's) unless the source is a
      DataLoader using default_collate. Every other value (a per-batch list of class names,
      a tensor of another size, a string, a number) goes whole into every piece;
    - a list of samples: any other list (numbers, variable-length sequences, tuple or dict
      samples), sliced.

    PyTorch's default_collate turns a batch of tuple or list samples into a *list* of
    fields, e.g. ``[inputs, targets]`` or ``[tensor, list_of_str]``: each item a tensor, a
    list or a nested structure, all with the batch size as their leading size. A list is
    taken for fields when it is shaped so (every item a tensor/array, list, tuple or dict, at
    least one of the items itself a tensor/array, one leading size for all), and always when
    the source is a DataLoader using default_collate (unless it is a list of strings: the
    samples). A list of tuple or dict samples (``(image, label)``, ``{"input_ids": ...}``)
    holds its tensors only inside its items: it is a list of samples. The first
    list batch decides for the batches after it: after a list of samples, a list shaped like
    fields (a tail batch of one sample, samples that happen to have one length) is a list of
    samples too; after fields, a list that is not shaped like fields raises TypeError. A
    list of same-length tensors from a loader that does not collate (``collate_fn=lambda b:
    b``) cannot be told from fields by its shape: say what the batches are with
    ``fields=False`` (lists and tuples are lists of samples) or ``fields=True`` (lists and
    tuples are parallel fields). Dicts and namedtuples are always fields.

    On OOM the size becomes half of the failed piece (at least ``min_batch``) and the failed
    piece is served again, split; an OOM at ``min_batch`` is raised (from step()) or gives
    RuntimeError (from report_oom()). After ``grow_after`` clean steps the size grows by 1.25x
    (up to ``max_batch``, default the initial ``batch_size``) if ``free_memory_fn()`` returns
    something true (no function: always). Memory is released (``release()``, default
    :func:`release_memory`) before the retry.

    A job that shares its GPU with jobs of higher priority gives memory back when asked:
    ``cuma.on_pressure(lambda nbytes: batcher.yield_memory())`` halves the batch from the next
    one on (see :meth:`yield_memory`).

    Attributes: ``batch_size`` (current), ``num_ooms``, ``num_steps`` (clean),
    ``num_yields`` (halvings asked for by other jobs). Not thread-safe, except
    :meth:`yield_memory`: one loop per batcher."""

    def __init__(
        self,
        loader_or_iterable,
        batch_size,
        min_batch=1,
        max_batch=None,
        free_memory_fn=None,
        grow_after=50,
        release=None,
        fields=None,
    ):
        self._source = loader_or_iterable
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.min_batch = _positive_int(min_batch, "min_batch")
        if self.min_batch > self.batch_size:
            raise ValueError("min_batch %d is above batch_size %d" % (min_batch, batch_size))
        self.max_batch = self.batch_size if max_batch is None else _positive_int(max_batch, "max_batch")
        if self.max_batch < self.batch_size:
            raise ValueError("max_batch %d is below batch_size %d" % (max_batch, batch_size))
        if free_memory_fn is not None and not callable(free_memory_fn):
            raise TypeError("free_memory_fn must be callable")
        if fields is not None and not isinstance(fields, bool):
            raise TypeError("fields must be None (decide from the batches), True or False, not %r" % (fields,))
        self.fields = fields
        self._default_collate = _uses_default_collate(loader_or_iterable)
        self._list_kind = None  # "fields" or "samples": what the first list batch was
        self._warned_size = False  # said once that the first tensor's size was taken
        self.free_memory_fn = free_memory_fn
        self.grow_after = _positive_int(grow_after, "grow_after")
        self.release = release or release_memory
        self.num_ooms = 0
        self.num_steps = 0
        self._it = None
        self._pending = collections.deque()  # (batch, plan, number of samples)
        self._last = None  # the piece served last, as (batch, plan, number of samples)
        self._last_state = None  # None: not judged yet; "clean"; "oom"
        self._clean_run = 0
        self._release_due = False
        self._yield_due = False
        self.num_yields = 0

    def __iter__(self):
        self._it = iter(self._source)
        self._pending.clear()
        self._last = None
        self._last_state = None
        return self

    def __next__(self):
        if self._it is None:
            self.__iter__()
        if self._last is not None and self._last_state is None:
            self._mark_clean()  # the caller moved on without reporting an OOM
        if self._yield_due:
            # Asked by another job: the next batches are half as large (the grown-back size
            # is earned again from here), and what the last one held goes back first.
            self._yield_due = False
            self.num_yields += 1
            self.batch_size = max(self.min_batch, self.batch_size // 2)
            self._clean_run = 0
            self._release_due = True
        if self._release_due:
            self._release_due = False
            self.release()
        while not self._pending:
            batch = next(self._it)  # StopIteration ends the loop
            plan, n = self._plan(batch)
            if n > 0:
                self._pending.append((batch, plan, n))
        unit, plan, n = self._pending.popleft()
        if n > self.batch_size:
            unit, rest = _split(unit, plan, self.batch_size)
            self._pending.appendleft((rest, plan, n - self.batch_size))
            n = self.batch_size
        self._last = (unit, plan, n)
        self._last_state = None
        return unit

    def _plan(self, batch):
        """(plan, number of samples) of a batch from the source (see the class docstring)."""
        if _is_array(batch):
            return _SPLIT, int(batch.shape[0])
        if isinstance(batch, dict) or _is_record(batch):
            return self._fields_plan(batch)
        if isinstance(batch, (list, tuple)):
            if self._is_fields(batch):
                return self._fields_plan(batch)
            return _SPLIT, len(batch)
        raise TypeError("DynamicBatcher: cannot split a batch of type %s" % type(batch).__name__)

    def _is_fields(self, seq):
        """Whether a list or tuple batch is parallel fields rather than a list of samples."""
        if self.fields is not None:
            return self.fields
        if isinstance(seq, tuple):
            return True
        if not seq:
            return False  # nothing to serve, and nothing to learn about the source from
        if self._default_collate:
            return not all(isinstance(x, (str, bytes)) for x in seq)
        if self._list_kind == "samples":
            return False
        shaped = _collated_size(seq) is not None
        if self._list_kind is None:
            self._list_kind = "fields" if shaped else "samples"
            if shaped and all(_is_array(x) for x in seq) and len({tuple(x.shape) for x in seq}) == 1:
                # Fields of one shape, or samples of one length? The shape cannot tell.
                warnings.warn(
                    "DynamicBatcher: a list of %d tensors of shape %s is taken for parallel fields "
                    "(default_collate's output), split along their first dimension; if it is a list "
                    "of samples, pass fields=False (fields=True says it is fields)" % (len(seq), tuple(seq[0].shape)),
                    stacklevel=4,  # the caller's loop: here < _plan < __next__
                )
        elif self._list_kind == "fields" and not shaped:
            raise TypeError(
                "DynamicBatcher: this list batch is a list of samples (no tensor among its items, or "
                "items of different leading sizes), but an earlier list batch looked like parallel "
                "fields and was split "
                "as such; pass fields=False if the batches are lists of samples (then the earlier "
                "ones are served right too), or fields=True if they are fields"
            )
        return self._list_kind == "fields"

    def _fields_plan(self, batch):
        keys = list(batch.keys()) if isinstance(batch, dict) else list(range(len(batch)))
        items = list(batch.values()) if isinstance(batch, dict) else list(batch)
        collated = self._default_collate
        n = _fields_size(items, collated)
        if n is None:
            raise TypeError(
                "DynamicBatcher: cannot tell the batch size of this %s batch: none of its fields is "
                "a tensor, an array or a list" % type(batch).__name__
            )
        sizes = [int(v.shape[0]) for v in items if _is_array(v)]
        top = _most_common(sizes) if sizes else n
        if not self._warned_size and sizes.count(top) > sizes.count(n):
            # The first tensor decides, as it always did; a shared table outnumbering the
            # batch tensors must not (it would be split, and every sample served twice).
            self._warned_size = True
            first = next(k for k, v in zip(keys, items) if _is_array(v))
            first = ("key %r" if isinstance(batch, dict) else "field %d") % (first,)
            warnings.warn(
                "DynamicBatcher: took %d, the leading size of the first tensor (%s), as the batch "
                "size, but most tensors in the batch have %d; values of another size than the batch "
                "go whole into every piece: if the samples lie along another tensor, put it first"
                % (n, first, top),
                stacklevel=4,  # the caller's loop: here < _plan < __next__
            )
        if isinstance(batch, dict):
            return _seal("dict", {k: _plan_field(v, n, collated) for k, v in batch.items()}), n
        return _seal("seq", [_plan_field(v, n, collated) for v in batch]), n

    def step(self):
        """A context manager for one training step on the batch just yielded (see above)."""
        return _Step(self)

    def yield_memory(self):
        """Asks the batcher to halve its batch size from the next batch on and to release the
        cache then: what a pressure callback calls (``cuma.on_pressure``), from the allocator's
        thread, while the loop runs. Safe from any thread; several calls before the next batch
        halve once."""
        self._yield_due = True

    def report_oom(self):
        """Tells the batcher that the batch just yielded ran out of memory: it is served
        again in smaller pieces. RuntimeError if it already was at ``min_batch``."""
        if not self._shrink():
            raise RuntimeError(
                "DynamicBatcher: out of memory at the minimum batch size %d" % self.min_batch
            )

    def _shrink(self):
        if self._last is None or self._last_state is not None:
            raise RuntimeError("DynamicBatcher: no batch is in flight to report an OOM for")
        n = self._last[2]
        if n <= self.min_batch:
            self._last_state = "oom"
            return False
        self.num_ooms += 1
        self.batch_size = max(self.min_batch, min(self.batch_size, n) // 2)
        self._pending.appendleft(self._last)
        self._last, self._last_state = None, "oom"
        self._clean_run = 0
        self._release_due = True
        return True

    def _mark_clean(self):
        if self._last_state is not None:
            return
        self._last_state = "clean"
        self.num_steps += 1
        self._clean_run += 1
        if self._clean_run >= self.grow_after and self.batch_size < self.max_batch:
            self._clean_run = 0
            if self.free_memory_fn is None or self.free_memory_fn():
                self.batch_size = min(self.max_batch, max(self.batch_size + 1, int(self.batch_size * 1.25)))


# --- safe_forward ---


def _tensors_in(x):
    if _is_array(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors_in(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors_in(v)


def _map_tensors(x, fn):
    if _is_array(x):
        return fn(x)
    if isinstance(x, dict):
        return type(x)((k, _map_tensors(v, fn)) for k, v in x.items())
    if isinstance(x, (tuple, list)):
        return _rebuild(x, [_map_tensors(v, fn) for v in x])
    return x


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _all_equal(torch, outs):
    """Whether every piece gave the same value (a tensor: same shape, dtype and elements)."""
    first = outs[0]
    for o in outs[1:]:
        if o is first:
            continue
        if isinstance(first, torch.Tensor) or isinstance(o, torch.Tensor):
            if not (isinstance(first, torch.Tensor) and isinstance(o, torch.Tensor)):
                return False
            if first.shape != o.shape or first.dtype != o.dtype:
                return False
            a, b = (first, o) if first.device == o.device else (first.cpu(), o.cpu())
            if not torch.equal(a, b):
                return False
            continue
        try:
            if _is_array(first) or _is_array(o):
                same = getattr(first, "shape", None) == getattr(o, "shape", None) and bool((first == o).all())
            else:
                same = bool(first == o)
        except Exception:
            same = False
        if not same:
            return False
    return True


def _describe(x):
    if hasattr(x, "shape"):
        return "a %s of shape %s" % (type(x).__name__, tuple(x.shape))
    return "a %s" % type(x).__name__


def _join(torch, outs, sizes, dim, path):
    """The outputs of the pieces of a split batch (``sizes`` samples each) as one output."""
    first = outs[0]
    if isinstance(first, dict):
        if any(not isinstance(o, dict) or o.keys() != first.keys() for o in outs):
            raise ValueError("safe_forward: %s has different keys in different pieces of the batch" % path)
        return type(first)((k, _join(torch, [o[k] for o in outs], sizes, dim, "%s[%r]" % (path, k))) for k in first)
    if isinstance(first, (tuple, list)):
        if any(type(o) is not type(first) or len(o) != len(first) for o in outs):
            raise ValueError("safe_forward: %s has a different length in different pieces of the batch" % path)
        names = first._fields if _is_record(first) else None
        paths = ["%s.%s" % (path, names[i]) if names else "%s[%d]" % (path, i) for i in range(len(first))]
        return _rebuild(first, [_join(torch, [o[i] for o in outs], sizes, dim, paths[i]) for i in range(len(first))])
    lead = [int(o.shape[dim]) if _is_array(o) and len(o.shape) > dim else None for o in outs]
    np = sys.modules.get("numpy")
    joinable = None not in lead and (all(isinstance(o, torch.Tensor) for o in outs) or np is not None)
    if joinable and lead == list(sizes):
        return _concat(torch, outs, dim)
    # Not per-sample (a scalar, a model's tensor, None): only a value that every piece gave
    # alike is the unsplit run's value too.
    if _all_equal(torch, outs):
        return first
    # A flattened batch dimension ((B*L, V) logits): the same whole number of rows per sample
    # in every piece, so the pieces' rows in order are the unsplit run's.
    if joinable:
        rows_per_sample = {m // n if m % n == 0 else None for m, n in zip(lead, sizes)}
        if len(rows_per_sample) == 1 and rows_per_sample.pop() not in (None, 0):
            return _concat(torch, outs, dim)
    raise ValueError(
        "safe_forward: the batch ran out of memory and was split (pieces of %s samples), but %s "
        "(%s) is not per-sample (its size along dim %d is neither the pieces' sizes nor one whole "
        "multiple of them) and differs between the pieces, so no joined value would equal the "
        "unsplit run's; return per-sample values and reduce them after safe_forward" % (
            " and ".join(str(n) for n in sizes), path, _describe(first), dim)
    )


def _concat(torch, outs, dim):
    if all(isinstance(o, torch.Tensor) for o in outs):
        if len({o.device for o in outs}) > 1:  # a CPU fallback piece that could not go back
            outs = [o.cpu() for o in outs]
        return torch.cat(outs, dim)
    return sys.modules["numpy"].concatenate(outs, axis=dim)


def _cpu_copy(torch, model):
    """A copy of the model on the CPU that never touches the model's device: every tensor the
    model holds (parameters, buffers, and tensors kept as plain attributes of its modules,
    such as a mask or a cached table, also inside lists, tuples and dicts) is copied to the
    CPU first and handed to deepcopy as already copied, so the deepcopy allocates no device
    memory (a plain deepcopy of a GPU model would, at the moment memory is shortest) and the
    copy holds no tensor on the device. The user's model is left as it is."""
    if not isinstance(model, torch.nn.Module):
        return model
    memo = {}

    def to_cpu(t):
        if id(t) in memo:
            return
        c = t.detach().to("cpu", copy=True)
        if isinstance(t, torch.nn.Parameter):
            c = torch.nn.Parameter(c, requires_grad=t.requires_grad)
        memo[id(t)] = c

    seen = set()  # containers already walked (an attribute may hold a cycle)

    def walk(x):
        if isinstance(x, torch.Tensor):
            to_cpu(x)
        elif isinstance(x, (dict, list, tuple, set, frozenset)) and id(x) not in seen:
            seen.add(id(x))
            for v in x.values() if isinstance(x, dict) else x:
                walk(v)

    for t in itertools.chain(model.parameters(), model.buffers()):
        to_cpu(t)
    for m in model.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):  # done above / visited
                walk(value)
    return copy.deepcopy(model, memo)


def safe_forward(model, inputs, min_batch=1, cpu_fallback=False, dim=0, release=None, batch_size=None):
    """``model(inputs)`` that survives out-of-memory by splitting the batch.

    ``inputs`` is a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``) or a
    dict (``model(**inputs)``). The batch size is ``batch_size`` if given, else the size
    along ``dim`` of the first tensor in ``inputs`` (put the batch first, or name it: when
    most input tensors have another size, a UserWarning says so, and an out-of-memory error
    that propagates while another size is as common carries a note saying which size was
    taken). The tensors of that size along ``dim`` are the batch, decided once for the call:
    they are split, and every other value (a shared bias, a temperature, a bank of keys, a
    tensor of another size, even one whose size equals a piece's) goes whole to every piece.
    On OOM the cache is released (``release()``, default :func:`release_memory`), the batch
    is split in halves, and each half is run the same way, down to ``min_batch``.

    The pieces' outputs (a tensor, or a tuple/list/dict of them) are joined along ``dim``:
    an output whose size along ``dim`` is its piece's batch size is concatenated
    (torch.cat), so the result equals the unsplit run's (up to floating-point summation
    order in the model). Any other output (a scalar, a model's tensor, None) is kept if every
    piece gave the same. One whose size along ``dim`` is the same whole multiple of its
    piece's batch size in every piece (a flattened batch dimension: (B*L, V) logits) is
    concatenated too. Any other output that differs between the pieces (a loss averaged over
    the batch) has no value that would be the unsplit run's, and ValueError names it: return
    per-sample values and reduce them after safe_forward.

    With ``cpu_fallback=True`` a piece that runs out of memory at ``min_batch`` runs on a CPU
    copy of the model (made once; the model itself is not moved) and its output is moved back
    to the inputs' device; if even that runs out of memory, the whole result is returned on
    the CPU. That is for inference only: gradients of a piece run on the copy would reach the
    copy's parameters, not the model's, so when the fallback is needed with grad enabled and
    parameters that require it, safe_forward raises RuntimeError rather than train silently
    wrong (a call that never needs it runs as usual, an eval() model under grad included):
    run it under torch.no_grad() or torch.inference_mode(). Errors that are not OOM propagate
    unchanged, as does an OOM at ``min_batch`` without the fallback."""
    import torch

    if not callable(model):
        raise TypeError("model must be callable")
    min_batch = _positive_int(min_batch, "min_batch")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError("dim must be an int >= 0, got %r" % (dim,))
    release = release or release_memory
    sizes = [int(t.shape[dim]) for t in _tensors_in(inputs) if len(t.shape) > dim]
    if not sizes:
        raise ValueError("safe_forward: inputs hold no tensor with a dimension %d to split along" % dim)
    note = None
    if batch_size is None:
        # The first tensor, as before sizes were put to a vote: a bank of keys or a table
        # that outnumbers the batch tensors would win a vote, be split, and give a wrong
        # result without an error.
        n = sizes[0]
        counts = collections.Counter(sizes)
        rivals = sorted(s for s in counts if s != n and counts[s] >= counts[n])
        if rivals:
            note = (
                "safe_forward took %d as the batch size (the first input tensor's size along dim %d), "
                "though as many or more input tensors have size %s there; if the batch is another "
                "size, pass batch_size= to name it" % (n, dim, " or ".join(str(r) for r in rivals))
            )
        top = _most_common(sizes)
        if counts[top] > counts[n]:
            warnings.warn(
                "safe_forward: took %d (the first input tensor's size along dim %d) as the batch size, "
                "but most input tensors have size %d there: pass batch_size=%d if they are the batch, "
                "or batch_size=%d to say the first one is" % (n, dim, top, top, n),
                stacklevel=2,
            )
    else:
        n = _positive_int(batch_size, "batch_size")
        if n not in sizes:
            raise ValueError(
                "safe_forward: batch_size %d: no input tensor has that size along dim %d (sizes: %s)"
                % (n, dim, ", ".join(str(s) for s in sorted(set(sizes))))
            )
    plan = _plan_dim(inputs, dim, n)
    batch = [t for t in _tensors_in(inputs) if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == n]
    device = batch[0].device if batch else torch.device("cpu")
    state = {}

    def run_cpu(piece, n):
        # Refused only here, when a piece needs the copy: a call that never gets this far
        # (no OOM, or splitting was enough) trains or evaluates the model itself.
        if (
            torch.is_grad_enabled()
            and isinstance(model, torch.nn.Module)
            and any(p.requires_grad for p in model.parameters())
        ):
            raise RuntimeError(
                # Worded so that is_oom() does not take it for one: it is not to be retried.
                "safe_forward: a piece of %d samples did not fit even at min_batch, and "
                "cpu_fallback=True is for inference: a piece run on a CPU copy of the model would "
                "give its gradients to the copy's parameters, never to the model's. Call it under "
                "torch.no_grad() or torch.inference_mode(), or without cpu_fallback when training" % n
            )
        if "cpu_model" not in state:
            state["cpu_model"] = _cpu_copy(torch, model)
        to_cpu = lambda t: t.to("cpu") if isinstance(t, torch.Tensor) else t  # noqa: E731
        out = _call(state["cpu_model"], _map_tensors(piece, to_cpu))
        if device.type == "cpu":
            return out
        try:
            return _map_tensors(out, lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        except BaseException as e:
            if not is_oom(e):
                raise
        return out  # stays on the CPU; _join moves the other pieces there too

    def attempt(piece, n):
        splittable = n // 2 >= min_batch
        try:
            return _call(model, piece)
        except BaseException as e:
            if not is_oom(e) or (not splittable and not cpu_fallback):
                raise
        release()  # outside the except: the failed attempt's frames are gone
        if not splittable:
            return run_cpu(piece, n)
        k = (n + 1) // 2
        first, second = _split(piece, plan, k, dim)
        return _join(torch, [attempt(first, k), attempt(second, n - k)], [k, n - k], dim, "output")

    try:
        return attempt(inputs, n)
    except BaseException as e:
        # Wherever the OOM came from (the whole batch, or a piece at min_batch), the batch may
        # have been taken from the wrong tensor.
        if note is not None and is_oom(e) and hasattr(e, "add_note"):
            e.add_note(note)
        raise


# --- TensorFlow's vocabulary ---


def set_memory_growth(enabled):
    """TensorFlow's ``set_memory_growth`` for the default heaps created from now on.

    True (cuma's default): memory is taken from the device as needed (growth:on). False:
    the heap maps its whole allowance at creation and never grows (growth:off with
    preallocate = the limit), which needs a size: call :func:`set_memory_limit` first.
    Like TensorFlow, it cannot change heaps that already exist: RuntimeError."""
    from .heap import _conf_lock, _created_default_heaps, _parse_conf, _update_env_conf

    if not isinstance(enabled, bool):
        raise TypeError("enabled must be True or False, not %r" % (enabled,))
    with _conf_lock:  # no default heap may appear between the check and the new settings
        if _created_default_heaps():
            raise RuntimeError(
                "set_memory_growth: the default heaps already exist; memory growth must be set before "
                "the first allocation"
            )
        if enabled:
            _update_env_conf({"growth": "on"}, removals=("preallocate",))
            return
        limit = _parse_conf(os.environ.get("CUMA_CONF")).get("limit")
        if not limit or limit.lower() in ("none", "unlimited"):
            raise ValueError(
                "set_memory_growth(False) needs the amount to preallocate: call set_memory_limit(bytes) first"
            )
        _update_env_conf({"growth": "off", "preallocate": limit})


def set_memory_limit(nbytes, device=None):
    """TensorFlow's ``memory_limit``: a hard limit on the memory a default heap holds.

    ``device=None``: becomes CUMA_CONF's ``limit`` for heaps created from now on and is set
    on every default heap that exists (cuma_set_limit; cache beyond it goes back at once,
    live memory stays until freed). With a device: that device's heap only (created if
    needed). ``nbytes`` None or 0 removes the limit. With growth off, the preallocated
    amount follows the limit."""
    from .heap import _conf_lock, _created_default_heaps, _parse_conf, _update_env_conf, default_heap

    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)):
        raise TypeError("nbytes must be an int or None, not %s" % type(nbytes).__name__)
    if nbytes is not None and nbytes < 0:
        raise ValueError("nbytes must be >= 0, got %d" % nbytes)
    nbytes = nbytes or 0
    if device is not None:
        default_heap(device).set_limit(nbytes)
        return
    with _conf_lock:  # a heap created meanwhile gets either the new limit or set_limit
        updates = {"limit": str(nbytes) if nbytes else "none"}
        if _parse_conf(os.environ.get("CUMA_CONF")).get("growth", "on").lower() in ("off", "false", "0", "no"):
            if not nbytes:
                raise ValueError("set_memory_limit(None): growth is off, which needs a size to preallocate")
            updates["preallocate"] = str(nbytes)
        existing = _created_default_heaps()
        _update_env_conf(updates)
        for d in existing:
            default_heap(d).set_limit(nbytes)
