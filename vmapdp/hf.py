"""Per-sample gradients of Hugging Face ``transformers`` (and ``peft``) models.

``loss_fn(model)`` returns ``(apply, params, buffers, loss_fn)`` where ``loss_fn(params, buffers,
sample)`` takes ONE sample as a dict (``input_ids``, ``attention_mask``, ``labels``, any other
input of the model such as ``token_type_ids`` or ``pixel_values``) and returns the model's loss for
it, ready for :func:`vmapdp.per_sample_grads`, :func:`vmapdp.clipped_grad_sum`,
:func:`vmapdp.make_train_step` and :func:`vmapdp.make_private` (which uses it for transformers
models)::

    apply, params, buffers, loss = vmapdp.hf.loss_fn(model)
    grads = vmapdp.per_sample_grads(loss)(params, buffers, dict(tokenizer(texts, padding=True)) | {"labels": y})

Why an adapter: given the usual 2-D padding ``attention_mask``, transformers builds the 4-D
attention mask with data-dependent Python control flow (``masking_utils`` checks
``padding_mask.all()`` to skip the mask), which ``torch.func.vmap`` cannot run. Every mask
builder in ``transformers.masking_utils`` returns a mask that is already 4-D as it is, so the
adapter builds the additive float mask ``[1, 1, T, T]`` (0 where a query may attend, the dtype's
most negative number where not) of each sample itself, with tensor ops only, and passes that.
Causal or bidirectional is found once by probing the model (does position 0 see position 1?).

Losses, per sample (a padded position never counts):

* causal LM (``*ForCausalLM``, ``*LMHeadModel``): the mean cross-entropy of the next token over
  the positions whose target is a real token (``attention_mask == 1`` and ``labels != -100``);
  ``labels`` defaults to ``input_ids``.
* token classification (``*ForTokenClassification``: tagging, NER): the mean cross-entropy of
  each real position's logits against its label (``labels`` ``[T]``, ``-100`` ignored);
* classification (``*ForSequenceClassification``, ``*ForImageClassification``, ...): the
  cross-entropy of the logits against the label (mean squared error for one output,
  ``problem_type="regression"``; the mean binary cross-entropy against a multi-hot float vector
  for ``problem_type="multi_label_classification"`` or float labels, as transformers does).

A left-padded sample is seen as right-padded (its leading padding moved to its end, labels
with it): its real tokens sit at positions 0, 1, ... whatever the batch's longest sample, so the
loss of a sample never depends on the other rows (a model counting positions from 0 would
otherwise place them by the batch's padded length). A zero inside the mask hides that token: a
causal LM's loss is the model's own on the sample with its hidden tokens removed (positions
count real tokens), except that the target right after a hidden token, which would be predicted
from it, does not count (with peft prompt tuning it does, predicted from the last real token
before it: the hidden tokens removed exactly); an encoder's is the model's own with the mask as
given (its positions are its own). Sliding-window and chunked attention
(``config.sliding_window``, ``config.attention_chunk_size``) are refused beyond their span, and a
next-token loss on a model whose attention is bidirectional is refused.

peft models: LoRA and the other adapters run as they are (only the adapters are in ``params``);
prompt tuning and P-tuning (``PromptTuningConfig``, ``PromptEncoderConfig``) run through a twin of
the model whose forward puts the virtual tokens' embeddings in front of the sample's and passes the
adapter's mask on (peft's own forward concatenates a 2-D prefix mask), with a causal LM's first real
token predicted from the last virtual one across any left padding, as without it. Prefix tuning and
the others that pass a cache or per-sample task ids are refused by name.

This module imports ``transformers`` lazily; vmapdp itself does not depend on it
(``pip install vmapdp[hf]``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import types
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vmapdp import _checks
from vmapdp.functional import FunctionalModel, functionalize

__all__ = ["loss_fn", "sample_loss", "is_transformers_model", "additive_mask", "TASKS"]

TASKS = ("causal_lm", "classification", "token_classification")
_IGNORE = -100


def _require_transformers(call: str) -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ImportError(
            f"{call}: needs the transformers package, which is not installed (vmapdp does not depend on it). "
            "Install it with: pip install vmapdp[hf]"
        )


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (``PeftModel.get_base_model()``), or ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (or a peft model wrapping one).
    Never imports transformers: a module that is not one cannot come from it."""
    if not isinstance(model, nn.Module):
        return False
    base = _base_model(model)
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(base).__mro__)


