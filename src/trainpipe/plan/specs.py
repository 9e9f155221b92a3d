"""Resolved specs: what the layers below the resolver (train/, data/) read instead of the user's config.

`plan.resolve` fills in every `auto` and unset value of a RunConfig for one machine and world size; `build_specs` then
copies the resolved values into six frozen dataclasses, one per concern of the loop:

    OptimizerSpec   the optimizer, its learning rate (already scaled with the world size) and schedule
    BatchSpec       micro-batch, accumulation, data-parallel degree and the exact effective batch; steps or epochs
    PrecisionSpec   mixed precision, the dtype the base loads in, TF32, compile and kernels
    CadenceSpec     logging, evaluation and checkpoint intervals; the best-checkpoint metric and its direction
    ResilienceSpec  out-of-memory and divergence recovery, the hang watchdog, preemption, checkpoint errors
    DistributedSpec the strategy, its offload and gradient compression, and the topology (distributed/topology.py)

No field holds `auto`. A field is `None` only where `None` is itself the decided value, and each such field says so
in its class's ``UNSET_MEANS`` (e.g. `warmup_steps: None` is "the `warmup_ratio` share of the total steps", which is
known once the data is counted; `early_stopping_patience: None` is "early stopping off").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from trainpipe.config import RunConfig
from trainpipe.distributed.topology import ParallelDims
from trainpipe.metrics import metric_direction, metric_key
from trainpipe.plan.hardware import Hardware


@dataclass(frozen=True)
class OptimizerSpec:
    """`training.optim` and its schedule, with the learning rate the run uses (the rules table's default when unset,
    scaled with the world size when `training.lr_scaling` asked for it)."""

    name: str
    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    lr_scheduler_type: str
    warmup_ratio: float
    warmup_steps: int | None

    UNSET_MEANS: ClassVar[dict[str, str]] = {"warmup_steps": "the `warmup_ratio` share of the total optimizer steps"}

    def warmup_for(self, total_steps: int) -> int:
        """Warmup steps for a run of ``total_steps`` optimizer steps (`warmup_steps`, else `ceil(warmup_ratio x total)`)."""
        return self.warmup_steps if self.warmup_steps is not None else math.ceil(self.warmup_ratio * total_steps)


@dataclass(frozen=True)
class BatchSpec:
    """The batch: `micro_batch x grad_accum x dp_degree == effective_batch`, exactly (`dp_degree`: the data-parallel degree
    of the topology, `DistributedSpec.dims.dp`; ranks of one sequence or tensor group read the same examples)."""

    micro_batch: int
    grad_accum: int
    dp_degree: int
    effective_batch: int
    eval_micro_batch: int
    gradient_checkpointing: bool
    max_steps: int  # -1: train for `num_train_epochs`
    num_train_epochs: float
    max_length: int
    packing: str
    seed: int

    UNSET_MEANS: ClassVar[dict[str, str]] = {}


@dataclass(frozen=True)
class PrecisionSpec:
    """`mixed` is `bf16`, `fp16` or `fp32` (after any fallback on hardware without it); the dtypes are torch dtype names."""

    mixed: str
    model_dtype: str
    compute_dtype: str  # what a 4-bit base is dequantized to (QLoRA); the mixed precision's dtype otherwise unused
    tf32: bool
    torch_compile: bool
    use_liger_kernel: bool

    UNSET_MEANS: ClassVar[dict[str, str]] = {}

    @property
    def bf16(self) -> bool:
        return self.mixed == "bf16"

    @property
    def fp16(self) -> bool:
        return self.mixed == "fp16"


@dataclass(frozen=True)
class CadenceSpec:
    """When the loop logs, evaluates and saves, and how the best checkpoint is chosen."""

    logging_steps: int
    eval_steps: int
    save_steps: int
    save_total_limit: int
    keep_best: int
    early_stopping_patience: int | None
    metric_for_best: str  # the metric's key as the evals report it (`eval_accuracy` -> `accuracy`)
    greater_is_better: bool

    UNSET_MEANS: ClassVar[dict[str, str]] = {"early_stopping_patience": "early stopping off"}


@dataclass(frozen=True)
class ResilienceSpec:
    """Recovery from out-of-memory and divergence, the hang watchdog, preemption and checkpoint-write failures."""

    oom_recovery: bool
    loss_spike_factor: float
    loss_spike_min_delta: float
    loss_spike_window: int
    max_recoveries: int
    recovery_lr_factor: float
    hang_timeout_seconds: float
    preemption_grace_seconds: float
    on_checkpoint_error: str
    resume: str
    collective_timeout_seconds: float

    UNSET_MEANS: ClassVar[dict[str, str]] = {}


@dataclass(frozen=True)
class DistributedSpec:
    """`distributed:` as resolved: the strategy (`single` for one process), its offload, DDP's gradient compression, the
    collective timeout, and the topology the strategy trains with (`ParallelDims`: the data-parallel, sequence and tensor
    degrees). The loop's strategy is made from this (train/context.py `DistRuntime`), not from the config."""

    strategy: str
    offload: str
    grad_compression: str
    timeout_seconds: float
    dims: ParallelDims

    UNSET_MEANS: ClassVar[dict[str, str]] = {}


