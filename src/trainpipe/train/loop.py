"""trainpipe's training loop: every optimizer step under its control, so that it can be
checkpointed, resumed to the bit, retried after an OOM and rolled back after divergence.

Data order is a pure function of (seed, data window): window ``w`` of epoch ``e`` is the
``w``-th slice of ``effective_batch`` examples of a permutation seeded with ``seed + e``. The
loop position is therefore just the next window, and a resumed run reads exactly the
examples the uninterrupted one would have, none twice and none skipped. The loss of a
step is the sum of token losses over the whole window divided by its number of loss
tokens, so splitting a window into smaller micro-batches (after an OOM) changes nothing
but rounding.

Failure handling, each with its event (see DESIGN.md):
- OOM (``cuda_oom`` -> ``oom_recovered``): halve the micro-batch (accumulation grows, the
  effective batch stays), then turn on gradient checkpointing, then stop with a plan.
- NaN/Inf loss or gradient norm (``gradient_overflow``) or a loss above k x its running
  median (``loss_spike``): roll back to the newest good checkpoint, scale the learning
  rate down, skip the offending window, continue; after ``max_recoveries`` ->
  ``training_diverged`` (fatal) and a clean stop.
- SIGTERM/SIGINT (``preempted``): finish the step, save, exit with EXIT_PREEMPTED; a second
  signal exits at once (checkpoints are atomic, so nothing is corrupted).
- No step finishing within ``hang_timeout_seconds`` (``distributed_hang``): all thread
  stacks are dumped to the run directory.

Under several processes (``dist``: torchrun / ``trainpipe run --nproc-per-node``, DDP) the window is
the same: each micro-step reads ``micro_batch x world`` examples of it and rank r takes its r-th
slice, so the optimizer step's global batch is the one a single process reads, and 2 processes
with micro-batch b equal 1 process with 2b. Gradients are summed over ranks (DDP averages; the loss
is scaled by the world size), accumulation micro-steps run under ``no_sync``. One all-reduce per
step carries the loss, the figures, an OOM flag and a stop flag, so every rank takes the same
decision (halve the micro-batch, roll back, stop on SIGTERM) at the same step. Rank 0 evaluates and
writes (events, metrics, checkpoints with every rank's RNG state); the others wait for it. A
checkpoint records the effective batch, and a resume under another world size keeps it (the
accumulation changes). A rank that stops answering is named by distributed/ddp.py's watchdog.

Under ``distributed.strategy: fsdp`` (distributed/fsdp.py) the same loop runs on a model sharded in place by
FSDP2: forwards go through the model itself, accumulation micro-steps skip the reduce-scatter, the gradient
norm is the global one over the shards, every rank takes part in evaluation, and a checkpoint is the full
state every rank helps gather and rank 0 writes (one process's layout: it resumes under 1 process, DDP or
FSDP). ``load_best_weights`` first takes FSDP off the model (``release``), so rank 0 evaluates and exports a
plain model.
"""

from __future__ import annotations

import faulthandler
import math
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable

from trainpipe.config import TrainingConfig
from trainpipe.data.collate import IGNORE_INDEX, PadCollator
from trainpipe.errors import TrainpipeError
from trainpipe.events import EventLog
from trainpipe.distributed.env import all_reduce_sum as env_all_reduce_sum
from trainpipe.distributed.ddp import powersgd_state_dict as psgd_state_dict
from trainpipe import faults
from trainpipe.model.checkpoints import CheckpointInfo, CheckpointManager, CheckpointWriteError, interop_writer

if TYPE_CHECKING:
    from trainpipe.train.context import DistRuntime

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


class CheckpointFailed(TrainpipeError):
    exit_code = 1
    title = "checkpoint failed"


class StopTrial(Exception):
    """Raised by an eval hook to end the run at this eval (a pruned search trial, trainpipe/tune): no further steps, no export."""


# Callables (loop, step, eval_loss) run after every in-training eval, in this process: how `trainpipe tune` reports
# intermediate values to its pruner. A hook may raise StopTrial. Empty for an ordinary run. Every metric the recipe's
# in-training eval measured (classification accuracy, preference accuracy/margins, perplexity, generated metrics when
# `eval.generate_in_training`) is in `loop.eval_metrics` ({"loss": ..., ...}) when a hook runs.
EVAL_HOOKS: list = []


def eval_metrics(out) -> dict:
    """A recipe's in-training eval result as {name: float}: a bare number is the eval loss; a mapping must hold `loss` (the
    figure the best checkpoint, early stopping and divergence checks go by) and may hold any other numeric metric."""
    if not isinstance(out, dict):
        return {"loss": float(out)}
    if "loss" not in out:
        raise ValueError(f"an in-training eval must measure `loss` (it returned {', '.join(out) or 'nothing'})")
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def best_metric_of(t) -> tuple[str, bool]:
    """(the eval metric that ranks checkpoints, whether greater is better) from `training.metric_for_best` /
    `greater_is_better`; a null direction is read from the one table (`trainpipe.metrics.DIRECTIONS`: loss, perplexity, KL lower;
    accuracies, margins, rewards higher), and a metric it has no direction for is refused (ConfigError), never guessed."""
    from trainpipe.metrics import metric_direction, metric_key

    raw = getattr(t, "metric_for_best", None) or "loss"
    name = metric_key(raw)  # HF's / TRL's names too: `eval_loss`, `eval_accuracy`, `rewards/accuracies`
    greater = getattr(t, "greater_is_better", None)
    if greater is None:
        return name, metric_direction(raw, key="training.greater_is_better", field="training.metric_for_best") == "maximize"
    return name, bool(greater)


def best_labels(best: CheckpointInfo | None) -> tuple[float | None, str | None, float | None]:
    """(eval loss, metric name, metric value) of the best checkpoint; a checkpoint without labels (written before they were
    recorded, or ranked by loss) has its eval loss as `metric`."""
    if best is None:
        return None, None, None
    name = best.metric_name or "loss"
    loss = best.eval_loss if best.eval_loss is not None else (best.metric if name == "loss" else None)
    value = best.metric_value if best.metric_value is not None else (best.metric if name == "loss" else None)
    return loss, name, value


def rank_update(st: "LoopState", name: str, value: float, score: float, patience: int | None) -> bool:
    """Record one eval in the best-so-far and early-stopping state; True when it is the best so far. A state ranked by
    another metric (resumed with a changed `metric_for_best`) starts its ranking afresh; a NaN score never improves."""
    if st.best_metric is not None and (st.best_metric_name or "loss") != name:
        st.best_metric = st.best_metric_value = st.best_step = None
        st.evals_without_improvement = 0
    if not math.isnan(score) and (st.best_metric is None or score < st.best_metric):
        st.best_metric, st.best_step, st.evals_without_improvement = score, st.step, 0
        st.best_metric_name, st.best_metric_value = name, value
        return True
    st.evals_without_improvement += 1
    if patience and st.evals_without_improvement >= patience:
        st.stopped_early = True
    return False


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


# ------------------------------------------------------------------------------ RNG state


def capture_rng() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


# ------------------------------------------------------------------------------ objectives