_PROMPT_TYPES = ("PROMPT_TUNING", "P_TUNING")


def _prompt_tokens(call: str, model: nn.Module, task: str, causal: Optional[bool]) -> int:
    """The number of virtual tokens a peft prompt-learning model prepends (0 for any other model),
    after refusing the kinds the adapter cannot run per sample."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind not in _PROMPT_TYPES:
        raise ValueError(
            f"{call}: peft {kind} is not supported: the adapter runs prompt learning that prepends virtual token "
            f"embeddings ({', '.join(_PROMPT_TYPES)}); prefix tuning passes past_key_values (a transformers Cache, which "
            "vmap cannot batch), and multitask prompt tuning / CPT need per-sample task_ids or type masks. Use "
            "PromptTuningConfig, PromptEncoderConfig (P-tuning) or LoRA."
        )
    if task == "token_classification" or (task == "classification" and causal):
        raise ValueError(
            f"{call}: peft prompt tuning with a {type(_base_model(model)).__name__} is not supported: "
            + ("a tagger's outputs at the virtual tokens have no labels" if task == "token_classification" else
               "a decoder classifier given inputs_embeds pools the last position, which is a padding position of a "
               "right-padded sample")
            + ". Prompt tuning runs with causal LMs and encoder classifiers (BERT-style); use LoRA here."
        )
    return int(config.num_virtual_tokens)


def _task_of_class(model: nn.Module, default: str) -> str:
    """The task the model's class name says (``default`` where it says none)."""
    try:
        return _task("", model, None)
    except ValueError:
        return default


def _prompted(apply: FunctionalModel) -> FunctionalModel:
    """``apply`` over a twin of the peft prompt-learning model whose forward prepends the virtual
    tokens' embeddings and passes the given (4-D, per-sample) attention mask on as it is (peft's own
    forward concatenates a 2-D prefix mask, which fails on the adapter's 4-D one). The twin shares the
    model's submodules and parameter names (a shallow copy with its own ``forward``)."""

    def forward(self, input_ids, attention_mask=None, **kwargs):
        embeds = self.word_embeddings(input_ids)
        prompts = self.get_prompt(batch_size=input_ids.shape[0]).to(embeds.dtype)
        return self.base_model(inputs_embeds=torch.cat((prompts, embeds), dim=1), attention_mask=attention_mask, **kwargs)

    twin = copy.copy(apply.module)
    twin.forward = types.MethodType(forward, twin)
    return FunctionalModel(twin, apply.param_names, apply.buffer_names)


def _task(call: str, model: nn.Module, task: Optional[str]) -> str:
    if task is not None:
        return _checks.choice(call, "task", task, TASKS, why="the loss the adapter computes per sample")
    name = type(_base_model(model)).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith("ForTokenClassification"):
        return "token_classification"
    if "Classification" in name:
        return "classification"
    raise ValueError(
        f"{call}: cannot tell which loss {name} trains with (expected a *ForCausalLM, *LMHeadModel, "
        f"*ForTokenClassification or *For...Classification model). Pass task= one of {TASKS}, or write your own loss_fn around "
        "vmapdp.hf.additive_mask."
    )


