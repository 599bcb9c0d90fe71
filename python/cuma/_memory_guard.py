# SPDX-License-Identifier: Apache-2.0
"""MemoryGuard: keep the saved activations of chosen blocks off the device while memory is
tight (offloaded to the host, or recomputed in the backward pass), and put them back when memory
returns.

Why per block and per step: PyTorch has the mechanisms (saved-tensor hooks, checkpointing) but
each is all or nothing for the run, and costs time (copies, a second forward) even when memory is
plentiful. The guard reads free memory before each step and guards only as many blocks as the
shortfall needs, largest first, measured from what each block saved in earlier steps.
"""

import threading

from ._oom import is_oom, release_memory

OFFLOAD = "offload"
RECOMPUTE = "recompute"
_MODES = (OFFLOAD, RECOMPUTE)


def _torch():
    import torch  # noqa: PLC0415  (lazy: importing cuma does not import torch)

    return torch


_HEAP_FREE_KEYS = ("limit_bytes", "allocated_bytes", "device_free_bytes", "cached_bytes")


def _heap_free(s):
    """What a heap could still hand out: its limit less what is allocated, and no more than the
    device has free plus what the heap holds idle."""
    free = s["limit_bytes"] - s["allocated_bytes"]
    return max(0, min(free, s["device_free_bytes"] + s["cached_bytes"]))


class _Block:
    """One guarded module. mode is None (activations stay where they are), OFFLOAD or
    RECOMPUTE; saved_bytes is what its forward saved for backward when last measured (unguarded
    or offloaded: both see every saved tensor), None before the first measurement."""

    __slots__ = ("module", "forward", "mode", "saved_bytes", "index")

    def __init__(self, module, index):
        self.module = module
        self.forward = module.forward
        self.mode = None
        self.saved_bytes = None
        self.index = index


