"""`training:` and `distributed:`: optimisation, precision, checkpoints, recovery, and how processes share the model."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from trainpipe.config.base import _Section


class TrainingConfig(_Section):
    learning_rate: float | None = Field(default=None, gt=0)
    """Peak learning rate. Default by method: 2e-4 with LoRA, 5e-5 for a full fine-tune."""
    num_train_epochs: float = Field(default=3.0, gt=0, le=100000)
    """Passes over the training data (ignored when `max_steps` > 0)."""
    max_steps: int = -1
    """Total optimizer steps (>= 1); -1 trains for `num_train_epochs`."""
    per_device_train_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 4
    """Micro-batch size per device; `auto`: the largest the planner predicts to fit (with 10 % headroom)."""
    per_device_eval_batch_size: int = Field(default=8, ge=1)
    """Batch size for evaluation."""
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    """Micro-batches per optimizer step. Default: enough for an effective batch of `target_effective_batch_size`."""
    target_effective_batch_size: int = Field(default=32, ge=1)
    """Effective batch (micro-batch x accumulation x devices) the default accumulation aims for."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale `learning_rate` with the world size relative to one process: `linear` (x world size, Goyal et al.), `sqrt` (x sqrt(world size), for Adam-type optimizers), `none` (the effective batch is kept by accumulation, so the lr needs no change)."""
    warmup_ratio: float = Field(default=0.03, ge=0.0, lt=1.0)
    """Share of the steps spent warming the learning rate up from 0 (ignored when `warmup_steps` is set)."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Exact number of warmup steps; overrides `warmup_ratio`."""
    lr_scheduler_type: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"] = "cosine"
    """Learning-rate schedule after warmup."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay (AdamW)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"] = "adamw_torch"
    """Optimizer: `adamw_torch`, `adamw_torch_fused` (CUDA), `adamw_8bit` / `paged_adamw_8bit` (bitsandbytes), `adafactor`, `sgd` (momentum 0.9)."""
    eval_steps: int = Field(default=50, ge=1)
    """Evaluate on the eval split every this many optimizer steps."""
    save_steps: int | None = Field(default=None, ge=1)
    """Save a checkpoint every this many steps (any number: the planner's Young/Daly interval in steps for spot training). Default: `eval_steps`. A checkpoint between evaluations has no eval loss and is kept as one of the newest `save_total_limit`; an evaluation that is the best so far is always saved, and the best `keep_best` of those are kept apart from the newest."""
    save_total_limit: int = Field(default=2, ge=1)
    """Newest checkpoints kept on disk (the best `keep_best` by eval loss are kept as well)."""
    logging_steps: int = Field(default=5, ge=1)
    """Write training metrics every this many steps."""
    early_stopping_patience: int | None = Field(default=3, ge=1)
    """Stop after this many evaluations without improvement of eval loss; null turns early stopping off."""
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    """Seed for the split, data order, initialisation and dropout (0 to 2^32 - 1: what numpy's seeding takes)."""
    bf16: bool | None = None
    """bfloat16 mixed precision. Default: on for GPUs that support it, off on CPU."""
    fp16: bool = False
    """float16 mixed precision with loss scaling (GPUs without bfloat16)."""
    precision_fallback: Literal["warn", "error"] = "warn"
    """`bf16`/`fp16` set on hardware without that mixed precision (the CPU; bf16 on GPUs before Ampere): `warn` trains in fp32 with one warning, `error` stops before anything is loaded."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in the backward pass to save memory (non-reentrant); `auto`: on only when the planner predicts the micro-batch does not fit without it."""
    tf32: bool | None = None
    """Allow TF32 matmuls on Ampere and newer GPUs (default: on there; no effect on CPU)."""
    torch_compile: bool = False
    """Compile the model with `torch.compile` before training (in place: checkpoints keep their keys). The first step compiles the forward and backward: its seconds are reported apart as `compile_warmup_seconds` (a `compile_warmup` event and the first metrics record); a new input shape may recompile once more. On the CPU the compiler needs a C++ compiler (g++)."""
    use_liger_kernel: bool = False
    """Compute the loss with Liger's kernels, so the full-vocabulary logits are never materialised. `sft`/`pretrain`: the fused linear cross-entropy (Triton, CUDA only; elsewhere trainpipe's chunked cross-entropy, said once). `dpo` (`sigmoid`, `hinge`, `simpo`), `orpo`, `kto`: Liger's chunked preference losses from the last hidden state and the LM head, for the policy and the reference (plain PyTorch: on the CPU too; compiled on CUDA), equal to trainpipe's; where Liger has no equal loss (`ipo`, `label_smoothing` with `sigmoid`, unequal KTO weights) the run says so once and keeps trainpipe's. The run manifest's `loss` records which ran. Needs `liger-kernel` (`pip install 'trainpipe[gpu]'`)."""
    resume: Literal["never", "auto"] = "never"
    """`auto`: continue from the newest checkpoint in `output_dir` whose checksums hold (as `--resume` does), or start fresh when there is none."""
    keep_best: int = Field(default=1, ge=0)
    """Checkpoints kept for their eval loss (or `metric_for_best`), in addition to the newest `save_total_limit`; the best is never deleted."""
    metric_for_best: str = "loss"
    """The in-training eval metric that ranks checkpoints (the best one is exported) and counts for early stopping, as HF's `metric_for_best_model`: `loss` (default), or one the recipe measures at every eval (classification `accuracy`/`macro_f1`, dpo `margin_per_token`, sft `exact_match` with `eval.generate_in_training`, ...). Divergence checks stay on the loss."""
    greater_is_better: bool | None = None
    """Direction of `metric_for_best`; null reads it from `trainpipe tune`'s table: loss, perplexity and KL lower; accuracies, exact match, margins and rewards higher; a metric without a known direction (e.g. rl `completion_length`) is refused until this is set."""
    on_checkpoint_error: Literal["continue", "stop"] = "continue"
    """When writing a checkpoint fails (disk full, I/O error): `continue` training (a later save may succeed) or `stop`."""
    preemption_grace_seconds: float = Field(default=30.0, gt=0)
    """After SIGTERM/SIGINT: time allowed to finish the step and save before the process exits regardless."""
    oom_recovery: bool = True
    """On out-of-memory: halve the micro-batch (same effective batch), then turn on gradient checkpointing, then stop with a plan."""
    loss_spike_factor: float = Field(default=3.0, ge=0)
    """A step loss above this many times the running median counts as a spike (0 turns spike detection off). Preference and reward objectives are judged against the larger of the median and their own zero-margin loss (ln 2 for DPO and reward models, 1 for hinge, (1/2β)² for IPO, softplus(γ) for SimPO, half the larger KTO weight), since their losses fall far below that scale while single batches stay noisy."""
    loss_spike_min_delta: float = Field(default=0.1, ge=0)
    """A spike must also exceed the running median by this much (in loss units): near convergence (a DPO loss of 0.01) a jump to 0.04 is noise, not divergence."""
    loss_spike_window: int = Field(default=20, ge=10)
    """Number of recent step losses the running median is taken over."""
    max_recoveries: int = Field(default=3, ge=0)
    """Rollbacks after NaN/Inf or a loss spike before the run stops as diverged (0: stop at the first)."""
    recovery_lr_factor: float = Field(default=0.5, gt=0, le=1)
    """Factor applied to the learning rate at each rollback."""
    hang_timeout_seconds: float = Field(default=1800.0, ge=0)
    """When no step finishes for this long, dump all thread stacks and emit `distributed_hang` (0 turns the watchdog off)."""

    @field_validator("max_steps")
    @classmethod
    def _max_steps_range(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be -1 (train for `num_train_epochs`) or a number of optimizer steps >= 1; 0 would train nothing (delete the key to train for the epochs)")
        if v > 10**10:
            raise ValueError(f"{v} optimizer steps is beyond any real run (at most 10^10); give the number of steps you mean, or -1 to train for `num_train_epochs`")
        return v

    @model_validator(mode="after")
    def _save_multiple_of_eval(self) -> "TrainingConfig":
        # save_steps need not be a multiple of eval_steps (issue 14.2): a checkpoint between evaluations is kept as one of the
        # newest `save_total_limit`; an evaluation that is the best so far is always saved, so `keep_best` ranks evaluated weights
        if self.bf16 and self.fp16:
            raise ValueError("`bf16` and `fp16` are both true; choose one")
        return self


# the `distributed.offload` values each strategy has (the planner's decisions.OFFLOADS_OF is this table): FSDP2's
# CPUOffloadPolicy moves parameters, gradients and the optimizer step together; ZeRO-2 offloads optimizer states only;
# ZeRO-3 optimizer states, and with `optimizer+params` the parameters too
OFFLOADS_OF_STRATEGY = {"single": ("none",), "ddp": ("none",), "fsdp": ("none", "optimizer+params"), "zero2": ("none", "optimizer"),
                        "zero3": ("none", "optimizer", "optimizer+params")}


class DistributedConfig(_Section):
    """How many processes train and how they share the model (issue 10: one resolved plan, executed by `run`)."""

    strategy: Literal["auto", "single", "ddp", "fsdp", "zero2", "zero3"] = "auto"
    """`auto`: by model size and world size (one process: `single`; <1B or a state that fits one device: `ddp`; 1-10B: `zero2` where the replicated weights fit, else `fsdp`; 10-100B: `zero3` with checkpointing, and optimizer offload when still short; >100B: stop and name Megatron-LM / torchtitan, outside trainpipe). `ddp` replicates the model; `fsdp` shards parameters, gradients and optimizer state (FSDP2); `zero2`/`zero3` are DeepSpeed ZeRO stages."""
    offload: Literal["none", "optimizer", "optimizer+params"] = "none"
    """CPU offload, as each strategy has it: `zero2` `optimizer`; `zero3` `optimizer` or `optimizer+params`; `fsdp` `optimizer+params` only (FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer step together); `single`/`ddp` none. Needs host RAM (the plan checks it)."""
    sequence_parallel: int | Literal["auto"] = "auto"
    """GPUs that split one sequence (Ulysses sequence parallelism; torchtitan's context parallelism in the hand-off). `auto`: the planner's long-context rule (at 32k tokens and above, the smallest degree dividing the GPUs per node, the heads and the sequence that fits; 1 otherwise); an integer: that degree, which must divide `data.max_length`, the attention and key/value heads and the GPUs per node. `trainpipe run` splits sequences with DeepSpeed's Ulysses attention under `distributed.strategy: ddp`, `fsdp` or `zero3`, for sft and pretrain, with padded, packed or padding-free rows (packed rows need `model.attn_implementation` sdpa or flash attention); anything else is refused, naming `trainpipe launch --emit torchtitan`, which runs it as torchtitan's context parallelism."""
    tensor_parallel: int | Literal["auto"] = "auto"
    """GPUs that split each weight matrix (tensor parallelism, over the attention heads: the model's own transformers `tp_plan` applied with torch's `parallelize_module`). `auto`: 1 in a run (the planner's tensor rule sizes TP for `trainpipe plan`: within a node, when the sharded state does not fit without it); an integer: that degree, which must divide the world size and the attention and key/value heads. `trainpipe run` trains full fine-tunes (`method.peft: none`) under it: alone (one data-parallel rank), or with `distributed.strategy: fsdp` as 2-D parallelism (FSDP2 over the data-parallel ranks x TP); ZeRO, DDP with several data-parallel ranks, sequence parallelism and adapters are refused in one paragraph."""
    nproc_per_node: int | Literal["auto"] = "auto"
    """Processes per machine. `auto`: the launcher's world (torchrun / `--nproc-per-node`), else 1."""
    nnodes: int = Field(default=1, ge=1)
    """Machines taking part (multi-node through torchrun's rendezvous)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: `auto` is NCCL on CUDA, gloo on the CPU."""
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """DDP communication hook for communication-bound runs: gradients all-reduced in fp16/bf16, or PowerSGD low-rank compression."""
    timeout_seconds: float = Field(default=600.0, gt=0)
    """A collective that waits longer than this names the rank that stopped answering (`nccl_timeout` / `distributed_hang`) and exits non-zero; so does a rank whose process or node is gone (no heartbeat for this long)."""
    nccl_socket_ifname: str | None = Field(default=None, pattern=r"^\^?=?[A-Za-z0-9_.,:-]+$")
    """`NCCL_SOCKET_IFNAME` in the launch files (`trainpipe launch`): the network interface(s) NCCL's bootstrap and socket transport use, e.g. `eth0`, `^docker,lo` (exclude), `=ib0` (exact). Null: NCCL chooses (it may pick a docker or loopback interface on multi-homed nodes)."""
    nccl_ib_hca: str | None = Field(default=None, pattern=r"^\^?=?[A-Za-z0-9_.,:-]+$")
    """`NCCL_IB_HCA` in the launch files: the InfiniBand / RoCE adapters (and ports) NCCL uses, e.g. `mlx5_0,mlx5_1` or `=mlx5_0:1`. Null: every adapter NCCL finds."""
    nccl_ib_timeout: int | None = Field(default=None, ge=1, le=31)
    """`NCCL_IB_TIMEOUT` in the launch files: the InfiniBand verbs timeout exponent (4.096 us x 2^value; NCCL's default 20, about 4 s). Raise it (e.g. 22) on large or congested fabrics where transfers time out. Null: NCCL's default."""
    nccl_ib_retry_cnt: int | None = Field(default=None, ge=0, le=7)
    """`NCCL_IB_RETRY_CNT` in the launch files: InfiniBand retries before a transfer fails (NCCL's default 7). Null: NCCL's default."""

    @field_validator("sequence_parallel")
    @classmethod
    def _sequence_degree(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"`distributed.sequence_parallel` is the number of GPUs that split one sequence, at least 1 (or `auto`); got {v}")
        return v

    @field_validator("tensor_parallel")
    @classmethod
    def _tensor_degree(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"`distributed.tensor_parallel` is the number of GPUs that split each weight matrix, at least 1 (or `auto`); got {v}")
        return v

    @model_validator(mode="after")
    def _offload_of_strategy(self) -> "DistributedConfig":
        has = OFFLOADS_OF_STRATEGY.get(self.strategy)  # `auto`: checked once the planner has chosen the strategy
        if has is not None and self.offload not in has:
            others = [s for s in ("zero3", "zero2", "fsdp") if self.offload in OFFLOADS_OF_STRATEGY[s]]
            raise ValueError(
                f"`distributed.offload: {self.offload}` is not an offload `distributed.strategy: {self.strategy}` has (it has "
                f"{', '.join(f'`{o}`' for o in has)}; FSDP2 offloads parameters, gradients and optimizer states together, ZeRO-2 "
                f"optimizer states only, ZeRO-3 either). Set `distributed.offload` to one of those, or `distributed.strategy` to "
                f"{' or '.join(f'`{s}`' for s in others)}")
        return self
