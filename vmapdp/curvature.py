"""Per-sample curvature: Hessians, Hessian-vector products, Jacobians and what is built from them.

Same convention as :func:`vmapdp.per_sample_grads`: ``loss_fn(params, *shared, sample)`` is
written for ONE sample and returns a scalar; the returned function maps it over the leading dim
``B`` of the last batch argument, every earlier argument is shared by all samples. Derivatives
are taken w.r.t. ``params`` (argument 0) only: buffers and frozen parameters are shared inputs.
Models whose forward is written for a batch are called on one sample as ``apply(p, b, x[None])``.

* ``per_sample_hessian(loss_fn)`` -> ``H[k1][k2]: [B, *shape1, *shape2]``
* ``per_sample_hvp(loss_fn)`` -> ``{k: [B, *shape]}``, ``H_i v`` (forward-over-reverse)
* ``per_sample_jacobian(apply_fn)`` -> ``{k: [B, *out_shape, *shape]}`` (reverse mode)
* ``per_sample_gnvp(apply_fn, loss_of_output)`` -> ``{k: [B, *shape]}``, ``J_i^T H_out,i J_i v``
* ``empirical_fisher_diag(loss_fn)`` -> ``{k: [*shape]}``, ``mean_i g_i**2``
* ``hutchinson_trace(loss_fn, num_probes=, generator=)`` -> ``[B]`` estimates of ``tr H_i``
* ``empirical_ntk(apply_fn)`` -> ``[B_a, B_b, *out_shape, *out_shape]``, ``J_a J_b^T``
* ``grad_similarity(grads_a, grads_b)`` -> ``[B_a, B_b]`` dot products (or cosines)
* ``influence_scores(loss_fn)`` -> ``[B_train, B_test]``, TracIn-style ``<g_train, g_test>``

None of them forms more than it returns: HVPs and GN products never build a Hessian or a
Jacobian. The transforms are pure and traceable (``torch.compile(fullgraph=True)``);
:func:`hutchinson_trace` draws its probes from a ``torch.Generator`` before the traced maths, so
compile the transforms rather than the draw.

Differential privacy for second-order statistics
-------------------------------------------------
A per-sample HVP (or GN product, or a flattened per-sample Hessian) is a per-sample vector like a
gradient, so it is privatised exactly like one, with the same clipper, noise and accounting::

    v = public_direction                                  # must not depend on private data
    hvps = per_sample_hvp(loss_fn)(params, buffers, batch, v)
    summed, norms = vmapdp.clip_and_sum(hvps, l2_clip_norm, mask=mask)
    noisy = vmapdp.add_noise(summed, noise_multiplier * l2_clip_norm, secure=True)  # (or key=: never a torch.Generator, predictable)
    ledger = ledger.record(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

Sensitivity: after clipping, each sample's contribution has L2 norm ``<= l2_clip_norm`` and does
not depend on any other sample, so adding or removing one sample changes ``summed`` by a vector
of norm ``<= l2_clip_norm`` -- the same add/remove sensitivity as a DP-SGD gradient sum. The
release is a Gaussian mechanism with noise multiplier ``noise_multiplier`` and is accounted as one
more (Poisson-subsampled, if the batch is) step in the ledger. For a per-sample Hessian the
clipped norm is the Frobenius norm over all blocks (``clip_and_sum`` flattens every leaf).

The argument needs every other input of the per-sample computation to be data-independent: ``v``
and ``params`` must be public or earlier DP releases (post-processing), never derived from the
non-private Hessian or gradients of this data (a power iteration must feed back the *noisy*
products). :func:`empirical_fisher_diag`, :func:`empirical_ntk`, :func:`grad_similarity` and
:func:`influence_scores` are not private; they are diagnostics.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import optree
import torch
from torch import Tensor
from torch.func import grad, hessian, jacrev, jvp, vjp, vmap

from vmapdp import _checks
from vmapdp._tree import acc_dtype, batch_size, check_chunk_size, check_mask, leaves_with_paths
from vmapdp._tree import leaves as _leaves
from vmapdp.per_sample import per_sample_grads, raise_explained

__all__ = [
    "per_sample_hessian",
    "per_sample_hvp",
    "per_sample_jacobian",
    "per_sample_gnvp",
    "empirical_fisher_diag",
    "hutchinson_trace",
    "empirical_ntk",
    "grad_similarity",
    "influence_scores",
]

_RANDOM_HELP = (
    "the function draws random numbers inside vmap (Dropout or another random layer in training "
    "mode?). Curvature of a random function is not defined per draw; call model.eval() (or make "
    "the randomness an explicit input) before computing it."
)


# ------------------------------------------------------------------------------------------------
# helpers

_forward_ad_ready = False


def _prepare_forward_ad() -> None:
    """Load torch's forward-mode decompositions once, without their ``torch.jit.script`` warning.

    torch registers them lazily on the first ``make_dual`` through ``torch.jit.script``, which
    warns (``DeprecationWarning``; ``FutureWarning`` from torch 2.14) from inside torch (an error for users running with
    ``-W error``). Doing it here, at construction time, keeps that out of user code and out of
    traced code.
    """
    global _forward_ad_ready
    if _forward_ad_ready:
        return
    with warnings.catch_warnings():
        # (a DeprecationWarning in torch 2.13, a FutureWarning in 2.14)
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated")
        with torch.autograd.forward_ad.dual_level():
            torch.autograd.forward_ad.make_dual(torch.zeros(()), torch.zeros(()))
    _forward_ad_ready = True


def _check_callable(call: str, name: str, fn: Any) -> None:
    _checks.loss_function(call, fn, name)


def _check_nargs(call: str, args: tuple, n_batched: int, form: str) -> None:
    if len(args) < 1 + n_batched:
        raise TypeError(
            f"{call}{form}: expected at least {1 + n_batched} arguments, got {len(args)}. "
            "params comes first, shared arguments (buffers, ...) next, the batched argument(s) last."
        )
    _checks.no_dtensor(call, args[0])  # (FSDP2 shards from functionalize: refused with the fix)


def _standardized(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    """``x`` centred and scaled to unit (biased) variance over ``dims``, as the norm layers do."""
    centred = x - x.mean(dims, keepdim=True)
    return centred * torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)


def _layer_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
                cudnn_enable: bool = False) -> Tensor:
    dims = tuple(range(-len(tuple(normalized_shape)), 0)) if not isinstance(normalized_shape, int) else (-1,)
    y = _standardized(x, dims, eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def _instance_norm(x: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None, weight: Tensor | None = None,
                   bias: Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if use_input_stats:
        if running_mean is not None or running_var is not None:
            raise ValueError(
                "vmapdp.curvature: InstanceNorm with track_running_stats in training mode updates its running statistics "
                "in the forward, which a curvature transform would repeat for every derivative. Put the model in eval "
                "mode (model.eval()) or build the norm without track_running_stats."
            )
        y = _standardized(x, tuple(range(2, x.dim())), eps)
    else:
        y = (x - running_mean.reshape(shape)) * torch.rsqrt(running_var.reshape(shape) + eps)
    y = y if weight is None else y * weight.reshape(shape)
    return y if bias is None else y + bias.reshape(shape)


def _prelu(x: Tensor, weight: Tensor) -> Tensor:
    w = weight.reshape(()) if weight.numel() == 1 else weight.reshape((-1,) + (1,) * (x.dim() - 2) if x.dim() >= 2 else (-1,))
    return torch.where(x > 0, x, w * x)  # (x > 0, as torch's own gradient at 0)


# ops whose torch.func derivatives are wrong in this torch (2.13), run as their decompositions into
# primitive ops inside the curvature transforms (found by review, against torch.autograd.functional):
# the Hessian block of a layer_norm / instance_norm weight against an earlier layer's weight (1.76
# relative error, the Hessian not symmetric; torch.func.hessian and jacrev(jacrev) alike), and
# per-sample Jacobians through prelu under vmap (100% error; its Hessian raised torch's own error)
_DECOMPOSED = {
    torch.nn.functional.layer_norm: _layer_norm,
    torch.layer_norm: _layer_norm,
    torch.nn.functional.instance_norm: _instance_norm,
    torch.instance_norm: lambda x, w, b, rm, rv, use_input_stats, momentum, eps, cudnn_enabled=False: _instance_norm(x, rm, rv, w, b, use_input_stats, momentum, eps),
    torch.nn.functional.prelu: _prelu,
    torch.prelu: _prelu,
}


class _Decomposed(torch.overrides.TorchFunctionMode):
    """Runs the ops of ``_DECOMPOSED`` as their decompositions (the rest as they are)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        impl = _DECOMPOSED.get(func)
        if impl is None:
            return func(*args, **(kwargs or {}))
        return impl(*args, **(kwargs or {}))


