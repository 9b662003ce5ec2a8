"""Low-rank adapters (LoRA) for DP fine-tuning: :class:`LoRALinear` and :func:`add_lora`.

A frozen backbone with small trainable adapters on its matrix layers: ``nn.Linear``, and layers
following transformers' ``Conv1D`` convention (GPT-2's projections: a 2-D ``weight`` of shape
``(in, out)``, ``nf`` output features, ``y = x @ weight + bias``), recognised without importing
transformers. Only the adapters are parameters, so only they are differentiated, clipped and
noised; the frozen weights travel among the buffers. Plain torch modules, independent of the
recurrent layers in this package.

References:
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LoRALinear", "add_lora", "lora_layers", "is_conv1d"]

logger = logging.getLogger("vmapdp")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` follows transformers' ``Conv1D`` convention (GPT-2's projections): an
    ``nf`` attribute (output features) and a 2-D ``weight`` of shape ``(in, nf)``, used as
    ``x @ weight + bias``. Told by those attributes, so transformers is never imported."""
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    return (
        not isinstance(module, nn.Linear)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and isinstance(nf, int)
        and weight.shape[1] == nf
    )


def _is_matrix_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _no_fused_fast_path(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. Its presence makes ``nn.TransformerEncoderLayer`` (and
    ``nn.TransformerEncoder``) skip their fused inference kernel, which reads ``linear1.weight``
    and ``linear2.weight`` directly and would silently leave the adapters out in eval mode."""
    return None


def _check_lora_args(call: str, rank, alpha) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{call}: rank={rank!r} must be a positive int (the inner dimension of the update B @ A; 4-16 is usual).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"{call}: alpha={alpha!r} must be a positive finite number (the update is scaled by alpha / rank).")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (alpha / rank) * x A^T B^T``.

    Args:
      base: the ``nn.Linear`` to adapt, or a ``Conv1D``-style layer (transformers' GPT-2
        projections, :func:`is_conv1d`: ``weight`` of shape ``(in, out)``, kept in that layout, so
        the layer computes ``x @ weight + bias + (alpha / rank) * x A^T B^T``). Its weight and bias are registered here as frozen
        parameters (``requires_grad=False``) under the same names, ``weight`` and ``bias``, so a
        state dict of the original model loads into the adapted one (``strict=False``) and
        :func:`vmapdp.functionalize` puts them among the buffers: only the adapters are
        differentiated, clipped and noised. They share storage with ``base`` (no copy); ``base``
        itself is not modified (use :func:`add_lora` for an independent copy of a whole model).
      rank: the rank ``r`` of the update ``B @ A``, a positive int.
      alpha: the update is scaled by ``alpha / rank`` (8.0 by default, as in PEFT's ``lora_alpha``),
        so that changing the rank does not change the scale of the update at initialisation.
      generator: a CPU ``torch.Generator`` for ``lora_A``'s initialisation (default: the global RNG).

    Parameters:
      lora_A: ``[rank, in_features]``, trainable, initialised ``N(0, 1 / in_features)``.
      lora_B: ``[out_features, rank]``, trainable, initialised to zeros, so the layer starts out
        computing exactly ``base(x)``.

    Forward: ``x [..., in_features] -> [..., out_features]``, any leading dims. A no-op forward
    pre-hook keeps ``nn.TransformerEncoderLayer``'s fused inference path (which reads
    ``linear1.weight`` directly and would skip the adapter) switched off.

    Example:
      >>> layer = LoRALinear(nn.Linear(64, 32), rank=4)
      >>> [n for n, p in layer.named_parameters() if p.requires_grad]
      ['lora_A', 'lora_B']
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 8.0, *, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        call = "vmapdp.nn.LoRALinear(base, rank)"
        if not _is_matrix_layer(base):
            raise TypeError(
                f"{call}: base must be a torch.nn.Linear or a Conv1D-style layer (2-D weight of shape (in, nf), as "
                f"transformers' GPT-2 uses), got {type(base).__name__}."
            )
        _check_lora_args(call, rank, alpha)
        self.transposed = not isinstance(base, nn.Linear)  # Conv1D: weight is (in, out)
        if self.transposed:
            self.in_features, self.out_features = base.weight.shape
        else:
            self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, float(alpha)
        self.scale = self.alpha / rank
        weight = base.weight
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        a = torch.randn(rank, self.in_features, generator=generator, dtype=weight.dtype) / math.sqrt(self.in_features)
        self.lora_A = nn.Parameter(a.to(weight.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=weight.dtype, device=weight.device))
        self.register_forward_pre_hook(_no_fused_fast_path)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return F.linear(x, weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def merged(self) -> nn.Linear:
        """One ordinary ``nn.Linear`` with weight ``W + (alpha / rank) * B @ A``: the same function,
        for deployment (a new module; nothing here is modified). A Conv1D base becomes an
        ``nn.Linear`` too (its weight transposed)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            out.weight.copy_((self.weight.t() if self.transposed else self.weight) + self.scale * (self.lora_B @ self.lora_A))
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out

    def extra_repr(self) -> str:
        conv = ", conv1d=True" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha:g}{conv}"


