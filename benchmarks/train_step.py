"""The whole DP-SGD step, side by side: non-private PyTorch vs vmapdp vs Opacus, in one run.

For each model of ``models.py`` and each batch size it times, on the same weights and batch:

* ``torch``: the non-private step (``zero_grad``, mean loss, ``backward``, ``SGD.step``), the
  baseline of the ratios; ``torch compiled``: the same with the model under ``torch.compile``;
* ``vmapdp ghost`` (eager and compiled): ``vmapdp.make_train_step(method="ghost")``, norms and
  clipped sum from layer inputs and output grads, no per-sample gradients;
* ``vmapdp vmap`` (eager and compiled): ``method="vmap"``, per-sample grads, clip, sum;
* ``vmapdp two-pass``: ``method="two_pass"``, norms first, then a reweighted batched backward;
  (every vmapdp step adds noise, divides by the expected batch size and applies SGD);
* ``Opacus hooks``: Opacus's ``GradSampleModule`` + ``DPOptimizer`` step;
* ``Opacus ghost``: Opacus's ghost clipping (``grad_sample_mode="ghost"``).

Times are medians of interleaved rounds (a change in load hits all methods alike); ratios are to
the non-private step. ``--memory`` also measures each method's peak memory in a fresh process
(peak RSS on CPU, ``max_memory_allocated`` on CUDA) above a process that only built the model;
not for the compiled methods, whose peak would be the compiler's.

    python benchmarks/train_step.py                                  # all models, batch 32/128/512
    python benchmarks/train_step.py --models mnist,cifar10 --batch-sizes 128 --memory
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent


def _load(name: str, file: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


models = _load("vmapdp_benchmarks_models", "models.py")
psg_bench = _load("vmapdp_benchmarks_per_sample_grads", "per_sample_grads.py")

METHODS = (
    "torch",
    "torch_compiled",
    "vmapdp_auto",
    "vmapdp_auto_compiled",
    "vmapdp_ghost",
    "vmapdp_ghost_compiled",
    "vmapdp_vmap",
    "vmapdp_vmap_compiled",
    "vmapdp_two_pass",
    "opacus_hooks",
    "opacus_ghost",
)
HEADERS = {
    "torch": "non-private torch",
    "torch_compiled": "non-private torch compiled",
    "vmapdp_auto": "vmapdp auto",
    "vmapdp_auto_compiled": "vmapdp auto compiled (the default)",
    "vmapdp_ghost": "vmapdp ghost",
    "vmapdp_ghost_compiled": "vmapdp ghost compiled",
    "vmapdp_vmap": "vmapdp vmap",
    "vmapdp_vmap_compiled": "vmapdp vmap compiled",
    "vmapdp_two_pass": "vmapdp two-pass",
    "opacus_hooks": "Opacus hooks",
    "opacus_ghost": "Opacus ghost",
}
LR, CLIP, SIGMA = 0.05, 1.0, 1.0


def build_step(
    method: str, name: str, batch_size: int, device: torch.device, *, seq_len: int, chunk: int | None = None, seed: int | None = None
) -> Callable[[], Any]:
    """A zero-argument function that runs one training step of ``method`` on a fixed batch.

    ``chunk``: vmapdp's ``physical_batch_size`` (``norm_chunk_size`` for the two-pass method).
    ``seed``: the vmapdp state's noise seed (default: from the method's name; two steps of one
    process need two seeds, as ``vmapdp.noise.spent`` refuses a noise key released twice).
    """
    import vmapdp

    spec = models.MODELS[name]
    model = spec.build().to(device)
    x, y = spec.make_batch(batch_size, generator=torch.Generator().manual_seed(0), **({"seq_len": seq_len} if name in ("embedding", "lstm") else {}))
    x, y = x.to(device), y.to(device)

    if method in ("torch", "torch_compiled"):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        forward = torch.compile(model) if method == "torch_compiled" else model

        def run():
            opt.zero_grad(set_to_none=True)
            models.loss(forward(x), y).backward()
            opt.step()

        return run

    if method.startswith("vmapdp"):
        vmodel, _ = models.for_vmapdp(model)
        apply, params, buffers = vmapdp.functionalize(vmodel)
        sgd = vmapdp.optim.sgd(LR)
        how = method.removeprefix("vmapdp_").removesuffix("_compiled")
        step = vmapdp.make_train_step(
            models.one_sample_loss(apply),
            sgd,
            l2_clip_norm=CLIP,
            noise_multiplier=SIGMA,
            expected_batch_size=float(batch_size),
            sample_rate=0.01,
            method=how,
            compile=method.endswith("_compiled"),
            physical_batch_size=chunk if how != "two_pass" else None,
            **({"norm_chunk_size": chunk} if how == "two_pass" and chunk else {}),
        )
        box = {"state": vmapdp.init_train_state(params, sgd, seed=zlib.crc32(method.encode()) if seed is None else seed)}  # its own noise: one key is released once (vmapdp.noise.spent)
        mask = torch.ones(batch_size, dtype=torch.bool, device=device)

        def run():
            box["state"], _ = step(box["state"], (x, y), mask, buffers)

        run.chosen_runs = step.chosen_runs  # what "auto" ran, compiled ("ghost") or not ("ghost eager"); filled by the first call
        return run

    # Opacus: the engine's own DP step on a fixed batch (no data loader in the timed region)
    from opacus import PrivacyEngine

    omodel = models.for_opacus(model)
    opt = torch.optim.SGD([p for p in omodel.parameters() if p.requires_grad], lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "opacus_ghost":
            criterion = torch.nn.CrossEntropyLoss()
            omodel, opt, criterion, _ = engine.make_private(
                module=omodel, optimizer=opt, data_loader=loader, criterion=criterion, noise_multiplier=SIGMA,
                max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode="ghost",
            )
        else:
            criterion = models.loss
            omodel, opt, _ = engine.make_private(
                module=omodel, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
            )

    def run():
        opt.zero_grad(set_to_none=True)
        criterion(omodel(x), y).backward()
        opt.step()

    return run


def _vm_hwm_mib() -> float:
    """This process's peak resident memory (Linux VmHWM; unlike ru_maxrss it is not inherited
    from the parent across fork + exec, which made every method read the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_memory_mib(method: str, name: str, batch_size: int, seq_len: int, device: torch.device, chunk: int | None = None) -> float | None:
    """Peak memory of 3 steps of ``method`` in a fresh process, above a process that only built the model."""
    code = (
        "import sys, resource, torch, warnings; warnings.simplefilter('ignore'); sys.path.insert(0, {here!r});"
        "import train_step as b; dev = torch.device({dev!r});"
        "run = b.build_step({m!r}, {n!r}, {bs}, dev, seq_len={sl}, chunk={chunk!r});"
        "torch.cuda.reset_peak_memory_stats() if dev.type == 'cuda' else None;"
        "[run() for _ in range(3)];"
        "print(torch.cuda.max_memory_allocated() / 2**20 if dev.type == 'cuda' else b._vm_hwm_mib())"
    )
    out = {}
    for m in ("none", method) if device.type != "cuda" else (method,):
        src = code.format(here=str(HERE), dev=str(device), m=m if m != "none" else "torch", n=name, bs=batch_size, sl=seq_len, chunk=chunk)
        if m == "none":
            src = src.replace("[run() for _ in range(3)];", "")
        proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return None
        out[m] = float(proc.stdout.strip().splitlines()[-1])
    return out[method] - out.get("none", 0.0)


