"""One home for argument checks: the same argument gets the same check everywhere.

Every public entry point checks its arguments through these functions, so a bad value raises
the same exception with the same message shape wherever it is passed:

* ``TypeError`` for a wrong type (``noise_multiplier="1"``, ``steps=10.0``, ``delta=None``),
* ``ValueError`` for a value out of range (``sample_rate=0``, ``delta=1``, ``l2_clip_norm=nan``),

and the message reads ``"<call>: <name>=<value> must be <range>; <what it means>. <one fix>"``.

Tensor clipping norms (adaptive clipping passes them) are checked on the host when that is
possible (eagerly, outside ``torch.compile``); where it is not (while tracing), the clipping
code makes the computation itself safe with :func:`clip_norm_ok` (an invalid norm releases
nothing, never more than a valid one).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import sys
import warnings
from typing import Any, Mapping, Sequence

import optree
import torch

from vmapdp._tree import leaves as _leaves

ACCOUNTANTS = ("rdp", "pld", "prv", "gdp")

NOISE_MEANING = "noise_multiplier is the noise std divided by l2_clip_norm"
SAMPLE_RATE_MEANING = (
    "sample_rate is the probability that each example is in a step's batch "
    "(expected batch size / dataset size)"
)
DELTA_MEANING = (
    "delta is the probability with which the epsilon guarantee may fail; it must be well below "
    "1/num_samples (e.g. 1e-5), because a mechanism that publishes one random record in the clear "
    "is already (0, 1/num_samples)-DP"
)
CLIP_MEANING = "l2_clip_norm is the largest L2 norm one sample's gradient may contribute"


def is_real(value: Any) -> bool:
    """A real number that is not a bool (``True`` is an int to Python, never a rate here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _type_error(call: str, name: str, value: Any, kind: str, fix: str = "") -> TypeError:
    return TypeError(f"{call}: {name} must be {kind}, got {type(value).__name__} ({value!r}).{' ' + fix if fix else ''}")


def _value_error(call: str, name: str, value: Any, rng: str, meaning: str = "", fix: str = "") -> ValueError:
    tail = f"; {meaning}." if meaning else "."
    return ValueError(f"{call}: {name}={value!r} must be {rng}{tail}{' ' + fix if fix else ''}")


def flag(call: str, name: str, value: Any, *, optional: bool = False) -> bool | None:
    """``True`` or ``False`` (a NumPy bool too; ``None`` where ``optional``): TypeError otherwise.
    A flag read for its truth would take ``secure="no"``, ``fixed_shapes="False"`` or ``causal=0``
    for what they do not say (found by review: ``hf.loss_fn(causal=0)`` passed the refusal that
    tests ``causal is False`` and built a bidirectional mask)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    kind = "True, False or None" if optional else "True or False"
    raise TypeError(f"{call}: {name} must be {kind}, got {type(value).__name__} ({shortened(repr(value))}). Pass {name}=True or {name}=False.")


def number(call: str, name: str, value: Any, *, meaning: str = "") -> float:
    """A real number (int or float, not bool): TypeError otherwise."""
    if not is_real(value):
        raise _type_error(call, name, value, "a real number (int or float)", f"Pass e.g. {name}=float(...)." if not meaning else f"({meaning}.)")
    return float(value)


def positive(
    call: str, name: str, value: Any, *, allow_zero: bool = False, allow_inf: bool = False, meaning: str = "", fix: str = ""
) -> float:
    """A real ``> 0`` (``>= 0`` with ``allow_zero``), finite unless ``allow_inf``; NaN never."""
    given = value
    value = number(call, name, value, meaning=meaning)
    ok = (value >= 0 if allow_zero else value > 0) and (allow_inf or math.isfinite(value))
    if not ok:
        rng = (">= 0" if allow_zero else "> 0") if allow_inf else ("finite and >= 0" if allow_zero else "finite and > 0")
        raise _value_error(call, name, given, rng, meaning, fix)
    return value


def positive_int(call: str, name: str, value: Any, *, minimum: int = 1, meaning: str = "", fix: str = "") -> int:
    """An int (``operator.index``: no floats, not even 10.0; no bools) ``>= minimum``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise _type_error(call, name, value, f"an int >= {minimum}", f"Pass {name}=int(...).")
    try:
        value = operator.index(value)
    except TypeError:
        raise _type_error(call, name, value, f"an int >= {minimum}", f"Pass {name}=int(...).") from None
    if value < minimum:
        raise _value_error(call, name, value, f"an int >= {minimum}", meaning, fix)
    return value


def optional_positive_int(call: str, name: str, value: Any, *, meaning: str = "") -> int | None:
    """None, or an int >= 1."""
    return None if value is None else positive_int(call, name, value, meaning=meaning, fix=f"Or pass {name}=None.")


def probability(
    call: str, name: str, value: Any, *, allow_zero: bool = False, allow_one: bool = True, meaning: str = "", fix: str = ""
) -> float:
    """A real in ``(0, 1]`` (the bounds opened or closed by ``allow_zero`` / ``allow_one``)."""
    given = value
    value = number(call, name, value, meaning=meaning)
    lo_ok = value >= 0 if allow_zero else value > 0
    hi_ok = value <= 1 if allow_one else value < 1
    if not (lo_ok and hi_ok):  # NaN fails both
        rng = f"in {'[' if allow_zero else '('}0, 1{']' if allow_one else ')'}"
        raise _value_error(call, name, given, rng, meaning, fix)
    return value


def sample_rate(call: str, value: Any, *, name: str = "sample_rate") -> float:
    """The Poisson sampling rate, in ``(0, 1]`` everywhere (a rate of 0 samples no data: such a
    step is no step, and needs no accounting)."""
    fix = "Did you pass the batch size? Use sample_rate=expected_batch_size/num_samples." if is_real(value) and value > 1 else ""
    return probability(call, name, value, meaning=SAMPLE_RATE_MEANING, fix=fix)


def noise_multiplier(call: str, value: Any, *, allow_zero: bool = False, zero_fix: str = "") -> float:
    """A finite noise multiplier ``> 0`` (``>= 0`` with ``allow_zero``: training without privacy)."""
    fix = ""
    if is_real(value) and value == 0 and not allow_zero:
        fix = zero_fix or "Zero noise is not private: use a positive noise_multiplier."
    elif is_real(value) and math.isinf(value):
        fix = "A step that releases nothing needs no event: leave it out of the ledger."
    value = positive(call, "noise_multiplier", value, allow_zero=allow_zero, meaning=NOISE_MEANING, fix=fix)
    if value and not _NOISE_RANGE[0] <= value <= _NOISE_RANGE[1]:
        # (found by review: the PLD accountant overflowed at 1e300 and divided by zero at 1e-300)
        raise ValueError(
            f"{call}: noise_multiplier={value!r} is outside [{_NOISE_RANGE[0]:g}, {_NOISE_RANGE[1]:g}], where the accountants' "
            "float64 arithmetic holds (its square and reciprocal square stay finite). No useful run needs more: "
            f"{'epsilon is 0 to float64 precision from about 1e30 on' if value > 1 else 'such a step is not private (epsilon beyond 1e30)'}."
        )
    return value


_NOISE_RANGE = (1e-100, 1e100)


def delta(call: str, value: Any, *, name: str = "delta", num_samples: int | None = None, refuse_large: bool = True) -> float:
    """``0 < delta < 1``; with ``num_samples``, also ``delta < 1/num_samples`` (a ValueError, or a
    warning where ``refuse_large=False``: the accountants, which only report)."""
    value = probability(call, name, value, allow_one=False, meaning=DELTA_MEANING, fix=f"Pass e.g. {name}=1e-5.")
    if num_samples is not None and value >= 1.0 / num_samples:
        text = (
            f"{call}: {name}={value!r} must be below 1/num_samples = 1/{num_samples} = {1.0 / num_samples:.3g}; "
            f"{DELTA_MEANING}, so such a guarantee protects nobody. Pass {name} well below 1/num_samples, "
            f"e.g. {name}={_suggest_delta(num_samples):.1e} (about 1/num_samples**1.1)."
        )
        if refuse_large:
            raise ValueError(text)
        warnings.warn(text, UserWarning, stacklevel=3)
    return value


def _suggest_delta(n: int) -> float:
    return 10.0 ** math.floor(math.log10(1.0 / n**1.1))


def epsilon(call: str, value: Any, *, name: str = "epsilon", allow_zero: bool = True) -> float:
    """A finite epsilon ``>= 0`` (``> 0`` unless ``allow_zero``)."""
    return positive(call, name, value, allow_zero=allow_zero, meaning="epsilon is the privacy budget", fix=f"E.g. {name}=8.0.")


def choice(call: str, name: str, value: Any, options: Sequence[str], *, why: str = "") -> str:
    """One of ``options``, spelled exactly (no case folding: ``"PLD"`` is refused with the fix)."""
    listed = ", ".join(map(repr, options))
    if not isinstance(value, str):
        raise _type_error(call, name, value, f"one of {listed} (a str)")
    if value not in options:
        close = [o for o in options if o.lower() == value.lower()]
        fix = f"Did you mean {name}={close[0]!r}? Options are spelled exactly." if close else ""
        raise _value_error(call, name, value, f"one of {listed}", why, fix)
    return value


#: The oldest torch whose compiler traces the step (2.9's dynamo refuses optree's C functions and
#: functorch's autograd.Function inside vmap; 2.11 compiled it on a GPU, 2.13 and 2.14 on the CPU).
COMPILE_MIN_TORCH = (2, 11)


def _major_minor(version: str) -> tuple[int, ...]:
    """``(2, 11)`` of ``"2.11.0a0+git1234"``; shorter where the version does not start with two numbers."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def optree_untraceable(call: str, torch_version: str, optree_version: str) -> str:
    """The message for torch 2.11's dynamo on optree 0.20 (``compile_supported`` refuses the pair;
    ``train`` explains the trace error where another torch shows it)."""
    return (
        f"{call}: torch {torch_version}'s compiler cannot trace optree {optree_version} (optree 0.20's registry compares "
        "sys.version_info, which torch 2.11's dynamo cannot; torch 2.13's can). Fix: pip install 'optree<0.20', or "
        "torch>=2.13, or compile=False."
    )


def compile_supported(call: str, version: str | None = None) -> None:
    """Refuse ``compile=`` on a torch whose compiler cannot trace the step, naming the fix."""
    version = torch.__version__ if version is None else version
    have = _major_minor(version)
    if have == (2, 11):
        import optree

        if _major_minor(optree.__version__) >= (0, 20):
            raise RuntimeError(optree_untraceable(call, version, optree.__version__) + " Nothing was run.")
    if len(have) == 2 and have < COMPILE_MIN_TORCH:
        raise RuntimeError(
            f"{call}: compile needs torch>={'.'.join(map(str, COMPILE_MIN_TORCH))}; this is torch {version} (untested "
            "below 2.11; torch 2.9's compiler cannot trace the DP step: dynamo refuses optree's C functions). Pass "
            "compile=False (the eager step: the same results), or upgrade torch. Nothing was run."
        )


def compile_backend(call: str, value: Any) -> str | None:
    """``compile=``: ``True`` (Inductor), ``False`` (eager: None) or a ``torch.compile`` backend's name
    (``"inductor"``; ``"aot_eager"`` and ``"eager"``, dynamo's and AOTAutograd's capture without
    code generation, for tests of the compiled path that cannot wait for Inductor), as a backend name."""
    if value is not False and isinstance(value, (bool, str)):
        compile_supported(call)
    if isinstance(value, bool):
        return "inductor" if value else None
    if not isinstance(value, str):
        raise _type_error(call, "compile", value, "True, False or a torch.compile backend name (a str)")
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if value not in backends:
        raise _value_error(
            call, "compile", value, f"True, False or one of torch._dynamo.list_backends(exclude_tags=()): {', '.join(map(repr, backends))}",
            "the backend torch.compile(fullgraph=True) runs each chunk with", "Use compile=True for Inductor.",
        )
    return value


def accountant(call: str, value: Any, options: Sequence[str] = ACCOUNTANTS, *, why: str = "") -> str:
    """An accountant name (exact spelling); ``"prv"`` is returned as ``"pld"`` (the same one)."""
    why = why or "'rdp' is a fast upper bound, 'pld' ('prv') a tight upper bound, 'gdp' a CLT approximation (not a bound)"
    value = choice(call, "accountant", value, options, why=why)
    return "pld" if value == "prv" else value


# the smallest clip norm: per-sample norms are sums of squares, and float32 squares of gradient
# entries below ~2.6e-23 underflow to 0; at C >= 2**-40 what they drop is below 1e-9 C (for up to
# 1e12 params), while at C = 1e-22 a sample whose entries were all that small had norm 0 and went
# out unclipped at 15 C (found by review)
MIN_CLIP_NORM = 2.0**-40


def _not_too_small(call: str, name: str, value: float) -> None:
    if value < MIN_CLIP_NORM:
        raise ValueError(
            f"{call}: {name}={value!r} is below 2**-40 (~9.1e-13), where the squares of float32 gradient entries underflow "
            f"and a sample's norm could be computed as 0 (releasing it unclipped); {CLIP_MEANING}. Scale the loss up by s and "
            "clip at s * C instead (the same clipped update, times s)."
        )


def clip_norm(call: str, name: str, value: Any, *, allow_inf: bool = True) -> float | torch.Tensor:
    """A clipping bound ``C``: a real ``>= MIN_CLIP_NORM`` (``math.inf`` switches clipping off, for
    non-private tests, where ``allow_inf``), or a 0-dim floating tensor that is finite and ``>=
    MIN_CLIP_NORM`` (2**-40).

    A tensor is read on the host when possible (not while ``torch.compile`` traces, not inside a
    functorch transform that batches or tracks it); the clipping code then still guards the
    computation with :func:`clip_norm_ok`, so an unchecked NaN / inf / non-positive tensor releases
    nothing rather than switching clipping off or flipping gradients.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{call}: {name} must be a 0-dim tensor (one bound for every sample), got shape "
                f"{tuple(value.shape)}; {CLIP_MEANING}. Pass a float or a 0-dim tensor (per-layer bounds: "
                "vmapdp.clip_and_sum_per_layer)."
            )
        if not value.is_floating_point():
            raise _type_error(call, name, value, "a float or a 0-dim floating-point tensor", "Pass float(...) or a float tensor.")
        if _host_readable(value):
            v = float(value.detach())
            if not (math.isfinite(v) and v > 0):
                raise ValueError(
                    f"{call}: {name}={value!r} must be finite and > 0; {CLIP_MEANING}, and a NaN, "
                    "infinite or non-positive bound would switch clipping off or flip gradients. "
                    "Check the code that computes it (adaptive clipping?)."
                )
            _not_too_small(call, name, v)
        return value
    if not is_real(value):
        raise _type_error(call, name, value, "a positive float or a 0-dim tensor", f"({CLIP_MEANING}.)")
    fix = "math.inf switches clipping off, for non-private tests only." if allow_inf else ""
    value = positive(call, name, value, allow_inf=allow_inf, meaning=CLIP_MEANING, fix=fix)
    _not_too_small(call, name, value)
    return value


