"""Exceptions raised by vmapdp."""

from __future__ import annotations

from typing import Callable


class UnsupportedModuleError(ValueError):
    """A module cannot be used for per-sample gradients / DP training as it is.

    Raised for modules that mix samples within a batch (train-mode BatchNorm), that
    update buffers from the data during the forward pass (running statistics), or that
    ``torch.func.vmap`` cannot batch. The message names the module and the fix;
    ``vmapdp.fix(module)`` returns a repaired copy where one exists.
    """


class PublicSeedWarning(UserWarning):
    """A noise seed or sampling key that others can know or guess (a small int, a short string, a
    ``torch.Generator``): whoever does can regenerate the noise and subtract it, or the batches
    (whose secrecy the amplification by sampling counts on), and the epsilon reported does not hold
    against them. Fine for tests and reproducible experiments (silence it with
    ``warnings.filterwarnings("ignore", category=vmapdp.PublicSeedWarning)``); for a release leave
    the seed out (a fresh secret from OS entropy) or pass 128 random bits kept as secret as the data.
    """


# Lower-case fragments of torch's own errors, and what they mean for per-sample gradients.
_BATCH_NORM_SIGN = "expected more than 1 value per channel when training"


def _positional_mismatch(msg: str) -> bool:
    """Python's own message for a call with too many or too few positional arguments."""
    import re

    return bool(re.search(r"takes (from )?\d+ (to \d+ )?positional arguments? but \d+ (were|was) given|missing \d+ required positional argument", msg))


def _torch_kind(err: BaseException) -> bool:
    """An error type torch's own failures come as (a caller's own ValueError or TypeError is not
    relabelled as one of them: found by review)."""
    return isinstance(err, (RuntimeError, IndexError))


