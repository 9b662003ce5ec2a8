"""Smoke test of benchmarks/: the script runs, and the benchmark models are the published ones.

The timings themselves are never asserted (they depend on the machine); the benchmark is only
meaningful if its models have the sizes the papers report and vmapdp's per-sample gradients on
them are right, which is what this checks. Nothing is compiled here (too slow for a unit test).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import vmapdp
from vmapdp.testing import assert_grads_close, microbatch_grads

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    module_name = f"vmapdp_benchmarks_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


bench = _load("per_sample_grads")
models = _load("models")  # the same module object the script uses


def test_quick_run_mnist(capsys):
    rows = bench.main(["--quick", "--no-compile", "--models", "mnist", "--batch-sizes", "4"])
    assert len(rows) == 1
    row = rows[0]
    assert (row["model"], row["batch_size"], row["params"]) == ("mnist", 4, 26_010)
    for method in ("torch", "eager", "clip_eager", "microbatch", "opacus"):
        assert row[method]["ms"] > 0 and row[method]["repeats"] >= 1, method
    assert "compiled" not in row
    # the Opacus hooks and vmapdp computed the same per-sample gradients on the timed batch
    assert row["opacus_max_rel_diff"] < 1e-4
    out = capsys.readouterr().out
    assert "| MNIST CNN | 26,010 | 4 |" in out


@pytest.mark.parametrize(
    "name, expected",
    [("mnist", 26_010), ("cifar10", 605_226), ("embedding", 160_098), ("lstm", 1_081_002)],
)
def test_model_size_and_per_sample_grads(name, expected):
    spec = models.MODELS[name]
    net = spec.build(seed=0)
    assert models.num_params(net) == expected
    vnet, _ = models.for_vmapdp(net)  # the LSTM becomes vmapdp.nn.LSTM when available
    assert models.num_params(vnet) == expected
    assert models.num_params(models.for_opacus(net)) == expected

    # short sequences keep the 256-step LSTM loop out of the test time; sizes do not depend on them
    x, y = spec.make_batch(2, generator=torch.Generator().manual_seed(0), seq_len=32)
    assert x.dtype == (torch.int64 if name in ("embedding", "lstm") else torch.float32)

    apply, params, buffers = vmapdp.functionalize(vnet)
    grads = vmapdp.per_sample_grads(models.one_sample_loss(apply))(params, buffers, (x, y))

    # reference: the model exactly as torch defines it (torch.nn.LSTM), float64, one sample at a time
    ref_apply, ref_params, ref_buffers = vmapdp.functionalize(net)
    expected_grads = microbatch_grads(models.one_sample_loss(ref_apply), ref_params, ref_buffers, (x, y))
    assert grads.keys() == expected_grads.keys()
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


def test_train_step_quick_run_every_method(capsys):
    train_step = _load("train_step")
    rows = train_step.main(["--quick"])
    (row,) = rows
    for method in ("torch", "vmapdp_ghost", "vmapdp_vmap", "vmapdp_two_pass", "opacus_hooks"):
        assert row["ms"][method] > 0, method
    assert "| MNIST CNN | 26,010 | 8 |" in capsys.readouterr().out


def test_memory_benchmark_measures_a_fresh_process_and_finds_the_largest_batch():
    memory = _load("memory")
    mib = memory.train_step._peak_memory_mib("vmapdp_ghost", "mnist", 8, 16, torch.device("cpu"))
    assert mib is not None and 0 < mib < 2048
    table = {"torch": {32: 100.0, 64: 150.0}, "vmapdp ghost": {32: 110.0, 64: None}, "vmapdp vmap": {32: 900.0, 64: 1800.0}}
    assert memory.largest_within(table["torch"], 160) == 64
    assert memory.largest_within(table["vmapdp ghost"], 160) == 32
    assert memory.largest_within(table["vmapdp vmap"], 160) is None
    md = memory.markdown(table, [32, 64], 160)
    assert "| vmapdp vmap | 900 (9.00x) | 1800 (12.00x) | none measured |" in md


def test_adapters_quick_run(capsys):
    adapters = _load("adapters")
    rows = adapters.main(["--quick"])
    assert [(r["variant"], r["batch"]) for r in rows] == [("lora", 8), ("full", 8)]
    lora, full = rows
    # quick model: Linear(32->64), one block 64->128->64, Linear(64->10); rank-4 adapters on the four Linears
    assert full["trainable"] == 19_594 and full["frozen"] == 0
    assert lora["trainable"] == 4 * ((32 + 64) + (64 + 128) + (128 + 64) + (64 + 10)) and lora["frozen"] == full["trainable"]
    for row in rows:
        for method in ("torch", "vmapdp_eager", "opacus_hooks"):
            assert row["ms"][method] > 0 and row["repeats"][method] >= 1, (row["variant"], method)
        assert "vmapdp_compiled" not in row["ms"]
    out = capsys.readouterr().out
    assert "| LoRA adapters | 2,216 | 8 |" in out and "| full fine-tuning | 19,594 | 8 |" in out


def test_hf_benchmark_smoke_run(capsys):
    pytest.importorskip("transformers")
    rows = _load("hf").main(["--smoke", "--models", "gpt2"])
    assert [(r["model"], r["variant"], r["batch"], r["seq"]) for r in rows] == [("gpt2", "full", 4, 8), ("gpt2", "lora", 4, 8)]
    full, lora = rows
    # smoke GPT-2: hidden 16, 1 layer, vocabulary 50, 8 positions (lm_head tied to wte); rank-4
    # adapters on c_attn, attn c_proj, c_fc, mlp c_proj (Conv1D) and lm_head (Linear)
    assert full["trainable"] == 4_240 and full["frozen"] == 0
    assert lora["trainable"] == 4 * ((16 + 48) + (16 + 16) + (16 + 64) + (64 + 16) + (16 + 50)) and lora["frozen"] == full["trainable"]
    for row in rows:
        for method in ("torch", "vmapdp_eager"):  # these must run
            assert row["ms"][method] > 0 and row["repeats"][method] >= 1, (row["variant"], method)
        # Opacus either ran or its error is reported, never silently left out
        assert ("opacus_hooks" in row["ms"]) != ("opacus_hooks" in row["failed"])
        assert not any(m.endswith("compiled") for m in row["ms"])
    out = capsys.readouterr().out
    assert "| gpt2 | full fine-tuning | 4,240 | 4 x 8 |" in out and "| gpt2 | LoRA adapters | 1,288 | 4 x 8 |" in out


def test_noise_benchmark_quick_run(capsys):
    rows = _load("noise").main(["--quick"])
    assert [r["n"] for r in rows] == [1000, 100_000]
    for row in rows:
        assert set(row["ms"]) == {"shake_old", "chacha20_f32", "chacha20_f64", "add_noise", "add_noise_plain", "randn", "randn_gen"}
        assert all(v > 0 for v in row["ms"].values()) and row["ratio_to_randn"]["randn"] == 1.0
    assert "| 100,000 |" in capsys.readouterr().out


def test_correlated_noise_benchmark_quick_run(capsys):
    rows = _load("correlated").main(["--quick"])
    (row,) = rows
    assert set(row["ms"]) == {"torch", "dpsgd", "banded4", "banded16", "blt4"} and all(v > 0 for v in row["ms"].values())
    # the noise state, exactly: (band - 1) or buffers float32 copies of the 26,010 MNIST params
    assert row["state_mib"] == {"torch": 0.0, "dpsgd": 0.0, "banded4": 3 * 26_010 * 4 / 2**20, "banded16": 15 * 26_010 * 4 / 2**20, "blt4": 4 * 26_010 * 4 / 2**20}
    assert "| MNIST CNN | 26,010 | 8 |" in capsys.readouterr().out


def test_fsdp_benchmark_smoke_run(tmp_path):
    """benchmarks/fsdp.py --smoke on 2 gloo processes (run as a script: its spawned workers import
    it by path): every mode steps, and the state each rank keeps is the exact count of a tiny MLP."""
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    out = tmp_path / "fsdp.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "fsdp.py"), "--smoke", "--worlds", "2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ddp", "sharded", "sharded-use", "fsdp2"} and all(r["world"] == 2 and r["ms"] > 0 and r["peak_mib"] is None for r in rows.values())
    n = 16 * 16 + 16 + 16 * 10 + 10  # Linear(16, 16) and the head Linear(16, 10)
    assert rows["ddp"]["params"] == n == 442
    bytes_of = lambda r: round(r["state_mib"] * 2**20)  # noqa: E731
    # params, Adam's two moments (float32) and its step count: every rank all of them (ddp), half (sharded: 221 of
    # 442 elements of every leaf on each rank), FSDP2's rows (also 221) with torch's step count per parameter
    assert bytes_of(rows["ddp"]) == 3 * 4 * n + 4
    assert bytes_of(rows["sharded"]) == bytes_of(rows["sharded-use"]) == 3 * 4 * (n // 2) + 4
    assert bytes_of(rows["fsdp2"]) == 3 * 4 * (n // 2) + 4 * 4
    assert "| sharded | 2 |" in done.stdout and "n/a" in done.stdout
    # the heap probe of one more step (glibc): it saw the step's temporaries, per phase for the sharded step
    assert all(r["transient"] > 0 for r in rows.values())
    assert set(rows["sharded"]["phases"]) == {"step", "gather", "clip", "reduce", "update"} and rows["ddp"]["phases"] is None
    assert set(rows["sharded-use"]["phases"]) == {"step", "gather", "clip", "reduce", "update"}


def test_float64_price_runs_both_sums_and_restores_the_shipped_dtype(capsys):
    from vmapdp.ghost import engine

    shipped = engine._sum_dtype
    price = _load("float64_price")
    (row,) = price.main(["--models", "mnist", "--batch-sizes", "4", "--repeats", "1", "--method", "vmapdp_ghost"])
    assert engine._sum_dtype is shipped and engine._sum_dtype(torch.float32) == torch.float64
    assert set(row["ms"]) == {"torch", "float64", "float32"} and all(v > 0 for v in row["ms"].values())
    assert "| mnist | 4 | vmapdp_ghost |" in capsys.readouterr().out


def test_float64_price_restores_the_shipped_dtype_when_a_step_fails(monkeypatch):
    from vmapdp.ghost import engine

    shipped = engine._sum_dtype
    price = _load("float64_price")

    built = []

    def build_step(method, *args, **kwargs):  # the float32 variant's build fails, after its dtype is set
        built.append(method)
        if len(built) == 3:
            raise RuntimeError("boom")
        return lambda: None

    monkeypatch.setattr(price.train_step, "build_step", build_step)
    with pytest.raises(RuntimeError, match="boom"):
        price.measure("mnist", 4, 1, "vmapdp_ghost")
    assert engine._sum_dtype is shipped


def test_the_audit_benchmark_runs_and_catches_the_unclipped_step(capsys):
    """Found by review: benchmarks/audit.py imported a function the step no longer has, so the
    README's audit figures could not be reproduced. Its smoke size runs here."""
    _load("audit").main(["--smoke"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("reference", "sharp", "literal"))]
    assert len(rows) == 7
    assert all(row[-2] == ("CAUGHT" if "clipping" in " ".join(row) else "pass") for row in rows if "sqrt(2)" not in " ".join(row))