def _host_readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s value can be read now without breaking a trace."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    return t.device.type != "meta"


def clip_norm_ok(value: Any) -> Any:
    """For a tensor bound: a bool tensor, True where it is finite and ``>= MIN_CLIP_NORM``
    (computed on the device, no host read). For a number (checked eagerly): None."""
    if isinstance(value, torch.Tensor):
        return torch.isfinite(value) & (value >= MIN_CLIP_NORM)
    return None


def noise_std(call: str, value: Any) -> float | torch.Tensor:
    """A noise std: a finite real ``>= 0``, or a 0-dim floating tensor checked like
    :func:`clip_norm` (host read when possible; traced, :func:`noise_std_guarded` makes a bad one
    release NaN, that is nothing)."""
    meaning = "std is the noise standard deviation, noise_multiplier * l2_clip_norm"
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{call}: std must be a 0-dim tensor, got shape {tuple(value.shape)}; {meaning}. Pass a float or a 0-dim tensor.")
        if not value.is_floating_point():
            raise _type_error(call, "std", value, "a float or a 0-dim floating-point tensor", "Pass float(...) or a float tensor.")
        if _host_readable(value):
            v = float(value.detach())
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{call}: std={value!r} must be finite and >= 0; {meaning}.")
        return value
    return positive(call, "std", value, allow_zero=True, meaning=meaning)