def _scalar(fn: Callable[..., Any], call: str, name: str) -> Callable[..., Tensor]:
    """``fn`` with a trace-time check that it returns a 0-dim tensor for one sample (run with the
    ops of ``_DECOMPOSED`` decomposed)."""

    def wrapped(*args: Any) -> Tensor:
        with _Decomposed():
            out = fn(*args)
        if not isinstance(out, Tensor) or out.dim() != 0:
            got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"{call}: {name} must return a 0-dim tensor for ONE sample; it returned {got}. "
                "Was it written for a batch? Index the sample (x[None]) and reduce to a scalar "
                "(.sum(), or .reshape(()) for a [1] result)."
            )
        return out

    return wrapped


def _tensor_out(fn: Callable[..., Any], call: str) -> Callable[..., Tensor]:
    def wrapped(*args: Any) -> Tensor:
        with _Decomposed():
            out = fn(*args)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"{call}: apply_fn must return one tensor for one sample, got {type(out).__name__}. "
                "Return the output you want differentiated (e.g. lambda p, b, x: apply(p, b, x[None])[0])."
            )
        return out

    return wrapped


def _mapped(call: str, fn: Callable[..., Any], args: tuple, in_dims: tuple, chunk_size: int | None) -> Any:
    try:
        return vmap(fn, in_dims=in_dims, chunk_size=chunk_size, randomness="error")(*args)
    except RuntimeError as err:
        msg = str(err)
        if "randomness" in msg and "vmap" in msg:
            raise RuntimeError(f"{call}: {_RANDOM_HELP}") from err
        raise_explained(call, err)