def add_lora(
    module: nn.Module,
    rank: int,
    alpha: float = 8.0,
    *,
    targets=None,
    generator: Optional[torch.Generator] = None,
) -> nn.Module:
    """A copy of ``module`` with low-rank adapters on its matrix layers and everything else frozen.

    Args:
      module: any ``nn.Module`` (it is not modified: the result is a deep copy).
      rank, alpha, generator: as in :class:`LoRALinear`.
      targets: which matrix layers get an adapter (``nn.Linear``, and ``Conv1D``-style layers such
        as GPT-2's projections, see :func:`is_conv1d`): ``None`` (default) for all of them, a tuple
        of classes (``nn.Linear`` subclasses or Conv1D-style classes), or a predicate
        ``targets(name) -> bool`` on the qualified module name (``"encoder.layers.0.linear1"``;
        ``""`` for ``module`` itself), applied to the matrix layers only. The output projection of
        ``nn.MultiheadAttention`` is never wrapped: attention reads its weight directly instead of
        calling it, so an adapter there would get no gradient.

    Returns:
      The copy, each targeted layer replaced by a :class:`LoRALinear` (its name keeps the layer's
      position: ``fc.weight`` stays ``fc.weight`` and ``fc.lora_A``, ``fc.lora_B`` are added). What
      was adapted is logged (logger ``"vmapdp"``, INFO) and listed by :func:`lora_layers`. Every parameter but the adapters has ``requires_grad=False``, so
      :func:`vmapdp.functionalize` returns the adapters as ``params`` and the frozen backbone among
      the ``buffers``. To train another layer too (a classifier head), set its
      ``requires_grad_(True)`` on the result.

    Raises:
      ValueError: ``rank <= 0``, ``alpha <= 0``, or no layer matched ``targets``.
      TypeError: ``targets`` is neither a tuple of ``nn.Linear`` classes nor a callable.

    Example:
      >>> model = add_lora(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), rank=4)
      >>> apply, params, buffers = vmapdp.functionalize(model)
      >>> sorted(params)
      ['0.lora_A', '0.lora_B', '2.lora_A', '2.lora_B']
    """
    call = "vmapdp.nn.add_lora(module, rank)"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{call}: module must be an nn.Module, got {type(module).__name__}.")
    _check_lora_args(call, rank, alpha)
    adapted = [name or "<root>" for name, m in module.named_modules() if isinstance(m, LoRALinear)]
    if adapted:
        raise ValueError(
            f"{call}: the model already holds LoRA adapters on {adapted[:5]} (add_lora ran on it before): adding more would "
            "leave the first adapters frozen in the backbone. Call add_lora once, on the base model, with every layer to "
            "adapt (targets=); to train the existing adapters, functionalize the model as it is."
        )
    if isinstance(targets, type):
        targets = (targets,)
    if targets is None:
        wanted = lambda name, m: _is_matrix_layer(m)  # noqa: E731
    elif isinstance(targets, tuple):
        if not targets or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in targets) or any(
            issubclass(t, (nn.modules.conv._ConvNd, nn.Embedding)) for t in targets
        ):
            raise TypeError(
                f"{call}: targets={targets!r} must be a non-empty tuple of nn.Linear (or Conv1D-style) classes, or a "
                "predicate targets(name) -> bool on module names (e.g. lambda name: 'attn' not in name)."
            )
        classes = targets
        wanted = lambda name, m: isinstance(m, classes) and _is_matrix_layer(m)  # noqa: E731
    elif callable(targets):
        predicate = targets
        wanted = lambda name, m: _is_matrix_layer(m) and bool(predicate(name))  # noqa: E731
    else:
        raise TypeError(
            f"{call}: targets must be None, a tuple of nn.Linear (or Conv1D-style) classes or a callable targets(name) -> bool, "
            f"got {type(targets).__name__}."
        )

    new = copy.deepcopy(module)
    new.requires_grad_(False)
    owned_by_attention = {id(m.out_proj) for m in new.modules() if isinstance(m, nn.MultiheadAttention)}
    chosen = [(name, m) for name, m in new.named_modules() if id(m) not in owned_by_attention and wanted(name, m)]
    if not chosen:
        linears = [name or "<root>" for name, m in new.named_modules() if _is_matrix_layer(m)]
        raise ValueError(
            f"{call}: no layer matched targets={targets!r}, so there would be nothing to train. "
            + (f"The model's nn.Linear/Conv1D layers are {linears}." if linears else "The model has no nn.Linear or Conv1D layer.")
            + " Adapters wrap nn.Linear and Conv1D-style layers only (nn.MultiheadAttention's out_proj excluded)."
        )
    names = [name or "<root>" for name, _ in chosen]
    skipped = [name for name, m in new.named_modules() if _is_matrix_layer(m) and id(m) not in {id(c) for _, c in chosen}]
    logger.info("add_lora: adapters (rank %d) on %d layer(s): %s; left frozen without adapter: %s", rank, len(names), names, skipped or "none")
    if chosen[0][0] == "":  # the module itself is a Linear
        return LoRALinear(new, rank, alpha, generator=generator)
    for name, m in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(new.get_submodule(parent_name), child, LoRALinear(m, rank, alpha, generator=generator))
    return new


def lora_layers(module: nn.Module) -> list[str]:
    """The qualified names of the :class:`LoRALinear` layers in ``module`` (what :func:`add_lora`
    adapted), ``"<root>"`` for ``module`` itself."""
    return [name or "<root>" for name, m in module.named_modules() if isinstance(m, LoRALinear)]
