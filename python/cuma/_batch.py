# SPDX-License-Identifier: Apache-2.0
"""What a batch is and how it is split: the batch *plans* shared by DynamicBatcher (which
splits along dim 0) and safe_forward (which splits along any dim).

Here are the readings of a batch (a tensor or array, parallel fields, a list of samples, a
nested list read as per-sample values or as default_collate's fields), the batch size they
stand for, the plan worked out once from them, and :func:`_split`, which applies a plan to
cut a batch in two. Both splitters import these from here; :mod:`cuma.adaptive` re-exports
them so that its old private names keep working. Also :func:`_positive_int`, the check
every helper makes of a batch size (and of its other counts). No PyTorch import: a
DataLoader's collate_fn is recognised only when torch.utils.data is already loaded.
"""

import collections
import sys


def _positive_int(v, name):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("%s must be an int, not %s" % (name, type(v).__name__))
    if v < 1:
        raise ValueError("%s must be >= 1, got %d" % (name, v))
    return v


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
