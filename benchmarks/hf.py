"""DP fine-tuning steps of Hugging Face ``transformers`` models: time and peak memory per step.

Models (random weights from a config, nothing downloaded; ``attn_implementation="eager"``, as
vmap needs on CPU): ``gpt2`` (``GPT2LMHeadModel``, causal LM loss), ``bert``
(``BertForSequenceClassification``, 2 classes), ``llama`` (``LlamaForCausalLM``, grouped-query
attention). Sizes (``--size``):

* ``cpu`` (default): hidden 128, 2 layers, 4 heads, vocabulary 512, sequences of 64, batch 16;
* ``gpt2-small``: GPT-2 small's shape (hidden 768, 12 layers, 12 heads, vocabulary 50257,
  position table 1024), sequences of 128, batch 32: the issue's target point, for a GPU;
* ``llama-1b``: a 1B-class Llama (hidden 2048, 16 layers, 32 heads and 16 key-value heads,
  MLP 8192, Llama 3's vocabulary of 128256, untied head: 1.5B weights), sequences of 128, batch
  8: for a GPU with ~80 GB (``--models llama --vmapdp-method ghost``: per-sample gradients of
  1.5B weights do not fit);
* ``--smoke``: hidden 16, 1 layer, 2 heads, vocabulary 50, sequences of 8, batch 4 (the suite).

Two set-ups of the same weights: ``full`` (every weight trainable) and ``lora``
(``vmapdp.nn.add_lora(model, rank=8)``: every linear and GPT-2 ``Conv1D`` frozen under a rank-8
adapter, everything else frozen). Batches: random tokens, attention mask all ones, labels the
tokens (LM) or random classes.

Methods, interleaved on the same batch (``benchmarks/per_sample_grads.py``'s timing helpers):

* ``torch`` / ``torch_compiled``: the non-private step (``model(**batch).loss.backward()``, SGD
  over the trainable weights), eager and under ``torch.compile``: the baselines of the ratios;
* ``vmapdp_eager`` / ``vmapdp_compiled``: ``vmapdp.make_train_step`` on ``vmapdp.hf.loss_fn(model)``
  (per-sample losses with per-sample masks; ``method="auto"``: ghost clipping or vmap, whichever its
  first-step race finds faster, or the method ``--vmapdp-method`` names; noise; SGD), with
  ``compile=False`` / ``True``;
* ``opacus_hooks``: Opacus's ``PrivacyEngine.make_private`` on the same module (where it runs on
  the model; a method that fails is reported with its error and left empty).

``--memory`` runs each method (the compiled ones excepted: their first step is the compiler's) in
a fresh process: one warm-up step (vmapdp's first step races ghost clipping against vmap, which
materialises per-sample gradients), then the peak is reset (Linux ``VmHWM`` through
``/proc/self/clear_refs``; CUDA's peak counter) and two more steps run: the steady-state peak of
the step, above a process that only built the model, with the method vmapdp's ``"auto"`` chose.
Results as JSON with ``--out``.

    python benchmarks/hf.py --memory --out benchmarks/results_hf_<date>_cpu.json
    python benchmarks/hf.py --size gpt2-small --models gpt2 --memory   # on a GPU
    python benchmarks/hf.py --smoke
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
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent

sys.path.insert(0, str(HERE))
import train_step  # noqa: E402  (the interleaved timing and CPU-load helpers, and the VmHWM probe)

psg_bench = train_step.psg_bench
_vm_hwm_mib = train_step._vm_hwm_mib

MODELS = ("gpt2", "bert", "llama")
VARIANTS = ("full", "lora")
METHODS = ("torch", "torch_compiled", "vmapdp_eager", "vmapdp_compiled", "opacus_hooks")
HEADERS = {
    "torch": "non-private eager",
    "torch_compiled": "non-private compiled",
    "vmapdp_eager": "vmapdp eager",
    "vmapdp_compiled": "vmapdp compiled",
    "opacus_hooks": "Opacus hooks",
}
LR, CLIP, SIGMA = 1e-3, 1.0, 1.0
VMAPDP_METHOD = "auto"  # make_train_step(method=) of the vmapdp rows (--vmapdp-method)
NORM_CHUNK_SIZE: int | None = None  # make_train_step(norm_chunk_size=) with two_pass (--norm-chunk-size)
SIZES = {
    "cpu": {"hidden": 128, "layers": 2, "heads": 4, "vocab": 512, "positions": 64, "seq": 64, "batch": 16, "rank": 8},
    "gpt2-small": {"hidden": 768, "layers": 12, "heads": 12, "vocab": 50257, "positions": 1024, "seq": 128, "batch": 32, "rank": 8},
    "llama-1b": {"hidden": 2048, "layers": 16, "heads": 32, "vocab": 128256, "positions": 2048, "seq": 128, "batch": 8, "rank": 8},
    "smoke": {"hidden": 16, "layers": 1, "heads": 2, "vocab": 50, "positions": 8, "seq": 8, "batch": 4, "rank": 4},
}


def build_model(name: str, variant: str, cfg: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """The ``name`` model of size ``cfg`` (``full``), or its LoRA copy (``lora``), same weights per seed."""
    import transformers

    import vmapdp.nn as vnn

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    h, n, heads, vocab, pos = cfg["hidden"], cfg["layers"], cfg["heads"], cfg["vocab"], cfg["positions"]
    common = dict(vocab_size=vocab, pad_token_id=0, attn_implementation="eager")
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=h, n_layer=n, n_head=heads, n_positions=pos, bos_token_id=0, eos_token_id=0,
                                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common))
    elif name == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=4 * h, max_position_embeddings=pos,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2, **common))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), intermediate_size=4 * h,
            max_position_embeddings=pos, bos_token_id=0, eos_token_id=0, **common))
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    model.train()
    if variant == "full":
        return model
    if variant == "lora":
        return vnn.add_lora(model, cfg["rank"], 2.0 * cfg["rank"], generator=torch.Generator().manual_seed(seed + 1))
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def make_batch(name: str, batch_size: int, cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg["vocab"], (batch_size, cfg["seq"]), generator=g)
    labels = torch.randint(0, 2, (batch_size,), generator=g) if name == "bert" else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, a storage counted once (a LoRA layer's frozen weight
    is a parameter of its own on the base layer's storage: GPT-2's lm_head on the tied wte)."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    return trainable, sum(p.numel() for p in unique) - trainable


def build_step(method: str, name: str, variant: str, batch_size: int, device: torch.device, cfg: dict[str, Any]) -> Callable[[], Any]:
    """A zero-argument function that runs one training step of ``method`` on a fixed batch."""
    import vmapdp

    model = build_model(name, variant, cfg).to(device)
    batch = {k: v.to(device) for k, v in make_batch(name, batch_size, cfg).items()}

    if method in ("torch", "torch_compiled"):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        forward = torch.compile(model) if method == "torch_compiled" else model

        def run():
            opt.zero_grad(set_to_none=True)
            forward(**batch).loss.backward()
            opt.step()

        return run

    if method.startswith("vmapdp"):
        apply, params, buffers, loss_fn = vmapdp.hf.loss_fn(model)
        sgd = vmapdp.optim.sgd(LR)
        step = vmapdp.make_train_step(
            loss_fn, sgd, l2_clip_norm=CLIP, noise_multiplier=SIGMA, expected_batch_size=float(batch_size),
            sample_rate=0.01, compile=method == "vmapdp_compiled", method=VMAPDP_METHOD,
            **({"norm_chunk_size": NORM_CHUNK_SIZE} if VMAPDP_METHOD == "two_pass" and NORM_CHUNK_SIZE else {}),
        )
        box = {"state": vmapdp.init_train_state(params, sgd, seed=zlib.crc32(method.encode()))}  # its own noise: one key is released once (vmapdp.noise.spent)
        mask = torch.ones(batch_size, dtype=torch.bool, device=device)

        def run():
            box["state"], _ = step(box["state"], batch, mask, buffers)

        run.chosen = step.chosen_methods  # type: ignore[attr-defined]  (what "auto" chose, per chunk shape)
        return run

    if method != "opacus_hooks":
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    from opacus import PrivacyEngine

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    data = torch.utils.data.TensorDataset(*batch.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        omodel, opt, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size),
            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
        )

    def run():
        opt.zero_grad(set_to_none=True)
        omodel(**batch).loss.backward()
        opt.step()

    return run


def _reset_peak() -> bool:
    """Reset this process's peak memory to its current use: CUDA's peak counter, or on Linux
    VmHWM (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0). False where that cannot be done."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_memory_mib(method: str, name: str, variant: str, batch_size: int, device: torch.device, cfg: dict[str, Any]) -> tuple[float | None, str | None]:
    """Steady-state peak memory of ``method``, above a process that only built the model, and the
    method vmapdp's step chose (None for the others), in a fresh process: one warm-up step (for
    vmapdp ``method="auto"``'s race, in which vmap materialises per-sample gradients, and the
    probe), then the peak is reset (:func:`_reset_peak`) and 2 more steps run. The memory the
    warm-up left held (the train state, allocator caches) counts; its transient peak does not.
    None where the peak could not be reset (then nothing is reported rather than the race's peak)."""
    code = (
        "import sys, json, warnings, torch; warnings.simplefilter('ignore'); sys.path.insert(0, {here!r});"
        "import hf as b;\n"
        "try:\n    import opacus\nexcept ImportError:\n    pass\n"
        "b.VMAPDP_METHOD = {vm!r}; b.NORM_CHUNK_SIZE = {ncs!r}; dev = torch.device({dev!r}); run = b.build_step({m!r}, {name!r}, {v!r}, {bs}, dev, {cfg!r});"
        "[run() for _ in range({warm})]; ok = b._reset_peak();"
        "[run() for _ in range({n})];"
        "chosen = sorted(set(getattr(run, 'chosen', {{}}).values())) or None;"
        "print(json.dumps([ok, torch.cuda.max_memory_allocated() / 2**20 if dev.type == 'cuda' else b._vm_hwm_mib(), chosen]))"
    )
    out, chosen = {}, None
    for m in ("none", method) if device.type != "cuda" else (method,):
        src = code.format(here=str(HERE), dev=str(device), m="torch" if m == "none" else m, name=name, v=variant, bs=batch_size, cfg=cfg, vm=VMAPDP_METHOD, ncs=NORM_CHUNK_SIZE,
                          warm=0 if m == "none" else 1, n=0 if m == "none" else 2)
        proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(f"  memory of {method}/{name}/{variant} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None, None
        ok, peak, chosen_m = json.loads(proc.stdout.strip().splitlines()[-1])
        if not ok:
            print(f"  memory of {method}/{name}/{variant}: the peak could not be reset after the warm-up step; not reported", file=sys.stderr)
            return None, None
        out[m] = peak
        chosen = chosen_m if m == method else chosen
    return out[method] - out.get("none", 0.0), (",".join(chosen) if chosen else None)


def bench(name: str, variant: str, batch_size: int, args: argparse.Namespace, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    trainable, frozen = count(build_model(name, variant, cfg))
    # memory first, each method in a fresh process, while this one holds no step: at GPT-2 small a
    # timed ghost step leaves ~11 GiB with this process, and a memory process beside it was killed
    peak, chosen = {}, {}
    for m in args.methods if args.memory else ():
        if not m.endswith("compiled"):
            peak[m], ran = _peak_memory_mib(m, name, variant, batch_size, device, cfg)
            if ran:
                chosen[m] = ran
    fns, first, failed = {}, {}, {}
    for m in args.methods:
        t0 = time.perf_counter()
        try:
            fn = build_step(m, name, variant, batch_size, device, cfg)
            fn()
        except Exception as err:  # report, don't hide: a method that cannot run gets an empty cell and its error
            failed[m] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if str(err) else type(err).__name__
            print(f"  {m}: failed: {failed[m]}", file=sys.stderr)
            continue
        first[m] = time.perf_counter() - t0
        fns[m] = fn
        if getattr(fn, "chosen", None) and m not in chosen:  # ("auto"'s choice in this process, where no memory run named it)
            chosen[m] = ",".join(sorted(set(fn.chosen.values())))
    timings = psg_bench._measure_interleaved(fns, device, repeats=args.repeats, warmup=args.warmup, max_seconds=args.max_seconds) if fns else {}
    if args.profile is not None:
        train_step.profile_steps(fns, device, args.profile or None, f"{name}_{variant}_{batch_size}")
    row: dict[str, Any] = {
        "model": name,
        "variant": variant,
        "trainable": trainable,
        "frozen": frozen,
        "batch": batch_size,
        "seq": cfg["seq"],
        "ms": {m: t["ms"] for m, t in timings.items()},
        "min_ms": {m: t["min_ms"] for m, t in timings.items()},
        "repeats": {m: t["repeats"] for m, t in timings.items()},
        "first_call_s": first,
        "failed": failed,
        "peak_mib": {m: v for m, v in peak.items() if m in fns},
        "chosen": {m: v for m, v in chosen.items() if m in fns},
    }
    return row


def markdown(rows: list[dict[str, Any]], methods: list[str]) -> str:
    head = ["model", "set-up", "trainable", "batch x T"] + [HEADERS[m] for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|" + "---:|" * len(methods)]
    for r in rows:
        base = r["ms"].get("torch")
        cells = []
        for m in methods:
            ms = r["ms"].get(m)
            if ms is None:
                cells.append("failed" if m in r["failed"] else "–")
                continue
            cell = f"{ms:.1f} ({ms / base:.2f}x)" if base else f"{ms:.1f}"
            if r["peak_mib"].get(m) is not None:
                cell += f", {r['peak_mib'][m]:.0f} MiB"
            if r.get("chosen", {}).get(m):
                cell += f" ({r['chosen'][m]})"
            cells.append(cell)
        setup = "LoRA adapters" if r["variant"] == "lora" else "full fine-tuning"
        lines.append(f"| {r['model']} | {setup} | {r['trainable']:,} | {r['batch']} x {r['seq']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--size", default="cpu", choices=[s for s in SIZES if s != "smoke"])
    p.add_argument("--batch-size", type=int, default=None, help="default: the size's")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=20.0, help="per method and configuration, once 3 rounds are done")
    p.add_argument("--memory", action="store_true", help="also measure peak memory per method (a fresh process each)")
    p.add_argument("--smoke", action="store_true", help="the suite's run: a tiny config, batch 4, 2 repeats, nothing compiled")
    p.add_argument("--vmapdp-method", default="auto", choices=["auto", "ghost", "vmap", "two_pass"], help="make_train_step(method=) of the vmapdp rows")
    p.add_argument("--norm-chunk-size", type=int, default=None, help="with --vmapdp-method two_pass: per-sample grads this many samples at a time")
    p.add_argument("--out", default=None, help="write the rows (and the set-up) to this JSON file")
    p.add_argument("--profile", nargs="?", const="", default=None, metavar="DIR", help="after timing, profile one step of each method (tables into DIR, or printed)")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    global VMAPDP_METHOD, NORM_CHUNK_SIZE
    VMAPDP_METHOD, NORM_CHUNK_SIZE = args.vmapdp_method, args.norm_chunk_size
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {','.join(METHODS)}")
    cfg = dict(SIZES["smoke" if args.smoke else args.size])
    if args.smoke:
        args.repeats, args.warmup, args.max_seconds = 2, 1, 1.0
        args.methods = [m for m in args.methods if not m.endswith("compiled")]
    batch_size = args.batch_size or cfg["batch"]
    warnings.simplefilter("ignore", UserWarning)  # Opacus's backward hooks warn on every step
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# Hugging Face DP steps, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"# size: {cfg}")
    rows = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            print(f"{name} {variant}, batch {batch_size} ...", file=sys.stderr, flush=True)
            rows.append(bench(name, variant, batch_size, args, device, cfg))
    print("\nmedian ms per step (ratio to the non-private eager step of the same set-up)"
          + (", steady-state peak memory above the model (after a warm-up step), the method vmapdp chose" if args.memory else ""))
    print(markdown(rows, args.methods))
    for r in rows:
        for m, err in r["failed"].items():
            print(f"- {r['model']} {r['variant']}: {HEADERS[m]} failed: {err}")
    if args.out:
        psg_bench.write_results(args.out, rows, device=where, threads=torch.get_num_threads(), argv=argv, model=cfg)
    return rows


if __name__ == "__main__":
    main()
