"""Ghost clipping: exact per-sample gradient norms and the clipped sum, without per-sample gradients.

DP-SGD needs each sample's gradient *norm* and the *clipped sum*, never the per-sample gradients
themselves. For a layer ``y = x W^T`` a sample's weight gradient is ``G_i = sum_t g_t x_t^T`` (``t``
runs over the positions of a sequence or the pixels of a feature map, ``g = dL/dy``), so

* its norm follows from the layer's inputs and output gradients alone:
  ``||G_i||^2 = sum_{t,s} (x_t . x_s)(g_t . g_s)`` (the "ghost norm"; Goodfellow 2015, Li et al.
  2022), or ``||g^T x||^2`` formed directly when that is cheaper (Bu et al. 2023, "mixed ghost
  clipping": chosen per layer by cost);
* the clipped sum ``sum_i c_i G_i = (c * g)^T x`` is one matmul over the whole batch, the same
  cost as the weight gradient of an ordinary backward ("book-keeping", Bu et al. 2023).

How vmapdp gets ``x`` and ``g`` for a *functional* model, without hooks: the loss is run once,
mapped over the batch with ``vmap``, under a ``TorchFunctionMode`` that watches the calls made
with the trainable params. At a covered op (``F.linear``, ``conv1d/2d/3d``, ``F.embedding``) whose
weight is a param, it keeps the op's input and adds a *tap*, a zero tensor that is an input of the
computation, to its output; one ``vjp`` of the summed loss then returns each tap's gradient, which
is the per-sample output gradient ``g``. The weight gradients themselves are never computed by
autograd. Convolutions go through unfolded patches; embeddings through token equality (never a
vocabulary-sized tensor per sample).

Parameters that no rule covers (LayerNorm's weight, a matrix used with ``@``, attention's packed
projections) are routed, for just those uses, through a per-sample copy (``p.expand(B, ...)``, a
view): the same ``vjp`` returns their per-sample gradients, whose norms join the total. A param
with both kinds of uses gets the exact sum of both. The result is exact: norms and clipped sums
equal the per-sample-gradient engine's up to float rounding, for any model.

Floating point: a sample's norm and its share of the clipped sum come from two different
computations, so their rounding differs; an adversarial sample can make the terms of a ghost
Gram sum cancel (a large component shared by all positions, output grads of alternating sign).
Gram sums are therefore taken in float64, and the clip factor uses the norm plus a margin that
bounds the rounding of both computations (``~ T eps sum_t |u_t||v_t|``; see :func:`_margin`): the
released contribution stays within ``C``, and benign samples see a relative change of ~1e-4 or
less. The returned ``norms`` are the computed norms, without the margin.

The margin bounds a sample's *own* contribution; the guarantee DP needs is on the neighbour
difference, ``||sum(D) - sum(D - {i})|| <= C (1 + tol)``. A book-keeping matmul adds the terms of
all samples in one accumulation, and in float32 a sample with huge cancelling terms (within its
margin) quantises the partial sums of the others (measured: 1.016 C). So every use with more than
one term per sample (sequences, conv positions, embeddings, a param with per-sample-view uses too)
is accumulated in float64, where that cross-talk is ``<= ~B**2 2**-30 C`` (see :func:`_sum_dtype`);
one-term uses (an MLP's layers) stay float32, with ``clip_and_sum``'s rounding. ``tol`` is then
that of ``clip_and_sum``'s float32 sum (``~ 2 B**2 eps`` worst case; < 1e-4 at B = 8 in
tests/test_sensitivity.py). Cost: +27% CPU time for the ghost clipped sum of the CIFAR-10 CNN at
B = 128 (float64 conv backwards of the wide convs), none on an MLP.

Small convs get their per-sample norms from one grouped conv backward; per-sample grads formed
on the way to a norm are then kept (up to ``_KEEP_ELEMENTS`` floats in all, or when no larger
than the layer inputs and output grads they replace) and the clipped sum is a weighted sum of
them, which is both faster than another conv backward or matmul and consistent by construction.

Everything here is a pure function of tensors and runs under ``torch.compile(fullgraph=True)``
(the first call for an input shape runs a one-sample probe eagerly: ``fn.prepare(*args)``, which
``make_train_step`` calls outside the compiled region).
Data-dependent control flow that changes which ops see the params between the first call for a
shape and later calls is refused with an error.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vjp, vmap
from torch.overrides import TorchFunctionMode

from vmapdp import _checks
from vmapdp._tree import acc_dtype, batch_size, check_mask, rows, zero_rows
from vmapdp.errors import UnsupportedModuleError
from vmapdp.clipping import _check_clip_norm, _check_rule, _keep, _weighted_sum, clip_and_sum, clip_factors, grad_norms
from vmapdp.per_sample import _explain_runtime_error, per_sample_grads

__all__ = ["clipped_grad_sum", "full_float32"]

_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_CASTS = {Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type}
# intermediates of one slice of the batch are kept under this many elements (64 MiB in float32)
_SLICE_ELEMENTS = 1 << 24
# convs with at most this many (C_out x C_in / groups) weights per kernel tap get their per-sample
# norms from one grouped conv backward (fast for few channels); wider ones from unfolded patches
_GROUPED_CONV_MAX = 4096
# ... taking at most this many input channels (samples x C_in) per call: mkldnn's grouped
# backward slows down 2x past it (CPU, CIFAR-10 64->64 at 16x16: 13 ms in slices of 32, 26 in 64)
_GROUPED_CHANNELS = 2048
# per-sample grads formed on the way to a norm (small convs, mixed uses) are kept for the clipped
# sum, which is then a weighted sum over the batch instead of one more conv backward, while their
# total stays under this many elements (32 MiB in float32); beyond it they are recomputed
_KEEP_ELEMENTS = 1 << 23
# ... and beyond it when they are at most this many times the elements of the output grads and
# inputs of their uses, which the clipped sum then no longer needs (freed unless shared)
_KEEP_RATIO = 1.0


@dataclass(frozen=True)
class _Site:
    """One call of a covered op whose weight is a trainable param."""

    kind: str  # "linear" | "conv" | "embedding"
    weight: str  # param key of the weight
    bias: str | None  # param key of the bias (None: no bias, or a bias that is not a param)
    out_shape: tuple[int, ...]  # per-sample output shape (the tap's)
    out_dtype: torch.dtype
    meta: tuple = ()  # conv: (dims, stride, padding, dilation, groups, kernel); embedding: (padding_idx,)


@dataclass
class _Plan:
    sites: list[_Site] = field(default_factory=list)
    candidates: list[bool] = field(default_factory=list)  # per covered-op call with a param weight: a site?
    other: list[str] = field(default_factory=list)  # keys with uses no rule covers (sorted)




# The run in progress (a stack, for nesting); a module-level list keeps the mode itself stateless,
# which torch.compile traces without trouble.
_ACTIVE: list["_Run"] = []


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _ACTIVE[-1].call(func, args, kwargs or {})


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _tuple(v: Any, d: int) -> tuple[int, ...]:
    """A conv argument as ``d`` ints (ATen repeats a single int, or a 1-element list, per dim)."""
    if isinstance(v, (tuple, list)):
        return tuple(int(u) for u in v) * (d if len(v) == 1 else 1)
    return (int(v),) * d


def _has_tensor(out: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in optree.tree_leaves(out, namespace="torch"))


_CONTROL_FLOW = (
    "the model used its params differently than in the first call with these input shapes "
    "(data-dependent control flow: another order of layers, other layer arguments, or a param "
    "used in a way it was not before). Use method='vmap' for such models."
)


class _Run:
    """The state of one forward: which tensors are params, the taps to add, what to keep.

    The probe (``plan=None``) runs the loss on one sample and records, in call order, every call
    of a covered op whose weight is a param (a *candidate*), whether it is a *site* (it runs at
    the level of vmapdp's own vmap, not inside a transform of the user's: those calls must be
    differentiated through the transform, so they are uses like any other), and which params
    have other uses (calls that return tensors; shape and dtype queries are not uses). The real
    run checks that every call matches the plan and refuses to go on otherwise.
    """

    def __init__(self, params: dict[str, Tensor], plan: _Plan | None, taps: list[Tensor], expanded: dict[str, Tensor], level: int = -1):
        self.key_of = {id(v): k for k, v in params.items()}
        self.probe = plan is None
        self.plan = plan if plan is not None else _Plan()
        self.taps = taps
        self.expanded = expanded
        self.level = level  # the functorch level of vmapdp's vmap (probe only)
        self.saved: list[Tensor] = []
        self.versions: list[tuple[Tensor, int]] = []
        self.n = 0  # sites seen so far
        self.n_cand = 0  # candidates seen so far
        self.aliases: list[Tensor] = []  # casts of params, kept alive so that their ids stay unique
        self.other: set[str] = set()

    # -- which params does a call use, and how --------------------------------------------------
    def _key(self, t: Any) -> str | None:
        return self.key_of.get(id(t)) if isinstance(t, Tensor) else None

    def _keys_in(self, tree: Any) -> set[str]:
        """The params (by key) among the leaves of a call's arguments."""
        keys = (self._key(leaf) for leaf in optree.tree_leaves(tree, namespace="torch"))
        return {k for k in keys if k is not None}

    def _candidate(self, func, args: tuple, kwargs: dict) -> tuple[str, str, str | None, tuple] | None:
        """A covered op whose weight is a param, in the standard form its rule handles."""
        if func is F.linear:
            x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if not isinstance(w, Tensor) or w.dim() != 2:
                return None
            meta: tuple = ()
            kind = "linear"
        elif func in _CONVS:
            x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            d = _CONVS[func]
            if not isinstance(w, Tensor) or w.dim() != d + 2:
                return None
            padding = _arg(args, kwargs, 4, "padding", 0)
            meta = (
                d,
                _tuple(_arg(args, kwargs, 3, "stride", 1), d),
                padding if isinstance(padding, str) else _tuple(padding, d),
                _tuple(_arg(args, kwargs, 5, "dilation", 1), d),
                int(_arg(args, kwargs, 6, "groups", 1)),
                tuple(w.shape),
            )
            kind = "conv"
        elif func is F.embedding:
            x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), None
            if not isinstance(w, Tensor) or w.dim() != 2:
                return None
            if _arg(args, kwargs, 3, "max_norm") is not None or _arg(args, kwargs, 5, "scale_grad_by_freq", False):
                return None  # renorming / frequency-scaled embeddings: the generic path
            pad = _arg(args, kwargs, 2, "padding_idx")
            if pad is not None and pad < 0:
                pad += w.shape[0]
            meta = (pad,)
            kind = "embedding"
        else:
            return None
        wk = self._key(w)
        if wk is None or not isinstance(x, Tensor) or self._key(x) is not None:
            return None
        if b is not None and (not isinstance(b, Tensor) or tuple(b.shape) != (w.shape[0],)):
            return None  # a broadcasting bias: the generic path
        return kind, wk, self._key(b), meta

    def _swap(self, tree: Any) -> Any:
        """Params with uses no rule covers -> their per-sample copies (views of the param)."""

        def one(v: Any) -> Any:
            k = self._key(v)
            if k is None or k not in self.expanded:
                return v
            e = self.expanded[k]
            return e if e.dtype == v.dtype else e.to(v.dtype)

        return optree.tree_map(one, tree, namespace="torch")

    def _other_use(self, func, args: tuple, kwargs: dict, keys: set[str]) -> Any:
        if self.probe:
            out = func(*args, **kwargs)
            if _has_tensor(out):  # a use that carries gradient (shape/dtype queries do not)
                self.other |= keys
            return out
        out = func(*self._swap(tuple(args)), **self._swap(kwargs))
        if _has_tensor(out) and not keys <= self.expanded.keys():  # (expanded: the plan's other-use keys)
            raise RuntimeError(f"ghost clipping: {_CONTROL_FLOW}")
        return out

    # -- what the probe refuses or records -------------------------------------------------------
    def _inspect(self, func, args: tuple, kwargs: dict) -> None:
        """Probe only: refuse, with the fix, what ghost clipping cannot run."""
        if isinstance(kwargs.get("out"), Tensor):
            raise UnsupportedModuleError(
                f"ghost clipping: the model calls {getattr(func, '__name__', func)}(..., out=...), writing into a "
                "tensor in place during the forward (torch.nn.utils.spectral_norm and "
                "torch.nn.utils.parametrizations.spectral_norm do so in their power iteration); expected "
                "out-of-place ops, because the forward is mapped over the batch. Remove the spectral norm "
                "(or apply it outside the loss), or use method='vmap'."
            )
        if func in (F.embedding, F.embedding_bag) and _arg(args, kwargs, 3, "max_norm") is not None:
            raise UnsupportedModuleError(
                f"ghost clipping: an embedding with max_norm={_arg(args, kwargs, 3, 'max_norm')!r} "
                "(nn.Embedding(max_norm=...)) renormalises the rows of its weight in place during the forward, "
                "from the tokens of the whole batch; expected max_norm=None. Renormalise out of place in the "
                "model (w = w * (max_norm / w.norm(dim=1, keepdim=True)).clamp(max=1)) or drop max_norm."
            )

    # -- the interception ----------------------------------------------------------------------
    def call(self, func, args: tuple, kwargs: dict) -> Any:
        if self.probe:
            self._inspect(func, args, kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        if func in _CASTS and args and self._key(args[0]) is not None and not kwargs.get("copy", False):
            out = func(*args, **kwargs)
            if isinstance(out, Tensor) and out is not args[0]:
                self.key_of[id(out)] = self.key_of[id(args[0])]
                self.aliases.append(out)
            return out
        cand = self._candidate(func, args, kwargs)
        if cand is None:
            keys = self._keys_in((args, kwargs))
            if func is F.embedding and _arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = _embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys) if keys else func(*args, **kwargs)
        kind, wk, bk, meta = cand
        keys = {wk} | ({bk} if bk else set())
        index = self.n_cand
        self.n_cand += 1
        if self.probe:
            out = func(*args, **kwargs)
            level = torch._C._functorch.maybe_get_level(out)
            is_site = level in (self.level, -1)  # not inside a transform of the user's own
            self.plan.candidates.append(is_site)
            if not is_site:
                self.other |= keys
                return out
            self.plan.sites.append(_Site(kind, wk, bk, tuple(out.shape), out.dtype, meta))
            return out
        if index >= len(self.plan.candidates):
            raise RuntimeError(f"ghost clipping: {_CONTROL_FLOW}")
        if not self.plan.candidates[index]:
            if func is F.embedding and _arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = _embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys)
        out = func(*args, **kwargs)
        if self.n >= len(self.plan.sites) or self.plan.sites[self.n] != _Site(kind, wk, bk, tuple(out.shape), out.dtype, meta):
            raise RuntimeError(f"ghost clipping: {_CONTROL_FLOW}")
        x = _arg(args, kwargs, 0, "input")
        tap = self.taps[self.n]
        self.n += 1
        if torch.compiler.is_compiling():
            x = x.clone()  # free when nothing writes to x afterwards (the compiler drops it)
        else:
            self.versions.append(_version_of(x))
        self.saved.append(x)
        return out + tap


