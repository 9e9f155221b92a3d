"""DeepSpeed ZeRO-2/3 configs from a run config, accepted by DeepSpeed's own config class.

The config a `deepspeed` launcher of one's own runs with is generated and validated here (`pip install
'trainpipe[deepspeed]'`; skipped without it); trainpipe's loop trains ZeRO itself (tests/e2e/test_deepspeed.py)."""

import pytest

from trainpipe.config import RunConfig
from trainpipe.distributed.deepspeed import zero_config
from trainpipe.errors import TrainpipeError


def config(**distributed) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
        "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True}, "distributed": distributed,
    })


@pytest.mark.parametrize("strategy,offload", [("zero2", "none"), ("zero2", "optimizer"), ("zero3", "none"), ("zero3", "optimizer+params")])
def test_deepspeed_accepts_the_generated_config(strategy, offload):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = zero_config(config(strategy=strategy, offload=offload), world_size=1)  # no process group here: DeepSpeed checks world size 1
    parsed = DeepSpeedConfig(ds)
    assert parsed.zero_optimization_stage == (2 if strategy == "zero2" else 3)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (8, 4, 2)
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    if offload != "none":
        assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # the check is real: a batch that does not add up is refused by DeepSpeed
    with pytest.raises(AssertionError, match="train_batch_size"):
        DeepSpeedConfig({**ds, "train_batch_size": ds["train_batch_size"] + 1})


def test_batch_arithmetic_follows_the_world_size():
    ds = zero_config(config(strategy="zero3"), world_size=8)
    assert ds["train_batch_size"] == 4 * 2 * 8


def test_param_offload_needs_zero3():
    """ZeRO-2 does not partition parameters: the config itself refuses `optimizer+params` with it, naming both keys."""
    from trainpipe.config import build_config

    with pytest.raises(TrainpipeError, match="`distributed.offload: optimizer\\+params` is not an offload `distributed.strategy: zero2` has"):
        build_config({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
                      "distributed": {"strategy": "zero2", "offload": "optimizer+params"}})
