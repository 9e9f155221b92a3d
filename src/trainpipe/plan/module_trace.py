"""One training step of any `nn.Module` traced on fake tensors: the planner's memory for the tabular and custom families.

`trace_module_step(build, loss_of, batch)` builds the module on the meta device (`build()`, e.g. trainpipe's tabular MLP
or your `model.factory`), replaces every parameter and buffer by a fake tensor, and runs real steps with AdamW (the
loop's optimizer): forward, the loss, backward, the optimizer step, `zero_grad(set_to_none=True)`, counting live tensor
bytes with plan/trace.py's `LiveBytes` mode. The second step's peak includes the optimizer state, as a training run's
does. Nothing is allocated: a module of any size traces in seconds. `trainpipe run` calls it before training (never
`trainpipe plan`, which does not import your code); the result is printed and kept in `summary.json` (`plan_trace`).
"""

from __future__ import annotations

import time
from typing import Callable

from trainpipe.plan.trace import _materialize
from trainpipe.plan.trace_modes import cuda_like_dropout, live_bytes_tracker


def trace_module_step(build: Callable[[], object], loss_of: Callable[[object, dict], object], batch: dict, *, steps: int = 2,
                      fake: bool = True) -> dict:
    """{"peak_bytes", "weights_bytes", "parameters", "trainable", "micro_batch", "seconds"} of ``steps`` traced steps.
    ``fake=False`` runs the same program on real (zero) tensors, to check the tracer."""
    import torch

    t0 = time.time()
    with torch.random.fork_rng(devices=[]):  # the trace draws nothing from the run's random streams (a factory may seed)
        return _trace(build, loss_of, batch, steps, fake, t0)


def _trace(build, loss_of, batch: dict, steps: int, fake: bool, t0: float) -> dict:
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = build()
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), cuda_like_dropout():
        tr = live_bytes_tracker(False)
        with tr:
            _materialize(model, lambda shape, dtype, is_float: torch.empty(shape, dtype=dtype) if fake else torch.zeros(shape, dtype=dtype))
            weights = tr.cur
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
            peaks = []
            for _ in range(steps):
                tr.peak = tr.cur
                loss = loss_of(model, dict(batch))
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                peaks.append(tr.peak)
    y = batch.get("y")
    return {"peak_bytes": int(max(peaks)), "weights_bytes": int(weights), "parameters": parameters, "trainable": trainable,
            "micro_batch": int(len(y)) if y is not None else None, "seconds": round(time.time() - t0, 3)}
