"""Crafted version of t1_crosstalk.py: the target's coordinates are chosen, from the attackers'
float32 partial sums S (read in a run without the target), so that fl(S + c) rounds up by ~half
an ulp of S in every coordinate. The neighbour difference is then deterministic.

Model: W [V, D] tied; loss = <emb(tok, W), z> + <linear(x, W), y>; per-sample grad e_tok z^T + y x^T.
Attackers (rows 0..B-2): y = a e_0, x = unit, z = -a x + r  (embedding and pair grads cancel).
Target (row B-1, last in the index_add): tok 0, z = c (norm < C), x = y = 0.
"""
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

import vmapdp
from vmapdp.ghost import engine, limits
from vmapdp.ghost.embedding import EMBEDDING

V = int(sys.argv[1]) if len(sys.argv) > 1 else 3
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
PRECISION = sys.argv[3] if len(sys.argv) > 3 else "float32"
D = int(sys.argv[4]) if len(sys.argv) > 4 else 16
A = float(sys.argv[5]) if len(sys.argv) > 5 else 1e6
C = 1.0
if V * D * B <= limits.LIMITS.keep_elements:  # emulate a vocabulary-sized table: nothing kept
    limits.LIMITS = replace(limits.LIMITS, keep_elements=0, keep_ratio=0.0)


def loss(p, sample):
    tok, z, x, y = sample
    return (F.embedding(tok, p["w"]) * z).sum() + (F.linear(x, p["w"]) * y).sum()


if PRECISION == "bfloat16":
    loss = vmapdp.mixed_precision(loss, torch.bfloat16)

g = torch.Generator().manual_seed(0)
tok = torch.zeros(B, 1, dtype=torch.int64)
z, x, y = torch.zeros(B, 1, D), torch.zeros(B, 1, D), torch.zeros(B, 1, V)
unit = torch.ones(D) / D**0.5
for j in range(B - 1):
    y[j, 0, 0] = A * (1 + 0.01 * torch.rand((), generator=g))
    x[j, 0] = unit
    z[j, 0] = -y[j, 0, 0] * unit + 0.01 * torch.randn(D, generator=g)
if PRECISION == "bfloat16":  # the values the bf16 model sees
    z, x, y = z.bfloat16().float(), x.bfloat16().float(), y.bfloat16().float()

emb_sums = []
orig = engine._weighted


def spy(use, w, keep, dtype=None):
    out = orig(use, w, keep, dtype)
    if use.kind is EMBEDDING:
        emb_sums.append(out.clone())
    return out


engine._weighted = spy
fn = vmapdp.clipped_grad_sum(loss, l2_clip_norm=C, method="ghost")
params = {"w": torch.zeros(V, D)}
without = torch.ones(B, dtype=torch.bool)
without[B - 1] = False
minus, norms, _ = fn(params, (tok, z, x, y), mask=without)
s = emb_sums[-1][0].double()  # the attackers' float32 partial sums at W[0]
ulp = torch.tensor([float(torch.finfo(torch.float32).eps) * 2.0 ** torch.frexp(v.abs()).exponent.item() / 2 for v in s.float()], dtype=torch.float64)
# c_k = (m_k + 0.52) ulp_k: fl(S_k + c_k) rounds c_k up by 0.48 ulp_k. The m_k: the largest that
# keep ||c|| <= 1 - 1e-5 (coordinates filled one by one; the last takes what is left)
budget = (1.0 - 1e-5) ** 2
c = torch.zeros(D, dtype=torch.float64)
for k in range(D):
    want = (budget / (D - k)) ** 0.5
    c[k] = (torch.floor(want / ulp[k] - 0.52) + 0.52) * ulp[k]
    budget -= float(c[k]) ** 2
c = c * torch.sign(s)  # (same sign as S: the same ulp grid)
print(f"attackers' partial sums at W[0] ~ {s.abs().mean():.1f}, ulp {ulp.mean():.3g}; target norm {float(c.norm()):.7f}")
zt = z.clone()
zt[B - 1, 0] = c.float()
if PRECISION == "bfloat16":
    print("(bfloat16: the target's values are rounded to bf16 by the model; crafting is approximate)")
full, norms_full, _ = fn(params, (tok, zt, x, y))
minus, _, _ = fn(params, (tok, zt, x, y), mask=without)
diff = float((full["w"].double() - minus["w"].double()).norm()) / C
print(f"V={V} D={D} B={B} {PRECISION}: target norm {float(norms_full[B-1]):.7f}; ||sum(D) - sum(D - target)|| = {diff:.7f} C  (claimed <= 1 + 1e-4)")
print(f"attacker computed norms {[round(float(n), 3) for n in norms_full[:B-1]]}, true norms ~{float((0.01*torch.ones(D)).norm()):.3f}")
