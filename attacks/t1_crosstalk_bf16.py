"""bfloat16 (vmapdp.mixed_precision) version of the T=1 tied-table attack: the target's grads are
bf16 values (on the partial sums' float32 grid), so it is made to be clipped (norm 1.5 C): its
released share w*c then has arbitrary float32 low bits, and a search over target directions finds
ones that round up. Same model and attackers as t1_crosstalk_crafted.py."""
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import vmapdp
from vmapdp.ghost import limits

V, B, D, TRIALS = 3, int(sys.argv[1]) if len(sys.argv) > 1 else 32, 16, int(sys.argv[2]) if len(sys.argv) > 2 else 30
C = 1.0
limits.LIMITS = replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0)  # a vocabulary-sized table keeps nothing


def loss(p, sample):
    tok, z, x, y = sample
    return (F.embedding(tok, p["w"]) * z).sum() + (F.linear(x, p["w"]) * y).sum()


loss = vmapdp.mixed_precision(loss, torch.bfloat16)
g = torch.Generator().manual_seed(0)
tok = torch.zeros(B, 1, dtype=torch.int64)
z, x, y = torch.zeros(B, 1, D), torch.zeros(B, 1, D), torch.zeros(B, 1, V)
unit = torch.ones(D) / D**0.5
for j in range(B - 1):
    y[j, 0, 0] = 1e6 * (1 + 0.01 * torch.rand((), generator=g))
    x[j, 0] = unit
    z[j, 0] = -y[j, 0, 0] * unit + 0.01 * torch.randn(D, generator=g)
fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
params = {"w": torch.zeros(V, D)}
without = torch.ones(B, dtype=torch.bool)
without[B - 1] = False
worst = 0.0
for trial in range(TRIALS):
    zt = z.clone()
    zt[B - 1, 0] = 1.5 * (0.25 + 0.01 * torch.randn(D, generator=g))  # (clipped: w ~ 0.67)
    full, norms, _ = fn(params, (tok, zt, x, y))
    minus, _, _ = fn(params, (tok, zt, x, y), mask=without)
    diff = float((full["w"].double() - minus["w"].double()).norm()) / C
    worst = max(worst, diff)
print(f"bfloat16 B={B}: worst ||sum(D) - sum(D - target)|| over {TRIALS} targets = {worst:.7f} C (claimed <= 1 + 1e-4)")