@dataclass(frozen=True)
class RunSpecs:
    """The six specs of one resolved run (`Plan.specs`)."""

    optimizer: OptimizerSpec
    batch: BatchSpec
    precision: PrecisionSpec
    cadence: CadenceSpec
    resilience: ResilienceSpec
    distributed: DistributedSpec

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: asdict(getattr(self, f.name)) for f in fields(self)}


def unresolved(specs: RunSpecs) -> list[str]:
    """`spec.field` for every field still `auto`, or `None` where its class does not say what `None` means (empty: resolved)."""
    out = []
    for f in fields(specs):
        spec = getattr(specs, f.name)
        for g in fields(spec):
            value = getattr(spec, g.name)
            if value == "auto" or (value is None and g.name not in type(spec).UNSET_MEANS):
                out.append(f"{f.name}.{g.name}")
    return out


def _direction(t) -> bool:
    """`training.greater_is_better`, else the metric's direction from the one table (refused, never guessed, when unknown)."""
    if t.greater_is_better is not None:
        return bool(t.greater_is_better)
    return metric_direction(t.metric_for_best, key="training.greater_is_better", field="training.metric_for_best") == "maximize"


def _compute_dtype(cfg: RunConfig, hw: Hardware) -> str:
    """`method.quantization.compute_dtype`; `auto`: bfloat16 on a CUDA GPU with it, float32 otherwise (as model/loading.py)."""
    asked = cfg.method.quantization.compute_dtype
    if asked != "auto":
        return asked
    return "bfloat16" if hw.accelerator == "cuda" and hw.bf16_supported else "float32"


def build_specs(cfg: RunConfig, hw: Hardware, *, dims: ParallelDims, effective_batch: int, precision: str) -> RunSpecs:
    """The specs of ``cfg`` as `resolve` left it (every `auto` of the batch, precision, lr and strategy decided), with the
    topology ``dims`` the resolver chose for its world size."""
    t, d = cfg.training, cfg.distributed
    optimizer = OptimizerSpec(
        name=t.optim, learning_rate=float(t.learning_rate), weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        lr_scheduler_type=t.lr_scheduler_type, warmup_ratio=t.warmup_ratio, warmup_steps=t.warmup_steps,
    )
    batch = BatchSpec(
        micro_batch=int(t.per_device_train_batch_size), grad_accum=int(t.gradient_accumulation_steps), dp_degree=dims.dp,
        effective_batch=effective_batch, eval_micro_batch=t.per_device_eval_batch_size, gradient_checkpointing=t.gradient_checkpointing is True,
        max_steps=t.max_steps, num_train_epochs=t.num_train_epochs, max_length=cfg.first_data().max_length,
        packing=cfg.first_data().packing, seed=t.seed,
    )
    prec = PrecisionSpec(
        mixed=precision, model_dtype=cfg.model.dtype, compute_dtype=_compute_dtype(cfg, hw),
        tf32=hw.accelerator == "cuda" and t.tf32 is not False, torch_compile=t.torch_compile, use_liger_kernel=t.use_liger_kernel,
    )
    cadence = CadenceSpec(
        logging_steps=t.logging_steps, eval_steps=t.eval_steps, save_steps=int(t.save_steps), save_total_limit=t.save_total_limit,
        keep_best=t.keep_best, early_stopping_patience=t.early_stopping_patience, metric_for_best=metric_key(t.metric_for_best),
        greater_is_better=_direction(t),
    )
    resilience = ResilienceSpec(
        oom_recovery=t.oom_recovery, loss_spike_factor=t.loss_spike_factor, loss_spike_min_delta=t.loss_spike_min_delta,
        loss_spike_window=t.loss_spike_window, max_recoveries=t.max_recoveries, recovery_lr_factor=t.recovery_lr_factor,
        hang_timeout_seconds=t.hang_timeout_seconds, preemption_grace_seconds=t.preemption_grace_seconds,
        on_checkpoint_error=t.on_checkpoint_error, resume=t.resume, collective_timeout_seconds=cfg.distributed.timeout_seconds,
    )
    distributed = DistributedSpec(strategy=d.strategy if dims.world > 1 else "single", offload=d.offload, grad_compression=d.grad_compression,
                                  timeout_seconds=d.timeout_seconds, dims=dims)
    return RunSpecs(optimizer=optimizer, batch=batch, precision=prec, cadence=cadence, resilience=resilience, distributed=distributed)
