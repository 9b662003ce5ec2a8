"""The privacy classes and the step's contracts on CUDA (marked ``gpu``; CI has no GPU).

CPU and CUDA run different kernels (cuBLAS, cuDNN, TF32 where allowed, atomics in scatter-type
backward ops), so what the CPU suite proves is checked again on the device: the sensitivity
fuzzer's whole zoo under every method and precision, per-sample gradients against the float64
oracle, the compiled step over an epoch of Poisson batches (no recompiles, the eager step's
result), a resume and the noise-key guard. Each test gathers every failing case before it fails,
so one run on a lent GPU shows them all.
"""

from __future__ import annotations

import contextlib
import os

import optree
import pytest
import torch

import vmapdp
from vmapdp import optim
from vmapdp.ghost import limits
from vmapdp.noise.spent import NoiseKeyReused, unreleased

import test_sensitivity as sens

# VMAPDP_TEST_DEVICE=cpu runs these on the CPU (to develop them without a GPU)
CUDA = os.environ.get("VMAPDP_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]


def to(tree, device):
    return optree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


@contextlib.contextmanager
def zoo_limits(name):
    """test_sensitivity's zoo_paths fixture, as a context (one test walks the whole zoo)."""
    old = limits.LIMITS
    limits.LIMITS = sens.zoo_limits(name)
    try:
        yield
    finally:
        limits.LIMITS = old


def test_neighbour_difference_is_at_most_C_on_cuda():
    """test_sensitivity's fuzzer (crafted cancelling samples, NaN rows, repeated tokens) for every
    model of its zoo x method x precision, on the device."""
    failures = []
    for name in sens.ZOO:
        for method in sens.METHODS:
            for precision in sens.PRECISIONS:
                loss_fn, params, buffers, batch = sens.setup(name, precision)
                params, buffers, batch = to(params, CUDA), to(buffers, CUDA), to(batch, CUDA)
                c = sens.SMALL_C.get(name, sens.C)
                case = f"{name}/{method}/{precision}"
                try:
                    with zoo_limits(name):
                        fn = vmapdp.clipped_grad_sum(loss_fn, l2_clip_norm=c, method=method)
                        diffs = sens.neighbour_differences(fn, params, buffers, batch, c)
                except Exception as e:  # noqa: BLE001  (gathered: every case is reported)
                    failures.append(f"{case}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                if max(diffs) > 1 + sens.TOL or max(diffs) <= 0.5:
                    failures.append(f"{case}: max {max(diffs):.6f}")
                if sens.ZOO[name][1] is not sens._tokens and diffs[1] != 0.0:
                    failures.append(f"{case}: the NaN sample moved the sum by {diffs[1]:.3g} C")
    assert not failures, "\n".join(failures)


def _oracle(loss_fn, params, buffers, batch):
    """Per-sample gradients one sample at a time, float64, on the CPU."""
    p64 = {k: v.detach().double().cpu() for k, v in params.items()}
    b64 = {k: (v.double() if v.is_floating_point() else v).cpu() for k, v in buffers.items()}
    out = []
    for i in range(len(batch[1])):
        sample = tuple((t[i].double() if t.is_floating_point() else t[i]).cpu() for t in batch)
        out.append(torch.func.grad(loss_fn)(p64, b64, sample))
    return {k: torch.stack([g[k] for g in out]) for k in p64}


def test_per_sample_grads_on_cuda_match_the_float64_oracle():
    """vmap(grad) on the device against one-sample float64 autograd on the CPU, for the benign rows
    of every zoo model (error 1e-4 of the batch's largest per-sample gradient: float32, TF32 off)."""
    failures = []
    with vmapdp.precision.full_float32(CUDA):
        for name in sens.ZOO:
            loss_fn, params, buffers, batch = sens.setup(name, None)
            rows = [0, 2, 3, 5, 7]  # (not the NaN row or the crafted ones)
            batch = tuple(t[rows] for t in batch)
            want = _oracle(loss_fn, params, buffers, batch)
            got = vmapdp.per_sample_grads(loss_fn)(to(params, CUDA), to(buffers, CUDA), to(batch, CUDA))
            for k in want:
                w, g = want[k].flatten(1), got[k].double().cpu().flatten(1)
                # (relative to the batch's largest: a sample whose exact gradient is 0, the llama
                # block's q and k on a row of one repeated token, is rounding there)
                err = ((g - w).norm(dim=1).max() / w.norm(dim=1).max().clamp_min(1e-30)).item()
                if not err <= 1e-4:
                    failures.append(f"{name}.{k}: relative error {err:.3g}")
    assert not failures, "\n".join(failures)


def _problem(device):
    """test_compile's MLP and epoch of Poisson batches, on ``device``."""
    from test_compile import make_problem

    params, buffers, loss_fn, capacity, batches = make_problem()
    return to(params, device), buffers, loss_fn, capacity, [(to(b, device), m.to(device)) for b, m in batches]


def _step(loss_fn, capacity, **kw):
    return vmapdp.make_train_step(
        loss_fn, optim.sgd(0.5), l2_clip_norm=1.0, noise_multiplier=0.7, expected_batch_size=6.0, sample_rate=0.1, physical_batch_size=capacity, **kw
    )


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_the_compiled_step_on_cuda_compiles_once_per_epoch_and_equals_the_eager_step(method, chunks, monkeypatch):
    """An epoch of Poisson batches (masks and sizes change) through the compiled step, each chunk a
    CUDA graph's replay (one graph step marked per chunk): no recompile after the first step, no
    graph skipped, parameters within float32 rounding of the eager step's (the same noise: drawn
    outside the graph, by the same Triton kernel). With 3 chunks a step, each replay overwrites the
    last one's outputs: a sum that kept them would add the last chunk three times."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda _mark=torch.compiler.cudagraph_mark_step_begin: (marks.append(1), _mark())[1])
    params, buffers, loss_fn, capacity, batches = _problem(CUDA)
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    skips = lambda: torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # noqa: E731
    size = -(-capacity // chunks)
    skipped = skips()
    compiled, eager = _step(loss_fn, size, method=method, compile=True), _step(loss_fn, size, method=method, compile=False)
    state = twin = vmapdp.init_train_state(params, optim.sgd(0.5), seed=1)
    for t, (batch, mask) in enumerate(batches):
        state, _ = compiled(state, batch, mask, buffers)
        with unreleased():
            twin, _ = eager(twin, batch, mask, buffers)
        if t == 0:
            after_first = graphs()
        for k in params:
            assert state.params[k].device.type == CUDA
            torch.testing.assert_close(state.params[k], twin.params[k], rtol=1e-5, atol=1e-6)
    assert graphs() - after_first == 0
    assert skips() == skipped
    assert len(marks) == (len(batches) * -(-capacity // size) if CUDA == "cuda" else 0)


@pytest.mark.parametrize("compile", [False, True])
def test_a_resume_on_cuda_recomputes_bit_for_bit_and_a_fork_is_refused(tmp_path, compile):
    """Saved after 3 steps and loaded in the same process, the next steps recompute exactly what was
    released (the noise-key guard lets a recomputation through and compares its bits, a checksum
    made on the device; compiled, the recomputation is a CUDA graph's replay where the first run
    was its warm-up and recording); the same state on another batch is refused before anything is
    released."""
    params, buffers, loss_fn, capacity, batches = _problem(CUDA)
    step = _step(loss_fn, capacity, method="ghost", compile=compile)
    state = vmapdp.init_train_state(params, optim.sgd(0.5), seed=3)
    for batch, mask in batches[:3]:
        state, _ = step(state, batch, mask, buffers)
    vmapdp.save_state(tmp_path / "ckpt.pt", state)
    ahead = state
    for batch, mask in batches[3:6]:
        ahead, _ = step(ahead, batch, mask, buffers)
    again = vmapdp.load_state(tmp_path / "ckpt.pt", like=state)
    assert all(v.device.type == CUDA for v in again.params.values())
    for batch, mask in batches[3:6]:
        again, _ = step(again, batch, mask, buffers)
    for k in params:
        assert torch.equal(again.params[k], ahead.params[k]), k
    batch, mask = batches[3]
    other = mask.clone()
    other[mask.nonzero()[0]] = False  # one sample fewer
    with pytest.raises(NoiseKeyReused, match="already released step 3"):
        step(state, batch, other, buffers)


def test_transformers_families_on_cuda_match_the_cpu_and_every_method_releases_one_sum():
    """test_hf's families (GPT-2, BERT, Llama, Qwen2; eager and sdpa attention) with padded 2-D
    masks on the device: per-sample gradients against the CPU's one-sample-at-a-time autograd, and
    ghost's and two_pass's clipped sums against vmap's."""
    pytest.importorskip("transformers")
    import test_hf

    from vmapdp import hf

    failures = []
    with vmapdp.precision.full_float32(CUDA):
        for name in test_hf.MODELS:
            m, batch = test_hf.model_batch(name, left=name.startswith("llama"))
            apply, params, buffers, loss = hf.loss_fn(m)
            ref = vmapdp.testing.microbatch_grads(loss, params, buffers, batch)
            m.to(CUDA)
            apply, params, buffers, loss = hf.loss_fn(m)
            batch = to(batch, CUDA)
            try:
                grads = vmapdp.per_sample_grads(loss)(params, buffers, batch)
                vmapdp.testing.assert_grads_close(to(grads, "cpu"), ref, rtol=1e-4, atol=1e-6)
                mask = torch.tensor([True, True, False], device=CUDA)
                want = vmapdp.clipped_grad_sum(loss, l2_clip_norm=0.5, method="vmap")(params, buffers, batch, mask=mask)[0]
                for method in ("ghost", "two_pass"):
                    got = vmapdp.clipped_grad_sum(loss, l2_clip_norm=0.5, method=method)(params, buffers, batch, mask=mask)[0]
                    for k in want:
                        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=f"{method} {k}")
            except Exception as e:  # noqa: BLE001  (gathered: every family is reported)
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


def test_a_compiled_transformers_step_on_cuda_equals_the_eager_one():
    """GPT-2 (sdpa attention: the math kernel under vmap) through the compiled ghost step, a CUDA
    graph per chunk: two steps within float32 rounding of the eager step's."""
    pytest.importorskip("transformers")
    import test_hf

    from vmapdp import hf

    m, batch = test_hf.model_batch("gpt2-sdpa")
    m.to(CUDA)
    apply, params, buffers, loss = hf.loss_fn(m)
    batch, mask = to(batch, CUDA), torch.ones(3, dtype=torch.bool, device=CUDA)

    def make(compile):
        return vmapdp.make_train_step(loss, optim.sgd(0.5), l2_clip_norm=0.5, noise_multiplier=0.7, expected_batch_size=3.0, sample_rate=0.1,
                                      method="ghost", compile=compile)

    compiled, eager = make(True), make(False)
    state = twin = vmapdp.init_train_state(params, optim.sgd(0.5), seed=4)
    for _ in range(2):
        state, _ = compiled(state, batch, mask, buffers)
        with unreleased():
            twin, _ = eager(twin, batch, mask, buffers)
        for k in params:
            torch.testing.assert_close(state.params[k], twin.params[k], rtol=1e-5, atol=1e-6)


def test_make_private_trains_a_model_on_cuda_from_data_on_the_host():
    """The usual set-up: the model on the GPU, the dataset in host memory; each sampled batch is
    moved to the model's device, and the model's own params follow the state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(CUDA)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = vmapdp.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8, l2_clip_norm=1.0, noise_multiplier=1.0,
                                  delta=1e-3, compile=False, method="ghost", seed=0)
    metrics = [next(iter(trainer.train_epoch())) for _ in range(2)]
    assert trainer.state.step == 2 and all(bool(torch.isfinite(m["loss"])) for m in metrics)
    for k, p in model.named_parameters():
        assert p.device.type == torch.device(CUDA).type and not torch.equal(p.detach(), before[k])
        assert torch.equal(p.detach(), trainer.state.params[k])