def noise_std_guarded(value: Any) -> Any:
    """A tensor std that is NaN where it is not finite and >= 0 (noise of NaN releases nothing)."""
    if isinstance(value, torch.Tensor):
        return torch.where(torch.isfinite(value) & (value >= 0), value, torch.full_like(value, math.nan))
    return value


def params_dict(call: str, params: Any, *, what: str = "params", require_dict: bool = True, fsdp_ok: bool = False) -> Any:
    """A non-empty dict of tensors (the trainable params from ``vmapdp.functionalize``); with
    ``require_dict=False`` any pytree that holds at least one tensor. FSDP2's ``DTensor`` shards
    (``functionalize`` of a ``fully_shard`` module) only where ``fsdp_ok`` (the calls that read
    them one parameter at a time: ``Sharding``, ``init_train_state``)."""
    if require_dict and not isinstance(params, dict):
        raise _type_error(call, what, params, "a dict of tensors keyed like named_parameters() (from vmapdp.functionalize)")
    leaves = [leaf for leaf in _leaves(params) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise ValueError(
            f"{call}: {what}={params!r} must hold at least one tensor; there is nothing to differentiate or train "
            "(a model without parameters, or all of them frozen with requires_grad=False?). Unfreeze the "
            "parameters to train (vmapdp.functionalize puts frozen ones in buffers)."
        )
    if isinstance(params, dict):
        bad = [k for k, v in params.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"{call}: {what} must map names to tensors; {bad[:5]} are not tensors.")
    if not fsdp_ok:
        no_dtensor(call, leaves, what)
    return params


def no_dtensor(call: str, tree: Any, what: str = "params") -> None:
    """ValueError, with the fix, where ``tree`` holds FSDP2 ``DTensor`` shards (``functionalize`` of a
    ``fully_shard`` module): the calls that run the model on full params cannot take them."""
    from vmapdp.sharding import _is_dtensor

    if any(_is_dtensor(leaf) for leaf in _leaves(tree)):
        raise ValueError(
            f"{call}: {what} hold FSDP2 DTensor shards (vmapdp.functionalize of a fully_shard module does not gather "
            "them). Train them sharded: state = init_train_state(params, opt, sharding=Sharding(params)) and "
            "make_train_step(..., sharding=) (see vmapdp.sharding); or gather them first: "
            "{k: v.full_tensor() for k, v in params.items()} (the whole model on every rank)."
        )


def loss_function(call: str, fn: Any, name: str = "loss_fn") -> Any:
    """A callable of the params, not a model (found by review: an nn.Module passed as the loss met
    a raw "forward() takes 2 positional arguments but 4 were given"). A module without parameters
    passes: a loss written as a module whose forward takes ``(params, ..., sample)``."""
    if isinstance(fn, torch.nn.Module) and any(True for _ in fn.parameters()):
        raise TypeError(
            f"{call}: {name} is a torch.nn.Module ({type(fn).__name__}); the transforms take a function of the params. "
            f"Make one: apply, params, buffers = vmapdp.functionalize(model), then {name} = lambda p, b, sample: "
            "criterion(apply(p, b, x[None]), y[None]) for sample = (x, y)."
        )
    if not callable(fn):
        raise TypeError(f"{call}: {name} must be callable, got {type(fn).__name__}.")
    return fn


def optimizer(call: str, value: Any) -> Any:
    """A functional optimizer: an init/update pair (``vmapdp.optim``'s)."""
    if not (hasattr(value, "init") and hasattr(value, "update")):
        raise TypeError(
            f"{call}: optimizer must be an init/update pair such as vmapdp.optim.sgd(lr=0.1), got {type(value).__name__}."
            + (" Wrap a torch optimizer's class instead: vmapdp.optim.from_torch(torch.optim.SGD, lr=0.1)." if isinstance(value, torch.optim.Optimizer) else "")
        )
    return value


def privatizer(call: str, value: Any) -> Any:
    """An init/privatize pair such as :func:`vmapdp.noise.gaussian_privatizer` (a :class:`vmapdp.noise.Privatizer`)."""
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "privatize", None))):
        raise _type_error(call, "privatizer", value, "an init/privatize pair such as vmapdp.noise.gaussian_privatizer(std)")
    return value


