"""The one optimizer and scheduler builder: the recipe (train/sft.py `build_loop`) and lr-find (tune/lrfind.py) call it
with the resolved :class:`~trainpipe.plan.specs.OptimizerSpec` (`plan.specs.optimizer`), never the user's config.

Weight decay applies to matrices only (biases and norms have none); `training.optim` picks AdamW (fused on CUDA with
`adamw_torch_fused`), SGD with momentum, bitsandbytes' 8-bit AdamW (paged on CUDA) or Adafactor; the scheduler is
transformers' `training.lr_scheduler_type` with its warmup over the run's optimizer steps.
"""

from __future__ import annotations

from trainpipe import ui
from trainpipe.errors import TrainpipeError
from trainpipe.plan.specs import OptimizerSpec


def trainable(model) -> list[tuple[str, object]]:
    """(name, parameter) of every trainable parameter, in the model's order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def running_stats(model) -> dict:
    """{name: buffer} of the running statistics of normalisation layers that track them (BatchNorm's running mean and
    variance and its batch count): the forward pass updates them, so a checkpoint that holds only the trainable parameters
    would resume, and load its best weights, with the statistics of another step. Empty for models without BatchNorm
    (transformers LMs, ViT, ConvNeXt)."""
    import torch

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for b, t in m.named_buffers(recurse=False):
                if t is not None:
                    out[f"{name}.{b}" if name else b] = t
    return out


def build_optimizer(params: list[tuple[str, object]], spec: OptimizerSpec, device_type: str, lr: float | None = None):
    """`spec.name` over ``params`` ((name, parameter) pairs) at the resolved `spec.learning_rate` (or ``lr``)."""
    import torch

    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    lr = spec.learning_rate if lr is None else lr
    if spec.name in ("adamw_torch", "adamw_torch_fused"):
        fused = spec.name == "adamw_torch_fused" and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=fused or None)
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if spec.name in ("adamw_8bit", "paged_adamw_8bit"):
        return adamw_8bit(groups, lr, spec.name, device_type)
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def adamw_8bit(groups: list[dict], lr: float, optim: str, device_type: str):
    """bitsandbytes AdamW with 8-bit block-wise quantized moments (Dettmers et al. 2022); `paged_` keeps them in
    CUDA unified memory so spikes page out to the CPU instead of OOM-ing. On the CPU there is nothing to page."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise TrainpipeError(
            f"`training.optim: {optim}` is bitsandbytes' 8-bit AdamW, and bitsandbytes is not installed. Install it "
            "with `pip install 'trainpipe[qlora]'`, or use `training.optim: adamw_torch`."
        ) from None
    paged = optim == "paged_adamw_8bit"
    if paged and device_type != "cuda":
        ui.console().print(
            f"[yellow]warning:[/] `training.optim: paged_adamw_8bit` pages optimizer state between GPU and CPU memory; "
            f"on {device_type} there is nothing to page, so `adamw_8bit` (the same update) is used.", markup=True, soft_wrap=True,
        )
        paged = False
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)


def build_scheduler(optimizer, spec: OptimizerSpec, total_steps: int):
    """`spec.lr_scheduler_type` over ``total_steps`` optimizer steps, warming up for `warmup_steps` (or `warmup_ratio`)."""
    from transformers import get_scheduler

    return get_scheduler(spec.lr_scheduler_type, optimizer, num_warmup_steps=spec.warmup_for(total_steps), num_training_steps=total_steps)


def scale_lr(scheduler, optimizer, base_lrs: list[float], scale: float) -> None:
    """Scale the schedule's base learning rates (after a divergence rollback) and set the current ones accordingly."""
    scheduler.base_lrs = [lr * scale for lr in base_lrs]
    for i, g in enumerate(optimizer.param_groups):
        g["lr"] = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](scheduler.last_epoch)
