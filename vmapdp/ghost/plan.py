"""Ghost clipping's tracer: which calls see which params, and the plan a probe makes of them.

The loss runs mapped over the batch under a ``TorchFunctionMode`` (``Mode``) that hands each call
to a ``Run``. A call of a covered op (rules.py) whose weight is a param is a *site*: the run keeps
its input and adds a tap (a zero input of the computation) to its output, whose gradient is the
per-sample output gradient. Every other use of a param is routed through a per-sample copy. The
probe (``probe``) runs one sample eagerly and records the sites in call order (a ``Plan``); the
real run checks every call against the plan and refuses data-dependent control flow.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from vmapdp import _checks
from vmapdp._tree import leaves as _leaves
from vmapdp.errors import UnsupportedModuleError
from vmapdp.functional import batched_attention
from vmapdp.ghost.affine import batch_norm_affine, instance_norm_affine
from vmapdp.ghost.embedding import embedding_bag_as_embedding
from vmapdp.ghost.rules import RULES
from vmapdp.ghost.uses import Site, arg
from vmapdp.ghost.views import VIEW_OPS, View, box_of

__all__ = ["Plan", "Run", "Mode", "probe", "coverage", "run_loss", "CONTROL_FLOW", "TRACED_THROUGH"]


# ops that return the param's values as they are (a copy, another dtype or device, or the tensor
# itself); `contiguous`, `type_as`, `cpu` and `resolve_conj` were refused as data-dependent (found by review)
_CASTS = {Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type, Tensor.type_as, Tensor.contiguous,
          Tensor.cpu, Tensor.cuda, Tensor.resolve_conj, Tensor.resolve_neg}


# in-place operators (Tensor.__iadd__ ...) that a `w += 1` on a param's cast calls, and item assignment (`w[0] = 0`)
_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift")) | {"__setitem__"}


@functools.lru_cache(maxsize=None)
def _inplace_position(func: Callable) -> int | None:
    """The position of ``func``'s ``inplace`` parameter (``F.relu``, ``F.dropout``, ``F.hardtanh``...),
    or None where it has none (or no signature Python can read: torch's builtins have no such
    parameter)."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _writes_in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether a call writes into its first argument: a method ending in ``_`` (``mul_``), an in-place
    operator (``+=``, ``w[0] = ...``), or a functional's ``inplace=True`` (``F.relu(w, inplace=True)``)."""
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_"):
        return True
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    i = _inplace_position(func)
    return i is not None and len(args) > i and bool(args[i])


@dataclass
class Plan:
    """What the probe learned of a loss for one input shape: its sites in call order, which
    covered-op calls are sites, and which params have uses no rule covers."""

    sites: list[Site] = field(default_factory=list)
    candidates: list[bool] = field(default_factory=list)  # per covered-op call with a param weight: a site?
    other: list[str] = field(default_factory=list)  # keys with uses no rule covers (sorted)
    uncovered: dict[str, list[str]] = field(default_factory=dict)  # those keys -> the ops of those uses
    # per view op on a param: the op, its outputs' views (None: not boxes) and its other arguments (which select the
    # boxes: their values, and as shown in messages)
    views: list[tuple[Callable, tuple[View, ...] | None, Any]] = field(default_factory=list)
    traced_through: bool = False  # the loss called nn.MultiheadAttention's forward (TRACED_THROUGH)
    batched: list[bool] = field(default_factory=list)  # per site: did its input depend on the sample? (the eager real run checks it)

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
        body = TRACED_THROUGH.get(func)
        if body is not None:  # run its body with the mode on: the ops inside are seen one by one
            if self.run.probe:
                self.run._inspect(func, args, kwargs or {})  # (embedding_bag's max_norm: refused with the fix)
            self.run.plan.traced_through |= func is F.multi_head_attention_forward
            with self:
                return body(*args, **(kwargs or {}))
        return self.run.call(func, args, kwargs or {})