def _check_vector(call: str, params: Any, vector: Any, b: int, per_sample: bool) -> None:
    """``vector`` must be params-like (same structure, shapes, dtypes), with a leading ``B`` if per sample."""
    p = dict(leaves_with_paths(params))
    v = dict(leaves_with_paths(vector))
    if p.keys() != v.keys() or optree.tree_structure(params, namespace="torch") != optree.tree_structure(vector, namespace="torch"):
        raise ValueError(
            f"{call}: vector must be a pytree like params (same keys); missing {sorted(p.keys() - v.keys())}, "
            f"unexpected {sorted(v.keys() - p.keys())}. Build it from params, e.g. "
            "{k: torch.randn_like(t) for k, t in params.items()}."
        )
    for k, t in p.items():
        x = v[k]
        if not isinstance(x, Tensor):
            raise TypeError(f"{call}: vector[{k!r}] must be a tensor, got {type(x).__name__}.")
        want = ((b,) if per_sample else ()) + tuple(t.shape)
        if tuple(x.shape) != want:
            hint = (
                "With per_sample_vector=True every leaf needs a leading batch dim B."
                if per_sample
                else "For one vector per sample (leading dim B) pass per_sample_vector=True."
            )
            raise ValueError(f"{call}: vector[{k!r}] has shape {tuple(x.shape)}, expected {want} (params[{k!r}] is {tuple(t.shape)}). {hint}")
        if x.dtype != t.dtype:
            raise TypeError(f"{call}: vector[{k!r}] has dtype {x.dtype} but params[{k!r}] has {t.dtype}; cast it with .to({t.dtype}).")


def _dot(a: Any, b: Any) -> Tensor:
    """Sum over leaves of elementwise products (one sample, joined by key)."""
    return sum(_leaves(optree.tree_map(lambda x, y: (x * y).sum(), a, b, namespace="torch")))


