# SPDX-License-Identifier: Apache-2.0
"""cuma.adaptive on CPU PyTorch: out-of-memory is simulated by a model wrapper that raises
PyTorch's OOM error when a batch holds more elements than a limit."""

import warnings

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
    conf = cuma.heap._default_conf()
    assert "growth:off" in conf and "preallocate:%d" % (64 << 20) in conf and "capacity:256M" in conf
    assert os.environ["CUMA_CONF"] == "backend:sim,capacity:256M"  # the environment is left alone
    s = cuma.default_heap(0).stats()
    assert s["limit_bytes"] == 64 << 20 and s["reserved_bytes"] == 64 << 20  # preallocated
    with pytest.raises(RuntimeError, match="already exist"):
        adaptive.set_memory_growth(True)
    adaptive.set_memory_limit(32 << 20)  # existing heaps follow at once
    assert cuma.default_heap(0).stats()["limit_bytes"] == 32 << 20
    cuma.shutdown_default_heaps()
    adaptive.set_memory_growth(True)
    assert "preallocate" not in cuma.heap._default_conf()
    adaptive.set_memory_limit(None)
    assert "limit:none" in cuma.heap._default_conf()
    adaptive.set_memory_limit(16 << 20, device=1)
    assert cuma.default_heap(1).stats()["limit_bytes"] == 16 << 20
    with pytest.raises(TypeError):
        adaptive.set_memory_growth("yes")
    with pytest.raises(ValueError):
        adaptive.set_memory_limit(-1)


# --- is_oom: every wording of "out of memory", and nothing else ---


def test_is_oom_recognises_the_cpu_allocator_and_cuda_libraries():
    try:
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: more than any address space
    except RuntimeError as e:
        real = e
    assert "DefaultCPUAllocator" in str(real) and adaptive.is_oom(real)
    for msg in (
        "DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes.",  # Windows
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
        "CUSOLVER_STATUS_ALLOC_FAILED",
        "cuFFT error: CUFFT_ALLOC_FAILED",
    ):
        assert adaptive.is_oom(RuntimeError(msg)), msg
    for msg in (
        "CUBLAS_STATUS_EXECUTION_FAILED",
        "CUDNN_STATUS_BAD_PARAM",
        "DefaultCPUAllocator: invalid argument",
        "Expected all tensors to be on the same device",
    ):
        assert not adaptive.is_oom(RuntimeError(msg)), msg
    assert not adaptive.is_oom(ValueError("CUBLAS_STATUS_ALLOC_FAILED"))  # text counts on RuntimeError only


def test_is_oom_recognises_torch_out_of_memory_error(monkeypatch):
    class NewOom(RuntimeError):  # torch.OutOfMemoryError of PyTorch >= 2.5 (not in 1.13)
        pass

    monkeypatch.setattr(torch, "OutOfMemoryError", NewOom, raising=False)
    assert adaptive.is_oom(NewOom("no text about memory"))


def test_find_batch_size_on_the_cpu_allocator():
    def step(bs):  # bs * 256 MiB of address space (pages never touched): 2**20 of them is
        torch.empty(bs, 1 << 28, dtype=torch.uint8)  # more than any 48-bit address space

    got = adaptive.find_batch_size(step, 1, release=lambda: None)
    assert 1 <= got < adaptive.DEFAULT_BATCH_LIMIT


# --- find_batch_size's default cap ---


def test_find_batch_size_stops_at_the_default_cap_when_memory_stops_growing():
    tries = []

    def step(bs):  # never more than a 1000-row data set: never out of memory
        tries.append(bs)
        return torch.ones(min(bs, 1000), 4).sum()

    assert adaptive.find_batch_size(step, 8, release=lambda: None) == adaptive.DEFAULT_BATCH_LIMIT
    assert max(tries) == adaptive.DEFAULT_BATCH_LIMIT and len(tries) <= 20
    big = adaptive.DEFAULT_BATCH_LIMIT * 4  # a start above the cap is its own cap
    assert adaptive.find_batch_size(lambda bs: None, big, release=lambda: None) == big


# --- safe_forward: the batch is decided once ---


