"""cuma.adaptive on CPU PyTorch: out-of-memory is simulated by a model wrapper that raises
PyTorch's OOM error when a batch holds more elements than a limit."""

import pytest

import cuma
from cuma import adaptive

torch = pytest.importorskip("torch")
nn = torch.nn

OOM_TYPE = getattr(torch.cuda, "OutOfMemoryError", None)


def oom_error(numel):
    msg = "CUDA out of memory. Tried to allocate %d elements (simulated)" % numel
    return OOM_TYPE(msg) if OOM_TYPE is not None else RuntimeError(msg)


class OomAbove(nn.Module):
    """nn.Linear that "runs out of memory" when its input has more than `limit` elements."""

    def __init__(self, inp, out, limit, plain_runtime_error=False):
        super().__init__()
        self.lin = nn.Linear(inp, out)
        self.limit = limit
        self.plain = plain_runtime_error
        self.calls = []

    def forward(self, x):
        self.calls.append(tuple(x.shape))
        if x.numel() > self.limit:
            if self.plain:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise oom_error(x.numel())
        return self.lin(x)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


# --- is_oom ---


def test_is_oom_recognises_every_kind():
    assert adaptive.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB"))
    assert adaptive.is_oom(RuntimeError("HIP OUT OF MEMORY"))
    assert adaptive.is_oom(MemoryError())
    assert adaptive.is_oom(cuma.OutOfMemoryError("out of memory: ...", 2))
    assert adaptive.is_oom(cuma.LimitExceededError("over", 3))
    if OOM_TYPE is not None:
        assert adaptive.is_oom(OOM_TYPE("whatever the text"))
    assert not adaptive.is_oom(RuntimeError("shape mismatch"))
    assert not adaptive.is_oom(ValueError("out of memory"))  # only RuntimeError's text counts
    assert not adaptive.is_oom(cuma.BadPointerError("bad", 4))


# --- safe_forward ---


def test_safe_forward_equals_the_unsplit_run():
    model = OomAbove(16, 8, limit=5 * 16)
    x = torch.randn(37, 16)
    with torch.no_grad():
        want = model.lin(x)
        got = adaptive.safe_forward(model, x)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    ran = [rows for rows, _ in model.calls if rows * 16 <= model.limit]
    assert model.calls[0][0] == 37 and sum(ran) == 37  # every sample exactly once


def test_safe_forward_tuple_inputs_and_outputs():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 3)
            self.b = nn.Linear(6, 2)

        def forward(self, x, scale, bias):
            if x.shape[0] > 4:
                raise oom_error(x.numel())
            return self.a(x) * scale, [self.b(x) + bias]

    model = TwoHeads()
    x = torch.randn(19, 6)
    bias = torch.randn(2)  # not a batch tensor: goes to every piece whole
    with torch.no_grad():
        out = adaptive.safe_forward(model, (x, 2.0, bias))
        want_a, want_b = model.a(x) * 2.0, model.b(x) + bias
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert torch.allclose(out[0], want_a, atol=1e-6) and torch.allclose(out[1][0], want_b, atol=1e-6)


def test_safe_forward_dict_inputs_and_other_dim():
    class Seq(nn.Module):
        def forward(self, tokens):
            if tokens.shape[1] > 3:
                raise RuntimeError("CUDA out of memory (simulated)")
            return tokens.cumsum(0) * 2

    x = torch.randn(5, 11)
    got = adaptive.safe_forward(Seq(), {"tokens": x}, dim=1)
    assert torch.allclose(got, x.cumsum(0) * 2)


def test_safe_forward_reraises_other_errors_unchanged():
    err = ValueError("not a memory problem")

    def model(x):
        raise err

    with pytest.raises(ValueError) as ei:
        adaptive.safe_forward(model, torch.ones(8, 2))
    assert ei.value is err

    class FailsWhenSmall(nn.Module):
        def forward(self, x):
            if x.shape[0] > 2:
                raise oom_error(x.numel())
            raise KeyError("after splitting")

    with pytest.raises(KeyError, match="after splitting"):
        adaptive.safe_forward(FailsWhenSmall(), torch.ones(8, 2))


