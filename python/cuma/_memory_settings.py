# SPDX-License-Identifier: Apache-2.0
"""TensorFlow's vocabulary for the default heaps: set_memory_growth and set_memory_limit,
written into the default heaps' settings for heaps created from now on (and, for the limit,
set on the heaps that exist). Those settings start from CUMA_CONF and replace it for the
default heaps only: CUMA_CONF itself, every Heap(...) and child processes are left as they are.
Re-exported by :mod:`cuma.adaptive`. cuma.heap is imported only when one is called.
"""


def set_memory_growth(enabled):
    """TensorFlow's ``set_memory_growth`` for the default heaps created from now on.

    True (cuma's default): memory is taken from the device as needed (growth:on). False:
    the heap maps its whole allowance at creation and never grows (growth:off with
    preallocate = the limit), which needs a size: call :func:`set_memory_limit` first.
    Like TensorFlow, it cannot change heaps that already exist: RuntimeError."""
    from . import heap
    from .heap import _conf_lock, _created_default_heaps, _conf_value, _default_conf, _update_default_conf

    if not isinstance(enabled, bool):
        raise TypeError("enabled must be True or False, not %r" % (enabled,))
    with _conf_lock:  # no default heap may appear between the check and the new settings
        if _created_default_heaps() or heap._settings_fixed_by is not None:
            raise RuntimeError(
                "set_memory_growth: the default heaps already exist (or %s fixed their settings); memory "
                "growth must be set before the first allocation" % (heap._settings_fixed_by or "nothing")
            )
        if enabled:
            _update_default_conf({"growth": "on"}, removals=("preallocate",))
            return
        limit = _conf_value(_default_conf(), "limit")
        if limit is None:
            raise ValueError(
                "set_memory_growth(False) needs the amount to preallocate: call set_memory_limit(bytes) first"
            )
        _update_default_conf({"growth": "off", "preallocate": str(limit)})


def set_memory_limit(nbytes, device=None):
    """TensorFlow's ``memory_limit``: a hard limit on the memory a default heap holds.

    ``device=None``: becomes the ``limit`` of default heaps created from now on (not of any
    Heap(...), nor CUMA_CONF) and is set on every default heap that exists (cuma_set_limit; cache beyond it goes back at once,
    live memory stays until freed). With a device: that device's heap only (created if
    needed). ``nbytes`` None or 0 removes the limit. With growth off, the preallocated
    amount follows the limit."""
    from .heap import _conf_lock, _created_default_heaps, _conf_value, _default_conf, _update_default_conf, default_heap

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
        if not _conf_value(_default_conf(), "growth"):
            if not nbytes:
                raise ValueError("set_memory_limit(None): growth is off, which needs a size to preallocate")
            updates["preallocate"] = str(nbytes)
        existing = _created_default_heaps()
        _update_default_conf(updates)
        for d in existing:
            default_heap(d).set_limit(nbytes)
