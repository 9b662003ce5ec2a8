"""The engine under torch.compile(fullgraph=True): no graph breaks, same numbers as eager.

Compiling takes seconds on 2 cores, so this file compiles few functions and reuses them.
"""

from __future__ import annotations

import torch
import torch._dynamo

import vmapdp
from vmapdp.testing import assert_grads_close
from zoo import CASES, setup


def test_compiled_grads_and_clipped_sum_equal_eager_without_graph_breaks():
    case = next(c for c in CASES if c.name == "conv2d_groups_reflect")
    _, _, params, buffers, batch, loss_fn = setup(case, 8)
    psg = vmapdp.per_sample_grads(loss_fn, return_loss=True, chunk_size=4)

    def step(params, buffers, batch, mask):
        grads, losses = psg(params, buffers, batch, mask=mask)
        summed, norms = vmapdp.clip_and_sum(grads, 0.5, mask=mask)
        return grads, losses, summed, norms

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)  # fullgraph: a graph break is an error
    mask = torch.tensor([True] * 6 + [False] * 2)
    eager_out = step(params, buffers, batch, mask)
    comp_out = compiled(params, buffers, batch, mask)
    assert_grads_close(comp_out[0], eager_out[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(comp_out[1], eager_out[1])
    assert_grads_close({k: v[None] for k, v in comp_out[2].items()}, {k: v[None] for k, v in eager_out[2].items()}, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(comp_out[3], eager_out[3])

    # new data and a new mask of the same shapes reuse the compiled graph
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batch2 = case.make_batch(8, torch.Generator().manual_seed(9))
    mask2 = torch.tensor([True, False] * 4)
    out2 = compiled(params, buffers, batch2, mask2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_before
    assert_grads_close(out2[0], step(params, buffers, batch2, mask2)[0], rtol=1e-5, atol=1e-7)
