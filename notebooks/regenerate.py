"""Execute the notebooks and store them with their outputs, so that a reader browsing them sees
their results and plots.

    python notebooks/regenerate.py                 # every notebook, full size (minutes each)
    python notebooks/regenerate.py 03_privacy_accounting.ipynb
    python notebooks/regenerate.py --small         # the suite's small sizes (seconds each)

Each notebook runs top to bottom in a fresh ``python3`` kernel (this interpreter's, see
tests/test_notebooks.py), in notebooks/, with ``VMAPDP_NOTEBOOK_SMALL`` unset (or set, with
``--small``). The executed notebook is written back in place, with, in its metadata under
``"vmapdp"``: the SHA-256 of every code cell's source in order (``code_sha256``), the vmapdp
version, the size it ran at, the seconds it took and the UTC time. tests/test_notebooks.py fails
when a stored notebook lacks outputs or when a code cell changed after its outputs were stored
(a digest differs): edit a notebook, then run this script on it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def code_digests(nb) -> list[str]:
    """The SHA-256 (hex) of each code cell's source, in order."""
    return [hashlib.sha256(c.source.encode("utf-8")).hexdigest() for c in nb.cells if c.cell_type == "code"]


def regenerate(name: str, *, small: bool, timeout_s: int) -> float:
    """Execute notebooks/<name> and store it with its outputs and metadata; return the seconds."""
    import nbclient
    import nbformat

    import vmapdp

    path = HERE / name
    nb = nbformat.read(path, as_version=4)
    env = {"JUPYTER_PLATFORM_DIRS": "1"}
    saved = {k: os.environ.get(k) for k in ("VMAPDP_NOTEBOOK_SMALL", "MPLBACKEND", *env)}
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend, not a user's default
    os.environ.update(env)
    if small:
        os.environ["VMAPDP_NOTEBOOK_SMALL"] = "1"
    else:
        os.environ.pop("VMAPDP_NOTEBOOK_SMALL", None)
    start = time.monotonic()
    try:
        nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout_s, resources={"metadata": {"path": str(HERE)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.monotonic() - start
    nb.metadata["vmapdp"] = {
        "code_sha256": code_digests(nb),
        "vmapdp_version": vmapdp.__version__,
        "size": "small" if small else "full",
        "seconds": round(seconds, 1),
        "executed_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook file names in notebooks/ (default: all)")
    parser.add_argument("--small", action="store_true", help="the suite's small sizes (VMAPDP_NOTEBOOK_SMALL=1)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell (default 3600)")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.name for p in HERE.glob("*.ipynb"))
    for name in names:
        if not (HERE / name).is_file():
            print(f"regenerate: no notebook {name!r} in {HERE}", file=sys.stderr)
            return 2
    for name in names:
        seconds = regenerate(name, small=args.small, timeout_s=args.timeout)
        print(f"{name}: executed ({'small' if args.small else 'full'}) in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