def test_safe_forward_oom_at_min_batch_is_raised():
    model = OomAbove(4, 4, limit=0, plain_runtime_error=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        adaptive.safe_forward(model, torch.ones(8, 4), min_batch=2)
    assert min(s[0] for s in model.calls) == 2  # went down to min_batch, no further


ORIGINALS = set()


class OnlyOnCopies(nn.Module):
    """Always out of memory, except in a copy (the CPU fallback's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("offset", torch.ones(3))
        ORIGINALS.add(id(self))

    def forward(self, x):
        if id(self) in ORIGINALS:
            raise oom_error(x.numel())
        return self.lin(x) + self.offset


def test_safe_forward_cpu_fallback_uses_a_copy():
    model = OnlyOnCopies()
    params_before = [p for p in model.parameters()]
    weight_before = model.lin.weight.detach().clone()
    x = torch.randn(6, 4)
    released = []
    with torch.no_grad():
        got = adaptive.safe_forward(model, x, min_batch=3, cpu_fallback=True, release=lambda: released.append(1))
        want = model.lin(x) + model.offset
    assert torch.allclose(got, want, atol=1e-6)
    assert [p for p in model.parameters()] == params_before  # same objects: not mutated
    assert torch.equal(model.lin.weight, weight_before)
    assert released  # the cache was emptied between tries


def test_safe_forward_argument_checks():
    with pytest.raises(ValueError, match="no tensor"):
        adaptive.safe_forward(lambda x: x, (1, 2))
    with pytest.raises(TypeError, match="model must be callable"):
        adaptive.safe_forward(5, torch.ones(2))
    with pytest.raises(ValueError, match="min_batch must be >= 1"):
        adaptive.safe_forward(lambda x: x, torch.ones(2), min_batch=0)


# --- find_batch_size ---


def make_step(threshold, log=None):
    def step(bs):
        if log is not None:
            log.append(bs)
        x = torch.ones(bs, 4)
        if bs > threshold:
            raise oom_error(x.numel())
        return x.sum()

    return step


@pytest.mark.parametrize("threshold, start", [(37, 1), (37, 5), (64, 1), (1, 1), (1000, 3), (5, 5)])
def test_find_batch_size_finds_exactly_the_threshold(threshold, start):
    log, released = [], []
    got = adaptive.find_batch_size(make_step(threshold, log), start, release=lambda: released.append(1))
    assert got == threshold
    assert len(released) == len(log)  # released between every try
    assert len(log) <= 2 * threshold.bit_length() + 2  # doubling + bisection, not a scan


def test_find_batch_size_respects_limit():
    assert adaptive.find_batch_size(make_step(100), 1, limit=20, release=lambda: None) == 20
    assert adaptive.find_batch_size(make_step(13), 1, limit=20, release=lambda: None) == 13


def test_find_batch_size_start_fails():
    with pytest.raises(RuntimeError, match="even the start batch size 8") as ei:
        adaptive.find_batch_size(make_step(4), 8, release=lambda: None)
    assert adaptive.is_oom(ei.value.__cause__)


def test_find_batch_size_non_oom_propagates():
    def step(bs):
        if bs > 4:
            raise ZeroDivisionError("bug in the step")

    with pytest.raises(ZeroDivisionError):
        adaptive.find_batch_size(step, 1, release=lambda: None)


def test_find_batch_size_default_release_is_gc():
    assert adaptive.find_batch_size(make_step(6), 1) == 6


# --- DynamicBatcher ---


def seq_loader(n_batches, batch, lengths):
    """Batches of (ids, tokens): ids name each sample, tokens grow to a new length."""
    sid = 0
    for i in range(n_batches):
        L = lengths(i)
        ids = torch.arange(sid, sid + batch)
        sid += batch
        yield ids, torch.ones(batch, L)


def test_dynamic_batcher_survives_sequence_length_growth():
    model = OomAbove(1, 1, limit=1024)
    seen = []
    batcher = adaptive.DynamicBatcher(
        seq_loader(20, 32, lambda i: 8 if i < 10 else 128), batch_size=32, grow_after=4, release=lambda: None
    )
    for ids, tokens in batcher:
        with batcher.step():
            if tokens.numel() > model.limit:
                raise oom_error(tokens.numel())
            seen.append(ids)
    got = torch.cat(seen).tolist()
    assert sorted(got) == list(range(20 * 32)) and len(got) == len(set(got))  # each once
    assert batcher.num_ooms >= 2 and batcher.batch_size * 128 <= 1024 * 1.25 + 128
    assert batcher.num_steps == len(seen)


def test_dynamic_batcher_grows_back_when_memory_allows():
    room = {"ok": False}
    limit = {"n": 8}
    batcher = adaptive.DynamicBatcher(
        [torch.arange(i * 32, i * 32 + 32) for i in range(40)],
        batch_size=32,
        grow_after=3,
        free_memory_fn=lambda: room["ok"],
        release=lambda: None,
    )
    sizes, seen = [], []
    for b in batcher:
        with batcher.step():
            if len(b) > limit["n"]:
                raise oom_error(len(b))
            sizes.append(len(b))
            seen.append(b)
        if len(sizes) == 12:
            limit["n"] = 32  # memory freed elsewhere
        if len(sizes) == 20:
            room["ok"] = True
    assert max(sizes[:12]) <= 8 and batcher.batch_size > 8 and max(sizes) > 8
    assert sorted(torch.cat(seen).tolist()) == list(range(40 * 32))


def test_dynamic_batcher_report_oom_and_min_batch():
    data = [list(range(10))]  # one batch, a list of samples
    batcher = adaptive.DynamicBatcher(data, batch_size=10, min_batch=2, release=lambda: None)
    out = []
    for b in batcher:
        if len(b) > 3:
            batcher.report_oom()
            continue
        out.append(b)
    assert sum(out, []) == list(range(10)) and all(len(b) <= 3 for b in out)
    assert batcher.batch_size == 2

    batcher = adaptive.DynamicBatcher([list(range(4))], batch_size=4, min_batch=2, release=lambda: None)
    with pytest.raises(RuntimeError, match="minimum batch size 2"):
        for b in batcher:
            batcher.report_oom()


def test_dynamic_batcher_step_reraises_at_min_and_passes_other_errors():
    batcher = adaptive.DynamicBatcher([torch.ones(4, 2)], batch_size=4, release=lambda: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        for b in batcher:
            with batcher.step():
                raise RuntimeError("CUDA out of memory (always)")
    batcher = adaptive.DynamicBatcher([torch.ones(4, 2)], batch_size=4, release=lambda: None)
    with pytest.raises(IndexError):
        for b in batcher:
            with batcher.step():
                raise IndexError("a bug")


def test_dynamic_batcher_splits_fields_and_dicts_together():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    batcher = adaptive.DynamicBatcher(
        [(x, y), {"x": x, "y": y, "meta": "run-1"}], batch_size=4, release=lambda: None
    )
    got = list(batcher)
    assert [type(b) for b in got] == [tuple, tuple, dict, dict]
    assert torch.equal(got[0][0], x[:4]) and torch.equal(got[1][1], y[4:])
    assert torch.equal(got[3]["x"], x[4:]) and got[3]["meta"] == "run-1"


def test_dynamic_batcher_list_of_variable_length_samples():
    seqs = [torch.ones(n) for n in (3, 5, 2, 7, 1)]
    got = list(adaptive.DynamicBatcher([seqs], batch_size=2, release=lambda: None))
    assert [len(b) for b in got] == [2, 2, 1]
    assert [t.shape[0] for b in got for t in b] == [3, 5, 2, 7, 1]


def test_dynamic_batcher_argument_checks():
    with pytest.raises(ValueError, match="min_batch 8 is above batch_size 4"):
        adaptive.DynamicBatcher([], batch_size=4, min_batch=8)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        adaptive.DynamicBatcher([], batch_size=4.0)
    with pytest.raises(ValueError, match="max_batch 2 is below batch_size 4"):
        adaptive.DynamicBatcher([], batch_size=4, max_batch=2)


# --- TensorFlow vocabulary ---


def test_set_memory_limit_and_growth(monkeypatch):
    import os

    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M")
    with pytest.raises(ValueError, match="set_memory_limit"):
        adaptive.set_memory_growth(False)
    adaptive.set_memory_limit(64 << 20)
    adaptive.set_memory_growth(False)
    conf = os.environ["CUMA_CONF"]
    assert "growth:off" in conf and "preallocate:%d" % (64 << 20) in conf and "capacity:256M" in conf
    s = cuma.default_heap(0).stats()
    assert s["limit_bytes"] == 64 << 20 and s["reserved_bytes"] == 64 << 20  # preallocated
    with pytest.raises(RuntimeError, match="already exist"):
        adaptive.set_memory_growth(True)
    adaptive.set_memory_limit(32 << 20)  # existing heaps follow at once
    assert cuma.default_heap(0).stats()["limit_bytes"] == 32 << 20
    cuma.shutdown_default_heaps()
    adaptive.set_memory_growth(True)
    assert "preallocate" not in os.environ["CUMA_CONF"]
    adaptive.set_memory_limit(None)
    assert "limit:none" in os.environ["CUMA_CONF"]
    adaptive.set_memory_limit(16 << 20, device=1)
    assert cuma.default_heap(1).stats()["limit_bytes"] == 16 << 20
    with pytest.raises(TypeError):
        adaptive.set_memory_growth("yes")
    with pytest.raises(ValueError):
        adaptive.set_memory_limit(-1)
