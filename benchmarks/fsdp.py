"""Sharded DP-SGD (vmapdp.sharding) against the data-parallel DP step and non-private FSDP2: memory per rank and step time.

For each world size (gloo processes on this machine's CPUs) and each mode, one fresh set of
processes (so that each peak is that mode's own) trains an MLP of ``--layers`` square
``Linear(width, width)`` layers with Adam on one Poisson batch per step, each rank on its share:

* ``ddp``: ``make_train_step(distributed=True)``: every rank holds every param and Adam state;
* ``sharded``: ``make_train_step(sharding=Sharding(params))``: each rank holds 1/W of them and
  gathers the whole model once per step;
* ``sharded-use``: ``Sharding(params, unshard="use")``: the same, each parameter gathered where
  an op uses it (forward and backward) and freed after;
* ``fsdp2``: non-private: every ``Linear`` and the root under ``torch.distributed.fsdp.fully_shard``,
  ``torch.optim.AdamW``, the mean loss's ``backward()``.

Per rank (rank 0 printed, the maximum over ranks in the JSON): ``state_mib``, the bytes of the
params and the optimizer state this rank keeps between steps (summed tensor sizes: exact, not
sampled); ``peak_mib``, the process's high-water RSS (``VmHWM``) above its RSS before the model
was built (after imports and the noise kernel's compile; it includes the full model every rank builds before sharding it, the transient
all-gathered params and clipped sums, gloo's buffers); ``ms``, the median step time; ``transient``,
the peak of the bytes in use (glibc ``mallinfo2``: every CPU tensor and gloo's buffers) during one
more step, sampled after every aten op, above its value before the step, in units of the full
params' bytes; for the sharded modes also per phase (``step``: the checks before the gather;
``gather``: ``Sharding.step_params`` (the whole model, or nothing with ``unshard="use"``);
``clip``: the clipped sums (with ``unshard="use"`` the per-use gathers and the per-param
reduce-scatters); ``reduce``: ``Sharding.reduce_step`` (the same-state check, the reduce-scatter
unless done); ``update``: noise and optimizer on the shards). Timings on a
shared CPU are noisy (see ``--repeats``); nothing here is asserted.

    python benchmarks/fsdp.py                        # worlds 1, 2, 4; 8 layers of width 1024 (8.4M params)
    python benchmarks/fsdp.py --quick                # small: worlds 1, 2; 2 layers of width 64
    python benchmarks/fsdp.py --smoke                # the test's size: every mode in ONE set of processes
                                                     # per world (no peak: it would mix the modes), eager noise
    python benchmarks/fsdp.py --out results.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODES = ("ddp", "sharded", "sharded-use", "fsdp2")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes() -> int | None:
    """malloc's bytes in use (small blocks + mmapped ones); None without glibc's mallinfo2."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _HeapProbe:
    """``with probe:`` the peak of :func:`_heap_bytes` above its value at entry, sampled after every
    aten op, overall (``peak``) and per ``phase`` (set it from outside); ``peak`` None without glibc."""

    def __init__(self) -> None:
        self.phase, self.peaks, self.peak = "step", {}, None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        gc.collect()
        self.phase, self.peaks, self.base = "step", {}, _heap_bytes()
        probe = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if probe.base is not None:
                    used = _heap_bytes() - probe.base
                    probe.peaks[probe.phase] = max(probe.peaks.get(probe.phase, 0), used)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.peak = max(self.peaks.values(), default=0) if self.base is not None else None

    def tagging(self, phase: str, fn, after: str):
        """``fn`` with its work counted as ``phase`` (then ``after``)."""

        def tagged(*args, **kwargs):
            self.phase = phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = after

        return tagged