def sharding(call: str, value: Any, *, privatizer: Any = None, method: str | None = None, compile: Any = False) -> Any:
    """A :class:`vmapdp.sharding.Sharding` for this process group, with what sharded steps support
    (``method`` and ``compile``: those of the step, for ``unshard="use"``)."""
    from vmapdp import distributed
    from vmapdp.sharding import Sharding

    if not isinstance(value, Sharding):
        raise _type_error(call, "sharding", value, "a vmapdp.sharding.Sharding(params)")
    if value.world_size != distributed.world_size() or value.rank != distributed.rank():
        raise ValueError(
            f"{call}: the sharding is for rank {value.rank} of {value.world_size}, this process is rank {distributed.rank()} of "
            f"{distributed.world_size()}. Build Sharding(params) after torch.distributed.init_process_group, in every process."
        )
    if value.unshard == "use":
        if compile is not False and compile is not None:
            raise ValueError(
                f"{call}: compile={compile!r} with Sharding(unshard='use'): the step gathers each parameter inside the forward "
                "and the backward, which torch.compile cannot trace. Pass compile=False, or Sharding(params, unshard='step') "
                "to gather the whole model once per step and compile."
            )
        if method == "auto":
            raise ValueError(
                f"{call}: method='auto' with Sharding(unshard='use'): auto's race times each rank's calls for as long as its "
                "own clock says, so the ranks would make different numbers of gathers. Name the method: 'ghost' (one forward "
                "and one backward), 'two_pass' or 'vmap'."
            )
    if privatizer is not None:
        import inspect

        bind = getattr(privatizer, "bind", None)
        takes = {} if bind is None else inspect.signature(bind).parameters
        if "offsets" not in takes and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
            raise ValueError(
                f"{call}: with sharding= each rank noises its own shards, so the privatizer must be told the shard layout; "
                "this one has no bind hook that takes offsets= and would give every shard the noise of the parameter's start "
                "(the same noise on every rank). Leave privatizer=None (the keyed Gaussian, sliced per shard), pass "
                "vmapdp.mf.correlated_noise(...), or train unsharded (distributed=True), where any privatizer runs "
                "(gaussian_privatizer(std, noise_dtype=torch.float64): float64 noise is not available sharded)."
            )
    return value


