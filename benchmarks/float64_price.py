"""What ghost clipping's float64 book-keeping sums cost: the same DP step with its sums in float64
(as shipped) and in float32 (for the figure only), against the non-private step, in one process.

Ghost clipping adds the clipped per-sample contributions of every sample in one matmul (a conv
backward, an ``index_add``) without forming per-sample grads. vmapdp accumulates those sums in
float64 (``vmapdp.ghost.engine._sum_dtype``): in float32 a crafted sample whose terms cancel
quantises the other samples' partial sums, and moved them by up to 1.016 C in a test. This script
swaps that function for one that keeps float32, times both steps interleaved with the non-private
step on the same weights and batch, and restores it. The float32 variant is not private and not
offered by the library: it only measures what the guarantee costs.

    python benchmarks/float64_price.py                                  # the four models, B=128, 512
    python benchmarks/float64_price.py --models cifar10 --batch-sizes 128 --repeats 9
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

sys.path.insert(0, str(HERE))
import train_step  # noqa: E402  (build_step: the same models, batches and steps as its table)

# the compiled step where vmapdp's default compiles the model (train_step.py's table), eager elsewhere
DEFAULT_METHOD = {"mnist": "vmapdp_ghost_compiled", "embedding": "vmapdp_ghost_compiled", "cifar10": "vmapdp_ghost", "lstm": "vmapdp_ghost"}
VARIANTS = ("float64", "float32")


def measure(name: str, batch_size: int, repeats: int, method: str | None = None) -> dict[str, Any]:
    """Median ms of the non-private step and of the ghost step with float64 / float32 sums."""
    from vmapdp.ghost import engine

    method = method or DEFAULT_METHOD[name]
    shipped = engine._sum_dtype
    dtypes = {"float64": shipped, "float32": lambda dtype: dtype}
    device = torch.device("cpu")
    seq_len = train_step.models.SEQ_LEN
    runs = {"torch": train_step.build_step("torch", name, batch_size, device, seq_len=seq_len)}
    try:
        for i, variant in enumerate(VARIANTS):
            engine._sum_dtype = dtypes[variant]
            # each variant its own noise key (vmapdp.noise.spent refuses a key released twice)
            runs[variant] = train_step.build_step(method, name, batch_size, device, seq_len=seq_len, seed=1000 + i)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(repeats + 1):  # round 0 warms up (and compiles)
            for k, run in runs.items():
                engine._sum_dtype = dtypes.get(k, shipped)
                t0 = time.perf_counter()
                run()
                if r:
                    times[k].append(time.perf_counter() - t0)
    finally:
        engine._sum_dtype = shipped
    ms = {k: 1000 * sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"model": name, "batch_size": batch_size, "method": method, "repeats": repeats, "ms": ms,
            "ratio": {k: ms[k] / ms["torch"] for k in VARIANTS}}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | step | non-private | ghost, float64 sums (shipped) | ghost, float32 sums (not private) |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        ms, ratio = r["ms"], r["ratio"]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['method']} | {ms['torch']:.1f} | "
                     f"{ms['float64']:.1f} ({ratio['float64']:.2f}x) | {ms['float32']:.1f} ({ratio['float32']:.2f}x) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mnist,embedding,cifar10,lstm")
    p.add_argument("--batch-sizes", default="128,512")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--method", default=None, help="train_step.py's method name; default: the compiled ghost step for MNIST and embedding, eager for CIFAR-10 and the LSTM")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*TF32.*")
    rows = []
    for name in args.models.split(","):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            row = measure(name, bs, args.repeats, args.method)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(markdown(rows))
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": f"{platform.machine()}, {torch.get_num_threads()} threads",
                "argv": sys.argv[1:] if argv is None else argv}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
