"""DP-SGD with sharded params and optimizer state, launched with torchrun; resumes after a crash.

One node, 4 processes (gloo on CPUs; NCCL with one GPU per process)::

    torchrun --nproc-per-node=4 --max-restarts=3 examples/sharded_dp.py --checkpoints /tmp/run1

Several nodes (the same command on each, a shared filesystem for the checkpoints)::

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --max-restarts=3 examples/sharded_dp.py --checkpoints /shared/run1

Every ``--every`` steps all ranks write a checkpoint (``vmapdp.sharded_checkpoint``). When a
process dies, torchrun restarts all of them (``--max-restarts``) and the script resumes from the
last complete checkpoint: the steps after it are taken again with the same batches and the same
noise (the sampler and the noise key come from the checkpoint), so the ledger counts each step
once. ``--fail-at-step K`` makes rank 1 exit at step K on the first attempt, to watch this.

The model is a small causal transformer on random tokens; put yours in ``build()``. The two
secrets (the noise seed and the sampler's key) are drawn on rank 0 and sent to the others here;
keep them, and the checkpoints, as private as the data.
"""

from __future__ import annotations

import argparse
import os
import secrets

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vmapdp
from vmapdp import distributed as vdist
from vmapdp import sharded_checkpoint as sc
from vmapdp.data import PoissonSampler, gather
from vmapdp.sharding import Sharding, local_bytes


def build(vocab: int, width: int, seq: int) -> nn.Module:
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            x = self.ln1(h)
            att = (self.q(x) @ self.k(x).transpose(-1, -2)) / width**0.5
            att = att.masked_fill(torch.ones(att.shape[-2:], dtype=torch.bool, device=att.device).triu(1), float("-inf"))
            h = h + self.o(att.softmax(-1) @ self.v(x))
            return self.head(h + self.fc2(F.gelu(self.fc1(self.ln2(h)))))

    return Tiny()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", required=True, help="a directory shared by every rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-rate", type=float, default=0.02)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--fail-at-step", type=int, default=None)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = vdist.rank()

    vocab, width, seq = 64, 32, 12
    torch.manual_seed(0)  # the same initial params on every rank (or load them from one file)
    apply, params, buffers = vmapdp.functionalize(build(vocab, width, seq).to(device))
    tokens = torch.randint(0, vocab, (args.samples, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def loss_fn(p, b, row):  # ONE sample: next-token loss
        return F.cross_entropy(apply(p, b, row[None, :-1])[0], row[1:])

    sharding = Sharding(params, unshard="use")  # each param gathered only while an op uses it (eager, a named method)
    opt = vmapdp.optim.adamw(1e-3)
    sigma = vmapdp.accounting.calibrate_noise(target_epsilon=args.epsilon, delta=1e-5, sample_rate=args.sample_rate, steps=args.steps)
    # the secrets, drawn once on rank 0 (a restart reads them from the checkpoint instead)
    shared = [secrets.randbits(128), secrets.token_bytes(32)] if rank == 0 else [None, None]
    dist.broadcast_object_list(shared, src=0)
    seed, sampler_key = shared
    sampler = PoissonSampler(args.samples, args.sample_rate, args.steps, key=sampler_key)
    step = vmapdp.make_train_step(
        loss_fn, opt, l2_clip_norm=1.0, noise_multiplier=sigma, sampler=sampler,
        physical_batch_size=vdist.local_capacity(sampler.capacity), method="ghost", compile=False,
        sharding=sharding, budget=(args.epsilon, 1e-5),
    )
    state = vmapdp.init_train_state(params, opt, seed=seed, sharding=sharding)
    last = sc.latest_checkpoint(args.checkpoints)
    if last is not None:  # a restart: the state, the noise seed and the sampler from the checkpoint
        state = sc.load_sharded(last, like=state, sharding=sharding, sampler=sampler)
        if rank == 0:
            print(f"resumed from {last} at step {state.step}", flush=True)
    del params  # from here on each rank holds its shards only

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    for indices, mask in vdist.sharded(sampler):
        if state.step >= args.steps:
            break
        if args.fail_at_step == state.step and rank == 1 and not restarted:
            os._exit(1)  # a crash mid-run: torchrun restarts every rank
        state, metrics = step(state, gather(tokens, indices), mask, buffers)
        if state.step % args.every == 0:
            sc.save_sharded(sc.checkpoint_path(args.checkpoints, state.step), state, sharding, sampler=sampler)
        if rank == 0:
            print(f"step {state.step}: loss {float(metrics['loss']):.4f}", flush=True)
    held = local_bytes(state.params) + local_bytes(state.opt_state)
    print(f"rank {rank}: {held} bytes of params and optimizer state", flush=True)
    if rank == 0:
        print(f"epsilon {state.epsilon(1e-5):.3f} at delta 1e-5 after {state.step} steps", flush=True)
    vdist.shutdown()


if __name__ == "__main__":
    main()
