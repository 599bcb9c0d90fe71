# SPDX-License-Identifier: Apache-2.0
"""Tensors in cuma memory that cuma.torch can move: compact(), pool_buffers() and empty().

A tensor's storage is one cuma block (its data pointer is the block's address): PyTorch's own
storages under cuma.torch.enable(), or storages this module made over a block (empty(), the
new places of compact(), pool blocks). Such a storage keeps an owner object alive that frees the
block when the storage dies; moving the block disowns the old owner (cuma frees the old place
itself) and gives the new storage a new owner. PyTorch's storages free through
cuma_torch_free, so before one dies after its move the shim is told to skip that free
(cuma_torch_disown).

A storage moves only when every tensor that holds it is one the caller named (parameters,
their gradients, buffers, optimizer state, plain tensors): each of those is rebound with
``tensor.data = ...``, which keeps the Python objects (and so the optimizer's and the module's
references) valid. A view, a saved activation or a storage object held elsewhere would still
point at the old place, so a block with such a holder is refused and stays where it is.

PyTorch is imported lazily, on the first call.
"""

import ctypes
import weakref

from . import _lib

_owners = weakref.WeakValueDictionary()  # block address -> _Owner of a storage made here
_refs_ok = None  # _refs_readable()'s answer once known (False: counts unreadable)


def _torch():
    import torch

    return torch


class _Owner:
    """Frees one block (``release(addr)``) when the storage made over it dies."""

    __slots__ = ("addr", "release", "heap", "__weakref__")

    def __init__(self, addr, release, heap):
        self.addr, self.release, self.heap = addr, release, heap

    def __del__(self):
        rel, self.release = self.release, None
        if rel is not None:
            try:
                rel(self.addr)
            except Exception:
                pass  # the heap (or pool) is closed: it freed the block with it


class _CudaBlock:
    """A device block as __cuda_array_interface__ for torch.as_tensor, which keeps it (and so
    its owner) alive as long as the storage."""

    def __init__(self, addr, nbytes, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 2, "strides": None}


def _heap_device(heap):
    """The torch device a heap's addresses are memory of: the CPU for the simulated device
    with host backing (its device addresses are host memory), else the CUDA device."""
    torch = _torch()
    s = heap.stats()
    if s.get("backend", "").startswith("sim"):
        if not s.get("config", {}).get("host_backing"):
            raise ValueError("cuma.torch: a simulated heap's addresses are memory only with host_backing:on")
        return torch.device("cpu")
    return torch.device("cuda", heap.device)


def _wrap(addr, nbytes, device, owner=None):
    """A uint8 tensor over nbytes at addr; it keeps `owner` alive (None: not owning)."""
    torch = _torch()
    if device.type == "cpu":
        arr = (ctypes.c_uint8 * nbytes).from_address(addr)
        arr.owner = owner  # frombuffer keeps arr, so the owner, alive with the storage
        return torch.frombuffer(arr, dtype=torch.uint8)
    return torch.as_tensor(_CudaBlock(addr, nbytes, owner), device=device)


def _adopt(addr, nbytes, device, release, heap):
    """An owning uint8 tensor over the block at addr, registered as movable."""
    owner = _Owner(addr, release, heap)
    try:
        base = _wrap(addr, nbytes, device, owner)
    except BaseException:
        owner.release = None  # the caller still owns the block
        raise
    _owners[addr] = owner
    return base


def empty(size, dtype=None, heap=None):
    """A new tensor of shape `size` whose storage is one block of `heap` (a :class:`cuma.Heap`;
    default: device 0's default heap), freed to it when the storage dies. On the simulated
    device with host_backing:on it is a CPU tensor over the host memory behind the block (what
    the tests use to run compact() without a GPU); on a CUDA heap a CUDA tensor."""
    torch = _torch()
    if heap is None:
        from .heap import default_heap

        heap = default_heap(0)
    if isinstance(size, int):
        size = (size,)
    dtype = dtype or torch.get_default_dtype()
    n = 1
    for d in size:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    device = _heap_device(heap)
    addr = heap.alloc(max(nbytes, 1))
    try:
        base = _adopt(addr, max(nbytes, 1), device, heap.free, heap)
    except BaseException:
        heap.free(addr)
        raise
    out = torch.empty(0, dtype=dtype, device=device)
    out.data = base[:nbytes].view(dtype).view(size)  # not a view of base: base does not stay
    return out


