"""Speed of keyed Gaussian noise: the ChaCha20 path against the former SHAKE-256 path and torch.randn.

Usage (from the repository root)::

    python benchmarks/noise.py                       # 1M and 10M elements, 15 interleaved rounds
    python benchmarks/noise.py --sizes 605226 --repeats 30 --out results.json
    python benchmarks/noise.py --quick               # smoke run: small sizes, 2 rounds

Rows: one per size. Columns (median ms over interleaved rounds, and the ratio to ``torch.randn``):

* ``shake (old)``: the keyed path before #18: SHAKE-256 (hashlib, one thread) of the key, then
  Box-Muller in float64 from 53-bit uniforms, cast to float32 (reimplemented here as it was).
* ``chacha20 f32``: ``keyed_normal(shape, key)`` (what ``add_noise(key=)`` draws for a float32
  leaf): OpenSSL's ChaCha20 keystream, a cache-sized piece at a time, each transformed by one
  Inductor-compiled float32 Box-Muller kernel.
* ``chacha20 f64``: the same for a float64 leaf (16 bytes of keystream per pair instead of 12).
* ``randn``: ``torch.randn(n)`` from the global generator (Mersenne Twister: not keyed, not
  secret-safe; the speed to aim for); ``randn gen``: with an explicit ``torch.Generator``.

The fused kernel's one-off compilation (per process and precision) is timed separately
(``compile_s``). ``--device cuda``: the noise for CUDA tensors, made there by one compiled kernel
(keystream and transform; ``chacha20_f32``, the default), op by op there (``..._op_by_op``), or
by OpenSSL on the host and copied (``..._host_copy``), against ``torch.randn`` on the device.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from vmapdp.noise import gaussian


def shake_normal(n: int, key: bytes) -> torch.Tensor:
    """The keyed noise of vmapdp before #18 (SHAKE-256 + float64 Box-Muller), for comparison."""
    stream = hashlib.shake_256(b"vmapdp-keyed-normal:" + key).digest(16 * ((n + 1) // 2))
    bits = torch.frombuffer(bytearray(stream), dtype=torch.int64)
    u = ((bits.reshape(2, -1) & ((1 << 53) - 1)).to(torch.float64) + 0.5) / float(1 << 53)
    r = torch.sqrt(-2.0 * torch.log(u[0]))
    return torch.cat([r * torch.cos(2 * math.pi * u[1]), r * torch.sin(2 * math.pi * u[1])])[:n].float()


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return float("nan")


def main(argv=None) -> list[dict]:
    """Run the benchmark, print the markdown table, return its rows as dicts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="comma-separated element counts")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = leave as is")
    parser.add_argument("--quick", action="store_true", help="sizes 1000 and 100000, 2 rounds")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--device", default="cpu", help="where the noise is needed (cuda: the keystream made there by one compiled kernel, against op by op there and OpenSSL on the host plus the copy)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.quick:
        args.sizes, args.repeats = "1000,100000", 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    key = b"benchmark-key"

    t = time.perf_counter()
    gaussian.keyed_normal((10,), key, device=device)
    sync()
    compile32 = time.perf_counter() - t
    t = time.perf_counter()
    gaussian.keyed_normal((10,), key, dtype=torch.float64, device=device)
    sync()
    compile64 = time.perf_counter() - t

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        if cuda:
            methods = {
                "chacha20_f32": lambda: gaussian.keyed_normal((n,), key, device=device),
                "chacha20_f32_op_by_op": lambda: gaussian.keyed_normal((n,), key, device=device, fused=False),
                "chacha20_f32_host_copy": lambda: gaussian.keyed_normal((n,), key, device=device, backend="openssl"),
                "chacha20_f64": lambda: gaussian.keyed_normal((n,), key, dtype=torch.float64, device=device),
                "randn": lambda: torch.randn(n, device=device),
            }
        else:
            methods = {
                "shake_old": lambda: shake_normal(n, key),
                "chacha20_f32": lambda: gaussian.keyed_normal((n,), key),
                "chacha20_f64": lambda: gaussian.keyed_normal((n,), key, dtype=torch.float64),
                "randn": lambda: torch.randn(n),
                "randn_gen": lambda: torch.randn(n, generator=gen),
            }
        times = {m: [] for m in methods}
        loads = []
        for fn in methods.values():  # warm-up
            fn()
        for _ in range(args.repeats):  # interleaved rounds
            for m, fn in methods.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times[m].append((time.perf_counter() - t) * 1e3)
            loads.append(_load())
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append(
            {
                "n": n,
                "ms": med,
                "min_ms": {m: min(v) for m, v in times.items()},
                "ratio_to_randn": {m: med[m] / med["randn"] for m in med},
                "repeats": args.repeats,
                "load_avg_1min_max": max(loads),
            }
        )

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile_s": {"float32": round(compile32, 2), "float64": round(compile64, 2)},
    }
    print(f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['threads']} threads; fused kernel compile s: {meta['compile_s']}")
    names = list(methods)
    print("| elements | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for row in rows:
        cells = [f"{row['ms'][m]:.3g} ({row['ratio_to_randn'][m]:.2f}x)" for m in names]
        print(f"| {row['n']:,} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
