"""Speed of per-sample gradients: vmapdp (eager and compiled) vs the non-private step, a microbatch
loop and Opacus hooks, on the four Fast-DPSGD / Opacus benchmark models.

Usage (from the repository root)::

    python benchmarks/per_sample_grads.py                          # all models, batch 32 and 128
    python benchmarks/per_sample_grads.py --models mnist --batch-sizes 64 --repeats 50
    python benchmarks/per_sample_grads.py --quick                  # smoke run: tiny sizes
    python benchmarks/per_sample_grads.py --out results.json

Every column is the median wall time in ms of one call over the repeats (after warm-up), on the
same model (same weights) and the same batch, and its ratio to the non-private step:

* ``torch step``: ``model.zero_grad(); cross_entropy(model(x), y).backward()`` (mean loss).
* ``vmapdp eager``: ``per_sample_grads(loss_fn)(params, buffers, (x, y))``.
* ``vmapdp compiled``: the same function under ``torch.compile`` (compiled once per model and
  batch size; compile time reported separately).
* ``+clip eager`` / ``+clip compiled``: per-sample grads then ``clip_and_sum(grads, 1.0)``, the
  DP-relevant unit (compiled together as one function).
* ``microbatch``: a Python loop, one sample at a time, ``torch.autograd.grad`` then stack. For
  ``B > --microbatch-samples`` only that many samples are timed and the time is scaled by
  ``B / samples`` (marked ``*``).
* ``Opacus``: ``opacus.GradSampleModule(model)``, forward + ``backward`` filling ``p.grad_sample``
  (hooks; ``nn.LSTM`` replaced by ``opacus.layers.DPLSTM`` with the same weights).

The methods are timed interleaved (one call of each per round) so that a change in machine load
hits them alike. Other processes matter a lot on a small machine (when they take a core, every
multi-threaded op waits for it), so the script measures the CPU they used while timing and
re-measures a row (``--retries``) when it exceeds ``--max-other-load`` cores; the JSON records it.

This is a script, not a test: the numbers depend on the machine and its load. The smoke test in
``tests/test_benchmarks_smoke.py`` only checks that it runs and that the models are right.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import vmapdp


def _load_models():
    """``benchmarks/models.py`` by path, so the script runs from anywhere and imports cleanly in tests."""
    name = "vmapdp_benchmarks_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


models = _load_models()

METHODS = ("torch", "eager", "compiled", "clip_eager", "clip_compiled", "microbatch", "opacus")
HEADERS = {
    "torch": "torch step",
    "eager": "vmapdp eager",
    "compiled": "vmapdp compiled",
    "clip_eager": "+clip eager",
    "clip_compiled": "+clip compiled",
    "microbatch": "microbatch",
    "opacus": "Opacus hooks",
}
# Compiling vmap(grad(.)) through the 256-step Python loop of the unrolled LSTM takes minutes
# on a small CPU machine (450-540 s per function on 2 cores with a cold Inductor cache);
# `--compile auto` skips it.
SLOW_TO_COMPILE = ("lstm",)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    max_seconds: float,
    min_repeats: int = 3,
) -> dict[str, dict[str, float]]:
    """Median wall time in ms of each ``fns[m]()`` over up to ``repeats`` rounds after ``warmup``.

    The methods are interleaved (one call of each per round) so that a change in machine load
    hits all of them alike and the ratios stay meaningful. Timing stops early once the rounds
    have taken ``max_seconds`` per method and ``min_repeats`` rounds are done, so slow models get
    fewer repeats (the count is reported).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {m: [] for m in fns}
    started = time.perf_counter()
    for r in range(repeats):
        for m, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[m].append(time.perf_counter() - t0)
        if r + 1 >= min(min_repeats, repeats) and time.perf_counter() - started > max_seconds * len(fns):
            break
    return {
        m: {"ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "repeats": len(ts)} for m, ts in times.items()
    }


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process, wall time), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / tick  # all but idle and iowait
    own = os.times()
    return busy, own.user + own.system, time.perf_counter()


def _other_cores(before: tuple[float, float, float] | None) -> float | None:
    """Average number of cores that OTHER processes kept busy since ``before``."""
    after = _cpu_snapshot()
    if before is None or after is None:
        return None
    wall = after[2] - before[2]
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall) if wall > 0 else None