# ------------------------------------------------------------------------------------------------
# transforms


def per_sample_hessian(loss_fn: Callable[..., Tensor], *, chunk_size: int | None = None) -> Callable[..., Any]:
    """Per-sample Hessians of a one-sample loss w.r.t. ``params``: ``vmap(torch.func.hessian(loss_fn))``.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample.
        chunk_size: map this many samples at a time (bounds activation memory; same result).

    Returns:
        ``fn(params, *shared, batch) -> H``: the structure of ``torch.func.hessian`` with a leading
        batch dim, ``H[k1][k2]`` of shape ``[B, *params[k1].shape, *params[k2].shape]``. Memory is
        ``B * n_params**2``: use :func:`per_sample_hvp` for anything but small models.

    Guarantees:
        ``H[k1][k2][i]`` equals the Hessian of sample ``i``'s loss alone (float tolerance);
        ``H[k1][k2][i]`` is the transpose of ``H[k2][k1][i]`` for a twice-differentiable loss.

    Raises:
        ValueError / TypeError: batch leaves that disagree on ``B``, a non-scalar loss.

    Example:
        >>> H = per_sample_hessian(loss_fn)(params, buffers, (x, y))
        >>> H["weight"]["bias"].shape          # Linear(3, 2), B = 5
        torch.Size([5, 2, 3, 2])
    """
    call = "per_sample_hessian(loss_fn)"
    _prepare_forward_ad()
    _check_callable(call, "loss_fn", loss_fn)
    check_chunk_size(call, chunk_size)
    h = hessian(_scalar(loss_fn, call, "loss_fn"), argnums=0)

    def fn(*args: Any) -> Any:
        _check_nargs(call, args, 1, "(params, *shared, batch)")
        batch_size(args[-1], call=call)
        return _mapped(call, h, args, (None,) * (len(args) - 1) + (0,), chunk_size)

    return fn


def per_sample_hvp(
    loss_fn: Callable[..., Tensor],
    *,
    chunk_size: int | None = None,
    per_sample_vector: bool = False,
    return_grads: bool = False,
) -> Callable[..., Any]:
    """Per-sample Hessian-vector products ``H_i v``, forward-over-reverse, never forming ``H_i``.

    Computed as ``jvp(grad(loss_fn), (params,), (v,))`` per sample: one forward and backward pass
    with forward-mode tangents, about the cost of 2-3 gradients.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample.
        chunk_size: map this many samples at a time.
        per_sample_vector: ``vector`` has a leading dim ``B`` (``v_i`` for sample ``i``) instead of
            being one params-like vector shared by all samples.
        return_grads: also return the per-sample gradients, which the jvp computes anyway.

    Returns:
        ``fn(params, *shared, batch, vector)`` -> ``hvps`` (like ``params``, leaves
        ``[B, *shape]``), or ``(hvps, grads)`` with ``return_grads``.

    Guarantees:
        Row ``i`` equals ``H_i @ v`` (``H_i @ v_i``) of sample ``i`` alone, float tolerance.
        For DP, pass ``hvps`` to :func:`vmapdp.clip_and_sum` (module docstring: ``v`` public).

    Raises:
        ValueError / TypeError: ``vector`` not like ``params`` (keys, shapes, dtypes), batch
        leaves that disagree on ``B``, a non-scalar loss.

    Example:
        >>> v = {k: torch.randn_like(t) for k, t in params.items()}
        >>> hvps = per_sample_hvp(loss_fn)(params, buffers, (x, y), v)
        >>> summed, norms = vmapdp.clip_and_sum(hvps, 1.0)   # sensitivity 1.0, as for gradients
    """
    call = "per_sample_hvp(loss_fn)"
    _prepare_forward_ad()
    _check_callable(call, "loss_fn", loss_fn)
    check_chunk_size(call, chunk_size)
    g = grad(_scalar(loss_fn, call, "loss_fn"), argnums=0)

    def one(params: Any, *rest: Any) -> Any:
        *shared, sample, v = rest
        grads, hv = jvp(lambda p: g(p, *shared, sample), (params,), (v,))
        return (hv, grads) if return_grads else hv

    return _vector_product(call, one, chunk_size, per_sample_vector)


