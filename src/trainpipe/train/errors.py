"""How a training run stops early: the exceptions the loop raises and the exit codes `trainpipe run` gives them."""

from __future__ import annotations

from trainpipe.errors import TrainpipeError
from trainpipe.model.checkpoints import CheckpointFailed

__all__ = ["EXIT_PREEMPTED", "EXIT_DIVERGED", "EXIT_OOM", "Preempted", "TrainingDiverged", "OutOfMemoryPlan", "CheckpointFailed", "StopTrial"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" -- rerun with --resume
EXIT_DIVERGED = 3
EXIT_OOM = 4


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    def __init__(self, step: int, checkpoint: str | None, signame: str):
        super().__init__(f"preempted by {signame} at step {step}")
        self.step, self.checkpoint, self.signame = step, checkpoint, signame


class TrainingDiverged(TrainpipeError):
    exit_code = EXIT_DIVERGED
    title = "training diverged"


class OutOfMemoryPlan(TrainpipeError):
    exit_code = EXIT_OOM
    title = "out of memory"


class StopTrial(Exception):
    """Raised by an eval hook to end the run at this eval (a pruned search trial, trainpipe/tune): no further steps, no export."""
