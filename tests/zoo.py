"""Small models covering the layer types vmapdp must handle, each with a batch maker and a loss.

Every case gives ``(module, make_batch(B, generator), loss_kind)``. ``loss_fn_for`` builds the
one-sample loss ``loss_fn(params, buffers, sample)`` used by the engine and the oracle alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import vmapdp


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple]
    loss: str = "ce"  # "ce": cross-entropy on logits [1, K]; "mse": squared error summed over outputs


def _images(shape, k):
    def make(b, g):
        return torch.randn((b,) + shape, generator=g), torch.randint(0, k, (b,), generator=g)

    return make


def _tokens(vocab, t, k):
    def make(b, g):
        # a small vocabulary so that tokens repeat within a sequence and across samples
        return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, k, (b,), generator=g)

    return make


def _seq(t, d, k):
    def make(b, g):
        return torch.randn((b, t, d), generator=g), torch.randint(0, k, (b,), generator=g)

    return make


class TiedLM(nn.Module):
    """Embedding tied to the output projection (weight sharing)."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens)))  # [N, T, d]
        return self.out(h.mean(1))  # [N, vocab]


class BufferCounter(nn.Module):
    """Counts forward calls in a registered buffer (in place)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.linear(x)


class CalledTwice(nn.Module):
    """The same Linear applied twice (gradient contributions from both calls must add)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class Pool(nn.Module):
    """Mean over the sequence dim of a [N, T, d] output, then a linear head."""

    def __init__(self, body, d, k):
        super().__init__()
        self.body = body
        self.head = nn.Linear(d, k)

    def forward(self, x):
        return self.head(self.body(x).mean(1))


class Attention(nn.Module):
    def __init__(self, d=8, heads=2, k=3):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, k)

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.head(y.mean(1))


class Recurrent(nn.Module):
    """A recurrent body (batch_first) whose last output feeds a linear head."""

    def __init__(self, rnn, k=3):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), k)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _fixed(build):
    """torch's recurrent layers cannot be vmapped in torch 2.13; vmapdp.fix swaps in equal ones."""
    return lambda: vmapdp.fix(build())


def _frozen_mlp():
    m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    m[0].weight.requires_grad_(False)
    return m


CASES = [
    Case("linear", lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), _images((6,), 3)),
    Case("linear_on_sequence_mse", lambda: nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 2)), _seq(3, 4, 2), "mse"),
    Case(
        "conv1d_stride_dilation_padding",
        lambda: nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, padding=2, dilation=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5, 3)),
        _images((2, 10), 3),
    ),
    Case(
        "conv2d_groups_reflect",
        lambda: nn.Sequential(nn.Conv2d(4, 6, 3, groups=2, padding=1, padding_mode="reflect"), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 5 * 5, 3)),
        _images((4, 5, 5), 3),
    ),
    Case(
        "conv2d_circular_stride",
        lambda: nn.Sequential(nn.Conv2d(3, 4, (3, 2), stride=2, padding=1, padding_mode="circular"), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)),
        _images((3, 7, 6), 3),
    ),
    Case(
        "conv3d_same_replicate",
        lambda: nn.Sequential(nn.Conv3d(2, 3, 3, padding="same", padding_mode="replicate"), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 3 * 3, 2)),
        _images((2, 4, 3, 3), 2),
    ),
    Case(
        "conv_transpose2d_stride_output_padding_groups",
        lambda: nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 6 * 6, 3)),
        _images((4, 3, 3), 3),
    ),
    Case(
        "conv_transpose1d_dilation",
        lambda: nn.Sequential(nn.ConvTranspose1d(3, 2, 3, stride=3, padding=2, dilation=2, output_padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 14, 3)),
        _images((3, 5), 3),
    ),
    Case(
        "conv_transpose3d",
        lambda: nn.Sequential(nn.ConvTranspose3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(0, 1, 0)), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 3 * 4, 2)),
        _images((2, 3, 2, 3), 2),
    ),
    Case("embedding_repeated_tokens", lambda: Pool(nn.Embedding(7, 5), 5, 3), _tokens(7, 9, 3)),
    Case("layernorm", lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)), _images((6,), 3)),
    Case(
        "groupnorm",
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)),
        _images((2, 5, 5), 3),
    ),
    Case(
        "instancenorm_affine",
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)),
        _images((2, 5, 5), 3),
    ),
    Case("multihead_attention", lambda: Attention(), _seq(5, 8, 3)),
    Case(
        "transformer_encoder_layer",
        lambda: Pool(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True), 8, 3),
        _seq(4, 8, 3),
    ),
    Case("lstm_via_fix", _fixed(lambda: Recurrent(nn.LSTM(4, 5, num_layers=2, batch_first=True))), _seq(6, 4, 3)),
    Case("gru_bidirectional_via_fix", _fixed(lambda: Recurrent(nn.GRU(4, 5, batch_first=True, bidirectional=True))), _seq(6, 4, 3)),
    Case("rnn_relu_via_fix", _fixed(lambda: Recurrent(nn.RNN(4, 5, nonlinearity="relu", batch_first=True))), _seq(6, 4, 3)),
    Case("tied_weights", lambda: TiedLM(), _tokens(11, 6, 11)),
    Case("module_called_twice", lambda: CalledTwice(), _images((5,), 3)),
    Case("frozen_params", _frozen_mlp, _images((6,), 3)),
]


def loss_fn_for(apply, kind: str):
    """One-sample loss: the model sees a batch of one (``x[None]``)."""

    def loss_fn(params, buffers, sample):
        x, y = sample
        out = apply(params, buffers, x[None])
        if kind == "ce":
            return F.cross_entropy(out, y[None])
        target = (torch.arange(out.shape[-1]) == y).to(out.dtype)
        return ((out[0] - target) ** 2).sum()

    return loss_fn


def setup(case: Case, b: int, seed: int = 0):
    torch.manual_seed(seed)
    model = case.build()
    apply, params, buffers = vmapdp.functionalize(model)
    batch = case.make_batch(b, torch.Generator().manual_seed(seed + 1))
    return model, apply, params, buffers, batch, loss_fn_for(apply, case.loss)