# what torch's message says (a test of the error and its lower-cased message), the exception
# vmapdp raises instead, and its message ({call}, torch's first line {first}, the aten {op}); in order
_KNOWN: tuple[tuple[Callable[[BaseException, str], bool], type, str], ...] = (
    (
        lambda err, low: _BATCH_NORM_SIGN in low,
        UnsupportedModuleError,
        "{call}: a BatchNorm layer in training mode reached the per-sample engine, which runs the "
        "model on one sample at a time, so BatchNorm has no batch to normalize over (torch said: "
        "{first}). BatchNorm mixes the samples of a batch, so its per-sample gradients are not "
        "per-sample and DP-SGD cannot bound one sample's influence. Fix: model = vmapdp.fix(model) "
        "(BatchNorm -> GroupNorm; vmapdp.validate(model) lists every such layer), or model.eval() "
        "if its running statistics come from public data.",
    ),
    (
        lambda err, low: "embedding_renorm_" in low,
        UnsupportedModuleError,
        "{call}: nn.Embedding(max_norm=...) renormalises rows of its weight in place during the forward (torch said: "
        "{first}): the per-sample engine cannot batch it, and a param rewritten by the data during the step is not "
        "what DP-SGD's update bounds. Build the embedding without max_norm (renormalise the weight after each step, "
        "outside the private computation, if you need it).",
    ),
    (
        lambda err, low: "sparsecpu" in low or "sparsecuda" in low,
        UnsupportedModuleError,
        "{call}: a sparse gradient reached the per-sample engine (nn.Embedding(sparse=True) or EmbeddingBag(sparse=True); "
        "torch said: {first}), which per-sample gradients cannot hold. Build the layer with sparse=False, or use "
        "method='ghost', whose embedding rule never forms per-sample gradients.",
    ),
    (
        lambda err, low: "vmap" in low and ("use a tensor in some data-dependent control flow" in low or ".item()" in low),
        ValueError,
        "{call}: loss_fn reads a per-sample tensor's value in Python (.item(), float(t), int(t), bool(t), `if t > 0:`, "
        "a tensor as a Python index; torch said: {first}), which the per-sample engine cannot map over the batch. "
        "Keep it a tensor: t instead of t.item(), torch.where(cond, a, b) instead of an if.",
    ),
    (
        lambda err, low: "batching rule not implemented for aten::" in low,
        UnsupportedModuleError,
        "{call}: torch.func.vmap has no batching rule for aten::{op}, which the loss applies to a per-sample tensor "
        "(torch said: {first}). With method='ghost' a use of a param no rule covers runs on per-sample copies of the "
        "param, so ops on params are batched too. Pass the op's scalar arguments as Python ints (narrow(dim, int(start), "
        "length) instead of a tensor start), write the op another way (a slice: w[start:start + length]), or use "
        "method='vmap'.",
    ),
    (
        lambda err, low: "expected f(*args) to return a tensor, got <class 'tuple'>" in low,
        TypeError,
        "{call}: loss_fn returned a tuple where a loss tensor was expected (torch said: {first}). For (loss, aux) "
        "pass per_sample_grads(loss_fn, has_aux=True); clipped_grad_sum and make_train_step take the loss alone.",
    ),
    (
        lambda err, low: _torch_kind(err) and ("int32/int64 for index" in low or "expected scalar type long" in low),
        TypeError,
        "{call}: an op that takes class indices (cross_entropy, nll_loss, gather, embedding) got a tensor of another "
        "dtype than int64 (torch said: {first}). Pass the labels (or token ids) as int64: y.long().",
    ),
    # (found by review: these reached the user raw; the per-sample view's "1x" in torch's shapes confused them)
    (
        lambda err, low: _torch_kind(err) and "mat1 and mat2 shapes cannot be multiplied" in low,
        ValueError,
        "{call}: a layer got inputs of another size than it takes (torch said: {first}). loss_fn runs on ONE sample "
        "(the batch's leading dim removed; a leading 1 in torch's shapes is the [None] your loss adds back): check "
        "each sample's feature size against the layer's in_features, and that dim 0 of every batch tensor is the batch.",
    ),
    (
        lambda err, low: _torch_kind(err) and ("index out of range in self" in low or "out of bounds for dimension" in low or "index out of bounds" in low),
        ValueError,
        "{call}: an index is out of range (torch said: {first}); most often a label outside [0, num_classes) "
        "(cross_entropy, nll_loss), or a token id or position past an embedding's size (a vocabulary or sequence "
        "length larger than the model's config). Check the batch's labels and ids against the model's sizes.",
    ),
    (
        lambda err, low: "we cannot vmap over non-tensor arguments" in low,
        TypeError,
        "{call}: the batch holds a leaf that is not a tensor (torch said: {first}), such as None or a number: every "
        "leaf of the batch must be a tensor whose dim 0 is the batch. Leave such values out of the batch (pass a "
        "constant as a shared argument, or close over it in loss_fn).",
    ),
    (
        lambda err, low: isinstance(err, TypeError) and _positional_mismatch(low),
        TypeError,
        "{call}: a function got another number of arguments than it takes (torch said: {first}). If it is loss_fn: it "
        "is called as loss_fn(params, *shared, sample), so the shared arguments (step(state, batch, mask, *shared); "
        "fn(params, *shared, batch)) must be exactly the ones it takes between params and sample, buffers included; "
        "pass a mask by keyword (fn(params, *shared, batch, mask=mask)), not after the batch.",
    ),
    (
        lambda err, low: _torch_kind(err) and ("same dtype" in low or "expected scalar type" in low or "should be the same" in low),
        TypeError,
        "{call}: the model's params and the batch (or two inputs) have different dtypes (torch said: {first}). "
        "Cast the batch's floating-point tensors to the params' dtype (x.to(torch.float64) for float64 params, x.float() "
        "for float32), or the model to the batch's before functionalize (model.double(), model.float()); labels stay "
        "integer.",
    ),
)


def explain_torch_error(call: str, err: BaseException) -> Exception | None:
    """torch's raw error, raised inside the per-sample engine, as one that names the cause and the
    fix; ``None`` when it is not one vmapdp knows (raise the original then)."""
    if isinstance(err, UnsupportedModuleError):
        return None  # already explained
    msg = str(err)
    first = msg.splitlines()[0] if msg else type(err).__name__
    low = msg.lower()
    for test, kind, text in _KNOWN:
        if test(err, low):
            op = (msg.split("aten::", 1)[1].split(";", 1)[0].split() or [""])[0] if "aten::" in msg else ""
            return kind(text.format(call=call, first=first, op=op))
    return None
