# SPDX-License-Identifier: Apache-2.0
"""cuma.adaptive.MemoryGuard on CPU PyTorch: the pressure comes from a simulated cuma heap
(ballast allocated and freed between steps) or a given free_memory(); the gradients of a guarded
run must be the same, bit for bit, as those of the plain run."""

import copy

import pytest

import cuma
from cuma.adaptive import MemoryGuard

torch = pytest.importorskip("torch")
nn = torch.nn

MB = 1 << 20
OOM_TYPE = getattr(torch.cuda, "OutOfMemoryError", None)


class Block(nn.Module):
    """A transformer-ish MLP block; dropout makes recomputation depend on the RNG state."""

    def __init__(self, width, hidden):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.norm(x + self.drop(self.down(torch.nn.functional.gelu(self.up(x)))))


def make_model(hiddens=(128, 256, 64, 192), width=32):
    torch.manual_seed(7)
    return nn.Sequential(*[Block(width, h) for h in hiddens])


def train(model, steps, before_step=None, seed=11):
    """Runs `steps` SGD steps on fixed data; the gradients of every parameter, every step."""
    torch.manual_seed(seed)
    data = [torch.randn(16, 32) for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for i, x in enumerate(data):
        if before_step:
            before_step(i)
        opt.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def assert_same(a, b):
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert torch.equal(x, y), "step %d, parameter %d: gradients differ" % (step, i)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_gradients_identical_with_pressure_on_and_off(mode):
    """20 steps; a sim heap whose ballast makes memory tight on steps 3-7 and 12-15: the guard
    turns on there and off elsewhere, and every gradient equals the plain run's."""
    model = make_model()
    plain = train(copy.deepcopy(model), 20)
    tight = set(range(3, 8)) | set(range(12, 16))
    with cuma.Heap("backend:sim,capacity:64M,page_size:2M", use_env=False) as heap:
        guard = MemoryGuard(list(model), watermark=16 * MB, heap=heap, mode=mode)
        ballast = []
        seen = []

        def before(i):
            while ballast:
                heap.free(ballast.pop())
            if i in tight:
                ballast.append(heap.alloc(56 * MB))
            if i > 0:  # what the guard did in the step that just ended
                seen.append(guard.stats())
            guard.update()

        guarded = train(model, 20, before)
        seen.append(guard.stats())
        guard.close()
        while ballast:
            heap.free(ballast.pop())
    assert_same(plain, guarded)
    for i, st in enumerate(seen):
        if i in tight:
            assert st["guarded_blocks"] == 4, (i, st)
            assert st["free_bytes"] == 8 * MB
            if mode == "offload":
                assert st["offloaded_bytes"] > 0 and st["recomputed_blocks"] == 0, (i, st)
            else:
                assert st["recomputed_blocks"] == 4 and st["offloaded_bytes"] == 0, (i, st)
        else:
            assert st["guarded_blocks"] == 0, (i, st)
            assert st["offloaded_bytes"] == 0 and st["recomputed_blocks"] == 0, (i, st)


def test_guards_only_as_many_blocks_as_needed_largest_first():
    """Once measured, a shortfall of less than the largest block's activations guards that
    block alone; a little more brings in the next largest; room within the hysteresis changes
    nothing; beyond it, both go back. Offloaded bytes are what the block saved."""
    model = make_model()
    W = 1 * MB
    free = [1 << 40]
    guard = MemoryGuard(list(model), watermark=W, free_memory=lambda: free[0], hysteresis=0.01)
    train(model, 1, lambda i: guard.update())
    assert guard.guarded_blocks() == 0
    sizes = [b["saved_bytes"] for b in guard.stats()["blocks"]]
    assert all(s > 0 for s in sizes), sizes
    total = sum(sizes)
    order = sorted(range(4), key=lambda i: -sizes[i])
    largest, second = order[0], order[1]
    assert largest == 1  # hidden 256: the widest block saves the most
    # free = W + total - need: the peak would leave W - need free.
    free[0] = W + total - (sizes[largest] - 1)
    train(model, 1, lambda i: guard.update())
    st = guard.stats()
    assert [b["mode"] for b in st["blocks"]] == [None, "offload", None, None]
    assert st["offloaded_bytes"] == sizes[largest]
    free[0] = W + total - (sizes[largest] + 1)
    guard.update()
    assert {b["index"] for b in guard.stats()["blocks"] if b["mode"]} == {largest, second}
    margin = int(0.01 * W)
    covered = sizes[largest] + sizes[second]
    free[0] = W + total - (covered - margin // 2)  # less is needed, by less than the margin
    guard.update()
    assert guard.guarded_blocks() == 2
    free[0] = W + total + margin  # nothing needed, with the margin to spare
    guard.update()
    assert guard.guarded_blocks() == 0
    guard.close()


def test_unmeasured_blocks_are_guarded_below_the_watermark():
    model = make_model()
    free = [0]
    guard = MemoryGuard(list(model), watermark=1 * MB, free_memory=lambda: free[0])
    assert guard.update() == 4  # nothing measured yet: every block
    guard.close()
    model = make_model()
    free[0] = 1 * MB
    guard = MemoryGuard(list(model), watermark=1 * MB, free_memory=lambda: free[0])
    assert guard.update() == 0  # at the watermark, unmeasured: measure first
    guard.close()


def oom():
    msg = "CUDA out of memory. Tried to allocate 2.00 MiB (simulated)"
    return OOM_TYPE(msg) if OOM_TYPE is not None else RuntimeError(msg)


def test_run_escalates_after_oom_and_retries():
    """A step that runs out of memory unless 3 blocks are guarded: run() guards 1, then 2, then
    4 (twice as many each time) and the step succeeds on the third retry; other errors pass."""
    model = make_model()
    guard = MemoryGuard(list(model), watermark=0, free_memory=lambda: 1 << 40)
    calls = []
    released = []

    def step():
        calls.append(guard.guarded_blocks())
        if guard.guarded_blocks() < 3:
            raise oom()
        return "done"

    assert guard.run(step, release=lambda: released.append(1)) == "done"
    assert calls == [0, 1, 2, 4] and len(released) == 3
    # Everything guarded and still out of memory: the error comes out.
    with pytest.raises(Exception) as e:
        guard.run(lambda: (_ for _ in ()).throw(oom()), release=lambda: None)
    assert "out of memory" in str(e.value)
    with pytest.raises(ValueError, match="not memory"):
        guard.run(lambda: (_ for _ in ()).throw(ValueError("not memory")))
    guard.close()


def test_close_restores_forward_and_misuse_is_named():
    model = make_model()
    before = [b.forward for b in model]
    guard = MemoryGuard(list(model), watermark=0, free_memory=lambda: 0)
    with pytest.raises(ValueError, match="already has its forward replaced"):
        MemoryGuard([model[0]], watermark=0, free_memory=lambda: 0)
    guard.close()
    assert [b.forward for b in model] == before
    assert all("forward" not in vars(b) for b in model)
    with pytest.raises(RuntimeError, match="closed"):
        guard.update()
    with pytest.raises(ValueError, match="mode"):
        MemoryGuard(list(model), watermark=0, mode="swap")
    with pytest.raises(ValueError, match="given twice"):
        MemoryGuard([model[0], model[0]], watermark=0, free_memory=lambda: 0)
    with pytest.raises(ValueError, match="no blocks"):
        MemoryGuard([], watermark=0)
    with pytest.raises(TypeError, match="callable"):
        MemoryGuard(list(model), watermark=0, free_memory=5)


def test_no_grad_forward_is_untouched():
    model = make_model()
    guard = MemoryGuard(list(model), watermark=1 << 40, free_memory=lambda: 0)
    guard.update()
    with torch.no_grad():
        y = model(torch.randn(4, 32))
    assert guard.stats()["offloaded_bytes"] == 0 and y.shape == (4, 32)
    guard.close()


class FakeHeap:
    """What MemoryGuard reads of a cuma.Heap: its stats."""

    def __init__(self):
        self.s = {
            "limit_bytes": 64 * MB,
            "allocated_bytes": 0,
            "device_free_bytes": 64 * MB,
            "cached_bytes": 0,
            "pressure_asks": 0,
        }

    def stats(self):
        return dict(self.s)


def test_ledger_pressure_guards_one_block_more():
    """Another job asking the heap for memory (pressure_asks grows) guards one block more,
    though free memory is plenty; the device's free memory caps the heap's own room."""
    model = make_model()
    heap = FakeHeap()
    guard = MemoryGuard(list(model), watermark=1 * MB, heap=heap)
    train(model, 1, lambda i: guard.update())
    assert guard.guarded_blocks() == 0 and guard.stats()["free_bytes"] == 64 * MB
    heap.s["pressure_asks"] = 2
    assert guard.update() == 1
    assert guard.update() == 0  # no new asks: back
    heap.s["device_free_bytes"] = 3 * MB
    heap.s["cached_bytes"] = 1 * MB
    guard.update()
    assert guard.stats()["free_bytes"] == 4 * MB
    guard.close()


def test_free_bytes_under_cuma_torch_reads_the_default_heap(monkeypatch):
    """Once cuma.torch.enable() ran, PyTorch's memory_reserved() and memory_allocated() raise
    (the pluggable allocator keeps no statistics): MemoryGuard reads the default heap instead.
    Faked here, as there is no CUDA: a torch.cuda whose statistics raise as PyTorch's do."""
    import cuma._memory_guard as mg

    def no_stats(*a, **k):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    class FakeCuda:
        is_available = staticmethod(lambda: True)
        current_device = staticmethod(lambda: 0)
        mem_get_info = staticmethod(lambda: (1 << 30, 1 << 34))
        memory_reserved = staticmethod(no_stats)
        memory_allocated = staticmethod(no_stats)

    class FakeTorch:
        cuda = FakeCuda

    stats = {"cuma.limit_bytes": 100 * MB, "cuma.allocated_bytes": 70 * MB,
             "cuma.device_free_bytes": 20 * MB, "cuma.cached_bytes": 5 * MB}
    monkeypatch.setattr(mg, "_torch", lambda: FakeTorch)
    monkeypatch.setattr(cuma.torch, "is_enabled", lambda: True)
    monkeypatch.setattr(cuma.torch, "memory_stats", lambda device=0: dict(stats))
    model = make_model()
    guard = MemoryGuard(list(model), watermark=0)
    assert guard.free_bytes() == 25 * MB  # device free + idle, under the limit's 30 MiB
    stats["cuma.device_free_bytes"] = 50 * MB
    assert guard.free_bytes() == 30 * MB  # the limit's
    guard.close()
    # Without cuma enabled the PyTorch figures are read (and here raise, as under the fake).
    monkeypatch.setattr(cuma.torch, "is_enabled", lambda: False)
    guard = MemoryGuard(list(model), watermark=0)
    with pytest.raises(RuntimeError, match="getDeviceStats"):
        guard.free_bytes()
    guard.close()
