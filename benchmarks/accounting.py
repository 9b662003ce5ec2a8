"""Speed and agreement of vmapdp.accounting against dp-accounting and Opacus.

Usage (from the repository root)::

    python benchmarks/accounting.py                # default: torch intra-op threads = 1
    python benchmarks/accounting.py --threads 0    # leave torch's thread count alone
    python benchmarks/accounting.py --repeats 10
    python benchmarks/accounting.py --quick        # smoke run: one repeat each

Setting: DP-SGD on a dataset of 60,000 examples, Poisson sample rate 0.01 (expected batch
600), noise multiplier 1.0, 10,000 steps, delta 1e-5. Rows:

* ``rdp``: epsilon by RDP. "cold": vmapdp's memo caches are emptied before every call, so
  the per-step RDP at all 185 default orders is computed; "warm": a repeat call (the
  per-step RDP is memoised; only the conversion runs). All other vmapdp rows are cold too.
* ``pld``: the tight accountant at its default accuracy: certified error <= 1% of epsilon.
* ``calibrate``: noise multiplier for target epsilon 3.0 (RDP), within 1% below the target.
* ``grid``: epsilon at 100 step counts (one call), and at 100 noise multipliers (one call).

Third-party columns run the same inputs: dp-accounting's ``RdpAccountant`` (its default orders)
and ``PLDAccountant`` (value_discretization_interval 1e-3 and 1e-4), Opacus's ``compute_rdp``
+ ``get_privacy_spent`` (its default orders) and ``PRVAccountant`` (eps_error 0.01 * epsilon),
and Opacus's ``get_noise_multiplier``. Times are medians over the repeats, in milliseconds,
single process; accounting runs on the host, outside any compiled graph.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import warnings

import torch

from vmapdp import accounting as acc

NOISE, RATE, STEPS, DELTA = 1.0, 0.01, 10_000, 1e-5


def timed(fn, repeats):
    """(median ms, last result) of fn(i) over repeats calls."""
    times, out = [], None
    for i in range(repeats):
        t = time.perf_counter()
        out = fn(i)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out


def cold(fn):
    """fn with vmapdp's memo caches emptied first, so every call does the full work."""

    def run(i):
        acc.rdp._rdp_cached.cache_clear()
        acc.pld._step_pmf.cache_clear()
        return fn(i)

    return run


