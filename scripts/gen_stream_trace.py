#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Writes a synthetic multi-stream allocation trace in RMM's CSV event log format.

The trace is shaped like a layer-offloading inference pipeline (a LLaMA-7B-sized decoder whose
weights live on the host): while the main stream computes layer i, the weights of layer i+depth
are allocated and copied in on one of several copy streams; the main stream uses them and the
program frees them when the layer is done. Layer outputs kept for the host (KV cache offload)
are allocated on the main stream and freed on an offload stream once copied out; each batch's
embeddings and logits belong to a request stream of their own. Batches alternate a prefill
(many tokens) with decode steps (one token a sequence).

What the CSV can say about streams: each row has one stream. An allocation's is the stream
that allocates; a free's is the stream the memory was last used on, which `cuma replay` passes
to cuma_free (memory reusable at once by that stream, by the others once its work so far is
done). PyTorch's record_stream (a block used by a second stream, freed later in host order)
has no row of its own: a program that orders the second stream after the first, as every
correct one does, frees on the stream of the last use, and that is what --free-main writes
(weights freed on the main stream). The other weights are freed on their copy stream, as a
program that frees in its allocation stream's order would. --free-on alloc names the
allocation's stream in every free row instead, as a PyTorch snapshot records frees.

Deterministic for a seed (printed on stderr). Standard library only.

  scripts/gen_stream_trace.py --seed 1 --streams 10 --batches 6 -o trace.csv.gz
