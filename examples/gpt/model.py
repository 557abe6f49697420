"""A small byte-level GPT, written as a PyTorch user writes one and scripted
with torch.jit.script so that Limbo trains it (model.name = "torchscript").

forward(x) takes int64 byte ids [B, T] and returns next-byte scores
[B, 256, T] (PyTorch's cross-entropy layout: classes second), so Limbo's
cross_entropy loss compares them with y = the bytes one position later."""
import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(c, dim=2)
        d = c // self.heads
        q = q.view(b, t, self.heads, d).transpose(1, 2)
        k = k.view(b, t, self.heads, d).transpose(1, 2)
        v = v.view(b, t, self.heads, d).transpose(1, 2)
        att = (q @ k.transpose(2, 3)) / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        h = h + self.proj(y)
        return h + self.out(torch.nn.functional.gelu(self.fc(self.ln2(h))))


class Gpt(nn.Module):
    def __init__(self, context: int = 64, width: int = 128, layers: int = 2, heads: int = 4, vocab: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        h = self.tok(x) + self.pos(pos)[None]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)).transpose(1, 2)  # [B, vocab, T]


def scripted(seed: int = 0, **kw):
    torch.manual_seed(seed)
    return torch.jit.script(Gpt(**kw))