def fsdp_module_params(call: str, module: Any, names: Sequence[str]) -> dict[str, Any]:
    """The trainable parameters of ``module`` by name, for writing params back: exactly ``names``;
    under FSDP2 every one a ``DTensor`` sharded ``Shard(0)`` on a 1-D mesh (``fully_shard``'s
    default layout, the one whose rows :meth:`Sharding.write_to_module` computes)."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(module, nn.Module):
        raise _type_error(call, "module", module, "an nn.Module (the one functionalize read the params from)")
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    if set(params) != set(names):
        raise ValueError(
            f"{call}: the module's trainable parameters {sorted(params)} are not the sharded ones {sorted(names)}. "
            "Pass the module that vmapdp.functionalize read the params from."
        )
    fsdp = any(isinstance(m, FSDPModule) for m in module.modules())
    for k, p in params.items():
        if not isinstance(p, DTensor):
            if fsdp:
                from vmapdp.sharding import RESHARD_FIX

                raise ValueError(
                    f"{call}: {k!r} of this fully_shard module is not a DTensor: the module is unsharded (after a forward "
                    f"with reshard_after_forward=False, or unshard()); {RESHARD_FIX}."
                )
            continue
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"{call}: {k!r} is sharded {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh; only fully_shard's default "
                "layout (Shard(0) on a 1-D mesh) is supported. Wrap the model with fully_shard(module, mesh=<1-D mesh>) and "
                "no shard_placement_fn, or load the params into a plain module."
            )
    return params


def batch_scheme(call: str, rate: Any, sampler: Any) -> tuple[float, Any]:
    """Which batch scheme a step runs: ``(rate, sampler)`` from ``sample_rate=`` and/or ``sampler=``.

    ``sample_rate`` alone means Poisson sampling at that rate (``sampler`` is then None); a
    ``sampler`` (anything with ``event(noise_multiplier)`` and a ``sample_rate``, such as the
    samplers of :mod:`vmapdp.data`) says which scheme ran and its events are recorded. Both may be
    given only when they agree (the same rate); TypeError/ValueError otherwise.
    """
    if sampler is None:
        if rate is None:
            raise ValueError(
                f"{call}: got neither sample_rate= nor sampler=; the ledger must know how the batches were drawn. "
                "Pass sampler=<the vmapdp.data sampler the batches come from> (or sample_rate= for Poisson sampling)."
            )
        return sample_rate(call, rate), None
    if not callable(getattr(sampler, "event", None)) or getattr(sampler, "sample_rate", None) is None:
        raise _type_error(
            call, "sampler", sampler, "a sampler from vmapdp.data (PoissonSampler, FixedSizeSampler, ShuffledSampler, BallsInBinsSampler, TruncatedPoissonSampler, CyclicPoissonSampler)",
            "Its event(noise_multiplier) is what the ledger records for each step.",
        )
    theirs = float(sampler.sample_rate)
    if rate is not None:
        given = sample_rate(call, rate)
        if not math.isclose(given, theirs, rel_tol=1e-12, abs_tol=0.0):
            raise ValueError(
                f"{call}: sample_rate={rate!r} disagrees with the sampler's rate {theirs!r} ({type(sampler).__name__}); "
                "the ledger would not know which one drew the batches. Pass sampler= alone (its events are recorded)."
            )
    return theirs, sampler


# --- DP matrix factorization (vmapdp.mf) ---------------------------------------------------------

MIN_SEPARATION_MEANING = (
    "min_separation is the smallest number of steps between two participations of one example "
    "(1: it may be in consecutive steps; b: at most once in any b consecutive steps)"
)
MAX_PARTICIPATIONS_MEANING = "max_participations is the most steps one example takes part in (None: as many as min_separation allows)"


def momentum(call: str, value: Any) -> float:
    """A momentum coefficient in ``[0, 1)``."""
    return probability(call, "momentum", value, allow_zero=True, allow_one=False,
                       meaning="momentum is the heavy-ball coefficient beta of m_t = beta m_(t-1) + g_t",
                       fix="Pass e.g. momentum=0.9 (0: plain SGD).")


def learning_rates(call: str, value: Any, n: int) -> torch.Tensor:
    """None (all ones) or ``n`` finite learning rates, returned as a float64 tensor."""
    if value is None:
        return torch.ones(n, dtype=torch.float64)
    try:
        lr = torch.as_tensor(value, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise _type_error(call, "learning_rates", value, f"None or a sequence of {n} floats (one per step)") from None
    if lr.numel() != n or not bool(torch.isfinite(lr).all()):
        raise ValueError(
            f"{call}: learning_rates must hold {n} finite floats (one per step), got {lr.numel()} values"
            f"{'' if bool(torch.isfinite(lr).all()) else ' with NaN or inf among them'}. Pass one learning rate per step, or None for 1.0 throughout."
        )
    return lr


def participation(call: str, n: int, min_separation: Any, max_participations: Any) -> tuple[int, int]:
    """``(min_separation, k)``: ``k`` the most participations that fit in ``n`` steps (at most
    ``max_participations``, at most ``ceil(n / min_separation)``)."""
    sep = positive_int(call, "min_separation", min_separation, meaning=MIN_SEPARATION_MEANING)
    cap = optional_positive_int(call, "max_participations", max_participations, meaning=MAX_PARTICIPATIONS_MEANING)
    fit = -(-n // sep)
    return sep, fit if cap is None else min(cap, fit)


def mf_strategy(call: str, value: Any, n: Any) -> tuple[int, Any]:
    """``(n, strategy)``: ``n`` an int >= 1 and the strategy either a Toeplitz strategy of
    :mod:`vmapdp.mf` (anything with ``toeplitz_coeffs(n)``) or an ``n x n`` lower-triangular float
    tensor with a nonzero diagonal (returned as float64)."""
    n = positive_int(call, "n", n, meaning="n is the number of steps")
    if callable(getattr(value, "toeplitz_coeffs", None)):
        return n, value
    if not isinstance(value, torch.Tensor):
        raise _type_error(call, "strategy", value, "a vmapdp.mf strategy (BandedToeplitz, BufferedToeplitz) or an n x n tensor")
    if value.shape != (n, n) or not value.is_floating_point():
        raise ValueError(f"{call}: a strategy tensor must be a floating-point {n} x {n} matrix (n={n}), got {value.dtype} of shape {tuple(value.shape)}. Pass the n x n C, or n=C.shape[0].")
    c = value.detach().to(torch.float64)
    if not bool(torch.isfinite(c).all()):
        raise ValueError(f"{call}: the strategy matrix has NaN or inf entries. Pass a finite C.")
    if bool((c.triu(1) != 0).any()) or bool((c.diagonal() == 0).any()):
        raise ValueError(
            f"{call}: the strategy matrix must be lower-triangular with a nonzero diagonal; the noise C^(-1) z "
            "of step t may only use the noise up to step t, and C must be invertible. Pass a lower-triangular C."
        )
    return n, c


def workload(call: str, value: Any, n: int) -> torch.Tensor:
    """None (prefix sums) or an ``n x n`` finite float tensor, returned as float64."""
    if value is None:
        return torch.ones(n, n, dtype=torch.float64).tril()
    if not isinstance(value, torch.Tensor):
        raise _type_error(call, "workload", value, "None (prefix sums) or an n x n tensor such as vmapdp.mf.momentum_prefix_sums(n, 0.9)")
    if value.shape != (n, n) or not value.is_floating_point() or not bool(torch.isfinite(value).all()):
        raise ValueError(f"{call}: workload must be a finite floating-point {n} x {n} matrix (n={n}), got {value.dtype} of shape {tuple(value.shape)}. Build it with vmapdp.mf.prefix_sums(n) or momentum_prefix_sums(n, ...).")
    return value.detach().to(torch.float64)


def loss_reads_its_sample(call: str, loss: Any) -> None:
    """Inside ``vmap`` over the batch (eagerly), refuse a per-sample loss that does not depend on
    its sample: one that reads data from elsewhere (a typo: ``apply(p, b, x)`` with the dataset's
    ``x`` for the sample's ``xi``) gives every sample the same gradient of those other rows, and
    the release then depends on rows that were never sampled (found by review: released under every
    method). Walks the loss's functorch wrappers (grad levels) for a batched one. Skipped while
    compiling: the eager ``prepare`` of a compiled step checks it (ghost's and "auto"'s probe, and
    one eager forward of a sample for ``vmap`` and ``two_pass``). A loss that depends on its sample
    only partly is not refused."""
    from torch._C import _functorch as fc

    if torch.compiler.is_compiling() or not isinstance(loss, torch.Tensor):
        return
    t = loss
    while True:
        if fc.is_batchedtensor(t):
            return
        if fc.is_gradtrackingtensor(t):
            t = fc.get_unwrapped(t)
            continue
        if fc.is_functionaltensor(t) or type(t) is not torch.Tensor:  # (another wrapper: not refused on a guess)
            return
        break
    raise ValueError(
        f"{call}: loss_fn's value does not depend on its sample (the last argument): every sample would get the same "
        "gradient, of data read from elsewhere, and the release would depend on rows that were never sampled. Compute "
        "the loss from the sample it is given (x, y = sample; apply(params, buffers, x[None])), not from the dataset's "
        "tensors captured from outside."
    )


def loss_is_differentiated(call: str, loss: Any) -> None:
    """Inside the transform that differentiates the loss (``grad``, ghost's ``vjp``), eagerly: refuse
    a loss that does not depend on what is differentiated (``.detach()``, ``torch.no_grad()``, a
    tensor rebuilt from ``.item()``, a loss of buffers only): every gradient would be zero, and a
    DP step would release its noise alone while the model never learns (found by review: silent
    under every method). Skipped while compiling."""
    from torch._C import _functorch as fc

    if torch.compiler.is_compiling() or not isinstance(loss, torch.Tensor):
        return
    t = loss  # (vmap's wrappers over the differentiating transform's: requires_grad shows below them)
    while True:
        if t.requires_grad:
            return
        if not (fc.is_batchedtensor(t) or fc.is_gradtrackingtensor(t)):
            break
        t = fc.get_unwrapped(t)
    if fc.is_functionaltensor(t) or type(t) is not torch.Tensor:  # (another wrapper: not refused on a guess)
        return
    raise ValueError(
        f"{call}: loss_fn's value does not depend on the parameters (it was detached, computed under torch.no_grad(), "
        "rebuilt from .item() / .tolist(), or uses no trainable parameter): every per-sample gradient would be zero, and a "
        "private step would release its noise alone. Return the loss as a tensor computed from params, without detach or "
        "no_grad."
    )


def _all_finite(v: torch.Tensor) -> bool:
    """No NaN or inf in ``v``; float8 read through float32 (torch has no isfinite for it: found by
    review); float4 has neither value."""
    if "float4" in str(v.dtype):
        return True
    return bool(torch.isfinite(v if v.element_size() > 1 else v.float()).all())


def no_nan_shared(call: str, shared: Any) -> None:
    """Refuse shared inputs (buffers, public tensors every sample reads) holding NaN: every sample
    would read them, its gradient be non-finite and dropped, and each step release noise alone
    (found by review: NaN BatchNorm running statistics, silently). Infinities pass (an additive
    attention mask holds -inf). Each step, each tensor's sum (one pass, no copy: 31 ms for a
    GPT-2-small-sized frozen base on a 2-core CPU; NaN in, NaN out), one host sync per device, and
    the exact check only where a sum is NaN (+inf and -inf together make one too). Not cached by
    version (found by review: writes through .data or a NumPy view leave it unchanged)."""
    paths, leaves, _ = optree.tree_flatten_with_path(shared, namespace="torch")
    by_device: dict[torch.device, list] = {}
    for p, v in zip(paths, leaves):
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()) or "float4" in str(v.dtype):
            continue  # (float4 has no NaN)
        if hasattr(v, "to_local"):  # (a DTensor: this rank's part; the step's failure is told to every rank)
            v = v.to_local()
        if v.layout == torch.sparse_coo:
            v = v._values()
        if v.layout != torch.strided or v.is_nested or v.device.type == "meta" or not v.numel():
            continue
        v = v if v.element_size() > 1 else v.float()  # (float8: no sum or isnan for it)
        by_device.setdefault(v.device, []).append((p, v, v.sum()))
    where = []
    for found in by_device.values():
        sums = torch.stack([s for _, _, s in found]).cpu().tolist()
        where += [p for (p, v, _), total in zip(found, sums) if math.isnan(total) and bool(torch.isnan(v).any())]
    if where:
        raise ValueError(
            f"{call}: the shared inputs (buffers and the other tensors after the mask) hold NaN at {where[:5]}: every sample "
            "reads them, so every gradient would be non-finite and dropped, and the step would release noise alone. Repair "
            "them before training (BatchNorm's running statistics: module.reset_running_stats()). Nothing was released."
        )


def finite_params(call: str, params: Mapping[str, torch.Tensor], fix: str) -> None:
    """Refuse params holding NaN or infinite values (``params`` full values, the same on every rank):
    every sample's gradient would be non-finite and dropped (``nonfinite='zero'``), and each step
    would release noise alone while the model never learns (found by review: silently)."""
    bad = [k for k, v in params.items() if v.is_floating_point() and not _all_finite(v)]
    if bad:
        raise ValueError(
            f"{call}: params {bad[:5]} hold NaN or infinite values: every sample's gradient would be non-finite and "
            f"dropped (nonfinite='zero'), and each step would release noise alone while the model never learns. {fix}"
        )


def guessable(call: str, name: str, value: Any, what: str) -> None:
    """A :class:`vmapdp.PublicSeedWarning` where ``value`` (a seed or key; ``what`` it makes) can be
    known or guessed: an integer (a Python, NumPy or 0-dim tensor one) of magnitude below ``2**64``, a
    str or bytes of fewer than 16 bytes, a ``torch.Generator`` (its output is predictable from a
    32-bit seed or from past output)."""
    from vmapdp.errors import PublicSeedWarning

    if isinstance(value, torch.Generator):
        why = "a torch.Generator, whose output can be predicted (its seed has 32 bits; Mersenne Twister is linear in its state)"
        fix = "pass key=secrets.token_bytes(16) instead, or leave it out (a fresh secret from OS entropy)"
    elif isinstance(value, (str, bytes)):
        if len(value.encode() if isinstance(value, str) else value) >= 16:
            return
        why, fix = "shorter than 16 bytes, which can be guessed", f"leave it out (a fresh secret from OS entropy) or pass {name}=secrets.token_bytes(16), kept as secret as the data"
    else:
        try:
            number = operator.index(value)  # (NumPy ints, 0-dim integer tensors: found by review, they passed)
        except TypeError:
            return
        if isinstance(value, bool) or abs(number) >= 2**64:
            return
        why = f"an integer of magnitude below 2**64 ({number}), which can be guessed"
        fix = f"leave it out (a fresh secret from OS entropy) or pass {name}=secrets.randbits(128), kept as secret as the data"
    here, level, frame = os.path.dirname(os.path.abspath(__file__)), 1, sys._getframe(0)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame, level = frame.f_back, level + 1  # (reported at the caller's line, outside vmapdp)
    warnings.warn(
        f"{call}: {name} is {why}. Whoever knows or guesses it can regenerate {what}, and the epsilon reported does not "
        f"hold against them. Fine for tests and reproducible experiments; for a release {fix}. Silence it with "
        "warnings.filterwarnings('ignore', category=vmapdp.PublicSeedWarning).",
        PublicSeedWarning,
        stacklevel=level,
    )


def shortened(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters (the last three an ellipsis): a value shown in a message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."