def test_safe_forward_never_splits_a_shared_tensor_whose_size_equals_a_piece():
    def model(x, scale):
        if x.shape[0] > 4:
            raise oom_error(x.numel())
        assert scale.shape == (8,)  # never cut, at any level
        return x * scale.sum()

    x, scale = torch.ones(16, 8), torch.ones(8)
    got = adaptive.safe_forward(model, (x, scale), release=lambda: None)
    assert torch.equal(got, x * 8.0)

    lin = nn.Linear(6, 8)

    def model2(x, bias):  # bias (8,) broadcast over a piece of 8 rows: must stay whole
        if x.shape[0] > 4:
            raise oom_error(x.numel())
        return lin(x) + bias

    x2, bias = torch.randn(16, 6), torch.randn(8)
    with torch.no_grad():
        assert torch.allclose(adaptive.safe_forward(model2, (x2, bias), release=lambda: None), lin(x2) + bias)


def test_safe_forward_batch_is_the_first_tensors_unless_named():
    def model(temperature, x, mask):
        if x.shape[0] > 4:
            raise oom_error(x.numel())
        return x / temperature * mask

    # The first tensor decides (here a temperature of size 1, which cannot be split): most
    # tensors having another size is said, and batch_size= names the batch.
    t, x, mask = torch.tensor([2.0]), torch.ones(16, 3), torch.ones(16, 1)
    with pytest.warns(UserWarning, match=r"took 1 .* most input tensors have size 16 .* batch_size=16"):
        with pytest.raises(RuntimeError, match="out of memory"):
            adaptive.safe_forward(model, (t, x, mask), release=lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = adaptive.safe_forward(model, (t, x, mask), batch_size=16, release=lambda: None)
    assert torch.equal(got, x / 2.0)
    with pytest.raises(ValueError, match="batch_size 5: no input tensor has that size"):
        adaptive.safe_forward(model, (t, x, mask), batch_size=5)


def test_safe_forward_never_splits_a_shared_bank_that_outnumbers_the_batch():
    """Attention of 4 queries over a shared bank of 8 keys and values: the keys and values
    are the majority, the queries (first) are the batch."""
    q, keys, values = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16)

    def attend(q, k, v):
        if q.shape[0] * k.shape[0] > 16:  # the scores matrix runs out of memory
            raise oom_error(q.shape[0] * k.shape[0])
        return torch.softmax(q @ k.T, -1) @ v

    want = torch.softmax(q @ keys.T, -1) @ values
    with pytest.warns(UserWarning, match="batch_size="):
        got = adaptive.safe_forward(attend, (q, keys, values), release=lambda: None)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named: nothing to say
        got = adaptive.safe_forward(attend, (q, keys, values), batch_size=4, release=lambda: None)
    assert torch.allclose(got, want, atol=1e-6)


def test_safe_forward_oom_after_a_tie_says_which_batch_was_taken():
    bank, q = torch.randn(8, 16), torch.randn(4, 16)

    def model(bank, q):  # the queries are the batch, but the bank comes first: a tie, 1 to 1
        if q.shape[0] > 2:
            raise oom_error(q.numel())
        return q @ bank.T

    with pytest.raises(RuntimeError, match="out of memory") as ei:
        adaptive.safe_forward(model, (bank, q), release=lambda: None)  # the bank split, down to 1
    if hasattr(ei.value, "add_note"):  # Python >= 3.11
        notes = " ".join(getattr(ei.value, "__notes__", []))
        assert "took 8 as the batch size" in notes and "batch_size=" in notes
    got = adaptive.safe_forward(model, (bank, q), batch_size=4, release=lambda: None)
    assert torch.allclose(got, q @ bank.T, atol=1e-6)


# --- safe_forward: outputs without a batch dimension ---


def test_safe_forward_outputs_without_batch_dim():
    lin = nn.Linear(4, 3)

    def per_sample_and_shared(x):
        if x.shape[0] > 4:
            raise oom_error(x.numel())
        return {"logits": lin(x), "weight": lin.weight, "none": None, "k": 3}

    x = torch.randn(8, 4)
    with torch.no_grad():
        out = adaptive.safe_forward(per_sample_and_shared, x, release=lambda: None)
        assert torch.allclose(out["logits"], lin(x), atol=1e-6)
    assert out["weight"] is lin.weight and out["none"] is None and out["k"] == 3  # kept once

    def with_mean(x):
        if x.shape[0] > 4:
            raise oom_error(x.numel())
        logits = lin(x)
        return logits, logits.mean()

    with torch.no_grad():
        a, m = adaptive.safe_forward(with_mean, x[:4], release=lambda: None)  # no split: as is
        assert m.dim() == 0
        with pytest.raises(ValueError, match=r"output\[1\] \(a Tensor of shape \(\)\) is not per-sample"):
            adaptive.safe_forward(with_mean, x, release=lambda: None)


