# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.compact, pool_buffers and empty on CPU PyTorch: tensors whose storage is the host
memory behind blocks of a simulated heap (host_backing:on), the code path a CUDA heap takes.
A model and its Adam state, scattered one tensor per page between freed temporaries, are
compacted; values stay bit for bit, and training goes on exactly as without compaction."""

import ctypes

import pytest

torch = pytest.importorskip("torch")

import cuma  # noqa: E402
import cuma.torch as ct  # noqa: E402

MB = 1 << 20
CONF = "backend:sim,host_backing:on,tcache:off,capacity:1G,page_size:2M,sim_clock:manual"


def _model():
    torch.manual_seed(0)
    nn = torch.nn
    # Linear(2048, 2048): 16 MiB tensors (too large to move) fill pages densely; the rest are
    # small tensors a training program leaves scattered.
    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 2048),
                         nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 16))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 64, generator=g)


def _step(model, opt, x):
    opt.zero_grad(set_to_none=False)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return float(loss)


def _tensors(model, opt):
    """Every tensor of the training state, in a fixed order (name, tensor)."""
    out = [("p" + n, p) for n, p in model.named_parameters()]
    out += [("g" + n, p.grad) for n, p in model.named_parameters()]
    out += [("b" + n, b) for n, b in model.named_buffers()]
    for i, p in enumerate(model.parameters()):
        for k, v in sorted(opt.state[p].items()):
            if torch.is_tensor(v) and v.numel() > 1:
                out.append(("s%d.%s" % (i, k), v))
    return out


def _scatter(h, model, opt):
    """Moves the training state into h: the large tensors first, side by side, then each small
    one followed by a 1.5 MiB temporary; then frees the temporaries: the small tensors end up
    one per page. Returns how many are small."""
    temps = []
    ts = [t for _, t in _tensors(model, opt)]
    small = [t for t in ts if t.numel() * t.element_size() <= MB]
    for t in [t for t in ts if t.numel() * t.element_size() > MB] + small:
        c = ct.empty(t.shape, dtype=t.dtype, heap=h)
        c.copy_(t)
        t.data = c
        del c
        if t.numel() * t.element_size() <= MB:
            temps.append(h.alloc(3 * MB // 2))
    for p in temps:
        h.free(p)
    h.trim()
    return len(small)


def _snapshot(model, opt):
    return [(n, t.clone()) for n, t in _tensors(model, opt)]


def _same(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), n


def _run(h, compact):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = _data()
    losses = [_step(model, opt, x)]  # creates the gradients and Adam's state
    small = _scatter(h, model, opt)
    r = None
    if compact:
        before = _snapshot(model, opt)
        addrs = {n: t.data_ptr() for n, t in _tensors(model, opt)}
        params = list(model.parameters())
        r = ct.compact(model, optimizer=opt)
        assert list(model.parameters()) == params  # the same objects, now elsewhere
        assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
        moved = [n for n, t in _tensors(model, opt) if t.data_ptr() != addrs[n]]
        assert len(moved) == r["tensors_rebound"] == small
        _same(before, _snapshot(model, opt))
    for _ in range(3):
        losses.append(_step(model, opt, x))
    return losses, _snapshot(model, opt), r, model, opt


def test_compact_model_and_adam_state_then_train_bit_identical():
    with cuma.Heap(CONF, use_env=False) as ha, cuma.Heap(CONF, use_env=False) as hb:
        ref_losses, ref_state, _, ma, oa = _run(ha, compact=False)
        frag_plain = ha.stats()["fragmentation"]
        losses, state, r, mb, ob = _run(hb, compact=True)
        s = hb.stats()
        print("compact:", r, "fragmentation uncompacted %.3f" % frag_plain)
        assert r["fragmentation_before"] > 0.30 and frag_plain > 0.30
        assert r["fragmentation_after"] < 0.05 and s["fragmentation"] < 0.05
        assert r["blocks_moved"] == r["tensors_rebound"] and r["pages_emptied"] > 10
        assert r["kept"] == 0
        assert s["mapped_bytes"] < ha.stats()["mapped_bytes"]
        assert losses == ref_losses
        _same(ref_state, state)
        # The moved storages are blocks of the heap, freed to it when they die.
        live = s["active_allocs"]
        assert live == ha.stats()["active_allocs"]
        del ma, oa, mb, ob, state, ref_state
        assert hb.stats()["active_allocs"] == 0 and ha.stats()["active_allocs"] == 0
        hb.validate()


def test_tensors_held_elsewhere_or_not_named_stay():
    with cuma.Heap(CONF, use_env=False) as h:
        named, other, temps = [], [], []
        for i in range(12):
            t = ct.empty((1000,), heap=h)
            t.copy_(torch.arange(1000.0) + i)
            (named if i % 2 == 0 else other).append(t)
            temps.append(h.alloc(3 * MB // 2))
        for p in temps:
            h.free(p)
        view = named[0][10:20]  # a view only the program knows: named[0] must stay
        addrs = [t.data_ptr() for t in named + other]
        r = ct.compact(*named)
        assert r["kept"] == 1 and r["tensors_rebound"] == len(named) - 1
        assert r["blocks_moved"] == len(named) - 1
        assert r["blocks_refused"] == len(other) + 1  # every other block was offered and kept
        assert named[0].data_ptr() == addrs[0]
        assert [t.data_ptr() for t in other] == addrs[len(named):]
        assert all(t.data_ptr() != a for t, a in zip(named[1:], addrs[1:len(named)]))
        for i, t in enumerate(named + other):
            k = 2 * i if i < len(named) else 2 * (i - len(named)) + 1
            assert torch.equal(t, torch.arange(1000.0) + k)
        assert torch.equal(view, torch.arange(10.0, 20.0))
        del view, named, other, t
        assert h.stats()["active_allocs"] == 0
        h.validate()


def test_compact_if_needed_waits_for_the_threshold():
    with cuma.Heap(CONF, use_env=False) as h:
        dense = ct.empty((64 * MB,), dtype=torch.uint8, heap=h)
        ts = [ct.empty((256,), heap=h)]
        assert h.stats()["fragmentation"] < 0.05  # 1 KiB on a page after 64 MiB
        r = ct.compact(*ts, if_needed=True)
        assert r["blocks_moved"] == 0 and h.stats()["compactions"] == 0
        temps = []
        for _ in range(8):
            temps.append(h.alloc(3 * MB // 2))
            ts.append(ct.empty((256,), heap=h))
        for p in temps:
            h.free(p)
        assert h.stats()["fragmentation"] > 0.05
        r = ct.compact(*ts, if_needed=True)
        assert r["blocks_moved"] > 0 and h.stats()["fragmentation"] < 0.05
        del dense, ts


def test_pool_buffers_places_buffers_in_the_pool():
    with cuma.Heap(CONF, use_env=False) as h:
        torch.manual_seed(0)
        bn, ref = torch.nn.BatchNorm1d(100), torch.nn.BatchNorm1d(100)
        pool = h.pool(1024, 4)
        assert ct.pool_buffers(bn, pool) == 3  # running_mean, running_var, num_batches_tracked
        assert pool.in_use == 3
        lo = min(b.data_ptr() for b in bn.buffers())
        assert all(0 <= b.data_ptr() - lo < 4 * pool.block_size for b in bn.buffers())
        assert ct.pool_buffers(bn, pool) == 0  # already there
        x = torch.randn(16, 100)
        for _ in range(3):
            bn(x)
            ref(x)
        for (n, a), (_, b) in zip(bn.named_buffers(), ref.named_buffers()):
            assert torch.equal(a, b), n
        assert ct.compact(bn, heap=h)["blocks_moved"] == 0  # a pool's blocks never move
        with pytest.raises(cuma.OutOfMemoryError):
            ct.pool_buffers(torch.nn.BatchNorm1d(100), pool)  # 3 more, 1 free block
        with pytest.raises(ValueError, match="does not fit"):
            ct.pool_buffers(torch.nn.BatchNorm1d(1000), pool)
        assert pool.in_use == 3
        n2 = torch.nn.Linear(4, 4, bias=False)  # no buffers; one parameter
        assert ct.pool_buffers(n2, pool) == 0
        assert ct.pool_buffers(n2, pool, parameters=True) == 1 and pool.in_use == 4
        assert n2(torch.ones(1, 4)).shape == (1, 4)
        del bn, n2, a, b
        assert pool.in_use == 0  # the storages gave their blocks back
        pool.close()


def test_empty_is_a_block_of_the_heap():
    with cuma.Heap(CONF, use_env=False) as h:
        t = ct.empty((3, 5), dtype=torch.float64, heap=h)
        assert t.shape == (3, 5) and t.dtype == torch.float64 and t.is_contiguous()
        assert h.block_size(t.data_ptr()) >= 120
        t.fill_(2.5)
        assert ctypes.c_double.from_address(t.data_ptr() + 8 * 14).value == 2.5
        assert h.stats()["active_allocs"] == 1
        del t
        assert h.stats()["active_allocs"] == 0


def test_disowned_pointer_free_is_skipped(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    p = lib.cuma_torch_malloc(4096, 0, None)
    assert p
    h = cuma.default_heap(0)
    assert lib.cuma_torch_disown(ctypes.c_void_p(p)) == 0
    assert lib.cuma_torch_disowned(ctypes.c_void_p(p))
    lib.cuma_torch_free(ctypes.c_void_p(p), 4096, 0, None)
    assert h.block_size(p) >= 4096  # still live: that free was skipped
    assert not lib.cuma_torch_disowned(ctypes.c_void_p(p))
    lib.cuma_torch_free(ctypes.c_void_p(p), 4096, 0, None)
    assert h.stats()["active_allocs"] == 0


def test_a_holder_the_count_misses_gets_a_warning(monkeypatch):
    """The safety net behind the use count (PyTorch 2 does not count a storage's Python object):
    a moved tensor's old storage that does not die with its last known holder is reported."""
    import cuma._torch_place as place

    with cuma.Heap(CONF, use_env=False) as h:
        ts, temps = [], []
        for i in range(3):
            t = ct.empty((1000,), heap=h)
            t.copy_(torch.arange(1000.0) + i)
            ts.append(t)
            temps.append(h.alloc(3 * MB // 2))
        for p in temps:
            h.free(p)
        hidden = ts[0][:10]  # a holder the count below pretends not to see
        extra = place._refs_readable()
        assert extra is not None
        monkeypatch.setattr(place, "_use_count", lambda st: 1 + extra)
        with pytest.warns(RuntimeWarning, match="still held somewhere"):
            r = ct.compact(*ts)
        assert r["blocks_moved"] == 3
        assert all(torch.equal(t, torch.arange(1000.0) + i) for i, t in enumerate(ts))
        del hidden, ts, t  # never read: its memory went back to the heap
        assert h.stats()["active_allocs"] == 0
