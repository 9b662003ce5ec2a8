"""Turn an ``nn.Module`` into a pure function of ``(params, buffers, *inputs)``.

``functionalize(module)`` returns ``(apply, params, buffers)``:

* ``params``: the trainable parameters (``requires_grad=True``), keyed like
  ``module.named_parameters()``. A tied (shared) parameter appears once, under its first name.
* ``buffers``: everything else the forward reads: registered buffers and frozen parameters
  (``requires_grad=False``), keyed by their names in the module.
* ``apply(params, buffers, *args, **kwargs)`` returns what ``module(*args, **kwargs)`` would return
  with those tensors in place, through ``torch.func.functional_call``. The module is never mutated.
  ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` layers and cells (which ``vmap`` cannot batch) run as their
  ``vmapdp.nn`` twins (same parameter names, equal outputs) in a copy of the module, so they work
  with every method without ``vmapdp.fix``.

The dicts hold detached tensors that share storage with the module (no copy). vmapdp never
writes into them in place; if you do, the module sees it.

A module under FSDP2's ``fully_shard`` (``DTensor`` parameters) is read differently: ``params``
are its ``DTensor`` s themselves (detached, this rank's shards: nothing is gathered, so a model
bigger than one device stays sharded), and ``apply`` runs a plain copy of the module tree without
FSDP2's hooks. Train them with ``init_train_state(params, opt, sharding=Sharding(params))`` and
``make_train_step(..., sharding=)``, which gather one parameter at a time, and write the trained
shards back with ``Sharding.write_to_module`` (see :mod:`vmapdp.sharding`). The other entry points
(``per_sample_grads``, ``clipped_grad_sum``, ...) refuse ``DTensor`` params with that fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch
from torch import Tensor, nn
from torch.func import functional_call

from vmapdp._tree import leaves as _leaves

Params = Dict[str, Tensor]
Buffers = Dict[str, Tensor]

__all__ = ["functionalize", "FunctionalModel", "Params", "Buffers", "batched_attention"]


class FunctionalModel:
    """``apply(params, buffers, *args, **kwargs)``: a module's forward as a pure function.

    Made by :func:`functionalize`. Calling it runs ``module.forward`` through
    ``torch.func.functional_call`` with the given tensors, so it composes with ``grad``,
    ``vmap``, ``jacrev``, ``hessian`` and ``torch.compile``. The wrapped module is available as
    ``.module`` (read only: vmapdp never changes it).
    """

    __slots__ = ("module", "param_names", "buffer_names", "_aliased")

    def __init__(self, module: nn.Module, param_names: tuple[str, ...], buffer_names: tuple[str, ...]):
        self.module = module
        self.param_names = param_names
        self.buffer_names = buffer_names
        self._aliased = _aliased_slots(module) is not None

    def __call__(self, params: Params, buffers: Buffers, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(params, dict) or not isinstance(buffers, dict):
            raise TypeError(
                f"apply(params, buffers, *inputs): expected two dicts of tensors first, got "
                f"{type(params).__name__} and {type(buffers).__name__}. Call it as "
                "apply(params, buffers, x) with the dicts returned by vmapdp.functionalize(model)."
            )
        if params.keys() & buffers.keys():
            raise ValueError(
                f"apply(params, buffers, ...): keys {sorted(params.keys() & buffers.keys())} are in both "
                "params and buffers; each tensor belongs to exactly one of them."
            )
        try:
            if not self._aliased:
                return functional_call(self.module, (params, buffers), args, kwargs, tie_weights=True, strict=True)
            return self._call_aliased(params, buffers, args, kwargs)
        except (RuntimeError, ValueError) as err:  # (train-mode BatchNorm on one sample raises ValueError)
            explained = _explain(self, params, buffers, err)
            if explained is err:
                raise
            raise explained from err

    def _call_aliased(self, params: Params, buffers: Buffers, args: tuple, kwargs: dict) -> Any:
        """Each slot set once, through its first path (see :func:`_aliased_slots`), after the
        check ``strict=True`` makes on the other path: the names passed are those of the module's
        tensors as it is now (one changed since ``functionalize`` is refused, not run with its own
        new tensors)."""
        slots = _aliased_slots(self.module)
        given, expected = params.keys() | buffers.keys(), {key for _, key in slots}
        if given != expected:
            raise KeyError(
                f"apply(params, buffers, ...): the tensors passed do not match the module {type(self.module).__name__}: "
                f"missing {sorted(expected - given)}, unexpected {sorted(given - expected)}. Pass the params and buffers "
                "dicts from vmapdp.functionalize(model) (trainable parameters in params; buffers and frozen parameters in "
                "buffers), of the model as it is now (functionalize it again after adding or replacing layers)."
            )
        chosen = {path: (params[key] if key in params else buffers[key]) for path, key in slots}
        return functional_call(self.module, chosen, args, kwargs, tie_weights=False)

    def __repr__(self) -> str:
        return f"FunctionalModel({type(self.module).__name__}, params={len(self.param_names)}, buffers={len(self.buffer_names)})"


def _aliased_slots(module: nn.Module):
    """``((path, key), ...)`` for a module tree that holds one submodule under two or more paths
    (``self.b = self.a``; peft's prompt models hold the input embedding as ``word_embeddings`` too):
    one path per (submodule, tensor name) slot, with the key of the tensor there in ``params`` /
    ``buffers``; ``None`` for any other tree.

    ``torch.func.functional_call`` with ``tie_weights=True`` sets such a slot once per path and puts
    the originals back in the same order, so the slot ends up holding the value passed in, not the
    module's parameter (torch 2.13: the module lost its ``Parameter`` after one call). Setting each
    slot once, through its first path, leaves the module as it was."""
    modules = list(module.named_modules(remove_duplicate=False))
    if len({id(m) for _, m in modules}) == len(modules):
        return None
    # id of each tensor -> its name in params / buffers (the first, as functionalize keys them); a
    # parameter's and a buffer's apart (one tensor registered as both gets each value passed)
    param_key = {id(t): name for name, t in reversed(list(module.named_parameters()))}
    buffer_key = {id(t): name for name, t in reversed(list(module.named_buffers()))}
    slots = []
    for prefix, m in module.named_modules():  # (each submodule once, under its first path)
        for registry, key in ((m._parameters, param_key), (m._buffers, buffer_key)):
            for name, t in registry.items():
                if t is not None:
                    slots.append((f"{prefix}.{name}" if prefix else name, key[id(t)]))
    return tuple(slots)


def _explain(fm: FunctionalModel, params: Params, buffers: Buffers, err: RuntimeError) -> Exception:
    """Turn torch's internal error into one that names the problem and the fix."""
    msg = str(err)
    if "reparametrizing" in msg and ("Missing key" in msg or "Unexpected key" in msg):
        given = set(params) | set(buffers)
        # (the module's names as it is now: one changed since functionalize shows what it gained)
        expected = {n for n, _ in fm.module.named_parameters()} | {n for n, _ in fm.module.named_buffers()}
        return KeyError(
            f"apply(params, buffers, ...): the tensors passed do not match the module "
            f"{type(fm.module).__name__}: missing {sorted(expected - given)}, unexpected "
            f"{sorted(given - expected)}. Pass the params and buffers dicts from "
            "vmapdp.functionalize(model) (trainable parameters in params; buffers and frozen "
            "parameters in buffers), of the model as it is now (functionalize it again after adding "
            "or replacing layers)."
        )
    if "randomness" in msg:
        return err  # per_sample_grads explains the randomness choice
    from vmapdp.validation import explain_failure

    explained = explain_failure(fm.module, err)
    return explained if explained is not None else err


def functionalize(module: nn.Module) -> tuple[FunctionalModel, Params, Buffers]:
    """Split a module into a pure ``apply`` function, its trainable params and its buffers.

    Args:
        module: any ``nn.Module``. It is not modified, now or later.

    Returns:
        ``(apply, params, buffers)`` where ``apply(params, buffers, *args, **kwargs)`` equals
        ``module(*args, **kwargs)``; ``params`` holds the parameters with ``requires_grad=True``
        (tied weights once, under their first name), ``buffers`` the registered buffers and the
        frozen parameters. Values are detached tensors sharing storage with the module (under
        FSDP2: its DTensors, not gathered; see above).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a ``fully_shard`` unit of the module is unsharded (reshard every unit first).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> apply, params, buffers = functionalize(model)
        >>> sorted(params)
        ['bias', 'weight']
        >>> apply(params, buffers, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize(module): expected an nn.Module, got {type(module).__name__}.")
    from vmapdp.sharding import RESHARD_FIX, is_fsdp_module, plain_twin, unsharded_units

    unsharded = unsharded_units(module)
    if unsharded:  # (its params would be full plain copies, and apply would run FSDP2's hooks inside vmap)
        raise ValueError(
            f"functionalize(module): the fully_shard units {unsharded[:5]} are unsharded (after a forward with "
            f"reshard_after_forward=False, or unshard()): their parameters are not DTensors; {RESHARD_FIX}."
        )
    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(
            f"functionalize(module): {lazy[:5]} are uninitialized (a lazy module: nn.LazyLinear, nn.LazyConv2d...), whose "
            "shapes come from its first input. Run the model once on a dummy batch first (model(x[:1])), then functionalize it."
        )
    fsdp = is_fsdp_module(module)
    params: Params = {}
    frozen: Buffers = {}
    for name, p in module.named_parameters():
        if fsdp and not p.requires_grad and hasattr(p, "full_tensor"):
            p = p.full_tensor()  # a frozen FSDP2 parameter is a buffer of the plain twin: gathered
        (params if p.requires_grad else frozen)[name] = p.detach()  # (a trainable FSDP2 one stays a DTensor shard)
    buffers: Buffers = {name: b.detach() for name, b in module.named_buffers()}
    buffers.update(frozen)
    from vmapdp.validation import with_vmap_recurrent

    # FSDP2's forward hooks all-gather inside the forward (no collective can run under vmap): apply
    # runs a plain copy of the module tree without them (vmapdp.sharding.plain_twin)
    # torch's RNN/GRU/LSTM kernels cannot be batched by vmap: apply runs a copy with vmapdp.nn's
    # twins in their place (same parameter names, equal outputs); params stay the module's own
    apply = FunctionalModel(with_vmap_recurrent(plain_twin(module) if fsdp else module), tuple(params), tuple(buffers))
    _quiet_transformers_logging_under_compile(module)
    return apply, params, buffers


def batched_attention(params: Any) -> contextlib.AbstractContextManager:
    """Where the tensors of ``params`` (a dict, or a tree) live on the CPU: attention
    (``F.scaled_dot_product_attention``: ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
    transformers' sdpa models) with its math kernel, which ``vmap`` batches; the CPU's flash kernel
    has no batching rule, and torch ran it one sample at a time ("performance drop" warnings; a
    TransformerEncoderLayer's per-sample step 25-30% slower, batch 64 x 32). The per-sample engines
    enter it around their ``vmap``. Elsewhere (CUDA: untested there) nothing changes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaf = next((t for t in _leaves(params) if isinstance(t, torch.Tensor)), None)
    if leaf is None or leaf.device.type != "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The global RNGs (CPU and ``device``'s) restored on exit: random layers (dropout) then draw
    in the real run as if what ran inside (the one-sample checks, ghost's probe, auto's race) had
    never run."""
    # (device_type "cpu", not None, for a CPU device: torch 2.9's fork_rng cannot take None)
    return torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type)


def _quiet_transformers_logging_under_compile(module: nn.Module) -> None:
    """transformers logs one-time notes with ``logger.warning_once`` inside forwards (GPT-2 called
    with ``labels=``: "loss_type=None was set in the config"), and ``torch.compile(fullgraph=True)``
    (``make_train_step(compile=True)``) refuses any logging call with "logging.Logger method not
    supported". For a module from transformers, that one function joins torch's
    ``torch._dynamo.config.ignore_logging_functions``: under compile the note is dropped (it still
    prints in eager runs); nothing else changes. transformers is only looked at when it is already
    imported (the module came from it)."""
    import sys

    if "transformers" not in sys.modules or not any(type(m).__module__.startswith("transformers.") for m in module.modules()):
        return
    warning_once = getattr(getattr(sys.modules["transformers"], "utils", None), "logging", None)
    warning_once = getattr(warning_once, "warning_once", None)
    if callable(warning_once):
        import torch._dynamo

        ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)  # (torch 2.9 has none)
        if ignored is not None:
            ignored.add(warning_once)

