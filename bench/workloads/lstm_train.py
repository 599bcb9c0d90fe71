# SPDX-License-Identifier: Apache-2.0
"""LSTM language-model training with variable batch size and sequence length.

An embedding, a 2-layer LSTM and a linear layer over the vocabulary predict the next token;
SGD with momentum steps, gradients clipped. Each step draws its own batch (4-32) and length
(16-96). Seeded.

    /usr/bin/python3 -m cuma.record -o lstm_train.csv.gz bench/workloads/lstm_train.py
"""
import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    torch.manual_seed(opts.seed)
    torch.set_num_threads(1)
    rng = random.Random(opts.seed)
    vocab, d, hidden = 1000, 64, 192
    embed = nn.Embedding(vocab, d)
    lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
    out = nn.Linear(hidden, vocab)
    params = list(embed.parameters()) + list(lstm.parameters()) + list(out.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(opts.steps):
        batch = rng.randint(4, 32)
        ids = torch.randint(0, vocab, (batch, rng.randint(16, 96) + 1))
        y, _ = lstm(embed(ids[:, :-1]))
        loss = F.cross_entropy(out(y).reshape(-1, vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        del ids, y, loss


if __name__ == "__main__":
    main()