def _first_call_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-key relative L2 difference between two per-sample gradient dicts."""
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return worst


def bench_one(
    spec: Any,
    batch_size: int,
    *,
    device: torch.device,
    repeats: int,
    warmup: int,
    max_seconds: float,
    compile_fns: bool,
    microbatch_samples: int,
    seq_len: int,
    clip_norm: float = 1.0,
    max_other_load: float = 0.25,
    retries: int = 0,
    retry_wait_s: float = 15.0,
) -> dict[str, Any]:
    """Every method on one model and one batch; returns a row of results."""
    net = spec.build(seed=0).to(device)
    gen = torch.Generator().manual_seed(batch_size)
    x, y = (t.to(device) for t in spec.make_batch(batch_size, generator=gen, seq_len=seq_len))
    batch = (x, y)
    row: dict[str, Any] = {
        "model": spec.name,
        "title": spec.title,
        "params": models.num_params(net),
        "batch_size": batch_size,
        "notes": [],
    }
    if x.dtype == torch.int64:
        row["seq_len"] = seq_len
    fns: dict[str, Callable[[], Any]] = {}

    # (1) the non-private step
    def torch_step() -> None:
        net.zero_grad(set_to_none=True)
        models.loss(net(x), y).backward()

    fns["torch"] = torch_step

    # (2), (3) vmapdp per-sample grads, alone and followed by clip_and_sum, eager and compiled
    vnet, note = models.for_vmapdp(net)
    if note:
        row["notes"].append(f"vmapdp rows: {note}")
    apply, params, buffers = vmapdp.functionalize(vnet)
    psg = vmapdp.per_sample_grads(models.one_sample_loss(apply))

    def psg_clip(params, buffers, batch):
        return vmapdp.clip_and_sum(psg(params, buffers, batch), clip_norm)

    grads_eager = psg(params, buffers, batch)
    fns["eager"] = lambda: psg(params, buffers, batch)
    fns["clip_eager"] = lambda: psg_clip(params, buffers, batch)
    if compile_fns:
        torch._dynamo.reset()  # no cache entries (or recompile limits) left from earlier rows
        row["compile_s"] = {}
        for key, fn in (("compiled", psg), ("clip_compiled", psg_clip)):
            compiled = torch.compile(fn, dynamic=False)
            row["compile_s"][key] = _first_call_seconds(lambda: compiled(params, buffers, batch), device)
            fns[key] = lambda compiled=compiled: compiled(params, buffers, batch)
        row["compiled_max_rel_diff"] = _max_rel_diff(fns["compiled"](), grads_eager)
    else:
        row["notes"].append("compiled columns skipped")

    # (4) microbatch loop, extrapolated for large batches
    k = min(batch_size, microbatch_samples)
    trainable = [p for p in net.parameters() if p.requires_grad]

    def microbatch() -> None:
        per_sample = []
        for i in range(k):
            loss = models.loss(net(x[i : i + 1]), y[i : i + 1])
            per_sample.append(torch.autograd.grad(loss, trainable))
        [torch.stack(gs) for gs in zip(*per_sample)]

    fns["microbatch"] = microbatch

    # (5) Opacus hooks
    from opacus import GradSampleModule

    gsm = GradSampleModule(models.for_opacus(net))

    def opacus_step() -> None:
        gsm.zero_grad(set_to_none=True)
        models.loss(gsm(x), y).backward()

    fns["opacus"] = opacus_step

    with warnings.catch_warnings():
        # torch warns on every backward that Opacus's full backward hook on the first layer fires
        # although the input (data) does not require grad: expected, and harmless here
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        # Other processes on the machine distort timings badly (with all cores in use, a busy
        # core stalls every parallel op). Measure their CPU use while timing; if they used more
        # than `max_other_load` cores, wait and measure again, keeping the quietest attempt.
        best = None
        for attempt in range(1 + retries):
            if attempt:
                time.sleep(retry_wait_s)
            before = _cpu_snapshot()
            timings = _measure_interleaved(fns, device, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
            other = _other_cores(before)
            if best is None or (other is not None and other < best[0]):
                best = (other, timings, attempt)
            if other is None or other <= max_other_load:
                break
        row["other_cores_busy"], timings, row["attempts"] = best[0], best[1], best[2] + 1
        row.update(timings)
        opacus_step()
    opacus_grads = {n: p.grad_sample for n, p in gsm._module.named_parameters() if p.requires_grad}
    row["opacus_max_rel_diff"] = _max_rel_diff(grads_eager, opacus_grads)
    gsm._close()
    torch._dynamo.reset()

    if k < batch_size:
        scale = batch_size / k
        mb = row["microbatch"]
        mb.update(ms=mb["ms"] * scale, min_ms=mb["min_ms"] * scale, extrapolated_from=k)
    base = row["torch"]["ms"]
    for m in METHODS:
        if m in row:
            row[m]["ratio"] = row[m]["ms"] / base
    return row


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _cell(entry: dict[str, float] | None, *, ratio: bool = True) -> str:
    if entry is None:
        return "—"
    star = "*" if "extrapolated_from" in entry else ""
    return f"{entry['ms']:.1f}{star} ({entry['ratio']:.1f}×)" if ratio else f"{entry['ms']:.1f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table: ms (ratio to the non-private step)."""
    head = ["model", "params", "B"] + [HEADERS[m] for m in METHODS] + ["compile s (psg / +clip)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(METHODS) + 1)) + "|"]
    for r in rows:
        cells = [r["title"], f"{r['params']:,}", str(r["batch_size"])]
        cells += [_cell(r.get(m), ratio=m != "torch") for m in METHODS]
        c = r.get("compile_s")
        cells.append(f"{c['compiled']:.0f} / {c['clip_compiled']:.0f}" if c else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mnist,cifar10,embedding,lstm", help="comma-separated: " + ",".join(models.MODELS))
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 32,128; 4 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds, one call of each method per round (default 20; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; 1 with --quick)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop a row after this many seconds per method, once 3 rounds are done (default 5)")
    p.add_argument("--microbatch-samples", type=int, default=None, help="samples the microbatch loop times (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help=f"IMDb sequence length (default {models.SEQ_LEN}; 16 with --quick)")
    p.add_argument(
        "--compile",
        choices=("auto", "all", "none"),
        default="auto",
        help=f"torch.compile columns: all models, none, or auto = all but {', '.join(SLOW_TO_COMPILE)} (minutes to compile)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_const", const="none", help="same as --compile none")
    p.add_argument(
        "--max-other-load",
        type=float,
        default=0.25,
        help="re-measure a row when other processes kept more than this many cores busy meanwhile (default 0.25)",
    )
    p.add_argument("--retries", type=int, default=None, help="re-measurements allowed per row for that (default 2; 0 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 4, 2 repeats, short sequences")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores of this process)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    q = args.quick
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("4" if q else "32,128")).split(",")]
    args.repeats = args.repeats if args.repeats is not None else (2 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    args.max_seconds = args.max_seconds if args.max_seconds is not None else (1.0 if q else 5.0)
    args.microbatch_samples = args.microbatch_samples or (2 if q else 8)
    args.retries = args.retries if args.retries is not None else (0 if q else 2)
    args.seq_len = args.seq_len or (16 if q else models.SEQ_LEN)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in models.MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(models.MODELS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; print a markdown table; return the rows (also written to ``--out``)."""
    args = _parse(argv)
    threads = args.threads or _cores()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} threads ({platform.processor() or platform.machine()})"
    print(f"# per-sample gradients benchmark — torch {torch.__version__}, {device_name}", flush=True)
    rows = []
    try:
        for name in args.models:
            spec = models.MODELS[name]
            compile_fns = args.compile == "all" or (args.compile == "auto" and name not in SLOW_TO_COMPILE)
            for b in args.batch_sizes:
                t0 = time.perf_counter()
                row = bench_one(
                    spec,
                    b,
                    device=device,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    max_seconds=args.max_seconds,
                    compile_fns=compile_fns,
                    microbatch_samples=args.microbatch_samples,
                    seq_len=args.seq_len,
                    max_other_load=args.max_other_load,
                    retries=args.retries,
                )
                if not compile_fns and args.compile == "auto":
                    row["notes"][-1] = "compiled columns skipped (--compile auto; minutes to compile, pass --compile all)"
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(
                    f"  {spec.title} B={b}: torch {row['torch']['ms']:.1f} ms, vmapdp eager "
                    f"{row['eager']['ms']:.1f} ms, opacus {row['opacus']['ms']:.1f} ms "
                    f"({row['wall_s']:.0f} s; other processes busy {_fmt(row['other_cores_busy'])} cores, "
                    f"attempt {row['attempts']})"
                    f"{'; ' + '; '.join(row['notes']) if row['notes'] else ''}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(old_threads)
    print()
    print(markdown_table(rows))
    print("\nms per call, median; (×) = ratio to the non-private torch step; * = microbatch loop "
          f"timed on {args.microbatch_samples} samples and scaled to B.")
    if args.out:
        write_results(args.out, rows, device=device_name, threads=threads, argv=argv)
    return rows


def write_results(path: str, rows: list[dict[str, Any]], *, device: str, threads: int, argv: list[str] | None, **extra: Any) -> None:
    """``rows`` and the run's metadata (date, torch and Opacus versions, device, threads, the
    command line, and ``extra``) as one JSON file."""
    try:
        opacus_version = importlib.metadata.version("opacus")
    except importlib.metadata.PackageNotFoundError:
        opacus_version = None
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "opacus": opacus_version,
        "device": device,
        "threads": threads,
        **extra,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
