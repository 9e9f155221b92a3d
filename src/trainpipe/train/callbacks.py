"""Callbacks the recipe passes to the loop (TRL's TrainerCallback, torchtune's hooks): they watch the run and report, the
loop does not know what they are. :func:`default_callbacks` are every run's; `trainpipe tune` adds its pruner
(:class:`EvalHook` around a function), which may raise :class:`~trainpipe.train.errors.StopTrial` to end a trial.

A callback may define ``on_step_end(loop, step, loss, grad_norm)`` after every optimizer step, ``log_fields(loop)``
(figures added to the step's `metrics.jsonl` record), ``on_log(loop, rec)`` after the record is written and
``on_eval(loop, step, eval_loss)`` after every in-training eval (every metric it measured is in ``loop.eval_metrics``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from trainpipe.events import append_line


class Callback:
    def on_step_end(self, loop, step: int, loss: float, grad_norm: float) -> None:
        pass

    def log_fields(self, loop) -> dict:
        return {}

    def on_log(self, loop, rec: dict) -> None:
        pass

    def on_eval(self, loop, step: int, eval_loss: float) -> None:
        pass


class MetricsLog:
    """`metrics.jsonl` (rank 0 writes it) and the experiment tracker, which logs every record as it is written (a listener
    of the run's event log ``events``: its `notify`)."""

    def __init__(self, path: Path, enabled: bool = True, events=None):
        self.path, self.enabled, self.events = Path(path), enabled, events

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(rec))
        if self.events is not None:
            self.events.notify("metric", rec)  # the run's listeners (the experiment tracker, track/tracking.py) log it now


class ClippingReport(Callback):
    """`clipped_steps` in every logged record, and `gradient_clipped` once per logging window in which clipping (a finite
    norm above `training.max_grad_norm`) happened."""

    def __init__(self, max_grad_norm: float, logging_steps: int):
        self.max_grad_norm, self.logging_steps = max_grad_norm, logging_steps
        self.clipped: tuple[int, float] = (0, 0.0)  # (steps whose gradient was clipped, their largest pre-clip norm) this window

    def on_step_end(self, loop, step: int, loss: float, grad_norm: float) -> None:
        if grad_norm > self.max_grad_norm:  # clipped (finite: NaN/Inf rolled back as gradient_overflow)
            self.clipped = (self.clipped[0] + 1, max(self.clipped[1], grad_norm))

    def log_fields(self, loop) -> dict:
        return {"clipped_steps": self.clipped[0]}

    def on_log(self, loop, rec: dict) -> None:
        count, worst = self.clipped
        self.clipped = (0, 0.0)
        if count:
            loop.events.emit(
                "gradient_clipped", step=rec["step"], level="info", clipped_steps=count,  # clipping is the limit doing its job: not a warning
                window_steps=self.logging_steps, max_grad_norm_before_clip=round(worst, 4), max_grad_norm=self.max_grad_norm,
            )


class GpuUtilisation(Callback):
    """On a GPU: low device utilisation while input preparation takes a large share of the step (`gpu_util_low`, once),
    and the utilisation samples the `gpu_utilization` quality gate reads. Without nvidia-ml-py the check is off, and the
    run says so once (`gpu_util_check_off`); on the CPU there is nothing to check and nothing is said."""

    def __init__(self, device):
        self.device = device
        self.fired = False

    def _gpu_util(self) -> float | None:
        """Device utilisation in % (None off a GPU); raises ModuleNotFoundError when nvidia-ml-py (pynvml) is missing."""
        if self.device.type != "cuda":
            return None
        import torch

        return torch.cuda.utilization(self.device)

    def on_log(self, loop, rec: dict) -> None:
        if self.fired:
            return
        try:
            util = self._gpu_util()
        except Exception as exc:  # noqa: BLE001 - torch reads utilisation through pynvml (nvidia-ml-py)
            self.fired = True
            loop.events.emit(
                "gpu_util_check_off", step=rec["step"], level="warning", reason=f"{type(exc).__name__}: {str(exc)[:160]}",
                fix="`pip install nvidia-ml-py` (or `pip install 'trainpipe[gpu]'`) to have `gpu_util_low` warn when the GPU waits for data",
            )
            return
        if util is None:
            return
        loop.metrics.write({"time": time.time(), "step": rec["step"], "gpu_util": util})  # the `gpu_utilization` quality gate's samples (evaluate/gates.py)
        if util < 50 and rec["input_share"] > 0.3:
            self.fired = True
            loop.events.emit(
                "gpu_util_low", step=rec["step"], level="warning", gpu_util=util, dataloader_share=rec["input_share"],
                fix="more data-loader workers or prefetch, packing (`data.packing`), or a pre-tokenized cache",
            )


class EvalHook(Callback):
    """A function (loop, step, eval_loss) run after every in-training eval, in this process: how `trainpipe tune` reports
    intermediate values to its pruner. It may raise StopTrial."""

    def __init__(self, fn: Callable[[object, int, float], None]):
        self.fn = fn

    def on_eval(self, loop, step: int, eval_loss: float) -> None:
        self.fn(loop, step, eval_loss)


class CompileWarmup(Callback):
    """`training.torch_compile`: the first optimizer step of a run (or of a resume) compiles the model's forward and
    backward graphs, so its time is the compile warm-up, not training. It is stated apart: one printed line, a
    `compile_warmup` event and `compile_warmup_seconds` in the first `metrics.jsonl` record (the first logging window's
    `tokens_per_second` still includes it). A new input shape may recompile later (dynamic shapes from the second shape on)."""

    def __init__(self):
        self.seconds: float | None = None
        self.logged = False

    def on_step_end(self, loop, step: int, loss: float, grad_norm: float) -> None:
        if self.seconds is not None:
            return
        self.seconds = round(time.time() - loop._since_log[0], 3)  # the loop starts this clock just before its first step
        loop.events.emit("compile_warmup", step=step, compile_warmup_seconds=self.seconds,  # the event's console line is the one said
                         note="torch.compile: the first step compiled the model's forward and backward (a one-off warm-up); later steps run the compiled graphs")

    def log_fields(self, loop) -> dict:
        if self.seconds is None or self.logged:
            return {}
        self.logged = True
        return {"compile_warmup_seconds": self.seconds}


def default_callbacks(specs, device) -> list[Callback]:
    """Every run's: the clipping report and the GPU utilisation check (``specs``: the run's `plan.specs`), and the
    compile warm-up report under `training.torch_compile`."""
    return [ClippingReport(specs.optimizer.max_grad_norm, specs.cadence.logging_steps), GpuUtilisation(device),
            *([CompileWarmup()] if specs.precision.torch_compile else [])]
