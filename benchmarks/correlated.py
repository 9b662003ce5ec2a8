"""Correlated noise in the DP step: time and memory per mechanism against plain DP-SGD.

For each model of ``models.py`` and each batch size it times, on the same weights and batch:

* ``torch``: the non-private step (``zero_grad``, mean loss, ``backward``, ``SGD.step``);
* ``DP-SGD``: ``vmapdp.make_train_step`` with the default Gaussian privatizer, on as many rows as
  the correlated mechanisms step (their sampler's capacity; ``batch_size`` of them real);
* ``banded b``: ``privatizer=vmapdp.mf.correlated_noise(BandedToeplitz)`` with band ``b``
  (``b - 1`` buffers of the params' size), a ``CyclicPoissonSampler`` of ``b`` groups;
* ``BLT k``: a ``BufferedToeplitz`` with ``k`` buffers (``k`` buffers of the params' size).

Every vmapdp step clips with the same ``--method`` and adds its noise after the sum, so the
differences are the noise: the keyed draw DP-SGD makes plus the streaming recursion over the
buffers (and, for the correlated mechanisms, their sampler's draw of each step's indices,
under 1.1 ms here at batch 256 and ``b = 16``: the step refuses to run ahead of its sampler, so
the timed step draws them, then runs on the fixed batch). ``state MiB`` is the noise state (``TrainState.noise_state``), exact; ``--memory``
measures each mechanism's peak memory in a fresh process (peak RSS on CPU,
``max_memory_allocated`` on CUDA) above a process that only built the model. Times are medians
of interleaved rounds; ratios are to the non-private step.

    python benchmarks/correlated.py                                   # MNIST and CIFAR-10 CNNs, batch 64/256
    python benchmarks/correlated.py --models cifar10 --batch-sizes 256 --memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_step  # noqa: E402  (the step builders, interleaved timing and the fresh-process memory probe)

models, psg_bench = train_step.models, train_step.psg_bench

MECHANISMS = ("torch", "dpsgd", "banded4", "banded16", "blt4")
HEADERS = {"torch": "torch (non-private)", "dpsgd": "DP-SGD", "banded4": "banded b=4", "banded16": "banded b=16", "blt4": "BLT 4 buffers"}
LR, CLIP, SIGMA = 0.1, 1.0, 1.0
RUN_STEPS = 100_000  # the run the correlated noise is built for: longer than any timing loop


def strategy(mechanism: str) -> Any:
    """The strategy of a mechanism (fixed coefficients: the time does not depend on their values)."""
    from vmapdp import mf

    if mechanism.startswith("banded"):
        return mf.sqrt_prefix(int(mechanism.removeprefix("banded")))
    if mechanism.startswith("blt"):
        k = int(mechanism.removeprefix("blt"))
        return mf.BufferedToeplitz(tuple(1.0 - 0.5**(i + 1) for i in range(k)), tuple(0.1 for _ in range(k)))
    raise ValueError(mechanism)


def build_step(mechanism: str, name: str, batch_size: int, device: torch.device, *, method: str, compile: bool, seq_len: int) -> Callable[[], Any]:
    """A zero-argument function that runs one training step of ``mechanism`` on a fixed batch;
    ``.state_bytes``: the bytes of its noise state."""
    if mechanism == "torch":
        run = train_step.build_step("torch", name, batch_size, device, seq_len=seq_len)
        run.state_bytes = 0
        return run
    import vmapdp
    from vmapdp.data import CyclicPoissonSampler, default_capacity

    spec = models.MODELS[name]
    model = spec.build().to(device)
    x, y = spec.make_batch(batch_size, generator=torch.Generator().manual_seed(0), **({"seq_len": seq_len} if name in ("embedding", "lstm") else {}))
    x, y = x.to(device), y.to(device)
    vmodel, _ = models.for_vmapdp(model)
    apply, params, buffers = vmapdp.functionalize(vmodel)
    sgd = vmapdp.optim.sgd(LR)
    common = dict(l2_clip_norm=CLIP, noise_multiplier=SIGMA, expected_batch_size=float(batch_size), method=method, compile=compile)
    if mechanism == "dpsgd":
        step = vmapdp.make_train_step(models.one_sample_loss(apply), sgd, sample_rate=0.01, **common)
        privatizer = sampler = None
        # the rows the correlated mechanisms step (their sampler's capacity, batch_size real among them on
        # average): the same rows here, the first batch_size real, so that the clipping work is the same
        # (found by review: DP-SGD stepped batch_size rows, and the ratios charged the padding to the noise)
        rows = default_capacity(100 * batch_size, 0.01)
        x, y = spec.make_batch(rows, generator=torch.Generator().manual_seed(0), **({"seq_len": seq_len} if name in ("embedding", "lstm") else {}))
        x, y = x.to(device), y.to(device)
        mask = torch.arange(rows, device=device) < batch_size
    else:
        s = strategy(mechanism)
        cycle = getattr(s, "band", 16)  # banded: cycle >= band; BLT: participations 16 steps apart
        sampler = CyclicPoissonSampler(100 * batch_size * cycle, 0.01, cycle=cycle, steps=RUN_STEPS, key=b"bench")
        privatizer = vmapdp.mf.correlated_noise(s, steps=RUN_STEPS)
        step = vmapdp.make_train_step(models.one_sample_loss(apply), sgd, sampler=sampler, privatizer=privatizer, **common)
    box = {"state": vmapdp.init_train_state(params, sgd, seed=0, privatizer=privatizer)}
    if sampler is not None:  # the fixed rows, as many as the sampler's capacity (the draw's real rows among them)
        rows = sampler.capacity
        x, y = spec.make_batch(rows, generator=torch.Generator().manual_seed(0), **({"seq_len": seq_len} if name in ("embedding", "lstm") else {}))
        x, y = x.to(device), y.to(device)

    def run():
        m = mask if sampler is None else None
        if sampler is not None:
            # a correlated step follows its own sampler's draw (its position and its real rows are checked): the
            # first rows of the fixed batch, as many as the draw holds, stand for it
            _, drawn = sampler.sample()
            m = torch.arange(x.shape[0], device=device) < int(drawn.sum())
        box["state"], _ = step(box["state"], (x, y), m, buffers)

    noise_state = box["state"].noise_state
    run.state_bytes = sum(v.numel() * v.element_size() for v in noise_state["buffers"].values()) if noise_state else 0
    return run


def _peak_memory_mib(mechanism: str, name: str, batch_size: int, device: torch.device, *, method: str, seq_len: int) -> float | None:
    """Peak memory of 3 steps of ``mechanism`` in a fresh process, above a process that only built the model."""
    code = (
        "import sys, torch, warnings; warnings.simplefilter('ignore'); sys.path.insert(0, {here!r});"
        "import correlated as b; dev = torch.device({dev!r});"
        "run = b.build_step({m!r}, {n!r}, {bs}, dev, method={method!r}, compile=False, seq_len={sl});"
        "torch.cuda.reset_peak_memory_stats() if dev.type == 'cuda' else None;"
        "[run() for _ in range(3)];"
        "print(torch.cuda.max_memory_allocated() / 2**20 if dev.type == 'cuda' else b.train_step._vm_hwm_mib())"
    )
    out = {}
    for m in ("none", mechanism) if device.type != "cuda" else (mechanism,):
        src = code.format(here=str(HERE), dev=str(device), m="torch" if m == "none" else m, n=name, bs=batch_size, method=method, sl=seq_len)
        if m == "none":
            src = src.replace("[run() for _ in range(3)];", "")
        proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return None
        out[m] = float(proc.stdout.strip().splitlines()[-1])
    return out[mechanism] - out.get("none", 0.0)


def bench(name: str, batch_size: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    spec = models.MODELS[name]
    fns, state_mib = {}, {}
    for m in args.mechanisms:
        fn = build_step(m, name, batch_size, device, method=args.method, compile=args.compile, seq_len=args.seq_len)
        fn()  # compile / warm up, and "auto"'s race
        fns[m], state_mib[m] = fn, fn.state_bytes / 2**20
    timings = psg_bench._measure_interleaved(fns, device, repeats=args.repeats, warmup=args.warmup, max_seconds=args.max_seconds)
    row: dict[str, Any] = {"model": spec.title, "params": spec.expected_params, "batch": batch_size, "method": args.method, "compile": args.compile}
    row["ms"] = {m: t["ms"] for m, t in timings.items()}
    row["state_mib"] = state_mib
    row["peak_mib"] = {m: _peak_memory_mib(m, name, batch_size, device, method=args.method, seq_len=args.seq_len) for m in fns} if args.memory else {}
    return row


def markdown(rows: list[dict[str, Any]], mechanisms: list[str]) -> str:
    head = ["model", "params", "batch"] + [HEADERS[m] for m in mechanisms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["ms"].get("torch")
        cells = []
        for m in mechanisms:
            ms = r["ms"].get(m)
            cell = "–" if ms is None else (f"{ms:.1f} ({ms / base:.2f}x)" if base else f"{ms:.1f}")
            if r["state_mib"].get(m):
                cell += f", state {r['state_mib'][m]:.2f} MiB"
            if r["peak_mib"].get(m) is not None:
                cell += f", peak {r['peak_mib'][m]:.0f} MiB"
            cells.append(cell)
        lines.append(f"| {r['model']} | {r['params']:,} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mnist,cifar10")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--method", default="ghost", help="the clipping method of every vmapdp step")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=10.0)
    p.add_argument("--seq-len", type=int, default=models.SEQ_LEN)
    p.add_argument("--memory", action="store_true", help="also measure peak memory per mechanism (a fresh process each)")
    p.add_argument("--quick", action="store_true", help="smoke run: MNIST, batch 8, 2 repeats, no compile")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.mechanisms = args.mechanisms.split(",")
    warnings.simplefilter("ignore", UserWarning)
    if args.quick:
        args.models, args.batch_sizes, args.repeats, args.warmup, args.max_seconds, args.compile = "mnist", "8", 2, 1, 1.0, False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# correlated-noise step benchmark, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, method {args.method}, compile {args.compile}")
    rows = []
    for name in args.models.split(","):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            print(f"{models.MODELS[name].title}, batch {bs} ...", file=sys.stderr, flush=True)
            rows.append(bench(name, bs, args, device))
    print("\nmedian ms per step (ratio to the non-private torch step), noise state" + (", peak memory above the model" if args.memory else ""))
    print(markdown(rows, args.mechanisms))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
