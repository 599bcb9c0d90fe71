# SPDX-License-Identifier: Apache-2.0
"""Inference serving with variable batch x sequence length: a small transformer encoder.

Requests arrive in bursts: each has its own batch size (1-16) and sequence length (8-128),
the model runs under no_grad and the output is pooled and reduced to one answer per row. Between
requests the server waits a few milliseconds; between bursts it idles 0.3-2 s, as a served model
does when traffic falls off. Seeded: the same run gives the same shapes and waits.

    /usr/bin/python3 -m cuma.record -o serve_varlen.csv.gz bench/workloads/serve_varlen.py
"""
import argparse
import random
import time

import torch
import torch.nn as nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bursts", type=int, default=8)
    p.add_argument("--requests", type=int, default=10, help="requests per burst")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    torch.manual_seed(opts.seed)
    torch.set_num_threads(1)
    rng = random.Random(opts.seed)
    vocab, d = 1000, 128
    embed = nn.Embedding(vocab, d)
    layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=4 * d, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2)
    head = nn.Linear(d, 16)
    model = nn.ModuleList([embed, encoder, head]).eval()
    with torch.no_grad():
        for _ in range(opts.bursts):
            for _ in range(opts.requests):
                batch = rng.choice([1, 2, 4, 8, 16])
                length = rng.randint(8, 128)
                ids = torch.randint(0, vocab, (batch, length))
                x = encoder(embed(ids))
                logits = head(x.mean(dim=1))
                answer = logits.argmax(dim=1).tolist()
                del ids, x, logits, answer
                time.sleep(rng.uniform(0.002, 0.02))
            time.sleep(rng.uniform(0.3, 2.0))


if __name__ == "__main__":
    main()
