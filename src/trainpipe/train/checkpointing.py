"""Writing one checkpoint of the loop (rank 0): the weights, `state.pt`, the interop files other tools open, the labels of
the eval it is ranked by, rotation, and `training.on_checkpoint_error` when the write fails (model/checkpoints.py writes
and verifies the files)."""

from __future__ import annotations

import time

from trainpipe import ui
from trainpipe.model.checkpoints import CheckpointInfo, CheckpointManager, CheckpointWriteError, interop_writer
from trainpipe.train.errors import CheckpointFailed


class CheckpointWriter:
    def __init__(self, ckpt: CheckpointManager, events, config_yaml: str, on_error: str):
        self.ckpt, self.events, self.config_yaml, self.on_error = ckpt, events, config_yaml, on_error
        self.last_saved: CheckpointInfo | None = None
        self._warned_interop = False

    def write(self, step: int, *, weights, state, model, info: dict, metric: float | None, labels: dict, sharded: bool) -> CheckpointInfo | None:
        """``weights`` and ``state`` are called for the tensors and `state.pt`'s mapping (in that order, as they are written)."""
        t0 = time.time()
        try:
            saved = self.ckpt.save(
                step, weights=weights(), state=state(), config_yaml=self.config_yaml, metric=metric, info=info,
                extra=interop_writer(model, weights(), sharded=sharded, warn=self._warn_once),  # adapter/model files other tools open
                labels=labels,  # what `metric` ranks by (training.metric_for_best) and its measured value
            )
        except CheckpointWriteError as exc:
            self.events.emit("checkpoint_failed", step=step, level="error", cause=str(exc), policy=self.on_error)
            if self.on_error == "stop":
                raise CheckpointFailed(
                    f"Writing the checkpoint of step {step} failed ({exc}); the earlier checkpoints are intact. "
                    "Free disk space, then continue with `--resume`."
                ) from None
            return None
        size = sum(f.stat().st_size for f in saved.path.iterdir())
        self.ckpt.rotate()
        self.last_saved = saved
        ranked = {"metric_name": labels["metric_name"], "metric_value": labels["metric_value"]} if labels.get("metric_name", "loss") != "loss" else {}
        self.events.emit("checkpoint_saved", step=step, path=str(saved.path), eval_loss=labels.get("eval_loss", metric), **ranked,
                         size_bytes=size, seconds=round(time.time() - t0, 3))
        return saved

    def _warn_once(self, text: str) -> None:
        if not self._warned_interop:
            self._warned_interop = True
            ui.console().print(f"[yellow]warning:[/] {text}", markup=True, soft_wrap=True)
