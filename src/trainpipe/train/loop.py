"""trainpipe's training loop: every optimizer step under its control, so that it can be checkpointed, resumed to the bit,
retried after an OOM and rolled back after divergence.

The recipe (train/sft.py `build_loop`) builds what the loop receives from the resolved specs (`plan.specs`, never the
user's config): the model prepared for training (train/prepare.py), the optimizer and scheduler (train/optim.py), the
stepper (train/stepper.py: the micro-batch), the window plan (train/window.py: which examples each step reads), the
objective (train/objectives.py), the :class:`~trainpipe.distributed.strategy.Strategy` (one process, DDP or FSDP2: the
loop never asks which) and the callbacks (train/callbacks.py). The loop delegates each step's forward and backward passes
to the stepper (train/stepper.py: micro-batches, exact denominators), asks the recovery policies (train/recovery.py) what
to do after an OOM or a divergent step, ranks evals with the best-checkpoint tracker (train/best.py), and stops cleanly
on SIGTERM (train/preemption.py). Each failure has its event (see DESIGN.md). Under several processes rank 0 evaluates
and writes; a checkpoint records the effective batch, and a resume under another world size keeps it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from trainpipe.distributed import strategy as strategies
from trainpipe.distributed.env import NullEventLog
from trainpipe.events import EventLog
from trainpipe.model.checkpoints import CheckpointInfo, CheckpointManager
from trainpipe.plan.specs import RunSpecs
from trainpipe.train.best import BestTracker, best_labels, eval_metrics, rank_update
from trainpipe.train.callbacks import Callback, MetricsLog
from trainpipe.train.checkpointing import CheckpointWriter
from trainpipe.train.errors import Preempted, TrainingDiverged
from trainpipe.train.objectives import Objective, shards_eval
from trainpipe.train.optim import build_scheduler, running_stats, scale_lr, trainable
from trainpipe.train.preemption import Watchdog
from trainpipe.train.prepare import gradient_checkpointing
from trainpipe.train.recovery import DivergenceGuard, OomPolicy, evaluate_or_stop, image_tokens_per_micro_batch
from trainpipe.train.state import FitResult, LoopState, capture_rng, restore_rng
from trainpipe.train.stepper import Stepper
from trainpipe.train.telemetry import measure_memory, record_world
from trainpipe.train.window import WindowPlan


class TrainLoop:
    def __init__(self, *, model, device, optimizer, scheduler, plan: WindowPlan, strategy, objective: Objective, train_data: list[dict],
                 stepper: Stepper, specs: RunSpecs, ckpt: CheckpointManager, run_dir: Path, events: EventLog, config_yaml: str,
                 evaluate: Callable[[object], object], metrics_path: Path, progress=None, callbacks: list[Callback] = ()):
        self.model, self.optimizer, self.scheduler, self.plan, self.strategy = model, optimizer, scheduler, plan, strategy
        self.objective, self.data, self.ckpt, self.run_dir = objective, train_data, ckpt, Path(run_dir)
        self.specs, self.cadence, self.resilience = specs, specs.cadence, specs.resilience  # resolved by the plan: no `auto` here
        self.config_yaml, self.evaluate, self.callbacks = config_yaml, evaluate, list(callbacks)
        self.is_main = strategy.rank == 0
        self.events = events if self.is_main else NullEventLog()  # rank 0 speaks for the run: events, metrics, progress
        self.progress = progress if self.is_main else None
        self.metrics = MetricsLog(metrics_path, enabled=self.is_main, events=self.events)  # the run's listeners see each record
        self.device = device  # where the model was before any wrapping
        self.params = trainable(model)
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]  # the schedule's base rates, before any rollback scaling
        self.stepper, self.scaler, self.heartbeat, self.preemption = stepper, stepper.scaler, stepper.heartbeat, stepper.preemption
        self.state = LoopState(micro_batch=stepper.micro_batch, gradient_checkpointing=specs.batch.gradient_checkpointing,
                               effective_batch=plan.effective, world_size=strategy.dims.dp)
        res = self.resilience
        self.oom, self.guard, self.best = OomPolicy(res.oom_recovery), DivergenceGuard(res, getattr(objective, "spike_floor", 0.0)), BestTracker(self.cadence)
        self.eval_metrics: dict = {}  # the latest in-training eval: {"loss": ..., other metrics} (the callbacks read it)
        self._last_labels: dict = {}  # the latest eval's metric_name / metric_value / eval_loss: what a scored checkpoint is labelled with
        self.writer = CheckpointWriter(ckpt, self.events, config_yaml, res.on_checkpoint_error)
        self._measured = self._resuming = False
        self._resumed_world: int | None = None
        self._powersgd_note: str | None = None  # what a resume did with PowerSGD's state (restored / re-warmed and why)

    # ------------------------------------------------------------------ fit
    def fit(self, resume_from: CheckpointInfo | None = None) -> FitResult:
        t0 = time.time()
        self.preemption.install()  # signals first: a SIGTERM from here on is a clean, checkpointed stop
        self._start(resume_from)
        watchdog = self._start_watchdog()
        if self.progress:
            self.progress.start(self.plan.total_windows, self.state.step)
        losses: list[float] = []
        tokens_at_start = self.state.tokens_seen
        self._since_log = (time.time(), self.state.tokens_seen)
        try:
            while not self._finished():
                w = self.state.window
                if w in self.state.skipped:
                    self.state.window += 1
                    continue
                self.heartbeat.mark("compute")
                loss, n_tok, gnorm = self._step_with_oom_recovery(w)
                bad = self.guard.check(loss, gnorm, self.state.recent_losses)
                if bad:
                    self._roll_back(w, *bad)
                    self._since_log = (time.time(), self.state.tokens_seen)  # a rollback rewinds tokens_seen: throughput counts from there
                    continue
                self._optimizer_step()
                self._advance(loss, n_tok)
                losses.append(loss)
                for cb in self.callbacks:
                    cb.on_step_end(self, self.state.step, loss, gnorm)
                self.heartbeat.beat()
                if self.state.step % self.cadence.logging_steps == 0:
                    self._log(loss, gnorm)
                if self.progress:
                    self.progress.update(self.state.step, loss)
                if self._evaluate_save_or_stop():
                    break
        finally:
            if watchdog:
                watchdog.stop()
            self.preemption.uninstall()
            if self.progress:
                self.progress.stop()
        return self._finish(t0, losses, tokens_at_start, resume_from)

    def _start(self, resume_from: CheckpointInfo | None) -> None:
        """Resume (or turn on gradient checkpointing), announce the run, and write the step-0 rollback target."""
        if resume_from is not None:
            self._resuming = True  # a new process: PowerSGD's per-bucket state does not carry over (Strategy.load)
            self._load(resume_from)
            self._resuming = False
            self._apply_lr_scale()
            self.events.emit("checkpoint_resumed", step=self.state.step, checkpoint=str(resume_from.path), window=self.state.window,
                             **({"powersgd": self._powersgd_note} if self._powersgd_note else {}))
        elif self.state.gradient_checkpointing:
            self._set_gradient_checkpointing(True)
        self.model.train()
        self.events.emit(
            "training_started", step=self.state.step, max_steps=self.plan.total_windows, micro_batch=self.state.micro_batch,
            gradient_accumulation_steps=self.stepper.grad_accum, effective_batch=self.plan.effective,
            learning_rate=self.specs.optimizer.learning_rate, examples=len(self.data), resumed=resume_from is not None, **self._world_fields(),
        )
        if self._world_fields() and self.is_main:
            record_world(self.run_dir, self.strategy, self.state, self.plan.effective, self._resumed_world, self._powersgd_note)
        if resume_from is None and self.resilience.max_recoveries > 0:
            self.save(metric=None)  # step 0: a rollback target before the first regular save

    def _start_watchdog(self):
        """The strategy's hang watchdog (several processes), else this process's own when `training.hang_timeout_seconds`."""
        hb = self.heartbeat
        watchdog = strategies.hang_watchdog(self.strategy, run_dir=self.run_dir, progress=lambda: (self.state.step, hb.phase, hb.time),
                                               emit=self.events.emit if self.is_main else None)
        if watchdog is None and self.resilience.hang_timeout_seconds:
            watchdog = Watchdog(self.resilience.hang_timeout_seconds, self.run_dir, lambda: (self.state.step, hb.time), self.events.emit)
        if watchdog:
            watchdog.start()
        return watchdog

    def _finished(self) -> bool:
        return self.plan.finished(self.state.step, self.state.window)

    def _optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if not self._measured:  # plan meets reality: the live state's bytes, gradients still present
            self._measure_memory()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _advance(self, loss: float, n_tok: int) -> None:
        st = self.state
        st.step += 1
        st.window += 1
        st.tokens_seen += n_tok
        st.recent_losses = (st.recent_losses + [loss])[-self.resilience.loss_spike_window :]

    def _log(self, loss: float, gnorm: float) -> None:
        """One `metrics.jsonl` record every `logging_steps`; the callbacks add their figures and report on it."""
        st, (t_log, tok_log) = self.state, self._since_log
        dt = max(time.time() - t_log, 1e-9)
        rec = {
            "time": time.time(), "step": st.step, "epoch": round(st.window / self.plan.steps_per_epoch, 4), "loss": loss,
            "learning_rate": self.optimizer.param_groups[0]["lr"], "grad_norm": gnorm, "tokens_seen": st.tokens_seen,
            "tokens_per_second": (st.tokens_seen - tok_log) / dt,
        }
        rec.update(self.stepper.figures)  # objective-specific figures (e.g. DPO reward margin), per unit of weight
        rec["input_share"] = round(self.stepper.input_seconds / dt, 4)
        self.stepper.input_seconds = 0.0
        for cb in self.callbacks:
            rec.update(cb.log_fields(self))
        self.metrics.write(rec)
        for cb in self.callbacks:
            cb.on_log(self, rec)
        if self.progress:
            self.progress.log(rec, self.plan.total_windows)
        self._since_log = (time.time(), st.tokens_seen)

    def _evaluate_save_or_stop(self) -> bool:
        """Evaluate every `eval_steps` and at the end, save every `save_steps`, at the end, on a stop signal and at a best
        eval (so the best checkpoint holds the evaluated weights); stop on a signal (Preempted) or early. True: stop now."""
        st, metric = self.state, None
        last = self._finished()
        if st.step % self.cadence.eval_steps == 0 or last:
            metric = self._eval()
            last = last or st.stopped_early
        stop = strategies.stop_signal(self.strategy, self.preemption.signal, self.stepper.agreed_stop)  # all ranks stop at the step they agreed on
        best_now = metric is not None and st.best_step == st.step and self.cadence.keep_best > 0
        if st.step % self.cadence.save_steps == 0 or last or stop or best_now:
            self.save(metric)
        saved = str(self.writer.last_saved.path) if self.writer.last_saved else None
        if stop:
            self.events.emit("preempted", step=st.step, level="warning", signal=stop, checkpoint=saved, **self._world_fields())
            raise Preempted(st.step, saved, stop)
        if st.stopped_early:
            self.events.emit("early_stopped", step=st.step, best_metric=st.best_metric, best_step=st.best_step, patience=self.cadence.early_stopping_patience,
                             best_metric_name=st.best_metric_name or "loss", best_metric_value=st.best_metric_value)
        return st.stopped_early

    def _finish(self, t0: float, losses: list[float], tokens_at_start: int, resume_from: CheckpointInfo | None) -> FitResult:
        best, st = self.ckpt.best(), self.state
        seconds = round(time.time() - t0, 3)
        self._measure_memory(final=True, seconds=seconds, tokens=st.tokens_seen - tokens_at_start)
        best_loss, best_name, best_value = best_labels(best)
        self.events.emit(
            "training_finished", step=st.step, seconds=seconds, best_checkpoint=str(best.path) if best else None,
            best_eval_loss=best_loss, best_metric_name=best_name, best_metric_value=best_value, tokens_seen=st.tokens_seen,
        )
        return FitResult.of(st, best, best_labels(best), self.best.direction(best_name), losses, seconds, resume_from)

    # ------------------------------------------------------------------ one step and its recovery
    def _step_with_oom_recovery(self, w: int) -> tuple[float, int, float]:
        examples = self.plan.window(self.data, w, by_row=self.objective.gathers_rows)
        rng = capture_rng(self.objective.step_rng)  # only what a step can draw from (Objective.step_rng)
        attempt = 0
        while True:
            try:
                if attempt:
                    restore_rng(rng)  # the retried step draws the same dropout masks
                out = self.stepper.run(examples, w, self.state.micro_batch, self.state.step)
                if attempt:
                    self.events.emit("oom_recovered", step=self.state.step + 1, micro_batch=self.state.micro_batch,
                                     gradient_accumulation_steps=math.ceil(self.plan.effective / self.state.micro_batch),
                                     effective_batch=self.plan.effective, gradient_checkpointing=self.state.gradient_checkpointing,
                                     **self._image_tokens(examples))
                return out
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised when not an OOM
                if not self.oom.handles(exc):
                    raise
                self._after_oom(exc, examples)
                attempt += 1

    def _image_tokens(self, examples: list[dict]) -> dict:
        """`image_tokens_per_micro_batch` of this window at the current micro-batch (vision-language rows; {} for text)."""
        n = image_tokens_per_micro_batch(examples, self.state.micro_batch)
        return {} if n is None else {"image_tokens_per_micro_batch": n}

    def _after_oom(self, exc: BaseException, examples: list[dict]) -> None:
        """Act on the OOM policy's decision: halve the micro-batch, turn on gradient checkpointing, or stop with a plan."""
        import torch

        st = self.state
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = {"micro_batch": st.micro_batch, "gradient_checkpointing": st.gradient_checkpointing, **self._image_tokens(examples)}
        decision = self.oom.decide(st)
        if decision == "stop":
            self.events.emit("cuda_oom", step=st.step + 1, level="fatal", **before, error=str(exc)[:200], action="stop")
            raise self.oom.give_up(st.step + 1, exc) from None
        if decision == "halve":
            st.micro_batch //= 2
        else:
            self._set_gradient_checkpointing(True)
        eff = self.plan.effective
        self.events.emit("cuda_oom", **self.oom.recovered_fields(st, exc, decision, before, eff), **self._image_tokens(examples),
                         **strategies.oom_fields(self.strategy, eff, st.micro_batch, self._resumed_world, self.stepper.oom_ranks))

    def _roll_back(self, w: int, kind: str, figures: dict) -> None:
        """A divergent step: roll back to the newest good checkpoint, skip window ``w``, scale the learning rate down."""
        st = self.state
        self.optimizer.zero_grad(set_to_none=True)
        self.events.emit(kind, step=st.step + 1, level="warning", window=w, **figures)
        if self.guard.exhausted(st):
            self.events.emit("training_diverged", step=st.step + 1, level="fatal", recoveries=st.recoveries,
                             skipped_windows=st.skipped + [w], last_event=kind, **figures)
            raise self.guard.diverged(st, kind, figures, w, self.run_dir)
        good = self.ckpt.latest_valid(on_skip=self._on_corrupt)
        if good is None:
            raise TrainingDiverged(f"{kind} at step {st.step + 1} and no valid checkpoint to roll back to.")
        keep = self.guard.after_rollback(st, w)
        self._load(good)
        self.state.recoveries, self.state.skipped, self.state.lr_scale = keep["recoveries"], keep["skipped"], keep["lr_scale"]
        self._apply_lr_scale()
        self.events.emit("rolled_back", step=self.state.step, level="warning", checkpoint=str(good.path), lr_scale=self.state.lr_scale,
                         skipped_windows=self.state.skipped, recoveries=self.state.recoveries)

    def _apply_lr_scale(self) -> None:
        scale_lr(self.scheduler, self.optimizer, self.base_lrs, self.state.lr_scale)

    def _set_gradient_checkpointing(self, on: bool) -> None:
        self.state.gradient_checkpointing = gradient_checkpointing(self.model, on)

    # ------------------------------------------------------------------ evaluation
    def _eval(self) -> float:
        """One in-training eval (the strategy shards it or broadcasts rank 0's figure), recorded, ranked by
        `training.metric_for_best` and handed to the callbacks; returns the score its checkpoint is ranked by."""
        metric, shard_fields = self.strategy.evaluate(self._evaluate_or_stop, shards_eval(self.objective), self.heartbeat.mark)
        self.eval_metrics = eval_metrics(metric)  # what the callbacks read (tune's pruner: the study's objective metric)
        metric = self.eval_metrics["loss"]
        more = {k: v for k, v in self.eval_metrics.items() if k != "loss"}
        self.model.train()
        st = self.state
        self.events.emit("eval_done", step=st.step, phase="train", eval_loss=metric, **({"metrics": more} if more else {}), **shard_fields)
        self.metrics.write({"time": time.time(), "step": st.step, "eval_loss": metric, **{f"eval_{k}": v for k, v in more.items()}})
        name, value, score = self.best.rank(self.eval_metrics, st.step)
        self._last_labels = {"metric_name": name, "metric_value": value, "eval_loss": metric}
        rank_update(st, name, value, score, self.cadence.early_stopping_patience)  # best so far and early stopping, by the chosen metric
        for cb in self.callbacks:
            cb.on_eval(self, st.step, metric)
        return score

    def _evaluate_or_stop(self):
        return evaluate_or_stop(self.evaluate, self.model, self.state.step, self.events, self.specs.batch.eval_micro_batch)

    # ------------------------------------------------------------------ state and checkpoints
    def state_dict(self, gathered: dict | None = None) -> dict:
        """What a checkpoint's `state.pt` holds: optimizer, scheduler, RNG, the loop state (and every rank's RNG and
        PowerSGD state, FSDP's gathered optimizer state, from ``gathered``: the strategy's)."""
        gathered = gathered or {}
        full = gathered.get("gathered")
        st = {
            "optimizer": full[1] if full is not None else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng(),
            "loop": asdict(self.state),
            "objective": self.objective.state_dict() if hasattr(self.objective, "state_dict") else {},  # e.g. RL's reused rollouts
        }
        if gathered.get("rng_ranks") is not None:
            st["rng_ranks"] = gathered["rng_ranks"]  # rank r resumes with its own dropout stream
        if gathered.get("powersgd_ranks") is not None:
            st["powersgd_ranks"] = gathered["powersgd_ranks"]  # rank r's PowerSGD state (its own error feedback)
        if self.scaler:
            st["scaler"] = self.scaler.state_dict()
        return st

    def load_state_dict(self, st: dict) -> None:
        """Everything but the weights and the optimizer state (the strategy loads those): the checkpoint's effective batch,
        scheduler, scaler, loop state, this rank's RNG stream and the strategy's own state."""
        self._adopt_effective_batch(st["loop"])
        self.scheduler.load_state_dict(st["scheduler"])
        if self.scaler and "scaler" in st:
            self.scaler.load_state_dict(st["scaler"])
        self.state = LoopState(**st["loop"])
        if st.get("objective") and hasattr(self.objective, "load_state_dict"):
            self.objective.load_state_dict(st["objective"])
        if self.state.gradient_checkpointing:
            self._set_gradient_checkpointing(True)
        rank = self.strategy.rank
        ranks = st.get("rng_ranks") or [st["rng"]]
        restore_rng(ranks[rank] if rank < len(ranks) else st["rng"])
        if self.state.world_size != self.strategy.dims.dp:
            self._resumed_world = self.state.world_size
        self.state.effective_batch, self.state.world_size = self.plan.effective, self.strategy.dims.dp

    def _adopt_effective_batch(self, loop: dict) -> None:
        """Keep the checkpoint's effective batch when the world size changed (2 processes -> 1: the accumulation
        doubles): the next window is then the same examples the uninterrupted run reads."""
        eff = loop.get("effective_batch") or 0
        if eff and eff != self.plan.effective:
            self.plan = self.plan.with_effective(eff)
            self.scheduler = build_scheduler(self.optimizer, self.specs.optimizer, self.plan.total_windows)

    def save(self, metric: float | None) -> CheckpointInfo | None:
        """Save a checkpoint (every rank calls this; the strategy gathers what rank 0 writes)."""
        return self.strategy.checkpoint(lambda gathered: self._write_checkpoint(metric, gathered), capture_rng, self.model, self.optimizer,
                                        self.heartbeat.mark)

    def _write_checkpoint(self, metric: float | None, gathered: dict) -> CheckpointInfo | None:
        full, st = gathered.get("gathered"), self.state
        return self.writer.write(
            st.step, weights=(lambda: full[0]) if full is not None else (lambda: {n: p for n, p in self.params} | running_stats(self.model)),
            state=lambda: self.state_dict(gathered), model=self.model, metric=metric, sharded=self.strategy.shards_parameters,
            info={"window": st.window, "micro_batch": st.micro_batch, "effective_batch": self.plan.effective, "world_size": self.strategy.dims.dp},
            labels=dict(self._last_labels) if metric is not None else {},
        )

    def _load(self, info: CheckpointInfo) -> None:
        weights, st = CheckpointManager.load(info.path)
        self._powersgd_note = self.strategy.load(self.model, self.optimizer, weights, st, {n for n, _ in self.params}, info.path,
                                                 resuming=self._resuming, device=self.device)
        self.load_state_dict(st)

    def release(self) -> None:
        """After training: the strategy takes itself off the model (FSDP gathers the weights on every rank), so that rank 0
        evaluates and exports a plain model (all ranks call this)."""
        if self.strategy.release(self.model):
            self.params = trainable(self.model)

    def load_best_weights(self) -> CheckpointInfo | None:
        self.release()
        best = self.ckpt.best()
        if best is not None:
            weights, _ = CheckpointManager.load(best.path)
            self.model.load_state_dict(weights, strict=False)
        return best

    # ------------------------------------------------------------------ reporting
    def _world_fields(self) -> dict:
        return strategies.world_fields(self.strategy, self.plan.effective, self.state.micro_batch, self._resumed_world)

    def _measure_memory(self, final: bool = False, seconds: float | None = None, tokens: int | None = None) -> None:
        self._measured = True
        if self.is_main:
            measure_memory(self.run_dir, self.model, self.optimizer, self.device, self.state, final=final, seconds=seconds, tokens=tokens)

    def _on_corrupt(self, info: CheckpointInfo, reason: str) -> None:
        self.events.emit("checkpoint_skipped", step=info.step, level="warning", path=str(info.path), reason=reason)
