"""Same root cause beyond the tie (pre-existing, not from bc5d866): a [D] param used by an
elementwise affine (x * b: a "direct" use) and as a linear's bias with one position (a pair use,
T=1). Both uses have t == 1, so engine._sum_dtype keeps the sum in float32; the two uses' grads
cancel, the direct use's mass is 0 and the pair's margin is 6 eps32 M, so w*M reaches ~1e5 C."""
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import vmapdp
from vmapdp.ghost import limits

B, D, TRIALS = int(sys.argv[1]) if len(sys.argv) > 1 else 8, 16, int(sys.argv[2]) if len(sys.argv) > 2 else 20
C = 1.0
limits.LIMITS = replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0)  # (what a large param gets)


def loss(p, sample):
    x, z1, h, z2 = sample
    return (x * p["b"] * z1).sum() + (F.linear(h, p["w"], p["b"]) * z2).sum()


g = torch.Generator().manual_seed(0)
x, z1, h, z2 = torch.ones(B, D), torch.zeros(B, D), torch.zeros(B, D), torch.zeros(B, D)
unit = torch.ones(D) / D**0.5
for j in range(B - 1):  # attackers: b's grad x*z1 + z2 = r, with |x*z1| = |z2| ~ 1e6
    a = 1e6 * (1 + 0.01 * float(torch.rand((), generator=g)))
    z1[j] = a * unit
    z2[j] = -a * unit + 0.01 * torch.randn(D, generator=g)
fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
params = {"b": torch.zeros(D), "w": torch.zeros(D, D)}
without = torch.ones(B, dtype=torch.bool)
without[B - 1] = False
worst = 0.0
for trial in range(TRIALS):
    z2t = z2.clone()
    z2t[B - 1] = 1.5 * (unit + 0.05 * torch.randn(D, generator=g))  # target: a clipped bias grad
    full, norms, _ = fn(params, (x, z1, h, z2t))
    minus, _, _ = fn(params, (x, z1, h, z2t), mask=without)
    diff = float((full["b"].double() - minus["b"].double()).norm()) / C
    worst = max(worst, diff)
print(f"direct + pair, B={B}: worst ||sum(D) - sum(D - target)|| over {TRIALS} targets = {worst:.7f} C (claimed <= 1 + 1e-4); attacker norms {norms[:3].tolist()}")
