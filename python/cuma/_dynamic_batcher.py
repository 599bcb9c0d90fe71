# SPDX-License-Identifier: Apache-2.0
"""DynamicBatcher: serves the batches of a loader in pieces that shrink on out-of-memory and
grow back when memory allows, plus the context manager of its step().

How a batch is read and split (its plan) lives in :mod:`cuma._batch`, shared with
safe_forward; this module holds the batcher's own state: the current size, the pieces still
to serve, what the first list batch said about the source, and the halving asked for by
other jobs. Re-exported by :mod:`cuma.adaptive`.
"""

import collections
import warnings

from ._batch import (
    _SPLIT,
    _collated_size,
    _fields_size,
    _is_array,
    _is_record,
    _most_common,
    _plan_field,
    _positive_int,
    _seal,
    _split,
    _uses_default_collate,
)
from ._oom import is_oom, release_memory


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