def _embedding_with_padding(embedding: Callable, input: Tensor, weight: Tensor, padding_idx: int | None = None, *rest: Any, **kwargs: Any) -> Tensor:
    """``F.embedding(input, weight, padding_idx, ...)`` with the padding rows' gradient zeroed by a
    ``where`` instead of by the op: torch's batching rule for the embedding backward zeroes the
    padding row of the first sample only when the weight is batched (ghost's per-sample views, an
    embedding inside a vmap), so half the gradients were wrong. The forward is the same (padding
    only changes the gradient); the gradient equals the op's for every sample."""
    kwargs = dict(kwargs)
    kwargs.pop("padding_idx", None)
    if padding_idx < 0:
        padding_idx += weight.shape[0]
    out = embedding(input, weight, None, *rest, **kwargs)
    return torch.where((input == padding_idx).unsqueeze(-1), out.detach(), out)


def _version_of(x: Tensor) -> tuple[Tensor, int]:
    """The plain tensor under vmap's wrappers, and its version counter (bumped by in-place writes)."""
    f = torch._C._functorch
    while f.is_batchedtensor(x) or f.is_gradtrackingtensor(x):
        x = f.get_unwrapped(x)
    return x, x._version


def _run_loss(run: _Run, loss_fn: Callable, params: dict[str, Tensor], shared: tuple, sample: Any) -> Tensor:
    """``loss_fn`` on one (vmapped) sample with ``run`` watching its calls."""
    _ACTIVE.append(run)
    try:
        with _Mode():
            return loss_fn(params, *shared, sample)
    finally:
        _ACTIVE.pop()