def test_safe_forward_joins_outputs_with_a_flattened_batch_dim():
    V = 5
    emb = nn.Embedding(20, V)

    def lm(ids):
        if ids.shape[0] > 2:
            raise oom_error(ids.numel())
        logits = emb(ids)
        return {"flat": logits.reshape(-1, V), "logits": logits}

    ids = torch.randint(0, 20, (5, 4))  # pieces of 2, 1 and 2 samples: (B*L, V) logits of 8, 4, 8 rows
    with torch.no_grad():
        out = adaptive.safe_forward(lm, ids, release=lambda: None)
        assert torch.equal(out["flat"], emb(ids).reshape(-1, V))
        assert torch.equal(out["logits"], emb(ids))

    def grid(ids):  # B*B rows: 4, 1 and 4 for pieces of 2, 1 and 2, no one multiple
        if ids.shape[0] > 2:
            raise oom_error(ids.numel())
        return {"grid": torch.zeros(ids.shape[0] ** 2, 3)}

    with pytest.raises(ValueError, match=r"output\['grid'\] \(a Tensor of shape \(4, 3\)\) is not per-sample"):
        adaptive.safe_forward(grid, ids, release=lambda: None)


# --- safe_forward(cpu_fallback=True): inference only, and a CPU copy of everything ---


def test_safe_forward_cpu_fallback_refuses_to_train():
    model = OnlyOnCopies()
    x = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match="is for inference") as ei:
        adaptive.safe_forward(model, x, cpu_fallback=True, release=lambda: None)
    assert not adaptive.is_oom(ei.value)
    with torch.no_grad():
        adaptive.safe_forward(model, x, min_batch=3, cpu_fallback=True, release=lambda: None)
    for p in model.parameters():
        p.requires_grad_(False)  # a frozen model cannot be trained wrong
    adaptive.safe_forward(model, x, min_batch=3, cpu_fallback=True, release=lambda: None)
    adaptive.safe_forward(OomAbove(4, 3, limit=1000), x, cpu_fallback=False)  # training without it: fine


def test_safe_forward_cpu_fallback_refuses_only_when_it_would_run():
    """An eval() model called without no_grad: only a piece that would run on the CPU copy
    is refused, when it comes to that."""
    model = OomAbove(4, 3, limit=2 * 4).eval()
    x = torch.randn(6, 4)
    assert torch.allclose(adaptive.safe_forward(model, x[:2], cpu_fallback=True), model.lin(x[:2]))  # no OOM
    got = adaptive.safe_forward(model, x, cpu_fallback=True, release=lambda: None)  # split: enough
    assert got.requires_grad and torch.allclose(got, model.lin(x), atol=1e-6)
    with pytest.raises(RuntimeError, match="is for inference"):
        adaptive.safe_forward(model, x, min_batch=3, cpu_fallback=True, release=lambda: None)


