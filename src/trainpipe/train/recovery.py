"""Recovery policies: what the loop does after an OOM in a training step and after a divergent step. Each returns a
decision; the loop acts on it (retry the window, roll back, stop).

- OOM (``cuda_oom`` -> ``oom_recovered``): halve the micro-batch (accumulation grows, the effective batch stays), then
  turn on gradient checkpointing, then stop with a plan (:class:`OomPolicy`). With images in the rows the events also
  count the most image tokens one micro-batch of the window holds, before and after (:func:`image_tokens_per_micro_batch`):
  images per example vary, so a halved micro-batch can keep most of them.
- NaN/Inf loss or gradient norm (``gradient_overflow``) or a loss above k x its running median (``loss_spike``): roll
  back to the newest good checkpoint, scale the learning rate down, skip the offending window, continue; after
  ``max_recoveries`` -> ``training_diverged`` (fatal) and a clean stop (:class:`DivergenceGuard`).
"""

from __future__ import annotations

import math
import statistics

from trainpipe import faults
from trainpipe.train.errors import OutOfMemoryPlan, TrainingDiverged
from trainpipe.train.state import LoopState


SPIKE_MIN_HISTORY = 3  # prior step losses a spike is judged against: early in training the history that exists is used


def is_loss_spike(loss: float, recent: list[float], factor: float, min_delta: float, floor: float = 0.0) -> float | None:
    """The running median when ``loss`` is a spike: above ``factor`` x the larger of the median of the recent step losses
    (the last ``loss_spike_window``, or as many as there are, ``SPIKE_MIN_HISTORY`` at least) and the objective's own
    scale ``floor`` (:attr:`Objective.spike_floor`: ln 2 for DPO, the loss of a model with no preference yet), and above
    the median by ``min_delta`` as well; None otherwise (or when ``factor`` is 0: detection off).

    The floor is why a converging DPO run is not stopped: its pair losses fall towards 0 (median 0.02) while a hard batch
    still scores 0.5-1.5, 25-75 x the median but below 3 x ln 2; a diverging one goes far above (log-sigmoid of large
    negative margins)."""
    if not factor or len(recent) < SPIKE_MIN_HISTORY:
        return None
    med = statistics.median(recent)
    ref = max(med, floor)
    return med if ref > 0 and loss > factor * ref and loss - med > min_delta else None


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def image_tokens_per_micro_batch(examples: list[dict], micro: int) -> int | None:
    """The most image tokens one micro-batch of a window holds (a vision-language model's rows count theirs,
    data/vision_chat.py; images per example vary, so halving the micro-batch does not halve this), None for text rows.
    Micro-batches are sliced as the stepper slices them (train/stepper.py): consecutive runs of ``micro`` examples of
    the window, one per rank and micro-step."""
    if not examples or "image_tokens" not in examples[0]:
        return None
    return max(sum(int(ex.get("image_tokens") or 0) for ex in examples[i : i + micro]) for i in range(0, len(examples), micro))