class Objective:
    """What one training step minimises. The loop reads a window of examples, asks ``weight`` for
    the window's denominator (loss tokens for cross-entropy, pairs for DPO, prompts for RL), splits
    the window into micro-batches, and for each calls ``collate`` then ``loss_sum`` (the *sum* of the
    per-unit losses in that micro-batch, plus figures to log as sums). The step loss is
    sum / weight, so any micro-batch x accumulation split of a window gives the same gradient."""

    # The loss of a model that has learnt nothing of this objective yet (DPO's zero margin: ln 2). A loss spike is judged
    # against the larger of this and the running median (`is_loss_spike`): objectives whose losses fall far below their
    # starting scale while single batches stay noisy (preference losses) are compared with their own scale. 0: the median only.
    spike_floor: float = 0.0

    def weight(self, examples: list[dict]) -> int:
        raise NotImplementedError

    def tokens(self, examples: list[dict]) -> int:
        from trainpipe.data.tokenize import row_tokens

        return sum(row_tokens(ex) for ex in examples)

    def collate(self, examples: list[dict]) -> dict:
        raise NotImplementedError

    def loss_sum(self, model, batch: dict):
        """(sum of per-unit losses as a 0-dim tensor with grad, {name: summed float figure})."""
        raise NotImplementedError


class TokenCrossEntropy(Objective):
    """Next-token cross-entropy over the labelled tokens (SFT, continued pretraining)."""

    def __init__(self, pad_id: int):
        self._collate = PadCollator(pad_id)

    def weight(self, examples: list[dict]) -> int:
        return sum(sum(1 for x in ex["labels"][1:] if x != IGNORE_INDEX) for ex in examples)

    def tokens(self, examples: list[dict]) -> int:
        return self.weight(examples)

    def collate(self, examples: list[dict]) -> dict:
        return self._collate(examples)

    fused = False  # Liger's fused linear cross-entropy patched into the model (`training.use_liger_kernel` on a GPU; losses.setup_liger)

    def loss_sum(self, model, batch: dict):
        """Summed next-token CE, in float32 one chunk at a time (model/losses.py): never the full-vocabulary logits upcast at once."""
        from trainpipe.model.losses import chunked_cross_entropy_sum, shift_labels

        labels = batch.pop("labels")
        if self.fused:  # the model's own (Liger) loss; num_items_in_batch=1 makes its reduction the sum
            return model(**batch, labels=labels, num_items_in_batch=1).loss, {}
        logits = model(**batch).logits
        logits = logits[:, logits.size(1) - labels.size(1) :]  # prompt tuning returns logits for its virtual tokens too: drop them
        return chunked_cross_entropy_sum(logits, shift_labels(labels)), {}


def _prefix_tuned(model) -> bool:
    from peft import PeftModel, PeftType

    return isinstance(model, PeftModel) and model.active_peft_config.peft_type == PeftType.PREFIX_TUNING


# ------------------------------------------------------------------------------ the loop


