"""Cold and warm compile time of the compiled DP step, per model, each in a fresh process.

For each model (``models.py``'s four and a tiny GPT-2) and each ``method``, one child process
builds ``vmapdp.make_train_step(compile=True, method=...)`` and times:

* ``isa_probe_s``: Inductor's one-time check of the CPU's vector instruction sets
  (``torch._inductor.cpu_vec_isa.pick_vec_isa``: one C++ build per candidate, kept in the cache
  directory, then a load test in a subprocess per candidate, every process), which the first CPU
  compile of a process pays, whatever it compiles; timed on its own so that it is not charged to
  the noise kernel;
* ``noise_compile_s``: the first keyed draw (``vmapdp.noise.keyed_normal``), which compiles the
  Box-Muller transform (once per process) minus a second draw;
* ``race_s``: ``"auto"``'s race (``vmapdp.clipped.race``, wrapped with a timer), zero for a named method;
* ``first_step_s``: the first step, noise compile excluded (race, dynamo trace, Inductor compile
  or cache load, first run); ``compile_s`` of it in ``torch.compile`` (dynamo's
  ``_compile.compile_inner``, all graphs), ``backend_s`` of that in AOTAutograd and Inductor
  (``OutputGraph.call_user_compiler``); ``trace_s`` of ``compile_s`` in dynamo's bytecode tracing
  (``bytecode_tracing``), ``cpp_s`` the C++ compiler's seconds (``compile_file``, summed over
  Inductor's ``compile_threads`` threads, so it can exceed the wall time) for ``kernels`` builds
  (one per CPU kernel, 0 when served by the cache);
* ``second_step_s`` and ``steady_ms`` (median of ``--repeats`` later steps), and ``eager_ms``,
  the same step with ``compile=False`` (median, interleaved with the compiled one);
* ``graphs``: dynamo's ``unique_graphs`` after the first step; ``recompiles``: graphs added by the
  later steps (each on a new batch and a new mask of the same shape); ``chosen``: what auto ran.

``cold``: the child gets an empty ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's FX graph cache and
AOTAutograd's cache start empty). ``warm``: a second child with the same directory, as a second
run of a training script finds torch's default cache directory. Dynamo's tracing is never cached
across processes; what the warm run saves is Inductor's code generation and C++ compilation.

    python benchmarks/compile_time.py                       # all models, batch 16, method auto
    python benchmarks/compile_time.py --models mnist --methods auto,ghost,vmap --batch-size 64
    python benchmarks/compile_time.py --smoke               # mnist, batch 4, one repeat
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # models.py
MODEL_NAMES = ("mnist", "cifar10", "embedding", "lstm", "gpt2")
# torch._dynamo.utils.compilation_time_metrics key -> row column (seconds in the first step)
PHASES = {"_compile.compile_inner": "compile_s", "OutputGraph.call_user_compiler": "backend_s", "bytecode_tracing": "trace_s", "compile_file": "cpp_s"}


def _problem(name: str, batch_size: int, seq_len: int):
    """``(loss_fn, params, buffers, make_batch)`` for one model; ``make_batch(seed) -> batch``."""
    import torch

    import vmapdp

    if name == "gpt2":
        import transformers

        from vmapdp import hf

        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        _, params, buffers, loss_fn = hf.loss_fn(transformers.GPT2LMHeadModel(cfg).eval())

        def make_batch(seed: int):
            ids = torch.randint(1, 100, (batch_size, 16), generator=torch.Generator().manual_seed(seed))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

        return loss_fn, params, buffers, make_batch
    import models
    spec = models.MODELS[name]
    vmodel, _ = models.for_vmapdp(spec.build())
    apply, params, buffers = vmapdp.functionalize(vmodel)
    extra = {"seq_len": seq_len} if name in ("embedding", "lstm") else {}
    return models.one_sample_loss(apply), params, buffers, lambda seed: spec.make_batch(batch_size, generator=torch.Generator().manual_seed(seed), **extra)


def child(name: str, method: str, batch_size: int, seq_len: int, repeats: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    t0 = time.perf_counter()
    import torch
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401  (Inductor's import, here rather than in the first compile)

    import vmapdp
    from vmapdp import clipped

    import_s = time.perf_counter() - t0
    race_s = [0.0]
    real_race = clipped.race

    def timed_race(runs, device):
        start = time.perf_counter()
        try:
            return real_race(runs, device)
        finally:
            race_s[0] += time.perf_counter() - start

    clipped.race = timed_race
    start = time.perf_counter()
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()
    isa_probe_s = time.perf_counter() - start
    start = time.perf_counter()
    vmapdp.noise.keyed_normal((4,), key=b"warm-up")
    first = time.perf_counter() - start
    start = time.perf_counter()
    vmapdp.noise.keyed_normal((4,), key=b"warm-up")
    noise_compile_s = first - (time.perf_counter() - start)

    loss_fn, params, buffers, make_batch = _problem(name, batch_size, seq_len)
    sgd = vmapdp.optim.sgd(0.05)
    cfg = dict(l2_clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=float(batch_size), sample_rate=0.01, method=method)
    step = vmapdp.make_train_step(loss_fn, sgd, compile=True, **cfg)
    eager = vmapdp.make_train_step(loss_fn, sgd, compile=False, **cfg)
    batches = [make_batch(s) for s in range(repeats + 2)]
    masks = [torch.rand(batch_size, generator=torch.Generator().manual_seed(s)) < 0.9 for s in range(repeats + 2)]
    masks[0][:] = True
    state = vmapdp.init_train_state(params, sgd, seed=0)

    metrics = torch._dynamo.utils.compilation_time_metrics
    spent = lambda name: sum(metrics.get(name, ()))  # noqa: E731
    before = {k: spent(k) for k in PHASES}
    kernels_before = len(metrics.get("compile_file", ()))
    start = time.perf_counter()
    state, _ = step(state, batches[0], masks[0], buffers)
    first_step_s = time.perf_counter() - start
    phases = {name: round(spent(k) - before[k], 3) for k, name in PHASES.items()}
    kernels = len(metrics.get("compile_file", ())) - kernels_before
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    start = time.perf_counter()
    state, _ = step(state, batches[1], masks[1], buffers)
    second_step_s = time.perf_counter() - start
    e_state = state._replace(noise_seed=state.noise_seed + 1)  # its own noise (one key is released once: vmapdp.noise.spent)
    e_state, _ = eager(e_state, batches[1], masks[1], buffers)  # eager's own race and plan, untimed
    compiled_ms, eager_ms = [], []
    for b, m in zip(batches[2:], masks[2:]):  # interleaved: a change in load hits both alike
        start = time.perf_counter()
        state, _ = step(state, b, m, buffers)
        compiled_ms.append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        e_state, _ = eager(e_state, b, m, buffers)
        eager_ms.append(1e3 * (time.perf_counter() - start))
    return {
        "model": name,
        "method": method,
        "batch_size": batch_size,
        "import_s": round(import_s, 3),
        "isa_probe_s": round(isa_probe_s, 3),
        "noise_compile_s": round(noise_compile_s, 3),
        "race_s": round(race_s[0], 3),
        "first_step_s": round(first_step_s, 3),
        **phases,
        "kernels": kernels,
        "second_step_s": round(second_step_s, 3),
        "steady_ms": round(statistics.median(compiled_ms), 2),
        "eager_ms": round(statistics.median(eager_ms), 2),
        "graphs": graphs,
        "recompiles": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs,
        "chosen": sorted(set(getattr(step, "chosen_runs", step.chosen_methods).values())) or [method],
    }


def run_child(name: str, method: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.root or str(HERE.parent), env.get("PYTHONPATH")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, method, str(args.batch_size), str(args.seq_len), str(args.repeats)]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"compile_time child {name}/{method} failed:\n{out.stderr[-4000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_s"] = round(wall, 3)
    row["root"] = args.root or str(HERE.parent)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | method (ran) | cache | first step s | race s | compile s | trace s | C++ s (kernels) | ISA probe s | noise compile s | process s | steady ms | eager ms | graphs | recompiles |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} ({','.join(r['chosen'])}) | {r['cache']} | {r['first_step_s']:.1f} | {r['race_s']:.1f} | {r.get('compile_s', math.nan):.1f} | "
            f"{r.get('trace_s', math.nan):.1f} | {r.get('cpp_s', math.nan):.1f} ({r.get('kernels', '?')}) | {r.get('isa_probe_s', math.nan):.1f} | "
            f"{r['noise_compile_s']:.1f} | {r['process_s']:.1f} | {r['steady_ms']:.1f} | {r['eager_ms']:.1f} | {r['graphs']} | {r['recompiles']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES))
    p.add_argument("--methods", default="auto", help="comma-separated: auto, ghost, vmap")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample (embedding, lstm)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="mnist only, batch 4, one repeat")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--root", default=None, help="import vmapdp from this checkout (to compare commits); default: this one")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the children; default: torch's")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.batch_size, args.repeats = "mnist", 4, 1
    rows = []
    for name in args.models.split(","):
        for method in args.methods.split(","):
            with tempfile.TemporaryDirectory(prefix="vmapdp-compile-cache-") as cache:
                for cache_state in ("cold", "warm"):
                    row = dict(run_child(name, method, args, cache), cache=cache_state)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(markdown(rows))
    if args.out:
        import torch

        meta = {"torch": torch.__version__, "platform": platform.platform(), "cpus": os.cpu_count(), "args": vars(args)}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))))
    else:
        main()
