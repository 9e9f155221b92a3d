"""Trainer callbacks: the event log, metrics.jsonl, and the training progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback

from trainpipe.events import EventLog


class EventsCallback(TrainerCallback):
    """Writes `training_started`, `eval_done`, `checkpoint_saved`, `training_finished`, and metrics.jsonl."""

    def __init__(self, events: EventLog, metrics_path: str | Path):
        self.events = events
        self.metrics_path = Path(metrics_path)
        self.last_eval: dict = {}
        self.t0 = 0.0

    def _metric(self, record: dict) -> None:
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.time()
        self.events.emit(
            "training_started",
            step=state.global_step,
            max_steps=state.max_steps,
            num_train_epochs=args.num_train_epochs,
            micro_batch=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            learning_rate=args.learning_rate,
        )

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs:
            return
        rec = {"time": time.time(), "step": state.global_step, "epoch": state.epoch, **logs}
        if state.num_input_tokens_seen:
            rec["tokens_seen"] = state.num_input_tokens_seen
        self._metric(rec)

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        metrics = metrics or {}
        self.last_eval = metrics
        self.events.emit("eval_done", step=state.global_step, phase="train", eval_loss=metrics.get("eval_loss"))

    def on_save(self, args, state, control, **kw):
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
        self.events.emit(
            "checkpoint_saved",
            step=state.global_step,
            path=str(path),
            eval_loss=self.last_eval.get("eval_loss"),
            size_bytes=size,
        )

    def on_train_end(self, args, state, control, **kw):
        stopped_early = state.max_steps > 0 and state.global_step < state.max_steps
        if stopped_early:
            self.events.emit("early_stopped", step=state.global_step, best_metric=state.best_metric, max_steps=state.max_steps)
        self.events.emit(
            "training_finished",
            step=state.global_step,
            seconds=round(time.time() - self.t0, 2),
            best_checkpoint=state.best_model_checkpoint,
            best_eval_loss=state.best_metric,
            tokens_seen=state.num_input_tokens_seen,
        )


class ProgressCallback(TrainerCallback):
    """A rich progress bar over optimizer steps with loss, tokens/s and ETA."""

    def __init__(self, progress):
        self.progress = progress
        self.task = None
        self.t0 = 0.0
        self.loss = float("nan")

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.time()
        self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, loss="-", tps="-")

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.loss = logs["loss"]
            if self.progress.disable:  # not a terminal: one plain line per logging step instead of a bar
                dt = max(time.time() - self.t0, 1e-6)
                tps = state.num_input_tokens_seen / dt if state.num_input_tokens_seen else 0.0
                eta = dt / max(state.global_step, 1) * (state.max_steps - state.global_step)
                self.progress.console.print(
                    f"  train step {state.global_step}/{state.max_steps} loss={self.loss:.4f} "
                    f"lr={logs.get('learning_rate', 0):.3g} tokens/s={tps:,.0f} eta={eta:,.0f}s"
                )

    def on_step_end(self, args, state, control, **kw):
        dt = max(time.time() - self.t0, 1e-6)
        tps = state.num_input_tokens_seen / dt if state.num_input_tokens_seen else 0.0
        self.progress.update(self.task, completed=state.global_step, loss=f"{self.loss:.4f}", tps=f"{tps:,.0f}")

    def on_train_end(self, args, state, control, **kw):
        self.progress.update(self.task, completed=state.global_step)
        self.progress.stop()
