"""A GPT-style model for the monitor benchmark and GPU tests (pre-LN blocks, causal SDPA); the
transformer block is the demo's (nanscan.demo_model.Block)."""
import torch
from torch import nn

from nanscan.demo_model import Block


class GPT(nn.Module):
    def __init__(self, vocab=1024, d=256, layers=4, heads=4, seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
