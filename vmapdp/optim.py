"""Functional optimizers: ``init(params) -> state`` and ``update(grads, state, params) -> (new_params, new_state)``.

Params and grads are ``dict[str, Tensor]`` keyed like ``module.named_parameters()``; grads are
joined to params by key, never by order. The state is a NamedTuple of plain tensors (and dicts of
them), so it can be saved, restored, compared and carried through ``torch.compile``.

The arithmetic is PyTorch's own: :func:`sgd`, :func:`adam` and :func:`adamw` call the functional
kernels behind ``torch.optim.SGD``/``Adam``/``AdamW`` (``torch.optim.sgd.sgd``,
``torch.optim.adam.adam``, ``torch.optim.adamw.adamw``). Those kernels update their arguments in
place, so ``update`` runs them on fresh copies of the params, grads and state: its inputs are
never modified, and the same inputs always give the same outputs. On CPU the results equal
``torch.optim``'s step for step (same code path, same rounding). :func:`from_torch` wraps any other
``torch.optim.Optimizer`` subclass the slow, general way.

Learning rate: a float, or a 0-dim floating tensor. A tensor is read at every ``update``, so a
schedule can change it in place (``lr.fill_(new_value)``) without rebuilding the optimizer or
recompiling a compiled step.

Dtypes: params may be float64, float32, bfloat16 or float16. Grads are cast to each param's dtype
inside ``update`` (DP sums are accumulated in float32 even for bfloat16 params); the state has
the params' dtypes, except ``step`` (a float32 count, as in ``torch.optim``). Outputs are detached
tensors, like the result of ``torch.optim``'s ``no_grad`` step.

Saving: the state classes are plain NamedTuples; to read one back with ``torch.load(...,
weights_only=True)``, allow them: ``with torch.serialization.safe_globals(SAFE_GLOBALS): ...``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor
from torch.optim.adam import adam as _adam_kernel
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.sgd import sgd as _sgd_kernel

__all__ = [
    "Optimizer",
    "SGDState",
    "AdamState",
    "TorchOptimizerState",
    "SAFE_GLOBALS",
    "sgd",
    "adam",
    "adamw",
    "from_torch",
]

Params = Mapping[str, Tensor]
Grads = Mapping[str, Tensor]
LearningRate = float | Tensor

# Devices where torch's Adam kernels can keep ``step`` on the device and do the bias correction
# in tensors (``capturable=True``): no host sync, nothing for torch.compile to fall back on.
_CAPTURABLE_DEVICE_TYPES = ("cuda", "xpu", "hpu")


class Optimizer(NamedTuple):
    """An optimizer as a pair of pure functions.

    ``init(params) -> state``; ``update(grads, state, params) -> (new_params, new_state)``.
    ``update`` never modifies its arguments; the same arguments give the same result.
    """

    init: Callable[[Params], Any]
    update: Callable[[Grads, Any, Params], tuple[dict[str, Tensor], Any]]
    config: str = ""  # its name and hyperparameters, canonically (bound into a DP step's noise keys)
    elementwise: bool = True  # each coordinate's update reads that coordinate alone (a sharded step updates slices)


# torch optimizers whose update of a coordinate reads that coordinate (and its own state) alone; a
# sharded step (vmapdp.sharding) updates each rank's slice, which only such an optimizer allows
_ELEMENTWISE = frozenset(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, name)
)


def optimizer_config(name: str, hyper: Mapping[str, Any]) -> str:
    """``name`` and its hyperparameters as one canonical string: floats exactly (hex), a tensor
    (a learning rate read at every update) as its dtype only, since its value may change."""

    def one(v: Any) -> str:
        if isinstance(v, Tensor):
            return f"tensor[{v.dtype}]"
        if isinstance(v, float):
            return v.hex()
        if isinstance(v, (tuple, list)):
            return "(" + ",".join(one(x) for x in v) + ")"
        return repr(v)

    return name + "(" + ",".join(f"{k}={one(hyper[k])}" for k in sorted(hyper)) + ")"


class SGDState(NamedTuple):
    """State of :func:`sgd`."""

    # {name: tensor of the param's shape and dtype}: the momentum buffer; None when momentum == 0
    momentum_buffer: dict[str, Tensor] | None
    # [] float32 on the params' device: the number of updates applied so far
    step: Tensor


class AdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`."""

    # [] float32 on the params' device: the number of updates applied so far (shared by all params)
    step: Tensor
    # {name: tensor of the param's shape and dtype}: running mean of the gradient
    exp_avg: dict[str, Tensor]
    # {name: tensor of the param's shape and dtype}: running mean of the squared gradient
    exp_avg_sq: dict[str, Tensor]
    # {name: tensor of the param's shape and dtype}: running max of exp_avg_sq; None unless amsgrad
    max_exp_avg_sq: dict[str, Tensor] | None


