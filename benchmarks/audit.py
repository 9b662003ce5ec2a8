"""White-box privacy audit of the DP-SGD step: empirical epsilon lower bound vs the claimed epsilon.

Usage (from the repository root)::

    python benchmarks/audit.py                 # full size (~3 min on one CPU thread)
    python benchmarks/audit.py --quick         # 10x fewer trials
    python benchmarks/audit.py --threads 0     # leave torch's thread count alone (default: 1)

``vmapdp.audit.audit_epsilon_lower_bound`` runs the real step (built by ``make_train_step``, or by
a mutant builder with one deliberate bug) many times with and without a canary whose gradient is
1000 x l2_clip_norm, thresholds the released parameter on half the trials and bounds the
false-positive/negative rates of the held-out half with Clopper-Pearson (confidence 95%). The
step is correct only if the lower bound stays below the epsilon its ledger claims (PLD accountant,
one full-batch step). Rows:

* ``reference``: noise_multiplier 2, delta 1e-5, 10^6 trials per world (the issue's setting; its
  numpy simulation reported 1.40-1.60 for a correct step, 2.15-2.31 for noise x 1/sqrt(2), ~9-10
  without clipping, against a claim of 1.99).
* ``sharp``: noise_multiplier 1, delta 1e-2, 10^5 trials per world. At delta 1e-5 the claim is
  decided by false-positive rates near 1e-5, which 10^6 trials barely resolve; at delta 1e-2 it is
  decided near 1e-2, so far fewer trials separate a correct step from noise off by sqrt(2).
* ``literal``: the ``sharp`` setting with ``coordinates=1`` -- literally a one-parameter model,
  one trial per step -- at 10^4 trials, to show the batched trials (one per coordinate of ``w``)
  measure the same mechanism.

"true eps" is the exact epsilon of the mechanism the mutant really runs (PLD at its real noise),
the ceiling any audit can reach.
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import time

import torch

import vmapdp
from vmapdp import accounting
from vmapdp.accounting import PoissonGaussianEvent
from vmapdp.audit import audit_epsilon_lower_bound
from vmapdp.clipping import clip_and_sum
from vmapdp.noise import add_noise
from vmapdp.per_sample import per_sample_grads
from vmapdp.train import _step_key, noise_binding, step_config


def mutant_train_step(loss_fn, optimizer, *, l2_clip_norm, noise_multiplier, expected_batch_size, sample_rate, compile=False, noise_scale=1.0, clip=True):
    """vmapdp's step composition re-implemented with one bug: noise x noise_scale, or no clipping.

    The ledger still records noise_multiplier (what the buggy code claims)."""
    del compile
    grads_fn = per_sample_grads(loss_fn)
    event = PoissonGaussianEvent(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def step(state, batch, mask, *shared):
        grads = grads_fn(state.params, *shared, batch, mask=mask)
        summed, _ = clip_and_sum(grads, l2_clip_norm if clip else math.inf, mask=mask)
        # vmapdp's own noise key (a keyed ChaCha20 stream bound to the run and the configuration)
        config = step_config(l2_clip_norm=l2_clip_norm, noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                             sample_rate=sample_rate, method="vmap", optimizer=optimizer.config)
        key = _step_key(state.noise_seed, state.step, noise_binding(state.run_id, config))
        noisy = add_noise(summed, noise_scale * noise_multiplier * l2_clip_norm, key=key)
        update = {k: v / expected_batch_size for k, v in noisy.items()}
        params, opt_state = optimizer.update(update, state.opt_state, state.params)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, ledger=state.ledger.append(event)), {}

    return step


STEPS = {
    "vmapdp.make_train_step": (vmapdp.make_train_step, 1.0),
    "mutant: noise x 1/sqrt(2)": (functools.partial(mutant_train_step, noise_scale=1 / math.sqrt(2)), 1 / math.sqrt(2)),
    "mutant: no clipping": (functools.partial(mutant_train_step, clip=False), 0.0),
}


def true_epsilon(noise_multiplier: float, noise_scale: float, delta: float) -> float:
    if noise_scale == 0.0:
        return math.inf
    return accounting.epsilon(noise_multiplier=noise_multiplier * noise_scale, sample_rate=1.0, steps=1, delta=delta, accountant="pld")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer trials")
    parser.add_argument("--smoke", action="store_true", help="1000x fewer trials (that the script runs: tests/test_benchmarks_smoke.py)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = 1000 if args.smoke else 10 if args.quick else 1
    configs = [
        ("reference", dict(noise_multiplier=2.0, delta=1e-5, trials=1_000_000 // scale), list(STEPS)),
        ("sharp", dict(noise_multiplier=1.0, delta=1e-2, trials=max(200, 100_000 // scale)), list(STEPS)),
        ("literal", dict(noise_multiplier=1.0, delta=1e-2, trials=max(200, 10_000 // scale), coordinates=1), ["vmapdp.make_train_step"]),
    ]
    print(f"# vmapdp white-box audit, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}")
    print(f"{'config':<10} {'step':<27} {'sigma':>5} {'delta':>6} {'trials/world':>12} {'eps_lb':>7} {'claimed':>7} {'true eps':>8}  {'verdict':<8} {'sec':>6}")
    start = time.perf_counter()
    for name, cfg, steps in configs:
        for label in steps:
            builder, noise_scale = STEPS[label]
            r = audit_epsilon_lower_bound(builder, raise_on_failure=False, **cfg)
            verdict = "pass" if r.passed else "CAUGHT"
            true = true_epsilon(cfg["noise_multiplier"], noise_scale, cfg["delta"])
            print(
                f"{name:<10} {label:<27} {cfg['noise_multiplier']:>5g} {cfg['delta']:>6g} {cfg['trials']:>12,} "
                f"{r.epsilon_lower_bound:>7.3f} {r.claimed_epsilon:>7.3f} {true:>8.3f}  {verdict:<8} {r.seconds:>6.1f}",
                flush=True,
            )
    print(f"# total {time.perf_counter() - start:.0f} s; confidence 95% (beta 0.05), threshold chosen on half the trials, Clopper-Pearson on the other half")


if __name__ == "__main__":
    main()
