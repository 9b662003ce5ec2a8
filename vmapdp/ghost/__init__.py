"""Ghost clipping: exact per-sample gradient norms and the clipped sum, without per-sample gradients.

DP-SGD needs each sample's gradient *norm* and the *clipped sum*, never the per-sample gradients
themselves. For a layer ``y = x W^T`` a sample's weight gradient is ``G_i = sum_t g_t x_t^T`` (``t``
runs over the positions of a sequence or the pixels of a feature map, ``g = dL/dy``), so

* its norm follows from the layer's inputs and output gradients alone:
  ``||G_i||^2 = sum_{t,s} (x_t . x_s)(g_t . g_s)`` (the "ghost norm"; Goodfellow 2015, Li et al.
  2022), or ``||g^T x||^2`` formed directly when that is cheaper (Bu et al. 2023, "mixed ghost
  clipping": chosen per layer by cost);
* the clipped sum ``sum_i c_i G_i = (c * g)^T x`` is one matmul over the whole batch, the same
  cost as the weight gradient of an ordinary backward ("book-keeping", Bu et al. 2023).

How vmapdp gets ``x`` and ``g`` for a *functional* model, without hooks: the loss is run once,
mapped over the batch with ``vmap``, under a ``TorchFunctionMode`` that watches the calls made
with the trainable params. At a covered op (``F.linear``, ``conv1d/2d/3d``, ``conv_transpose1d/2d/3d``, ``F.embedding`` (and ``F.embedding_bag`` of 2-D bags, run as one),
``torch.addmm``, ``matmul`` / ``@`` / ``mm`` with a 2-D param, ``bmm`` / batched ``matmul`` with a
``[*G, m, n]`` param, two-operand ``einsum`` with a param of any rank (``"btd,dhk->bthk"``), the
affines of ``layer_norm`` / ``group_norm`` / ``rms_norm`` (and of ``batch_norm`` / ``instance_norm``, run as ``mul`` and ``add``), ``x * w`` and ``x + w``, ``torch.cat``)
whose weight is a param, or a view of one (a box: ``chunk``, ``split``, ``narrow``, slices,
``unbind``, ``W.t()`` / ``W.T`` / ``transpose``, reshapes; or a box broadcast by ``expand`` /
``broadcast_to`` / ``repeat``, whose per-sample grad is the view's summed over the repeated dims;
views.py),
it keeps the op's input and adds a *tap*, a zero tensor that is an input of the
computation, to its output; one ``vjp`` of the summed loss then returns each tap's gradient, which
is the per-sample output gradient ``g``. The weight gradients themselves are never computed by
autograd. Convolutions go through unfolded patches; embeddings through token equality (never a
vocabulary-sized tensor per sample); a matmul with a 2-D param is a linear with the weight
possibly transposed; a batched param is a pair per matrix; the disjoint views of one param (the
q, k, v blocks of ``nn.MultiheadAttention``'s packed in-projection) add their norms in squares;
the elementwise affines form their small per-sample grads (``[B, C]``)
directly, and norm and sum then share the same numbers (no margin, no cross-sample sum).

``nn.MultiheadAttention``'s ``F.multi_head_attention_forward`` is traced through (its ops are seen
one by one: ``plan.TRACED_THROUGH``). Parameters that no rule covers (an einsum with a trace or a
diagonal, a strided slice, a tile within a dim;
``Plan.describe`` names them) are routed, for just those uses, through a per-sample copy (``p.expand(B, ...)``, a
view): the same ``vjp`` returns their per-sample gradients, whose norms join the total. A param
with both kinds of uses gets the exact sum of both. A param used by two covered ops of different
kinds (GPT-2's token embedding tied to its LM head) gets its norm from each use's own terms and
their cross terms (cross.py), without per-sample grads. The result is exact: norms and clipped sums
equal the per-sample-gradient engine's up to float rounding, for any model.

Floating point: a sample's norm and its share of the clipped sum come from two different
computations, so their rounding differs; an adversarial sample can make the terms of a ghost
Gram sum cancel (a large component shared by all positions, output grads of alternating sign).
Gram sums are therefore taken in float64 (of float32 factors only: a float64 model's factors
take the direct outer product, ``uses.float64_factors``, since output grads near 1e-162 square to
0 while their products with inputs near 1e154 do not), and the clip factor uses the norm plus a margin that
bounds the rounding of both computations (``~ T eps sum_t |u_t||v_t|``, ``eps`` that of the
dtype the clipped sum is accumulated in; see ``uses.rounding_margin``): the released contribution
stays within ``C``. The returned ``norms`` are the computed norms, without the margin.

The margin bounds a sample's *own* contribution; the guarantee DP needs is on the neighbour
difference, ``||sum(D) - sum(D - {i})|| <= C (1 + tol)``. A book-keeping matmul adds the terms of
all samples in one accumulation, and in float32 a sample with huge cancelling terms (within its
margin) quantises the partial sums of the others (a neighbour difference above C). So every
book-keeping sum of a float32 model is accumulated in float64, where that cross-talk is
``<= ~B**2 2**-30 C`` (see ``engine._sum_dtype``); one-term uses (an MLP's layers) too, since a
float32 weighted side underflows (absolute rounding) when the sample's values are subnormal. The cross-talk
bound needs each sample's mass bounded, ``w_i M_i <= C / (2 (T + 2) eps32)``: the float32 margin
is kept as a floor of the safe norm (``engine._floor``), which only samples whose terms cancel
reach; benign samples get the float64 margin, so the clipped sum of long sequences stays accurate
(relative error ~4e-7 against float64 at T = 8 to 512, where the float32 margin gave 2e-6 to 1.4e-3). ``tol`` is then
that of ``clip_and_sum``'s float32 sum (``~ 2 B**2 eps`` worst case; < 1e-4 at B = 8 in
tests/test_sensitivity.py). The cost is float64 conv backwards for wide convs and float64
book-keeping matmuls (figures in ``engine._sum_dtype`` and benchmarks/README.md).

Small convs get their per-sample norms from one grouped conv backward; per-sample grads formed
on the way to a norm are then kept (up to ``Limits.keep_elements`` floats in all, or when no larger
than the layer inputs and output grads they replace) and the clipped sum is a weighted sum of
them, which is both faster than another conv backward or matmul and consistent by construction.

Everything here is a pure function of tensors and runs under ``torch.compile(fullgraph=True)``
(the first call for an input shape runs a one-sample probe eagerly: ``fn.prepare(*args)``, which
``make_train_step`` calls outside the compiled region).
Data-dependent control flow that changes which ops see the params between the first call for a
shape and later calls is refused with an error.

The package, a file a job: ``plan.py`` (the tracer: ``Mode``, ``Run``, the probe and its
``Plan``), ``uses.py`` (``Use``, ``UseKind``, ``Site``, ``Rule`` and the rounding margin),
``rules.py`` (``RULES``, the one table of covered ops) with a file per rule (``linear.py``,
``conv.py``, ``embedding.py``, ``matmul.py``, ``affine.py``), ``views.py`` (views of params as
weights), ``cross.py`` (cross terms between uses of different kinds), ``engine.py`` (``ghost_norms_and_sum``) and ``limits.py`` (the
tuning limits). The dispatcher over vmap, ghost and two_pass, ``clipped_grad_sum``, is
:mod:`vmapdp.clipped` (re-exported here).
"""

from __future__ import annotations

from typing import Any

from vmapdp.ghost.engine import ghost_norms_and_sum
from vmapdp.ghost.limits import LIMITS, Limits
from vmapdp.ghost.plan import Plan, coverage, probe
from vmapdp.ghost.rules import RULES

__all__ = ["clipped_grad_sum", "ghost_norms_and_sum", "coverage", "probe", "Plan", "RULES", "Limits", "LIMITS", "METHODS"]

_FROM_CLIPPED = ("clipped_grad_sum", "METHODS")


def __getattr__(name: str) -> Any:
    """``clipped_grad_sum`` and ``METHODS``, which moved to :mod:`vmapdp.clipped`, re-exported on
    first use (vmapdp.clipped imports this package, so an eager import here would be circular)."""
    if name in _FROM_CLIPPED:
        from vmapdp import clipped

        return getattr(clipped, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
