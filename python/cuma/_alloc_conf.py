# SPDX-License-Identifier: Apache-2.0
"""PYTORCH_CUDA_ALLOC_CONF in cuma's terms, for cuma.torch.enable().

A program tuned for PyTorch's own allocator often carries PYTORCH_CUDA_ALLOC_CONF (for example
``expandable_segments:True,max_split_size_mb:128``). Under cuma PyTorch's caching allocator is
not used, so those options would silently do nothing; enable() translates the ones that have a
cuma equivalent into cuma settings and warns, once per option, about the others, saying why.

=================================  ============================================================
PyTorch option                     under cuma
=================================  ============================================================
expandable_segments:True           nothing to set: cuma always maps pages into one reserved
                                   virtual range (the vmm backend), which is what expandable
                                   segments do
expandable_segments:False          nothing to set (PyTorch's default); ``backend:segment`` gives
                                   cudaMalloc-sized segments like PyTorch's native allocator
per_process_memory_fraction:F      ``memory_fraction:F``
garbage_collection_threshold:T     warned: no such setting; cuma gives idle pages back after
                                   ``release_delay_ms`` (1 s) and releases its cache before an
                                   allocation fails, which is what the threshold is for
max_split_size_mb:N                warned: not needed; blocks are placed in a virtual range and
                                   only pages under live bytes are mapped, so large free blocks
                                   do not fragment the device
roundup_power2_divisions,          warned: cuma's policies round sizes their own way (``policy``)
max_non_split_rounding_mb
backend:native                     nothing to set
backend:cudaMallocAsync            warned: cuma replaces the allocator, so CUDA's stream-ordered
                                   pool is not used
pinned_use_cuda_host_register,     left to PyTorch: they configure PyTorch's pinned host memory
pinned_num_register_threads,       allocator, which cuma does not replace
pinned_use_background_threads
stream_order                       warned: a cuma setting, read from enable()'s settings or
                                   CUMA_CONF only
anything else                      warned: unknown to cuma
=================================  ============================================================

Settings given to enable() or in CUMA_CONF win over translated ones.

enable() also sets ``stream_order:on`` unless those settings name ``stream_order``: PyTorch's
contract is stream-ordered. Its allocator hook gets the current stream, a tensor's memory is
used on the stream it was allocated on, and a program that uses it on another stream must order
that stream after the allocation's (an event, wait_stream) and call record_stream before the
free, as PyTorch's own allocator reuses a block on its stream with no wait. So cuma may back a
PyTorch allocation with a page whose earlier work is still pending on another stream once the
allocation's stream waits for that work on the device (the host does not wait); memory that must
be ready on every stream at once (cudaMalloc's) is not what PyTorch asks for.
"""

import warnings

# What enable() sets under the caller's settings (see the note above).
TORCH_DEFAULTS = ("stream_order:on",)

_DEFAULT_KEYS = tuple(d.partition(":")[0] for d in TORCH_DEFAULTS)
_PINNED = ("pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads")
_ROUNDING = ("roundup_power2_divisions", "max_non_split_rounding_mb")


def _true(v):
    return v.strip().lower() in ("true", "1", "yes", "on")


def _items(text):
    """PYTORCH_CUDA_ALLOC_CONF's options: split at the commas outside brackets, as PyTorch's
    parser does for list values such as roundup_power2_divisions:[256:1,512:2,>:8]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def translate(text):
    """(settings, notes): the cuma settings ("key:value" strings) that PYTORCH_CUDA_ALLOC_CONF
    ``text`` maps to, and one sentence for each option that has no effect under cuma."""
    settings, notes = [], []
    for item in _items(text or ""):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments" and sep and value.lower() in ("true", "false", "1", "0"):
            continue  # cuma's vmm backend already maps pages into one virtual range
        if key == "per_process_memory_fraction" and sep:
            try:
                f = float(value)
            except ValueError:
                f = -1.0
            if 0.0 < f <= 1.0:
                settings.append("memory_fraction:%s" % value)
            else:
                notes.append("%s: %r is not a fraction between 0 and 1; ignored" % (key, value))
            continue
        if key == "garbage_collection_threshold":
            notes.append(
                "%s has no cuma setting: cuma gives idle pages back after release_delay_ms (default 1 s) "
                "and releases its cache before an allocation fails; ignored" % key
            )
        elif key == "max_split_size_mb":
            notes.append(
                "%s is not needed under cuma: blocks lie in one virtual range and only pages under live "
                "bytes are mapped, so large free blocks do not fragment the device; ignored" % key
            )
        elif key in _ROUNDING:
            notes.append("%s has no cuma setting: cuma's policies round sizes their own way; ignored" % key)
        elif key == "backend" and value == "native":
            pass
        elif key == "backend" and value == "cudaMallocAsync":
            notes.append("backend:cudaMallocAsync: cuma replaces the allocator, so CUDA's stream-ordered pool "
                         "is not used; ignored")
        elif key in _PINNED:
            pass  # PyTorch's pinned host allocator reads these; cuma does not replace it
        elif key in _DEFAULT_KEYS:
            notes.append(
                "%r is a cuma setting, which cuma does not read from PYTORCH_CUDA_ALLOC_CONF: pass it "
                "to enable() or set it in CUMA_CONF; ignored" % item
            )
        else:
            notes.append("%r is not an option cuma knows; ignored" % item)
    return settings, notes


def _keys(conf):
    return {part.partition(":")[0].strip() for part in (conf or "").split(",") if part.strip()}


def merge(translated, conf):
    """``conf`` (the caller's settings, which win) with the translated settings whose keys it
    does not set put first; None when both are empty."""
    own = _keys(conf)
    extra = [s for s in translated if s.partition(":")[0] not in own]
    parts = extra + ([conf] if conf else [])
    return ",".join(parts) if parts else None


def apply(env, conf, defaults=TORCH_DEFAULTS):
    """The settings enable() uses: ``conf`` or, when it is None, CUMA_CONF, with
    PYTORCH_CUDA_ALLOC_CONF's translatable options and ``defaults`` added where it does not set
    their keys; warns (RuntimeWarning) about the others. Returns ``conf`` unchanged when there
    is nothing to add."""
    text = env.get("PYTORCH_CUDA_ALLOC_CONF")
    translated = []
    if text:
        translated, notes = translate(text)
        for n in notes:
            warnings.warn("cuma.torch.enable(): PYTORCH_CUDA_ALLOC_CONF " + n, RuntimeWarning, stacklevel=3)
    base = conf if conf is not None else env.get("CUMA_CONF")
    own = _keys(base) | {t.partition(":")[0] for t in translated}
    added = translated + [d for d in defaults if d.partition(":")[0] not in own]
    if not added:
        return conf
    return merge(added, base)
