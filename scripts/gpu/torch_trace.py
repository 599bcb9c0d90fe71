#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The allocation trace of torch_compare.py's training loop, recorded without a GPU.

Runs the loop of scripts/gpu/torch_compare.py (same model, same seed, same per-step
(batch, length) plan, imported from it) on PyTorch's "meta" device: tensors there have
shapes, dtypes, strides and storages but no data, so the full-size model costs no
arithmetic. A TorchDispatchMode sees every aten op: each output tensor whose storage is new
is an `allocate` of the storage's bytes (what PyTorch's CUDA allocator is asked for), and a
storage whose last reference has gone (StorageWeakRef.expired(), polled before every op
and at the end of each step) is a `free`. The trace is written in RAPIDS RMM's CSV format
(gzip when the name ends in .gz), at full size: replay it with `cuma replay --scale 1`.

What the forward runs is not torch 1.13's nn.TransformerEncoder code but the op sequence
PyTorch 2.x runs on CUDA for torch_compare.py's model (norm_first, training, batch_first,
is_causal=True, need_weights=False), written out with the modules' own parameters:
  - CUDA bf16 autocast by hand: linear inputs, weights and biases cast to bf16 (the casts
    of parameters cached for the forward, as autocast does), layer norm in float32, the
    residual stream float32 (float32 + bf16), logits bf16, then .float() for the loss;
  - at::linear's paths: addmm for 2-D or contiguous 3-D input, else matmul's fold (a
    contiguous copy of the input, mm, a bias add_ in place);
  - MultiheadAttention's packed in-projection (one contiguous copy of q|k|v) and SDPA
    with is_causal and no mask: flash attention, which keeps only its output and a float32
    logsumexp (b x h x n); its backward allocates contiguous copies of grad_out and out,
    dq/dk/dv, softmax_d (b x h x n128) and dq_accum (float32 b x n128 x h x hd32), as
    FlashAttention-2's mha_bwd does; the n x n score matrix is never made;
  - dropout as native_dropout (bf16 output and a bool mask), embedding as CUDA's
    (a reshaped index copy forward; embedding_dense_backward_cuda's sort path backward:
    sorted/original indices, segment buffers, float32 grad_weight_per_segment);
  - AdamW as 2.x's default foreach step: exp_avg and exp_avg_sq made at the first step,
    one sqrt temporary per parameter each step (step counters live on the CPU); the
    in-place updates allocate nothing and are left out.
The causal mask is still built every step (n x n float32), as torch_compare.py does.
Not modelled: cuBLAS/cuBLASLt workspaces (one block of a few to 32 MiB, held for the run),
cub's scratch, the RNG state, and any other buffer an op allocates for itself. The flash
and embedding buffers follow the PyTorch sources (flash_api.cpp's mha_bwd,
attention_backward.cu, EmbeddingBackwardKernel.cu), not a measured CUDA run.

