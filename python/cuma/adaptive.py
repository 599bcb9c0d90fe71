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

__all__ = [
    "is_oom",
    "release_memory",
    "find_batch_size",
    "DynamicBatcher",
    "safe_forward",
    "set_memory_growth",
    "set_memory_limit",
]


def is_oom(exc):
    """Whether an exception means "out of memory": torch.cuda.OutOfMemoryError (where this
    PyTorch has it), a RuntimeError whose message says "out of memory" (older PyTorch, other
    libraries), cuma.OutOfMemoryError, and MemoryError."""
    if isinstance(exc, MemoryError):  # cuma.OutOfMemoryError is one too
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        cls = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


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


def find_batch_size(step_fn, start, limit=None, release=None):
    """The largest batch size for which ``step_fn(batch_size)`` runs without running out of
    memory: doubles from ``start`` until a size fails (or ``limit`` is reached), then
    searches between the last size that ran and the first that failed.

    ``release()`` runs between tries (default: :func:`release_memory`). Raises RuntimeError
    (from the OOM) if even ``start`` fails; any error that is not an OOM propagates as is.
    Assumes that if a size fits, every smaller one does."""
    if not callable(step_fn):
        raise TypeError("step_fn must be callable")
    start = _positive_int(start, "start")
    if limit is not None:
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
    while limit is None or good < limit:
        nxt = good * 2 if limit is None else min(good * 2, limit)
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


# --- batch structures: a tensor/array, a tuple/list of them (fields), a dict, or a list of
# samples. Shared by DynamicBatcher (dim 0) and safe_forward (any dim). ---


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "__getitem__") and len(getattr(x, "shape", ())) > 0


def _is_fields(b):
    """A tuple/list whose items are all arrays (or nested field structures) with the same
    leading size is a batch of parallel fields, e.g. (inputs, targets) as a DataLoader
    collates them; any other list (numbers, variable-length sequences) is a list of samples."""
    if not isinstance(b, (tuple, list)) or not b:
        return False
    if not all(_is_array(x) or _is_fields(x) or isinstance(x, dict) for x in b):
        return False
    return len({_batch_len(x) for x in b}) == 1


def _batch_len(b):
    if _is_array(b):
        return int(b.shape[0])
    if isinstance(b, dict):
        for v in b.values():
            n = _batch_len(v)
            if n is not None:
                return n
        return None
    if _is_fields(b):
        return _batch_len(b[0])
    if isinstance(b, (list, tuple)):
        return len(b)
    return None


def _rebuild(template, items):
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # namedtuple
        return type(template)(*items)
    return type(template)(items)


def _take(b, k):
    """(first k samples, the rest) of a batch along dim 0."""
    if _is_array(b):
        return b[:k], b[k:]
    if isinstance(b, dict):
        pairs = {key: _take(v, k) if _batch_len(v) is not None else (v, v) for key, v in b.items()}
        return type(b)((key, p[0]) for key, p in pairs.items()), type(b)((key, p[1]) for key, p in pairs.items())
    if _is_fields(b):
        pairs = [_take(x, k) for x in b]
        return _rebuild(b, [p[0] for p in pairs]), _rebuild(b, [p[1] for p in pairs])
    return b[:k], b[k:]


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

    The source yields batches: a tensor/array (split along dim 0), a tuple/list of tensors
    with the same leading size (parallel fields such as (inputs, targets), split together), a
    dict of tensors (other values go to every piece), or a list of samples (anything else,
    e.g. variable-length sequences). A batch larger than the current size is served in several pieces; pieces are
    never merged across source batches.

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
        self.free_memory_fn = free_memory_fn
        self.grow_after = _positive_int(grow_after, "grow_after")
        self.release = release or release_memory
        self.num_ooms = 0
        self.num_steps = 0
        self._it = None
        self._pending = collections.deque()
        self._last = None
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
            if _batch_len(batch) is None:
                raise TypeError("DynamicBatcher: cannot split a batch of type %s" % type(batch).__name__)
            if _batch_len(batch) > 0:
                self._pending.append(batch)
        unit = self._pending.popleft()
        if _batch_len(unit) > self.batch_size:
            unit, rest = _take(unit, self.batch_size)
            self._pending.appendleft(rest)
        self._last = unit
        self._last_state = None
        return unit

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
        n = _batch_len(self._last)
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


def _split_at(x, dim, n, k):
    """(first k, rest) along dim of every tensor whose size along dim is n; other values go
    to both halves whole."""
    if _is_array(x):
        if len(x.shape) > dim and x.shape[dim] == n:
            lead = (slice(None),) * dim
            return x[lead + (slice(0, k),)], x[lead + (slice(k, n),)]
        return x, x
    if isinstance(x, dict):
        pairs = {key: _split_at(v, dim, n, k) for key, v in x.items()}
        return type(x)((key, p[0]) for key, p in pairs.items()), type(x)((key, p[1]) for key, p in pairs.items())
    if isinstance(x, (tuple, list)):
        pairs = [_split_at(v, dim, n, k) for v in x]
        return _rebuild(x, [p[0] for p in pairs]), _rebuild(x, [p[1] for p in pairs])
    return x, x


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


