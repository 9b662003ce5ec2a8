"""The tutorial notebooks in notebooks/ run top to bottom and reach sensible results.

Each notebook runs in a fresh Jupyter kernel of the interpreter running pytest (jupyter_client
maps the ``python3`` kernelspec's ``python`` to ``sys.executable``), with
``VMAPDP_NOTEBOOK_SMALL=1`` so that it shrinks its sizes and epochs and runs in seconds. Its last
cell prints one JSON line of key results, which the checks below read back. A notebook must also
stay warning-clean (nothing on stderr) and within its wall-clock budget.

The notebooks are stored executed (notebooks/regenerate.py, full size); the suite checks that
their stored outputs come from their current code cells (a SHA-256 per cell in the metadata).

Needs the ``notebooks`` extra (nbclient, nbformat, ipykernel, matplotlib); Opacus is optional
for notebook 06; notebook 07 needs transformers (the ``hf`` extra) and is skipped without it.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (the [notebooks] extra)")
nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (the [notebooks] extra)")
pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (the [notebooks] extra)")
pytest.importorskip("matplotlib", reason="the notebook tests need matplotlib (the [notebooks] extra)")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

# Wall-clock budget per notebook in seconds, kernel start included. In small mode each notebook
# takes about 10 s on a 2-core CPU; the budget leaves room for a slow, shared CI machine.
BUDGET_S = 120.0


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _run(name: str, monkeypatch) -> tuple[object, dict]:
    """Execute notebooks/<name> in small mode; return the executed notebook and its results line."""
    from jupyter_client.kernelspec import KernelSpecManager

    argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    assert argv0 in ("python", "python3", sys.executable), (
        f"the 'python3' kernelspec runs {argv0!r}, not this interpreter ({sys.executable}); "
        "install ipykernel into this environment."
    )
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    monkeypatch.setenv("VMAPDP_NOTEBOOK_SMALL", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, not a user's default
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's path-migration DeprecationWarning
    # one intra-op thread: the small sizes gain nothing from more, and on a busy shared machine
    # OpenMP threads waiting for a core made a notebook 2-5x slower
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    deadline = time.monotonic() + BUDGET_S
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
        # one budget for the whole notebook: each cell may use what is left of it
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
    )
    client.execute()

    stderr = [
        (i, out.get("text", ""))
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "stream" and out.get("name") == "stderr"
    ]
    assert not stderr, f"{name} wrote to stderr (a warning?): " + "; ".join(f"cell {i}: {t[:400]!r}" for i, t in stderr)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    lines = [ln for ln in _stdout(last).splitlines() if ln.startswith("{")]
    assert lines, f"{name}: the last cell printed no JSON line of results"
    return nb, json.loads(lines[-1])


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)


# ------------------------------------------------------------------------------------------------
# what each notebook must reach (small mode)


def check_01(nb, r):
    assert r["oracle_ok"] is True and r["oracle_catches_wrong_grads"] is True
    assert r["oracle_worst_relative_error"] < 1e-4
    assert r["median_norm_trained"] < r["median_norm_init"]
    assert r["speedup_vs_loop_largest_batch"] > 0
    assert _images(nb) >= 2


def check_02(nb, r):
    assert len(r["accuracy"]) == len(r["epsilons"]) == 2
    for target, rdp, pld in zip(r["epsilons"], r["spent_eps_rdp"], r["spent_eps_pld"]):
        assert 0.9 * target <= rdp <= target  # calibrated: close to the budget, never above it
        assert pld <= rdp
    assert r["non_private_accuracy"] > 0.3
    assert max(r["accuracy"]) > 0.2  # chance is 0.1
    assert _images(nb) >= 1


def check_03(nb, r):
    for key in ("gdp_warned", "rdp_increasing", "pld_below_rdp", "eps_decreases_with_noise",
                "eps_increases_with_sample_rate", "noise_on_mean_decreases", "schedule_between_constants"):
        assert r[key] is True, key
    assert 0.95 <= r["calibration_max_ratio"] <= 1.0
    lower, upper = r["pld_bracket"]
    assert 0 < lower <= upper <= 1.01 * lower
    assert _images(nb) >= 4


def check_04(nb, r):
    assert r["hessian_ok"] is True
    assert r["power_iteration_rel_error"] < 1e-2
    assert r["hutchinson_rel_error_most_probes"] < 0.5
    assert r["influence_sign_agreement"] >= 0.75
    lo, hi = r["influence_score_range"]
    assert lo < 0 < hi
    assert r["fisher_border_vs_centre"] < 0.1  # the always-blank border pixels carry no signal
    assert _images(nb) >= 4


def check_05(nb, r):
    full, lora = r["full"], r["lora"]
    for run in (full, lora):
        assert run["grad_bytes"] == run["capacity"] * run["trainable"] * 4
        assert run["epsilon"] <= 3.0
    assert lora["trainable"] * 3 < full["trainable"]
    assert lora["frozen"] == full["trainable"]  # the whole backbone is frozen under the adapters
    assert r["pretrained_public_accuracy"] > 0.8
    assert full["accuracy"] > 0.2  # chance among the five private classes
    assert lora["accuracy"] > r["pretrained_private_accuracy"]
    assert abs(r["merged_accuracy"] - lora["accuracy"]) < 1e-6
    assert _images(nb) >= 1


def check_06(nb, r):
    eps = r["epsilons"]
    assert r["steps"] == 5
    assert eps["vmapdp PLD"] <= eps["vmapdp RDP"] <= 3.0
    assert r["accuracies"]["vmapdp"] > 0.12  # chance is 0.1
    if r["opacus"]:
        assert r["same_per_sample_grads"] is True
        assert abs(eps["Opacus RDP"] - eps["vmapdp RDP"]) <= 1e-3 * eps["vmapdp RDP"]
        assert abs(eps["Opacus PRV"] - eps["vmapdp PLD"]) <= 0.05 * eps["vmapdp PLD"]
        assert r["accuracies"]["Opacus"] > 0.12
    assert _images(nb) >= 1


def check_07(nb, r):
    lm, eps = r["lm"], r["epsilons"]
    assert len(eps) >= 2
    for kind in ("full", "lora"):
        for e in eps:
            run = lm[kind][str(e)]
            assert run["epsilon"] <= e  # calibrated with PLD: never above the target
            assert run["perplexity"] < r["vocab_size"] / 2  # far below the uniform-vocabulary perplexity
        assert lm[kind]["None"]["perplexity"] < lm[kind][str(min(eps))]["perplexity"]  # privacy costs something
    assert lm["full"]["None"]["perplexity"] < r["pretrained_perplexity"]  # fine-tuning helps without noise
    assert lm["full"][str(max(eps))]["perplexity"] < r["pretrained_perplexity"]  # and with DP at the largest epsilon
    assert r["trainable"]["lora"] * 3 < r["trainable"]["full"]
    cls = r["classifier"]
    for e in eps:
        assert cls[str(e)]["epsilon"] <= e
    assert cls["None"]["accuracy"] > 0.8  # balanced classes: chance is 0.5
    assert cls[str(max(eps))]["accuracy"] > 0.6
    assert cls["None"]["accuracy"] > cls[str(min(eps))]["accuracy"]
    assert _images(nb) >= 2


def check_08(nb, r):
    e, closed = r["expected_errors"], r["closed_forms"]
    assert abs(e["DP-SGD (identity)"] - closed["identity"]) <= 1e-9 * closed["identity"]  # (n + 1) / 2
    assert abs(e["sqrt factorization"] - closed["sqrt"]) <= 1e-9 * closed["sqrt"]
    assert e["BLT (2 buffers)"] < e["banded MF (b=4)"] < e["DP-SGD (identity)"]
    for runs in r["runs"].values():
        for by_eps in runs.values():
            for eps, out in by_eps.items():
                assert 0.95 * float(eps) <= out["epsilon"] <= float(eps)  # calibrated: never above the target
    assert r["runs"]["digits"]["banded MF"][str(max(r["epsilons"]))]["accuracy"] > 0.5  # chance is 0.1
    assert max(run[str(max(r["epsilons"]))]["accuracy"] for run in r["runs"]["shakespeare"].values()) > 0.1
    assert _images(nb) >= 1


CHECKS = {
    "01_per_sample_gradients.ipynb": check_01,
    "02_dp_sgd_digits.ipynb": check_02,
    "03_privacy_accounting.ipynb": check_03,
    "04_curvature.ipynb": check_04,
    "05_dp_lora_finetuning.ipynb": check_05,
    "06_migrating_from_opacus.ipynb": check_06,
    "07_dp_transformer_finetuning.ipynb": check_07,
    "08_correlated_noise.ipynb": check_08,
}


NEEDS_TRANSFORMERS = {"07_dp_transformer_finetuning.ipynb"}


def _regenerate():
    """notebooks/regenerate.py as a module (the one definition of the code digests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regenerate", NOTEBOOKS / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_checked_and_stored_executed_from_its_current_code():
    """Each notebook is stored executed (outputs, plots, its results line) by
    notebooks/regenerate.py, and no code cell changed since: the SHA-256 of every code cell's
    source equals the one stored with the outputs."""
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(CHECKS)
    digests = _regenerate().code_digests
    for name in CHECKS:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3", name
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert any("VMAPDP_NOTEBOOK_SMALL" in c.source for c in code), f"{name}: must honour VMAPDP_NOTEBOOK_SMALL"
        assert "json.dumps(results)" in code[-1].source, f"{name}: the last cell must print the results line"
        regenerate = f"run `python notebooks/regenerate.py {name}` to store it executed"
        stored = nb.metadata.get("vmapdp", {})
        assert "code_sha256" in stored, f"{name} is stored without outputs: {regenerate}"
        assert stored["code_sha256"] == digests(nb), f"{name}: code cells changed after their outputs were stored: {regenerate}"
        assert all(c.execution_count is not None for c in code), f"{name}: a code cell was not executed: {regenerate}"
        assert any(ln.startswith("{") for ln in _stdout(code[-1]).splitlines()), f"{name}: no stored results line: {regenerate}"
        assert _images(nb) >= 1, f"{name}: no stored plot: {regenerate}"
        stderr = [i for i, c in enumerate(code) for o in c.outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
        assert not stderr, f"{name}: the stored run wrote to stderr (a warning?) in code cells {stderr}"


def test_a_changed_code_cell_no_longer_matches_its_stored_digest():
    nb = nbformat.read(NOTEBOOKS / "03_privacy_accounting.ipynb", as_version=4)
    digests = _regenerate().code_digests
    before = digests(nb)
    next(c for c in nb.cells if c.cell_type == "code").source += "\n# edited"
    after = digests(nb)
    assert after[0] != before[0] and after[1:] == before[1:]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_notebook_runs(name, monkeypatch):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers", reason=f"{name} needs transformers (the [hf] extra)")
    nb, results = _run(name, monkeypatch)
    CHECKS[name](nb, results)
