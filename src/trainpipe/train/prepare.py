"""Model preparation for training, called by the recipe before the optimizer is built (train/sft.py `build_loop`):
kernels (Liger's fused linear cross-entropy), the strategy's sharding, precision (TF32, `torch.compile`) and the checks
that a model and its data can train together; gradient checkpointing, which the OOM recovery also turns on."""

from __future__ import annotations

from trainpipe import ui
from trainpipe.errors import TrainpipeError
from trainpipe.model.loading import enable_gradient_checkpointing
from trainpipe.model.losses import setup_liger
from trainpipe.train import fused_preference
from trainpipe.plan.specs import PrecisionSpec
from trainpipe.train.objectives import Objective, TokenCrossEntropy, prefix_tuned


def prepare_model(model, precision: PrecisionSpec, objective: Objective, strategy, train_data: list[dict]) -> None:
    """Kernels, then the strategy's sharding (FSDP2 shards in place, before the optimizer), then precision, then the
    packing check: the order the loop has always prepared a model in. ``precision`` is `plan.specs.precision`."""
    use_kernels(model, objective, precision.use_liger_kernel, device_of(model).type, strategy.rank == 0)
    strategy.wrap(model, device_of(model))  # before the optimizer: FSDP2 shards in place
    set_precision(model, precision)
    check_packing(model, train_data)


def device_of(model):
    return next(model.parameters()).device


def use_kernels(model, objective: Objective, enabled: bool, device_type: str, speak: bool) -> None:
    """`training.use_liger_kernel`: Liger's fused linear cross-entropy on a CUDA GPU for the token cross-entropy objectives;
    otherwise one message and the chunked loss (model/losses.py)."""
    if not enabled:
        return

    def say(text: str) -> None:
        if speak:
            ui.console().print(f"[yellow]note:[/] {text}", markup=True, soft_wrap=True)

    if getattr(objective, "method", None) in ("dpo", "orpo", "kto"):  # preference objectives: Liger's chunked losses (CPU or GPU)
        fused_preference.setup(objective, model, device_type, say=say)
        return
    if not isinstance(objective, TokenCrossEntropy):
        say(f"`training.use_liger_kernel: true` applies to the token cross-entropy of `sft` and `pretrain` and to the "
            f"preference losses; this objective ({type(objective).__name__}) computes its own loss, so it is not used here.")
        return
    objective.fused = setup_liger(model, device_type, True, say=say)
    objective.loss_record = {"implementation": "liger_fused_linear_cross_entropy" if objective.fused else "trainpipe_chunked_cross_entropy",
                             "use_liger_kernel": True, "device": device_type}


def set_precision(model, precision: PrecisionSpec) -> None:
    """TF32 matmuls on CUDA (`precision.tf32`: `training.tf32`, unset: on) and `torch.compile` of the model (`training.torch_compile`,
    in place: parameter names, and so checkpoints, stay the same). bf16/fp16 autocast is applied per step; on
    hardware without it the plan has already fallen back to fp32 (plan.resolve)."""
    import torch

    if device_of(model).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision.tf32
        torch.backends.cudnn.allow_tf32 = precision.tf32
    if precision.torch_compile:
        model.compile()


def check_packing(model, data: list[dict]) -> None:
    """Packed and padding-free rows separate their examples by position ids; prompt and prefix tuning put virtual
    tokens before the row and PEFT drops the position ids, so examples would attend to each other."""
    from peft import PeftModel

    first = data[0] if len(data) else {}
    packed = first.get("position_ids") is not None or first.get("padding_free")
    if packed and isinstance(model, PeftModel) and model.active_peft_config.is_prompt_learning:
        raise TrainpipeError(
            f"`method.peft: {model.active_peft_config.peft_type.value.lower()}` cannot train on packed rows (`data.packing: pack` "
            "or `padding_free`): its virtual tokens come before the whole row and PEFT drops the position ids that keep packed "
            "examples apart, so they would attend to each other. Set `data.packing: none`."
        )


def gradient_checkpointing(model, on: bool) -> bool:
    """Turn gradient checkpointing on (model/loading.py: also what the memory tracer applies); returns ``on``."""
    if on and prefix_tuned(model):
        raise TrainpipeError(
            "`method.peft: prefix_tuning` cannot train with gradient checkpointing: the learned prefix reaches every layer "
            "as its key/value cache, and checkpointed layers run without a cache (the attention shapes then disagree). "
            "Set `training.gradient_checkpointing: false` (and, if memory is short, a smaller "
            "`training.per_device_train_batch_size`), or use `method.peft: prompt_tuning`."
        )
    if on:
        enable_gradient_checkpointing(model)
    return on
