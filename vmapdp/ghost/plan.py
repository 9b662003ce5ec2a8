"""Ghost clipping's tracer: which calls see which params, and the plan a probe makes of them.

The loss runs mapped over the batch under a ``TorchFunctionMode`` (``Mode``) that hands each call
to a ``Run``. A call of a covered op (rules.py) whose weight is a param is a *site*: the run keeps
its input and adds a tap (a zero input of the computation) to its output, whose gradient is the
per-sample output gradient. Every other use of a param is routed through a per-sample copy. The
probe (``probe``) runs one sample eagerly and records the sites in call order (a ``Plan``); the
real run checks every call against the plan and refuses data-dependent control flow.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap
from torch.overrides import TorchFunctionMode

from vmapdp.errors import UnsupportedModuleError
from vmapdp.ghost.rules import RULES
from vmapdp.ghost.uses import Site, arg

__all__ = ["Plan", "Run", "Mode", "probe", "coverage", "run_loss", "rng_kept", "CONTROL_FLOW"]


_CASTS = {Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type}


@dataclass
class Plan:
    """What the probe learned of a loss for one input shape: its sites in call order, which
    covered-op calls are sites, and which params have uses no rule covers."""

    sites: list[Site] = field(default_factory=list)
    candidates: list[bool] = field(default_factory=list)  # per covered-op call with a param weight: a site?
    other: list[str] = field(default_factory=list)  # keys with uses no rule covers (sorted)
    uncovered: dict[str, list[str]] = field(default_factory=dict)  # those keys -> the ops of those uses

    def describe(self, params: dict[str, Tensor]) -> str:
        """What ghost clipping covers of ``params`` and what it leaves to per-sample views, by name
        and op (``print(fn.prepare(params, *shared, batch).describe(params))``)."""
        total = sum(v.numel() for v in params.values())
        lines = [f"ghost clipping covers {coverage(self, params):.1%} of {total} trainable elements"]
        for k in self.other:
            ops = ", ".join(self.uncovered.get(k, [])) or "?"
            lines.append(f"  not covered (per-sample view, {params[k].numel()} elements per sample): {k} {tuple(params[k].shape)} used by {ops}")
        return "\n".join(lines)


class Mode(TorchFunctionMode):
    """Hands every torch function call made inside it to ``run``.

    The run is the mode's own (not a module-level stack, which threads would share); torch.compile
    traces a mode with an attribute, but not a ``contextvars.ContextVar``."""

    def __init__(self, run: "Run"):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.run.call(func, args, kwargs or {})


def _has_tensor(out: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in optree.tree_leaves(out, namespace="torch"))


CONTROL_FLOW = (
    "the model used its params differently than in the first call with these input shapes "
    "(data-dependent control flow: another order of layers, other layer arguments, or a param "
    "used in a way it was not before). Use method='vmap' for such models."
)


class Run:
    """The state of one forward: which tensors are params, the taps to add, what to keep.

    The probe (``plan=None``) runs the loss on one sample and records, in call order, every call
    of a covered op whose weight is a param (a *candidate*), whether it is a *site* (it runs at
    the level of vmapdp's own vmap, not inside a transform of the user's: those calls must be
    differentiated through the transform, so they are uses like any other), and which params
    have other uses (calls that return tensors; shape and dtype queries are not uses). The real
    run checks that every call matches the plan and refuses to go on otherwise.
    """

    def __init__(self, params: dict[str, Tensor], plan: Plan | None, taps: list[Tensor], expanded: dict[str, Tensor], level: int = -1):
        self.key_of = {id(v): k for k, v in params.items()}
        self.known = [(v, k) for k, v in params.items()]  # the same, by identity (for torch.compile: see _key)
        self.probe = plan is None
        self.plan = plan if plan is not None else Plan()
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
        if not isinstance(t, Tensor):
            return None
        if torch.compiler.is_compiling():  # id() of a graph input (a clip norm, a buffer) guards on the object: every new one recompiled
            return next((k for v, k in self.known if v is t), None)
        return self.key_of.get(id(t))

    def _keys_in(self, tree: Any) -> set[str]:
        """The params (by key) among the leaves of a call's arguments."""
        keys = (self._key(leaf) for leaf in optree.tree_leaves(tree, namespace="torch"))
        return {k for k in keys if k is not None}

    def _candidate(self, func, args: tuple, kwargs: dict) -> tuple[Tensor, str, str | None, tuple] | None:
        """A covered op whose weight is a param, in the standard form its rule handles (the rule's
        parse checks the shapes, a bias's included): ``(input, weight key, bias key, meta)``."""
        rule = RULES.get(func)
        parsed = None if rule is None else rule.parse(args, kwargs)
        if parsed is None:
            return None
        for x, w, b, meta in parsed if isinstance(parsed, list) else [parsed]:  # the first alternative whose weight is a param
            wk = self._key(w)
            if wk is None or not isinstance(x, Tensor) or self._key(x) is not None:
                continue
            if b is not None and not isinstance(b, Tensor):
                return None
            return x, wk, self._key(b), meta
        return None

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
                self._uncovered(keys, _name(func))
            return out
        out = func(*self._swap(tuple(args)), **self._swap(kwargs))
        if _has_tensor(out) and not keys <= self.expanded.keys():  # (expanded: the plan's other-use keys)
            raise RuntimeError(f"ghost clipping: {CONTROL_FLOW}")
        return out

    def _uncovered(self, keys: set[str], op: str) -> None:
        self.other |= keys
        for k in keys:
            ops = self.plan.uncovered.setdefault(k, [])
            if op not in ops:
                ops.append(op)

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
        if func in (F.embedding, F.embedding_bag) and arg(args, kwargs, 3, "max_norm") is not None:
            raise UnsupportedModuleError(
                f"ghost clipping: an embedding with max_norm={arg(args, kwargs, 3, 'max_norm')!r} "
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
                self.key_of[id(out)] = self._key(args[0])
                self.known.append((out, self.key_of[id(out)]))
                self.aliases.append(out)
            return out
        cand = self._candidate(func, args, kwargs)
        if cand is None:
            keys = self._keys_in((args, kwargs))
            if func is F.embedding and arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys) if keys else func(*args, **kwargs)
        x, wk, bk, meta = cand
        keys = {wk} | ({bk} if bk else set())
        index = self.n_cand
        self.n_cand += 1
        if self.probe:
            out = func(*args, **kwargs)
            level = torch._C._functorch.maybe_get_level(out)
            is_site = level in (self.level, -1)  # not inside a transform of the user's own
            self.plan.candidates.append(is_site)
            if not is_site:
                self._uncovered(keys, f"{_name(func)} inside a transform of the loss's own")
                return out
            self.plan.sites.append(Site(func, wk, bk, tuple(out.shape), out.dtype, meta))
            return out
        if index >= len(self.plan.candidates):
            raise RuntimeError(f"ghost clipping: {CONTROL_FLOW}")
        if not self.plan.candidates[index]:
            if func is F.embedding and arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys)
        out = func(*args, **kwargs)
        if self.n >= len(self.plan.sites) or self.plan.sites[self.n] != Site(func, wk, bk, tuple(out.shape), out.dtype, meta):
            raise RuntimeError(f"ghost clipping: {CONTROL_FLOW}")
        tap = self.taps[self.n]
        self.n += 1
        if torch.compiler.is_compiling():
            x = x.clone()  # free when nothing writes to x afterwards (the compiler drops it)
        else:
            self.versions.append(_version_of(x))
        self.saved.append(x)
        return out + tap