def additive_mask(attention_mask: Tensor, *, causal: bool, dtype: torch.dtype) -> Tensor:
    """The 4-D additive attention mask ``[1, 1, T, T]`` of ONE sample's 2-D padding mask ``[T]``.

    0 where query ``q`` may attend to key ``k`` (``attention_mask[k] == 1``, and ``k <= q`` when
    ``causal``), ``torch.finfo(dtype).min`` elsewhere: what transformers' ``eager_mask`` builds,
    with tensor ops only, so it runs under ``vmap``, ``grad`` and ``torch.compile``. Every query also
    sees itself, so no row is fully masked (a left-padding query of a causal model would be NaN once
    a model casts the scores to float32): this changes only padding positions' outputs, which never
    reach a real position nor the losses here.
    """
    if attention_mask.dim() != 1:
        raise ValueError(
            f"vmapdp.hf.additive_mask(attention_mask): expected ONE sample's padding mask of shape [T], got shape "
            f"{tuple(attention_mask.shape)}. Call it inside a per-sample loss (vmap maps the batch dim away)."
        )
    _checks.flag("vmapdp.hf.additive_mask(attention_mask)", "causal", causal)
    t = attention_mask.shape[0]
    keep = (attention_mask != 0)[None, :].expand(t, t)
    if causal:
        keep = keep & torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    # a query that would see no key at all (a left-padding position of a causal model) sees itself:
    # a fully masked row is NaN once a model casts the scores to a narrower dtype (-inf everywhere)
    keep = keep | torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)[None, None]


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


def _is_causal(model: nn.Module) -> bool:
    """Whether the model's attention is causal: does its last hidden state at position 0 change
    when the token at position 1 does? (Two length-2 forwards of one sample each, in eval mode,
    without gradients: a decoder classifier without a pad_token_id refuses batches of two.)"""
    with _eval_mode(model), torch.no_grad():
        first = [model(input_ids=torch.tensor([[1, t]], device=_device(model)), output_hidden_states=True, return_dict=True).hidden_states[-1][0, 0] for t in (2, 3)]
    return bool(torch.equal(*first))


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _label_key(sample: Mapping) -> str:
    for k in ("labels", "label"):
        if k in sample:
            return k
    raise KeyError(
        f"vmapdp.hf loss_fn(params, buffers, sample): the sample has keys {sorted(sample)} but no 'labels' "
        "(or 'label'); the loss needs the targets. For a causal LM put labels = input_ids (padding is "
        "ignored through attention_mask)."
    )


