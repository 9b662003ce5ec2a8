"""The four models of the Fast-DPSGD / Opacus speed benchmarks, with inputs and losses.

Subramani, Vadivelu and Kamath (2021), "Enabling Fast Differentially Private SGD via Just-in-Time
Compilation and Vectorization" (code: github.com/TheSalon/fast-dpsgd), benchmark DP-SGD
frameworks on four models; the Opacus paper (Yousefpour et al. 2021, Table 2) reuses them and
lists their sizes. Architectures below follow the Fast-DPSGD repository (``pytorch.py`` and, for
the LSTM, ``jaxdp.py``); the trainable parameter counts are checked exactly:

============  =========  ====================================================================
name          params     architecture
============  =========  ====================================================================
mnist         26,010     Conv(1->16, k8, s2, p3) ReLU MaxPool(2, s1) Conv(16->32, k4, s2) ReLU
                         MaxPool(2, s1) Flatten Linear(512->32) ReLU Linear(32->10); [B,1,28,28]
cifar10       605,226    3x3 convs (padding 1) 32,32 | avgpool2 | 64,64 | avgpool2 | 128,128 |
                         avgpool2 | 256, then Conv(256->10) and a global mean; ReLU after every
                         conv but the last; [B,3,32,32]
embedding     160,098    Embedding(10,004 x 16) mean over time, Linear(16->2); tokens [B,256]
lstm          1,081,002  Embedding(10,004 x 100), LSTM(100->100) with ONE bias per gate,
                         mean over time, Linear(100->2); tokens [B,256]
============  =========  ====================================================================

IMDb sizes as in Fast-DPSGD (``utils.py``): a vocabulary of ``max_features = 10,000`` words plus
4 special tokens (<unk>, <pad>, <eos>, <sos>), sequences of ``max_len = 256`` tokens, 2 classes.

The LSTM count: 1,081,002 is the Haiku model of ``jaxdp.py`` (``hk.LSTM`` has a single bias
vector for the 4 gates). ``torch.nn.LSTM`` has two (``bias_ih_l0`` and ``bias_hh_l0``), which
only ever appear as their sum, so the PyTorch LSTM of ``pytorch.py`` has 400 redundant parameters
(1,081,402). We keep torch's layer and parameter names and freeze ``bias_hh_l0`` at zero: the
model computes the same function family as the Haiku one and has exactly 1,081,002 trainable
parameters (vmapdp puts the frozen bias among the buffers; Opacus skips it).

Each model is available as torch defines it (``build``), for vmapdp (``for_vmapdp``: recurrent
layers swapped for the vmap-friendly ``vmapdp.nn`` twins when that module exists) and for Opacus
(``for_opacus``: ``nn.LSTM`` swapped for ``opacus.layers.DPLSTM``); all three hold the same
weights and compute the same outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MNISTNet",
    "CIFAR10Net",
    "IMDbEmbeddingNet",
    "IMDbLSTMNet",
    "BenchModel",
    "MODELS",
    "VOCAB_SIZE",
    "NUM_SPECIAL_TOKENS",
    "SEQ_LEN",
    "num_params",
    "for_vmapdp",
    "for_opacus",
    "one_sample_loss",
    "loss",
]

VOCAB_SIZE = 10_000  # Fast-DPSGD --max_features
NUM_SPECIAL_TOKENS = 4  # <unk>, <pad>, <eos>, <sos>
SEQ_LEN = 256  # Fast-DPSGD --max_len


class MNISTNet(nn.Module):
    """The MNIST CNN of Fast-DPSGD / Opacus (26,010 params); input ``[B, 1, 28, 28]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)  # [B, 16, 13, 13]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)  # [B, 32, 4, 4]
        x = F.relu(self.fc1(x.flatten(1)))  # [B, 32]
        return self.fc2(x)  # [B, 10]


class CIFAR10Net(nn.Module):
    """The all-convolutional CIFAR-10 net of Fast-DPSGD / Opacus (605,226 params); ``[B, 3, 32, 32]``."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for width in (32, 64, 128):
            for _ in range(2):
                layers += [nn.Conv2d(in_ch, width, 3, padding=1), nn.ReLU()]
                in_ch = width
            layers.append(nn.AvgPool2d(2, stride=2))
        layers += [nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 10, 3, padding=1)]
        self.features = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x).mean(dim=(2, 3))  # global average over the 4x4 map -> [B, 10]


class IMDbEmbeddingNet(nn.Module):
    """Bag of embeddings for IMDb (160,098 params): embed, mean over time, linear; tokens ``[B, T]``."""

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size + NUM_SPECIAL_TOKENS, 16)
        self.fc1 = nn.Linear(16, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.fc1(self.emb(tokens).mean(1))


class IMDbLSTMNet(nn.Module):
    """Embedding + one-layer LSTM for IMDb (1,081,002 trainable params); tokens ``[B, T]``.

    ``bias_hh_l0`` is frozen at zero (see the module docstring): one bias per gate, as in the
    Haiku model whose size the benchmark papers report.
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size + NUM_SPECIAL_TOKENS, 100)
        self.lstm = nn.LSTM(100, 100, batch_first=True)
        with torch.no_grad():
            self.lstm.bias_hh_l0.zero_()
        self.lstm.bias_hh_l0.requires_grad_(False)
        self.fc1 = nn.Linear(100, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.emb(tokens))  # [B, T, 100]
        return self.fc1(out.mean(1))


