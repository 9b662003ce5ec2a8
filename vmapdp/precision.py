"""Mixed precision for one-sample losses: compute in bfloat16 or float16, keep float32 master params.

:func:`mixed_precision` wraps a loss ``loss_fn(params, *shared, sample)`` so that the forward and
the backward run in a low-precision dtype while everything DP-SGD does with the result stays in
float32::

    fp32 master params ──cast──▶ bf16 params ─▶ loss_fn (bf16 forward) ─▶ loss ──▶ float32 loss
    fp32 per-sample grads ◀──cast── bf16 grads ◀──── bf16 backward ◀────────────────┘

The casts are ordinary differentiable ops, so ``per_sample_grads(mixed_precision(loss_fn))``
differentiates through them: the gradient with respect to the float32 master params comes back
in float32 (the backward of a cast is the cast back). Per-sample norms, clipping, the clipped sum,
the noise and the optimizer update then all run in float32, exactly as without mixed precision:
the privacy guarantee does not depend on the compute dtype (every sample's contribution is still
clipped to ``l2_clip_norm`` in float32, and the noise is float32 with the same std).

What changes is the accuracy of each per-sample gradient: bfloat16 keeps 8 significant bits, so
expect relative errors of about 1e-2 per gradient (``tests/test_precision.py`` measures them).
That is noise well below the DP noise in any realistic setting, but it is not bitwise float32.

float16 has more significant bits (11) but a narrow exponent range: values below about 6e-8
underflow to 0 and above 65504 overflow to inf. Per-sample gradients of a one-sample loss are
usually larger than those of a batch mean (there is no 1/B), but small ones can still vanish. A
static ``loss_scale`` (a power of two) multiplies the gradient flowing back through the float16
graph and divides it out again in float32, exactly. A sample whose scaled gradient overflows gets
a non-finite gradient, which ``clip_and_sum`` (``nonfinite="zero"``) drops and the train step
counts in its ``nonfinite`` metric; lower the scale if that happens often. bfloat16 has float32's
exponent range and needs no scaling.

:func:`full_float32` is the other float32 guard: TF32 off for CUDA convs and matmuls while open,
which the clipped sum's float32 rounding margins assume (``clipped_grad_sum``, ``make_train_step``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import optree
import torch
from torch import Tensor

__all__ = ["mixed_precision", "full_float32"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MAX_FP16_SCALE = 2.0**15  # the largest power of two below float16's max (65504)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor leaf cast to ``dtype``; integer, bool and complex leaves and
    non-tensors untouched."""

    def one(x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return optree.tree_map(one, tree, namespace="torch")


def _scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` itself in the forward (``x.detach() + 0``), with its gradient multiplied by ``factor``.

    Plain ops, no custom autograd.Function, so it works under ``vmap``, ``grad`` and
    ``torch.compile`` like everything else. With ``factor`` a power of two the scaling is exact.
    """
    d = x.detach()
    return d + (x - d) * factor


def _scale_grads(tree: Any, factor: float) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, Tensor) and x.is_floating_point():
            return _scale_grad(x, factor)
        return x

    return optree.tree_map(one, tree, namespace="torch")


def mixed_precision(
    loss_fn: Callable[..., Any],
    dtype: torch.dtype = torch.bfloat16,
    *,
    loss_scale: float | None = None,
) -> Callable[..., Any]:
    """Wrap a one-sample loss so that it computes in ``dtype`` and returns a float32 loss.

    Args:
        loss_fn: ``loss_fn(params, *shared, sample) -> scalar`` for ONE sample (the form of
            :func:`vmapdp.per_sample_grads`), or ``-> (scalar, aux)`` for ``has_aux``.
        dtype: the compute dtype, ``torch.bfloat16`` (default) or ``torch.float16``.
        loss_scale: float16 only (optional): a static power of two in ``[1, 2**15]`` by which the gradient is
            multiplied while it flows back through the float16 computation, and divided by again
            (exactly) once it is float32. Guards small per-sample gradients against underflow.

    Returns:
        ``wrapped(params, *shared, sample)`` with ``loss_fn``'s signature. It casts every
        floating-point tensor leaf of every argument (the params, the shared arguments such as
        buffers, the sample's inputs) to ``dtype``; integer tensors (labels, tokens), bools and
        non-tensors are passed through untouched. It returns the loss cast to float32 (``aux``,
        if any, as ``loss_fn`` computed it).

    Guarantees:
        Gradients of ``wrapped`` with respect to float32 params are float32, so
        ``per_sample_grads``, ``clip_and_sum``, the noise and the update run in float32 as
        without mixed precision; the clipping bound and the noise std are unchanged. Only the
        per-sample gradients' accuracy is that of ``dtype`` (bfloat16: about 1e-2 relative).
        With ``loss_scale`` the returned loss value is unscaled and the gradients are unscaled
        exactly (multiplication by powers of two).

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: ``dtype`` is not bfloat16 or float16; ``loss_scale`` is given for bfloat16
            or is not a positive power of two.

    Example:
        >>> step = vmapdp.make_train_step(loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.1,
        ...     expected_batch_size=256, sample_rate=0.01, precision=torch.bfloat16)
        >>> # or, by hand:
        >>> grads = vmapdp.per_sample_grads(mixed_precision(loss_fn))(params, buffers, (x, y))
        >>> grads["fc.weight"].dtype
        torch.float32
    """
    call = "mixed_precision(loss_fn, dtype)"
    from vmapdp import _checks

    _checks.loss_function(call, loss_fn)
    if dtype not in _LOW_PRECISION:
        raise ValueError(
            f"{call}: dtype={dtype!r} must be torch.bfloat16 or torch.float16 (the compute dtype; "
            "the master params, the clipping and the noise stay float32). Without mixed precision, "
            "pass the loss unwrapped (precision=None in make_train_step)."
        )
    if loss_scale is not None:
        if dtype != torch.float16:
            raise ValueError(
                f"{call}: loss_scale={loss_scale!r} is for float16 only; bfloat16 has float32's exponent "
                "range and needs no scaling. Drop loss_scale."
            )
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not 1 <= loss_scale <= _MAX_FP16_SCALE:
            raise ValueError(
                f"{call}: loss_scale={loss_scale!r} must be a power of two in [1, 2**15]: the backward "
                "starts from loss_scale in float16, whose largest finite value is 65504."
            )
        mantissa, _ = math.frexp(loss_scale)
        if mantissa != 0.5:
            raise ValueError(
                f"{call}: loss_scale={loss_scale!r} must be a power of two (e.g. {2.0 ** round(math.log2(loss_scale))!r}) "
                "so that scaling the gradient and unscaling it again are exact."
            )
        loss_scale = float(loss_scale)

    def run(args: tuple, unscale: bool) -> Any:
        if loss_scale is not None and unscale:
            # float32 side: the gradient reaching the master params (and any other differentiated
            # shared argument) is divided by the scale; the sample is never differentiated
            args = _scale_grads(args[:-1], 1.0 / loss_scale) + args[-1:]
        out = loss_fn(*_cast(args, dtype))
        loss, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, Tensor):
            raise TypeError(f"{call}: loss_fn must return a scalar tensor (or a tuple (loss, aux)), got {type(loss).__name__}.")
        if loss_scale is not None:
            # low-precision side: the backward through loss_fn starts from loss_scale, not 1
            loss = _scale_grad(loss, loss_scale)
        loss = loss.to(torch.float32)
        return loss if rest is None else (loss,) + rest

    @functools.wraps(loss_fn)
    def wrapped(*args: Any) -> Any:
        return run(args, unscale=True)

    if loss_scale is not None:
        # For ghost clipping (vmapdp.clipped_grad_sum): the float32-side unscaling hides the params
        # from the layers it covers (they see d + (p - d) / scale, not a cast of p), which turned its
        # coverage to 0. It runs this form instead, whose gradients are loss_scale times wrapped's,
        # and divides the scale out of its norms and sum itself (exactly: a power of two).
        @functools.wraps(loss_fn)
        def scaled(*args: Any) -> Any:
            return run(args, unscale=False)

        mark_scaled_form(wrapped, loss_scale, scaled)
    return wrapped


def mark_scaled_form(fn: Callable[..., Any], loss_scale: float, scaled: Callable[..., Any]) -> None:
    """Offer ghost clipping ``scaled`` (gradients ``loss_scale`` times ``fn``'s) in place of ``fn``.
    The mark names ``fn`` itself: a caller's wrapper made with ``functools.wraps(fn)`` copies the
    attribute, and ghost would then run the inner loss, dropping what the wrapper adds (found by
    review: a wrapper tripling the loss got a third of vmap's norms under ghost)."""
    fn._vmapdp_loss_scale = (loss_scale, scaled, fn)  # type: ignore[attr-defined]


def scaled_form(fn: Callable[..., Any]) -> tuple[float, Callable[..., Any]] | None:
    """``(loss_scale, scaled)`` marked on ``fn`` by :func:`mark_scaled_form`, or None (none, or
    one copied from another function by ``functools.wraps``)."""
    form = getattr(fn, "_vmapdp_loss_scale", None)
    if isinstance(form, tuple) and len(form) == 3 and form[2] is fn:
        return form[0], form[1]
    return None


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
        saved = [obj.fp32_precision for obj in flags]
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