class WithPlainTensors(nn.Module):
    """Tensors kept as plain attributes (not parameters or buffers), as models do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0)
        self.tables = {"shift": torch.ones(4)}
        self.lin.cache = [torch.zeros(4)]  # in a submodule too
        ORIGINALS.add(id(self))

    def forward(self, x):
        if id(self) in ORIGINALS:
            raise oom_error(x.numel())
        return self.lin(x) * self.scale + self.tables["shift"] + self.lin.cache[0]


def test_cpu_copy_copies_plain_tensor_attributes_without_deepcopying_them(monkeypatch):
    """A deepcopy of a device tensor allocates on its device (and leaves the copy there):
    no tensor of the model may reach Tensor.__deepcopy__."""
    model = WithPlainTensors()

    def no_deepcopy(self, memo):
        raise AssertionError("a tensor of the model was deep-copied on its device")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", no_deepcopy)
    c = adaptive._cpu_copy(torch, model)
    assert c.scale is not model.scale and torch.equal(c.scale, model.scale)
    assert c.tables["shift"] is not model.tables["shift"] and c.lin.cache[0] is not model.lin.cache[0]
    assert c.lin.weight is not model.lin.weight and torch.equal(c.lin.weight, model.lin.weight)
    monkeypatch.undo()
    x = torch.randn(4, 4)
    with torch.no_grad():
        got = adaptive.safe_forward(model, x, cpu_fallback=True, release=lambda: None)
        assert torch.allclose(got, model.lin(x) * 2.0 + 1.0, atol=1e-6)


# --- DynamicBatcher: fields or samples ---


def test_dynamic_batcher_collated_list_with_strings_is_fields():
    x = torch.arange(8).view(8, 1)
    names = ["s%d" % i for i in range(8)]
    pieces = list(adaptive.DynamicBatcher([[x, names]], batch_size=3, release=lambda: None))
    assert [type(p) for p in pieces] == [list, list, list]
    assert [p[1] for p in pieces] == [names[:3], names[3:6], names[6:]]
    assert all(p[0].view(-1).tolist() == [int(s[1:]) for s in p[1]] for p in pieces)

    batcher = adaptive.DynamicBatcher([[x, names]], batch_size=8, release=lambda: None)
    served = []
    for b in batcher:
        with batcher.step():
            if len(b[1]) > 4:
                raise oom_error(8)
            served.append(b)
    assert [p[1] for p in served] == [names[:4], names[4:]]
    assert torch.equal(torch.cat([p[0] for p in served]), x)


def test_dynamic_batcher_lists_of_samples_stay_samples():
    # Variable lengths first: lists are samples, so the tail of one sample is not cut.
    loader = [[torch.arange(3), torch.arange(5)], [torch.arange(7)]]
    got = list(adaptive.DynamicBatcher(loader, batch_size=2, release=lambda: None))
    assert [[t.tolist() for t in b] for b in got] == [[[0, 1, 2], [0, 1, 2, 3, 4]], [list(range(7))]]
    # A batch of samples of equal length cannot be told from fields: fields=False says so.
    same = [torch.arange(6) + 10 * i for i in range(5)]
    got = list(adaptive.DynamicBatcher([same], batch_size=2, release=lambda: None, fields=False))
    assert [len(b) for b in got] == [2, 2, 1] and all(t.shape == (6,) for b in got for t in b)
    assert [t[0].item() for b in got for t in b] == [0, 10, 20, 30, 40]
    with pytest.warns(UserWarning, match="pass fields=False"):
        list(adaptive.DynamicBatcher([same], batch_size=2, release=lambda: None))
    # ... and a later list that cannot be fields shows the first guess was wrong: loudly.
    with pytest.warns(UserWarning):
        with pytest.raises(TypeError, match="fields=False"):
            mixed = [same, [torch.arange(2), torch.arange(9)]]
            list(adaptive.DynamicBatcher(mixed, batch_size=2, release=lambda: None))
    # fields=True: a list whose items do not share a size is still fields (others go whole).
    loader = [[torch.arange(4), torch.arange(3)]]
    got = list(adaptive.DynamicBatcher(loader, batch_size=2, release=lambda: None, fields=True))
    assert [b[0].tolist() for b in got] == [[0, 1], [2, 3]] and all(b[1].tolist() == [0, 1, 2] for b in got)
    with pytest.raises(TypeError, match="fields must be"):
        adaptive.DynamicBatcher([], batch_size=2, fields="yes")


def test_dynamic_batcher_with_a_default_collate_dataloader():
    data = torch.utils.data

    class Pairs(data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):  # tuple samples: default_collate gives a *list* of fields
            return torch.full((3,), float(i)), "s%d" % i, ("a%d" % i, "b%d" % i)

    loader = data.DataLoader(Pairs(), batch_size=4)
    batcher = adaptive.DynamicBatcher(loader, batch_size=3, release=lambda: None)
    seen = []
    for x, names, (a, b) in batcher:
        assert x.shape[1] == 3 and len(x) == len(names) == len(a) == len(b) <= 3
        assert [int(s[1:]) for s in names] == [int(v) for v in x[:, 0]] == [int(s[1:]) for s in a]
        seen += names
    assert seen == ["s%d" % i for i in range(10)]

    class Texts(data.Dataset):  # no tensor at all: the fields are lists of strings
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return "q%d" % i, "a%d" % i

    got = list(adaptive.DynamicBatcher(data.DataLoader(Texts(), batch_size=5), batch_size=2, release=lambda: None))
    got = [[list(field) for field in b] for b in got]  # torch 1.13 gives tuples of str, newer lists
    assert got == [[["q0", "q1"], ["a0", "a1"]], [["q2", "q3"], ["a2", "a3"]], [["q4"], ["a4"]]]
    loader = data.DataLoader(["x", "y", "z"], batch_size=3)
    strings = list(adaptive.DynamicBatcher(loader, batch_size=2, release=lambda: None))
    assert strings == [["x", "y"], ["z"]]  # a batch of str samples is the samples themselves


def test_dynamic_batcher_dict_size_comes_from_tensors():
    x = torch.arange(6)
    for b in ({"x": x, "classes": ["cat", "dog", "bird"]}, {"classes": ["cat", "dog", "bird"], "x": x}):
        got = list(adaptive.DynamicBatcher([b], batch_size=2, release=lambda: None))
        assert [p["x"].tolist() for p in got] == [[0, 1], [2, 3], [4, 5]]
        assert all(p["classes"] == ["cat", "dog", "bird"] for p in got)  # per batch: whole
    # A per-batch value whose length equals a *piece's* size is not cut in the rest either.
    b = {"x": torch.arange(6), "y": torch.arange(6), "pair": ["p", "q"], "w": torch.ones(2)}
    got = list(adaptive.DynamicBatcher([b], batch_size=4, release=lambda: None))
    assert [p["x"].tolist() for p in got] == [[0, 1, 2, 3], [4, 5]]
    assert all(p["pair"] == ["p", "q"] and p["w"].shape == (2,) for p in got)


def _fuzz_batches(rnd, kind):
    """Batches of one kind; every sample carries its id (in every field) and a length."""
    src, sid, lengths = [], 0, {}
    for _ in range(rnd.randint(1, 8)):
        n = rnd.randint(0, 24)
        ids = list(range(sid, sid + n))
        sid += n
        L = rnd.choice([1, 2, 3, 5])  # token lengths that often equal piece sizes
        idt = torch.tensor(ids, dtype=torch.long)
        tok = idt.view(-1, 1).repeat(1, L)
        names = ["s%d" % i for i in ids]
        if kind == "tensor":
            src.append(tok)
        elif kind == "tuple":
            src.append((idt, tok))
        elif kind == "collated":
            src.append([idt, names, tok])
        elif kind == "dict":
            src.append({
                "ids": idt, "names": names, "tok": tok, "tag": "run-1",
                "classes": ["c%d" % j for j in range(n + 1)],  # per batch, never per sample
                "scale": torch.ones(n + rnd.choice([1, 2])),  # per batch: another size
            })
        else:  # lists of samples of any lengths, said so with fields=False
            sample_lengths = [rnd.randint(1, 4) for _ in ids]
            lengths.update(zip(ids, sample_lengths))
            src.append([torch.full((m,), i) for i, m in zip(ids, sample_lengths)])
    return src, sid, lengths


def _fuzz_piece_ids(kind, piece, lengths):
    """The ids a piece holds, checking that each sample arrived whole and fields aligned."""
    if kind == "tensor":
        assert all(len(set(row.tolist())) == 1 for row in piece)
        return [row[0].item() for row in piece]
    if kind == "samples":
        assert all(len(t) == lengths[t[0].item()] and len(set(t.tolist())) == 1 for t in piece)
        return [t[0].item() for t in piece]
    if kind == "tuple":
        ids, tok = piece
        names = ["s%d" % i for i in ids.tolist()]
    elif kind == "collated":
        ids, names, tok = piece
    else:
        ids, names, tok = piece["ids"], piece["names"], piece["tok"]
        # Per-batch values come whole: longer than any piece of the batch they belong to.
        assert piece["tag"] == "run-1" and piece["scale"].shape[0] > len(ids)
        assert piece["classes"][0] == "c0" and len(piece["classes"]) > len(ids)
    assert names == ["s%d" % i for i in ids.tolist()] and tok.shape[0] == len(ids)
    assert all((tok[j] == ids[j]).all() for j in range(len(ids)))
    return ids.tolist()


@pytest.mark.parametrize("kind", ["tensor", "tuple", "collated", "dict", "samples"])
def test_dynamic_batcher_fuzz_no_sample_lost_duplicated_or_cut(kind):
    import random

    seed = random.randrange(1 << 30)
    print("fuzz seed", seed)  # shown on failure: rerun with this seed
    rnd = random.Random(seed)
    for _ in range(60):
        src, total, lengths = _fuzz_batches(rnd, kind)
        bs = rnd.randint(1, 16)
        mb = rnd.randint(1, bs)
        batcher = adaptive.DynamicBatcher(
            src, batch_size=bs, min_batch=mb, max_batch=bs + rnd.randint(0, 8), grow_after=rnd.randint(1, 4),
            release=lambda: None, fields=False if kind == "samples" else None,
        )
        seen, report = [], rnd.random() < 0.5
        for piece in batcher:
            n = len(_fuzz_piece_ids(kind, piece, lengths))
            if rnd.random() < 0.1:
                batcher.yield_memory()
            oom = n > mb and rnd.random() < 0.3
            if report:
                if oom:
                    batcher.report_oom()
                    continue
                seen += _fuzz_piece_ids(kind, piece, lengths)
            else:
                with batcher.step():
                    if oom:
                        raise oom_error(n)
                    seen += _fuzz_piece_ids(kind, piece, lengths)
        assert sorted(seen) == list(range(total)), (seed, kind)


# --- DynamicBatcher: samples that are tuples or dicts, nested per-sample lists, sizes ---


def _drain_after_an_oom(batcher):
    """Every piece served after an OOM reported for the first one."""
    pieces, first = [], True
    for piece in batcher:
        if first:
            first = False
            batcher.report_oom()
            continue
        pieces.append(piece)
    return pieces


SAMPLE_KINDS = {  # a loader that does not collate (collate_fn=lambda b: b) gives lists of these
    "(image, int)": lambda i: (torch.full((3, 4, 4), float(i)), i),
    "(tensor, 0-d tensor)": lambda i: (torch.full((4,), float(i)), torch.tensor(i)),
    "(tensor(L), tensor(L))": lambda i: (torch.full((4,), float(i)), torch.full((4,), -float(i))),
    "dict": lambda i: {"input_ids": torch.full((6,), i), "label": torch.tensor(i)},
    "[tensor, tensor]": lambda i: [torch.full((8,), float(i)), torch.full((8,), float(i))],
}


@pytest.mark.parametrize("kind", list(SAMPLE_KINDS))
def test_dynamic_batcher_lists_of_tuple_and_dict_samples_are_samples(kind):
    samples = [SAMPLE_KINDS[kind](i) for i in range(8)]
    batcher = adaptive.DynamicBatcher([samples], batch_size=4, release=lambda: None)
    pieces = _drain_after_an_oom(batcher)
    assert all(isinstance(p, list) and len(p) == 2 for p in pieces)
    served = [s for p in pieces for s in p]
    assert len(served) == 8 and all(s is samples[i] for i, s in enumerate(served))  # whole, once


def _detection_batch(n, channels=3):
    """torchvision's detection batches: collate_fn=lambda b: tuple(zip(*b))."""
    targets = [{"boxes": torch.zeros(i + 1, 4), "labels": torch.full((i + 1,), i)} for i in range(n)]
    samples = [(torch.full((channels, 20 + i, 30), float(i)), targets[i]) for i in range(n)]
    return tuple(zip(*samples))