Sizes: no scaling anywhere. Every storage has the bytes the CUDA run would ask for at the
model and batch options given (by default torch_compare.py's full model), so replays take
--scale 1 (the default); --scale K would also multiply sizes that do not grow with the model
(token ids, the n x n mask, layer-norm statistics, scalars).

Timestamps: the meta device has no timing, so every step gets a fixed synthetic duration
(--step-ms, 60 ms by default: the GPU step time assumed; use a measured one when known)
and its events are spaced evenly by op index inside it; model set-up takes one such slot
before the first step. A 1 s release delay thus spans about 16 steps.

    /usr/bin/python3 scripts/gpu/torch_trace.py --out /tmp/lm.csv.gz
    build/bin/cuma replay --json --conf release_delay_ms:1000 /tmp/lm.csv.gz

The 300 default steps take about 45 s on one CPU core (the op count per step, not the
tensor sizes, sets the time). Model and loop options are torch_compare.py's.
"""

import argparse
import gzip
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from torch_compare import add_loop_args, plan  # noqa: E402  (the GPU run's model and steps)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

DEV = torch.device("meta")
BF16 = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="trace file (RMM CSV; gzip if it ends in .gz)")
    add_loop_args(p)
    p.add_argument("--step-ms", type=float, default=60.0, help="synthetic duration of one training step")
    return p.parse_args(argv)


# ---- the recorder ---------------------------------------------------------------------------


class Recorder(TorchDispatchMode):
    """Storage allocations and frees on DEV, in op order, grouped by step."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage address -> [weak ref, block id, bytes]
        self.next_id = 0
        self.ops = 0  # ops so far in the current step
        self.pending = []  # (op index, action, block id, bytes) of the current step
        self.steps = []  # [(ops, events)] per finished step
        self.cur = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.poll()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == DEV:
                self.track(t)
        self.ops += 1
        return out

    def track(self, t):
        st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()  # torch 2.x / 1.13
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        ref = StorageWeakRef(st)
        old = self.live.get(ref.cdata)
        if old is not None:
            if not old[0].expired():
                return  # a view or an in-place result: no new storage
            self.free(ref.cdata)  # a new storage at a dead one's address
        self.live[ref.cdata] = [ref, self.next_id, nbytes]
        self.pending.append((self.ops, "allocate", self.next_id, nbytes))
        self.next_id += 1
        self.cur += nbytes
        self.peak = max(self.peak, self.cur)

    def free(self, key):
        _, bid, nbytes = self.live.pop(key)
        self.pending.append((self.ops, "free", bid, nbytes))
        self.cur -= nbytes

    def poll(self):
        for key in [k for k, v in self.live.items() if v[0].expired()]:
            self.free(key)

    def end_step(self):
        self.poll()
        self.steps.append((max(1, self.ops), self.pending))
        self.ops, self.pending = 0, []

    def write(self, path, step_us):
        opener = gzip.open if path.endswith(".gz") else open
        n = 0
        with opener(path, "wt", encoding="ascii", newline="\n") as f:
            f.write("Thread,Time,Action,Pointer,Size,Stream\n")
            for s, (ops, events) in enumerate(self.steps):
                for i, action, bid, nbytes in events:
                    us = int(round((s + i / ops) * step_us))
                    sec, us = divmod(us, 1000000)
                    f.write("0,%02d:%02d:%02d:%06d,%s,0x%x,%d,0\n" % (
                        sec // 3600, sec // 60 % 60, sec % 60, us, action, 0x7F0000000000 + 0x200 * bid, nbytes))
                    n += 1
        return n


# ---- what PyTorch 2.x on CUDA runs ---------------------------------------------------------------


class Autocast:
    """CUDA autocast's cast to bf16 for matmul-like ops, parameters' casts cached for the forward."""

    def __init__(self):
        self.cache = {}

    def __call__(self, t):
        if t.dtype != torch.float32:
            return t
        if t.is_leaf and t.requires_grad:
            if id(t) not in self.cache:
                self.cache[id(t)] = t.to(BF16)
            return self.cache[id(t)]
        return t.to(BF16)


def linear(x, w, b, ac):
    """F.linear under autocast: at::linear on the cast arguments (the caller keeps x alive meanwhile)."""
    xc, wc, bc = ac(x), ac(w), ac(b)
    if xc.dim() == 2:
        return torch.addmm(bc, xc, wc.t())
    if xc.is_contiguous():  # _flatten_nd_linear
        return torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc.t()).view(*xc.shape[:-1], wc.shape[0])
    # matmul folds the batch dimensions (a copy of xc, kept for the weight's gradient), then adds the bias
    out = torch.ops.aten._unsafe_view(xc.reshape(-1, xc.shape[-1]).mm(wc.t()), [*xc.shape[:-1], wc.shape[0]])
    return out.add_(bc)


def dropout(x, p):
    return torch.native_dropout(x, p, True)[0]


def rounded(n, m):
    return (n + m - 1) // m * m


class FlashAttention(torch.autograd.Function):
    """_scaled_dot_product_flash_attention's memory on (b, n, h, hd) views; no arithmetic."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)  # mha_fwd: empty_like(q), q's strides
        b, n, h, _ = q.shape
        ctx.lse = q.new_empty((b, h, n), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        b, n, h, hd = q.shape
        tmp = [grad_out.contiguous(), out.contiguous()]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        tmp.append(q.new_empty((b, h, rounded(n, 128)), dtype=torch.float32))  # softmax_d
        tmp.append(q.new_empty((b, rounded(n, 128), h, rounded(hd, 32)), dtype=torch.float32))  # dq_accum
        del tmp
        return dq, dk, dv


class Embedding(torch.autograd.Function):
    """aten::embedding and CUDA's embedding_dense_backward (sort path), memory only."""

    NROWS_PER_THREAD = 10

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        ctx.num_weights = weight.shape[0]
        return weight.index_select(0, idx.reshape(-1)).view(*idx.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        numel, d = idx.numel(), grad.shape[-1]
        segments = min(numel, ctx.num_weights)
        partials = numel // Embedding.NROWS_PER_THREAD + segments
        tmp = [idx.new_empty(numel), idx.new_empty(numel)]  # sorted_indices, orig_indices
        sort_range = idx.new_empty(numel)  # arange(numel), the radix sort's values
        del sort_range
        grad_weight = grad.new_zeros((ctx.num_weights, d))
        tmp += [idx.new_empty(numel), idx.new_empty(())]  # segment_offsets, num_of_segments
        tmp += [idx.new_empty(segments), idx.new_empty(segments)]  # partials_per_segment, its offsets
        tmp += [idx.new_empty(()), idx.new_empty(partials)]  # num_of_partial_segments, partial_segment_offset
        tmp.append(grad.new_empty((partials, d)))  # grad_weight_per_segment
        del tmp
        return None, grad_weight


def mha(attn, x, ac):
    """MultiheadAttention(x, x, x, is_causal=True, need_weights=False), batch_first, training."""
    q = x.transpose(1, 0)
    tgt_len, bsz, e = q.shape
    heads = attn.num_heads
    hd = e // heads
    proj = linear(q, attn.in_proj_weight, attn.in_proj_bias, ac)  # _in_projection_packed
    proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = proj[0], proj[1], proj[2]
    del proj
    q, k, v = (t.view(tgt_len, bsz * heads, hd).transpose(0, 1).view(bsz, heads, tgt_len, hd) for t in (q, k, v))
    out = FlashAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = out.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, e)
    out = linear(out, attn.out_proj.weight, attn.out_proj.bias, ac)
    return out.view(tgt_len, bsz, e).transpose(1, 0)


def layer_norm(x, norm):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def sa_block(layer, x, ac):
    """TransformerEncoderLayer._sa_block: x (norm1's output) lives until the attention returns."""
    x = mha(layer.self_attn, x, ac)
    return dropout(x, layer.dropout1.p)


def ff_block(layer, x, ac):
    """TransformerEncoderLayer._ff_block: x (norm2's output) lives until linear2 returns."""
    x = linear(dropout(F.relu(linear(x, layer.linear1.weight, layer.linear1.bias, ac)), layer.dropout.p),
               layer.linear2.weight, layer.linear2.bias, ac)
    return dropout(x, layer.dropout2.p)


def encoder_layer(layer, x, ac):
    """TransformerEncoderLayer.forward, norm_first, training."""
    x = x + sa_block(layer, layer_norm(x, layer.norm1), ac)
    return x + ff_block(layer, layer_norm(x, layer.norm2), ac)


def lm_forward(model, x, ac):
    """torch_compare.py's LM.forward under autocast."""
    n = x.shape[1]
    mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)  # unused with is_causal
    h = Embedding.apply(x, model.emb.weight)
    for layer in model.enc.layers:
        h = encoder_layer(layer, h, ac)
    logits = linear(h, model.head.weight, model.head.bias, ac)
    del mask  # freed when LM.forward returns
    return logits


class AdamW:
    """torch.optim.AdamW's default foreach step on CUDA, its allocations only."""

    def __init__(self, params):
        self.params = list(params)
        self.exp_avg_sqs = None

    def step(self):
        if self.exp_avg_sqs is None:
            self.exp_avg_sqs = []
            self.exp_avgs = []
            for p in self.params:
                self.exp_avgs.append(torch.zeros_like(p))
                self.exp_avg_sqs.append(torch.zeros_like(p))
        exp_avg_sq_sqrt = [s.sqrt() for s in self.exp_avg_sqs]  # _foreach_sqrt
        del exp_avg_sq_sqrt

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class LM(nn.Module):
    """torch_compare.py's model: the same modules, so the same parameters in the same order."""

    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d_model, device=DEV)
        layer = nn.TransformerEncoderLayer(a.d_model, a.heads, 4 * a.d_model, dropout=0.1, batch_first=True,
                                           norm_first=True, device=DEV)
        self.enc = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
        self.head = nn.Linear(a.d_model, a.vocab, device=DEV)


def main(argv=None):
    a = parse_args(argv)
    t0 = time.time()
    model = LM(a)
    rec = Recorder()
    with rec:
        model._apply(torch.Tensor.clone)  # model.to("cuda"): one copy per parameter, in _apply's order
        opt = AdamW(model.parameters())
        rec.end_step()
        for b, n in plan(a):
            x = torch.randint(0, a.vocab, (b, n + 1), device=DEV)
            logits = lm_forward(model, x[:, :-1], Autocast())
            loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.end_step()
    events = rec.write(a.out, a.step_ms * 1000)
    ops = sum(s[0] for s in rec.steps[1:])
    print("%s: %d steps, %d events, %.0f ops per step, peak live %.1f MiB, %.1f s" % (
        a.out, len(rec.steps) - 1, events, ops / max(1, len(rec.steps) - 1), rec.peak / 2**20, time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
