"""A character language model as a PyTorch user writes one, for the Python
loop benches: torch.nn.MultiheadAttention blocks with a GELU MLP, tied input
and output embeddings, a model that takes and returns dicts, a Python
tokeniser and a map-style Dataset of dict samples over the King James Bible
(Debian's bible-kjv).

Sizes (width, blocks, heads, context, batch a member):
  charlm-s   96, 2, 4,  64, 16   (the loop a new user tried first)
  charlm-m  192, 3, 6, 64, 16
  charlm-l  384, 4, 8, 64,  8
"""
import shutil
import subprocess
import sys

import torch
from torch import nn
from torch.nn import functional as F

SIZES = {"charlm-s": (96, 2, 4, 64, 16), "charlm-m": (192, 3, 6, 64, 16), "charlm-l": (384, 4, 8, 64, 8)}


class Tokeniser:
    """Characters to ids, in Python (a dict lookup a character)."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, s):
        return [self.index[c] for c in s]


class Windows(torch.utils.data.Dataset):
    """Sample i: the context window at i * context, as a dict of tensors."""

    def __init__(self, text, tok, context):
        self.text, self.tok, self.t = text, tok, context
        self.n = (len(text) - 1) // context

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.tensor(self.tok.encode(self.text[i * self.t:(i + 1) * self.t + 1]))
        return {"tokens": ids[:-1], "targets": ids[1:]}


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h, mask):
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class CharLM(nn.Module):
    def __init__(self, vocab, width, blocks, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        # The causal mask as an additive float buffer (a bool one would be
        # refused by DDP over Gloo, whose first broadcast takes no bool).
        self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1))
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, batch):
        x = batch["tokens"]
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        for b in self.blocks:
            h = b(h, self.mask[:t, :t])
        logits = self.ln(h) @ self.tok.weight.t()  # tied with the input embedding
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))
        return {"logits": logits, "loss": loss}


def param_groups(model, weight_decay=0.1):
    """AdamW's two groups: matrices decay, biases, norms and the positions do not."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def data_and_model(name):
    width, blocks, heads, context, batch = SIZES[name]
    if shutil.which("bible") is None:
        sys.exit("charlm: the corpus is Debian's King James Bible: apt-get install bible-kjv-text "
                 "(examples/gpt/setup.sh installs it too)")
    text = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True).stdout.decode("latin-1")
    tok = Tokeniser(text)
    torch.manual_seed(1)
    return Windows(text, tok, context), CharLM(len(tok.chars), width, blocks, heads, context), batch
