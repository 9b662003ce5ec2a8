"""Exceptions raised by vmapdp."""

from __future__ import annotations


class UnsupportedModuleError(ValueError):
    """A module cannot be used for per-sample gradients / DP training as it is.

    Raised for modules that mix samples within a batch (train-mode BatchNorm), that
    update buffers from the data during the forward pass (running statistics), or that
    ``torch.func.vmap`` cannot batch. The message names the module and the fix;
    ``vmapdp.fix(module)`` returns a repaired copy where one exists.
    """


# Lower-case fragments of torch's own errors, and what they mean for per-sample gradients.
_BATCH_NORM_SIGN = "expected more than 1 value per channel when training"


def explain_torch_error(call: str, err: BaseException) -> Exception | None:
    """torch's raw error, raised inside the per-sample engine, as one that names the cause and the
    fix; ``None`` when it is not one vmapdp knows (raise the original then)."""
    if isinstance(err, UnsupportedModuleError):
        return None  # already explained
    msg = str(err)
    first = msg.splitlines()[0] if msg else type(err).__name__
    if _BATCH_NORM_SIGN in msg.lower():
        return UnsupportedModuleError(
            f"{call}: a BatchNorm layer in training mode reached the per-sample engine, which runs the "
            "model on one sample at a time, so BatchNorm has no batch to normalize over (torch said: "
            f"{first}). BatchNorm mixes the samples of a batch, so its per-sample gradients are not "
            "per-sample and DP-SGD cannot bound one sample's influence. Fix: model = vmapdp.fix(model) "
            "(BatchNorm -> GroupNorm; vmapdp.validate(model) lists every such layer), or model.eval() "
            "if its running statistics come from public data."
        )
    return None
