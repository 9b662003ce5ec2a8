"""opake's compiled accounting core, for the cross-checks (tests/test_accounting_crosscheck.py,
tests/test_accounting_balls_in_bins.py). opake's Python accounting package does not import on
this Python (3.11.7), so its compiled core (the same PLD code the package wraps) is loaded from
its file."""

import importlib.machinery
import importlib.util
from pathlib import Path

import opake


def opake_core():
    (path,) = Path(opake.__path__[0]).glob("api/accounting/core/opake_accounting*.so")
    loader = importlib.machinery.ExtensionFileLoader("opake_accounting", str(path))
    spec = importlib.util.spec_from_file_location("opake_accounting", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
