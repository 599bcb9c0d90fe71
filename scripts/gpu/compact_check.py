#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.compact on a fragmented cuma heap: a small model and its Adam state, scattered,
moved into dense pages; values intact, fragmentation down, training unchanged.

One process, cuma.torch.enable() first. An MLP with a few large layers (whose tensors fill
pages densely and are too large to move) trains one Adam step; then every tensor of the
training state is placed again, the small ones each followed by a 1.5 MiB temporary that is
freed afterwards (with the cache emptied), so that each small tensor keeps a page of its own
mapped: the heap's fragmentation (stranded share of the memory in use) is high.
cuma.torch.compact(model, optimizer=opt) then moves them. Checked: every tensor holds the same
bytes as before (compared with a copy on the host), the fragmentation fell below the
fragmentation_threshold (0.05), blocks moved, and --steps more steps give the same losses as
the same model trained first without scattering or compaction.

Prints the figures and ``COMPACT RESULT: PASS|FAIL ...`` (exit 0 or 1; 3: no CUDA).
``--device cpu`` is a dry run for the tests: the heap is a simulated one with host_backing:on
and the tensors are CPU tensors over its memory (cuma.torch.empty), the same code path.

    PYTHONPATH=python CUMA_LIBRARY=build-gpu/lib/libcuma.so python3 scripts/gpu/compact_check.py
"""

import argparse
import sys

MB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=4096, help="width of the large layers")
    p.add_argument("--small", type=int, default=12, help="small layers (scattered tensors)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="steps after the compaction")
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--cuma-conf", default="tcache:off",
                   help="settings for cuma (default tcache:off: each placement takes a new block, "
                   "not one the thread cache kept)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    import torch

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("COMPACT RESULT: SKIP torch.cuda.is_available() is False")
        return 3
    import cuma
    import cuma.torch as ct

    nn = torch.nn
    if on_gpu:
        ct.enable(a.cuma_conf)
        heap = cuma.heap.default_heap(0)
        dev = torch.device("cuda", 0)
    else:
        heap = cuma.Heap("backend:sim,host_backing:on,capacity:4G,page_size:2M,sim_clock:manual,"
                         + (a.cuma_conf or ""), use_env=False)
        dev = torch.device("cpu")

    def place(t):
        if on_gpu:
            return torch.empty_like(t)
        return ct.empty(t.shape, dtype=t.dtype, heap=heap)

    def temp():
        if on_gpu:
            return torch.empty(3 * MB // 2, dtype=torch.uint8, device=dev)
        return ct.empty((3 * MB // 2,), dtype=torch.uint8, heap=heap)

    def make():
        torch.manual_seed(0)
        w = a.width
        layers = [nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU()]
        for _ in range(a.small):  # small layers: 64x64 weights, biases, norms
            layers += [nn.Linear(w if len(layers) == 4 else 64, 64), nn.LayerNorm(64), nn.ReLU()]
        layers.append(nn.Linear(64, 8))
        model = nn.Sequential(*layers).to(dev)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.batch, 64, generator=g).to(dev)

    def step(model, opt):
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return float(loss)

    def state(model, opt):
        out = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
        out += list(model.buffers())
        for p in model.parameters():
            out += [v for v in opt.state[p].values() if torch.is_tensor(v) and v.device == dev]
        return out

    def scatter(model, opt):
        ts = state(model, opt)
        small = [t for t in ts if t.numel() * t.element_size() <= MB]
        temps = []
        for t in [t for t in ts if t.numel() * t.element_size() > MB] + small:
            c = place(t)
            c.copy_(t)
            t.data = c
            del c
            if t.numel() * t.element_size() <= MB:
                temps.append(temp())
        del temps, t
        if on_gpu:
            torch.cuda.synchronize()
            ct.empty_cache()
        else:
            heap.trim()
        return len(small)

    def fingerprint(ts):
        return [t.detach().reshape(-1).view(torch.uint8).cpu().clone() for t in ts]

    # The run without compaction first, and gone before the other starts: its tensors would
    # add their own layout to the heap's fragmentation.
    ref_model, ref_opt = make()
    ref_losses = [step(ref_model, ref_opt) for _ in range(1 + a.steps)]
    del ref_model, ref_opt
    model, opt = make()
    losses = [step(model, opt)]
    nsmall = scatter(model, opt)
    frag_before = heap.stats()["fragmentation"]
    before = fingerprint(state(model, opt))
    # x too: the one other long-lived tensor, alone on a page once the first model is gone.
    r = ct.compact(model, x, optimizer=opt, heap=heap)
    if on_gpu:
        torch.cuda.synchronize()
    s = heap.stats()
    intact = all(torch.equal(b, c) for b, c in zip(before, fingerprint(state(model, opt))))
    for _ in range(a.steps):
        losses.append(step(model, opt))
    same = losses == ref_losses
    print("tensors: %d, %d small (and the input); fragmentation %.3f -> %.3f (threshold %.2f); "
          "moved %d blocks, %.2f MiB; pages emptied %d, released %d; kept %d, refused %d" % (
              len(before), nsmall, frag_before, s["fragmentation"], a.threshold, r["blocks_moved"],
              r["bytes_moved"] / MB, r["pages_emptied"], r["pages_released"], r["kept"],
              r["blocks_refused"]))
    print("pages freed per MiB copied: %.1f" % (r["pages_emptied"] / max(r["bytes_moved"] / MB, 1e-9)))
    print("losses %s: %s" % ("same" if same else "DIFFERENT", losses))
    notes = []
    if not intact:
        notes.append("values changed by the move")
    if r["blocks_moved"] == 0:
        notes.append("nothing moved")
    if not s["fragmentation"] < min(a.threshold, frag_before):
        notes.append("fragmentation %.3f not under %.2f" % (s["fragmentation"], a.threshold))
    if not same:
        notes.append("losses after compaction differ")
    del model, opt, before
    if not on_gpu:
        heap.close()
    ok = not notes
    print("COMPACT RESULT: %s%s%s" % ("PASS" if ok else "FAIL", " (dry run)" if not on_gpu else "",
                                       ": " + "; ".join(notes) if notes else
                                       ": fragmentation %.3f -> %.3f, %.2f MiB moved" % (
                                           frag_before, s["fragmentation"], r["bytes_moved"] / MB)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