def _model(width: int, layers: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def _tensor_bytes(tree) -> int:
    import optree

    total = 0
    for x in optree.tree_leaves(tree, namespace="torch"):
        if isinstance(x, torch.Tensor):
            x = x.to_local() if hasattr(x, "to_local") else x
            total += x.numel() * x.element_size()
    return total


def _worker(rank: int, world: int, init_file: str, out: str, modes: list[str], cfg: dict) -> None:
    """Every mode of ``modes`` in turn in this process (one, except ``--smoke``: a peak is then not
    measured, it would be that of all of them)."""
    import vmapdp
    from vmapdp import distributed as vdist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    if cfg.get("eager_noise"):  # the fused noise kernel's compile costs a fresh process seconds; eager is a few ulps apart
        vmapdp.noise.gaussian._fused_ok = False
    try:
        for mode in modes:
            row = _run_mode(rank, world, mode, cfg)
            if len(modes) > 1:
                row["peak_kib"] = None
            with open(os.path.join(out, f"{mode}-{world}-{rank}.json"), "w") as f:
                json.dump(row, f)
    finally:
        vdist.shutdown()


def _run_mode(rank: int, world: int, mode: str, cfg: dict) -> dict:
    import vmapdp
    from vmapdp import distributed as vdist
    from vmapdp.data import PoissonSampler, gather
    from vmapdp.sharding import Sharding, local_bytes

    n, q, classes = cfg["samples"], cfg["sample_rate"], 10
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(n, cfg["width"], generator=g), torch.randint(0, classes, (n,), generator=g))
    total = cfg["warmup"] + cfg["repeats"] + 1  # the last step: the heap probe (not timed)
    sampler = PoissonSampler(n, q, total, key=b"benchmark-sampler")
    probe = _HeapProbe()
    vmapdp.noise.keyed_normal((64,), b"warm-up", leaf=0)  # the noise kernel's one-time compile, before the baseline
    base = _rss_kib("VmRSS")
    model = _model(cfg["width"], cfg["layers"], classes)
    times = []
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def fsdp_step(indices, mask):
            x, y = gather(data, indices[mask])
            loss = F.cross_entropy(model(x), y, reduction="sum") / (n * q)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i, (indices, mask) in enumerate(vdist.sharded(sampler)):
            if i == total - 1:
                with probe:
                    fsdp_step(indices, mask)
                continue
            t0 = time.perf_counter()
            fsdp_step(indices, mask)
            times.append(time.perf_counter() - t0)
        state_bytes = _tensor_bytes(list(model.parameters())) + _tensor_bytes(opt.state_dict()["state"])
    else:
        apply, params, buffers = vmapdp.functionalize(model)
        del model

        def loss_fn(p, b, sample):
            x, y = sample
            return F.cross_entropy(apply(p, b, x[None]), y[None])

        sharding = None if mode == "ddp" else Sharding(params, unshard="use" if mode == "sharded-use" else "step")
        opt = vmapdp.optim.adamw(1e-3)
        step = vmapdp.make_train_step(
            loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=n * q, sample_rate=q,
            physical_batch_size=vdist.local_capacity(sampler.capacity), method="ghost", compile=False,
            distributed=True, sharding=sharding,
        )
        # a seed per mode, the same on every rank: the modes run one after another in one process, and
        # one seed for all would release their different sums under one noise key (vmapdp.noise.spent)
        state = vmapdp.init_train_state(params, opt, seed=1 + MODES.index(mode), sharding=sharding)
        del params
        if sharding is not None:  # the probe's phases (instance attributes: the step looks them up on each call)
            sharding.step_params = probe.tagging("gather", sharding.step_params, "clip")
            sharding.reduce_step = probe.tagging("reduce", sharding.reduce_step, "update")
        for i, (indices, mask) in enumerate(vdist.sharded(sampler)):
            if i == total - 1:
                with probe:
                    state, _ = step(state, gather(data, indices), mask, buffers)
                continue
            t0 = time.perf_counter()
            state, _ = step(state, gather(data, indices), mask, buffers)
            times.append(time.perf_counter() - t0)
        state_bytes = local_bytes(state.params) + local_bytes(state.opt_state)
    peak = _rss_kib("VmHWM") - base
    param_bytes = 4 * sum(p.numel() for p in _model(cfg["width"], cfg["layers"], classes).parameters())
    transient = None if probe.peak is None else probe.peak / param_bytes
    phases = {k: v / param_bytes for k, v in probe.peaks.items()} if mode.startswith("sharded") and probe.peak is not None else None
    return {"rank": rank, "state_bytes": state_bytes, "peak_kib": peak, "times": times[cfg["warmup"]:], "transient": transient, "phases": phases}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=None, help="default: 1,2,4 (--quick, --smoke: 1,2)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--sample-rate", type=float, default=1 / 64)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="worlds 1, 2; 2 layers of width 64; 2 timed steps")
    parser.add_argument("--smoke", action="store_true", help="worlds 1, 2; 1 layer of width 16; 1 step; every mode in one set of processes; no peak")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.repeats, args.warmup, args.samples = 64, 2, 2, 1, 256
    if args.smoke:
        args.width, args.layers, args.repeats, args.warmup, args.samples, args.sample_rate = 16, 1, 1, 0, 64, 1 / 8
    args.worlds = args.worlds or ("1,2" if args.quick or args.smoke else "1,2,4")
    cfg = {"eager_noise": args.smoke, "width": args.width, "layers": args.layers, "samples": args.samples, "sample_rate": args.sample_rate, "repeats": args.repeats, "warmup": args.warmup}
    params = sum(p.numel() for p in _model(args.width, args.layers, 10).parameters())
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}) + head: {params:,} params; Adam; gloo on {os.cpu_count()} CPUs; torch {torch.__version__}")
    print("| mode | world | state MiB / rank | x world | peak MiB / rank | median ms / step | step transient (x params) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        modes = args.modes.split(",")
        for world in (int(w) for w in args.worlds.split(",")):
            if args.smoke:  # one set of processes for all modes
                mp.spawn(_worker, args=(world, os.path.join(out, f"init-{world}"), out, modes, cfg), nprocs=world, join=True)
            for mode in modes:
                if not args.smoke:  # a fresh set of processes per mode: each peak is that mode's own
                    mp.spawn(_worker, args=(world, os.path.join(out, f"init-{mode}-{world}"), out, [mode], cfg), nprocs=world, join=True)
                ranks = []
                for r in range(world):
                    with open(os.path.join(out, f"{mode}-{world}-{r}.json")) as f:
                        ranks.append(json.load(f))
                row = {
                    "mode": mode,
                    "world": world,
                    "params": params,
                    "state_mib": max(r["state_bytes"] for r in ranks) / 2**20,
                    "peak_mib": None if ranks[0]["peak_kib"] is None else max(r["peak_kib"] for r in ranks) / 1024,
                    "ms": 1e3 * statistics.median(ranks[0]["times"]),
                    "transient": None if ranks[0]["transient"] is None else max(r["transient"] for r in ranks),
                    "phases": ranks[0]["phases"],
                }
                rows.append(row)
                peak = "n/a" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
                transient = "n/a" if row["transient"] is None else f"{row['transient']:.2f}"
                if row["phases"]:
                    transient += " (" + ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items()) + ")"
                print(f"| {mode} | {world} | {row['state_mib']:.2f} | {row['state_mib'] * world:.2f} | {peak} | {row['ms']:.1f} | {transient} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
