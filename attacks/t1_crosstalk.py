"""Attack: a tied table used once as an embedding (T=1) and once as a linear weight (S=1).

Both uses have one term per sample, so engine._sum_dtype keeps the book-keeping sum in float32
(its premise: "with T = 1 ... a term is the sample's whole grad, nothing can cancel"). But the
embedding use's grad and the pair use's grad of one sample can cancel each other: the crossed
norm is ~0, the masses are huge. The safe bound is then ~ sqrt(24 eps32) * M, so the clip factor
lets w*M reach ~590 C, and each attacker's huge +/- parts sit in the float32 emb-sum and pair-sum.
The target sample's contribution is quantised at ulp(k * 590 C).

Per-sample grad of W: e_tok z^T + y x^T.   loss = <emb(tok, W), z> + <linear(x, W), y>.
"""
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import vmapdp
from vmapdp.ghost import limits

V = int(sys.argv[1]) if len(sys.argv) > 1 else 3
D = int(sys.argv[5]) if len(sys.argv) > 5 else 16
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
C = 1.0
PRECISION = sys.argv[3] if len(sys.argv) > 3 else "float32"
if V * D * B <= limits.LIMITS.keep_elements:  # emulate a vocabulary-sized table: nothing kept
    limits.LIMITS = replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0)


def loss(p, sample):
    tok, z, x, y = sample
    return (F.embedding(tok, p["w"]) * z).sum() + (F.linear(x, p["w"]) * y).sum()


if PRECISION == "bfloat16":
    loss = vmapdp.mixed_precision(loss, torch.bfloat16)


def batch(seed, a=1e6):
    g = torch.Generator().manual_seed(seed)
    tok = torch.zeros(B, 1, dtype=torch.int64)
    z = torch.zeros(B, 1, D)
    x = torch.zeros(B, 1, D)
    y = torch.zeros(B, 1, V)
    for j in range(1, B):  # attackers: y = a e_0, x = e_0 (+noise), z = -a x + r
        xj = torch.ones(D) / D**0.5  # every coordinate of W[0] gets the same huge partial sums
        y[j, 0, 0] = a * (1 + 0.01 * torch.rand((), generator=g))
        x[j, 0] = xj
        z[j, 0] = -y[j, 0, 0] * xj + 0.01 * torch.randn(D, generator=g)
    # target (row 0): an embedding grad of norm just under C spread evenly over W[0]: each
    # coordinate is quantised the same way (up or down by up to half an ulp of the partial sum)
    z[0, 0] = (1.0 - 1e-6) / D**0.5 - 2.0**-13 * float(torch.rand((), generator=g))
    return tok, z, x, y


fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
params = {"w": torch.zeros(V, D)}
worst = 0.0
for seed in range(int(sys.argv[4]) if len(sys.argv) > 4 else 20):
    bt = batch(seed)
    full, norms, _ = fn(params, bt)
    mask = torch.ones(B, dtype=torch.bool)
    mask[0] = False
    minus, _, _ = fn(params, bt, mask=mask)
    diff = float((full["w"].double() - minus["w"].double()).norm()) / C
    worst = max(worst, diff)
    print(f"seed {seed}: ||sum(D) - sum(D - target)|| / C = {diff:.7f}   (attacker norms {norms[1:3].tolist()})")
print(f"V={V} B={B} {PRECISION}: worst {worst:.7f} C   (claimed <= 1 + 1e-4)")
