"""The planner's trace of any module (plan/module_trace.py): on fake tensors it counts the same peak as the same step on
real tensors, and the peak grows with the micro-batch (activations) while the weights do not."""

from __future__ import annotations

import torch

from trainpipe.model.tabular import build_tabular_mlp
from trainpipe.plan.module_trace import trace_module_step


def _loss(model, batch):
    y = batch.pop("y")
    return torch.nn.functional.cross_entropy(model(batch["x_num"], batch["x_cat"]), y, reduction="sum")


def _batch(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x_num": torch.randn(n, 6, generator=g), "x_cat": torch.randint(0, 4, (n, 2), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def test_fake_trace_equals_the_real_step_and_scales_with_the_batch():
    def build():
        return build_tabular_mlp(6, [4, 5], 3, {"hidden_size": 64, "depth": 2, "dropout": 0.1})

    fake = trace_module_step(build, _loss, _batch(32))
    real = trace_module_step(build, _loss, _batch(32), fake=False)
    assert fake["peak_bytes"] == real["peak_bytes"] and fake["weights_bytes"] == real["weights_bytes"]
    n = fake["trainable"]
    assert fake["weights_bytes"] == 4 * n and fake["peak_bytes"] >= 4 * n * 4  # weights + gradients + 2 Adam moments at least
    big = trace_module_step(build, _loss, _batch(512))
    assert big["weights_bytes"] == fake["weights_bytes"] and big["peak_bytes"] > fake["peak_bytes"]
