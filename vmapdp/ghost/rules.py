"""The ops ghost clipping covers, each with its rule: the one table the tracer (plan.py) consults.

A call of one of these ops whose weight is a trainable param becomes a *site*: its input is kept
and a tap added to its output. Any other use of a param goes through a per-sample copy (exact,
slower). To cover a new op, write its ``Rule`` (and ``UseKind`` if its maths are new) in one file
and list it here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vmapdp.ghost.affine import ADD, CAT, GROUP_NORM, LAYER_NORM, MUL, RMS_NORM
from vmapdp.ghost.conv import CONV_RULES
from vmapdp.ghost.embedding import EMBEDDING_RULE
from vmapdp.ghost.linear import LINEAR
from vmapdp.ghost.matmul import ADDMM, EINSUM, MATMUL

__all__ = ["RULES"]

RULES = {
    F.linear: LINEAR,
    **CONV_RULES,
    F.embedding: EMBEDDING_RULE,
    # matmul.py: a 2-D param times an activation (GPT-2's Conv1D is addmm; `x @ W` is Tensor.matmul)
    torch.addmm: ADDMM,
    torch.matmul: MATMUL,
    Tensor.matmul: MATMUL,
    Tensor.__matmul__: MATMUL,
    torch.mm: MATMUL,
    Tensor.mm: MATMUL,
    torch.bmm: MATMUL,
    Tensor.bmm: MATMUL,
    torch.einsum: EINSUM,
    # affine.py: elementwise affines, their per-sample grads formed directly
    F.layer_norm: LAYER_NORM,
    F.group_norm: GROUP_NORM,
    torch.rms_norm: RMS_NORM,  # (F.rms_norm is traced through to it: plan.TRACED_THROUGH)
    torch.mul: MUL,
    Tensor.mul: MUL,
    Tensor.__mul__: MUL,
    torch.add: ADD,
    Tensor.add: ADD,
    Tensor.__add__: ADD,
    Tensor.__radd__: ADD,
    # a param (or a view of one) concatenated to activations: its slice of the output grad
    torch.cat: CAT,
    torch.concat: CAT,
}