class TorchOptimizerState(NamedTuple):
    """State of an optimizer wrapped by :func:`from_torch`."""

    # {name: that param's entry of optimizer.state_dict()["state"]} (e.g. for RMSprop
    # {"step": [] float32, "square_avg": the param's shape and dtype}); {} before the first update
    per_param: dict[str, dict[str, Any]]


#: The state classes, for ``torch.serialization.safe_globals`` when loading with ``weights_only``.
SAFE_GLOBALS = (SGDState, AdamState, TorchOptimizerState)


# ----------------------------------------------------------------------------------------------
# validation


def _check_number(call: str, name: str, value: Any, *, low: float, high: float | None = None) -> float:
    """``value`` must be a finite real number, ``>= low`` and, if given, ``< high``; as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{call}: {name} must be a float, got {type(value).__name__} ({value!r}).")
    value = float(value)
    if math.isinf(value):
        raise ValueError(f"{call}: {name}={value!r} must be finite.")
    if high is None:
        if not (value >= low):  # also rejects NaN
            raise ValueError(f"{call}: {name}={value!r} must be >= {low:g}.")
    else:
        if not (low <= value < high):
            raise ValueError(f"{call}: {name}={value!r} must be in [{low:g}, {high:g}).")
    return value


def _check_lr(call: str, lr: Any) -> LearningRate:
    if isinstance(lr, Tensor):
        if lr.dim() != 0 or not lr.is_floating_point():
            raise ValueError(
                f"{call}: lr must be a float or a 0-dim floating tensor, got a {lr.dtype} tensor of "
                f"shape {tuple(lr.shape)}. Use torch.tensor(value) (0-dim, float32)."
            )
        value = float(lr.detach().cpu())  # construction time: not inside a compiled step
        if not (value >= 0) or math.isinf(value):
            raise ValueError(f"{call}: lr={value!r} (a tensor) must be finite and >= 0.")
        return lr
    return _check_number(call, "lr", lr, low=0.0)


def _check_betas(call: str, betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{call}: betas must be a pair of floats (beta1, beta2), got {betas!r}.")
    return (
        _check_number(call, "betas[0]", betas[0], low=0.0, high=1.0),
        _check_number(call, "betas[1]", betas[1], low=0.0, high=1.0),
    )


def _check_params(call: str, params: Any) -> list[str]:
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{call}: params must be a dict[str, Tensor] keyed like module.named_parameters(), got "
            f"{type(params).__name__}."
        )
    for name, p in params.items():
        if not isinstance(p, Tensor) or not (p.is_floating_point() or p.is_complex()):
            what = f"a {p.dtype} tensor" if isinstance(p, Tensor) else f"a {type(p).__name__}"
            raise TypeError(f"{call}: params[{name!r}] must be a floating-point tensor, got {what}.")
    return list(params)


def _check_like_params(call: str, what: str, tree: Any, params: Params) -> None:
    """``tree`` must be a dict with exactly the keys of ``params`` and tensors of the same shapes."""
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{call}: {what} must be a dict[str, Tensor] with the keys of params, got "
            f"{type(tree).__name__}."
        )
    missing = [k for k in params if k not in tree]
    extra = [k for k in tree if k not in params]
    if missing or extra:
        raise ValueError(
            f"{call}: the keys of {what} differ from the keys of params (leaves are joined by key); "
            f"missing from {what}: {missing}; extra in {what}: {extra}. Pass {what} for exactly the "
            "trainable params (e.g. frozen params are not in params)."
        )
    for name, p in params.items():
        t = tree[name]
        if not isinstance(t, Tensor):
            raise TypeError(f"{call}: {what}[{name!r}] must be a tensor, got {type(t).__name__}.")
        if t.shape != p.shape:
            hint = (
                " Did you pass per-sample gradients? Sum them first (clip_and_sum)."
                if what == "grads" and t.dim() == p.dim() + 1 and t.shape[1:] == p.shape
                else ""
            )
            raise ValueError(
                f"{call}: {what}[{name!r}] has shape {tuple(t.shape)}, expected the param's shape "
                f"{tuple(p.shape)}.{hint}"
            )


def _check_state(call: str, state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{call}: state must be the {cls.__name__} returned by this optimizer's init or update, "
            f"got {type(state).__name__}."
        )


# ----------------------------------------------------------------------------------------------
# copies: torch's kernels work in place, on these


def _copies(tree: Mapping[str, Tensor], names: list[str]) -> list[Tensor]:
    return [tree[k].detach().clone() for k in names]


def _grad_copies(grads: Grads, params: Params, names: list[str]) -> list[Tensor]:
    """Fresh copies of the grads in each param's dtype and device (the kernels may write into them)."""
    return [
        grads[k].detach().to(device=params[k].device, dtype=params[k].dtype, copy=True) for k in names
    ]