def _vector_product(call: str, one: Callable[..., Any], chunk_size: int | None, per_sample_vector: bool) -> Callable[..., Any]:
    """``fn(params, *shared, batch, vector)`` mapping ``one`` over the batch (and the vector if per sample)."""

    def fn(*args: Any) -> Any:
        _check_nargs(call, args, 2, "(params, *shared, batch, vector)")
        b = batch_size(args[-2], call=call)
        _check_vector(call, args[0], args[-1], b, per_sample_vector)
        in_dims = (None,) * (len(args) - 2) + (0, 0 if per_sample_vector else None)
        return _mapped(call, one, args, in_dims, chunk_size)

    return fn


def per_sample_jacobian(apply_fn: Callable[..., Tensor], *, chunk_size: int | None = None) -> Callable[..., Any]:
    """Per-sample Jacobians of a model's output w.r.t. ``params`` (reverse mode, ``jacrev``).

    Args:
        apply_fn: ``apply_fn(params, *shared, inputs) -> Tensor`` for ONE sample, e.g.
            ``lambda p, b, x: apply(p, b, x[None])[0]`` for a module written for batches.
        chunk_size: map this many samples at a time.

    Returns:
        ``fn(params, *shared, batch_inputs) -> {k: [B, *out_shape, *params[k].shape]}``.

    Guarantees:
        Row ``i`` equals ``torch.autograd.functional.jacobian`` of sample ``i``'s output.

    Example:
        >>> J = per_sample_jacobian(lambda p, b, x: apply(p, b, x[None])[0])(params, buffers, x)
        >>> J["weight"].shape                  # Linear(3, 2), B = 5
        torch.Size([5, 2, 2, 3])
    """
    call = "per_sample_jacobian(apply_fn)"
    _check_callable(call, "apply_fn", apply_fn)
    check_chunk_size(call, chunk_size)
    jac = jacrev(_tensor_out(apply_fn, call), argnums=0)

    def fn(*args: Any) -> Any:
        _check_nargs(call, args, 1, "(params, *shared, batch_inputs)")
        batch_size(args[-1], call=call, what="batch_inputs")
        return _mapped(call, jac, args, (None,) * (len(args) - 1) + (0,), chunk_size)

    return fn


def per_sample_gnvp(
    apply_fn: Callable[..., Any],
    loss_of_output: Callable[[Any, Any], Tensor],
    *,
    chunk_size: int | None = None,
    per_sample_vector: bool = False,
) -> Callable[..., Any]:
    """Per-sample (generalised) Gauss-Newton-vector products ``J_i^T H_out,i J_i v``.

    ``J_i`` is the Jacobian of sample ``i``'s model output w.r.t. ``params`` and ``H_out,i`` the
    Hessian of the loss w.r.t. that output. Computed as a jvp (``J v``), a jvp of the output
    gradient (``H_out J v``) and a vjp (``J^T .``); neither ``J`` nor any Hessian is formed.

    * Cross-entropy on logits ``z``: ``H_out = diag(p) - p p^T`` with ``p = softmax(z)``, PSD; the
      GN matrix equals the Fisher information of the model's predictive distribution.
    * Summed squared error ``||z - t||**2``: ``H_out = 2 I``, so the product is ``2 J^T J v``
      (mean over ``K`` outputs: ``2/K``).
    Unlike the Hessian, the GN matrix is PSD for a convex loss of the output (``v^T G v >= 0``).

    Args:
        apply_fn: ``apply_fn(params, *shared, sample) -> output`` for ONE sample (a tensor or
            pytree of tensors), e.g. ``lambda p, b, s: apply(p, b, s[0][None])[0]``.
        loss_of_output: ``loss_of_output(output, sample) -> scalar``, e.g.
            ``lambda z, s: F.cross_entropy(z[None], s[1][None])``. Both functions receive the
            whole sample, so the targets are wherever the sample keeps them.
        chunk_size, per_sample_vector: as in :func:`per_sample_hvp`.

    Returns:
        ``fn(params, *shared, batch, vector) -> {k: [B, *shape]}``.

    Example:
        >>> gnvps = per_sample_gnvp(apply_fn, loss_of_output)(params, buffers, (x, y), v)
    """
    call = "per_sample_gnvp(apply_fn, loss_of_output)"
    _prepare_forward_ad()
    _check_callable(call, "apply_fn", apply_fn)
    _check_callable(call, "loss_of_output", loss_of_output)
    check_chunk_size(call, chunk_size)
    out_grad = grad(_scalar(loss_of_output, call, "loss_of_output"), argnums=0)

    def one(params: Any, *rest: Any) -> Any:
        *shared, sample, v = rest

        def f(p: Any) -> Any:
            with _Decomposed():
                return apply_fn(p, *shared, sample)

        out, jv = jvp(f, (params,), (v,))
        _, hjv = jvp(lambda o: out_grad(o, sample), (out,), (jv,))
        _, pullback = vjp(f, params)
        return pullback(hjv)[0]

    return _vector_product(call, one, chunk_size, per_sample_vector)