class OomPolicy:
    """`training.oom_recovery`: after an OOM in a training step, the next thing to try."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def handles(self, exc: BaseException) -> bool:
        return is_oom(exc) and bool(self.enabled)

    @staticmethod
    def decide(state: LoopState) -> str:
        """The next thing to try: "halve" the micro-batch, turn on "checkpointing", or "stop" (micro-batch 1 with checkpointing already)."""
        if state.micro_batch > 1:
            return "halve"
        if not state.gradient_checkpointing:
            return "checkpointing"
        return "stop"

    @staticmethod
    def recovered_fields(state: LoopState, exc: BaseException, decision: str, before: dict, effective: int) -> dict:
        """The `cuda_oom` warning of a recovery: what was done, the settings before and after (the effective batch stays)."""
        return {
            "step": state.step + 1, "level": "warning", "error": str(exc)[:200],
            "action": "halved the micro-batch" if decision == "halve" else "turned on gradient checkpointing", **{f"before_{k}": v for k, v in before.items()},
            "micro_batch": state.micro_batch, "gradient_accumulation_steps": math.ceil(effective / state.micro_batch), "effective_batch": effective,
            "gradient_checkpointing": state.gradient_checkpointing,
        }

    @staticmethod
    def give_up(step: int, exc: BaseException) -> OutOfMemoryPlan:
        return OutOfMemoryPlan(
            f"Out of memory at step {step} even with micro-batch 1 and gradient checkpointing "
            f"({str(exc)[:120]}). What would fit: a shorter `data.max_length`, LoRA instead of a full fine-tune "
            "(`method.peft: lora`), a smaller model, or a GPU with more memory. Resume from the newest "
            "checkpoint with `--resume` after the change."
        )


class DivergenceGuard:
    """Judges each step's loss and gradient norm (`training.loss_spike_*`) and how many rollbacks the run may take
    (`training.max_recoveries`, each scaling the learning rate by `training.recovery_lr_factor`): ``t`` is the resolved
    :class:`~trainpipe.plan.specs.ResilienceSpec` (`plan.specs.resilience`)."""

    def __init__(self, t, spike_floor: float):
        self.t = t
        self.floor = float(spike_floor or 0.0)

    def check(self, loss: float, gnorm: float, recent: list[float]) -> tuple[str, dict] | None:
        """(event, figures) of a divergent step, else None."""
        if not math.isfinite(loss) or not math.isfinite(gnorm):
            return "gradient_overflow", {"loss": loss, "grad_norm": gnorm}
        med = is_loss_spike(loss, recent, self.t.loss_spike_factor, self.t.loss_spike_min_delta, self.floor)
        if med is not None:
            return "loss_spike", {"loss": loss, "running_median": med, "objective_floor": round(self.floor, 6), "factor": self.t.loss_spike_factor}
        return None

    def exhausted(self, state: LoopState) -> bool:
        return state.recoveries >= self.t.max_recoveries

    def after_rollback(self, state: LoopState, w: int) -> dict:
        """What the rolled-back state keeps of the current one: one more recovery, the window skipped, a lower learning rate."""
        return {"recoveries": state.recoveries + 1, "skipped": sorted(set(state.skipped + [w])), "lr_scale": state.lr_scale * self.t.recovery_lr_factor}

    def diverged(self, state: LoopState, kind: str, figures: dict, w: int, run_dir) -> TrainingDiverged:
        return TrainingDiverged(
            f"Training diverged at step {state.step + 1} ({kind}: {figures}) after {state.recoveries} "
            f"rollback(s) with the learning rate scaled to {state.lr_scale:g}x. Likely causes: a learning rate "
            "too high (lower `training.learning_rate`), fp16 overflow (use bf16 or fp32), or bad data in the skipped "
            f"windows {state.skipped + [w]}. `trainpipe diagnose {run_dir}` shows the evidence."
        )


def evaluate_or_stop(evaluate, model, step: int, events, eval_batch_size: int):
    """One in-training evaluation. Out of memory here is not the training step's (whose micro-batch recovery does not
    apply): it stops with `cuda_oom` (`phase: eval`) and exit code 4, naming the evaluation settings to lower."""
    try:
        faults.before_eval(step)
        out = evaluate(model)  # the eval loss, or {"loss": ..., every other metric the recipe measured}
        return dict(out) if isinstance(out, dict) else float(out)
    except Exception as exc:  # noqa: BLE001 - only an OOM is handled here
        if not is_oom(exc):
            raise
        events.emit("cuda_oom", step=step, level="fatal", phase="eval", error=str(exc)[:200], action="stop", per_device_eval_batch_size=eval_batch_size)
        raise OutOfMemoryPlan(
            f"Out of memory in the evaluation after step {step} ({str(exc)[:120]}); the training steps fit. Lower "
            f"`training.per_device_eval_batch_size` (now {eval_batch_size}), `eval.max_new_tokens` for generated "
            "metrics, or `eval.max_samples`, then continue with `--resume`."
        ) from None