def _step_device(params: Params) -> torch.device:
    for p in params.values():
        return p.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# SGD


def sgd(
    lr: LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, with optional momentum, Nesterov momentum and weight decay.

    Runs ``torch.optim.sgd.sgd`` (the kernel of ``torch.optim.SGD``) on copies of its inputs.

    Args:
        lr: the learning rate, ``>= 0``: a float, or a 0-dim floating tensor read at every update.
        momentum: ``>= 0``; 0 keeps no momentum buffer.
        dampening: dampening for momentum, as in ``torch.optim.SGD``.
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
        weight_decay: L2 penalty coefficient, ``>= 0`` (added to the gradient).
        maximize: ascend the objective instead of descending.

    Returns:
        An :class:`Optimizer`; its state is an :class:`SGDState`.

    Guarantees:
        Equal to ``torch.optim.SGD`` with the same hyperparameters given the same gradients
        (bitwise on CPU), including the first step with momentum, where the buffer starts as the
        undamped gradient. With ``dampening != 0`` each update evaluates the kernel twice (first
        step and later steps) and selects by ``state.step``, so that the state's structure never
        changes and a compiled step compiles once. Inputs are never modified.

    Raises:
        ValueError: a hyperparameter out of range (at construction); grads' keys or shapes differ
            from params' (in ``update``).

    Example:
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
        >>> params["w"]
        tensor([0.9000, 1.1000])
    """
    call = "sgd"
    lr = _check_lr(call, lr)
    momentum = _check_number(call, "momentum", momentum, low=0.0)
    dampening = _check_number(call, "dampening", dampening, low=-math.inf)
    weight_decay = _check_number(call, "weight_decay", weight_decay, low=0.0)
    nesterov, maximize = bool(nesterov), bool(maximize)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"{call}: nesterov=True requires momentum > 0 and dampening = 0, got "
            f"momentum={momentum!r}, dampening={dampening!r}."
        )
    hyper = dict(
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize,
    )
    update_call = "sgd(...).update(grads, state, params)"

    def init(params: Params) -> SGDState:
        _check_params("sgd(...).init(params)", params)
        step = torch.zeros((), dtype=torch.float32, device=_step_device(params))
        if momentum == 0:
            return SGDState(momentum_buffer=None, step=step)
        bufs = {k: torch.zeros_like(p.detach()) for k, p in params.items()}
        return SGDState(momentum_buffer=bufs, step=step)

    def update(grads: Grads, state: SGDState, params: Params) -> tuple[dict[str, Tensor], SGDState]:
        names = _check_params(update_call, params)
        _check_like_params(update_call, "grads", grads, params)
        _check_state(update_call, state, SGDState)
        if momentum != 0:
            if state.momentum_buffer is None:
                raise ValueError(f"{update_call}: state.momentum_buffer is None but momentum={momentum!r}.")
            _check_like_params(update_call, "state.momentum_buffer", state.momentum_buffer, params)
        with torch.no_grad():
            new_params = _copies(params, names)
            if momentum == 0:
                _sgd_kernel(new_params, _grad_copies(grads, params, names), [None] * len(names), **hyper)
                return dict(zip(names, new_params)), SGDState(None, state.step + 1)
            # A zero buffer gives torch's first step exactly when dampening == 0 (0 * m + g == g).
            bufs: list[Tensor | None] = _copies(state.momentum_buffer, names)
            _sgd_kernel(new_params, _grad_copies(grads, params, names), bufs, **hyper)
            if dampening != 0:
                # torch.optim.SGD starts the buffer as the undamped first gradient: the kernel does
                # that when handed no buffer. Evaluate that branch too and select on the step count.
                first_params = _copies(params, names)
                first_bufs: list[Tensor | None] = [None] * len(names)
                _sgd_kernel(first_params, _grad_copies(grads, params, names), first_bufs, **hyper)
                is_first = state.step == 0
                new_params = [torch.where(is_first, a, b) for a, b in zip(first_params, new_params)]
                bufs = [torch.where(is_first, a, b) for a, b in zip(first_bufs, bufs)]
            return dict(zip(names, new_params)), SGDState(dict(zip(names, bufs)), state.step + 1)

    return Optimizer(init=init, update=update, config=optimizer_config("sgd", hyper))


# ----------------------------------------------------------------------------------------------
# Adam, AdamW


def _adam_like(
    call: str,
    kernel: Callable[..., None],
    *,
    lr: LearningRate,
    betas: Any,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
) -> Optimizer:
    lr = _check_lr(call, lr)
    beta1, beta2 = _check_betas(call, betas)
    eps = _check_number(call, "eps", eps, low=0.0)
    weight_decay = _check_number(call, "weight_decay", weight_decay, low=0.0)
    amsgrad, maximize = bool(amsgrad), bool(maximize)
    hyper = dict(
        amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
        maximize=maximize,
    )
    update_call = f"{call}(...).update(grads, state, params)"

    def init(params: Params) -> AdamState:
        _check_params(f"{call}(...).init(params)", params)

        def zeros() -> dict[str, Tensor]:
            return {k: torch.zeros_like(p.detach()) for k, p in params.items()}

        return AdamState(
            step=torch.zeros((), dtype=torch.float32, device=_step_device(params)),
            exp_avg=zeros(),
            exp_avg_sq=zeros(),
            max_exp_avg_sq=zeros() if amsgrad else None,
        )

    def update(grads: Grads, state: AdamState, params: Params) -> tuple[dict[str, Tensor], AdamState]:
        names = _check_params(update_call, params)
        _check_like_params(update_call, "grads", grads, params)
        _check_state(update_call, state, AdamState)
        _check_like_params(update_call, "state.exp_avg", state.exp_avg, params)
        _check_like_params(update_call, "state.exp_avg_sq", state.exp_avg_sq, params)
        if amsgrad:
            if state.max_exp_avg_sq is None:
                raise ValueError(f"{update_call}: state.max_exp_avg_sq is None but amsgrad=True.")
            _check_like_params(update_call, "state.max_exp_avg_sq", state.max_exp_avg_sq, params)
        # On accelerators keep the whole step on the device (no .item() per param); on CPU use
        # torch.optim's own default path, so the numbers match it bitwise.
        capturable = bool(names) and all(
            params[k].device.type in _CAPTURABLE_DEVICE_TYPES and params[k].device == state.step.device
            for k in names
        )
        with torch.no_grad():
            new_params = _copies(params, names)
            exp_avg = _copies(state.exp_avg, names)
            exp_avg_sq = _copies(state.exp_avg_sq, names)
            max_exp_avg_sq = _copies(state.max_exp_avg_sq, names) if amsgrad else []
            # The kernel counts steps per param, in place: one copy of the shared count each. Off
            # the capturable path, eager reads it with .item() (a Python float), but a compiled
            # step computes 1 - beta2**step in the tensor's dtype, where float32 cancels (relative
            # error ~1e-5 for beta2 = 0.999): hand it float64 copies. The capturable path keeps
            # torch's float32, the configuration torch tests.
            step_dtype = state.step.dtype if capturable or state.step.device.type == "mps" else torch.float64
            steps = [state.step.detach().to(dtype=step_dtype, copy=True) for _ in names]
            kernel(
                new_params, _grad_copies(grads, params, names), exp_avg, exp_avg_sq, max_exp_avg_sq,
                steps, capturable=capturable, **hyper,
            )
            new_state = AdamState(
                step=state.step + 1,
                exp_avg=dict(zip(names, exp_avg)),
                exp_avg_sq=dict(zip(names, exp_avg_sq)),
                max_exp_avg_sq=dict(zip(names, max_exp_avg_sq)) if amsgrad else None,
            )
        return dict(zip(names, new_params)), new_state

    return Optimizer(init=init, update=update, config=optimizer_config(call, hyper))


def adam(
    lr: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
) -> Optimizer:
    """Adam (Kingma & Ba, 2015), with L2 weight decay added to the gradient.

    Runs ``torch.optim.adam.adam`` (the kernel of ``torch.optim.Adam``) on copies of its inputs.

    Args:
        lr: the learning rate, ``>= 0``: a float, or a 0-dim floating tensor read at every update.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``: decay rates of the running means of the
            gradient and of its square.
        eps: ``>= 0``, added to the denominator.
        weight_decay: L2 penalty coefficient, ``>= 0`` (added to the gradient; for decoupled
            decay use :func:`adamw`).
        amsgrad: use the running maximum of the second moment (Reddi et al., 2018).
        maximize: ascend the objective instead of descending.

    Returns:
        An :class:`Optimizer`; its state is an :class:`AdamState`.

    Guarantees:
        Equal to ``torch.optim.Adam`` with the same hyperparameters given the same gradients
        (bitwise on CPU). On CUDA/XPU/HPU the kernel runs with ``capturable=True`` (the step count
        stays on the device, no host sync), which can round the bias correction differently from
        torch's default there in the last bits. Inputs are never modified.

    Raises:
        ValueError: a hyperparameter out of range (at construction); grads' keys or shapes differ
            from params' (in ``update``).

    Example:
        >>> opt = adam(1e-2)
        >>> params = {"w": torch.zeros(3)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.tensor([1.0, -2.0, 0.0])}, state, params)
        >>> params["w"]
        tensor([-0.0100,  0.0100,  0.0000])
    """
    return _adam_like(
        "adam", _adam_kernel, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        amsgrad=amsgrad, maximize=maximize,
    )


def adamw(
    lr: LearningRate = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> Optimizer:
    """AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay.

    Runs ``torch.optim.adamw.adamw`` (the kernel of ``torch.optim.AdamW``) on copies of its
    inputs. Each update first shrinks the params by ``1 - lr * weight_decay``, then takes the Adam
    step. Arguments, state, guarantees and errors are those of :func:`adam`.

    Example:
        >>> opt = adamw(1e-2, weight_decay=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> params, _ = opt.update({"w": torch.zeros(2)}, opt.init(params), params)
        >>> params["w"]
        tensor([0.9990, 0.9990])
    """
    return _adam_like(
        "adamw", _adamw_kernel, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        amsgrad=amsgrad, maximize=maximize,
    )


# ----------------------------------------------------------------------------------------------
# any torch.optim.Optimizer, the slow general way


def _copy_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of one param's optimizer state that shares no tensor with ``entry``."""
    return {s: (v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)) for s, v in entry.items()}


