"""DP fine-tuning with LoRA adapters on a frozen backbone vs full DP fine-tuning: time and memory.

The model is a stack of pre-LayerNorm residual MLP blocks (the feed-forward half of a transformer
layer) on vectors: ``Linear(in -> W)``, ``depth`` x ``[x + fc2(gelu(fc1(LayerNorm(x))))]`` with
``fc1: W -> mult*W`` and ``fc2: mult*W -> W``, a final LayerNorm and ``Linear(W -> 10)``; random
inputs and labels. Two set-ups of the same weights:

* ``full``: every parameter trainable (about 4.2 M at the default W = 512, mult 2, depth 4);
* ``lora``: ``vmapdp.nn.add_lora(model, rank)`` -- every ``nn.Linear`` frozen under a rank-``r``
  adapter, every other parameter (LayerNorm) frozen; only the adapters train (2.5 %).

For each set-up and batch size it times, interleaved on the same batch:

* ``torch``: the non-private step (``zero_grad``, mean loss, ``backward``, ``SGD.step`` over the
  trainable parameters): the baseline of the ratios;
* ``vmapdp compiled`` / ``vmapdp eager``: ``vmapdp.make_train_step`` (clipped sum of per-sample
  gradients, noise, divide by the expected batch size, SGD) with and without ``torch.compile``,
  with its default ``method="auto"`` (ghost clipping when linear layers hold the trainable
  parameters, as here: the per-sample gradients are never materialised);
* ``vmapdp eager, vmap``: the same step with ``method="vmap"``: ``vmap(grad)`` per-sample
  gradients, ``B x (trainable parameters)`` floats, then clip and sum;
* ``Opacus hooks``: Opacus's ``PrivacyEngine.make_private`` step on the same module (Opacus
  computes the per-sample gradients of ``LoRALinear``, a module it has no hook for, with its
  functorch fallback).

``--memory`` runs 3 steps of each method (compiled excepted: its peak would be the compiler's) in
a fresh process and reports the peak resident memory above a process that only built the model
(the ``VmHWM`` helper of ``train_step.py``; ``max_memory_allocated`` on CUDA).

    python benchmarks/adapters.py --memory --out benchmarks/results_adapters_2026-11-22_cpu.json
    python benchmarks/adapters.py --quick
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent


sys.path.insert(0, str(HERE))
import train_step  # noqa: E402  (the interleaved timing and CPU-load helpers, and the VmHWM probe)

psg_bench = train_step.psg_bench
_vm_hwm_mib = train_step._vm_hwm_mib

VARIANTS = ("lora", "full")
METHODS = ("torch", "vmapdp_compiled", "vmapdp_eager", "vmapdp_vmap", "opacus_hooks")
HEADERS = {
    "torch": "non-private torch",
    "vmapdp_compiled": "vmapdp compiled",
    "vmapdp_eager": "vmapdp eager",
    "vmapdp_vmap": "vmapdp eager, vmap",
    "opacus_hooks": "Opacus hooks",
}
LR, CLIP, SIGMA = 0.05, 1.0, 1.0
CLASSES = 10
DEFAULT = {"in_features": 256, "width": 512, "mult": 2, "depth": 4, "rank": 8, "alpha": 16.0}
QUICK = {"in_features": 32, "width": 64, "mult": 2, "depth": 1, "rank": 4, "alpha": 8.0}


class Block(nn.Module):
    """``x + fc2(gelu(fc1(LayerNorm(x))))``: a transformer layer's feed-forward half."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Backbone(nn.Module):
    """``Linear(in -> W)``, ``depth`` residual MLP blocks, LayerNorm, ``Linear(W -> classes)``."""

    def __init__(self, in_features: int, width: int, mult: int, depth: int, classes: int = CLASSES) -> None:
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[Block(width, mult * width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def build_model(variant: str, cfg: dict[str, Any], seed: int = 0) -> nn.Module:
    """The backbone (``full``) or its LoRA copy (``lora``), same backbone weights for a given seed."""
    import vmapdp.nn as vnn

    torch.manual_seed(seed)
    model = Backbone(cfg["in_features"], cfg["width"], cfg["mult"], cfg["depth"])
    if variant == "full":
        return model
    if variant == "lora":
        return vnn.add_lora(model, cfg["rank"], cfg["alpha"], generator=torch.Generator().manual_seed(seed + 1))
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def make_batch(batch_size: int, cfg: dict[str, Any], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, cfg["in_features"], generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def count(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def build_step(method: str, variant: str, batch_size: int, device: torch.device, cfg: dict[str, Any]) -> Callable[[], Any]:
    """A zero-argument function that runs one training step of ``method`` on a fixed batch."""
    import vmapdp

    model = build_model(variant, cfg).to(device)
    x, y = (t.to(device) for t in make_batch(batch_size, cfg))

    if method == "torch":
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

        def run():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return run

    if method.startswith("vmapdp"):
        apply, params, buffers = vmapdp.functionalize(model)

        def loss_fn(params, buffers, sample):
            xi, yi = sample
            return F.cross_entropy(apply(params, buffers, xi[None]), yi[None])

        kwargs = {}
        if method == "vmapdp_vmap":  # per-sample gradients materialised, whatever "auto" would pick
            if "method" not in inspect.signature(vmapdp.make_train_step).parameters:
                raise TypeError("this vmapdp's make_train_step has no method= option")
            kwargs["method"] = "vmap"
        sgd = vmapdp.optim.sgd(LR)
        step = vmapdp.make_train_step(
            loss_fn, sgd, l2_clip_norm=CLIP, noise_multiplier=SIGMA, expected_batch_size=float(batch_size),
            sample_rate=0.01, compile=method == "vmapdp_compiled", **kwargs,
        )
        box = {"state": vmapdp.init_train_state(params, sgd, seed=zlib.crc32(method.encode()))}  # its own noise: one key is released once (vmapdp.noise.spent)
        mask = torch.ones(batch_size, dtype=torch.bool, device=device)

        def run():
            box["state"], _ = step(box["state"], (x, y), mask, buffers)

        return run

    if method != "opacus_hooks":
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    from opacus import PrivacyEngine

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        omodel, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
        )

    def run():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(omodel(x), y).backward()
        opt.step()

    return run


def _peak_memory_mib(method: str, variant: str, batch_size: int, device: torch.device, cfg: dict[str, Any]) -> float | None:
    """Peak memory of 3 steps of ``method`` in a fresh process, above a process that only built the model.

    Both processes import the same modules (Opacus included, when installed), so imports cancel.
    """
    code = (
        "import sys, warnings, torch; warnings.simplefilter('ignore'); sys.path.insert(0, {here!r});"
        "import adapters as b;\n"
        "try:\n    import opacus\nexcept ImportError:\n    pass\n"
        "dev = torch.device({dev!r}); run = b.build_step({m!r}, {v!r}, {bs}, dev, {cfg!r});"
        "torch.cuda.reset_peak_memory_stats() if dev.type == 'cuda' else None;"
        "[run() for _ in range({n})];"
        "print(torch.cuda.max_memory_allocated() / 2**20 if dev.type == 'cuda' else b._vm_hwm_mib())"
    )
    out = {}
    for m in ("none", method) if device.type != "cuda" else (method,):
        src = code.format(here=str(HERE), dev=str(device), m="torch" if m == "none" else m, v=variant, bs=batch_size, cfg=cfg, n=0 if m == "none" else 3)
        proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(f"  memory of {method}/{variant} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        out[m] = float(proc.stdout.strip().splitlines()[-1])
    return out[method] - out.get("none", 0.0)


def bench(variant: str, batch_size: int, args: argparse.Namespace, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    trainable, frozen = count(build_model(variant, cfg))
    fns, first = {}, {}
    for m in args.methods:
        t0 = time.perf_counter()
        try:
            fn = build_step(m, variant, batch_size, device, cfg)
            fn()
        except Exception as err:  # report, don't hide: a method that cannot run gets an empty cell
            print(f"  {m}: failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}", file=sys.stderr)
            continue
        first[m] = time.perf_counter() - t0
        fns[m] = fn
    # on a small shared machine other processes spoil timings badly: when they kept more than
    # --max-other-load cores busy, wait and measure again, keeping the quietest attempt
    best = None
    for attempt in range(1 + args.retries):
        if attempt:
            print(f"  other processes were busy ({best[0]:.2f} cores); measuring again in {args.retry_wait:g} s", file=sys.stderr, flush=True)
            time.sleep(args.retry_wait)
        before = psg_bench._cpu_snapshot()
        timings = psg_bench._measure_interleaved(fns, device, repeats=args.repeats, warmup=args.warmup, max_seconds=args.max_seconds)
        other = psg_bench._other_cores(before)
        if best is None or (other is not None and other < best[0]):
            best = (other, timings, attempt + 1)
        if other is None or other <= args.max_other_load:
            break
    other, timings, attempts = best
    row: dict[str, Any] = {
        "variant": variant,
        "trainable": trainable,
        "frozen": frozen,
        "batch": batch_size,
        "ms": {m: t["ms"] for m, t in timings.items()},
        "min_ms": {m: t["min_ms"] for m, t in timings.items()},
        "repeats": {m: t["repeats"] for m, t in timings.items()},
        "first_call_s": first,
        "other_cores_busy": other,
        "attempts": attempts,
        "peak_mib": {},
    }
    if args.memory:
        for m in fns:
            if m != "vmapdp_compiled":
                row["peak_mib"][m] = _peak_memory_mib(m, variant, batch_size, device, cfg)
    return row


def markdown(rows: list[dict[str, Any]], methods: list[str]) -> str:
    compiled = "vmapdp_compiled" in methods
    head = ["set-up", "trainable", "batch"] + [HEADERS[m] for m in methods] + (["compile s"] if compiled else [])
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * (len(methods) + compiled)]
    for r in rows:
        base = r["ms"].get("torch")
        cells = []
        for m in methods:
            ms = r["ms"].get(m)
            if ms is None:
                cells.append("–")
                continue
            cell = f"{ms:.1f} ({ms / base:.2f}x)" if base else f"{ms:.1f}"
            if r["peak_mib"].get(m) is not None:
                cell += f", {r['peak_mib'][m]:.0f} MiB"
            cells.append(cell)
        if compiled:
            first = r["first_call_s"].get("vmapdp_compiled")
            cells.append("–" if first is None else f"{first:.0f}")
        name = "LoRA adapters" if r["variant"] == "lora" else "full fine-tuning"
        lines.append(f"| {name} | {r['trainable']:,} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch-sizes", default="64,128")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--width", type=int, default=DEFAULT["width"])
    p.add_argument("--depth", type=int, default=DEFAULT["depth"])
    p.add_argument("--rank", type=int, default=DEFAULT["rank"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=10.0, help="per method and configuration, once 3 rounds are done")
    p.add_argument("--max-other-load", type=float, default=0.25, help="re-measure a row when other processes kept more cores busy")
    p.add_argument("--retries", type=int, default=None, help="re-measurements allowed per row for that (default 3; 0 with --quick)")
    p.add_argument("--retry-wait", type=float, default=30.0, help="seconds to wait before measuring a row again")
    p.add_argument("--memory", action="store_true", help="also measure peak memory per method (a fresh process each)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, batch 8, 2 repeats, no compile")
    p.add_argument("--out", default=None, help="write the rows (and the set-up) to this JSON file")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {','.join(METHODS)}")
    cfg = dict(DEFAULT, width=args.width, depth=args.depth, rank=args.rank)
    if args.quick:
        cfg = dict(QUICK)
        args.batch_sizes, args.repeats, args.warmup, args.max_seconds = "8", 2, 1, 1.0
        args.methods = [m for m in args.methods if m != "vmapdp_compiled"]
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 3)
    warnings.simplefilter("ignore", UserWarning)  # Opacus's backward hooks warn on every step
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# LoRA vs full DP fine-tuning, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"# model: {cfg}")
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for variant in args.variants.split(","):
            print(f"{variant}, batch {bs} ...", file=sys.stderr, flush=True)
            rows.append(bench(variant, bs, args, device, cfg))
    print("\nmedian ms per DP step (ratio to the non-private torch step of the same set-up)" + (", peak memory above the model" if args.memory else ""))
    print(markdown(rows, args.methods))
    if args.out:
        psg_bench.write_results(args.out, rows, device=where, threads=torch.get_num_threads(), argv=argv, model=cfg)
    return rows


if __name__ == "__main__":
    main()