def _cat(torch, outs, dim):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        devices = {o.device for o in outs}
        if len(devices) > 1:  # a CPU fallback piece that could not go back: all to the CPU
            outs = [o.cpu() for o in outs]
        return torch.cat(outs, dim)
    if isinstance(first, dict):
        return type(first)((k, _cat(torch, [o[k] for o in outs], dim)) for k in first)
    if isinstance(first, (tuple, list)):
        return _rebuild(first, [_cat(torch, [o[i] for o in outs], dim) for i in range(len(first))])
    if first is None:
        return None
    raise TypeError("safe_forward: cannot concatenate outputs of type %s after splitting" % type(first).__name__)


def _cpu_copy(torch, model):
    """A copy of the model on the CPU that never touches the model's device: parameters and
    buffers are copied to the CPU first and handed to deepcopy as already-copied objects, so
    the deepcopy allocates no device memory (a plain deepcopy of a GPU model would, at the
    moment memory is shortest). The user's model is left as it is."""
    if not isinstance(model, torch.nn.Module):
        return model
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in memo:
            continue
        c = t.detach().to("cpu", copy=True)
        if isinstance(t, torch.nn.Parameter):
            c = torch.nn.Parameter(c, requires_grad=t.requires_grad)
        memo[id(t)] = c
    return copy.deepcopy(model, memo)


def safe_forward(model, inputs, min_batch=1, cpu_fallback=False, dim=0, release=None):
    """``model(inputs)`` that survives out-of-memory by splitting the batch.

    ``inputs`` is a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``) or a
    dict (``model(**inputs)``); every tensor in it whose size along ``dim`` equals the
    batch size is split, other values go to every piece whole. On OOM the cache is released
    (``release()``, default :func:`release_memory`), the batch is split in halves, and each
    half is run the same way, down to ``min_batch``. The pieces' outputs (a tensor, or a
    tuple/list/dict of tensors) are joined with torch.cat along ``dim``, so the result equals
    the unsplit run's (up to floating-point summation order in the model).

    With ``cpu_fallback=True`` a piece that runs out of memory at ``min_batch`` runs on a CPU
    copy of the model (made once; the model itself is not moved) and its output is moved back
    to the inputs' device; if even that runs out of memory, the whole result is returned on
    the CPU. Errors that are not OOM propagate unchanged, as does an OOM at ``min_batch``
    without the fallback."""
    import torch

    if not callable(model):
        raise TypeError("model must be callable")
    min_batch = _positive_int(min_batch, "min_batch")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError("dim must be an int >= 0, got %r" % (dim,))
    release = release or release_memory
    tensors = [t for t in _tensors_in(inputs) if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not tensors:
        raise ValueError("safe_forward: inputs hold no tensor with a dimension %d to split along" % dim)
    device = tensors[0].device
    state = {}

    def run_cpu(piece):
        if "cpu_model" not in state:
            state["cpu_model"] = _cpu_copy(torch, model)
        out = _call(state["cpu_model"], _map_tensors(piece, lambda t: t.to("cpu")))
        if device.type == "cpu":
            return out
        try:
            return _map_tensors(out, lambda t: t.to(device))
        except BaseException as e:
            if not is_oom(e):
                raise
        return out  # stays on the CPU; _cat moves the other pieces there too

    def attempt(piece, n):
        splittable = n // 2 >= min_batch
        try:
            return _call(model, piece)
        except BaseException as e:
            if not is_oom(e) or (not splittable and not cpu_fallback):
                raise
        release()  # outside the except: the failed attempt's frames are gone
        if not splittable:
            return run_cpu(piece)
        k = (n + 1) // 2
        first, second = _split_at(piece, dim, n, k)
        return _cat(torch, [attempt(first, k), attempt(second, n - k)], dim)

    return attempt(inputs, int(tensors[0].shape[dim]))


# --- TensorFlow's vocabulary ---


def set_memory_growth(enabled):
    """TensorFlow's ``set_memory_growth`` for the default heaps created from now on.

    True (cuma's default): memory is taken from the device as needed (growth:on). False:
    the heap maps its whole allowance at creation and never grows (growth:off with
    preallocate = the limit), which needs a size: call :func:`set_memory_limit` first.
    Like TensorFlow, it cannot change heaps that already exist: RuntimeError."""
    from .heap import _created_default_heaps, _parse_conf, _update_env_conf

    if not isinstance(enabled, bool):
        raise TypeError("enabled must be True or False, not %r" % (enabled,))
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
    from .heap import _created_default_heaps, _parse_conf, _update_env_conf, default_heap

    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)):
        raise TypeError("nbytes must be an int or None, not %s" % type(nbytes).__name__)
    if nbytes is not None and nbytes < 0:
        raise ValueError("nbytes must be >= 0, got %d" % nbytes)
    nbytes = nbytes or 0
    if device is not None:
        default_heap(device).set_limit(nbytes)
        return
    updates = {"limit": str(nbytes) if nbytes else "none"}
    if _parse_conf(os.environ.get("CUMA_CONF")).get("growth", "on").lower() in ("off", "false", "0", "no"):
        if not nbytes:
            raise ValueError("set_memory_limit(None): growth is off, which needs a size to preallocate")
        updates["preallocate"] = str(nbytes)
    existing = _created_default_heaps()
    _update_env_conf(updates)
    for d in existing:
        default_heap(d).set_limit(nbytes)
