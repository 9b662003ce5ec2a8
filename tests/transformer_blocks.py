"""Small transformer blocks in plain torch, as GPT-2, BERT, Llama and ViT write them (no
``transformers`` package): embeddings, GPT-2's ``Conv1D`` (``torch.addmm``), linear q/k/v, ``@``
attention, LayerNorm, RMSNorm (``F.rms_norm`` and hand-written), SwiGLU, a conv patchify, learned
position embeddings added to the activations. Each takes a batch ``[N, ...]`` and returns logits
``[N, K]``; ``BLOCKS`` maps a name to ``(build, make inputs(b, t, generator))``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D, K, VOCAB = 8, 3, 11


class Conv1D(nn.Module):
    """GPT-2's: ``W`` is ``[in, out]``, the forward ``torch.addmm(bias, x, W)``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(size)


def _attend(q, k, v, heads, causal):
    n, t, d = q.shape
    q, k, v = (z.view(n, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-1, -2)) / math.sqrt(d // heads)
    if causal:
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=att.device).triu(1), float("-inf"))
    return (att.softmax(-1) @ v).transpose(1, 2).reshape(n, t, d)


class GPT2Block(nn.Module):
    def __init__(self, t_max=6):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(t_max, D)
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.attn_proj = Conv1D(3 * D, D), Conv1D(D, D)
        self.c_fc, self.mlp_proj = Conv1D(4 * D, D), Conv1D(D, 4 * D)
        self.head = nn.Linear(D, K)

    def forward(self, tokens):
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        q, k, v = self.c_attn(self.ln_1(h)).split(D, dim=2)
        h = h + self.attn_proj(_attend(q, k, v, 2, causal=True))
        h = h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))
        return self.head(self.ln_f(h)[:, -1])


class BertBlock(nn.Module):
    def __init__(self, t_max=6):
        super().__init__()
        self.word, self.pos, self.segment = nn.Embedding(VOCAB, D), nn.Embedding(t_max, D), nn.Embedding(2, D)
        self.ln_emb, self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.pooler, self.head = nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.ln_emb(self.word(tokens) + self.pos(torch.arange(t)) + self.segment(torch.zeros_like(tokens)))
        h = self.ln_1(h + self.o(_attend(self.q(h), self.k(h), self.v(h), 2, causal=False)))
        h = self.ln_2(h + self.down(F.gelu(self.up(h))))
        return self.head(torch.tanh(self.pooler(h[:, 0])))


class HandRMSNorm(nn.Module):
    """Llama's own: ``x * rsqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norm_1, self.norm_2 = nn.RMSNorm(D), nn.RMSNorm(D, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)
        self.norm_f = HandRMSNorm(D)
        self.head = nn.Linear(D, K, bias=False)
        with torch.no_grad():
            for m in (self.norm_1, self.norm_2):
                m.weight.add_(0.1 * torch.randn(D))

    def forward(self, tokens):
        h = self.emb(tokens)
        x = self.norm_1(h)
        h = h + self.o(_attend(self.q(x), self.k(x), self.v(x), 2, causal=True))
        x = self.norm_2(h)
        h = h + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.head(self.norm_f(h).mean(1))


class ViTBlock(nn.Module):
    def __init__(self, patch=2, size=4):
        super().__init__()
        self.patchify = nn.Conv2d(3, D, patch, stride=patch)
        self.pos = nn.Parameter(0.1 * torch.randn((size // patch) ** 2, D))
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, K)

    def forward(self, images):
        h = self.patchify(images).flatten(2).transpose(1, 2) + self.pos
        q, k, v = self.qkv(self.ln_1(h)).chunk(3, dim=-1)
        h = h + self.proj(_attend(q, k, v, 2, causal=False))
        h = h + self.fc2(F.gelu(self.fc1(self.ln_2(h))))
        return self.head(self.ln_f(h).mean(1))


def _tokens(b, t, g):
    return torch.randint(0, VOCAB, (b, t), generator=g)


def _images(b, t, g):
    return torch.randn((b, 3, 4, 4), generator=g)


BLOCKS = {
    "gpt2": (GPT2Block, _tokens),
    "bert": (BertBlock, _tokens),
    "llama": (LlamaBlock, _tokens),
    "vit": (ViTBlock, _images),
}
