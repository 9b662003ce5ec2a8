"""Small pytree helpers shared by the engine (optree underneath).

The order of a dict's leaves: ``optree`` with ``namespace="torch"`` flattens a dict in SORTED key
order until ``torch.utils._cxx_pytree`` is imported, and in INSERTION order after that (that
module registers torch's dict types in the namespace; the first ``vmap`` of a process imports
it). The leaf order decides which keyed noise stream each leaf draws (:func:`vmapdp.add_noise`:
the leaf's index in the flattened tree), so an ``add_noise`` made before any ``vmap`` would draw
differently from the same call made after one. Importing it here, when vmapdp is imported, fixes
the order to insertion order for the whole process: the order every train step has always used
(its noise is drawn after the per-sample ``vmap``), so no run's noise changes.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import optree
import torch
import torch.utils._cxx_pytree  # noqa: F401  (fixes the dict leaf order: see the docstring)
from torch import Tensor


def path_str(path: tuple) -> str:
    """A readable name for a leaf's path: ``'fc1.weight'`` for a params dict, ``'[1]'`` in a tuple."""
    if not path:
        return "<root>"
    parts = []
    for p in path:
        parts.append(p if isinstance(p, str) else f"[{p}]")
    return ".".join(parts).replace(".[", "[")


def _tensor_dict(tree: Any) -> bool:
    """A dict of tensors keyed by names (params, grads): its leaves are its values in insertion order
    (see above), taken without optree's flatten, which torch.compile traces step by step (the
    checks and sums of a compiled step flatten the params several times: a quarter of a vmap
    step's capture)."""
    return type(tree) is dict and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in tree.items())


def leaves(tree: Any) -> list:
    """``optree.tree_leaves(tree, namespace="torch")``."""
    return list(tree.values()) if _tensor_dict(tree) else optree.tree_leaves(tree, namespace="torch")


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    if _tensor_dict(tree):
        return [(path_str((k,)), v) for k, v in tree.items()]
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False, namespace="torch")
    return [(path_str(p), leaf) for p, leaf in zip(paths, leaves)]