def _float_dtype(params: Mapping, buffers: Mapping) -> torch.dtype:
    for t in list(params.values()) + list(buffers.values()):
        if isinstance(t, Tensor) and t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def sample_loss(
    model: nn.Module,
    apply: FunctionalModel,
    *,
    task: Optional[str] = None,
    causal: Optional[bool] = None,
    criterion: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
) -> Callable[..., Tensor]:
    """``loss_fn(params, buffers, sample)`` for ``apply`` (from ``functionalize(model)``); see
    :func:`loss_fn`. With ``criterion``, the loss is ``criterion(logits [1, ...], labels [1, ...])``
    instead of the task's (the mask is still built per sample)."""
    call = "vmapdp.hf.loss_fn(model)"
    _require_transformers(call)
    causal = _checks.flag(call, "causal", causal, optional=True)
    if criterion is None:
        task = _task(call, model, task)
    elif task is None:
        task = "classification"  # (only picks where the labels are read: criterion computes the loss)
    config = getattr(_base_model(model), "config", None)
    # transformers' own choice: the problem_type, or one output a regression and float labels several binary ones
    problem = getattr(config, "problem_type", None)
    regression = task == "classification" and (problem == "regression" or (problem is None and getattr(config, "num_labels", 2) == 1))
    multi_label = task == "classification" and problem == "multi_label_classification"
    causal_given = causal
    if causal is None and "input_ids" in inspect.signature(_base_model(model).forward).parameters:
        # once, eagerly (not while vmap or compile traces the loss); on the transformers model (a peft
        # prompt's virtual tokens would sit at position 0)
        causal = _is_causal(_base_model(model))
    if criterion is None and task == "causal_lm" and causal is False:
        raise ValueError(
            f"{call}: {type(_base_model(model)).__name__}'s attention is bidirectional ("
            + ("probed: position 0 sees position 1" if causal_given is None else "causal=False given")
            + "), "
            "so a next-token loss would let each position see its own target. The adapter trains causal LMs; for a "
            "bidirectional model pass task='classification' or 'token_classification' (or causal=True if the probe is "
            "wrong for this model)."
        )
    # (with a criterion, ``task`` only says where the labels are: the prompt checks take the class's)
    prompt_task = task if criterion is None else _task_of_class(model, task)
    virtual = _prompt_tokens(call, model, prompt_task, causal)
    if virtual and criterion is not None and prompt_task != "classification":
        raise ValueError(
            f"{call}: criterion= with a peft prompt-tuned {type(_base_model(model)).__name__}: its logits hold the "
            f"{virtual} virtual tokens' positions in front of the sample's, which a criterion written for the model's own "
            "outputs does not expect. Leave criterion out: the adapter's loss skips them."
        )
    if virtual:
        apply = _prompted(apply)
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    use_cache = config is not None and hasattr(config, "use_cache")
    # a sample's positions from its own mask: a model left to count positions from 0 would place a
    # left-padded sample's tokens by the batch's padded length, i.e. by the other samples' lengths
    # (GPT-2 / BERT learned positions; found by review: adding a long sample moved the others'
    # clipped sum by 2.07 C)
    # (causal models only: an encoder's positions may start elsewhere, RoBERTa's at padding_idx + 1, and
    # its padding goes on the right, where positions from 0 are the model's own)
    positions = bool(causal) and "position_ids" in inspect.signature(_base_model(model).forward).parameters
    sdpa = getattr(config, "_attn_implementation", None) == "sdpa"
    if getattr(config, "model_type", None) == "bloom":
        raise ValueError(
            f"{call}: {type(_base_model(model)).__name__} cannot run under vmap: its GELU is an autograd.Function "
            "without setup_context (torch.func refuses it), and it derives ALiBi biases from the 2-D attention_mask, "
            "which the adapter replaces by each sample's 4-D mask. Not supported; use a model with rotary or learned "
            "positions (Llama, Qwen2, GPT-2, OPT), or Falcon/MPT (ALiBi) on batches without padding."
        )
    # ALiBi biases from the 2-D mask (MPT, Falcon with alibi=True): not from a 4-D one
    alibi = getattr(config, "model_type", None) == "mpt" or getattr(config, "alibi", False) is True
    # a decoder classifier pools its last token that is not config.pad_token_id (the last position
    # where that is None), whatever the attention_mask says: a right-padded sample's padding,
    # whatever ids it holds, would be read (found by review: the loss moved with the padding's ids)
    pooled_pad = prompt_task == "classification" and bool(causal)
    # the forward's named inputs: transformers' forwards take **kwargs too, which would swallow a
    # misspelt key (an "atention_mask" ignored, the padding attended to; found by review)
    named = inspect.signature(_base_model(model).forward).parameters
    accepted = {k for k, v in named.items() if v.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}

    def loss(params: Mapping, buffers: Mapping, sample: Mapping) -> Tensor:
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"vmapdp.hf loss_fn(params, buffers, sample): sample must be a dict of one sample's tensors "
                f"(input_ids, attention_mask, labels, ...), got {type(sample).__name__}."
            )
        stray = sorted(k for k in sample if k not in accepted and k not in ("labels", "label"))
        if stray:
            raise ValueError(
                f"vmapdp.hf loss_fn(params, buffers, sample): the sample's keys {stray} are not inputs of "
                f"{type(_base_model(model)).__name__}.forward, which would take them into its **kwargs and ignore them "
                f"(a misspelt attention_mask leaves the padding attended to). Its inputs: {sorted(accepted)}; the labels go "
                "in 'labels'. Rename or drop those keys."
            )
        mask = given_mask = sample.get("attention_mask")
        rolled = None
        if mask is not None and mask.dim() == 1:
            sample, rolled = _padding_last(sample, mask, token_labels=criterion is None and task != "classification")
        if virtual:
            sample = _with_prompt(sample, virtual, task)
        key = _label_key(sample) if task in ("classification", "token_classification") or "labels" in sample or "label" in sample else None
        inputs = {k: v[None] for k, v in sample.items() if k != key}
        mask = sample.get("attention_mask")
        if mask is None and not alibi and "input_ids" in sample and "mamba" not in str(getattr(config, "model_type", "")):
            # without a mask transformers' classifier checks the ids for padding, and its mask builder runs, with
            # data-dependent code that vmap refuses (found by review: a decoder classifier; then GPT-2 and BERT, whose
            # error blamed the user's loss): an equal-length sample is all real tokens, which a ones mask says (not for
            # the attention-free Mamba family, which multiplies its states by a 2-D mask the adapter's 4-D one would break)
            mask = torch.ones_like(sample["input_ids"])
        if mask is not None and mask.dim() == 1:
            if causal is None:
                raise ValueError(
                    f"{call}: the sample has a 2-D attention_mask but the model takes no input_ids, so whether its "
                    "attention is causal could not be probed. Pass causal=True or causal=False."
                )
            if alibi:
                raise ValueError(
                    f"{call}: {type(_base_model(model)).__name__} derives its ALiBi position biases from the 2-D "
                    "attention_mask, which the adapter replaces by each sample's 4-D mask (transformers' own mask "
                    "builder cannot run under vmap). Not supported with padding: use batches without attention_mask "
                    "(equal lengths), or a model with rotary or learned positions."
                )
            t = mask.shape[0]
            # (encoders too: ModernBERT's local attention, found by review; and Llama 4's chunked attention)
            for name, span, kind in (("sliding_window", window, "a sliding window"), ("attention_chunk_size", chunk, "chunked attention")):
                if isinstance(span, int) and not isinstance(span, bool) and t > span:
                    raise ValueError(
                        f"{call}: sequences of length {t} exceed config.{name}={span}; the adapter's mask is a full "
                        f"{'causal' if causal else 'bidirectional'} one, not {kind}. Use sequences of at most that length."
                    )
            inputs["attention_mask"] = additive_mask(mask, causal=causal, dtype=_float_dtype(params, buffers))
            if pooled_pad and "input_ids" not in sample:
                raise ValueError(
                    f"{call}: {type(_base_model(model)).__name__} given inputs_embeds classifies the last position, which a "
                    "right-padded sample's attention_mask marks as padding (it finds the last real token from input_ids "
                    "only). Pass input_ids (the adapter writes the pad id into the padding), or batches without padding."
                )
            if pooled_pad:
                pad = getattr(config, "pad_token_id", None)
                if pad is None:
                    raise ValueError(
                        f"{call}: {type(_base_model(model)).__name__} classifies the last token that is not "
                        "config.pad_token_id, and with pad_token_id None the last position, which a right-padded "
                        "sample's attention_mask marks as padding. Set model.config.pad_token_id (the tokenizer's "
                        "pad_token_id; GPT-2's tokenizer has none: its eos id is the usual choice)."
                    )
                # (the padding's ids made the pad id: the pooled token is the sample's last real one)
                inputs["input_ids"] = torch.where(mask != 0, sample["input_ids"], pad)[None]
            if positions and "position_ids" not in sample:
                inputs["position_ids"] = ((mask != 0).long().cumsum(0) - 1).clamp(min=0)[None]
        if use_cache:
            inputs["use_cache"] = False
        if sdpa:
            # the math kernel (what "eager" attention computes), which vmap batches: vmap of CUDA's
            # memory-efficient attention fails in its backward ("LSE is not correctly aligned", torch
            # 2.11 on an H200), and the CPU's flash kernel has no batching rule (torch runs it one
            # sample at a time, with a "performance drop" warning each call; slower by 10-15% on tiny models)
            with sdpa_kernel(SDPBackend.MATH):
                out = apply(params, buffers, **inputs)
        else:
            out = apply(params, buffers, **inputs)
        logits = _logits(out)
        if criterion is not None:
            if rolled is not None and logits.dim() >= 3 and logits.shape[1] == rolled.shape[0]:
                # (per-token logits back in the batch's positions, where the criterion's labels are; zero at the
                # padding, whose rolled positions come after the sample and saw all of it: a criterion shifting the
                # labels itself would predict the first real token from a padding position that saw it; found by review)
                real = (given_mask != 0).reshape((1, -1) + (1,) * (logits.dim() - 2))
                logits = torch.where(real, logits.index_select(1, torch.argsort(rolled)), 0.0)
            return criterion(logits, sample[_label_key(sample)][None])
        if task in ("causal_lm", "token_classification"):
            labels = sample[key] if key is not None else sample["input_ids"]
            if mask is not None and mask.dim() == 1:
                labels = torch.where(mask != 0, labels, _IGNORE)
            if task == "causal_lm":  # the next token, predicted from a real one (left padding: not from the last pad)
                if virtual:  # predicted from the last real position before it: a left-padded sample's first
                    # token from the prompt's last virtual one across the padding, as without the padding
                    target = labels[1:]
                    index = torch.arange(mask.shape[0], device=mask.device)
                    src = torch.cummax(torch.where(mask != 0, index, -1), 0).values[:-1]
                    pred = logits.squeeze(0).index_select(0, src.clamp(min=0))
                    valid = (target != _IGNORE) & (src >= 0)
                else:
                    # the targets shifted (the last position predicts nothing), not the logits: a slice
                    # or a select of the logits would cost a copy of their size in the backward (785 MB
                    # each for GPT-2 small at 32 x 128), a squeeze costs none
                    target = torch.cat([labels[1:], labels.new_full((1,), _IGNORE)])
                    pred = logits.squeeze(0)
                    valid = target != _IGNORE
                    if mask is not None and mask.dim() == 1:
                        valid = valid & (mask != 0)
            else:  # each position's own label
                target, pred = labels, logits.squeeze(0)
                valid = target != _IGNORE
            per_token = F.cross_entropy(pred.float() if pred.dtype in (torch.float16, torch.bfloat16) else pred,
                                        torch.where(valid, target, 0), reduction="none")
            count = valid.sum().clamp(min=1)
            return torch.where(valid, per_token, 0.0).sum() / count  # (not a product: a position predicting nothing adds 0 even where its logits are not finite)
        y = sample[key]
        if regression:
            return F.mse_loss(logits.reshape(-1), y.reshape(-1).to(logits.dtype))
        if multi_label or (problem is None and y.is_floating_point()):
            if y.numel() != logits.numel():
                raise ValueError(
                    f"vmapdp.hf loss_fn(params, buffers, sample): multi-label classification takes one float label per "
                    f"output ({logits.numel()}), got labels of shape {tuple(y.shape)}. Give each sample a multi-hot vector."
                )
            # (the mean over the labels of their binary cross-entropies, transformers' BCEWithLogitsLoss per sample)
            return F.binary_cross_entropy_with_logits(logits.reshape(-1), y.reshape(-1).to(logits.dtype))
        return F.cross_entropy(logits.reshape(1, -1), y.reshape(1))

    return loss