def _storage(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


def _use_count(st):
    f = getattr(_torch()._C, "_storage_Use_Count", None)
    if f is not None:
        return f(st._cdata)
    # Older PyTorch: c10::intrusive_ptr_target is a vtable pointer, then the reference count.
    return ctypes.c_size_t.from_address(st._cdata + ctypes.sizeof(ctypes.c_void_p)).value


def _refs_readable():
    """How many references a storage object we hold adds to its use count (0 where PyTorch
    keeps the Python object with the storage, 1 where the object holds one), or None when the
    count does not tell the holders (a view must add exactly one)."""
    global _refs_ok
    if _refs_ok is None:
        _refs_ok = False
        try:
            x = _torch().zeros(4)
            st = _storage(x)
            c1 = _use_count(st)
            v = x.view(2, 2)
            c2 = _use_count(st)
            del v
            if c1 in (1, 2) and c2 == c1 + 1 and _use_count(st) == c1:
                _refs_ok = c1 - 1
        except Exception:
            pass
    return None if _refs_ok is False else _refs_ok


def _known_tensors(objs, optimizer):
    """Every tensor the caller named, once each: parameters and their gradients, buffers,
    optimizer state, plain tensors."""
    torch = _torch()
    out, seen = [], set()

    def add(t):
        if isinstance(t, torch.Tensor) and id(t) not in seen and not t.is_sparse:
            seen.add(id(t))
            out.append(t)

    def add_param(p):
        add(p)
        if p.grad is not None:
            add(p.grad)

    for o in objs:
        if isinstance(o, torch.nn.Module):
            for p in o.parameters():
                add_param(p)
            for b in o.buffers():
                add(b)
        elif isinstance(o, torch.Tensor):
            add_param(o)
        else:
            raise TypeError("cuma.torch.compact: expected modules or tensors, not %s" % type(o).__name__)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                add_param(p)
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    return out


class _Mover:
    """The mover for one heap: moves the blocks of known tensors and rebinds them."""

    def __init__(self, heap, groups):
        self.heap = heap
        self.groups = groups  # block address -> [tensors sharing that storage]
        self.rebound = 0
        self.kept = 0  # offered blocks of known tensors that had other holders

    def __call__(self, old, new, size):
        torch = _torch()
        ts = self.groups.pop(old, None)
        if ts is None:
            return False  # not a tensor we were given: nobody could rebind it
        st = _storage(ts[0])
        nbytes = st.nbytes()
        if st.data_ptr() != old or nbytes > size or _use_count(st) != len(ts) + _refs_readable():
            self.kept += 1  # a view, a saved tensor or a storage object elsewhere holds it
            return False
        device = ts[0].device
        old_owner = _owners.get(old)
        if old_owner is None and (device.type != "cuda" or not _cuma_allocates()):
            return False  # not a storage of ours nor of PyTorch's allocator under cuma
        base = _adopt(new, size, device, self.heap.free, self.heap)
        try:
            base[:nbytes].copy_(_wrap(old, nbytes, device))
            if device.type == "cuda":
                # cuma frees the old place on the block's stream once this returns: the copy
                # must not be overtaken by the next user of that memory.
                torch.cuda.current_stream(device).synchronize()
        except BaseException:
            _disown_base(new)  # refused: cuma frees the new place itself
            raise
        if old_owner is None and _lib.lib().cuma_torch_disown(ctypes.c_void_p(old)):
            # PyTorch frees the old place when its storage dies, below; cuma frees it once
            # this returns, so that free must be skipped, and no slot was left for it.
            _disown_base(new)
            return False
        flat = base[:nbytes]
        with torch.no_grad():
            for t in ts:
                t.data = flat.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
        del flat, base
        self.rebound += len(ts)
        if old_owner is not None:
            old_owner.release = None  # cuma frees the old place when this returns
        del st, old_owner  # the last holders of the old storage: it dies here
        if _owners.get(old) is not None:
            gone = False
        else:
            gone = not _lib.lib().cuma_torch_disowned(ctypes.c_void_p(old))
        if not gone:
            # A holder the use count did not show (PyTorch 2 keeps a storage's Python object
            # without counting it): it now sees freed memory.
            import warnings

            warnings.warn("cuma.torch.compact: the old storage of a moved tensor (%#x) is still held "
                          "somewhere (a storage object?); it no longer holds the tensor's values" % old,
                          RuntimeWarning, stacklevel=2)
        return True


def _disown_base(addr):
    owner = _owners.pop(addr, None)
    if owner is not None:
        owner.release = None


def _cuma_allocates():
    from . import torch as ctorch

    return ctorch.is_enabled()


def _heaps_of(tensors, heap):
    if heap is not None:
        return [heap]
    heaps, seen = [], set()
    for t in tensors:
        st = _storage(t)
        owner = _owners.get(st.data_ptr())
        h = owner.heap if owner is not None else None
        if h is None and t.device.type == "cuda" and _cuma_allocates():
            from .heap import default_heap

            h = default_heap(t.device.index or 0)
        if h is not None and id(h) not in seen:
            seen.add(id(h))
            heaps.append(h)
    return heaps


def compact(*modules_or_tensors, optimizer=None, heap=None, if_needed=False):
    """Moves the named tensors' storages out of the pages they alone keep mapped, into dense
    pages, with the heap's compaction (:meth:`cuma.Heap.compact`), and rebinds every tensor
    that held one: parameters (``param.data``), their ``.grad``, buffers, the state of
    `optimizer` (Adam's exp_avg, ...), plain tensors. The Python objects stay the same, so
    the model, the optimizer and your references to them go on working, with identical values.

    A block is moved only when the tensors given are all that hold its storage; one also held
    by a view, a saved activation or a storage object stays where it is (``kept``), as does
    every block of the heap that holds no tensor given. `heap`: the :class:`cuma.Heap` (default:
    the heap of each tensor: the default heap of its CUDA device under
    :func:`cuma.torch.enable`, or the heap of :func:`empty`). With ``if_needed=True`` a heap is
    compacted only while its fragmentation is over its fragmentation_threshold setting (a step
    boundary). Call it between steps, not while the tensors are in use on another thread.

    Returns a dict: blocks_moved, bytes_moved, blocks_refused, pages_emptied, pages_released
    (as :meth:`cuma.Heap.compact`, summed over the heaps), tensors_rebound, kept, and
    fragmentation_before / fragmentation_after (the heaps' stranded share of the memory in use;
    the largest of them)."""
    tensors = _known_tensors(modules_or_tensors, optimizer)
    res = {"blocks_moved": 0, "bytes_moved": 0, "blocks_refused": 0, "pages_emptied": 0,
           "pages_released": 0, "tensors_rebound": 0, "kept": 0,
           "fragmentation_before": 0.0, "fragmentation_after": 0.0}
    heaps = _heaps_of(tensors, heap)
    if _refs_readable() is None:
        import warnings

        warnings.warn("cuma.torch.compact: this PyTorch does not let cuma count a storage's "
                      "holders; nothing is moved", RuntimeWarning, stacklevel=2)
        heaps = []
    groups = {}
    for t in tensors:
        addr = _storage(t).data_ptr()
        if addr:
            groups.setdefault(addr, []).append(t)
    del tensors
    for h in heaps:
        s = h.stats()
        frag = s.get("fragmentation", 0.0)
        res["fragmentation_before"] = max(res["fragmentation_before"], frag)
        if not (if_needed and frag <= s["config"]["fragmentation_threshold"]):
            mover = _Mover(h, dict(groups))
            r = h.compact(mover)
            for k, v in r.items():
                res[k] += v
            res["tensors_rebound"] += mover.rebound
            res["kept"] += mover.kept
        res["fragmentation_after"] = max(res["fragmentation_after"], h.stats().get("fragmentation", 0.0))
    return res


def pool_buffers(module, pool, parameters=False):
    """Places every buffer of `module` (with ``parameters=True`` its parameters too) in a block
    of `pool` (a :class:`cuma.Pool`, ``heap.pool(size, count)``), one block each, copying the
    values and rebinding the tensors (``.data``), which keep their identity. A tensor larger
    than the pool's blocks raises ValueError, a full pool OutOfMemoryError, before any tensor
    moved; one already in the pool stays. Freeing the tensor's storage gives the block back
    to the pool. Returns how many tensors were placed. The pool's blocks never move in a
    compaction and never go back to the device while the pool exists (BN statistics and
    other fixed-size state that lives as long as the model)."""
    torch = _torch()
    ts, seen = [], set()
    for t in list(module.buffers()) + (list(module.parameters()) if parameters else []):
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            ts.append(t)
    bs = pool.block_size
    todo = []
    for t in ts:
        st = _storage(t)
        owner = _owners.get(st.data_ptr())
        if owner is not None and getattr(owner.release, "__self__", None) is pool:
            continue
        if st.nbytes() > bs:
            raise ValueError("cuma.torch.pool_buffers: a tensor of %d bytes does not fit the pool's "
                             "blocks of %d bytes" % (st.nbytes(), bs))
        todo.append(t)
    if len(todo) > pool.count - pool.in_use:
        from .errors import OutOfMemoryError

        raise OutOfMemoryError("cuma.torch.pool_buffers: %d tensors to place, %d free blocks in the pool"
                               % (len(todo), pool.count - pool.in_use))
    heap = pool._heap
    device = _heap_device(heap)
    for t in todo:
        if t.device != device:
            raise ValueError("cuma.torch.pool_buffers: a tensor on %s, the pool's memory is on %s"
                             % (t.device, device))
    for t in todo:
        st = _storage(t)
        nbytes = st.nbytes()
        addr = pool.alloc()
        try:
            base = _adopt(addr, bs, device, pool.free, heap)
        except BaseException:
            pool.free(addr)
            raise
        base[:nbytes].copy_(_wrap(st.data_ptr(), nbytes, device))
        flat = base[:nbytes]
        with torch.no_grad():
            t.data = flat.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
        del st, flat, base
    return len(todo)