def from_torch(optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> Optimizer:
    """Wrap any ``torch.optim.Optimizer`` subclass as an init/update pair (slow, general path).

    Each ``update`` builds a throwaway ``optimizer_cls(copies_of_params, **kwargs)``, loads the
    state into it (``load_state_dict``), sets each copy's ``.grad`` (cast to the param's dtype),
    calls ``.step()`` and reads back the params and ``state_dict()["state"]``. That is a Python
    object per call and a host round trip: use it for optimizers without a functional form, in
    eager mode; prefer :func:`sgd`, :func:`adam`, :func:`adamw` inside a compiled step.

    Args:
        optimizer_cls: a subclass of ``torch.optim.Optimizer`` whose ``step()`` needs no closure
            (not ``LBFGS``).
        **kwargs: its hyperparameters (one param group), e.g. ``lr=1e-2, alpha=0.9``.

    Returns:
        An :class:`Optimizer`; its state is a :class:`TorchOptimizerState`, whose ``per_param``
        is empty for each param until its first update (torch optimizers create state lazily).

    Guarantees:
        Equal to using ``optimizer_cls`` directly with ``p.grad = g; opt.step()``. Inputs are
        never modified.

    Raises:
        TypeError: ``optimizer_cls`` is not an ``Optimizer`` subclass. The optimizer's own errors
            for bad ``kwargs`` are raised here, at construction.

    Example:
        >>> opt = from_torch(torch.optim.RMSprop, lr=1e-2)
        >>> params = {"w": torch.ones(2)}
        >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> sorted(state.per_param["w"])
        ['square_avg', 'step']
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch(optimizer_cls, **kwargs): optimizer_cls must be a subclass of "
            f"torch.optim.Optimizer (e.g. torch.optim.RMSprop), got {optimizer_cls!r}."
        )
    name = f"from_torch({optimizer_cls.__name__})"
    optimizer_cls([torch.zeros(1)], **kwargs)  # the optimizer validates its kwargs now, not mid-training
    update_call = f"{name}.update(grads, state, params)"
    own_keys: dict[tuple, frozenset] = {}  # a param's state keys after one step from none (by name, shape, dtype, device)

    def step_copies(params: Params, names: list[str], grads: Grads, state: Mapping[str, Mapping]) -> tuple[list[Tensor], Any]:
        leaves = _copies(params, names)
        opt = optimizer_cls(leaves, **kwargs)
        saved = opt.state_dict()
        # load_state_dict keeps some tensors as they are (``step``) and step() then counts in
        # place: hand it copies, so the caller's state stays untouched
        saved["state"] = {i: _copy_entry(state[k]) for i, k in enumerate(names) if state.get(k)}
        opt.load_state_dict(saved)
        for leaf, g in zip(leaves, _grad_copies(grads, params, names)):
            leaf.grad = g
        opt.step()
        return leaves, opt.state_dict()["state"]

    def check_kind(per_param: Mapping[str, Mapping], names: list[str], params: Params, grads: Grads) -> None:
        """A param's saved state must hold at least the keys this optimizer makes at its first step
        (more is fine: an optimizer may add keys later, or ignore another setting's): another
        optimizer's (an RMSprop run's checkpoint loaded into an SGD one) would be ignored, or half used.
        The keys come from one step on copies from no state, once per param name, shape, dtype and
        device (that first update holds a second copy of the params and the new state meanwhile)."""
        key = lambda k: (k, tuple(params[k].shape), params[k].dtype, params[k].device)  # noqa: E731
        held = [k for k in names if per_param[k]]
        if any(key(k) not in own_keys for k in held):
            accel = [d for d in {params[k].device for k in names} if d.type != "cpu"]
            with torch.random.fork_rng(devices=accel, device_type=accel[0].type if accel else "cpu"):  # (its draws are not the run's)
                _, fresh = step_copies(params, names, grads, {})
            own_keys.update({key(k): frozenset(fresh.get(i, {})) for i, k in enumerate(names)})
        for k in held:
            made = own_keys[key(k)]
            if not made or not made <= set(per_param[k]):
                raise ValueError(
                    f"{update_call}: state.per_param[{k!r}] holds {sorted(per_param[k])}, but {optimizer_cls.__name__}"
                    f"({', '.join(f'{a}={v!r}' for a, v in kwargs.items())}) makes {sorted(made)} for it: the state was "
                    "made by another optimizer or other hyperparameters (a checkpoint of another run?). Resume with the "
                    "optimizer that saved it, or start its state afresh with init(params). Nothing was updated."
                )

    def init(params: Params) -> TorchOptimizerState:
        names = _check_params(f"{name}.init(params)", params)
        return TorchOptimizerState(per_param={k: {} for k in names})

    def update(
        grads: Grads, state: TorchOptimizerState, params: Params
    ) -> tuple[dict[str, Tensor], TorchOptimizerState]:
        names = _check_params(update_call, params)
        _check_like_params(update_call, "grads", grads, params)
        _check_state(update_call, state, TorchOptimizerState)
        per_param = state.per_param
        if not isinstance(per_param, Mapping) or set(per_param) != set(names):
            got = sorted(per_param) if isinstance(per_param, Mapping) else type(per_param).__name__
            raise ValueError(
                f"{update_call}: state.per_param must have the keys of params, {sorted(names)}; got {got}."
            )
        check_kind(per_param, names, params, grads)
        leaves, after = step_copies(params, names, grads, per_param)
        new_state = {k: _copy_entry(after.get(i, {})) for i, k in enumerate(names)}
        return {k: leaf.detach() for k, leaf in zip(names, leaves)}, TorchOptimizerState(new_state)

    return Optimizer(
        init=init, update=update, config=optimizer_config(f"from_torch[{optimizer_cls.__module__}.{optimizer_cls.__qualname__}]", kwargs),
        elementwise=optimizer_cls in _ELEMENTWISE,
    )
