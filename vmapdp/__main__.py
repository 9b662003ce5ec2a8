"""``python -m vmapdp demo``: per-sample gradients and DP-SGD on the shipped digits dataset.

Everything runs offline on a CPU in well under a minute. The demo

1. turns a small CNN into a pure function and computes per-sample gradients with vmap∘grad,
2. checks them against the float64 one-sample-at-a-time oracle,
3. times them (eager and torch.compile) against an ordinary forward+backward,
4. trains with DP-SGD built from the pure parts: Poisson sampling, clip-and-sum, Gaussian noise,
   division by the *expected* batch size, SGD; and prints the privacy spent next to the accuracy
   of the same model trained without privacy.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import vmapdp
from vmapdp import _checks, accounting
from vmapdp.data import PoissonSampler, gather
from vmapdp.datasets import load_digits


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _accuracy(apply, params, buffers, images, labels) -> float:
    with torch.no_grad():
        return float((apply(params, buffers, images).argmax(1) == labels).float().mean())


def _train(apply, params, buffers, loss_fn, data, *, steps, sample_rate, lr, l2_clip_norm, noise_multiplier, private, compile, on_checkpoint=None):
    """SGD on Poisson-sampled batches padded to a fixed capacity; ``private``: the DP-SGD step.
    A progress bar shows the steps; ``on_checkpoint(state)`` runs at ten evenly spaced steps."""
    n = data[0].shape[0]
    # the batches and the noise from fresh secrets (OS entropy): a fixed seed would let anyone who knows it regenerate
    # them, subtract the noise and void the epsilon printed (found by review); --seed fixes the weights and the split only
    sampler = PoissonSampler(n, sample_rate, steps)
    opt = vmapdp.optim.sgd(lr)
    state = vmapdp.init_train_state(params, opt)
    if private:
        step = vmapdp.make_train_step(
            loss_fn,
            opt,
            l2_clip_norm=l2_clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=sampler.expected_batch_size,
            sample_rate=sample_rate,
            physical_batch_size=sampler.capacity,
            compile=compile,
        )
    else:
        grad_fn = torch.func.grad(lambda p, x, y, m: (F.cross_entropy(apply(p, buffers, x), y, reduction="none") * m).sum() / m.sum().clamp_min(1))

        def step(state, batch, mask, buffers):
            grads = grad_fn(state.params, *batch, mask.float())
            params, opt_state = opt.update(grads, state.opt_state, state.params)
            return state._replace(params=params, opt_state=opt_state, step=state.step + 1), {}

    marks = {round(steps * k / 10) for k in range(1, 11)}
    bar = tqdm(sampler, total=steps, desc="DP-SGD" if private else "non-private", unit="step", file=sys.stderr, dynamic_ncols=True)
    for indices, mask in bar:
        state, _ = step(state, gather(data, indices), mask, buffers)
        if on_checkpoint is not None and state.step in marks:
            bar.set_postfix_str(on_checkpoint(state))
    bar.close()
    return state


def _plot(path: str, curve: list[tuple[int, float, float]], plain_acc: float, delta: float) -> str:
    """Epsilon and test accuracy over the steps of the DP-SGD run, as a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no plot: pip install matplotlib for one)"
    steps, eps, acc = zip(*curve)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(steps, eps, marker="o")
    left.set(xlabel="step", ylabel=f"epsilon (PLD, delta={delta:g})", title="privacy spent")
    right.plot(steps, acc, marker="o", label="DP-SGD")
    right.axhline(plain_acc, color="gray", linestyle="--", label="non-private")
    right.set(xlabel="step", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    right.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot of epsilon and accuracy over the steps: {path}"


def demo(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmapdp demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=float, default=30.0, help="passes over the training set (default 30)")
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size (Poisson sampling)")
    parser.add_argument("--epsilon", type=float, default=3.0, help="privacy budget: the noise is calibrated to reach it at --delta")
    parser.add_argument("--l2-clip-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2.0, help="DP-SGD learning rate (the non-private baseline uses 0.2)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0, help="the initial weights and the train/test split (the batches and the noise come from fresh secrets)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile timing (saves ~15 s)")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--plot", default="vmapdp_demo.png", help="where to write the plot of epsilon and accuracy over the steps ('' for none)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.quick:
        args.epochs, args.no_compile = 3.0, True
    if not args.no_compile:
        try:
            _checks.compile_supported("python -m vmapdp demo")
        except RuntimeError as err:
            print(f"{err}\n(the demo runs without compiling)")
            args.no_compile = True

    split = load_digits(seed=args.seed)
    n = split.train_images.shape[0]
    model = digits_cnn()
    apply, params, buffers = vmapdp.functionalize(model)
    print(f"digits: {n} train / {split.test_images.shape[0]} test images (8x8), CNN with {sum(p.numel() for p in params.values()):,} params")

    def loss_fn(params, buffers, sample):
        x, y = sample
        return F.cross_entropy(apply(params, buffers, x[None]), y[None])

    # 1-2. per-sample gradients, checked against the float64 oracle
    batch = (split.train_images[: args.batch_size], split.train_labels[: args.batch_size])
    grads = vmapdp.per_sample_grads(loss_fn)(params, buffers, batch)
    few = tuple(t[:8] for t in batch)
    ref = vmapdp.testing.microbatch_grads(loss_fn, params, buffers, few)
    worst = max(float(((grads[k][:8].double() - ref[k]).norm() / ref[k].norm())) for k in ref)
    vmapdp.testing.assert_grads_close({k: v[:8] for k, v in grads.items()}, ref)
    print(f"per-sample grads for B={args.batch_size}: {len(grads)} tensors with a leading batch dim; worst relative error vs float64 oracle: {worst:.1e}")
    norms = vmapdp.grad_norms(grads)
    print(f"per-sample grad norms: min {norms.min():.3f}  median {norms.median():.3f}  max {norms.max():.3f}")

    # 3. speed, side by side
    def non_private():
        live = {k: v.requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(apply(live, buffers, batch[0]), batch[1])
        torch.autograd.grad(loss, list(live.values()))

    psg = vmapdp.per_sample_grads(loss_fn)
    repeats = 3 if args.quick else 20
    rows = [("non-private forward+backward", _median_ms(non_private, repeats))]
    rows.append(("per-sample grads, eager", _median_ms(lambda: psg(params, buffers, batch), repeats)))
    if not args.no_compile:
        compiled = torch.compile(psg, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        compiled(params, buffers, batch)
        print(f"(torch.compile took {time.perf_counter() - t0:.1f} s, once)")
        rows.append(("per-sample grads, torch.compile", _median_ms(lambda: compiled(params, buffers, batch), repeats)))
    base = rows[0][1]
    for name, ms in rows:
        print(f"  {name:34s} {ms:8.2f} ms  {ms / base:5.2f}x")

    # 4. DP-SGD vs non-private training, same steps
    sample_rate = args.batch_size / n
    steps = max(1, round(args.epochs / sample_rate))
    noise_multiplier = accounting.calibrate_noise(target_epsilon=args.epsilon, delta=args.delta, sample_rate=sample_rate, steps=steps)
    common = dict(steps=steps, sample_rate=sample_rate, lr=args.lr, l2_clip_norm=args.l2_clip_norm, noise_multiplier=noise_multiplier)
    t0 = time.perf_counter()
    curve: list[tuple[int, float, float]] = []

    def checkpoint(state) -> str:
        eps_t = accounting.epsilon(state.ledger, delta=args.delta)
        curve.append((state.step, eps_t, _accuracy(apply, state.params, buffers, split.test_images, split.test_labels)))
        return f"epsilon {eps_t:.2f}, test accuracy {curve[-1][2]:.3f}"

    dp_state = _train(apply, params, buffers, loss_fn, (split.train_images, split.train_labels), private=True, compile=not args.no_compile, on_checkpoint=checkpoint, **common)
    dp_time = time.perf_counter() - t0
    plain_state = _train(apply, params, buffers, loss_fn, (split.train_images, split.train_labels), private=False, compile=False, **dict(common, lr=0.2))
    dp_acc = _accuracy(apply, dp_state.params, buffers, split.test_images, split.test_labels)
    plain_acc = _accuracy(apply, plain_state.params, buffers, split.test_images, split.test_labels)
    print(f"\nDP-SGD: {steps} steps, sample rate {sample_rate:.4f} (expected batch {args.batch_size}), noise multiplier {noise_multiplier:.3f} (calibrated to epsilon {args.epsilon:g}), clip {args.l2_clip_norm} ({dp_time:.1f} s{'' if args.no_compile else ', compile included'})")
    eps = accounting.epsilon(dp_state.ledger, delta=args.delta)  # PLD, the accountant the noise was calibrated with
    loose = accounting.epsilon(dp_state.ledger, delta=args.delta, accountant="rdp")
    print(f"  test accuracy, DP-SGD:      {dp_acc:.3f}   (epsilon = {eps:.2f} by PLD, {loose:.2f} by RDP; delta = {args.delta:g})")
    print(f"  test accuracy, non-private: {plain_acc:.3f}")
    if args.plot:
        print(_plot(args.plot, curve, plain_acc, args.delta))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m vmapdp demo [--quick] [--epochs E] [--epsilon EPS] ...\n\ncommands:\n  demo    per-sample gradients and DP-SGD on the shipped digits dataset")
        return 0
    if argv[0] == "demo":
        return demo(argv[1:])
    print(f"python -m vmapdp: unknown command {argv[0]!r}; try 'demo'.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