# a sample's inputs indexed by token, which _padding_last moves with the tokens (the labels only where they are per token)
_PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


def _padding_last(sample: Mapping, mask: Tensor, *, token_labels: bool) -> tuple[dict, Tensor]:
    """ONE sample with its leading padding moved to its end (a left-padded sample made
    right-padded; a right-padded one unchanged), and the order of positions used. A left-padded
    sample's real tokens would sit at positions set by the batch's longest sample, i.e. by the
    other rows: a model counting positions from 0 (BERT's and BART's learned positions, any model
    taking no ``position_ids``) would compute another loss for the same sample in another batch
    (found by review: one long row added to a batch of left-padded rows moved the clipped sum by
    4.23 C on BartForCausalLM; a BERT classifier's loss moved with its padding). Zeros inside
    the mask stay where they are. With tensor ops only (vmap, compile)."""
    t = mask.shape[0]
    first = torch.argmax((mask != 0).to(torch.int64))  # the first real position (0 where none)
    order = (torch.arange(t, device=mask.device) + first) % t
    keys = _PER_TOKEN + (("labels", "label") if token_labels else ())
    out = {k: v.index_select(0, order) if k in keys and isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == t else v for k, v in sample.items()}
    return out, order


def _with_prompt(sample: Mapping, virtual: int, task: str) -> dict:
    """ONE sample as the prompted model sees it: ``virtual`` real positions in front of its mask and
    (causal LM) labels that ignore them; ``token_type_ids`` get zeros in front, as peft's own forward
    gives a classifier."""
    call = "vmapdp.hf loss_fn(params, buffers, sample)"
    if "input_ids" not in sample:
        raise KeyError(f"{call}: a peft prompt-tuning model needs input_ids (its prompt goes in front of their embeddings); the sample has keys {sorted(sample)}.")
    if "position_ids" in sample or (task == "causal_lm" and "token_type_ids" in sample):
        bad = "position_ids" if "position_ids" in sample else "token_type_ids"
        raise ValueError(
            f"{call}: {bad} with a peft prompt-tuning model: peft's own forward ignores them (with a warning); the adapter "
            f"does not drop an input silently. Leave {bad} out of the batch."
        )
    ids = sample["input_ids"]
    out = dict(sample)
    ones = torch.ones(virtual, dtype=torch.long, device=ids.device)
    mask = sample.get("attention_mask")
    out["attention_mask"] = torch.cat((ones, torch.ones_like(ids) if mask is None else mask.to(torch.long)))
    if task == "causal_lm":
        labels = sample[_label_key(sample)] if ("labels" in sample or "label" in sample) else ids
        out.pop("label", None)
        out["labels"] = torch.cat((torch.full((virtual,), _IGNORE, dtype=labels.dtype, device=ids.device), labels))
    if "token_type_ids" in sample:
        out["token_type_ids"] = torch.cat((torch.zeros_like(ones), sample["token_type_ids"].to(torch.long)))
    return out


