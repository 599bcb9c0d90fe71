#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A fixed-size pool on the GPU: raw blocks and a model's buffers, values intact.

One process. First the raw pool: heap.pool(SIZE, COUNT) carved from cuma's default heap on
device 0; every block handed out once (distinct, 256-byte aligned, inside one carve of COUNT
blocks), each filled through PyTorch with its own byte and read back, an allocation past the
last block refused (OutOfMemoryError), all given back and handed out again, the heap's pool
figures (pools, pool_blocks, pool_blocks_in_use) as they should be. Then a model with
BatchNorm layers whose buffers cuma.torch.pool_buffers puts in a pool: --steps training steps
give the same losses and the same running statistics, bit for bit, as the same model trained
with its buffers where PyTorch put them; cuma.torch.compact does not move them.

Prints the figures and ``POOL RESULT: PASS|FAIL ...`` (exit 0 or 1; 3: no CUDA).
``--device cpu`` is a dry run for the tests: the heap is a simulated one with host_backing:on
and the tensors are CPU tensors over its memory (cuma.torch.empty), the same code path.

    PYTHONPATH=python CUMA_LIBRARY=build-gpu/lib/libcuma.so python3 scripts/gpu/pool_check.py
"""

import argparse
import ctypes
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4000, help="bytes per raw block (rounded up to 256)")
    p.add_argument("--count", type=int, default=512, help="raw blocks")
    p.add_argument("--width", type=int, default=256, help="features of the model's layers")
    p.add_argument("--layers", type=int, default=4, help="Linear+BatchNorm layers")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    import torch

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("POOL RESULT: SKIP torch.cuda.is_available() is False")
        return 3
    import cuma
    import cuma.torch as ct

    nn = torch.nn
    if on_gpu:
        ct.enable("")
        heap = cuma.heap.default_heap(0)
        dev = torch.device("cuda", 0)
    else:
        heap = cuma.Heap("backend:sim,host_backing:on,capacity:1G,page_size:2M,sim_clock:manual",
                         use_env=False)
        dev = torch.device("cpu")
    notes = []

    def over(addr, nbytes):
        """A uint8 tensor over nbytes of heap memory at addr (a pool's block), not owning it."""
        if on_gpu:
            class Mem:  # the CUDA array interface: PyTorch makes a tensor over the memory
                __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                            "data": (addr, False), "version": 2}
            return torch.as_tensor(Mem(), device=dev)
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)

    # ---- raw blocks ----
    pool = heap.pool(a.size, a.count)
    bs = pool.block_size
    s0 = heap.stats()
    blocks = [pool.alloc() for _ in range(a.count)]
    lo, hi = min(blocks), max(blocks)
    if len(set(blocks)) != a.count:
        notes.append("blocks handed out twice")
    if any(b % 256 for b in blocks):
        notes.append("a block not 256-byte aligned")
    if hi - lo != (a.count - 1) * bs:
        notes.append("blocks span %d bytes, not one carve of %d" % (hi - lo + bs, a.count * bs))
    try:
        pool.alloc()
        notes.append("an allocation past the last block succeeded")
    except cuma.OutOfMemoryError:
        pass
    s1 = heap.stats()
    if (s1["pools"] - s0["pools"], s1["pool_blocks_in_use"] - s0["pool_blocks_in_use"]) != (0, a.count):
        notes.append("pool figures %s -> %s" % ({k: s0[k] for k in ("pools", "pool_blocks_in_use")},
                                                 {k: s1[k] for k in ("pools", "pool_blocks_in_use")}))
    # Each block written with its own byte through a tensor over it, then all read back: a
    # block that overlapped another, or memory not mapped, shows here.
    views = [over(b, bs) for b in blocks]
    for i, v in enumerate(views):
        v.fill_(i % 251)
    if on_gpu:
        torch.cuda.synchronize()
    data_ok = all(int(v.min()) == i % 251 == int(v.max()) for i, v in enumerate(views))
    if not data_ok:
        notes.append("a block's bytes were changed by another's")
    del views
    for b in blocks:
        pool.free(b)
    again = sorted(pool.alloc() for _ in range(a.count))
    if again != sorted(blocks):
        notes.append("blocks handed out again are not the same set")
    for b in again:
        pool.free(b)
    pool.close()
    print("raw pool: %d blocks of %d bytes, one carve of %.2f MiB; data %s" % (
        a.count, bs, a.count * bs / (1 << 20),
        "checked" if data_ok else "CHANGED"))

    # ---- a model's buffers ----
    def make():
        torch.manual_seed(0)
        layers = []
        for _ in range(a.layers):
            layers += [nn.Linear(a.width, a.width), nn.BatchNorm1d(a.width), nn.ReLU()]
        model = nn.Sequential(*layers).to(dev)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(a.batch, a.width, generator=g).to(dev) for _ in range(a.steps)]

    def train(model, opt):
        losses = []
        for x in xs:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    ref, ref_opt = make()
    ref_losses = train(ref, ref_opt)
    ref_buffers = [b.detach().cpu().clone() for b in ref.buffers()]
    del ref, ref_opt
    model, opt = make()
    nbuf = len(list(model.buffers()))
    bpool = heap.pool(a.width * 4, nbuf)
    placed = ct.pool_buffers(model, bpool)
    if placed != nbuf:
        notes.append("%d of %d buffers placed" % (placed, nbuf))
    if bpool.in_use != nbuf:
        notes.append("pool has %d of %d blocks in use" % (bpool.in_use, nbuf))
    losses = train(model, opt)
    same = losses == ref_losses and all(
        torch.equal(b.detach().cpu(), r) for b, r in zip(model.buffers(), ref_buffers))
    if not same:
        notes.append("losses or running statistics differ from the plain run")
    moved = ct.compact(model, optimizer=opt, heap=heap)["blocks_moved"]
    ptrs = sorted(b.data_ptr() for b in model.buffers())
    in_pool = ptrs[-1] - ptrs[0] < nbuf * bpool.block_size
    if not in_pool:
        notes.append("a buffer is outside the pool after compaction")
    print("model: %d buffers in a pool of %d-byte blocks; %d steps, losses %s; compaction moved %d "
          "blocks (buffers %s)" % (placed, bpool.block_size, a.steps, "same" if same else "DIFFERENT",
                                   moved, "stayed" if in_pool else "MOVED"))
    del model, opt
    if bpool.in_use:
        notes.append("%d pool blocks still in use after the model is gone" % bpool.in_use)
    else:
        bpool.close()
    if not on_gpu:
        heap.close()
    ok = not notes
    print("POOL RESULT: %s%s: %s" % ("PASS" if ok else "FAIL", " (dry run)" if not on_gpu else "",
                                     "; ".join(notes) if notes else
                                     "%d raw blocks, %d buffers, losses same" % (a.count, placed)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