class MemoryGuard:
    """Guards ``blocks`` (modules of a model) so that at least ``watermark`` bytes stay free at
    each step's peak.

    Each step, call :meth:`update` before the forward pass (or run the step through
    :meth:`run`, which also retries it after an out-of-memory error). update() reads free memory
    and guards as many blocks as needed (largest saved activations first, measured in earlier
    steps), and unguards them when memory returns (``hysteresis``, a share of the watermark,
    keeps it from flapping; see update() for the rule). A guarded block's saved activations are
    copied to ``offload_device`` (``mode="offload"``) and brought back for the backward pass, or
    not kept at all and recomputed then (``mode="recompute"``, torch.utils.checkpoint without
    reentrancy, RNG state preserved). Gradients are the same as without the guard, bit for bit.

    Free memory comes from ``free_memory()`` (a callable returning bytes) when given; else from
    ``heap`` (a :class:`cuma.Heap`: its limit less its allocated bytes, at most what the device
    has free plus the heap's cache, one block more guarded while other jobs ask it for memory
    through the ledger); else from PyTorch's CUDA device (free device memory plus what the
    caching allocator holds unused).

    Parameters and buffers of a block are never offloaded (they stay on the device anyway).
    """

    def __init__(
        self,
        blocks,
        watermark,
        free_memory=None,
        mode=OFFLOAD,
        heap=None,
        offload_device="cpu",
        hysteresis=0.1,
    ):
        if mode not in _MODES:
            raise ValueError("MemoryGuard: mode %r: must be %r or %r" % ((mode,) + _MODES))
        if watermark < 0:
            raise ValueError("MemoryGuard: watermark %r: must be bytes >= 0" % (watermark,))
        if not 0 <= hysteresis < 1:
            raise ValueError("MemoryGuard: hysteresis %r: must be in [0, 1)" % (hysteresis,))
        if free_memory is not None and not callable(free_memory):
            raise TypeError("MemoryGuard: free_memory must be a callable returning bytes")
        blocks = list(blocks)
        if not blocks:
            raise ValueError("MemoryGuard: no blocks to guard")
        self.watermark = int(watermark)
        self.mode = mode
        self.hysteresis = hysteresis
        self.offload_device = offload_device
        self._free_memory = free_memory
        self._heap = heap
        self._pressure_seen = None
        self._lock = threading.Lock()
        self._blocks = []
        seen = set()
        for i, m in enumerate(blocks):
            if id(m) in seen:
                raise ValueError("MemoryGuard: block %d is given twice" % i)
            if "forward" in vars(m):
                raise ValueError(
                    "MemoryGuard: block %d (%s) already has its forward replaced (guarded "
                    "by another MemoryGuard?)" % (i, type(m).__name__)
                )
            seen.add(id(m))
            self._blocks.append(_Block(m, i))
        for b in self._blocks:
            b.module.forward = self._wrap(b)
        self._closed = False
        self._reset_counts()
        self.last_free = None

    # --- the step -------------------------------------------------------------------------

    def free_bytes(self):
        """Free memory now, as update() reads it."""
        if self._free_memory is not None:
            return int(self._free_memory())
        if self._heap is not None:
            return _heap_free(self._heap.stats())
        torch = _torch()
        if not torch.cuda.is_available():
            raise RuntimeError(
                "MemoryGuard: no CUDA device to read free memory from: give free_memory= "
                "(a callable returning bytes) or heap= (a cuma.Heap)"
            )
        from . import torch as cuma_torch  # noqa: PLC0415

        if cuma_torch.is_enabled():
            # PyTorch keeps no statistics for a pluggable allocator (memory_reserved() raises
            # under it): the default heap of the current device says what it holds.
            s = cuma_torch.memory_stats(torch.cuda.current_device())
            return _heap_free({k: s["cuma." + k] for k in _HEAP_FREE_KEYS})
        free, _total = torch.cuda.mem_get_info()
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    def update(self):
        """Reads free memory and guards or unguards blocks for the coming step; returns the
        number of blocks guarded.

        Read between steps, free memory still has room for the step's activations; what must be
        kept off the device is what would leave less than the watermark at the step's peak:
        ``watermark + (all blocks' measured activations) - free``. Blocks are guarded, largest
        first, until their activations cover it, and unguarded, smallest first, while what
        stays guarded still covers it with ``hysteresis * watermark`` to spare. Blocks not
        measured yet are all guarded when free memory is below the watermark itself."""
        self._check_open()
        free = self.free_bytes()
        self.last_free = free
        pressed = self._pressed()
        with self._lock:
            self._reset_counts()
            measured = [b for b in self._blocks if b.saved_bytes is not None]
            need = self.watermark + sum(b.saved_bytes for b in measured) - free
            if free < self.watermark:
                for b in self._blocks:
                    if b.saved_bytes is None and b.mode is None:
                        b.mode = self.mode
            covered = sum(b.saved_bytes for b in measured if b.mode is not None)
            margin = int(self.hysteresis * self.watermark)
            if need > covered or pressed:
                plain = [b for b in measured if b.mode is None]
                for i, b in enumerate(self._largest_first(plain)):
                    if covered >= need and not (pressed and i == 0):
                        break
                    b.mode = self.mode
                    covered += b.saved_bytes
            else:
                guarded = [b for b in measured if b.mode is not None]
                for b in sorted(guarded, key=lambda b: (b.saved_bytes, b.index)):
                    if covered - b.saved_bytes < need + margin:
                        break
                    covered -= b.saved_bytes
                    b.mode = None
            return self.guarded_blocks()

    def escalate(self):
        """After an out-of-memory error: guards twice as many blocks (one at least); False when
        every block was guarded already."""
        self._check_open()
        with self._lock:
            plain = [b for b in self._blocks if b.mode is None]
            if not plain:
                return False
            n = max(1, len(self._blocks) - len(plain))
            for b in self._largest_first(plain)[:n]:
                b.mode = self.mode
            return True

    def run(self, step, *args, retries=3, release=release_memory, **kwargs):
        """Runs ``step(*args, **kwargs)`` (a whole training step: forward, backward, optimizer)
        after update(); after an out-of-memory error, releases memory, escalates and runs it
        again, ``retries`` times at most. The step must be safe to repeat (zero the gradients
        at its start). Other errors, and the last out-of-memory error, pass through."""
        self.update()
        for attempt in range(retries + 1):
            try:
                return step(*args, **kwargs)
            except Exception as e:  # noqa: BLE001  (only out-of-memory is caught)
                if not is_oom(e) or attempt == retries or not self.escalate():
                    raise
            # Outside the except clause: the traceback, and the failed step's tensors, are gone.
            release()
            with self._lock:
                self._reset_counts()
        raise AssertionError("unreachable")

    def stats(self):
        """What the guard did in the step since the last update() (or run()):
        ``offloaded_bytes`` (activations kept off the device), ``recomputed_blocks`` (block
        forwards run again in the backward pass), ``guarded_blocks`` (now), ``free_bytes``
        (read by the last update()), and per block its mode and last measured saved bytes."""
        with self._lock:
            return {
                "offloaded_bytes": self._offloaded,
                "recomputed_blocks": self._recomputed,
                "guarded_blocks": self.guarded_blocks(),
                "free_bytes": self.last_free,
                "watermark": self.watermark,
                "blocks": [
                    {"index": b.index, "mode": b.mode, "saved_bytes": b.saved_bytes}
                    for b in self._blocks
                ],
            }

    def guarded_blocks(self):
        return sum(1 for b in self._blocks if b.mode is not None)

    def close(self):
        """Gives every block its own forward back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for b in self._blocks:
                if vars(b.module).get("forward") is not None:
                    del b.module.forward
                b.mode = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- policy ---------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise RuntimeError("MemoryGuard: closed")

    def _reset_counts(self):
        self._offloaded = 0
        self._recomputed = 0

    def _pressed(self):
        """Whether other jobs asked the heap for memory since the last look (heap= only)."""
        if self._heap is None or self._free_memory is not None:
            return False
        asks = self._heap.stats()["pressure_asks"]
        before, self._pressure_seen = self._pressure_seen, asks
        return before is not None and asks > before

    @staticmethod
    def _largest_first(blocks):
        # Unmeasured blocks first (their size is unknown: guarding them is the safe guess),
        # then by measured bytes; ties keep the model's order.
        return sorted(
            blocks, key=lambda b: (b.saved_bytes is not None, -(b.saved_bytes or 0), b.index)
        )

    # --- the blocks' forward --------------------------------------------------------------

    def _wrap(self, block):
        guard = self

        def forward(*args, **kwargs):
            torch = _torch()
            if not torch.is_grad_enabled() or guard._closed:
                return block.forward(*args, **kwargs)
            mode = block.mode
            if mode == RECOMPUTE:
                return guard._recompute(block, args, kwargs)
            return guard._saving(block, mode == OFFLOAD, args, kwargs)

        forward.__wrapped__ = block.forward
        return forward

    def _own_storage(self, block):
        """Data pointers of the block's parameters and buffers (never offloaded)."""
        ptrs = set()
        for t in list(block.module.parameters()) + list(block.module.buffers()):
            ptrs.add(t.data_ptr())
        return ptrs

    def _saving(self, block, offload, args, kwargs):
        """Runs the block with hooks that measure what it saves for backward and, when
        offloading, keep a copy on offload_device in place of each activation."""
        torch = _torch()
        own = self._own_storage(block)
        total = [0]
        dest = self.offload_device

        def pack(t):
            if t.data_ptr() in own or t.numel() == 0:
                return t
            n = t.numel() * t.element_size()
            total[0] += n
            if not offload:
                return t
            with self._lock:
                self._offloaded += n
            # A copy even when the device is the host already: the same path as on a GPU.
            return (t.device, t.to(dest, copy=True))

        def unpack(p):
            if isinstance(p, tuple):
                device, host = p
                return host.to(device, copy=True)
            return p

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = block.forward(*args, **kwargs)
        block.saved_bytes = total[0]
        return out

    def _recompute(self, block, args, kwargs):
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

        calls = [0]

        def run(*a):
            calls[0] += 1
            if calls[0] > 1:
                with self._lock:
                    self._recomputed += 1
            return block.forward(*a, **kwargs)

        return checkpoint(run, *args, use_reentrant=False)