def loss_fn(model: nn.Module, *, task: Optional[str] = None, causal: Optional[bool] = None):
    """``(apply, params, buffers, loss_fn)`` for a transformers (or peft) model.

    Args:
      model: a transformers ``PreTrainedModel`` (or a ``peft`` model over one); not modified.
      task: ``"causal_lm"``, ``"classification"`` or ``"token_classification"``; by default from the class name.
      causal: whether attention is causal; by default probed once (position 0 must not see position 1).

    Returns:
      ``apply, params, buffers`` as from :func:`vmapdp.functionalize` (only trainable parameters in
      ``params``: the adapters of a LoRA/peft model), and ``loss_fn(params, buffers, sample)`` for ONE
      sample given as a dict of its tensors (no batch dim): the keys of a tokenizer's output plus
      ``labels``. A 2-D padding ``attention_mask`` is turned into a 4-D additive mask per sample
      (vmap-safe); padding never counts in the loss.

    Raises:
      ImportError: transformers is not installed (``pip install vmapdp[hf]``).
      ValueError: the task cannot be told from the model (pass ``task=``).
    """
    call = "vmapdp.hf.loss_fn(model)"
    _require_transformers(call)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model must be a transformers model (an nn.Module), got {type(model).__name__}.")
    apply, params, buffers = functionalize(model)
    return apply, params, buffers, sample_loss(model, apply, task=task, causal=causal)


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        logits = out[0]
    if not isinstance(logits, Tensor):
        raise TypeError(f"vmapdp.hf loss_fn: the model returned {type(out).__name__} without .logits; the loss needs the logits.")
    return logits