@pytest.mark.parametrize("n", [4, 3, 2])  # 3: as many images as channels; 2: fewer
@pytest.mark.parametrize("fields", [None, True])
def test_dynamic_batcher_detection_batches_are_split_by_image(n, fields):
    batch = _detection_batch(n)
    kw = {} if fields is None else {"fields": fields}
    pieces = list(adaptive.DynamicBatcher([batch], batch_size=1, release=lambda: None, **kw))
    assert len(pieces) == n and all(isinstance(p, tuple) and len(p[0]) == len(p[1]) == 1 for p in pieces)
    for i, (images, targets) in enumerate(pieces):
        assert images[0] is batch[0][i] and targets[0] is batch[1][i]  # never cut along channels
    # The images alone: one field read both ways (n images, 3 channels), a tie: by image.
    images_only = list(adaptive.DynamicBatcher([(batch[0],)], batch_size=1, release=lambda: None))
    assert [p[0][0] is img for p, img in zip(images_only, batch[0])] == [True] * n and len(images_only) == n


def test_dynamic_batcher_fields_batch_size_is_the_first_tensors():
    B, L = 3, 5
    d = {"x": torch.arange(B * L).view(B, L), "y": torch.arange(B), "pos": torch.zeros(L, L),
         "bias": torch.zeros(L), "table": torch.zeros(L, 2)}
    for batch in (d, tuple(d.values())):
        batcher = adaptive.DynamicBatcher([batch, batch], batch_size=2, release=lambda: None)
        with pytest.warns(UserWarning, match=r"took 3, .* first tensor .* most tensors .* have 5") as rec:
            pieces = list(batcher)
        assert len(rec) == 1  # once per batcher
        values = [list(p.values()) if isinstance(p, dict) else list(p) for p in pieces]
        assert [v[1].tolist() for v in values] == [[0, 1], [2], [0, 1], [2]]
        assert all(v[0].shape[0] == v[1].shape[0] for v in values)
        assert all(v[2].shape == (L, L) and v[3].shape == (L,) and v[4].shape == (L, 2) for v in values)
