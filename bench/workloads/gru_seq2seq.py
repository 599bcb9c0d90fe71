# SPDX-License-Identifier: Apache-2.0
"""GRU seq2seq training with variable source and target lengths (teacher forcing).

An embedding and a 1-layer GRU encode a source batch; a GRU decoder started from the encoder's
last state reads the shifted target, a linear layer gives the vocabulary logits and
cross-entropy the loss; Adam steps. Each step draws its own batch (8-32), source length
(10-60) and target length (10-60). Seeded.

    /usr/bin/python3 -m cuma.record -o gru_seq2seq.csv.gz bench/workloads/gru_seq2seq.py
"""
import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


class Seq2Seq(nn.Module):
    def __init__(self, vocab, d, hidden):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d)
        self.tgt_embed = nn.Embedding(vocab, d)
        self.encoder = nn.GRU(d, hidden, batch_first=True)
        self.decoder = nn.GRU(d, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, src, tgt_in):
        _, h = self.encoder(self.src_embed(src))
        y, _ = self.decoder(self.tgt_embed(tgt_in), h)
        return self.out(y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    torch.manual_seed(opts.seed)
    torch.set_num_threads(1)
    rng = random.Random(opts.seed)
    vocab = 1000
    model = Seq2Seq(vocab, 64, 128)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(opts.steps):
        batch = rng.randint(8, 32)
        src = torch.randint(0, vocab, (batch, rng.randint(10, 60)))
        tgt = torch.randint(0, vocab, (batch, rng.randint(10, 60) + 1))
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del src, tgt, logits, loss


if __name__ == "__main__":
    main()