def sample_shapes(tree: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each tensor leaf's path and shape without its batch dim: a sample's shapes, which must not
    depend on the data (a batch padded to its longest row makes every sample's computation depend
    on the others' lengths)."""
    return tuple((p, tuple(x.shape[1:])) for p, x in leaves_with_paths(tree) if isinstance(x, torch.Tensor))


def shapes_differ(what: str, fix: str = "") -> ValueError:
    """The refusal of per-sample shapes that depend on the data (``what``: whose, against what)."""
    return ValueError(
        f"{what}: a sample's shapes must not depend on the data. A batch padded to its longest row makes each "
        "sample's computation depend on the others' lengths (a model's positions, the rounding margins of the "
        "clipped sum), so one sample could move the others' clipped gradients beyond what the accountant assumes. "
        f"Pad every row to one fixed length (a tokenizer's padding='max_length', max_length=N){fix}. Nothing was released."
    )


def batch_size(tree: Any, *, call: str, what: str = "batch") -> int:
    """The common leading dim of every tensor leaf of ``tree``; a clear error otherwise."""
    sizes = []
    for name, leaf in leaves_with_paths(tree):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"{call}: every leaf of {what} must be a tensor with a leading batch dim; "
                f"leaf {name!r} is a {type(leaf).__name__}. Turn it into a tensor or pass it as a "
                "shared argument before the batch."
            )
        if leaf.dim() == 0:
            raise ValueError(
                f"{call}: leaf {name!r} of {what} is a 0-dim tensor; every leaf needs a leading "
                "batch dim B. Did you pass a single sample instead of a batch? Use x[None] for B = 1."
            )
        sizes.append((name, leaf.shape[0]))
    if not sizes:
        raise ValueError(f"{call}: {what} has no tensor leaves, so there is no batch dim to map over.")
    first_name, b = sizes[0]
    bad = [(n, s) for n, s in sizes if s != b]
    if bad:
        listed = ", ".join(f"{n!r} has {s}" for n, s in bad)
        raise ValueError(
            f"{call}: expected the same batch size on dim 0 of every leaf of {what} "
            f"({b}, from {first_name!r}); {listed}. "
            + (
                "Did you pass aggregated instead of per-sample gradients?"
                if what == "grads"
                else f"Every leaf of the {what} must hold one row per sample."
            )
        )
    return b


def check_mask(mask: Any, b: int, *, call: str) -> Tensor:
    if not isinstance(mask, Tensor):
        hint = (
            " Was the mask left out? The step is called step(state, batch, mask, *shared): pass the sampler's mask "
            "(torch.ones(B, dtype=torch.bool) where every row is real) before the buffers."
            if isinstance(mask, (dict, tuple, list)) else ""
        )  # (found by review: step(state, batch, buffers) named only the dict's type)
        raise TypeError(f"{call}: mask must be a bool tensor of shape [{b}], got {type(mask).__name__}.{hint}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{call}: mask must have dtype torch.bool (True = real row, False = padding), got "
            f"{mask.dtype}. Use mask.bool() if it holds 0/1."
        )
    if mask.shape != (b,):
        raise ValueError(f"{call}: mask must have shape [{b}] (one flag per sample), got {tuple(mask.shape)}.")
    return mask


def rows(mask: Tensor, like: Tensor) -> Tensor:
    """``mask`` [B] reshaped to broadcast against ``like`` [B, ...]."""
    return mask.reshape(mask.shape + (1,) * (like.dim() - 1))


def _promotable(dtype: torch.dtype) -> bool:
    try:
        torch.promote_types(dtype, torch.float32)
    except RuntimeError:  # (float8, bit and quantized dtypes)
        return False
    return True


# ``acc_dtype`` of every dtype torch promotes, made once: ``torch.promote_types`` is a dispatched op,
# and ghost clipping asked it ~3 times per param per step (472 of GPT-2 small's 8,823 ops)
_ACC_DTYPES = {
    d: torch.promote_types(d, torch.float32)
    for d in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    if _promotable(d)
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and norms are accumulated in: float32 or wider (float64 stays float64);
    ``torch.promote_types(dtype, torch.float32)``."""
    acc = _ACC_DTYPES.get(dtype)
    return torch.promote_types(dtype, torch.float32) if acc is None else acc  # (None: torch says why it cannot)


NORM_BLOCK = 256  # entries per block of :func:`sq_norms`' first, float32 level


def sq_norms(x: Tensor) -> Tensor:
    """Squared L2 norms of the rows of ``x`` ``[B, ...]`` -> ``[B]`` float64, accurate at any size.

    A float32 reduction over millions of entries loses up to ``n eps``: on CPU, torch 2.13's
    ``vector_norm`` of 4096 x 2048 equal float32 entries is 0.63% low, and a clipped sample with
    such a grad was released at 1.0063 C (found by review). Here each block of ``NORM_BLOCK``
    consecutive entries is reduced in ``x``'s accumulation dtype (relative error <= 256 eps32 =
    1.5e-5 however the reduction is ordered) and the blocks' squares are added in float64; the
    blocks are a strided view (``unfold``), so no copy of ``x`` is made.
    """
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # (not -1: B may be 0)
    acc, n = acc_dtype(x.dtype), flat.shape[1]
    m = n // NORM_BLOCK
    if m == 0:
        return torch.linalg.vector_norm(flat, dim=1, dtype=acc).double().square()
    sq = torch.linalg.vector_norm(flat.unfold(1, NORM_BLOCK, NORM_BLOCK), dim=2, dtype=acc).double().square().sum(1)
    if m * NORM_BLOCK < n:
        sq = sq + torch.linalg.vector_norm(flat[:, m * NORM_BLOCK :], dim=1, dtype=acc).double().square()
    return sq


def zero_rows(tree: Any, keep: Tensor) -> Any:
    """Rows where ``keep`` [B] is False set to exactly 0 (they may hold NaN or inf).

    ``keep`` may live on another device than the leaves (samplers make masks on the CPU). In eager
    mode, when every row is kept, the tree is returned as is (no copy).
    """

    def one(g: Tensor) -> Tensor:
        k = keep.to(g.device)
        return torch.where(rows(k, g), g, torch.zeros((), dtype=g.dtype, device=g.device))

    if not torch.compiler.is_compiling() and bool(keep.all()):
        return tree
    return optree.tree_map(one, tree, namespace="torch")


def check_chunk_size(call: str, chunk_size: Any, name: str = "chunk_size") -> None:
    """``chunk_size`` (vmap's) is None or a positive int."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"{call}: {name} must be a positive int or None, got {chunk_size!r}.")


def tensor_bytes(x: Tensor) -> bytes:
    """The raw bytes of a tensor's elements (row-major, on the CPU), for hashing. Read straight
    from memory: numpy is not a dependency of vmapdp, so ``.numpy()`` is not available everywhere."""
    x = x.detach().cpu().contiguous()
    return ctypes.string_at(x.data_ptr(), x.numel() * x.element_size()) if x.numel() else b""