def _images(channels: int, size: int) -> Callable[..., tuple[Tensor, Tensor]]:
    def make(batch_size: int, *, generator: torch.Generator | None = None, seq_len: int = SEQ_LEN) -> tuple[Tensor, Tensor]:
        x = torch.randn(batch_size, channels, size, size, generator=generator)
        y = torch.randint(0, 10, (batch_size,), generator=generator)
        return x, y

    return make


def _tokens(batch_size: int, *, generator: torch.Generator | None = None, seq_len: int = SEQ_LEN) -> tuple[Tensor, Tensor]:
    x = torch.randint(0, VOCAB_SIZE + NUM_SPECIAL_TOKENS, (batch_size, seq_len), generator=generator, dtype=torch.int64)
    y = torch.randint(0, 2, (batch_size,), generator=generator)
    return x, y


@dataclass(frozen=True)
class BenchModel:
    """One benchmark entry.

    Fields:
        name: CLI name (``mnist``, ``cifar10``, ``embedding``, ``lstm``).
        title: human-readable name for tables.
        expected_params: the trainable parameter count the papers report.
        cls: the ``nn.Module`` class (built with its defaults).
        build: ``build(seed=0) -> nn.Module``, the model as torch defines it (float32, CPU).
        make_batch: ``make_batch(B, generator=None, seq_len=256) -> (x, y)``: random inputs of the
            right shape and dtype (images float32; tokens int64) and int64 class labels.
    """

    name: str
    title: str
    expected_params: int
    cls: type
    make_batch: Callable[..., tuple[Tensor, Tensor]]

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.cls()


MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel("mnist", "MNIST CNN", 26_010, MNISTNet, _images(1, 28)),
        BenchModel("cifar10", "CIFAR-10 CNN", 605_226, CIFAR10Net, _images(3, 32)),
        BenchModel("embedding", "IMDb Embedding", 160_098, IMDbEmbeddingNet, _tokens),
        BenchModel("lstm", "IMDb LSTM", 1_081_002, IMDbLSTMNet, _tokens),
    )
}


def loss(logits: Tensor, y: Tensor) -> Tensor:
    """The benchmark loss: mean cross-entropy."""
    return F.cross_entropy(logits, y)


def num_params(model: nn.Module) -> int:
    """Trainable parameters (``requires_grad=True``), tied weights counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


_TORCH_RNNS = (nn.RNN, nn.GRU, nn.LSTM, nn.RNNCell, nn.GRUCell, nn.LSTMCell)


def _has_torch_rnn(model: nn.Module) -> bool:
    return any(type(m) in _TORCH_RNNS for m in model.modules())


def for_vmapdp(model: nn.Module) -> tuple[nn.Module, str]:
    """The model to hand to vmapdp, and a note on what was done.

    torch's recurrent layers run under ``vmap`` only through a slow per-sample fallback. When
    ``vmapdp.fix`` or ``vmapdp.nn`` exists, a copy with the vmap-friendly twins (same parameter
    names, values and outputs) is returned; otherwise the model itself, with a note saying so.
    """
    if not _has_torch_rnn(model):
        return model, ""
    import vmapdp

    fix = getattr(vmapdp, "fix", None)
    if fix is not None:
        return fix(model), "vmapdp.fix: torch.nn.LSTM -> vmapdp.nn.LSTM"
    try:
        import vmapdp.nn as vnn
    except ImportError:
        return model, "torch.nn.LSTM under vmap (slow per-sample fallback; vmapdp.nn not available)"
    fixed = copy.deepcopy(model)
    for parent in list(fixed.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) in _TORCH_RNNS:
                setattr(parent, child_name, getattr(vnn, type(child).__name__).from_torch(child))
    return fixed, "torch.nn.LSTM -> vmapdp.nn.LSTM.from_torch"


def for_opacus(model: nn.Module) -> nn.Module:
    """A copy for ``opacus.GradSampleModule``: ``nn.LSTM`` -> ``opacus.layers.DPLSTM`` (same weights)."""
    fixed = copy.deepcopy(model)
    if not _has_torch_rnn(fixed):
        return fixed
    from opacus.layers import DPLSTM

    for parent in list(fixed.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.LSTM:
                if child.num_layers != 1 or child.bidirectional or child.proj_size:
                    raise NotImplementedError("for_opacus: only single-layer unidirectional LSTMs are converted")
                dp = DPLSTM(child.input_size, child.hidden_size, bias=child.bias, batch_first=child.batch_first)
                dp.load_state_dict(child.state_dict())
                frozen = {n for n, p in child.named_parameters() if not p.requires_grad}
                for n, p in dp.named_parameters():
                    p.requires_grad_(n not in frozen)
                setattr(parent, child_name, dp)
    return fixed


def one_sample_loss(apply: Callable[..., Tensor]) -> Callable[[dict, dict, tuple[Tensor, Tensor]], Tensor]:
    """``loss_fn(params, buffers, (x, y))`` for ONE sample, for ``vmapdp.per_sample_grads``."""

    def loss_fn(params: dict, buffers: dict, sample: tuple[Tensor, Tensor]) -> Tensor:
        x, y = sample
        return loss(apply(params, buffers, x[None]), y[None])

    return loss_fn