def empirical_fisher_diag(loss_fn: Callable[..., Tensor], *, chunk_size: int | None = None) -> Callable[..., Any]:
    """Diagonal of the empirical Fisher: the mean over samples of squared per-sample gradients.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample.
        chunk_size: passed to :func:`vmapdp.per_sample_grads`.

    Returns:
        ``fn(params, *shared, batch, mask=None) -> {k: [*shape]}`` (like ``params``, same dtypes),
        ``sum_i g_i**2 / n`` with ``n`` the number of rows where ``mask`` is True (all rows without
        a mask); 0 when ``n = 0``. Masked rows contribute exactly 0, even if they hold NaN.

    Not private: it is a plain statistic of the batch. The per-sample ``[B, ...]`` gradients are
    materialised (use ``chunk_size`` and smaller batches to bound memory).
    """
    call = "empirical_fisher_diag(loss_fn)"
    _check_callable(call, "loss_fn", loss_fn)
    check_chunk_size(call, chunk_size)
    psg = per_sample_grads(loss_fn, chunk_size=chunk_size)

    def fn(*args: Any, mask: Tensor | None = None) -> Any:
        _check_nargs(call, args, 1, "(params, *shared, batch)")
        b = batch_size(args[-1], call=call)
        grads = psg(*args, mask=mask)
        n: Any = max(b, 1) if mask is None else check_mask(mask, b, call=call).sum().clamp_min(1)

        def one(g: Tensor) -> Tensor:
            acc = g.to(acc_dtype(g.dtype))
            return (acc.square().sum(0) / n).to(g.dtype)

        return optree.tree_map(one, grads, namespace="torch")

    return fn


def _rademacher(params: Any, num_probes: int, generator: torch.Generator) -> Any:
    """``{k: [num_probes, *shape]}`` of independent +-1 entries, leaves drawn in optree order."""

    def one(t: Tensor) -> Tensor:
        bits = torch.randint(0, 2, (num_probes,) + tuple(t.shape), generator=generator, device=generator.device)
        return (bits * 2 - 1).to(device=t.device, dtype=t.dtype)

    return optree.tree_map(one, params, namespace="torch")


