"""The demo's model: a tiny pre-LayerNorm transformer, its factory and its loss.

It lives apart from :mod:`nanscan.demo` because three places use it and only one of them is the
demo: ``nanscan replay BUNDLE --model nanscan.demo_model:make_model`` rebuilds it, the benchmarks
and GPU tests build their GPT from its :class:`Block`, and replay treats this file as *user code*
(the frame it names is a line in here, as it would be in a user's model) while it skips the rest
of nanscan. Importing it needs torch but nothing of the demo's story (no planted fault, no output).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head attention (SDPA) and a GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Features in, one regression target per position out."""

    def __init__(self, features: int = 32, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)).squeeze(-1)


def make_model():
    """Factory for ``nanscan replay BUNDLE --model nanscan.demo_model:make_model``: the bundle holds
    the model's forward inputs (``watch`` kept them), so the replay is ``model(x)``."""
    torch.manual_seed(0)
    return TinyTransformer()


def step_loss(model, batch):
    """The training loss of one batch ``(x, y)``: mean squared error, computed in float32."""
    x, y = batch
    return F.mse_loss(model(x).float(), y)