class TrainLoop:
    def __init__(
        self,
        *,
        model,
        train_data: list[dict],
        pad_id: int,
        t: TrainingConfig,
        checkpoint_dir: Path,
        run_dir: Path,
        events: EventLog,
        config_yaml: str,
        evaluate: Callable[[object], float],
        metrics_path: Path,
        progress=None,
        objective: "Objective | None" = None,
        dist: "DistRuntime | None" = None,
    ):
        import torch

        self.torch = torch
        self.model = model
        self.data = train_data
        self.pad_id = pad_id
        self.objective = objective if objective is not None else TokenCrossEntropy(pad_id)
        self._extras: dict[str, float] = {}
        self._measured = False
        self.t = t
        self.run_dir = Path(run_dir)
        self.events = events
        self.config_yaml = config_yaml
        self.evaluate = evaluate
        self.eval_metrics: dict = {}  # the latest in-training eval: {"loss": ..., other metrics} (EVAL_HOOKS read it)
        self._last_labels: dict = {}  # the latest eval's metric_name / metric_value / eval_loss: what a scored checkpoint is labelled with
        self.metrics_path = Path(metrics_path)
        self.dist = dist
        self.world = dist.env.world_size if dist is not None else 1
        self.rank = dist.env.rank if dist is not None else 0
        self.is_main = self.rank == 0
        if not self.is_main:  # rank 0 speaks for the run: events, metrics, progress
            from trainpipe.distributed.env import NullEventLog

            self.events, progress = NullEventLog(), None
        self.progress = progress
        self.ckpt = CheckpointManager(checkpoint_dir, keep_last=t.save_total_limit, keep_best=t.keep_best)
        self.device = next(model.parameters()).device
        self._setup_liger(t.use_liger_kernel)
        self.fsdp = self.world > 1 and dist.strategy == "fsdp"  # FSDP2: the model is sharded in place, before the optimizer
        if self.fsdp:
            from trainpipe.distributed import fsdp

            fsdp.wrap(model, dist.grad_compression, dist.offload)
        self._gathered: tuple[dict, dict] | None = None  # FSDP: the full state rank 0 writes into the next checkpoint
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.effective = t.per_device_train_batch_size * t.gradient_accumulation_steps * self.world
        n = len(train_data)
        self.steps_per_epoch = max(1, math.ceil(n / self.effective))
        self.total_windows = t.max_steps if t.max_steps > 0 else max(1, math.ceil(t.num_train_epochs * self.steps_per_epoch))
        self.state = LoopState(micro_batch=t.per_device_train_batch_size, gradient_checkpointing=t.gradient_checkpointing,
                               effective_batch=self.effective, world_size=self.world)
        self._set_precision()
        self._check_packing()
        self.optimizer = self._optimizer()
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler = self._scheduler()
        self.scaler = torch.amp.GradScaler("cuda") if (t.fp16 and self.device.type == "cuda") else None
        self._perm_cache: dict[int, list[int]] = {}
        self._stop_signal: str | None = None
        self._heartbeat = time.time()
        self._watchdog_stop = threading.Event()
        self.last_saved: CheckpointInfo | None = None
        self._input_seconds = 0.0
        self._grace_timer: threading.Timer | None = None
        self._gpu_low_fired = False
        self._clipped: tuple[int, float] = (0, 0.0)  # (steps whose gradient was clipped, their largest pre-clip norm) this logging window
        self.ddp = None  # the DDP wrapper that forwards run through (distributed runs); self.model stays the bare model
        self._phase = "compute"  # what this rank is doing, for the distributed hang watchdog
        self._agreed_stop: str | None = None  # the stop signal as all ranks agreed it (distributed runs)
        self._rank_rngs: list | None = None
        self._resumed_world: int | None = None
        self._oom_ranks: list[int] = []  # the ranks that ran out of memory in the last OOM every rank recovered from
        self._powersgd_ranks: list | None = None  # every rank's PowerSGD state, for the checkpoint rank 0 writes
        self._powersgd_note: str | None = None  # what a resume did with PowerSGD's state (restored / re-warmed and why)
        if self.world > 1 and not self.fsdp:
            from trainpipe.distributed.ddp import wrap

            self.ddp = wrap(model, self.device, dist.grad_compression)

    def _fwd(self):
        """What forwards run through: the DDP wrapper, or the model itself (one process, or sharded in place by FSDP)."""
        return self.ddp if self.ddp is not None else self.model

    def _no_sync(self):
        """Accumulation micro-steps keep their gradients local (DDP: no all-reduce; FSDP: no reduce-scatter)."""
        if self.ddp is not None:
            return self.ddp.no_sync()
        if self.fsdp:
            from trainpipe.distributed import fsdp

            return fsdp.no_sync(self.model)
        return nullcontext()

    # ------------------------------------------------------------------ set-up
    def _setup_liger(self, enabled: bool) -> None:
        """`training.use_liger_kernel`: Liger's fused linear cross-entropy on a CUDA GPU for the token cross-entropy objectives;
        otherwise one message and the chunked loss (model/losses.py)."""
        if not enabled:
            return
        from trainpipe import ui
        from trainpipe.model.losses import setup_liger

        def say(text: str) -> None:
            if self.is_main:
                ui.console().print(f"[yellow]note:[/] {text}", markup=True, soft_wrap=True)

        if not isinstance(self.objective, TokenCrossEntropy):
            say(f"`training.use_liger_kernel: true` applies to the token cross-entropy of `sft` and `pretrain`; this objective "
                f"({type(self.objective).__name__}) computes its own loss, so it is not used here.")
            return
        self.objective.fused = setup_liger(self.model, self.device.type, True, say=say)

    def _optimizer(self):
        torch = self.torch
        decay = [p for n, p in self.params if p.ndim >= 2]
        no_decay = [p for n, p in self.params if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": self.t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        lr = self.t.learning_rate
        if self.t.optim in ("adamw_torch", "adamw_torch_fused"):
            fused = self.t.optim == "adamw_torch_fused" and self.device.type == "cuda"
            return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused or None)
        if self.t.optim == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=0.9)
        if self.t.optim in ("adamw_8bit", "paged_adamw_8bit"):
            return self._adamw_8bit(groups, lr)
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)

    def _adamw_8bit(self, groups: list[dict], lr: float):
        """bitsandbytes AdamW with 8-bit block-wise quantized moments (Dettmers et al. 2022); `paged_` keeps them in
        CUDA unified memory so spikes page out to the CPU instead of OOM-ing. On the CPU there is nothing to page."""
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise TrainpipeError(
                f"`training.optim: {self.t.optim}` is bitsandbytes' 8-bit AdamW, and bitsandbytes is not installed. Install it "
                "with `pip install 'trainpipe[qlora]'`, or use `training.optim: adamw_torch`."
            ) from None
        paged = self.t.optim == "paged_adamw_8bit"
        if paged and self.device.type != "cuda":
            from trainpipe import ui

            ui.console().print(
                f"[yellow]warning:[/] `training.optim: paged_adamw_8bit` pages optimizer state between GPU and CPU memory; "
                f"on {self.device.type} there is nothing to page, so `adamw_8bit` (the same update) is used.", markup=True, soft_wrap=True,
            )
            paged = False
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)

    def _check_packing(self) -> None:
        """Packed and padding-free rows separate their examples by position ids; prompt and prefix tuning put virtual
        tokens before the row and PEFT drops the position ids, so examples would attend to each other."""
        from peft import PeftModel

        first = self.data[0] if len(self.data) else {}
        packed = first.get("position_ids") is not None or first.get("padding_free")
        if packed and isinstance(self.model, PeftModel) and self.model.active_peft_config.is_prompt_learning:
            raise TrainpipeError(
                f"`method.peft: {self.model.active_peft_config.peft_type.value.lower()}` cannot train on packed rows (`data.packing: pack` "
                "or `padding_free`): its virtual tokens come before the whole row and PEFT drops the position ids that keep packed "
                "examples apart, so they would attend to each other. Set `data.packing: none`."
            )

    def _set_precision(self) -> None:
        """TF32 matmuls on CUDA (`training.tf32`; unset: on) and `torch.compile` of the model (`training.torch_compile`,
        in place: parameter names, and so checkpoints, stay the same). bf16/fp16 autocast is applied per step; on
        hardware without it the plan has already fallen back to fp32 (plan.resolve)."""
        torch = self.torch
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.t.tf32 is not False
            torch.backends.cudnn.allow_tf32 = self.t.tf32 is not False
        if self.t.torch_compile:
            self.model.compile()

    def _scheduler(self):
        from transformers import get_scheduler

        warm = self.t.warmup_steps if self.t.warmup_steps is not None else math.ceil(self.t.warmup_ratio * self.total_windows)
        return get_scheduler(self.t.lr_scheduler_type, self.optimizer, num_warmup_steps=warm, num_training_steps=self.total_windows)

    def _apply_lr_scale(self) -> None:
        self.scheduler.base_lrs = [lr * self.state.lr_scale for lr in self.base_lrs]
        for i, g in enumerate(self.optimizer.param_groups):
            g["lr"] = self.scheduler.base_lrs[i] * self.scheduler.lr_lambdas[i](self.scheduler.last_epoch)

    def _set_gradient_checkpointing(self, on: bool) -> None:
        if on and _prefix_tuned(self.model):
            raise TrainpipeError(
                "`method.peft: prefix_tuning` cannot train with gradient checkpointing: the learned prefix reaches every layer "
                "as its key/value cache, and checkpointed layers run without a cache (the attention shapes then disagree). "
                "Set `training.gradient_checkpointing: false` (and, if memory is short, a smaller "
                "`training.per_device_train_batch_size`), or use `method.peft: prompt_tuning`."
            )
        if on:
            from trainpipe.model.loading import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.model)  # model/loading.py: also what the memory tracer applies
        self.state.gradient_checkpointing = on

    # ------------------------------------------------------------------ data
    def window_indices(self, w: int) -> list[int]:
        epoch, k = divmod(w, self.steps_per_epoch)
        if epoch not in self._perm_cache:
            g = self.torch.Generator().manual_seed(self.t.seed + epoch)
            self._perm_cache = {epoch: self.torch.randperm(len(self.data), generator=g).tolist()}
        perm = self._perm_cache[epoch]
        return perm[k * self.effective : (k + 1) * self.effective]

    # ------------------------------------------------------------------ one step
    def _forward_backward(self, w: int) -> tuple[float, int, float]:
        torch = self.torch
        examples = [self.data[i] for i in self.window_indices(w)]
        obj = self.objective
        denom = max(obj.weight(examples), 1)  # loss = sum over the whole window / its weight: exact under any micro-batching
        n_tokens = obj.tokens(examples)
        total = torch.zeros((), device=self.device)
        micro = self.state.micro_batch
        amp = self.device.type == "cuda" and (self.t.bf16 or self.t.fp16)
        amp_dtype = torch.bfloat16 if self.t.bf16 else torch.float16
        extras: dict[str, float] = {}
        world, rank = self.world, self.rank
        starts = range(0, len(examples), micro * world)  # one micro-step: micro x world examples, rank r takes the r-th slice
        oom: BaseException | None = None
        synced = False
        for j, i in enumerate(starts):
            part = examples[i + rank * micro : i + (rank + 1) * micro]
            idle = not part  # the window's last micro-step has fewer examples than ranks x micro: join the sync with a zero loss
            sync = j == len(starts) - 1
            if oom is not None:  # FSDP: this rank ran out of memory earlier in the window; every sharded forward and backward is a
                self._join_step(examples, amp, amp_dtype, sync)  # collective, so it keeps taking part (zero loss) until the window ends
                synced = synced or sync
                continue
            forwarding = False  # an OOM before the forward leaves the collectives of every rank in step (FSDP can recover from it)
            try:
                with self._no_sync() if not sync else nullcontext():
                    faults.before_forward(w)
                    tc = time.perf_counter()
                    faults.slow_input()
                    batch = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in obj.collate(part or examples[:1]).items()}
                    self._input_seconds += time.perf_counter() - tc
                    forwarding = True
                    with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp):
                        loss_sum, extra = obj.loss_sum(self._fwd(), batch)
                    if idle:
                        loss_sum, extra = loss_sum * 0.0, {k: 0.0 for k in extra}
                    for k, v in extra.items():
                        extras[k] = extras.get(k, 0.0) + float(v)
                    loss = faults.poison_loss(w, loss_sum / denom)
                    back = loss * world if world > 1 else loss  # DDP averages over the ranks; the window's gradient is their sum
                    if sync and world > 1:
                        self._mark("wait")  # the backward ends in the gradient all-reduce
                    (self.scaler.scale(back) if self.scaler else back).backward()
                    synced = synced or sync
                    total += loss.detach()
            except Exception as exc:  # noqa: BLE001 - an OOM on one rank must become every rank's OOM (below)
                if world == 1 or not is_oom(exc):
                    raise
                if self.fsdp and forwarding:
                    raise OutOfMemoryPlan(
                        f"Out of memory on rank {rank} inside a sharded forward or backward at step {self.state.step + 1} ({str(exc)[:120]}). "
                        "Under `distributed.strategy: fsdp` the other ranks are then waiting in that forward's collectives, so this rank "
                        "cannot retry with a smaller micro-batch; the launcher stops every worker. Resume with `--resume` after setting a "
                        "smaller `training.per_device_train_batch_size` (the accumulation grows, the effective batch stays) or "
                        "`training.gradient_checkpointing: true`."
                    ) from None
                oom = exc
                if not self.fsdp:
                    break  # DDP: the micro-steps before the last keep their gradients local; the all-reduce is joined below
                self._join_step(examples, amp, amp_dtype, sync)
                synced = synced or sync
        if world > 1:
            if not synced:  # this rank ran out of memory before the gradient all-reduce: take part in it, then all retry
                self._join_sync(examples, amp, amp_dtype)
            names = sorted(extras)
            self._mark("wait")
            red = env_all_reduce_sum([float(total), float(oom is not None), float(self._stop_signal is not None), *(extras[k] for k in names)], self.device)
            self._mark("compute")
            total = torch.tensor(red[0])
            extras = dict(zip(names, red[3:]))
            if red[2] and self._agreed_stop is None:
                self._agreed_stop = self._stop_signal or "SIGTERM"
            if red[1]:
                from trainpipe.distributed.env import gather_objects

                self._oom_ranks = [r for r, hit in enumerate(gather_objects(oom is not None)) if hit]
                self.optimizer.zero_grad(set_to_none=True)
                raise oom if oom is not None else torch.OutOfMemoryError(f"out of memory on another rank ({int(red[1])} of {world} ranks)")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], self.t.max_grad_norm)  # FSDP: the global norm of the sharded gradients (a DTensor)
        if self.fsdp:
            from trainpipe.distributed.fsdp import scalar

            gnorm = scalar(gnorm)
        self._extras = {k: v / denom for k, v in extras.items()}
        return float(total), n_tokens, float(gnorm)

    def _join_sync(self, examples: list[dict], amp: bool, amp_dtype) -> None:
        """A zero-loss micro-step that only takes part in DDP's gradient all-reduce (after an OOM on this rank)."""
        torch = self.torch
        batch = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in self.objective.collate(examples[:1]).items()}
        with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp):
            loss_sum, _ = self.objective.loss_sum(self._fwd(), batch)
        self._mark("wait")
        (loss_sum * 0.0).backward()

    def _powersgd(self):
        """The live PowerSGD state of this rank's DDP hook (`distributed.grad_compression: powersgd`), else None."""
        return getattr(self.ddp, "trainpipe_hook_state", None) if self.ddp is not None else None

    def _load_powersgd(self, st: dict) -> None:
        """A rollback (same processes, same DDP) gives each rank its own PowerSGD state back from the checkpoint (iteration
        count, projections, its error feedback), keyed by the gradient buckets it was saved with. A resume re-warms
        PowerSGD from scratch (plain all-reduce for its first steps again), as stated in `checkpoint_resumed` and the
        manifest: the new processes' DDP lays its buckets out anew (and rebuilds them after its first step), so the saved
        per-bucket residuals and P/Q would land on other parameters; restoring them made a resumed 2-process run differ
        from the uninterrupted one by 3e-4 (not bit-exact) in a test, so they are not restored."""
        psgd = self._powersgd()
        saved = st.get("powersgd_ranks")
        if psgd is None:
            self._powersgd_note = None
            return
        from trainpipe.distributed.ddp import POWERSGD_START_STEP, load_powersgd_state

        if getattr(self, "_resuming", False):
            self._powersgd_note = (f"re-warmed from scratch (a resumed run's DDP lays out its gradient buckets anew, so the saved per-bucket "
                                   f"state does not apply): plain all-reduce for {POWERSGD_START_STEP} steps, then rank-1 compression")
            return
        if saved and len(saved) == self.world:
            load_powersgd_state(psgd, saved[self.rank], self.device)
            self._powersgd_note = f"restored (iteration {int(saved[self.rank]['iter'])}, every rank's error feedback)"
            return
        why = f"the checkpoint holds the state of {len(saved)} rank(s), this run has {self.world}" if saved else "the checkpoint holds no PowerSGD state"
        self._powersgd_note = f"re-warmed from scratch ({why}): plain all-reduce for {POWERSGD_START_STEP} steps, then rank-1 compression"

    def _oom_world_fields(self) -> dict:
        """Under several processes (every rank is in the OOM recovery together): each rank's micro-batch after the decision,
        gathered, and the per-rank accumulation that keeps the effective batch."""
        if self.world == 1:
            return {}
        from trainpipe.distributed.env import gather_objects

        return {**self._world_fields(), "micro_batch_per_rank": gather_objects(self.state.micro_batch), "ranks_out_of_memory": self._oom_ranks}

    def _join_step(self, examples: list[dict], amp: bool, amp_dtype, sync: bool) -> None:
        """FSDP, after an OOM on this rank: a zero-loss micro-step on one example, so that this rank's all-gathers (and, on the
        window's last micro-step, reduce-scatter) pair with the other ranks'; then every rank retries the window together."""
        with self._no_sync() if not sync else nullcontext():
            self._join_sync(examples, amp, amp_dtype)

    def _mark(self, phase: str) -> None:
        """This rank's phase and the time of its last progress, read by the distributed hang watchdog."""
        self._phase = phase
        self._heartbeat = time.time()

    def _step_with_oom_recovery(self, w: int) -> tuple[float, int, float]:
        rng = capture_rng()
        attempt = 0
        while True:
            try:
                if attempt:
                    restore_rng(rng)  # the retried step draws the same dropout masks
                out = self._forward_backward(w)
                if attempt:
                    self.events.emit(
                        "oom_recovered", step=self.state.step + 1, micro_batch=self.state.micro_batch,
                        gradient_accumulation_steps=math.ceil(self.effective / self.state.micro_batch),
                        effective_batch=self.effective, gradient_checkpointing=self.state.gradient_checkpointing,
                    )
                return out
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised when not an OOM
                if not is_oom(exc) or not self.t.oom_recovery:
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    self.torch.cuda.empty_cache()
                before = {"micro_batch": self.state.micro_batch, "gradient_checkpointing": self.state.gradient_checkpointing}
                if self.state.micro_batch > 1:
                    self.state.micro_batch //= 2
                    action = "halved the micro-batch"
                elif not self.state.gradient_checkpointing:
                    self._set_gradient_checkpointing(True)
                    action = "turned on gradient checkpointing"
                else:
                    self.events.emit("cuda_oom", step=self.state.step + 1, level="fatal", **before, error=str(exc)[:200], action="stop")
                    raise OutOfMemoryPlan(
                        f"Out of memory at step {self.state.step + 1} even with micro-batch 1 and gradient checkpointing "
                        f"({str(exc)[:120]}). What would fit: a shorter `data.max_length`, LoRA instead of a full fine-tune "
                        "(`method.peft: lora`), a smaller model, or a GPU with more memory. Resume from the newest "
                        "checkpoint with `--resume` after the change."
                    ) from None
                self.events.emit(
                    "cuda_oom", step=self.state.step + 1, level="warning", error=str(exc)[:200], action=action, **{f"before_{k}": v for k, v in before.items()},
                    micro_batch=self.state.micro_batch, gradient_accumulation_steps=math.ceil(self.effective / self.state.micro_batch),
                    effective_batch=self.effective, gradient_checkpointing=self.state.gradient_checkpointing, **self._oom_world_fields(),
                )
                attempt += 1

    # ------------------------------------------------------------------ divergence
    def _diverged(self, loss: float, gnorm: float) -> tuple[str, dict] | None:
        if not math.isfinite(loss) or not math.isfinite(gnorm):
            return "gradient_overflow", {"loss": loss, "grad_norm": gnorm}
        hist = self.state.recent_losses
        floor = float(getattr(self.objective, "spike_floor", 0.0) or 0.0)
        med = is_loss_spike(loss, hist, self.t.loss_spike_factor, self.t.loss_spike_min_delta, floor)
        if med is not None:
            return "loss_spike", {"loss": loss, "running_median": med, "objective_floor": round(floor, 6), "factor": self.t.loss_spike_factor}
        return None

    def _recover(self, w: int, kind: str, figures: dict) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.events.emit(kind, step=self.state.step + 1, level="warning", window=w, **figures)
        if self.state.recoveries >= self.t.max_recoveries:
            self.events.emit(
                "training_diverged", step=self.state.step + 1, level="fatal", recoveries=self.state.recoveries,
                skipped_windows=self.state.skipped + [w], last_event=kind, **figures,
            )
            raise TrainingDiverged(
                f"Training diverged at step {self.state.step + 1} ({kind}: {figures}) after {self.state.recoveries} "
                f"rollback(s) with the learning rate scaled to {self.state.lr_scale:g}x. Likely causes: a learning rate "
                "too high (lower `training.learning_rate`), fp16 overflow (use bf16 or fp32), or bad data in the skipped "
                f"windows {self.state.skipped + [w]}. `trainpipe diagnose {self.run_dir}` shows the evidence."
            )
        good = self.ckpt.latest_valid(on_skip=self._on_corrupt)
        if good is None:
            raise TrainingDiverged(f"{kind} at step {self.state.step + 1} and no valid checkpoint to roll back to.")
        keep = {"recoveries": self.state.recoveries + 1, "skipped": sorted(set(self.state.skipped + [w])), "lr_scale": self.state.lr_scale * self.t.recovery_lr_factor}
        self._load(good)
        self.state.recoveries, self.state.skipped, self.state.lr_scale = keep["recoveries"], keep["skipped"], keep["lr_scale"]
        self._apply_lr_scale()
        self.events.emit(
            "rolled_back", step=self.state.step, level="warning", checkpoint=str(good.path), lr_scale=self.state.lr_scale,
            skipped_windows=self.state.skipped, recoveries=self.state.recoveries,
        )

    # ------------------------------------------------------------------ checkpoints
    def _weights(self) -> dict:
        if self._gathered is not None:
            return self._gathered[0]
        return {n: p for n, p in self.params}

    def _state(self) -> dict:
        st = {
            "optimizer": self._gathered[1] if self._gathered is not None else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng(),
            "loop": asdict(self.state),
        }
        if self._rank_rngs is not None:
            st["rng_ranks"] = self._rank_rngs  # rank r resumes with its own dropout stream
        if self._powersgd_ranks is not None:
            st["powersgd_ranks"] = self._powersgd_ranks  # rank r's PowerSGD state (its own error feedback)
        if self.scaler:
            st["scaler"] = self.scaler.state_dict()
        return st

    def save(self, metric: float | None) -> CheckpointInfo | None:
        """Save a checkpoint. Under several processes every rank calls this: rank 0 writes (with every rank's RNG state),
        the others wait for its outcome, so that a failed write stops (or continues) all of them alike."""
        if self.world == 1:
            return self._write_checkpoint(metric)
        from trainpipe.distributed.env import broadcast_object, gather_objects

        self._mark("wait")
        rngs = gather_objects(capture_rng())
        psgd = self._powersgd()
        psgd_ranks = gather_objects(psgd_state_dict(psgd)) if psgd is not None else None
        if self.fsdp:  # every rank takes part in gathering the full state; rank 0 receives it
            from trainpipe.distributed.fsdp import full_state

            self._gathered = full_state(self.model, self.optimizer)
        info, outcome = None, None
        if self.is_main:
            self._rank_rngs = rngs
            self._powersgd_ranks = psgd_ranks
            self._mark("checkpoint")
            try:
                info = self._write_checkpoint(metric)
            except CheckpointFailed as exc:
                outcome = exc.message
                broadcast_object(outcome)
                raise
            finally:
                self._gathered = None
        self._gathered = None
        self._mark("wait")
        outcome = broadcast_object(outcome)
        self._mark("compute")
        if outcome is not None:
            raise CheckpointFailed(outcome)
        return info

    def _write_checkpoint(self, metric: float | None) -> CheckpointInfo | None:
        t0 = time.time()
        labels = dict(self._last_labels) if metric is not None else {}
        try:
            info = self.ckpt.save(
                self.state.step, weights=self._weights(), state=self._state(), config_yaml=self.config_yaml, metric=metric,
                info={"window": self.state.window, "micro_batch": self.state.micro_batch, "effective_batch": self.effective, "world_size": self.world},
                extra=interop_writer(self.model, self._weights(), sharded=self.fsdp, warn=self._warn_once),  # adapter/model files other tools open
                labels=labels,  # what `metric` ranks by (training.metric_for_best) and its measured value
            )
        except CheckpointWriteError as exc:
            self.events.emit("checkpoint_failed", step=self.state.step, level="error", cause=str(exc), policy=self.t.on_checkpoint_error)
            if self.t.on_checkpoint_error == "stop":
                raise CheckpointFailed(
                    f"Writing the checkpoint of step {self.state.step} failed ({exc}); the earlier checkpoints are intact. "
                    "Free disk space, then continue with `--resume`."
                ) from None
            return None
        size = sum(f.stat().st_size for f in info.path.iterdir())
        self.ckpt.rotate()
        self.last_saved = info
        ranked = {"metric_name": labels["metric_name"], "metric_value": labels["metric_value"]} if labels.get("metric_name", "loss") != "loss" else {}
        self.events.emit("checkpoint_saved", step=self.state.step, path=str(info.path), eval_loss=labels.get("eval_loss", metric), **ranked,
                         size_bytes=size, seconds=round(time.time() - t0, 3))
        return info

    def _load(self, info: CheckpointInfo) -> None:
        weights, st = CheckpointManager.load(info.path)
        trainable = {n for n, _ in self.params}
        missing = trainable - set(weights)
        if self.fsdp:  # every rank reads the full state and keeps its shard
            from trainpipe.distributed.fsdp import load_full_state

            unexpected = sorted(set(weights) - {n for n, _ in self.model.named_parameters()})
            if unexpected or missing:
                raise TrainpipeError(f"Checkpoint {info.path} does not match the model (missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}).")
            load_full_state(self.model, self.optimizer, weights, st["optimizer"])
        else:
            result = self.model.load_state_dict(weights, strict=False)
            if result.unexpected_keys or missing:
                raise TrainpipeError(f"Checkpoint {info.path} does not match the model (missing {sorted(missing)[:3]}, unexpected {result.unexpected_keys[:3]}).")
            self.optimizer.load_state_dict(st["optimizer"])
        self._adopt_effective_batch(st["loop"])
        self.scheduler.load_state_dict(st["scheduler"])
        if self.scaler and "scaler" in st:
            self.scaler.load_state_dict(st["scaler"])
        loop = st["loop"]
        self.state = LoopState(**loop)
        if self.state.gradient_checkpointing:
            self._set_gradient_checkpointing(True)
        ranks = st.get("rng_ranks") or [st["rng"]]
        restore_rng(ranks[self.rank] if self.rank < len(ranks) else st["rng"])
        self._load_powersgd(st)
        if self.state.world_size != self.world:
            self._resumed_world = self.state.world_size
        self.state.effective_batch, self.state.world_size = self.effective, self.world

    def _adopt_effective_batch(self, loop: dict) -> None:
        """Keep the checkpoint's effective batch when the world size changed (2 processes -> 1: the accumulation
        doubles): the next window is then the same examples the uninterrupted run reads."""
        eff = loop.get("effective_batch") or 0
        if eff and eff != self.effective:
            self.effective = eff
            self.steps_per_epoch = max(1, math.ceil(len(self.data) / eff))
            if self.t.max_steps <= 0:
                self.total_windows = max(1, math.ceil(self.t.num_train_epochs * self.steps_per_epoch))
            self.scheduler = self._scheduler()
            self._perm_cache = {}

    def _warn_once(self, text: str) -> None:
        if getattr(self, "_warned_interop", False):
            return
        self._warned_interop = True
        from trainpipe import ui

        ui.console().print(f"[yellow]warning:[/] {text}", markup=True, soft_wrap=True)

    def _on_corrupt(self, info: CheckpointInfo, reason: str) -> None:
        self.events.emit("checkpoint_skipped", step=info.step, level="warning", path=str(info.path), reason=reason)

    def release(self) -> None:
        """After training under FSDP: gather the weights on every rank and take FSDP off the model, so that rank 0
        evaluates and exports a plain model (all ranks call this). A no-op otherwise."""
        if self.fsdp:
            from trainpipe.distributed.fsdp import release

            release(self.model)
            self.fsdp = False
            self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def load_best_weights(self) -> CheckpointInfo | None:
        self.release()
        best = self.ckpt.best()
        if best is not None:
            weights, _ = CheckpointManager.load(best.path)
            self.model.load_state_dict(weights, strict=False)
        return best

    # ------------------------------------------------------------------ signals, watchdog
    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_signal is not None:  # second signal: out now; checkpoints are atomic
            os._exit(128 + signum)
        self._stop_signal = name
        self._grace_timer = threading.Timer(self.t.preemption_grace_seconds, lambda: os._exit(EXIT_PREEMPTED))
        self._grace_timer.daemon = True
        self._grace_timer.start()

    def _watchdog(self) -> None:
        timeout = self.t.hang_timeout_seconds
        fired_for = None
        while not self._watchdog_stop.wait(min(max(timeout / 4, 0.05), 5.0)):
            beat = self._heartbeat
            if time.time() - beat > timeout and fired_for != beat:
                fired_for = beat
                path = self.run_dir / f"hang-stacks-step-{self.state.step}.txt"
                with open(path, "w") as fh:
                    faulthandler.dump_traceback(file=fh, all_threads=True)
                name = "distributed_hang"
                try:
                    import torch.distributed as dist

                    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
                        name = "nccl_timeout"
                except Exception:  # noqa: BLE001
                    pass
                self.events.emit(name, step=self.state.step, level="error", seconds_without_progress=round(time.time() - beat, 1), stacks=str(path))

    # ------------------------------------------------------------------ fit
    def fit(self, resume_from: CheckpointInfo | None = None) -> FitResult:
        t0 = time.time()
        # signals first: a SIGTERM from here on is a clean, checkpointed stop
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if threading.current_thread() is threading.main_thread() else {}
        if resume_from is not None:
            self._resuming = True  # a new process: PowerSGD's per-bucket state does not carry over (_load_powersgd)
            self._load(resume_from)
            self._resuming = False
            self._apply_lr_scale()
            self.events.emit("checkpoint_resumed", step=self.state.step, checkpoint=str(resume_from.path), window=self.state.window,
                             **({"powersgd": self._powersgd_note} if self._powersgd_note else {}))
        elif self.state.gradient_checkpointing:
            self._set_gradient_checkpointing(True)
        self.model.train()
        self.events.emit(
            "training_started", step=self.state.step, max_steps=self.total_windows, micro_batch=self.state.micro_batch,
            gradient_accumulation_steps=self.t.gradient_accumulation_steps, effective_batch=self.effective,
            learning_rate=self.t.learning_rate, examples=len(self.data), resumed=resume_from is not None,
            **self._world_fields(),
        )
        if self.world > 1 or self._resumed_world is not None:
            self._record_world()
        if resume_from is None and self.t.max_recoveries > 0:
            self.save(metric=None)  # step 0: a rollback target before the first regular save

        if self.world > 1:
            watchdog = self._distributed_watchdog()
        else:
            watchdog = threading.Thread(target=self._watchdog, name="trainpipe-watchdog", daemon=True) if self.t.hang_timeout_seconds else None
        if watchdog:
            watchdog.start()
        if self.progress:
            self.progress.start(self.total_windows, self.state.step)
        losses: list[float] = []
        tokens_at_start = self.state.tokens_seen
        t_log, tok_log = time.time(), self.state.tokens_seen
        try:
            while not self._finished():
                w = self.state.window
                if w in self.state.skipped:
                    self.state.window += 1
                    continue
                self._mark("compute")
                loss, n_tok, gnorm = self._step_with_oom_recovery(w)
                bad = self._diverged(loss, gnorm)
                if bad:
                    self._recover(w, *bad)
                    t_log, tok_log = time.time(), self.state.tokens_seen  # a rollback rewinds tokens_seen: throughput counts from there
                    continue
                if self.scaler:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
                if not self._measured:
                    self._measure_memory()  # plan meets reality: the live state's bytes, gradients still present
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                st = self.state
                st.step += 1
                st.window += 1
                st.tokens_seen += n_tok
                st.recent_losses = (st.recent_losses + [loss])[-self.t.loss_spike_window :]
                losses.append(loss)
                if gnorm > self.t.max_grad_norm:  # clipped (finite: NaN/Inf rolled back above as gradient_overflow)
                    self._clipped = (self._clipped[0] + 1, max(self._clipped[1], gnorm))
                self._heartbeat = time.time()
                if st.step % self.t.logging_steps == 0:
                    dt = max(time.time() - t_log, 1e-9)
                    rec = {
                        "time": time.time(), "step": st.step, "epoch": round(st.window / self.steps_per_epoch, 4), "loss": loss,
                        "learning_rate": self.optimizer.param_groups[0]["lr"], "grad_norm": gnorm, "tokens_seen": st.tokens_seen,
                        "tokens_per_second": (st.tokens_seen - tok_log) / dt,
                    }
                    rec.update(self._extras)  # objective-specific figures (e.g. DPO reward margin), per unit of weight
                    rec["input_share"] = round(self._input_seconds / dt, 4)
                    self._input_seconds = 0.0
                    rec["clipped_steps"] = self._clipped[0]
                    self._metric(rec)
                    self._report_clipping(st.step)
                    self._check_gpu_util(rec)
                    if self.progress:
                        self.progress.log(rec, self.total_windows)
                    t_log, tok_log = time.time(), st.tokens_seen
                if self.progress:
                    self.progress.update(st.step, loss)
                metric = None
                last = self._finished()
                if st.step % self.t.eval_steps == 0 or last:
                    metric = self._eval()
                    if st.stopped_early:
                        last = True
                stop = self._stop_signal if self.world == 1 else self._agreed_stop  # all ranks stop at the step they agreed on
                best_now = metric is not None and st.best_step == st.step and self.t.keep_best > 0  # an eval that is the best so far
                if st.step % self.t.save_steps == 0 or last or stop or best_now:  # is saved, so the best checkpoint holds the evaluated weights
                    self.save(metric)
                if stop:
                    self.events.emit("preempted", step=st.step, level="warning", signal=stop, checkpoint=str(self.last_saved.path) if self.last_saved else None, **self._world_fields())
                    raise Preempted(st.step, str(self.last_saved.path) if self.last_saved else None, stop)
                if st.stopped_early:
                    self.events.emit("early_stopped", step=st.step, best_metric=st.best_metric, best_step=st.best_step, patience=self.t.early_stopping_patience,
                                     best_metric_name=st.best_metric_name or "loss", best_metric_value=st.best_metric_value)
                    break
        finally:
            self._watchdog_stop.set()
            if watchdog and self.world > 1:
                watchdog.stop()
            elif watchdog:
                watchdog.join(timeout=2)
            if self._grace_timer is not None:  # the stop finished in time
                self._grace_timer.cancel()
            for s, h in old.items():
                signal.signal(s, h)
            if self.progress:
                self.progress.stop()
        best = self.ckpt.best()
        seconds = round(time.time() - t0, 3)
        self._measure_memory(final=True, seconds=seconds, tokens=self.state.tokens_seen - tokens_at_start)
        best_loss, best_name, best_value = best_labels(best)
        self.events.emit(
            "training_finished", step=self.state.step, seconds=seconds, best_checkpoint=str(best.path) if best else None,
            best_eval_loss=best_loss, best_metric_name=best_name, best_metric_value=best_value, tokens_seen=self.state.tokens_seen,
        )
        return FitResult(
            global_step=self.state.step, best_checkpoint=str(best.path) if best else None, best_eval_loss=best_loss,
            best_metric_name=best_name, best_metric_value=best_value, best_metric_greater_is_better=self._best_direction(best_name),
            train_loss=sum(losses) / len(losses) if losses else None, train_seconds=seconds, tokens_seen=self.state.tokens_seen,
            stopped_early=self.state.stopped_early, resumed_from=str(resume_from.path) if resume_from else None,
            recoveries=self.state.recoveries, skipped_windows=list(self.state.skipped), micro_batch=self.state.micro_batch,
            gradient_checkpointing=self.state.gradient_checkpointing,
        )

    def _world_fields(self) -> dict:
        if self.world == 1 and self._resumed_world is None:
            return {}
        return {"world_size": self.world, "rank": self.rank, "per_rank_accumulation": math.ceil(self.effective / (self.state.micro_batch * self.world))}

    def _record_world(self) -> None:
        """State the world size, and a resume under another one, in the run manifest (rank 0)."""
        import json

        path = self.run_dir / "manifest.json"
        if not self.is_main or not path.exists():
            return
        man = json.loads(path.read_text())
        d = man.setdefault("distributed", {})
        d.update({"world_size": self.world, "strategy": ("fsdp" if self.fsdp else "ddp") if self.world > 1 else "single", "effective_batch": self.effective,
                  "micro_batch": self.state.micro_batch, "accumulation": math.ceil(self.effective / (self.state.micro_batch * self.world)),
                  "grad_compression": self.dist.grad_compression if self.dist else "none",
                  "launcher": self.dist.env.launcher if self.dist is not None and self.world > 1 else None})
        if self._powersgd_note:
            d.setdefault("powersgd_resumes", []).append({"step": self.state.step, "powersgd": self._powersgd_note})
        if self._resumed_world is not None:
            d.setdefault("resumes", []).append({
                "step": self.state.step, "window": self.state.window, "from_world_size": self._resumed_world, "to_world_size": self.world,
                "effective_batch": self.effective, "note": "the effective batch of the checkpoint is kept; the accumulation follows the world size",
                **({"powersgd": self._powersgd_note} if self._powersgd_note else {}),
            })
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(man, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def _distributed_watchdog(self):
        from trainpipe.distributed.ddp import HangWatchdog

        backend = self.torch.distributed.get_backend()
        return HangWatchdog(
            rank=self.rank, world=self.world, timeout=self.dist.timeout_seconds, run_dir=self.run_dir,
            progress=lambda: (self.state.step, self._phase, self._heartbeat),
            emit=self.events.emit if self.is_main else None, event="nccl_timeout" if backend == "nccl" else "distributed_hang",
        )

    def _measure_memory(self, final: bool = False, seconds: float | None = None, tokens: int | None = None) -> None:
        """Write `measured_memory.json`: after the first optimizer step the exact bytes of parameters, gradients and
        optimizer state (plan/measure.py); at the end the CUDA peak and the throughput of this process."""
        import json

        from trainpipe.plan.measure import measure_state_bytes

        path = self.run_dir / "measured_memory.json"
        if not self.is_main:
            self._measured = True
            return
        rec = json.loads(path.read_text()) if path.exists() else {}
        if not final:
            rec["state_bytes"] = measure_state_bytes(self.model, self.optimizer) | {"after_step": self.state.step + 1}
            self._measured = True
        else:
            if self.device.type == "cuda":
                rec["cuda_max_memory_allocated"] = int(self.torch.cuda.max_memory_allocated(self.device))
                rec["cuda_max_memory_reserved"] = int(self.torch.cuda.max_memory_reserved(self.device))
            if seconds and tokens:
                rec["tokens_per_second"] = round(tokens / seconds, 2)
            rec["micro_batch"] = self.state.micro_batch
            rec["gradient_checkpointing"] = self.state.gradient_checkpointing
        path.write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")

    def _finished(self) -> bool:
        """`max_steps`: the optimizer steps asked for are trained (a window skipped after a rollback is made up by the next
        window); epochs: every window of them has been read (a skipped one is not repeated)."""
        if self.t.max_steps > 0:
            return self.state.step >= self.t.max_steps
        return self.state.window >= self.total_windows

    def _report_clipping(self, step: int) -> None:
        """`gradient_clipped` once per logging window in which clipping (a finite norm above `max_grad_norm`) happened."""
        count, worst = self._clipped
        self._clipped = (0, 0.0)
        if count:
            self.events.emit(
                "gradient_clipped", step=step, level="info", clipped_steps=count,  # clipping is the limit doing its job: not a warning
                window_steps=self.t.logging_steps, max_grad_norm_before_clip=round(worst, 4), max_grad_norm=self.t.max_grad_norm,
            )

    def _gpu_util(self) -> float | None:
        """Device utilisation in % (None off a GPU); raises ModuleNotFoundError when nvidia-ml-py (pynvml) is missing."""
        if self.device.type != "cuda":
            return None
        return self.torch.cuda.utilization(self.device)

    def _check_gpu_util(self, rec: dict) -> None:
        """On a GPU: low device utilisation while input preparation takes a large share of the step. Without nvidia-ml-py the
        check is off, and the run says so once (`gpu_util_check_off`); on the CPU there is nothing to check and nothing is said."""
        if self._gpu_low_fired:
            return
        try:
            util = self._gpu_util()
        except Exception as exc:  # noqa: BLE001 - torch reads utilisation through pynvml (nvidia-ml-py)
            self._gpu_low_fired = True
            self.events.emit(
                "gpu_util_check_off", step=rec["step"], level="warning", reason=f"{type(exc).__name__}: {str(exc)[:160]}",
                fix="`pip install nvidia-ml-py` (or `pip install 'trainpipe[gpu]'`) to have `gpu_util_low` warn when the GPU waits for data",
            )
            return
        if util is None:
            return
        self._metric({"time": time.time(), "step": rec["step"], "gpu_util": util})  # the `gpu_utilization` quality gate's samples (evaluate/gates.py)
        if util < 50 and rec["input_share"] > 0.3:
            self._gpu_low_fired = True
            self.events.emit(
                "gpu_util_low", step=rec["step"], level="warning", gpu_util=util, dataloader_share=rec["input_share"],
                fix="more data-loader workers or prefetch, packing (`data.packing`), or a pre-tokenized cache",
            )

    def _evaluate_or_stop(self) -> float:
        """One in-training evaluation. Out of memory here is not the training step's (whose micro-batch recovery does not
        apply): it stops with `cuda_oom` (`phase: eval`) and exit code 4, naming the evaluation settings to lower."""
        try:
            faults.before_eval(self.state.step)
            out = self.evaluate(self.model)  # the eval loss, or {"loss": ..., every other metric the recipe measured}
            return dict(out) if isinstance(out, dict) else float(out)
        except Exception as exc:  # noqa: BLE001 - only an OOM is handled here
            if not is_oom(exc):
                raise
            self.events.emit("cuda_oom", step=self.state.step, level="fatal", phase="eval", error=str(exc)[:200], action="stop",
                             per_device_eval_batch_size=self.t.per_device_eval_batch_size)
            raise OutOfMemoryPlan(
                f"Out of memory in the evaluation after step {self.state.step} ({str(exc)[:120]}); the training steps fit. Lower "
                f"`training.per_device_eval_batch_size` (now {self.t.per_device_eval_batch_size}), `eval.max_new_tokens` for generated "
                "metrics, or `eval.max_samples`, then continue with `--resume`."
            ) from None

    def _eval(self) -> float:
        shard_fields: dict = {}
        if self.world == 1:
            metric = self._evaluate_or_stop()
        elif self.fsdp or type(self.objective) is TokenCrossEntropy or getattr(self.objective, "shards_eval", False):
            # the token loss (sft, pretrain: evaluate/evaluator.eval_loss) is sharded: rank r evaluates batches r, r + world, ...
            # and the sums of losses and loss tokens are all-reduced, so the figure is one process's over the whole set. Other
            # evaluations run whole on every rank under FSDP (a sharded forward needs every rank); rank 0's figure counts.
            # Objectives with `shards_eval` (dpo/orpo/kto, reward, rl: evaluate/shard.py) shard their own evaluation the same way.
            from trainpipe.distributed.env import broadcast_object, sharded_eval

            self._mark("eval")
            with sharded_eval(self.rank, self.world, lockstep=self.fsdp) as shard:
                metric = self._evaluate_or_stop()
            metric = broadcast_object(metric)
            if shard.used:
                shard_fields = {"eval_ranks": self.world, "eval_loss_tokens_per_rank": shard.counts}
            self._mark("compute")
        else:  # rank 0 evaluates (the weights are the same on every rank); all take its figure
            from trainpipe.distributed.env import broadcast_object

            self._mark("eval" if self.is_main else "wait")
            metric = broadcast_object(self._evaluate_or_stop() if self.is_main else None)
            self._mark("compute")
        self.eval_metrics = eval_metrics(metric)  # what the hooks read (tune's pruner: the study's objective metric)
        metric = self.eval_metrics["loss"]
        more = {k: v for k, v in self.eval_metrics.items() if k != "loss"}
        self.model.train()
        st = self.state
        self.events.emit("eval_done", step=st.step, phase="train", eval_loss=metric, **({"metrics": more} if more else {}), **shard_fields)
        self._metric({"time": time.time(), "step": st.step, "eval_loss": metric, **{f"eval_{k}": v for k, v in more.items()}})
        name, value, score = self._rank(self.eval_metrics)
        self._last_labels = {"metric_name": name, "metric_value": value, "eval_loss": metric}
        rank_update(st, name, value, score, self.t.early_stopping_patience)  # best so far and early stopping, by the chosen metric
        for hook in list(EVAL_HOOKS):
            hook(self, st.step, metric)
        return score  # what the checkpoint of this eval is ranked by

    def _best_direction(self, name: str | None) -> bool | None:
        """Whether greater is better for the metric the best checkpoint was ranked by (None: no best checkpoint)."""
        if name is None:
            return None
        ranked, greater = best_metric_of(self.t)
        if ranked == name:
            return greater
        return False if name == "loss" else None  # a checkpoint ranked before `metric_for_best` changed: the eval loss is lower-better

    def _rank(self, measured: dict) -> tuple[str, float, float]:
        """(metric name, its value, the lower-is-better score) of one eval by `training.metric_for_best`."""
        name, greater = best_metric_of(self.t)
        if name not in measured:
            from trainpipe.errors import ConfigError

            raise ConfigError(
                f"`training.metric_for_best: {getattr(self.t, 'metric_for_best', name)}` is not measured by this run's in-training eval "
                f"(step {self.state.step} measured {', '.join(measured)}). Choose one of those; the checkpoints written so far are intact."
            )
        value = float(measured[name])
        return name, value, (-value if greater else value)

    def _metric(self, rec: dict) -> None:
        import json

        if not self.is_main:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        from trainpipe.events import notify

        notify("metric", self.metrics_path.parent, rec)  # the experiment tracker logs it now (track/tracking.py)
