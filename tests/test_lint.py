"""The code passes the linter (ruff; its rules are [tool.ruff] in pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "vmapdp", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{done.stdout}{done.stderr}"
