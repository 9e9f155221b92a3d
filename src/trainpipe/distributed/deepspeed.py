"""DeepSpeed ZeRO-2 / ZeRO-3 configuration from a run config (`distributed.strategy: zero2 | zero3`).

Generated from the resolved values the loop uses (micro-batch, accumulation, world size, precision, clipping, offload)
so that DeepSpeed's batch arithmetic (train_batch = micro x accumulation x world) holds by construction. The file is
validated by DeepSpeed's own ``DeepSpeedConfig`` in the tests (``pip install 'trainpipe[deepspeed]'``). This is the
config for a ``deepspeed`` launcher of one's own; ``trainpipe run`` trains ZeRO inside its own loop with the engine
config of distributed/zero.py (the loop owns the accumulation there).
"""

from __future__ import annotations

from trainpipe.config import RunConfig
from trainpipe.errors import TrainpipeError


def zero_config(cfg: RunConfig, world_size: int) -> dict:
    """The DeepSpeed JSON config of ``cfg`` for ``world_size`` processes."""
    d, t = cfg.distributed, cfg.training
    if d.strategy not in ("zero2", "zero3"):
        raise TrainpipeError(f"A DeepSpeed config is made for `distributed.strategy: zero2` or `zero3`; got `{d.strategy}`.")
    mb = t.per_device_train_batch_size
    if not isinstance(mb, int) or t.gradient_accumulation_steps is None:
        raise TrainpipeError("The DeepSpeed config needs the resolved micro-batch and accumulation: pass the plan's config (`plan_run(cfg, hw).config`).")
    stage = 2 if d.strategy == "zero2" else 3
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8}
    if d.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if d.offload == "optimizer+params":
        if stage != 3:
            raise TrainpipeError("`distributed.offload: optimizer+params` needs ZeRO-3 (`distributed.strategy: zero3`): ZeRO-2 does not partition parameters.")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update({"stage3_gather_16bit_weights_on_model_save": True, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5})
    out = {
        "train_batch_size": mb * t.gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(t.bf16)},
        "fp16": {"enabled": bool(t.fp16), "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": t.logging_steps,
        "wall_clock_breakdown": False,
    }
    return out