def hutchinson_trace(
    loss_fn: Callable[..., Tensor],
    *,
    num_probes: int,
    generator: torch.Generator | int,
    chunk_size: int | None = None,
    probe_chunk_size: int | None = None,
) -> Callable[..., Tensor]:
    """Per-sample Hessian trace estimates ``mean_p v_p^T H_i v_p`` with Rademacher probes.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample.
        num_probes: number of probe vectors ``P``.
        generator: the source of the probes: a ``torch.Generator`` (its state advances, so two
            calls draw different probes) or an int seed (a fresh CPU generator per call: the same
            inputs give the same estimates).
        chunk_size: map this many samples at a time; probe_chunk_size: this many probes at a time
            (memory grows with ``chunk_size * probe_chunk_size`` HVPs).

    Returns:
        ``fn(params, *shared, batch) -> [B]`` trace estimates (params' dtype).

    Guarantees:
        Unbiased, with variance ``2 (||H_i||_F**2 - sum_j H_i[j, j]**2) / P`` per sample. All samples
        use the same ``P`` probes (drawn once per call, leaf by leaf in optree order, outside the
        traced maths), so their errors are correlated and ``estimates.sum()`` is itself the
        Hutchinson estimate of the batch's summed Hessian.

    Example:
        >>> traces = hutchinson_trace(loss_fn, num_probes=100, generator=0)(params, buffers, (x, y))
    """
    call = "hutchinson_trace(loss_fn)"
    _prepare_forward_ad()
    _check_callable(call, "loss_fn", loss_fn)
    check_chunk_size(call, chunk_size)
    check_chunk_size(call, probe_chunk_size, "probe_chunk_size")
    if isinstance(num_probes, bool) or not isinstance(num_probes, int) or num_probes < 1:
        raise ValueError(f"{call}: num_probes must be a positive int, got {num_probes!r}; the estimate's variance falls as 1/num_probes.")
    if isinstance(generator, bool) or not isinstance(generator, (torch.Generator, int)) or (isinstance(generator, int) and generator < 0):
        raise TypeError(
            f"{call}: generator must be a torch.Generator or a non-negative int seed, got {generator!r}. "
            "Pass vmapdp.make_generator(seed) or the seed itself."
        )
    g = grad(_scalar(loss_fn, call, "loss_fn"), argnums=0)

    def one(params: Any, probes: Any, *rest: Any) -> Tensor:
        *shared, sample = rest

        def quad(v: Any) -> Tensor:
            _, hv = jvp(lambda p: g(p, *shared, sample), (params,), (v,))
            return _dot(v, hv)

        return vmap(quad, chunk_size=probe_chunk_size)(probes).mean()

    def fn(*args: Any) -> Tensor:
        _check_nargs(call, args, 1, "(params, *shared, batch)")
        batch_size(args[-1], call=call)
        gen = torch.Generator().manual_seed(generator) if isinstance(generator, int) else generator
        probes = _rademacher(args[0], num_probes, gen)
        in_dims = (None, None) + (None,) * (len(args) - 2) + (0,)
        return _mapped(call, one, (args[0], probes) + args[1:], in_dims, chunk_size)

    return fn


def empirical_ntk(apply_fn: Callable[..., Tensor], *, chunk_size: int | None = None) -> Callable[..., Tensor]:
    """The empirical neural tangent kernel ``J_a J_b^T`` between two batches of inputs.

    ``NTK[i, j, o1, o2] = sum over params k of <dout_o1(a_i)/dparams_k, dout_o2(b_j)/dparams_k>``.

    Args:
        apply_fn: ``apply_fn(params, *shared, inputs) -> Tensor`` for ONE sample (as in
            :func:`per_sample_jacobian`).
        chunk_size: map this many samples at a time when forming the Jacobians.

    Returns:
        ``fn(params, *shared, inputs_a, inputs_b) -> [B_a, B_b, *out_shape, *out_shape]``
        (``[B_a, B_b]`` for a scalar output), accumulated in float32 or wider. Both batches'
        Jacobians are formed (``(B_a + B_b) * n_out * n_params`` numbers).
    """
    call = "empirical_ntk(apply_fn)"
    jac = per_sample_jacobian(apply_fn, chunk_size=chunk_size)

    def fn(*args: Any) -> Tensor:
        _check_nargs(call, args, 2, "(params, *shared, inputs_a, inputs_b)")
        params, shared = args[0], args[1:-2]
        ja = jac(params, *shared, args[-2])
        jb = jac(params, *shared, args[-1])
        total = None
        out_shape: tuple[int, ...] = ()
        for (_, a), (_, b), (_, p) in zip(leaves_with_paths(ja), leaves_with_paths(jb), leaves_with_paths(params)):
            out_shape = tuple(a.shape[1 : a.dim() - p.dim()])
            n_out, dtype = math.prod(out_shape), acc_dtype(a.dtype)
            a2 = a.reshape(a.shape[0], n_out, -1).to(dtype)
            b2 = b.reshape(b.shape[0], n_out, -1).to(dtype)
            term = torch.einsum("iap,jbp->ijab", a2, b2)
            total = term if total is None else total + term
        if total is None:
            raise ValueError(f"{call}: params has no tensor leaves, so the kernel is empty.")
        return total.reshape(total.shape[:2] + out_shape + out_shape)

    return fn