def _body(func: Callable, **replaced: Any) -> Callable:
    """A copy of a torch Python function that does not hand itself to ``__torch_function__`` (its
    ``has_torch_function`` check answers False), with the globals in ``replaced`` replaced: called
    under the mode, its ops are seen one by one. (``torch.overrides.redispatch_function`` does the
    same in eager, but torch.compile refuses it inside a mode's handler.)"""
    names = dict(func.__globals__, has_torch_function=lambda *a: False, **replaced)
    copy = types.FunctionType(func.__code__, names, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


# Python functions that dispatch to ``__torch_function__`` as a whole although their bodies are
# plain torch ops -> their bodies: the tracer sees their ops instead (``nn.MultiheadAttention``'s
# body is ``F.linear`` on the packed in-projection, or on its slices, and on ``out_proj``)
def _per_projection(q: Tensor, k: Tensor, v: Tensor, w: Tensor, b: Tensor | None = None) -> list[Tensor]:
    """``F._in_projection_packed`` on its per-projection path (``w.chunk(3)``, three ``F.linear``):
    the same q, k and v as its packed paths, whose ``Tensor.unflatten`` torch.compile cannot trace
    inside a mode. (Ghost clipping then sees three disjoint blocks of the packed weight.)"""
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    return F._in_projection_packed(q, k, v, w, b)


TRACED_THROUGH = {
    F.multi_head_attention_forward: _body(F.multi_head_attention_forward, _in_projection_packed=_per_projection),
    F.batch_norm: batch_norm_affine,  # (affine.py: its affine as `mul` and `add` on views of the weight and bias)
    F.instance_norm: functools.partial(instance_norm_affine, _body(F.instance_norm, has_torch_function_variadic=lambda *a: False)),  # (the same)
    # (embedding.py: bags as rows of a 2-D input -> F.embedding and a reduction; other calls its own body)
    F.embedding_bag: functools.partial(embedding_bag_as_embedding, _body(F.embedding_bag, has_torch_function_variadic=lambda *a: False)),
    # (torch.compile inlines F.rms_norm, so the compiled run sees the torch.rms_norm inside it: the probe must too;
    # found by review: the sites differed and every compiled ghost step of a model with nn.RMSNorm was refused)
    F.rms_norm: _body(F.rms_norm, has_torch_function_variadic=lambda *a: False),
}


# leaves that are no pytree node (``_arg_leaves``): what torch functions take besides tensors
_PLAIN = (Tensor, int, float, bool, complex, str, type(None), slice, type(Ellipsis), torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format)  # (a Size holds ints)
_WALKED = (tuple, list, dict)


def _walked(tree: Any) -> bool:
    """Whether ``_arg_leaves`` / ``_arg_map`` walk ``tree``'s items themselves: a tuple, list or
    dict, or a subclass optree does not know (torch's argument parser reads a tuple subclass's
    items as a sequence of tensors, where optree would see one leaf and miss a param inside). A
    registered subclass (named tuples, ``torch.Size``, ``OrderedDict``...) goes to optree, which
    flattens it as registered."""
    if type(tree) in _WALKED:
        return True
    return isinstance(tree, _WALKED) and optree.tree_is_leaf(tree, namespace="torch")


def _arg_leaves(tree: Any, out: list | None = None) -> list:
    """The leaves of a torch function's arguments or result: optree's (``namespace="torch"``, up to
    their order and ``None``), and the items of tuple, list and dict subclasses optree does not
    know (``_walked``). Walked here, not by an optree flatten: this runs for every call of a
    forward, and under torch.compile dynamo traces an optree flatten's registry lookups (as much as
    half of the capture of a ghost step)."""
    out = [] if out is None else out
    if isinstance(tree, _PLAIN):
        out.append(tree)
    elif _walked(tree):
        for x in tree.values() if isinstance(tree, dict) else tree:
            _arg_leaves(x, out)
    else:  # (a container optree knows, or a leaf)
        out.extend(optree.tree_leaves(tree, namespace="torch"))
    return out


def _arg_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to each of ``_arg_leaves(tree)``, in ``tree``'s structure (the same containers
    walked: a param ``_arg_leaves`` finds is one this map replaces). A walked container whose items
    all stay is returned as it is; one that changes is rebuilt as its own type where that takes its
    items (a tuple or list subclass's constructor), else as a plain tuple, list or dict."""
    if isinstance(tree, _PLAIN):
        return fn(tree)
    if not _walked(tree):
        return optree.tree_map(fn, tree, namespace="torch")
    if isinstance(tree, dict):
        new = {k: _arg_map(fn, v) for k, v in tree.items()}
        if all(new[k] is v for k, v in tree.items()):
            return tree
        return new
    items = [_arg_map(fn, x) for x in tree]
    if all(a is b for a, b in zip(items, tree)):
        return tree
    try:
        return type(tree)(items)
    except Exception:
        return tuple(items) if isinstance(tree, tuple) else items


def _has_tensor(out: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in _arg_leaves(out))


CONTROL_FLOW = (
    "the model used its params differently than in the first call with these input shapes "
    "(data-dependent control flow: another order of layers, other layer arguments, or a param "
    "used in a way it was not before; or, under torch.compile, a view the compiler hides from the "
    "tracer: write W.t() instead of W.T). Use method='vmap' for such models."
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
        # params by id(), eagerly; by identity under torch.compile (id() of a graph input guards on the
        # object, and torch 2.11's dynamo cannot take the id() of a tensor made in the graph; 2.13's can)
        self.compiling = torch.compiler.is_compiling()
        self.key_of = {} if self.compiling else {id(v): k for k, v in params.items()}
        self.known = [(v, k) for k, v in params.items()]
        self.born = [_version_of(v)[1] for v in params.values()] if plan is None else []  # (the probe's written())
        self.shape_of = {k: tuple(v.shape) for k, v in params.items()}
        # the views of params made so far (views.py), found by identity, not id(): under
        # torch.compile the id of an intermediate tensor can be reused. Each is [tensor, param key,
        # View, the flat param indices it holds (probe), its twin: the same view of the per-sample copy]
        self.views: list[list] = []
        self.n_view = 0  # view ops on params seen so far
        self.probe = plan is None
        self.plan = plan if plan is not None else Plan()
        self.taps = taps
        self.expanded = expanded
        self.level = level  # the functorch level of vmapdp's vmap (probe; eager real runs)
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
        if self.compiling:  # (id() of a graph input, a clip norm or a buffer, guards on the object: every new one recompiled)
            k = next((k for v, k in self.known if v is t), None)
        else:
            k = self.key_of.get(id(t))
        if k is None:
            entry = self._view(t)
            k = None if entry is None else entry[1]
        return k

    def _view(self, t: Any) -> list | None:
        """``t``'s entry in ``views`` when it is a view of a param."""
        for entry in self.views:
            if entry[0] is t:
                return entry
        return None

    def _keys_listed(self, tree: Any) -> list[str]:
        """The params (by key) among the leaves of a call's arguments, once per leaf that is one of
        them or a view of one."""
        keys = [self._key(leaf) for leaf in _arg_leaves(tree) if isinstance(leaf, Tensor)]
        return [k for k in keys if k is not None]

    def _keys_in(self, tree: Any) -> set[str]:
        """The params (by key) among the leaves of a call's arguments."""
        return set(self._keys_listed(tree))

    def _candidate(self, func, args: tuple, kwargs: dict) -> tuple[Tensor, str, str | None, tuple, tuple] | None:
        """A covered op whose weight is a param (or a view of one, views.py), in the standard form
        its rule handles (the rule's parse checks the shapes, a bias's included): ``(input, weight
        key, bias key, meta, (weight view, bias view))``."""
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
            bk = self._key(b)
            views = tuple(None if e is None else e[2] for e in (self._view(w), None if bk is None else self._view(b)))
            if views[0] is not None and views[0].transposed and not rule.transposable:
                continue
            if bk == wk and views != (None, None):
                return None  # a weight and a bias from one param: the generic path
            if sorted(self._keys_listed((args, kwargs))) != sorted(k for k in (wk, bk) if k is not None):
                # another param among the arguments (two params in one cat), or the weight twice
                # (``cat([p, x, p])``, a param and a view of it: the rule takes one): the generic path
                continue
            return x, wk, bk, meta, views
        return None

    def _swap(self, tree: Any) -> Any:
        """Params with uses no rule covers -> their per-sample copies (views of the param)."""

        def one(v: Any) -> Any:
            k = self._key(v)
            if k is None or k not in self.expanded:
                return v
            entry = self._view(v)
            e = self.expanded[k] if entry is None else entry[4]
            return e if e.dtype == v.dtype else e.to(v.dtype)

        swapped = _arg_map(one, tree)
        if self._keys_in(swapped) & self.expanded.keys():  # a param left in place: its use's grad would be lost
            raise UnsupportedModuleError(
                f"ghost clipping: a parameter is passed to a torch function inside a container it cannot rebuild "
                f"({type(tree).__name__}); expected tuples, lists, dicts or pytree nodes registered with optree. "
                "Pass a plain tuple or list, or use method='vmap'."
            )
        return swapped

    def _other_use(self, func, args: tuple, kwargs: dict, keys: set[str]) -> Any:
        if self.probe:
            out = func(*args, **kwargs)
            if _has_tensor(out):  # a use that carries gradient (shape/dtype queries do not)
                self._uncovered(keys, _name(func))
            return out
        out = func(*self._swap(tuple(args)), **self._swap(kwargs))
        if _has_tensor(out) and not keys <= self.expanded.keys():  # (expanded: the plan's other-use keys)
            raise self._mismatch()
        return out

    def _uncovered(self, keys: set[str], op: str) -> None:
        self.other |= keys
        for k in keys:
            ops = self.plan.uncovered.setdefault(k, [])
            if op not in ops:
                ops.append(op)

    def _mismatch(self) -> RuntimeError:
        """The real run differs from the plan: data-dependent control flow, or, under torch.compile,
        an attention module's fused fast path (taken in eval mode when no ``__torch_function__``
        override is visible, and torch.compile's tracing does not show the tracer's)."""
        if self.plan.traced_through and torch.compiler.is_compiling() and torch.backends.mha.get_fastpath_enabled():
            return RuntimeError(
                "ghost clipping: under torch.compile, nn.MultiheadAttention / nn.TransformerEncoderLayer in eval mode "
                "took their fused fast path, which the eager probe did not (the model's ops differ from the plan). "
                "Call torch.backends.mha.set_fastpath_enabled(False) before the first compiled step, train in "
                "train mode (model.train()), or use compile=False."
            )
        return RuntimeError(f"ghost clipping: {CONTROL_FLOW}")

    # -- what the probe refuses or records -------------------------------------------------------
    def _inspect(self, func, args: tuple, kwargs: dict) -> None:
        """Probe only: refuse, with the fix, what ghost clipping cannot run."""
        if isinstance(kwargs.get("out"), Tensor):
            raise UnsupportedModuleError(
                f"ghost clipping: the model calls {getattr(func, '__name__', func)}(..., out=...), writing into a "
                "tensor in place during the forward (torch.nn.utils.spectral_norm and "
                "torch.nn.utils.parametrizations.spectral_norm do so in their power iteration); expected "
                "out-of-place ops, because the forward is mapped over the batch (every method refuses such writes). "
                "Call model.eval() for spectral_norm (the power iteration stops: u and v stay as they are), or remove it."
            )
        if args and self._key(args[0]) is not None and _writes_in_place(func, args, kwargs):
            raise self._in_place(func)
        if func in (F.embedding, F.embedding_bag) and arg(args, kwargs, 3, "max_norm") is not None:
            raise UnsupportedModuleError(
                f"ghost clipping: an embedding with max_norm={arg(args, kwargs, 3, 'max_norm')!r} "
                "(nn.Embedding(max_norm=...)) renormalises the rows of its weight in place during the forward, "
                "from the tokens of the whole batch; expected max_norm=None. Renormalise out of place in the "
                "model (w = w * (max_norm / w.norm(dim=1, keepdim=True)).clamp(max=1)) or drop max_norm."
            )

    def _in_place(self, func) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"ghost clipping: the model writes in place into a parameter, a cast of one (W.double()) or a view of one "
            f"({_name(func) if func is not None else 'in a call the tracer does not see'}); ghost clipping traces each parameter's uses and runs them on its own copies, so the write would "
            "land elsewhere than the model's forward reads it (found by review: W.double().mul_(2) was differentiated "
            "as W.double()). Write out of place (w = W.double() * 2, F.relu(w) without inplace=True), or use method='vmap'."
        )

    # -- the interception ----------------------------------------------------------------------
    def call(self, func, args: tuple, kwargs: dict) -> Any:
        if not self.probe:
            return self._call(func, args, kwargs)
        self._inspect(func, args, kwargs)
        # any other write into a param, a cast or a view of one shows in the version counters of the call's
        # tensors (a view shares its base's counter): a view the tracer does not follow (W.double().permute(1, 0)
        # .mul_(2); found by review); one the call does not take (a Python function of the user's writing into a
        # param it captured) shows in the params' and casts' own counters, read once the forward is done (written)
        watched = [_version_of(t) for t in _leaves((args, kwargs)) if isinstance(t, Tensor)]
        try:
            out = self._call(func, args, kwargs)
        except RuntimeError as err:  # (the probe's params track gradients: autograd refuses writes into them or their views)
            if "leaf Variable that requires grad" in str(err):
                raise self._in_place(func) from err
            raise
        changed = [t for t, v in watched if t._version != v]
        if changed and self._alias_known(changed):
            raise self._in_place(func)
        return out

    def _alias_known(self, tensors: list[Tensor]) -> bool:
        """Whether any of ``tensors`` shares memory with a param or a cast of one."""
        known = {s.data_ptr() for s in (_version_of(t)[0].untyped_storage() for t, _ in self.known) if s.nbytes()}
        return any(t.untyped_storage().data_ptr() in known for t in tensors if t.untyped_storage().nbytes())  # (empty ones share a pointer)

    def written(self) -> bool:
        """Probe, after the forward: whether a param or a cast of one has been written since it was known."""
        return any(_version_of(t)[0]._version != v for (t, _), v in zip(self.known, self.born))

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        if func in _CASTS and args and self._key(args[0]) is not None and not kwargs.get("copy", False):
            out = func(*args, **kwargs)
            if isinstance(out, Tensor) and out is not args[0]:
                entry = self._view(args[0])
                if entry is None:
                    key = self._key(args[0])
                    if not self.compiling:
                        self.key_of[id(out)] = key
                    self.known.append((out, key))
                    if self.probe:
                        self.born.append(_version_of(out)[1])
                    self.aliases.append(out)
                else:  # a cast of a view is the same view
                    twin = None if entry[4] is None else func(entry[4], *args[1:], **kwargs)
                    self.views.append([out, entry[1], entry[2], entry[3], twin])
            return out
        if func in VIEW_OPS and args and self._key(args[0]) is not None:
            return self._view_op(func, args, kwargs)
        keys = self._keys_in((args, kwargs))
        # (no param among the arguments: no rule applies, and its parse, shape checks in Python, is skipped:
        # an LSTM's time loop makes thousands of elementwise calls a step)
        cand = self._candidate(func, args, kwargs) if keys else None
        if cand is None:
            if func is F.embedding and arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys) if keys else func(*args, **kwargs)
        x, wk, bk, meta, views = cand
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
            self.plan.sites.append(Site(func, wk, bk, tuple(out.shape), out.dtype, meta, views))
            self.plan.batched.append(isinstance(x, Tensor) and torch._C._functorch.maybe_get_level(x) == self.level)
            return out
        if index >= len(self.plan.candidates):
            raise self._mismatch()
        if not self.plan.candidates[index]:
            if func is F.embedding and arg(args, kwargs, 2, "padding_idx") is not None:
                func, args, kwargs = embedding_with_padding, (func,) + tuple(args), kwargs
            return self._other_use(func, args, kwargs, keys)
        out = func(*args, **kwargs)
        if self.n >= len(self.plan.sites) or self.plan.sites[self.n] != Site(func, wk, bk, tuple(out.shape), out.dtype, meta, views):
            raise self._mismatch()
        if not self.compiling and self.plan.batched[self.n] and isinstance(x, Tensor) and torch._C._functorch.maybe_get_level(x) != self.level:
            # the probe's input depended on the sample, this one does not: the loss reads something else now (a flag
            # outside its arguments switched it to a captured dataset row; found by review); the taps would hide it
            raise ValueError(
                f"ghost clipping: the input of the layer using {wk!r} ({_name(func)}) depended on the sample when the loss "
                "was probed and does not now: the loss reads something else than it did (a flag outside its arguments "
                "switched it, or the module went from train to eval mode), and the rows it reads may not be the "
                "sample's. Pass such a flag as an argument of the loss (each value is then probed), build the step (or "
                "clipped_grad_sum) anew after model.train()/eval(), or use method='vmap', which checks every call."
            )
        tap = self.taps[self.n]
        self.n += 1
        if torch.compiler.is_compiling():
            x = x.clone()  # free when nothing writes to x afterwards (the compiler drops it)
        else:
            self.versions.append(_version_of(x))
        self.saved.append(x)
        return out + tap


    def _view_op(self, func, args: tuple, kwargs: dict) -> Any:
        """A view op (views.VIEW_OPS) on a param or a view of one. The probe finds the box each
        output is (the op applied to the flat indices of the param) and records them; outputs that
        are boxes become views (the weight or bias of a site, or, used otherwise, their twins: the
        same view of the per-sample copy), else the call is an ordinary use of the param."""
        key = self._key(args[0])
        keys = self._keys_in((args, kwargs))
        if self.probe:
            out = func(*args, **kwargs)
            leaves = _leaves(out)
            views = idx = None
            # (a tensor among the other arguments, W[idx], may select differently per sample: not a view)
            if keys == {key} and not _has_tensor((args[1:], kwargs)):
                entry = self._view(args[0])
                base = None if entry is None else entry[3]
                if base is None:  # the param itself (or a cast of it): its flat indices (int32 when they fit)
                    n = args[0].numel()
                    base = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view(self.shape_of[key])
                idx = _leaves(func(base, *args[1:], **kwargs))
                views = tuple(box_of(j, self.shape_of[key]) if isinstance(j, Tensor) else None for j in idx)
                if len(views) != len(leaves) or None in views:
                    views = None
            if views is None:
                self.plan.views.append((func, None, None))
                if _has_tensor(out):
                    self._uncovered(keys, _name(func))
                return out
            self.plan.views.append((func, views, (_selection(args, kwargs), _shown(args[1:], kwargs))))
            self.views += [[t, key, v, j, None] for t, j, v in zip(leaves, idx, views)]
            return out
        if self.n_view >= len(self.plan.views) or self.plan.views[self.n_view][0] != func:
            raise self._mismatch()
        _, views, probed = self.plan.views[self.n_view]
        self.n_view += 1
        if views is None:
            return self._other_use(func, args, kwargs, keys)
        if not _same(_selection(args, kwargs), probed[0]):
            # (found by review: W[s:s+T] with s = int(a 0-dim tensor argument), keyed by its shape only: every call took
            # the probe's rows, and the gradient went to them, silently)
            raise ValueError(
                f"ghost clipping: {_name(func)} selects another part of the param {key!r} than when the loss was probed "
                f"(arguments {_shown(args[1:], kwargs)}, the probe's {probed[1]}): the plan would put the "
                "gradient on the probed part. Pass what selects it (an offset, an index) as a Python int argument of "
                "the loss, which is probed for each value (a tensor's value is not), or use method='vmap'."
            )
        out = func(*args, **kwargs)
        leaves = _leaves(out)
        if len(leaves) != len(views) or any(tuple(t.shape) != v.shape for t, v in zip(leaves, views)):
            raise self._mismatch()
        twins = _leaves(func(*self._swap(tuple(args)), **self._swap(kwargs))) if key in self.expanded else [None] * len(leaves)
        self.views += [[t, key, v, None, e] for t, v, e in zip(leaves, views, twins)]
        return out


