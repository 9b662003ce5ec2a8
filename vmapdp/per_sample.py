"""Per-sample gradients: ``vmap(grad(loss_fn))`` with the details done right.

``loss_fn`` is written for ONE sample (no batch dim) and returns a scalar. The returned function
maps it over the leading dim of the last argument (the batch); every other argument is shared::

    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    grads = per_sample_grads(loss_fn)(params, buffers, (x, y))   # {name: [B, *shape]}

Everything here is pure and traceable: it runs under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Literal, NoReturn

import optree
import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vjp, vmap

from vmapdp import _checks
from vmapdp._tree import batch_size, check_mask, zero_rows
from vmapdp._tree import leaves as _leaves
from vmapdp.clipping import grad_norms
from vmapdp.errors import explain_torch_error
from vmapdp.functional import batched_attention, rng_kept

__all__ = ["per_sample_grads", "per_sample_grad_norms"]

Randomness = Literal["error", "different", "same"]

_RANDOMNESS_HELP = (
    "loss_fn draws random numbers inside vmap (Dropout or another random layer in training mode?). "
    "vmapdp refuses by default because the choice matters: randomness='different' gives every "
    "sample its own independent draw, exactly as in a per-sample loop (the right choice for "
    "DP-SGD); randomness='same' shares one draw across the batch, which couples the samples. "
    "Pass per_sample_grads(loss_fn, randomness='different'), or call model.eval() if you did not "
    "mean to use dropout."
)

_INPLACE_HELP = (
    "loss_fn writes in place into a tensor it did not create (a module updating a buffer in its "
    "forward, such as BatchNorm's running statistics, or code that mutates a captured tensor). "
    "That cannot be done per sample, and for DP it would leak data into the buffer. Run "
    "vmapdp.validate(model) to find the module and use vmapdp.fix(model) (BatchNorm -> GroupNorm), "
    "or compute the forward without mutation."
)


def _check_options(call: str, chunk_size: int | None, randomness: str, argnums: Any) -> None:
    _checks.optional_positive_int(call, "chunk_size", chunk_size)
    _checks.choice(call, "randomness", randomness, ("error", "different", "same"), why="see vmapdp.per_sample_grads")
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if not nums or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in nums):
        raise ValueError(f"{call}: argnums must be a non-negative int or a tuple of them, got {argnums!r}.")


def _mapped(
    loss_fn: Callable[..., Any],
    call: str,
    *,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    chunk_size: int | None,
    randomness: str,
) -> Callable[..., tuple[Any, Tensor, Any, int]]:
    """``fn(*args) -> (grads, losses, aux, B)`` with the batch mapped over; shared by the public forms."""
    def checked(*args: Any) -> Any:
        out = loss_fn(*args)
        loss = out[0] if has_aux and isinstance(out, tuple) else out
        _checks.loss_reads_its_sample(call, loss)
        _checks.loss_is_differentiated(call, loss)
        return out

    transform = grad_and_value(checked, argnums=argnums, has_aux=has_aux)
    nums = argnums if isinstance(argnums, tuple) else (argnums,)

    def run(*args: Any) -> tuple[Any, Tensor, Any, int]:
        if len(args) < 2:
            raise TypeError(
                f"{call}(*args): expected at least two arguments, (params, ..., batch); got {len(args)}. "
                "The last argument is the batch, every earlier one is shared by all samples."
            )
        if max(nums) >= len(args) - 1:
            raise ValueError(
                f"{call}: argnums={argnums!r} points at the batch or past it; only the shared arguments "
                f"0..{len(args) - 2} can be differentiated."
            )
        for n in nums:  # an empty params dict: nothing to differentiate (clear error, not an empty result)
            _checks.params_dict(call, args[n], what="params" if n == 0 else f"argument {n}", require_dict=False)
        b = batch_size(args[-1], call=call)
        in_dims = (None,) * (len(args) - 1) + (0,)
        mapped = vmap(transform, in_dims=in_dims, randomness=randomness, chunk_size=chunk_size)
        try:
            with batched_attention(args[nums[0]]):
                grads, value = mapped(*args)
        except EXPLAINED as err:
            raise_explained(call, err)
        if has_aux:
            losses, aux = value
        else:
            losses, aux = value, None
        if isinstance(losses, Tensor) and losses.shape != (b,):
            raise ValueError(
                f"{call}: loss_fn must return a scalar for one sample; it returned shape "
                f"{tuple(losses.shape[1:])} per sample. Did you write it for a batch? Index the "
                "sample (x[None]) and reduce the loss to a scalar."
            )
        return grads, losses, aux, b

    return run


@torch.compiler.disable  # (a compiled caller that reaches it falls back to eager for it: it must run for real)
def check_on_one_sample(
    call: str,
    params: Any,
    shared: tuple,
    batch: Any,
    randomness: str,
    forward: Callable[[Any, tuple, Any], Any],
) -> None:
    """The loss, eagerly, on the batch's first sample, as a private step runs it (under ``vmap``,
    with gradients tracked; on copies of the params; the global RNGs restored afterwards), and the
    refusals no compiled run can make, since their checks look at the eager tensors:

    * a loss that does not depend on its sample (``_checks.loss_reads_its_sample``);
    * a loss that does not depend on the params (``_checks.loss_is_differentiated``);
    * a forward that writes into the tensors passed to it (buffers): vmap lets a write that is the
      same for every sample through (spectral_norm's power iteration in training mode, a call
      counter), and a private step must not change its inputs (found by review: the caller's
      buffers changed at each call of a vmap or two_pass step, silently).

    Random layers draw the same for every sample here (``randomness="same"`` where the step's is
    ``"different"``): a dropout mask drawn per sample is itself batched, and made the loss look as
    if it read its sample when it read only a captured dataset row (found by review: released by
    every method). The sample is a copy of the first row (a loss writing into its sample in place
    wrote into the caller's batch, and that row was then written twice; found by review).

    ``forward(params, shared, sample) -> loss`` runs the loss (ghost's probe watches its ops
    there). Private steps call it once per input shape before their first run (``clipped_grad_sum``
    as it plans, so ``make_train_step``'s eager prepare), so a compiled step is covered too.
    """
    # gradients tracked on plain copies (not a transform's wrappers: ghost's probe finds its sites by functorch
    # level); inside a transform of the caller's (clipped_grad_sum under their vmap) autograd cannot be asked
    # for them, and the differentiating transform's own check (per-sample wrapper, ghost's engine) runs there
    tracked = torch._C._functorch.peek_interpreter_stack() is None
    copies = optree.tree_map(lambda t: _copy(t, tracked) if isinstance(t, Tensor) else t, params, namespace="torch")
    watched = watch_writes(copies, shared)

    def fwd(sample: Any) -> Tensor:
        loss = forward(copies, shared, sample)
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"{call}: loss_fn returned {type(loss).__name__} where a loss tensor was expected; for (loss, aux) use "
                "per_sample_grads(loss_fn, has_aux=True): clipped_grad_sum and make_train_step take the loss alone."
            )
        _checks.loss_reads_its_sample(call, loss)
        if tracked:
            _checks.loss_is_differentiated(call, loss)
        return loss

    _on_first_row(call, fwd, batch, copies, randomness)
    refuse_writes(call, watched)


@torch.compiler.disable
def check_reads_its_sample(call: str, loss_fn: Callable[..., Any], params: Any, shared: tuple, batch: Any, randomness: str) -> None:
    """Refuse, eagerly, a loss whose value does not depend on its sample, from one forward of the
    plain loss on the first row (under ``vmap``, the params differentiated as in a private step,
    random layers drawing the same for every sample, the global RNGs restored; no backward).

    For each run whose own view of this is blurred, and so cannot tell a loss that switched to
    data from elsewhere after the one-sample check of its shape (a flag outside its arguments):
    per-sample random draws (``randomness="different"``: a dropout mask is batched whatever the
    loss reads) and ghost clipping (its taps make everything after a covered layer batched, its
    per-sample copies of the params it does not cover everything after their use: a gate
    ``sigmoid(g) * x``). Found by review: these released a loss that read only a captured
    dataset row."""

    def fwd(sample: Any) -> Tensor:
        loss = vjp(lambda p: loss_fn(p, *shared, sample), params)[0]
        _checks.loss_reads_its_sample(call, loss)
        return loss

    # (one row: torch's per-sample fallback for ops without a batching rule, embedding_bag's, which ghost runs as an
    # embedding and a reduction, costs nothing here; its "performance drop" warning is not the user's)
    _on_first_row(call, fwd, batch, params, randomness, quiet=True)


def _on_first_row(call: str, fwd: Callable[[Any], Any], batch: Any, params: Any, randomness: str, *, quiet: bool = False) -> None:
    """``fwd`` mapped over a copy of the batch's first row for a check of what the loss reads:
    gradients enabled, the global RNGs of the params' device restored, attention batched as the
    engines run it, torch's errors explained; ``quiet``: without torch's "performance drop"
    warning. Random layers draw the same for every sample (a per-sample draw is batched on its
    own). torch cannot draw "same" from a per-sample parameter (``torch.normal(mu, std)``,
    ``torch.bernoulli(p)``, a ``torch.distributions`` sample): such a loss is checked with the
    step's per-sample draws, which a dropout layer blurs (found by review: refusing it with
    torch's error broke losses that ran before). ``mu + std * torch.randn_like(mu)`` or
    ``torch.rand_like(p) < p`` draw alike and are checked exactly."""
    one = optree.tree_map(lambda t: t[:1].clone(), batch, namespace="torch")
    device = next((t.device for t in _leaves(params) if isinstance(t, Tensor)), torch.device("cpu"))
    try:
        with torch.enable_grad(), rng_kept(device), batched_attention(params), warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:
                warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the batching rule")
            try:
                vmap(fwd, randomness="same" if randomness == "different" else randomness)(one)
            except RuntimeError as err:
                if randomness != "different" or "same randomness with a batched tensor input" not in str(err):
                    raise
                vmap(fwd, randomness=randomness)(one)
    except EXPLAINED as err:
        raise_explained(call, err)


def _copy(t: Tensor, tracked: bool) -> Tensor:
    c = t.detach().clone()
    return c.requires_grad_() if tracked and c.is_floating_point() else c


def watch_writes(params: Any, shared: tuple) -> list[tuple[bool, str, Tensor, int]]:
    """``(is_param, name, tensor, version)`` of the plain tensors among ``params`` and ``shared``,
    for :func:`refuse_writes` after a run of the loss (an in-place write bumps a version counter)."""
    out = []
    for is_param, tree in ((True, params), (False, tuple(shared))):
        paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace="torch")
        out += [(is_param, _path_name(path, is_param), t, t._version) for path, t in zip(paths, leaves) if type(t) in (Tensor, nn.Parameter)]
    return out


def refuse_writes(call: str, watched: list[tuple[bool, str, Tensor, int]]) -> None:
    """Refuse, naming them, writes into the tensors :func:`watch_writes` recorded. A private step
    must not change its inputs: vmap lets through a write that is the same for every sample, and
    how often it lands follows how many chunks the private batch needed (found by review: a forward
    halving a param under no_grad released params that told the batch size, without noise; the
    caller's buffers changed at each call of a vmap or two_pass step)."""
    params = [name for is_param, name, t, v in watched if is_param and t._version != v]
    if params:
        raise RuntimeError(
            f"{call}: loss_fn writes in place into the params {params[:5]} (under torch.no_grad(), or through .data: a "
            "max-norm or decay constraint in the forward). The released params would record how many times the forward "
            "ran, which follows the private batch's size, without noise. Apply the constraint out of place inside the "
            "loss (w = W * scale), or to the params between steps, outside the loss. (The write has landed: those params "
            "have changed; take them from the last checkpoint. Another thread writing into them during the run is "
            "refused the same way.)"
        )
    buffers = [name for is_param, name, t, v in watched if not is_param and t._version != v]
    if buffers:
        raise RuntimeError(
            f"{call}: loss_fn writes in place into {', '.join(buffers[:5])}, passed to it: a buffer updated in the forward "
            "(torch.nn.utils.spectral_norm's power iteration in training mode updates its u and v; a call counter). A "
            "private step must not change its inputs: the state would change outside the step, and how often it is "
            "written would follow the private batch's size. For spectral_norm: model.eval() (u and v then stay as "
            "they are, so sigma stops following the weights, and dropout is off too), or run the power iteration "
            "between steps, outside the loss (a forward of the module in training mode under torch.no_grad() on any "
            "input updates u and v from the weights alone). Otherwise make the update outside the loss. (The write "
            "has landed: those tensors have changed. Another thread writing into them during the run is refused the same way.)"
        )


def _path_name(path: tuple, is_param: bool) -> str:
    """A leaf named by its keys: ``'bn.running_mean'`` (dicts of named tensors), else by the
    position of loss_fn's argument and the indices in it (``"loss_fn's argument 2[0]"``)."""
    keys = path if is_param else path[1:]
    if keys and all(isinstance(k, str) for k in keys):
        return ".".join(keys)
    where = "loss_fn's argument 1 (params)" if is_param else f"loss_fn's argument {path[0] + 2}"
    return where + "".join(f"[{k!r}]" for k in keys)


# the exception types torch's failures inside the engine come as (and a caller's own, passed through unchanged)
EXPLAINED = (RuntimeError, ValueError, TypeError, IndexError)


def raise_explained(call: str, err: Exception) -> NoReturn:
    """Raise :func:`explain_runtime_error` of ``err`` from it, or ``err`` itself where it is not
    one vmapdp knows (call it in the ``except`` block that caught ``err``)."""
    explained = explain_runtime_error(call, err)
    if explained is err:
        raise err
    raise explained from err


def explain_runtime_error(call: str, err: Exception) -> Exception:
    """torch's raw ``err`` as an error naming the cause and the fix, or ``err`` itself where it is
    not one vmapdp knows (or is one vmapdp raised or explained already: found by review, an error
    explained by ``per_sample_grads`` was explained again around it)."""
    if getattr(err, "_vmapdp_explained", False):
        return err
    explained = _explained(call, err)
    if explained is not err:
        explained._vmapdp_explained = True
    return explained


def _explained(call: str, err: Exception) -> Exception:
    known = explain_torch_error(call, err)
    if known is not None:
        return known
    if not isinstance(err, RuntimeError):  # (a caller's own ValueError is not relabelled: found by review)
        return err
    msg = str(err)
    if "randomness" in msg and "vmap" in msg:
        return RuntimeError(f"{call}: {_RANDOMNESS_HELP}")
    if "in-place operation" in msg or "inplace arithmetic" in msg or "mutate a captured Tensor" in msg:
        return RuntimeError(f"{call}: {_INPLACE_HELP}\nTorch said: {msg.splitlines()[0]}")
    if "grad requires real-valued outputs" in msg or "expected f(*args) to return a scalar" in msg.lower() or (
        "only" in msg and "scalar" in msg
    ):
        return ValueError(
            f"{call}: loss_fn must return a scalar tensor for one sample. Reduce the loss "
            f"(e.g. .sum() or .mean()) inside loss_fn.\nTorch said: {msg.splitlines()[0]}"
        )
    return err


def per_sample_grads(
    loss_fn: Callable[..., Tensor],
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    return_loss: bool = False,
    chunk_size: int | None = None,
    randomness: Randomness = "error",
) -> Callable[..., Any]:
    """Per-sample gradients of a one-sample loss: ``vmap(grad(loss_fn))``.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample. ``sample`` is one
            row of the batch (any pytree: a tensor, a tuple ``(x, y)``, a dict).
        argnums: which argument(s) to differentiate (default 0, the params).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is returned per sample.
        return_loss: also return the per-sample losses ``[B]``.
        chunk_size: map this many samples at a time to bound activation memory (the result is
            the same; the ``[B, ...]`` gradients are still materialised).
        randomness: ``vmap``'s randomness flag. The default ``'error'`` refuses random ops so that
            dropout is a decision: ``'different'`` draws independently per sample (use this for
            DP-SGD), ``'same'`` shares one draw across the batch.

    Returns:
        ``fn(params, *shared, batch, mask=None)``. Its result is ``grads`` (a pytree like
        ``params`` with a leading dim ``B`` on every leaf), or a tuple: ``(grads, losses)`` with
        ``return_loss``, ``(grads, aux)`` with ``has_aux``, ``(grads, losses, aux)`` with both.
        ``batch`` is any pytree of tensors sharing the leading dim ``B`` (``B = 0`` gives empty
        leading dims). ``mask`` is an optional bool ``[B]``: rows where it is False get gradients
        and losses of exactly 0, even if they hold NaN.

    Guarantees:
        Row ``i`` equals the gradient of ``loss_fn`` at sample ``i`` alone (float tolerance);
        keys, shapes and dtypes follow ``params``.

    Raises:
        ValueError / TypeError: at call time, for a batch whose leaves disagree on ``B``, a
        non-scalar loss, a bad mask; RuntimeError with the fix when ``loss_fn`` uses randomness
        without a ``randomness`` choice or mutates captured tensors (train-mode BatchNorm).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> apply, params, buffers = vmapdp.functionalize(model)
        >>> def loss_fn(params, buffers, sample):
        ...     x, y = sample
        ...     return torch.nn.functional.cross_entropy(apply(params, buffers, x[None]), y[None])
        >>> grads = per_sample_grads(loss_fn)(params, buffers, (torch.randn(5, 3), torch.zeros(5, dtype=torch.long)))
        >>> grads["weight"].shape
        torch.Size([5, 2, 3])
    """
    call = "per_sample_grads(loss_fn)"
    _checks.loss_function(call, loss_fn)
    _check_options(call, chunk_size, randomness, argnums)
    run = _mapped(loss_fn, call, argnums=argnums, has_aux=has_aux, chunk_size=chunk_size, randomness=randomness)

    def fn(*args: Any, mask: Tensor | None = None) -> Any:
        grads, losses, aux, b = run(*args)
        if mask is not None:
            check_mask(mask, b, call=call)
            grads = zero_rows(grads, mask)
            losses = zero_rows(losses, mask)
        out: tuple = (grads,)
        if return_loss:
            out += (losses,)
        if has_aux:
            out += (aux,)
        return out[0] if len(out) == 1 else out

    fn.__doc__ = f"Per-sample gradients of {getattr(loss_fn, '__name__', 'loss_fn')}; see vmapdp.per_sample_grads."
    return fn


def per_sample_grad_norms(
    loss_fn: Callable[..., Tensor],
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    return_loss: bool = False,
    chunk_size: int | None = None,
    randomness: Randomness = "error",
) -> Callable[..., Any]:
    """The ``[B]`` total L2 norms of the per-sample gradients of ``loss_fn``.

    Same arguments and call form as :func:`per_sample_grads`; the result is ``norms`` (float32
    or wider) in place of ``grads``: ``norms``, ``(norms, losses)``, ``(norms, aux)`` or
    ``(norms, losses, aux)``. Masked rows get norm 0.
    """
    inner = per_sample_grads(
        loss_fn, argnums=argnums, has_aux=has_aux, return_loss=return_loss, chunk_size=chunk_size, randomness=randomness
    )

    def fn(*args: Any, mask: Tensor | None = None) -> Any:
        out = inner(*args, mask=mask)
        if isinstance(out, tuple):
            return (grad_norms(out[0]),) + out[1:]
        return grad_norms(out)

    return fn
