"""Peak memory of one DP step vs batch size, per path, against non-private training and Opacus.

On the CIFAR-10 CNN of ``models.py`` (605,226 params) it measures, for each batch size, the peak
memory of three steps in a fresh process, above a process that only built the model (Linux VmHWM on
CPU, ``max_memory_allocated`` on CUDA; see ``train_step._peak_memory_mib``), for:

* ``torch``: the non-private step;
* ``vmapdp vmap``: per-sample gradients of the whole batch (``B x params`` floats);
* ``vmapdp vmap, chunks of K``: the same, ``physical_batch_size=K`` (``K x params``; the sum of the
  chunks' clipped sums equals the unchunked one);
* ``vmapdp two-pass``: per-sample norms ``K`` rows at a time, then one batched backward of
  ``sum_i min(1, C/norm_i) loss_i``;
* ``vmapdp ghost``: norms from layer inputs and output grads, book-keeping sum (no per-sample grads);
* ``Opacus hooks`` and ``Opacus ghost``.

It then reports the largest measured batch each path fits in a memory budget (``--budget-mib``).

    python benchmarks/memory.py                          # batch 32..1024, budget 2048 MiB
    python benchmarks/memory.py --quick                  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_step  # noqa: E402  (the step builders and the fresh-process peak-memory probe)

PATHS = {
    "torch": ("torch", None),
    "vmapdp vmap": ("vmapdp_vmap", None),
    "vmapdp vmap, chunks of {k}": ("vmapdp_vmap", "chunk"),
    "vmapdp two-pass (norms {k} at a time)": ("vmapdp_two_pass", "chunk"),
    "vmapdp ghost": ("vmapdp_ghost", None),
    "Opacus hooks": ("opacus_hooks", None),
    "Opacus ghost": ("opacus_ghost", None),
}


def measure(model: str, batch_sizes: list[int], chunk: int, device: torch.device, seq_len: int) -> dict[str, dict[int, float | None]]:
    table: dict[str, dict[int, float | None]] = {}
    for label, (method, uses_chunk) in PATHS.items():
        name = label.format(k=chunk)
        table[name] = {}
        for bs in batch_sizes:
            k = chunk if uses_chunk and chunk < bs else None
            if uses_chunk and k is None:
                table[name][bs] = None  # chunking a batch no larger than the chunk is the plain path
                continue
            print(f"  {name}, batch {bs} ...", file=sys.stderr, flush=True)
            table[name][bs] = train_step._peak_memory_mib(method, model, bs, seq_len, device, chunk=k)
    return table


def largest_within(row: dict[int, float | None], budget: float) -> int | None:
    fits = [bs for bs, mib in row.items() if mib is not None and mib <= budget]
    return max(fits) if fits else None


def markdown(table: dict[str, dict[int, float | None]], batch_sizes: list[int], budget: float) -> str:
    head = ["path"] + [f"B={b}" for b in batch_sizes] + [f"largest B within {budget:.0f} MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = table.get("torch", {})
    for name, row in table.items():
        cells = []
        for b in batch_sizes:
            mib = row.get(b)
            if mib is None:
                cells.append("–")
            elif base.get(b):
                cells.append(f"{mib:.0f} ({mib / base[b]:.2f}x)")
            else:
                cells.append(f"{mib:.0f}")
        big = largest_within(row, budget)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {big if big is not None else 'none measured'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cifar10")
    p.add_argument("--batch-sizes", default="32,128,256,512,1024")
    p.add_argument("--chunk", type=int, default=32, help="rows per chunk for the chunked and two-pass paths")
    p.add_argument("--budget-mib", type=float, default=2048.0)
    p.add_argument("--seq-len", type=int, default=train_step.models.SEQ_LEN)
    p.add_argument("--quick", action="store_true", help="smoke run: MNIST, batch 8 and 16, chunk 4")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.batch_sizes, args.chunk = "mnist", "8,16", 4
    warnings.simplefilter("ignore", UserWarning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"# Peak memory of a DP step, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, model {args.model}")
    table = measure(args.model, sizes, args.chunk, device, args.seq_len)
    print(f"\npeak MiB above the model (ratio to non-private); budget {args.budget_mib:.0f} MiB")
    print(markdown(table, sizes, args.budget_mib))
    result = {"model": args.model, "device": where, "date": time.strftime("%Y-%m-%d"), "budget_mib": args.budget_mib, "chunk": args.chunk, "peak_mib": table}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