def _name(func: Callable) -> str:
    """An op's name as users write it (``torch.bmm``, ``Tensor.mul``, ``torch.nn.functional.instance_norm``)."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__objclass__", None)
    if owner is not None:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{'torch' if module.startswith('torch._C') else module}.{name}"


def embedding_with_padding(embedding: Callable, input: Tensor, weight: Tensor, padding_idx: int | None = None, *rest: Any, **kwargs: Any) -> Tensor:
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


def run_loss(run: Run, loss_fn: Callable, params: dict[str, Tensor], shared: tuple, sample: Any) -> Tensor:
    """``loss_fn`` on one (vmapped) sample with ``run`` watching its calls."""
    with Mode(run):
        return loss_fn(params, *shared, sample)


def rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The global RNGs (CPU and ``device``'s) restored on exit: random layers (dropout) then draw
    in the real run as if what ran inside (the probe, auto's race) had never run."""
    accelerator = device.type != "cpu"
    return torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type if accelerator else None)


def probe(loss_fn: Callable, params: dict[str, Tensor], shared: tuple, batch: Any, randomness: str) -> Plan:
    """Run the loss on one sample to learn which ops see which params (shapes only matter).

    The global RNGs are restored afterwards (the probe's dropout draws are not the step's)."""
    one = optree.tree_map(lambda t: t[:1], batch, namespace="torch")

    run = Run(params, None, [], {})

    def fwd(sample):
        run.level = torch._C._functorch.maybe_get_level(optree.tree_leaves(sample, namespace="torch")[0])
        return run_loss(run, loss_fn, params, shared, sample)

    with torch.no_grad(), rng_kept(next(iter(params.values())).device):
        vmap(fwd, randomness=randomness)(one)
    run.plan.other = sorted(run.other)
    return run.plan


def coverage(plan: Plan, params: dict[str, Tensor]) -> float:
    """The fraction of trainable elements whose gradients come entirely from covered ops."""
    covered = {s.weight for s in plan.sites} | {s.bias for s in plan.sites if s.bias}
    covered -= set(plan.other)
    total = sum(v.numel() for v in params.values())
    return sum(params[k].numel() for k in covered) / max(total, 1)