def main(argv=None) -> list[dict]:
    """Run the benchmark, print the markdown table, return its rows as dicts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one repeat of everything")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 = leave as is")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # Opacus, calibration
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    r = args.repeats
    rows = []  # (task, vmapdp ms, target, dp-accounting ms, opacus ms, values)

    import dp_accounting
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis import rdp as opacus_rdp
    from opacus.accountants.utils import get_noise_multiplier

    acc.epsilon(noise_multiplier=2.0, sample_rate=0.5, steps=10, delta=DELTA, accountant="rdp")  # warm torch up

    # --- RDP -----------------------------------------------------------------------------
    t_cold, e_rdp = timed(
        cold(lambda i: acc.epsilon(noise_multiplier=NOISE, sample_rate=RATE, steps=STEPS, delta=DELTA, accountant="rdp")), r
    )
    t_warm, _ = timed(lambda i: acc.epsilon(noise_multiplier=NOISE, sample_rate=RATE, steps=STEPS, delta=DELTA, accountant="rdp"), r)

    def dp_rdp(i):
        a = dp_accounting.rdp.RdpAccountant()
        a.compose(dp_accounting.PoissonSampledDpEvent(RATE, dp_accounting.GaussianDpEvent(NOISE)), STEPS)
        return a.get_epsilon(DELTA)

    t_dp_rdp, e_dp_rdp = timed(dp_rdp, r)
    opacus_orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

    def op_rdp(i):
        rdp = opacus_rdp.compute_rdp(q=RATE, noise_multiplier=NOISE, steps=STEPS, orders=opacus_orders)
        return float(opacus_rdp.get_privacy_spent(orders=opacus_orders, rdp=rdp, delta=DELTA)[0])

    t_op_rdp, e_op_rdp = timed(op_rdp, r)
    e_same_grid = acc.epsilon(noise_multiplier=NOISE, sample_rate=RATE, steps=STEPS, delta=DELTA, orders=opacus_orders, accountant="rdp")
    rows.append(
        (f"rdp eps, {STEPS} steps (cold)", t_cold, "< 10", t_dp_rdp, t_op_rdp,
         f"{e_rdp:.4f} (Opacus grid {e_same_grid:.4f}) / {e_dp_rdp:.4f} / {e_op_rdp:.4f}")
    )
    rows.append((f"rdp eps, {STEPS} steps (warm)", t_warm, "< 10", math.nan, math.nan, ""))

    # --- PLD -----------------------------------------------------------------------------
    t_pld, b = timed(
        cold(lambda i: acc.epsilon_bounds(noise_multiplier=NOISE, sample_rate=RATE, steps=STEPS, delta=DELTA)),
        max(1, r // 2),
    )

    def dp_pld(interval):
        a = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        a.compose(dp_accounting.PoissonSampledDpEvent(RATE, dp_accounting.GaussianDpEvent(NOISE)), STEPS)
        return a.get_epsilon(DELTA)

    t_dp3, e_dp3 = timed(lambda i: dp_pld(1e-3), max(1, r // 2))
    t_dp4, e_dp4 = timed(lambda i: dp_pld(1e-4), max(1, r // 2))

    def op_prv(i):
        a = PRVAccountant()
        a.history = [(NOISE, RATE, STEPS)]
        return a.get_epsilon(delta=DELTA, eps_error=0.01 * b.upper)

    t_prv, e_prv = timed(op_prv, max(1, r // 2))
    rows.append(
        (f"pld eps, {STEPS} steps, <= 1% error", t_pld, "< 2000", t_dp4, t_prv,
         f"{b.upper:.4f} in [{b.lower:.4f}, {b.upper:.4f}] / {e_dp4:.4f} (h=1e-4) / {e_prv:.4f} (PRV)")
    )
    rows.append(("  dp-accounting PLD at h=1e-3", math.nan, "", t_dp3, math.nan, f"{e_dp3:.4f}"))

    # --- calibration ---------------------------------------------------------------------
    target = 3.0
    t_cal, sigma = timed(
        cold(lambda i: acc.calibrate_noise(target_epsilon=target, delta=DELTA, sample_rate=RATE, steps=STEPS, accountant="rdp")), r
    )
    achieved = acc.epsilon(noise_multiplier=sigma, sample_rate=RATE, steps=STEPS, delta=DELTA, accountant="rdp")
    t_op_cal, sigma_op = timed(
        lambda i: get_noise_multiplier(
            target_epsilon=target + 1e-7 * i, target_delta=DELTA, sample_rate=RATE, steps=STEPS, accountant="rdp"
        ),
        max(1, r // 2),
    )
    rows.append(
        ("calibrate_noise(eps=3), rdp", t_cal, "< 1000", math.nan, t_op_cal,
         f"sigma {sigma:.4f} (eps {achieved:.4f}) / Opacus sigma {sigma_op:.4f}")
    )
    t_cal_pld, sigma_pld = timed(
        cold(
            lambda i: acc.calibrate_noise(
                target_epsilon=target, delta=DELTA, sample_rate=RATE, steps=STEPS, accountant="pld"
            )
        ),
        1,
    )
    rows.append(("calibrate_noise(eps=3), pld", t_cal_pld, "", math.nan, math.nan, f"sigma {sigma_pld:.4f}"))

    # --- grids ---------------------------------------------------------------------------
    steps_grid = list(range(100, 10_001, 100))
    t_g1, g1 = timed(
        cold(lambda i: acc.epsilon_grid(noise_multiplier=NOISE, sample_rate=RATE, steps=steps_grid, delta=DELTA, accountant="rdp")), r
    )
    noise_grid = [0.5 + 0.05 * k for k in range(100)]
    t_g2, g2 = timed(
        cold(lambda i: acc.epsilon_grid(noise_multiplier=noise_grid, sample_rate=RATE, steps=STEPS, delta=DELTA, accountant="rdp")),
        max(1, r // 2),
    )

    def op_grid(i):
        out = []
        for t in steps_grid:
            rdp = opacus_rdp.compute_rdp(q=RATE, noise_multiplier=NOISE, steps=t, orders=opacus_orders)
            out.append(opacus_rdp.get_privacy_spent(orders=opacus_orders, rdp=rdp, delta=DELTA)[0])
        return out

    t_op_g1, _ = timed(op_grid, 1)
    rows.append(("epsilon_grid, 100 step counts", t_g1, "", math.nan, t_op_g1, f"{g1[0]:.3f} .. {g1[-1]:.3f}"))
    rows.append(("epsilon_grid, 100 noise multipliers", t_g2, "", math.nan, math.nan, f"{g2[0]:.3f} .. {g2[-1]:.3f}"))

    def ms(x):
        return "" if math.isnan(x) else f"{x:.1f}"

    print(
        f"\nvmapdp.accounting benchmark, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"noise {NOISE}, rate {RATE}, steps {STEPS}, delta {DELTA}\n"
    )
    print("| task | vmapdp ms | target ms | dp-accounting ms | opacus ms | epsilon: vmapdp / dp-accounting / opacus |")
    print("|---|---:|---:|---:|---:|---|")
    for task, ours, target_ms, dp_ms, op_ms, values in rows:
        print(f"| {task} | {ms(ours)} | {target_ms} | {ms(dp_ms)} | {ms(op_ms)} | {values} |")
    results = {
        "rdp": {"vmapdp": e_rdp, "vmapdp_opacus_orders": e_same_grid, "dp_accounting": e_dp_rdp, "opacus": e_op_rdp},
        "pld": {"upper": b.upper, "lower": b.lower, "dp_accounting_1e-4": e_dp4, "opacus_prv": e_prv},
        "calibrate": {"noise_multiplier": sigma, "epsilon": achieved, "opacus": sigma_op, "pld": sigma_pld},
        "grid": {"steps": g1, "noise": g2},
    }
    return [
        {"task": task, "vmapdp_ms": ours, "target_ms": target_ms, "dp_accounting_ms": dp_ms, "opacus_ms": op_ms}
        for task, ours, target_ms, dp_ms, op_ms, _ in rows
    ] + [{"task": "values", **results}]


if __name__ == "__main__":
    main()
