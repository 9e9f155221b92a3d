"""The DeepSpeed ZeRO strategy's engine config and choice, without processes (the training itself: the 2-process gloo
runs of tests/e2e/test_deepspeed.py)."""

from __future__ import annotations

import pytest

from trainpipe.distributed.env import DistEnv
from trainpipe.distributed.strategy import DDP, FSDP, DeepSpeed, Single, make
from trainpipe.distributed.zero import engine_config
from trainpipe.errors import TrainpipeError
from trainpipe.train.context import DistRuntime


def dist(strategy: str, **kw) -> DistRuntime:
    return DistRuntime(DistEnv(rank=0, world_size=2, local_world_size=2, launcher="torchrun"), strategy=strategy, **kw)


@pytest.mark.parametrize("stage,offload", [(2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")])
def test_deepspeed_accepts_the_engine_config_and_the_loop_keeps_the_accumulation(stage, offload):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = engine_config(stage, 1, 1, 1.0, offload)  # no process group here: DeepSpeed checks world size 1
    parsed = DeepSpeedConfig(cfg)
    assert parsed.zero_optimization_stage == stage and parsed.gradient_clipping == 1.0
    # the loop owns the window: DeepSpeed never divides a loss by its own accumulation count, the step is the boundary
    assert parsed.gradient_accumulation_steps == 1 and parsed.managed_gradient_accumulation is False
    assert ("offload_optimizer" in cfg["zero_optimization"]) == (offload != "none")
    assert ("offload_param" in cfg["zero_optimization"]) == (offload == "optimizer+params")


def test_zero2_cannot_offload_parameters():
    with pytest.raises(TrainpipeError, match="needs ZeRO-3"):
        engine_config(2, 1, 2, 1.0, "optimizer+params")


def test_make_picks_deepspeed_for_zero_and_refuses_a_ddp_hook():
    s = make(dist("zero3"))
    assert isinstance(s, DeepSpeed) and s.name == "zero3" and s.stage == 3 and s.caps.shards_parameters and s.shards_parameters  # every rank evaluates
    z2 = make(dist("zero2"))
    assert isinstance(z2, DeepSpeed) and z2.stage == 2 and not z2.shards_parameters and z2.caps.needs_full_state_gather  # whole weights on every rank: rank 0 evaluates
    assert type(make(dist("fsdp"))) is FSDP and type(make(dist("ddp"))) is DDP and type(make(None)) is Single
    with pytest.raises(TrainpipeError, match="grad_compression"):
        make(dist("zero2", grad_compression="powersgd"))


def test_fp16_loss_scaling_under_zero_is_refused_with_what_to_use():
    with pytest.raises(TrainpipeError, match="bf16"):
        make(dist("zero3")).wrap(object(), None, object(), max_grad_norm=1.0, loss_scaling=True)
