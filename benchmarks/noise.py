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
* ``add_noise`` / ``add_noise_plain``: the release of a float32 leaf of ``n`` elements,
  ``add_noise({"w": x}, 1.0, key=)``: the draw plus the sum computed in float64 and snapped to the
  grid (the default), and the plain float32 ``x + z`` (``snap=False``).
* ``randn``: ``torch.randn(n)`` from the global generator (Mersenne Twister: not keyed, not
  secret-safe; the speed to aim for); ``randn gen``: with an explicit ``torch.Generator``.

The fused kernel's one-off compilation (per process and precision) is timed separately
(``compile_s``). ``--device cuda``: the noise for CUDA tensors, made there by the Triton kernel
(keystream and transform in native 32-bit words; ``chacha20_f32``, the default), by Inductor's
compile of the torch twin (int64 words; ``..._inductor``, with ``--inductor``: where triton is missing), or by OpenSSL on
the host and copied (``..._host_copy``), against ``torch.randn`` on the device. ``--tree gpt2``
adds a row for a whole step's noise: ``add_noise`` over GPT-2 small's 148 parameter tensors (124M
elements; one launch of the Triton kernel) against ``randn`` per tensor.
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


def gpt2_small_shapes() -> dict[str, tuple[int, ...]]:
    """GPT-2 small's 148 parameter tensors (124M elements), by name."""
    shapes = {"wte": (50257, 768), "wpe": (1024, 768), "ln_f.weight": (768,), "ln_f.bias": (768,)}
    for i in range(12):
        for name, shape in {"ln_1.weight": (768,), "ln_1.bias": (768,), "attn.c_attn.weight": (768, 2304), "attn.c_attn.bias": (2304,),
                            "attn.c_proj.weight": (768, 768), "attn.c_proj.bias": (768,), "ln_2.weight": (768,), "ln_2.bias": (768,),
                            "mlp.c_fc.weight": (768, 3072), "mlp.c_fc.bias": (3072,), "mlp.c_proj.weight": (3072, 768), "mlp.c_proj.bias": (768,)}.items():  # fmt: skip
            shapes[f"h.{i}.{name}"] = shape
    return shapes


def _timed(methods: dict, repeats: int, sync) -> dict:
    """Median (and min) ms of each method over interleaved rounds after one warm-up, and the ratio to ``randn``."""
    times = {m: [] for m in methods}
    loads = []
    for fn in methods.values():  # warm-up
        fn()
    for _ in range(repeats):  # interleaved rounds
        for m, fn in methods.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[m].append((time.perf_counter() - t) * 1e3)
        loads.append(_load())
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "ms": med,
        "min_ms": {m: min(v) for m, v in times.items()},
        "ratio_to_randn": {m: med[m] / med["randn"] for m in med},
        "repeats": repeats,
        "load_avg_1min_max": max(loads),
    }


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
    parser.add_argument("--inductor", action="store_true", help="with --device cuda: also Inductor's compile of the torch twin (~30 s to compile per precision)")
    parser.add_argument("--tree", default=None, choices=["gpt2"], help="also time add_noise over a model's parameter tensors (gpt2: GPT-2 small's 148)")
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

    def inductor(shape, dtype):  # the torch twin compiled by Inductor: the CUDA path where triton is missing (and before the Triton kernel)
        return gaussian._keyed_one(gaussian.stream_key(key), shape, 0, 0, dtype, device, backend="torch", fused=None)

    t = time.perf_counter()
    if cuda and args.inductor:
        inductor((10,), torch.float32)
        inductor((10,), torch.float64)
        sync()
    compile_inductor = time.perf_counter() - t

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        leaf = {"w": torch.zeros(n, device=device)}
        releases = {
            "add_noise": lambda: gaussian.add_noise(leaf, 1.0, key=key),
            "add_noise_plain": lambda: gaussian.add_noise(leaf, 1.0, key=key, snap=False),
        }
        if cuda:
            methods = {
                "chacha20_f32": lambda: gaussian.keyed_normal((n,), key, device=device),
                **({"chacha20_f32_inductor": lambda: inductor((n,), torch.float32)} if args.inductor else {}),
                "chacha20_f32_host_copy": lambda: gaussian.keyed_normal((n,), key, device=device, backend="openssl"),
                "chacha20_f64": lambda: gaussian.keyed_normal((n,), key, dtype=torch.float64, device=device),
                **({"chacha20_f64_inductor": lambda: inductor((n,), torch.float64)} if args.inductor else {}),
                **releases,
                "randn": lambda: torch.randn(n, device=device),
            }
        else:
            methods = {
                "shake_old": lambda: shake_normal(n, key),
                "chacha20_f32": lambda: gaussian.keyed_normal((n,), key),
                "chacha20_f64": lambda: gaussian.keyed_normal((n,), key, dtype=torch.float64),
                **releases,
                "randn": lambda: torch.randn(n),
                "randn_gen": lambda: torch.randn(n, generator=gen),
            }
        rows.append({"n": n, **_timed(methods, args.repeats, sync)})
    if args.tree == "gpt2":
        tree = {name: torch.zeros(shape, device=device) for name, shape in gpt2_small_shapes().items()}
        methods = {
            "add_noise": lambda: gaussian.add_noise(tree, 1.0, key=key),
            "randn": lambda: {k: v + torch.randn_like(v) for k, v in tree.items()},
        }
        rows.append({"n": sum(v.numel() for v in tree.values()), "tree": f"gpt2-small, {len(tree)} tensors", **_timed(methods, args.repeats, sync)})

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile_s": {"float32": round(compile32, 2), "float64": round(compile64, 2), **({"inductor_both": round(compile_inductor, 2)} if cuda and args.inductor else {})},
    }
    print(f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['threads']} threads; fused kernel compile s: {meta['compile_s']}")
    for row in rows:
        names = list(row["ms"])
        if row is rows[0] or "tree" in row:
            print("| elements | " + " | ".join(names) + " |")
            print("|---:|" + "---:|" * len(names))
        cells = [f"{row['ms'][m]:.3g} ({row['ratio_to_randn'][m]:.2f}x)" for m in names]
        print(f"| {row['n']:,}{' (' + row['tree'] + ')' if 'tree' in row else ''} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