def bench(name: str, batch_size: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    spec = models.MODELS[name]
    methods = [m for m in METHODS if m in args.methods]
    if name == "lstm" and not args.compile_lstm:  # compiling the unrolled 256-step LSTM takes minutes here (6 min cold):
        # a named compiled method would compile it; auto keeps it eager (Limits.compile_max_ops)
        methods = [m for m in methods if m not in ("vmapdp_ghost_compiled", "vmapdp_vmap_compiled")]
    fns, first = {}, {}
    for m in methods:
        t0 = time.perf_counter()
        try:
            fn = build_step(m, name, batch_size, device, seq_len=args.seq_len)
            fn()
        except Exception as err:  # report, don't hide: a method that cannot run gets an error cell
            print(f"  {m}: failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}", file=sys.stderr)
            continue
        first[m] = time.perf_counter() - t0
        fns[m] = fn
    timings = psg_bench._measure_interleaved(fns, device, repeats=args.repeats, warmup=args.warmup, max_seconds=args.max_seconds)
    if args.profile is not None:
        profile_steps(fns, device, args.profile or None, f"{name}_{batch_size}")
    row: dict[str, Any] = {"model": spec.title, "params": spec.expected_params, "batch": batch_size, "ms": {}, "first_call_s": first, "peak_mib": {}}
    row["auto_chose"] = {m: sorted(set(fn.chosen_runs.values())) for m, fn in fns.items() if "auto" in m}
    for m, t in timings.items():
        row["ms"][m] = t["ms"]
    if args.memory:
        for m in fns:
            if not m.endswith("_compiled"):
                row["peak_mib"][m] = _peak_memory_mib(m, name, batch_size, args.seq_len, device)
    return row


def profile_steps(fns: dict[str, Callable[[], Any]], device: torch.device, out_dir: str | None, label: str, *, rows: int = 25) -> None:
    """One more step of each method under ``torch.profiler`` (host and, on CUDA, device activity),
    its ops ranked by their own time on the device (on the host without a GPU), written as
    ``<out_dir>/<label>_<method>.txt`` (and printed without ``out_dir``): where a step's time goes,
    side by side with the non-private step's."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for m, fn in fns.items():
        fn()  # (the step warm: nothing compiled or raced inside the profile)
        if cuda:
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows, max_name_column_width=70)
        events = [e for e in prof.events() if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        text = f"# {label} {m}: {len(events)} top-level aten ops\n{table}"
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / f"{label}_{m}.txt").write_text(text)
        else:
            print(text)


def markdown(rows: list[dict[str, Any]], memory: bool) -> str:
    head = ["model", "params", "batch"] + [HEADERS[m] for m in METHODS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["ms"].get("torch")
        cells = []
        for m in METHODS:
            ms = r["ms"].get(m)
            if ms is None:
                cells.append("–")
                continue
            cell = f"{ms:.1f} ({ms / base:.2f}x)" if base else f"{ms:.1f}"
            if m in r.get("auto_chose", {}):
                cell += " " + "/".join(r["auto_chose"][m])
            if memory and r["peak_mib"].get(m) is not None:
                cell += f", {r['peak_mib'][m]:.0f} MiB"
            cells.append(cell)
        lines.append(f"| {r['model']} | {r['params']:,} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mnist,cifar10,embedding,lstm")
    p.add_argument("--batch-sizes", default="32,128,512")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=10.0, help="per method and configuration, once 3 rounds are done")
    p.add_argument("--seq-len", type=int, default=models.SEQ_LEN)
    p.add_argument("--memory", action="store_true", help="also measure peak memory per method (a fresh process each)")
    p.add_argument("--compile-lstm", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: MNIST, batch 8, 2 repeats, no compile")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", nargs="?", const="", default=None, metavar="DIR", help="after timing, profile one step of each method (tables into DIR, or printed)")
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    warnings.simplefilter("ignore", UserWarning)  # Opacus's backward hooks warn on every step
    if args.quick:
        args.models, args.batch_sizes, args.repeats, args.warmup, args.max_seconds = "mnist", "8", 2, 1, 1.0
        args.methods = [m for m in args.methods if not m.endswith("_compiled")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# DP step benchmark, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows = []
    for name in args.models.split(","):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            print(f"{models.MODELS[name].title}, batch {bs} ...", file=sys.stderr, flush=True)
            rows.append(bench(name, bs, args, device))
    print("\nmedian ms per step (ratio to the non-private torch step)" + (", peak memory above the model" if args.memory else ""))
    print(markdown(rows, args.memory))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