def _selection(args: tuple, kwargs: dict) -> tuple:
    """A view op's arguments other than the tensor it views (slices, ints, lists, dims, shapes),
    which decide the part of the param each output is: their values now (a list, an array or a
    0-dim tensor in a slice, changed in place between calls, compared as what it held then;
    found by review: kept by reference, it equalled itself)."""
    return (_frozen(tuple(args[1:])), _frozen(dict(kwargs)))


def _frozen(x: Any) -> Any:
    if isinstance(x, (list, tuple)):  # (torch.Size included)
        if all(type(v) is int for v in x):  # (a long index list: one pass, found by review: 23 ms for 100k)
            return (type(x).__name__, tuple(x))
        return (type(x).__name__, tuple(_frozen(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in x.items())))
    if isinstance(x, slice):
        return ("slice", _frozen(x.start), _frozen(x.stop), _frozen(x.step))
    if isinstance(x, Tensor) or (hasattr(x, "tolist") and hasattr(x, "shape") and hasattr(x, "ravel")):  # (a tensor or an array: its values)
        flat = x.reshape(-1) if isinstance(x, Tensor) else x.ravel()
        return ("array", tuple(x.shape), tuple(flat.tolist()))
    return x


def _same(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # (an array among them: elementwise ==)
        return repr(a) == repr(b)


def _shown(args: Any, kwargs: Any) -> str:
    return _checks.shortened(repr(args) + (f", {kwargs!r}" if kwargs else ""))


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
    with Mode(run), batched_attention(params):
        return loss_fn(params, *shared, sample)


def probe(loss_fn: Callable, params: dict[str, Tensor], shared: tuple, batch: Any, randomness: str, call: str = "ghost clipping") -> Plan:
    """Run the loss on one sample to learn which ops see which params (shapes only matter).

    It runs in ``per_sample.check_on_one_sample`` (on copies of the params, with its refusals of
    a loss that ignores its sample or the params, or writes into its inputs); the global RNGs are
    restored afterwards (the probe's dropout draws are not the step's)."""
    from vmapdp.per_sample import check_on_one_sample

    runs: list[Run] = []

    def forward(copies: dict[str, Tensor], shared: tuple, sample: Any) -> Tensor:
        run = Run(copies, None, [], {})
        run.level = torch._C._functorch.maybe_get_level(_leaves(sample)[0])
        runs.append(run)
        loss = run_loss(run, loss_fn, copies, shared, sample)
        if run.written():
            raise run._in_place(None)
        return loss

    check_on_one_sample(call, params, shared, batch, randomness, forward)
    run = runs[-1]
    run.plan.other = sorted(run.other)
    return run.plan


def coverage(plan: Plan, params: dict[str, Tensor]) -> float:
    """The fraction of trainable elements whose gradients come entirely from covered ops."""
    covered = {s.weight for s in plan.sites} | {s.bias for s in plan.sites if s.bias}
    covered -= set(plan.other)
    total = sum(v.numel() for v in params.values())
    return sum(params[k].numel() for k in covered) / max(total, 1)