def _rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The global RNGs (CPU and ``device``'s) restored on exit: random layers (dropout) then draw
    in the real run as if what ran inside (the probe, auto's race) had never run."""
    accelerator = device.type != "cpu"
    return torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type if accelerator else None)


def _probe(loss_fn: Callable, params: dict[str, Tensor], shared: tuple, batch: Any, randomness: str) -> _Plan:
    """Run the loss on one sample to learn which ops see which params (shapes only matter).

    The global RNGs are restored afterwards (the probe's dropout draws are not the step's)."""
    one = optree.tree_map(lambda t: t[:1], batch, namespace="torch")

    run = _Run(params, None, [], {})

    def fwd(sample):
        run.level = torch._C._functorch.maybe_get_level(optree.tree_leaves(sample, namespace="torch")[0])
        return _run_loss(run, loss_fn, params, shared, sample)

    with torch.no_grad(), _rng_kept(next(iter(params.values())).device):
        vmap(fwd, randomness=randomness)(one)
    run.plan.other = sorted(run.other)
    return run.plan


def coverage(plan: _Plan, params: dict[str, Tensor]) -> float:
    """The fraction of trainable elements whose gradients come entirely from covered ops."""
    covered = {s.weight for s in plan.sites} | {s.bias for s in plan.sites if s.bias}
    covered -= set(plan.other)
    total = sum(v.numel() for v in params.values())
    return sum(params[k].numel() for k in covered) / max(total, 1)


# ---------------------------------------------------------------------------------------------
# The per-layer math, on batched tensors (leading dim B), outside vmap.
# ---------------------------------------------------------------------------------------------


def _unfold(x: Tensor, dims: int, kernel: tuple, stride: tuple, dilation: tuple) -> Tensor:
    """Patches ``[N, C * prod(kernel), L]`` of an already padded ``x`` ``[N, C, *spatial]``."""
    if dims == 2:
        return F.unfold(x, kernel, dilation=dilation, stride=stride)
    if dims == 1:
        return F.unfold(x.unsqueeze(2), (1,) + kernel, dilation=(1,) + dilation, stride=(1,) + stride)
    n, c = x.shape[:2]
    for i in range(dims):
        span = dilation[i] * (kernel[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])  # appends the window dim
        if dilation[i] > 1:
            x = x[..., :: dilation[i]]
    # [N, C, *out, *window] -> [N, C, *window, *out]
    perm = (0, 1) + tuple(range(2 + dims, 2 + 2 * dims)) + tuple(range(2, 2 + dims))
    x = x.permute(perm)
    return x.reshape(n, c * math.prod(kernel), -1)


def _conv_padded(x: Tensor, dims: int, padding: Any, kernel: tuple, dilation: tuple) -> Tensor:
    """``x`` ``[N, C, *spatial]`` with the conv's zero padding applied, so the conv uses padding 0."""
    if isinstance(padding, str):
        if padding == "valid":
            return x
        pads: list[int] = []
        for i in reversed(range(dims)):  # F.pad lists the last dim first
            total = dilation[i] * (kernel[i] - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)
    if not any(padding):
        return x
    return F.pad(x, [p for p in reversed(padding) for _ in range(2)])


@dataclass
class _Use:
    """One covered use of a param, as batched tensors (leading dim B).

    ``"pair"``: per-sample grad ``sum_t u_t v_t^T`` with ``u`` ``[B, T, du]``, ``v`` ``[B, T, dv]``
    (linear weights and biases, conv biases). ``"conv"``: ``u`` the output grads ``[B, n, C_out,
    *out]``, ``v`` the padded input ``[B, n, C_in, *in]`` (``n``: a sample's own batch dim, usually
    1), ``extra = (dims, stride, dilation, groups)``. ``"embedding"``: ``u`` grads ``[B, T, d]``,
    ``v`` tokens ``[B, T]``, ``extra`` the vocabulary size.
    """

    kind: str
    u: Tensor
    v: Tensor
    shape: tuple[int, ...]  # the param's shape
    extra: Any = None

    @property
    def t(self) -> int:
        """Positions per sample: ``T``, or ``n * L`` output positions of a conv."""
        return self.u.shape[1] * math.prod(self.u.shape[3:]) if self.kind == "conv" else self.u.shape[1]

    def rows(self, s: int, e: int) -> "_Use":
        """The use restricted to samples ``s:e``."""
        return _Use(self.kind, self.u[s:e], self.v[s:e], self.shape, self.extra)


def _uses(site: _Site, x: Tensor, g: Tensor, params: dict[str, Tensor]) -> list[tuple[str, _Use]]:
    """The (param key, use) pairs of one site, from its saved input ``x`` and tap grad ``g``."""
    b = g.shape[0]
    w = params[site.weight]
    out: list[tuple[str, _Use]] = []
    dt = acc_dtype(g.dtype)
    if site.kind == "linear":
        gg = g.reshape(b, -1, g.shape[-1]).to(dt)
        xx = x.reshape(b, -1, x.shape[-1]).to(dt)
        out.append((site.weight, _Use("pair", gg, xx, tuple(w.shape))))
        if site.bias:
            out.append((site.bias, _Use("pair", gg, gg.new_ones(gg.shape[:2] + (1,)), tuple(params[site.bias].shape))))
    elif site.kind == "conv":
        dims, stride, padding, dilation, groups, kshape = site.meta  # (set by _Run._candidate)
        c_in, c_out = x.shape[-dims - 1], kshape[0]
        xs = _conv_padded(x.reshape((-1, c_in) + tuple(x.shape[-dims:])).to(dt), dims, padding, tuple(kshape[2:]), dilation)
        gs = g.reshape((b, -1, c_out) + tuple(g.shape[-dims:])).to(dt)
        out.append((site.weight, _Use("conv", gs, xs.reshape((b, -1) + tuple(xs.shape[1:])), tuple(w.shape), (dims, stride, dilation, groups))))
        if site.bias:
            u = gs.flatten(3).transpose(2, 3)  # [B, n, L, C_out]
            u = u[:, 0] if u.shape[1] == 1 else u.reshape(b, -1, c_out)  # [B, n*L, C_out], a view when n == 1
            out.append((site.bias, _Use("pair", u, u.new_ones(u.shape[:2] + (1,)), tuple(params[site.bias].shape))))
    else:  # embedding
        (pad,) = site.meta
        tok = x.reshape(b, -1)
        gg = g.reshape(b, -1, g.shape[-1]).to(dt)
        if pad is not None:
            gg = torch.where((tok == pad).unsqueeze(-1), 0.0, gg)
        out.append((site.weight, _Use("embedding", gg, tok, tuple(w.shape), w.shape[0])))
    return out


def _rows_per_slice(b: int, per_sample: int) -> int:
    """How many of ``b`` samples fit a slice of ``_SLICE_ELEMENTS`` intermediates."""
    return max(1, min(b, _SLICE_ELEMENTS // max(per_sample, 1)))


def _slices(b: int, per_sample: int) -> list[tuple[int, int]]:
    step = _rows_per_slice(b, per_sample)
    return [(s, min(s + step, b)) for s in range(0, b, step)]


def _cat(xs: Any) -> Tensor:
    return torch.cat(list(xs)) if len(xs) > 1 else xs[0]


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _pair_sq_norms(u: Tensor, v: Tensor, keep_grads: bool = False, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``||sum_t u_t v_t^T||^2`` per sample, ghost (Gram matrices) or direct, whichever is cheaper,
    the floating-point margin of the norm (see :func:`_margin`), and, when the direct way formed
    them and ``keep_grads``, the per-sample grads ``[B, du, dv]`` (then the margin is 0: the sum
    will use these very numbers). ``dtype``: the dtype the clipped sum is computed in (default
    ``u``'s; conv patches for Grams arrive in float64 already), which the margin is for."""
    dtype = u.dtype if dtype is None else dtype
    b, t, du = u.shape
    dv = v.shape[2]
    ghost = _gram_cheaper(t, du, dv)
    sqs, masses = [], []
    per = u.new_empty(b, du, dv) if keep_grads and not ghost else None
    for s, e in _slices(b, 2 * t * (t + du + dv) if ghost else du * dv):  # (float64 copies in the Gram case)
        us, vs = u[s:e], v[s:e]
        if ghost:
            # float64: the T^2 terms can cancel, and in float32 an adversarial sample can make the
            # computed norm far smaller than the true one (a large shared component in x, output
            # grads of alternating sign)
            u64, v64 = us.double(), vs.double()
            sq, mass = _from_grams(torch.bmm(u64, u64.transpose(1, 2)), torch.bmm(v64, v64.transpose(1, 2)), dtype)
            sqs.append(sq)
            masses.append(mass)
        else:
            g = torch.bmm(us.transpose(1, 2), vs, out=None if per is None else per[s:e])
            sqs.append(torch.linalg.vector_norm(g, dim=(1, 2)).square())
            if per is None:
                masses.append(_mass(us, vs))
    sq = _cat(sqs)
    if per is not None:
        return sq, torch.zeros_like(sq), per
    mass = _cat(masses)
    if ghost:
        return sq, _gram_margin(sq, mass, t, du, dv, dtype), None
    return sq, _margin(t, dtype) * mass, None


def _from_grams(gu: Tensor, gv: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Squared norms ``sum_{t,s} gu_ts gv_ts`` and masses ``sum_t |u_t||v_t|`` (in ``dtype``) of a
    pair from its float64 Gram matrices ``[B, T, T]``: ``|u_t|^2 |v_t|^2`` are their diagonals."""
    t = gu.shape[1]
    diagonals = gu.flatten(1)[:, :: t + 1] * gv.flatten(1)[:, :: t + 1]  # (a strided slice: inductor lowers it)
    return (gu * gv).sum((1, 2)), diagonals.sqrt().sum(1).to(dtype)


def _gram_margin(sq: Tensor, mass: Tensor, t: int, du: int, dv: int, dtype: torch.dtype) -> Tensor:
    """The margin of a norm from float64 Grams of ``T`` positions: the clipped sum's rounding (see
    :func:`_margin`) plus the Gram sum's own, within ``gamma * mass^2`` of the true squared norm."""
    gamma = (du + dv + t * t + 2) * _eps(torch.float64)
    m = mass.double()
    root = sq.clamp_min(0.0).sqrt()
    return _margin(t, dtype) * mass + ((sq.clamp_min(0.0) + gamma * m * m).sqrt() - root)


def _gram_cheaper(t: int, du: int, dv: int) -> bool:
    """Ghost norms (two ``T x T`` Grams) cost less than the direct ``du x dv`` outer product."""
    return t * (du + dv) < du * dv


def _mass(u: Tensor, v: Tensor) -> Tensor:
    """``sum_t |u_t| |v_t|`` per sample. In the tensors' dtype (a float64 copy would cost memory):
    it overflows only for extreme values (|u| ~ 2e19 in float32), and a non-finite margin then
    drops the sample visibly (see ghost_norms_and_sum), never releases it unclipped."""
    return (torch.linalg.vector_norm(u, dim=2) * torch.linalg.vector_norm(v, dim=2)).sum(1)


def _margin(t: int, dtype: torch.dtype) -> float:
    """Relative margin for a per-sample gradient ``sum_t u_t v_t^T`` computed twice, differently.

    Ghost clipping computes a sample's norm and its share of the clipped sum by two different
    float computations; each can be off by ``~ T eps sum_t |u_t| |v_t|`` (worst case, when the
    terms cancel). The clip factor uses ``norm + margin * sum_t |u_t||v_t|`` so that the released
    contribution is within ``C`` however the rounding falls (an adversary can make the terms
    cancel); benign samples see a relative change of ``~ T^1.5 eps``, 1e-4 or less in float32.
    """
    return 2.0 * (t + 2) * _eps(dtype)


def _conv_pair(use: _Use, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A groups=1 conv use as a pair: output grads ``[B, n*L, C_out]`` and patches ``[B, n*L, C_in*k]``
    (in ``dtype``: patches for float64 Grams are unfolded from a float64 input, not copied)."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u.to(dtype), use.v
    b, n, c_out = g.shape[:3]
    patches = _unfold(x.flatten(0, 1).to(dtype), dims, tuple(use.shape[2:]), stride, dilation)  # [B*n, C_in*k, L]
    if n == 1:  # transposed views, no copies
        return g.flatten(3)[:, 0].transpose(1, 2), patches.transpose(1, 2)
    v = patches.reshape(b, n, patches.shape[1], patches.shape[2]).transpose(2, 3).reshape(b, -1, patches.shape[1])
    u = g.flatten(3).transpose(2, 3).reshape(b, -1, c_out)
    return u, v


def _input_gram_cheaper(positions: int, c_in: int, k: int, t: int) -> bool:
    """The patches' Gram from the input's Gram (:func:`_conv_grams`) costs less than from unfolded patches."""
    return positions * positions * c_in + k * t * t < t * t * c_in * k + t * c_in * k


def _conv_grams(use: _Use) -> tuple[Tensor, Tensor]:
    """Float64 Grams ``[B, T, T]`` of a groups=1 conv use's output grads and of its patches, the
    latter from the Gram of the padded input's positions: ``<patch_t, patch_s> = sum_k <x[i_tk],
    x[i_sk]>`` over the kernel offsets ``k`` (``i_tk``: the input position output ``t`` reads at
    offset ``k``; for each ``k`` a strided view of the input Gram). Costs ``P^2 C_in + K T^2`` per
    sample instead of ``T^2 C_in K``, and no patches."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u, use.v  # [B, n, C_out, *out], [B, n, C_in, *in] (padded)
    b, n, c_out = g.shape[:3]
    c_in, in_shape, out_shape, kernel = x.shape[2], tuple(x.shape[3:]), tuple(g.shape[3:]), tuple(use.shape[2:])
    u = g.flatten(3).transpose(2, 3).reshape(b, -1, c_out).double()  # [B, T, C_out]
    gu = torch.bmm(u, u.transpose(1, 2))
    p = math.prod(in_shape)
    xs = x.flatten(3).transpose(2, 3).reshape(b, n * p, c_in).double()  # [B, n*P, C_in]
    gx = torch.bmm(xs, xs.transpose(1, 2)).view((b, n) + in_shape + (n,) + in_shape)
    gv = None
    for offset in itertools.product(*(range(k) for k in kernel)):
        # the input positions every output position reads at this kernel offset: a strided view
        at = tuple(slice(o * dl, o * dl + (m - 1) * st + 1, st) for o, dl, m, st in zip(offset, dilation, out_shape, stride))
        term = gx[(slice(None), slice(None)) + at + (slice(None),) + at]  # [B, n, *out, n, *out]
        gv = term.clone() if gv is None else gv.add_(term)
    return gu, gv.reshape(b, u.shape[1], u.shape[1])


def _conv_backward(use: _Use, grad: Tensor, x: Tensor, groups: int, weight_shape: tuple) -> Tensor:
    dims, stride, dilation, _ = use.extra
    weight = grad.new_empty(weight_shape)
    return torch.ops.aten.convolution_backward(
        grad, x, weight, None, list(stride), [0] * dims, list(dilation), False, [0] * dims, groups, [False, True, False]
    )[1]


def _conv_per_sample(use: _Use) -> Tensor:
    """Per-sample conv weight grads ``[B, *shape]``: one conv backward with the batch as groups."""
    _, _, _, groups = use.extra
    g, x = use.u, use.v
    b, n = g.shape[:2]
    # the sample's own dim n becomes the conv's batch dim; samples become groups
    gg = g.transpose(0, 1).reshape((n, -1) + tuple(g.shape[3:]))
    xx = x.transpose(0, 1).reshape((n, -1) + tuple(x.shape[3:]))
    w = _conv_backward(use, gg, xx, groups * b, (b * use.shape[0],) + use.shape[1:])
    return w.reshape((b,) + use.shape)


def _grouped_path(use: _Use) -> bool:
    """Few channels: the grouped conv backward (no patches in memory) is the fast kernel."""
    c_out, c_in_g = use.shape[:2]
    return use.extra[3] > 1 or c_out * c_in_g <= _GROUPED_CONV_MAX


def _conv_mass(use: _Use) -> Tensor:
    """``sum_t |g_t| |patch_t|`` per sample, without forming the patches (a conv of ``x^2`` with ones)."""
    dims, stride, dilation, _ = use.extra
    g, x = use.u, use.v  # [B, n, C_out, *out], [B, n, C_in, *in] (padded)
    b, n = g.shape[:2]
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    ones = x.new_ones((1, x.shape[2]) + tuple(use.shape[2:]))
    patch_sq = conv(x.flatten(0, 1).square(), ones, stride=stride, dilation=dilation)  # [B*n, 1, *out]
    g_norm = torch.linalg.vector_norm(g.flatten(0, 1), dim=1, keepdim=True).square()
    return (g_norm * patch_sq).sqrt().reshape(b, -1).sum(1)


def _conv_sq_norms(use: _Use, keep_grads: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Squared norms of one conv use, their margin, and the per-sample grads when ``keep_grads``."""
    b = use.u.shape[0]
    if not _grouped_path(use):
        t, du, dv = use.t, use.shape[0], math.prod(use.shape[1:])
        gram = _gram_cheaper(t, du, dv)
        positions = use.v.shape[1] * math.prod(use.v.shape[3:])  # n * padded input positions
        c_in, k = use.v.shape[2], math.prod(use.shape[2:])
        if gram and _input_gram_cheaper(positions, c_in, k, t):
            # the patches' Gram from the input's own (fewer products, no patches in memory)
            per_sample = 2 * positions * positions + positions * c_in + 3 * t * t + t * du
            parts = [_from_grams(*_conv_grams(use.rows(s, e)), use.u.dtype) for s, e in _slices(b, per_sample)]
            sqs, masses = zip(*parts)
            sq, mass = _cat(sqs), _cat(masses)
            return sq, _gram_margin(sq, mass, t, du, dv, use.u.dtype), None
        # patches are unfolded a slice of the batch at a time (float64 ones for Grams)
        parts = [
            _pair_sq_norms(*_conv_pair(use.rows(s, e), torch.float64 if gram else use.u.dtype), keep_grads, use.u.dtype)
            for s, e in _slices(b, 2 * t * (t + du + dv) + t * dv if gram else du * dv + t * dv)
        ]
        sqs, margins, pers = zip(*parts)
        per = None if pers[0] is None else _cat(pers).reshape((b,) + use.shape)
        return _cat(sqs), _cat(margins), per
    rows = max(1, _GROUPED_CHANNELS // use.v.shape[2])  # samples per grouped conv backward (x all their C_in)
    step = min(rows, b) if keep_grads else min(rows, _rows_per_slice(b, math.prod(use.shape)))
    per = use.u.new_empty((b,) + use.shape) if keep_grads else None
    sqs = []
    for s in range(0, b, step):
        g = _conv_per_sample(use.rows(s, s + step))
        sqs.append(torch.linalg.vector_norm(g.flatten(1), dim=1).square())
        if per is not None:
            per[s:s + step] = g
    sq = _cat(sqs)
    if per is not None:  # the clipped sum will use these very numbers: nothing to reconcile
        return sq, torch.zeros_like(sq), per
    return sq, _margin(use.t, sq.dtype) * _conv_mass(use), None


def _embedding_sq_norms(g: Tensor, tok: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """``||sum_t e_{tok_t} g_t^T||^2`` per sample, by summing the grads of equal (sample, token)
    pairs, and its margin. One flat sort of ``row * vocab + token`` groups the pairs; sizes stay
    static (at most ``B*T`` groups) for torch.compile, and no tensor is vocab-sized per sample."""
    b, t, d = g.shape
    if t == 0:
        return g.new_zeros(b), g.new_zeros(b)
    srt, perm = (torch.arange(b, device=tok.device).unsqueeze(1) * vocab + tok).flatten().sort()
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    group = first.cumsum(0) - 1  # the group of each sorted position
    group_of = torch.empty_like(group).scatter_(0, perm, group)  # ... of each position
    sums = g.new_zeros(b * t, d).index_add_(0, group_of, g.reshape(-1, d))
    row_of_group = torch.zeros_like(group).scatter_(0, group, srt // vocab)  # unused groups: row 0, sum 0
    sq = g.new_zeros(b).index_add_(0, row_of_group, torch.linalg.vector_norm(sums, dim=1).square())
    return sq, _margin(t, g.dtype) * torch.linalg.vector_norm(g, dim=2).sum(1)


def _per_sample(use: _Use) -> Tensor:
    """The materialised per-sample grads ``[B, *shape]`` of one use (for params with mixed uses)."""
    b = use.u.shape[0]
    if use.kind == "pair":
        return torch.bmm(use.u.transpose(1, 2), use.v).reshape((b,) + use.shape)
    if use.kind == "conv":
        return _conv_per_sample(use)
    vocab = use.extra
    g, tok = use.u, use.v
    out = g.new_zeros(b, vocab, g.shape[-1])
    return out.scatter_add(1, tok.unsqueeze(-1).expand_as(g), g).reshape((b,) + use.shape)


def _sum_dtype(uses: list[_Use], other: bool, dtype: torch.dtype) -> torch.dtype:
    """The dtype the book-keeping sum of one param is accumulated in (see :func:`_weighted`).

    One matmul (conv backward, index_add) adds the ``T`` terms ``w_i u_it v_it^T`` of *every*
    sample ``i``; its rounding is ``<= gamma_N sum_i w_i M_i`` (``N = B T`` terms, ``M_i = sum_t
    |u_it| |v_it|`` the mass). The margin only bounds ``w_i M_i`` by ``C / (2 (T + 2) eps)``: a
    sample whose terms cancel (huge mass, small norm) is clipped within its own rounding, yet in
    float32 it quantises the *other* samples' partial sums (measured: the neighbour difference
    reached 1.016 C). Accumulated in float64 that cross-talk is ``<= gamma64_N * B * C / (2 T
    eps32) ~ B**2 * 2**-30 * C`` (1.5e-5 C at B = 128). With ``T = 1`` and no other uses a term is
    the sample's whole grad (``w_i M_i = ||w_i G_i|| <= C``: nothing can cancel), and the float32
    sum's rounding ``gamma_B * B * C`` is the same as :func:`vmapdp.clip_and_sum`'s: it stays in
    float32. A param with per-sample-view uses too (whose grads may cancel against the covered
    ones) is summed in float64 as a whole."""
    if dtype != torch.float32:
        return dtype  # float64 stays float64
    if other or any(u.t > 1 for u in uses):
        return torch.float64
    return dtype


def _weighted(use: _Use, w: Tensor, keep: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
    """``sum_i w_i G_i`` of one use, with ``G_i`` never formed (book-keeping), accumulated in
    ``dtype`` (default the use's; see :func:`_sum_dtype`).

    Rows where ``keep`` is False (not None) are zeroed first: they may hold NaN, and ``0 * NaN``
    is NaN.
    """
    u, v = use.u, use.v
    if dtype is not None and dtype != u.dtype:
        u = u.to(dtype)
        if use.kind != "embedding":
            v = v.to(dtype)
    if keep is not None:
        u = torch.where(rows(keep, u), u, 0.0)
        if use.kind != "embedding":
            v = torch.where(rows(keep, v), v, 0.0)
    uw = u * rows(w.to(u.dtype), u)
    if use.kind == "pair":
        return (uw.reshape(-1, uw.shape[-1]).T @ v.reshape(-1, v.shape[-1])).reshape(use.shape)
    if use.kind == "conv":
        return _conv_backward(use, uw.flatten(0, 1), v.flatten(0, 1), use.extra[3], use.shape)
    flat = uw.reshape(-1, uw.shape[-1])
    return uw.new_zeros(use.extra, uw.shape[-1]).index_add(0, v.reshape(-1), flat).reshape(use.shape)


def _use_margin(use: _Use) -> Tensor:
    if use.kind == "pair":
        mass = _mass(use.u, use.v)
    elif use.kind == "conv":
        mass = _conv_mass(use)
    else:
        mass = torch.linalg.vector_norm(use.u, dim=2).sum(1)
    return _margin(use.t, use.u.dtype) * mass


def _merged(uses: list[_Use], joined: dict[tuple[int, ...], tuple[list[Tensor], Tensor]]) -> list[_Use]:
    """A param's uses with the same rule joined into one (an RNN cell's weight is used once per
    time step): ``"pair"`` and ``"embedding"`` uses concatenate along T, so that the norm and the
    clipped sum each take one call, not one per use. ``joined`` caches the concatenations by the
    identity of their parts: params whose uses share tensors (a cell's input and hidden weights
    share the gate grads, a weight and its bias the output grads) share one copy."""
    if len(uses) < 2 or len({u.kind for u in uses}) > 1 or uses[0].kind == "conv":
        return uses

    def cat(parts: list[Tensor]) -> Tensor:
        key = tuple(id(t) for t in parts)
        if key not in joined:  # (the parts stay in the cache too: their ids cannot be reused meanwhile)
            joined[key] = (parts, torch.cat(parts, 1))
        return joined[key][1]

    first = uses[0]
    return [_Use(first.kind, cat([u.u for u in uses]), cat([u.v for u in uses]), first.shape, first.extra)]


def _merge_all(uses: dict[str, list[_Use]]) -> dict[str, list[_Use]]:
    joined: dict = {}
    return {key: _merged(u, joined) for key, u in uses.items()}


def _held(uses: list[_Use]) -> int:
    """Elements of the output grads and inputs the uses hold (tokens not counted)."""
    return sum(u.u.numel() + (u.v.numel() if u.kind != "embedding" else 0) for u in uses)


def _sq_norms(uses: list[_Use], other: Tensor | None, keep_grads: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Squared per-sample norms of one param's gradient (the sum of all its uses, see
    :func:`_merged`), the margin of the norm (see :func:`_margin`), and the per-sample grads when
    they had to be formed and ``keep_grads`` allows keeping them (then the sum uses the same
    numbers and the margin is 0)."""
    if other is None and len(uses) == 1:
        (use,) = uses
        if use.kind == "conv":
            return _conv_sq_norms(use, keep_grads)
        if use.kind == "pair":
            sq, margin, per = _pair_sq_norms(use.u, use.v, keep_grads)
            return sq, margin, None if per is None else per.reshape((per.shape[0],) + use.shape)
        return (*_embedding_sq_norms(use.u, use.v, use.extra), None)
    total = None if other is None else other.to(acc_dtype(other.dtype))
    for u in uses:
        p = _per_sample(u)
        total = p if total is None else total + p
    sq = torch.linalg.vector_norm(total.reshape(total.shape[0], -1), dim=1).square()
    if keep_grads:
        return sq, torch.zeros_like(sq), total
    margin = torch.zeros_like(sq)
    for u in uses:  # the other uses' per-sample grads are summed as they are: no margin for them
        margin = margin + _use_margin(u).to(sq.dtype)
    return sq, margin, None


def ghost_norms_and_sum(
    loss_fn: Callable[..., Tensor],
    params: dict[str, Tensor],
    shared: tuple,
    batch: Any,
    mask: Tensor | None,
    weights_fn: Callable[[Tensor], Tensor] | None,
    *,
    randomness: str = "error",
    plan: _Plan | None = None,
    call: str = "ghost clipping",
) -> tuple[Tensor, dict[str, Tensor] | None, Tensor]:
    """Per-sample norms ``[B]`` and ``sum_i w_i g_i`` from one forward and one backward.

    ``weights_fn(norms)`` returns the per-sample clip factors (rows that must not contribute get
    weight 0 here); with ``weights_fn=None`` only the norms are computed. Returns
    ``(norms, summed or None, losses)``; masked rows get norm 0 and loss 0.
    """
    if not isinstance(params, dict):
        raise TypeError(f"{call}: params must be a dict of tensors keyed like named_parameters(), got {type(params).__name__}.")
    b = batch_size(batch, call=call)
    if mask is not None:
        check_mask(mask, b, call=call)
    params = {k: v.detach() for k, v in params.items()}
    if plan is None:
        plan = _probe(loss_fn, params, shared, batch, randomness)
    device = next(iter(params.values())).device
    # zero taps as broadcast views of one zero: no memory, no fill; their grads come back dense
    zero = torch.zeros((), dtype=acc_dtype(next(iter(params.values())).dtype), device=device)
    taps = [zero.to(s.out_dtype).expand((b,) + s.out_shape) for s in plan.sites]
    expanded = {k: params[k].expand((b,) + tuple(params[k].shape)) for k in plan.other}

    def fwd(taps, expanded, sample):
        run = _Run(params, plan, taps, expanded)
        loss = _run_loss(run, loss_fn, params, shared, sample)
        if run.n != len(plan.sites) or run.n_cand != len(plan.candidates):
            raise RuntimeError(f"{call}: {_CONTROL_FLOW}")
        if any(t._version != v for t, v in run.versions):
            raise RuntimeError(
                f"{call}: the model wrote in place into the input of a linear, conv or embedding layer after "
                "the layer read it; ghost clipping needs that input unchanged. Write out of place "
                "(y = x * 3 instead of x.mul_(3)), or use method='vmap'."
            )
        return loss, run.saved

    def mapped(taps, expanded):
        return vmap(fwd, in_dims=(0, 0, 0), randomness=randomness)(taps, expanded, batch)

    losses, backward, saved = vjp(mapped, taps, expanded, has_aux=True)
    if losses.shape != (b,):
        raise ValueError(f"{call}: loss_fn must return a scalar for one sample; it returned shape {tuple(losses.shape[1:])} per sample.")
    real = torch.ones(b, dtype=torch.bool, device=device) if mask is None else mask.to(device)
    tap_grads, other_grads = backward(real.to(losses.dtype))
    del backward  # frees the forward's saved tensors before the norms are computed

    uses: dict[str, list[_Use]] = {}
    for site, x, g in zip(plan.sites, saved, tap_grads):
        for key, use in _uses(site, x, g, params):
            uses.setdefault(key, []).append(use)
    del saved, tap_grads  # from here on only `uses` holds layer inputs and output grads
    sq = torch.zeros(b, dtype=acc_dtype(next(iter(params.values())).dtype), device=device)
    kept: dict[str, Tensor] = {}  # per-sample grads that were formed anyway, kept within a budget
    safe_sq = torch.zeros(b, dtype=torch.float64, device=device)
    budget = _KEEP_ELEMENTS if weights_fn is not None else 0
    uses = _merge_all(uses)  # the per-use tensors that were joined are freed here (unless shared)
    for key in params:
        if key in uses or key in other_grads:
            size = b * params[key].numel()
            # per-sample grads that get formed are kept while they fit the budget, or when they are
            # no larger than the output grads and inputs of their uses: those are then released,
            # which frees their memory unless other params' uses share them (a bias shares the
            # output grads, sibling layers an input); so keeping adds at most that much
            keep = weights_fn is not None and (size <= budget or size <= _KEEP_RATIO * _held(uses.get(key, [])))
            sq_k, margin_k, per = _sq_norms(uses.get(key, []), other_grads.get(key), keep)
            if per is not None:
                kept[key] = per
                if size <= budget:
                    budget -= size
                uses.pop(key, None)  # the clipped sum will come from `per`: free its inputs and output grads
            sq_k = sq_k.to(sq.dtype).clamp_min(0.0)  # (a float64 Gram sum can round below 0)
            sq = sq + sq_k
            safe_sq = safe_sq + (sq_k.double().sqrt() + margin_k.double()).square()
    norms = torch.where(real, sq.sqrt(), 0.0)
    # the clip factor uses an upper bound on the norm that covers the rounding of the two
    # computations (norm, and clipped sum) ghost clipping does for a sample: see _margin
    safe = torch.where(real, safe_sq.sqrt(), 0.0)
    # a bound that is not finite (extreme values) must not turn into a factor of 1 or NaN: such a
    # sample is dropped like a non-finite one, and its norm reported as inf so that it is counted
    norms = torch.where(torch.isfinite(safe), norms, torch.inf)
    safe = safe.to(norms.dtype)
    losses = torch.where(real, losses, 0.0)
    if weights_fn is None:
        return norms, None, losses

    keep = real & torch.isfinite(norms)
    w = torch.where(keep, weights_fn(safe), 0.0)
    # rows that must not contribute may hold NaN; zero them unless every row is kept (eager check)
    zero = None if (not torch.compiler.is_compiling() and bool(keep.all())) else keep
    # per-sample grads at hand (kept, or of uses no rule covers): clip_and_sum's weighted sum
    # (each w_i g_i of these has norm <= C: summed in float32 their rounding is clip_and_sum's)
    per_sample = {k: kept[k] if k in kept else other_grads[k] for k in params if k in kept or (k in other_grads and k not in uses)}
    summed = _weighted_sum(per_sample if zero is None else zero_rows(per_sample, zero), w)
    for key, p in params.items():
        if key in summed:  # kept (every use of it is in its per-sample grads), or other uses only
            continue
        dtype = acc_dtype(p.dtype)
        wide = _sum_dtype(uses.get(key, []), key in other_grads, dtype)
        total = torch.zeros(p.shape, dtype=wide, device=device)
        if key in other_grads:
            other = {key: other_grads[key]} if zero is None else zero_rows({key: other_grads[key]}, zero)
            total = total + _weighted_sum({key: other[key].to(wide)}, w)[key]
        for use in uses.get(key, []):
            total = total + _weighted(use, w, zero, wide)
        summed[key] = total.to(dtype)
    return norms, {k: summed[k] for k in params}, losses


# ---------------------------------------------------------------------------------------------
# The public, clip_and_sum-level API: one function, three exact methods.
# ---------------------------------------------------------------------------------------------

METHODS = ("auto", "vmap", "ghost", "two_pass")
# "auto" races "vmap" only while its per-sample grads (B x trainable elements) stay under this
# many elements (256 MiB in float32); beyond it ghost (which covers the rest by per-sample views)
_AUTO_VMAP_ELEMENTS = 1 << 26
# ... and times each candidate this many times after one warm-up call, keeping the best
_AUTO_ROUNDS = 2


def auto_candidates(plan: _Plan | None, params: dict[str, Tensor], batch_rows: int) -> list[str]:
    """The exact methods ``"auto"`` times for a batch of ``batch_rows``: ``"ghost"`` when it covers
    any param, ``"vmap"`` when its per-sample grads fit ``_AUTO_VMAP_ELEMENTS`` (or nothing else
    applies). ``"two_pass"`` (vmap in chunks, for memory) is never raced."""
    out = ["ghost"] if plan is not None and coverage(plan, params) > 0 else []
    if not out or batch_rows * sum(v.numel() for v in params.values()) <= _AUTO_VMAP_ELEMENTS:
        out.append("vmap")
    return out


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on an accelerator (a no-op on the CPU)."""
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) if device.type != "cpu" else None
    if sync is not None:
        sync()


def _elapsed(name: str, run: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``run`` takes (the device synchronised before and after)."""
    del name  # (tests replace this function and time by name)
    _synchronize(device)
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def race(runs: dict[str, Callable[[], Any]], device: torch.device) -> str:
    """The name of the fastest of ``runs`` (zero-argument calls of exact methods on the same chunk).

    Each is called once to warm up (and compile, when compiled), then ``_AUTO_ROUNDS`` times in
    turn; the best time of each decides. The results are dropped: nothing is released. The global
    RNGs (CPU and ``device``'s) are restored afterwards, so random layers (dropout) draw in the
    step as if no race had run. A candidate that runs out of memory drops out (unless it is the
    last one).
    """
    if len(runs) == 1:
        return next(iter(runs))
    runs = dict(runs)
    with _rng_kept(device):
        for name in list(runs):
            try:
                runs[name]()
            except RuntimeError as err:
                if not _out_of_memory(err) or len(runs) == 1:
                    raise
                del runs[name]
        best = {name: math.inf for name in runs}
        for _ in range(_AUTO_ROUNDS):
            for name, run in runs.items():
                best[name] = min(best[name], _elapsed(name, run, device))
    return min(best, key=best.__getitem__)


def _shape_key(args: tuple) -> tuple:
    """What a plan depends on: the arguments' leaves by path (param names included), shapes, dtypes.

    Sorted by path, so that the key does not depend on the order optree lists dict entries in.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(args, namespace="torch")
    items = [
        (repr(p), (tuple(t.shape), t.dtype, t.device.type) if isinstance(t, Tensor) else (type(t).__name__, repr(t)))
        for p, t in zip(paths, leaves)
    ]
    return tuple(sorted(items))


@contextlib.contextmanager
def full_float32(device_type: str):
    """TF32 off for CUDA convs and matmuls while it is open (a no-op elsewhere).

    Ghost clipping computes a sample's norm and its share of the clipped sum in two different
    ways; ghost's margin bounds their difference for float32 rounding
    (eps 2**-24), which TF32's 10-bit mantissa (2**-11) would exceed by far (an adversarial sample
    was shown to release 1.9 C under simulated TF32). cuDNN allows TF32 for float32 convs by
    default; ``make_train_step`` holds this open around every chunk.
    """
    if device_type != "cuda":
        yield
        return
    flags = _fp32_precision_flags()
    if flags:
        # torch >= 2.9: fp32_precision, the only API to touch (reading or writing the legacy
        # allow_tf32 flags after TF32 was set through it raises)
        saved = [getattr(obj, "fp32_precision") for obj in flags]
        try:
            for obj in flags:
                obj.fp32_precision = "ieee"
            yield
        finally:
            for obj, value in zip(flags, saved):
                obj.fp32_precision = value
        return
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def _fp32_precision_flags() -> list[Any]:
    """The backends whose float32 precision ``full_float32`` sets through torch's fp32_precision API
    (cuBLAS matmuls, cuDNN convs and RNNs), or [] on a torch without it (before 2.9)."""
    cudnn = torch.backends.cudnn
    objs = [torch.backends.cuda.matmul, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    return objs if all(o is not None and hasattr(o, "fp32_precision") for o in objs) else []


def clipped_grad_sum(
    loss_fn: Callable[..., Tensor],
    *,
    l2_clip_norm: float,
    method: str = "auto",
    rule: str = "clip",
    stability: float = 0.01,
    nonfinite: str = "zero",
    randomness: str = "error",
    norm_chunk_size: int | None = None,
) -> Callable[..., tuple[dict[str, Tensor], Tensor, Tensor]]:
    """The clipped sum of per-sample gradients straight from a one-sample loss.

    ``fn = clipped_grad_sum(loss_fn, l2_clip_norm=C)`` and ``fn(params, *shared, batch, mask=None)``
    return ``(summed, norms, losses)``: exactly what ``clip_and_sum(per_sample_grads(loss_fn)(...),
    C, mask=mask)`` gives (float rounding aside), plus the per-sample losses, computed by one of:

    * ``"vmap"``: per-sample gradients (``vmap(grad)``), then :func:`vmapdp.clip_and_sum`.
      Memory ``B x params``; works for every model.
    * ``"ghost"``: per-sample norms from layer inputs and output gradients and the clipped sum by
      book-keeping (see this module's docstring): one forward and one backward, no per-sample
      gradients for linear, conv and embedding weights. Memory: non-private training's plus every
      covered layer's output gradients (1.4-1.9x on the CIFAR-10 CNN).
    * ``"two_pass"``: per-sample grads by the vmap engine, ``norm_chunk_size`` samples at a time;
      each chunk is clipped and added to the sum before the next is computed. Peak memory
      ``norm_chunk_size x (params + one sample's activations)``, for any model, dropout included.
      The sum is of the very per-sample grads whose norms were clipped, as with ``"vmap"``. (It
      used to take the sum from one batched backward of ``sum_i w_i loss_i``: that backward's
      rounding is relative to the whole batch, so in bfloat16 one benign sample moved the update
      by 32 C, in float32 a sample with cancelling terms moved the others' by 1.015 C, and ops
      whose batched backward couples samples, such as ``scale_grad_by_freq``, broke the bound.)
    * ``"auto"`` (default): the faster of ``"ghost"`` and ``"vmap"`` for this model and batch,
      timed on the first call for each input shape (each run once to warm up, then twice; see
      :func:`race`); ``"vmap"`` is raced only while its per-sample grads fit 256 MiB, ``"ghost"``
      only when it covers any param. ``fn.chosen_methods`` holds the choices. The methods agree
      up to float rounding; for bitwise-reproducible runs (and resumes) name the method. Traced
      by ``torch.compile`` before any eager call, nothing can be timed: the graph then runs
      ``"ghost"`` where it covers a param (call ``fn`` once eagerly first to race).

    Every method gives each sample's contribution a norm ``<= C`` (up to float rounding), and
    the released sums of neighbouring batches (with and without one sample) differ by at most
    ``C (1 + tol)``, with ``tol`` ``clip_and_sum``'s float32 summation rounding (``~ 2 B**2 eps``
    worst case; ghost: see :func:`_sum_dtype`; tests/test_sensitivity.py checks it with crafted
    samples), and drops masked and non-finite rows exactly (see :func:`vmapdp.clip_and_sum` for ``rule``, ``stability`` and ``nonfinite``).
    """
    call = "clipped_grad_sum(loss_fn)"
    if not callable(loss_fn):
        raise TypeError(f"{call}: loss_fn must be callable, got {type(loss_fn).__name__}.")
    _checks.choice(call, "method", method, METHODS)
    _check_rule(call, rule, stability, nonfinite)
    _check_clip_norm(call, "l2_clip_norm", l2_clip_norm)
    _checks.optional_positive_int(call, "norm_chunk_size", norm_chunk_size)
    grads_fn = per_sample_grads(loss_fn, return_loss=True, randomness=randomness)
    plans: dict[tuple, _Plan] = {}
    chosen: dict[tuple, str] = {}  # "auto"'s choice per input shape

    def weights(norms: Tensor) -> Tensor:
        return clip_factors(norms, l2_clip_norm, rule=rule, stability=stability)

    def by_vmap(params, shared, batch, mask):
        grads, losses = grads_fn(params, *shared, batch, mask=mask)
        summed, norms = clip_and_sum(grads, l2_clip_norm, mask=mask, rule=rule, stability=stability, nonfinite=nonfinite)
        return summed, norms, losses

    def by_two_pass(params, shared, batch, mask):
        # Per-sample grads norm_chunk_size rows at a time, each chunk clipped and added to the sum
        # at once: the sum is of the very numbers whose norms were clipped (as vmap's), so every
        # bound of clip_and_sum holds. (It used to be one batched backward of the reweighted
        # losses, whose rounding is relative to the whole batch: 32 C in bfloat16, 1.015 C in
        # float32 next to a sample with cancelling terms, and ops such as scale_grad_by_freq
        # coupled the samples in it.)
        b = batch_size(batch, call=call)
        size = norm_chunk_size or b
        real = torch.ones(b, dtype=torch.bool) if mask is None else mask
        norms, losses, summed = [], [], None
        for s in range(0, b, size):
            chunk = optree.tree_map(lambda t: t[s : s + size], batch, namespace="torch")
            g, lo = grads_fn(params, *shared, chunk)
            part, n = clip_and_sum(g, l2_clip_norm, mask=real[s : s + size], rule=rule, stability=stability, nonfinite="zero")
            summed = part if summed is None else {k: summed[k] + part[k] for k in summed}
            norms.append(n)
            losses.append(lo)
            del g, part  # one chunk's per-sample grads at a time
        norms_t = torch.cat(norms)
        if nonfinite == "raise":  # (after all chunks: the error names the rows of the whole batch)
            _keep(norms_t, real.to(norms_t.device), nonfinite, call)
        return summed, norms_t, torch.where(real.to(norms_t.device), torch.cat(losses), 0.0)

    # an fp16 loss with a static loss_scale (vmapdp.mixed_precision): ghost runs the form whose
    # params reach the layers as casts, with gradients grad_scale times the loss's, and divides the
    # (power-of-two) scale out of its norms and sum exactly
    grad_scale, ghost_loss = getattr(loss_fn, "_vmapdp_loss_scale", (1.0, loss_fn))

    def by_ghost(params, shared, batch, mask, plan):
        try:
            if grad_scale == 1.0:
                norms, summed, losses = ghost_norms_and_sum(loss_fn, params, shared, batch, mask, weights, randomness=randomness, plan=plan, call=call)
            else:
                norms, summed, losses = ghost_norms_and_sum(
                    ghost_loss, params, shared, batch, mask, lambda n: weights(n / grad_scale), randomness=randomness, plan=plan, call=call
                )
                norms, summed = norms / grad_scale, {k: v / grad_scale for k, v in summed.items()}
        except RuntimeError as err:
            raise _explain_runtime_error(call, err) from err
        if nonfinite == "raise":
            _keep(norms, mask, nonfinite, call)
        return summed, norms, losses

    def planned(args: tuple) -> tuple[tuple, _Plan | None]:
        if method in ("vmap", "two_pass") or batch_size(args[-1], call=call) == 0:
            return (), None
        key = _shape_key(args)
        plan = plans.get(key)
        if plan is None:
            try:
                plan = _probe(ghost_loss, {k: v.detach() for k, v in args[0].items()}, tuple(args[1:-1]), args[-1], randomness)
            except RuntimeError as err:
                raise _explain_runtime_error(call, err) from err
            plans[key] = plan
        return key, plan

    def prepare(*args: Any) -> _Plan | None:
        """Learn (once per input shape) which ops see which params; call it outside torch.compile."""
        return planned(args)[1]

    def choose(key: tuple, plan: _Plan | None, params, shared, batch, mask) -> str:
        """``"auto"``'s method for this input shape: the fastest candidate, timed on the first call
        (while tracing for torch.compile nothing can be timed: then ghost if it covers any param)."""
        if key not in chosen:
            names = auto_candidates(plan, params, batch_size(batch, call=call))
            if torch.compiler.is_compiling():
                return names[0]
            runs = {"ghost": lambda: by_ghost(params, shared, batch, mask, plan), "vmap": lambda: by_vmap(params, shared, batch, mask)}
            chosen[key] = race({m: runs[m] for m in names}, next(iter(params.values())).device)
        return chosen[key]

    def fn(*args: Any, mask: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        try:
            return dispatch(*args, mask=mask)
        except RuntimeError as err:
            if "saved tensor hooks" in str(err):
                raise UnsupportedModuleError(
                    f"{call}: the loss uses torch.utils.checkpoint (or other saved tensor hooks), which "
                    "torch.func's grad/vjp (used by every method: vmap, ghost, two_pass) refuse: 'torch.func."
                    "{grad, vjp, ...} don't yet support saved tensor hooks'. Expected a loss without "
                    "checkpoint; to bound memory use physical_batch_size (make_train_step) or "
                    "method='two_pass' with a small norm_chunk_size instead."
                ) from err
            raise

    def dispatch(*args: Any, mask: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        if len(args) < 2:
            raise TypeError(f"{call}: expected fn(params, *shared, batch, mask=None); got {len(args)} positional arguments.")
        params, shared, batch = args[0], tuple(args[1:-1]), args[-1]
        _checks.params_dict(call, params, require_dict=False)
        if mask is not None:
            check_mask(mask, batch_size(batch, call=call), call=call)
        if method == "vmap" or batch_size(batch, call=call) == 0:
            return by_vmap(params, shared, batch, mask)
        # (compiled, the caller holds it open: make_train_step does, around the compiled chunk)
        eager = not torch.compiler.is_compiling()
        with full_float32(next(iter(params.values())).device.type) if eager else contextlib.nullcontext():
            if method == "two_pass":
                return by_two_pass(params, shared, batch, mask)
            key, plan = planned(args)
            if method == "auto" and choose(key, plan, params, shared, batch, mask) == "vmap":
                return by_vmap(params, shared, batch, mask)
            return by_ghost(params, shared, batch, mask, plan)

    fn.prepare = prepare  # type: ignore[attr-defined]
    fn.chosen_methods = chosen  # type: ignore[attr-defined]
    return fn