"""
import argparse
import gzip
import random
import sys

MIB = 1 << 20


def layer_weights(hidden, inter):
    """fp16 tensors of one decoder layer: attention q/k/v/o, MLP gate/up/down, two norms."""
    att = hidden * hidden * 2
    mlp = hidden * inter * 2
    return [att, att, att, att, mlp, mlp, mlp, hidden * 2, hidden * 2]


class Writer:
    def __init__(self, out, free_on_alloc):
        self.out = out
        self.free_on_alloc = free_on_alloc
        self.t = 0  # host time, microseconds
        self.next_ptr = 0x7F0000000000
        self.live = {}  # ptr -> size
        self.events = 0
        self.live_bytes = 0
        self.peak = 0
        out.write("Thread,Time,Action,Pointer,Size,Stream\n")

    def _row(self, action, ptr, size, stream):
        t = self.t
        stamp = "%02d:%02d:%02d:%06d" % (t // 3600000000, t // 60000000 % 60, t // 1000000 % 60,
                                         t % 1000000)
        self.out.write("0,%s,%s,0x%x,%d,%d\n" % (stamp, action, ptr, size, stream))
        self.events += 1

    def alloc(self, size, stream):
        ptr = self.next_ptr
        self.next_ptr += (size + 511) // 512 * 512 + 512
        self.live[ptr] = (size, stream)
        self.live_bytes += size
        self.peak = max(self.peak, self.live_bytes)
        self._row("allocate", ptr, size, stream)
        return ptr

    def free(self, ptr, stream):
        size, astream = self.live.pop(ptr)
        self.live_bytes -= size
        self._row("free", ptr, size, astream if self.free_on_alloc else stream)

    def advance(self, us):
        self.t += max(0, int(us))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    ap.add_argument("--streams", type=int, default=10, help="streams in all (4 or more)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--depth", type=int, default=2, help="layers prefetched ahead")
    ap.add_argument("--batches", type=int, default=6, help="batches (a prefill, then decodes)")
    ap.add_argument("--decode", type=int, default=6, help="decode steps a batch")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences a batch, at most")
    ap.add_argument("--max-prompt", type=int, default=512, help="prompt tokens, at most")
    ap.add_argument("--layer-us", type=int, default=3000,
                    help="host time a layer takes (the copy of its weights paces the loop)")
    ap.add_argument("--free-main", type=float, default=0.5,
                    help="share of weights freed on the main stream (the rest on their copy "
                    "stream)")
    ap.add_argument("--free-on", choices=("last", "alloc"), default="last",
                    help="the stream a free row names: of the memory's last use (default), or "
                    "of its allocation, as a PyTorch snapshot records every free")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every size (small tests)")
    ap.add_argument("-o", "--output", required=True, help="file to write (.gz: gzip'd)")
    a = ap.parse_args()
    if a.streams < 4:
        ap.error("--streams must be 4 or more")
    seed = a.seed if a.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)

    # Streams, numbered from 1 (0 would read as "the allocation's stream" in a free).
    main_s = 1
    ncopy = max(1, (a.streams - 2) // 3)
    copy_s = list(range(2, 2 + ncopy))
    offload_s = 2 + ncopy
    req_s = list(range(3 + ncopy, a.streams + 1)) or [main_s]

    def sz(n):
        return max(1, int(n * a.scale))

    opener = gzip.open if a.output.endswith(".gz") else open
    with opener(a.output, "wt") as f:
        w = Writer(f, a.free_on == "alloc")
        h = a.hidden
        wsizes = [sz(s) for s in layer_weights(h, a.inter)]
        # Resident: embedding table and output head, allocated once on the main stream.
        resident = [w.alloc(sz(a.vocab * h * 2), main_s), w.alloc(sz(a.vocab * h * 2), main_s)]
        nextcopy = 0
        offloaded = []  # (ptr, free after layer count)
        layer_count = 0
        for b in range(a.batches):
            bs = rng.randint(1, a.max_batch)
            prompt = rng.randint(16, a.max_prompt)
            rs = req_s[b % len(req_s)]
            for step in range(1 + a.decode):
                tokens = bs * prompt if step == 0 else bs
                ctx = prompt + step
                # The request stream brings the step's token ids and embeddings in.
                ids = w.alloc(sz(tokens * 8), rs)
                w.advance(20)
                x = w.alloc(sz(tokens * h * 2), rs)
                w.advance(30)
                w.free(ids, rs)
                inflight = []  # per prefetched layer: (ptrs, copy stream)

                def prefetch():
                    nonlocal nextcopy
                    cs = copy_s[nextcopy % len(copy_s)]
                    nextcopy += 1
                    ptrs = []
                    for s in wsizes:
                        ptrs.append(w.alloc(s, cs))
                        w.advance(rng.randint(5, 40))
                    inflight.append((ptrs, cs))

                for _ in range(min(a.depth, a.layers)):
                    prefetch()
                for layer in range(a.layers):
                    if layer + a.depth < a.layers:
                        prefetch()
                    ptrs, cs = inflight.pop(0)
                    lt = a.layer_us * rng.uniform(0.7, 1.3) * (2.0 if step == 0 else 1.0)
                    # Compute on the main stream: attention, then the MLP.
                    heads = 32
                    att = sz(bs * heads * (tokens // bs) * ctx * 2)
                    acts = []
                    for s in (tokens * h * 2, tokens * h * 2 * 3):
                        acts.append(w.alloc(sz(s), main_s))
                        w.advance(lt * 0.04)
                    scores = w.alloc(att, main_s)
                    w.advance(lt * 0.08)
                    probs = w.alloc(att, main_s)
                    w.advance(lt * 0.05)
                    w.free(scores, main_s)
                    o = w.alloc(sz(tokens * h * 2), main_s)
                    w.advance(lt * 0.05)
                    w.free(probs, main_s)
                    for p in acts:
                        w.free(p, main_s)
                    w.advance(lt * 0.05)
                    g = w.alloc(sz(tokens * a.inter * 2), main_s)
                    u = w.alloc(sz(tokens * a.inter * 2), main_s)
                    w.advance(lt * 0.25)
                    w.free(g, main_s)
                    y = w.alloc(sz(tokens * h * 2), main_s)
                    w.advance(lt * 0.2)
                    w.free(u, main_s)
                    w.free(o, main_s)
                    w.free(x, main_s)
                    x = y
                    # The new keys and values go to the host on the offload stream, a few
                    # layers later; they are allocated on the main stream.
                    kv = w.alloc(sz(tokens * h * 2 * 2), main_s)
                    offloaded.append((kv, layer_count + rng.randint(1, 3)))
                    layer_count += 1
                    for p, due in [e for e in offloaded if e[1] <= layer_count]:
                        w.free(p, offload_s)
                    offloaded = [e for e in offloaded if e[1] > layer_count]
                    w.advance(lt * 0.1)
                    # The layer's weights are done with.
                    for p in ptrs:
                        w.free(p, main_s if rng.random() < a.free_main else cs)
                    w.advance(lt * 0.13)
                # Logits and sampling on the request stream.
                logits = w.alloc(sz(bs * a.vocab * 4), rs)
                w.free(x, main_s)
                w.advance(200)
                tok = w.alloc(sz(bs * 8), rs)
                w.free(logits, rs)
                w.advance(50)
                w.free(tok, rs)
        for p, _ in offloaded:
            w.free(p, offload_s)
        for p in resident:
            w.free(p, main_s)
        print("gen_stream_trace: seed %d, %d streams (main 1, copy %s, offload %d, requests %s), "
              "%d events, peak live %.1f MiB, %.3f s" %
              (seed, a.streams, ",".join(map(str, copy_s)), offload_s,
               ",".join(map(str, req_s)), w.events, w.peak / MIB, w.t / 1e6), file=sys.stderr)


if __name__ == "__main__":
    main()
