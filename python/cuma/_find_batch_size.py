# SPDX-License-Identifier: Apache-2.0
"""find_batch_size: the largest batch size a step runs at without running out of memory,
found by doubling and then bisecting. Re-exported by :mod:`cuma.adaptive`, with
:data:`DEFAULT_BATCH_LIMIT`, its cap when it is given no limit.
"""

from ._batch import _positive_int
from ._oom import is_oom, release_memory

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
