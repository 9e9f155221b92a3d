"""The loop's own state: what a checkpoint records of it (:class:`LoopState`, every rank's RNG streams) and what a fit returns."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    window: int = 0  # next data window to read
    skipped: list[int] = field(default_factory=list)  # windows skipped after a divergence
    lr_scale: float = 1.0
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    best_metric: float | None = None  # the best ranking score so far, lower is better (the eval loss, or minus a greater-is-better metric)
    best_step: int | None = None
    evals_without_improvement: int = 0
    recoveries: int = 0
    recent_losses: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    stopped_early: bool = False
    effective_batch: int = 0  # examples per optimizer step (all ranks); 0 in checkpoints written before it was recorded
    world_size: int = 1
    best_metric_name: str | None = None  # what best_metric ranks by (`training.metric_for_best`); None: eval loss (older checkpoints)
    best_metric_value: float | None = None  # that metric's measured value at best_step


@dataclass
class FitResult:
    global_step: int
    best_checkpoint: str | None
    best_eval_loss: float | None
    train_loss: float | None
    train_seconds: float
    tokens_seen: int
    stopped_early: bool
    resumed_from: str | None
    recoveries: int
    skipped_windows: list[int]
    micro_batch: int
    gradient_checkpointing: bool
    best_metric_name: str | None = None  # `training.metric_for_best` the best checkpoint was chosen by
    best_metric_value: float | None = None  # its value in the best checkpoint's evaluation
    best_metric_greater_is_better: bool | None = None  # that metric's direction (`training.greater_is_better` or tune's table)

    @classmethod
    def of(cls, st: LoopState, best, labels: tuple, greater: bool | None, losses: list[float], seconds: float, resume_from) -> "FitResult":
        """From the final loop state, the best checkpoint and its labels (eval loss, metric name, metric value)."""
        best_loss, best_name, best_value = labels
        return cls(
            global_step=st.step, best_checkpoint=str(best.path) if best else None, best_eval_loss=best_loss,
            best_metric_name=best_name, best_metric_value=best_value, best_metric_greater_is_better=greater,
            train_loss=sum(losses) / len(losses) if losses else None, train_seconds=seconds, tokens_seen=st.tokens_seen,
            stopped_early=st.stopped_early, resumed_from=str(resume_from.path) if resume_from else None,
            recoveries=st.recoveries, skipped_windows=list(st.skipped), micro_batch=st.micro_batch, gradient_checkpointing=st.gradient_checkpointing,
        )


# ------------------------------------------------------------------------------ RNG state


def capture_rng(sources: tuple[str, ...] = ("python", "numpy", "torch")) -> dict:
    """The global RNG states of ``sources`` (a checkpoint takes every one; the loop's snapshot before a step only those the
    objective's step draws from: Objective.step_rng), with CUDA's beside torch's; :func:`restore_rng` restores what it holds."""
    import numpy as np
    import torch

    state: dict = {}
    if "python" in sources:
        state["python"] = random.getstate()
    if "numpy" in sources:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    state["torch"] = torch.get_rng_state()
    if _cuda():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@functools.cache
def _cuda() -> bool:
    """Whether CUDA is there (asked once a process: the loop snapshots the RNGs before every step)."""
    import torch

    return torch.cuda.is_available()


def restore_rng(state: dict) -> None:
    import numpy as np
    import torch

    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
