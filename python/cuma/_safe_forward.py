# SPDX-License-Identifier: Apache-2.0
"""safe_forward: a forward pass that survives out-of-memory by splitting its batch, with what
only it needs: finding the tensors in its inputs and calling the model with them, joining the
pieces' outputs into the unsplit run's output (or refusing where no joined value would be
it), and the CPU copy of the model for ``cpu_fallback``.

The batch plan and the split itself come from :mod:`cuma._batch`, shared with
DynamicBatcher. PyTorch is imported only when safe_forward is called. Re-exported by
:mod:`cuma.adaptive` (the private helpers too: the tests reach ``adaptive._cpu_copy``).
"""

import collections
import copy
import itertools
import sys
import warnings

from ._batch import _is_array, _is_record, _most_common, _plan_dim, _positive_int, _rebuild, _split
from ._oom import is_oom, release_memory


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
