"""Smoke test of benchmarks/accounting.py: it runs, and the numbers it compares agree.

Timings are never asserted (they depend on the machine and its load).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accounting.py"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quick_run_agrees_with_dp_accounting_and_opacus(capsys):
    spec = importlib.util.spec_from_file_location("vmapdp_benchmarks_accounting", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--quick", "--threads", "0"])
    timed = [r for r in rows if r["task"] != "values"]
    assert len(timed) >= 6 and all(r["vmapdp_ms"] > 0 for r in timed if r["vmapdp_ms"] == r["vmapdp_ms"])
    values = rows[-1]
    rdp = values["rdp"]
    assert rdp["vmapdp_opacus_orders"] == pytest.approx(rdp["opacus"], rel=1e-6)
    assert rdp["vmapdp"] == pytest.approx(rdp["dp_accounting"], rel=1e-3)
    pld = values["pld"]
    assert pld["lower"] <= pld["dp_accounting_1e-4"] <= pld["upper"] * (1 + 1e-4)
    assert pld["upper"] <= rdp["vmapdp"]
    assert 0.99 * 3.0 <= values["calibrate"]["epsilon"] <= 3.0
    assert values["grid"]["steps"] == sorted(values["grid"]["steps"])
    assert "| rdp eps, 10000 steps (cold) |" in capsys.readouterr().out
