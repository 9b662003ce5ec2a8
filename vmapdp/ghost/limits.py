"""Ghost clipping's and ``"auto"``'s tuning limits: one frozen value, ``LIMITS``, read at call time.

Each limit only trades speed against memory; none changes a result beyond float rounding. Tests
(and callers tuning for a device) replace the default in one place:
``monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, keep_elements=0))``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits", "LIMITS"]


@dataclass(frozen=True)
class Limits:
    """Memory and speed limits of ghost clipping and of ``"auto"``'s race."""

    # intermediates of one slice of the batch are kept under this many elements (64 MiB in float32)
    slice_elements: int = 1 << 24
    # convs with at most this many (C_out x C_in / groups) weights per kernel tap get their
    # per-sample norms from one grouped conv backward (fast for few channels); wider ones from
    # unfolded patches or Grams
    grouped_conv_max: int = 4096
    # ... taking at most this many input channels (samples x C_in) per call: mkldnn's grouped
    # backward slows down sharply past it (CPU)
    grouped_channels: int = 2048
    # per-sample grads formed on the way to a norm (small convs, mixed uses) are kept for the
    # clipped sum, which is then a weighted sum over the batch instead of one more conv backward,
    # while their total stays under this many elements (32 MiB in float32); beyond it recomputed
    keep_elements: int = 1 << 23
    # ... and beyond it when they are at most this many times the elements of the output grads and
    # inputs of their uses, which the clipped sum then no longer needs (freed unless shared)
    keep_ratio: float = 1.0
    # "auto" races "vmap" only while its per-sample grads (B x trainable elements) stay under this
    # many elements (256 MiB in float32); beyond it ghost (which covers the rest by per-sample views)
    auto_vmap_elements: int = 1 << 26
    # ... and times each candidate this many times after one warm-up call, keeping the best
    auto_rounds: int = 2
    # "two_pass" without a norm_chunk_size takes as many samples at a time as keep their per-sample
    # grads under this many elements (2 GiB in float32), at least one: GPT-2 small (124M trainable)
    # 4 at a time, measured on a 2-core CPU (2026-11-28, full fine-tuning, 32 x 128) at 1.23x the
    # non-private step's time and 0.76x its memory; the whole batch at once held 16 GB and was killed
    two_pass_elements: int = 1 << 29
    # a compiled "auto" step keeps a chunk eager without compiling it (on the CPU) where at least this
    # share of its eager run's time is in kernels Inductor calls as they are (convolutions, matrix
    # products, sorts: ``clipped.eager_profile``): compiling could take at most the rest off, and on
    # the CIFAR-10 CNN (73-90% there, on one thread) it took nothing off after 48 s of compiling;
    # MNIST CNN 25-54%, a tiny GPT-2 18-22%, the embedding model 5-8%, which compiling speeds up
    compile_kernel_share: float = 0.65
    # ... and (with a warning) where its eager run dispatches more than this many ATen ops: compile
    # time grows with the graph (dynamo's trace, Inductor's lowering and its C++ builds). Measured
    # on a 2-core CPU (2026-11-28, batch 16, one chunk's ghost / vmap clipped sum): the embedding
    # model 260 / 157 ops (6 s cold); MNIST CNN 499 / 318 (16 s); a 2-layer GPT-2 1,648 / 1,057
    # (34 / 25 s); the IMDb LSTM (a 256-step time loop) 11,414 / 12,536: ghost 362 s cold (trace
    # 59 s, Inductor 300 s, 277 C++ builds) and still 240 s warm (another job was running; most of
    # it Inductor's Python, which its caches did not save), after which its step ran 3.5x faster
    # than eager (52 against 182 ms)
    compile_max_ops: int = 5000
    # a compiled step on CUDA replays each chunk's graph as a CUDA graph (Inductor's
    # "reduce-overhead"): the eager step is bound by launching its ~10k small kernels
    cuda_graphs: bool = True
    # ... for at most this many trainable elements (1 GiB in float32): a replay holds about three
    # parameter-sized buffers more than an eager step (the params copied in, its sums, their copy)
    cuda_graph_elements: int = 1 << 28


LIMITS = Limits()