def grad_similarity(grads_a: Any, grads_b: Any, *, normalize: bool = False) -> Tensor:
    """Dot products between every pair of per-sample gradients: ``[B_a, B_b]``.

    Args:
        grads_a, grads_b: per-sample gradients (pytrees with the same keys, leaves ``[B_a, *shape]``
            and ``[B_b, *shape]``), e.g. of training and test samples.
        normalize: cosine similarity instead (0 where either gradient is zero).

    Returns:
        ``S[i, j] = sum over keys of <grads_a[k][i], grads_b[k][j]>``, float32 or wider.

    Example:
        >>> S = grad_similarity(per_sample_grads(loss_fn)(params, buffers, train),
        ...                     per_sample_grads(loss_fn)(params, buffers, test))
    """
    call = "grad_similarity(grads_a, grads_b)"
    ba = batch_size(grads_a, call=call, what="grads")
    bb = batch_size(grads_b, call=call, what="grads")
    a, b = dict(leaves_with_paths(grads_a)), dict(leaves_with_paths(grads_b))
    if a.keys() != b.keys():
        raise ValueError(
            f"{call}: both must have the same keys (they are joined by key); only in grads_a "
            f"{sorted(a.keys() - b.keys())}, only in grads_b {sorted(b.keys() - a.keys())}. "
            "Compute both with the same loss_fn and params."
        )
    total = None
    for k in a:
        x, y = a[k], b[k]
        if x.shape[1:] != y.shape[1:]:
            raise ValueError(f"{call}: {k!r} has per-sample shape {tuple(x.shape[1:])} in grads_a but {tuple(y.shape[1:])} in grads_b.")
        dtype = acc_dtype(torch.promote_types(x.dtype, y.dtype))
        term = x.reshape(ba, -1).to(dtype) @ y.reshape(bb, -1).to(dtype).T
        total = term if total is None else total + term
    if normalize:
        na = torch.sqrt(sum(a[k].reshape(ba, -1).to(total.dtype).square().sum(1) for k in a))
        nb = torch.sqrt(sum(b[k].reshape(bb, -1).to(total.dtype).square().sum(1) for k in b))
        denom = na[:, None] * nb[None, :]
        total = torch.where(denom > 0, total / torch.where(denom > 0, denom, 1.0), 0.0)
    return total


def influence_scores(
    loss_fn: Callable[..., Tensor], *, chunk_size: int | None = None, normalize: bool = False
) -> Callable[..., Tensor]:
    """TracIn-style influence scores: ``<grad loss(train_i), grad loss(test_j)>`` at ``params``.

    One checkpoint's term of TracIn (Pruthi et al. 2020, "Estimating Training Data Influence by
    Tracing Gradient Descent"); TracIn-CP sums ``learning_rate_t * scores_t`` over checkpoints::

        scores = sum(lr * influence_scores(loss_fn)(p, buffers, train, test) for p, lr in checkpoints)

    A positive score: a gradient step on ``train_i`` lowers ``test_j``'s loss (to first order).

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample.
        chunk_size: passed to :func:`vmapdp.per_sample_grads`.
        normalize: cosine similarity of the gradients instead of dot products.

    Returns:
        ``fn(params, *shared, train_batch, test_batch) -> [B_train, B_test]``.
    """
    call = "influence_scores(loss_fn)"
    _check_callable(call, "loss_fn", loss_fn)
    psg = per_sample_grads(loss_fn, chunk_size=chunk_size)

    def fn(*args: Any) -> Tensor:
        _check_nargs(call, args, 2, "(params, *shared, train_batch, test_batch)")
        shared = args[:-2]
        return grad_similarity(psg(*shared, args[-2]), psg(*shared, args[-1]), normalize=normalize)

    return fn
