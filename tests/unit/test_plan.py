"""The one resolver (`plan.resolve`): defaults, the exact effective batch, world size from its sources, lr scaling.

The GPU machines are FAKE `Hardware` descriptions: the resolver is a pure function of (config, hardware, world size).
"""

import math

import pytest

from trainpipe.config import build_config
from trainpipe.plan import Plan, PlanError, resolve
from trainpipe.plan.hardware import Hardware

BASE = {"model": {"name_or_path": "org/m"}, "data": {"sources": [{"path": "t.jsonl"}]}}
CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
A100x4 = Hardware("cuda", 4, ("A100",) * 4, True, 32, "")
H100x8 = Hardware("cuda", 8, ("NVIDIA H100 80GB HBM3",) * 8, True, 64, "")


def cfg(*overrides):
    return build_config(BASE, overrides=list(overrides))


def test_learning_rate_defaults_by_method():
    assert resolve(cfg(), CPU).config.training.learning_rate == 2e-4
    assert resolve(cfg("method.peft=none"), CPU).config.training.learning_rate == 5e-5
    p = resolve(cfg("training.learning_rate=1e-3"), CPU)
    assert p.config.training.learning_rate == 1e-3 and p.learning_rate.source == "config"
    assert resolve(cfg(), CPU).learning_rate.source == "default"


def test_accumulation_reaches_effective_batch_32():
    r = resolve(cfg("training.per_device_train_batch_size=4"), CPU)
    assert r.config.training.gradient_accumulation_steps == 8
    r = resolve(cfg("training.per_device_train_batch_size=5"), CPU)
    assert r.config.training.gradient_accumulation_steps == 7 and r.effective_batch.value == 35  # the smallest >= 32, stated


def test_eight_gpus_mb4_is_accumulation_1_and_effective_32_exactly():
    p = resolve(cfg("training.per_device_train_batch_size=4"), H100x8, 8)
    assert p.grad_accum.value == math.ceil(32 / (4 * 8)) == 1
    assert p.effective_batch.value == 32 == p.micro_batch.value * p.grad_accum.value * p.world_size.value
    assert p.to_dict()["effective_batch_formula"] == "4 x 1 x 8 = 32"
    assert p.config.training.gradient_accumulation_steps == 1


def test_three_gpus_round_up_and_say_so():
    p = resolve(cfg("training.per_device_train_batch_size=4"), Hardware("cuda", 3, ("A100",) * 3, True, 8, ""), 3)
    assert (p.grad_accum.value, p.effective_batch.value) == (3, 36)
    assert "36" in p.grad_accum.rule and "not a multiple" in p.grad_accum.rule


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 16, 64])
@pytest.mark.parametrize("mb", [1, 3, 4, 8])
def test_effective_batch_is_the_exact_product_for_every_world_size(world, mb):
    hw = Hardware("cuda", min(world, 8), ("A100",) * min(world, 8), True, 8, "")
    p = resolve(cfg(f"training.per_device_train_batch_size={mb}"), hw, world, nnodes=max(1, world // 8))
    assert p.effective_batch.value == mb * p.grad_accum.value * world
    assert p.effective_batch.value >= 32 and (p.grad_accum.value == 1 or mb * (p.grad_accum.value - 1) * world < 32)


def test_explicit_accumulation_is_honoured_and_the_product_stated():
    p = resolve(cfg("training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=2"), A100x4, 4)
    assert p.grad_accum.source == "config" and p.effective_batch.value == 32
    p = resolve(cfg("training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=4"), A100x4, 4)
    assert p.effective_batch.value == 64 and "64" in p.grad_accum.rule


def test_one_process_without_a_launcher_trains_the_whole_target():
    # the bug of issue 10: a 4-GPU machine divided accumulation by 4 while one process trained
    p = resolve(cfg("training.per_device_train_batch_size=4"), A100x4)
    assert p.world_size.value == 1 and p.grad_accum.value == 8 and p.effective_batch.value == 32


def test_world_size_from_launcher_config_or_caller():
    c = cfg("training.per_device_train_batch_size=4")
    p = resolve(c, A100x4, env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (p.world_size.value, p.nnodes.value, p.nproc_per_node.value, p.world_size.source) == (8, 2, 4, "launcher")
    assert p.grad_accum.value == 1
    p = resolve(cfg("training.per_device_train_batch_size=4", "distributed.nproc_per_node=2"), A100x4)
    assert (p.world_size.value, p.world_size.source, p.grad_accum.value) == (2, "config", 4)
    p = resolve(c, A100x4, 4, env={"WORLD_SIZE": "2"})  # the caller wins over the environment
    assert (p.world_size.value, p.world_size.source) == (4, "cli")


def test_nproc_above_the_devices_present_is_an_error_naming_the_key():
    with pytest.raises(PlanError) as e:
        resolve(cfg("distributed.nproc_per_node=8"), A100x4)
    msg = e.value.message
    assert "`distributed.nproc_per_node`" in msg and "8 processes" in msg and "4 CUDA device(s)" in msg and "nproc_per_node: 4" in msg
    with pytest.raises(PlanError, match="launcher"):
        resolve(cfg(), A100x4, env={"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "6"})
    assert resolve(cfg("distributed.nproc_per_node=2"), CPU).world_size.value == 2  # gloo processes share the CPU


@pytest.mark.parametrize("mode,factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling(mode, factor):
    p = resolve(cfg("training.learning_rate=1e-4", f"training.lr_scaling={mode}"), A100x4, 4)
    assert p.learning_rate.value == pytest.approx(1e-4 * factor)
    assert p.config.training.learning_rate == pytest.approx(1e-4 * factor)
    assert p.lr_scaling.value == mode and (mode == "none" or p.lr_scaling.watch)
    # the resolved config holds the scaled lr and no scaling: resolving it again changes nothing
    again = resolve(p.config, A100x4, 4)
    assert again.config.training.learning_rate == pytest.approx(1e-4 * factor)


def test_precision_follows_hardware():
    assert resolve(cfg(), CPU).config.training.bf16 is False
    r = resolve(cfg(), A100x4)
    assert r.config.training.bf16 is True and r.config.model.dtype == "bfloat16" and r.precision.value == "bf16"
    t4 = resolve(cfg(), Hardware("cuda", 1, ("Tesla T4",), False, 8, ""))
    assert t4.precision.value == "fp16" and t4.config.training.fp16 is True


def test_every_decision_names_its_rule_and_every_setting_its_source():
    r = resolve(cfg(), CPU)
    keys = {d.key for d in r.decisions}
    assert {"training.learning_rate", "training.gradient_accumulation_steps", "training.bf16", "output_dir", "strategy"} <= keys
    assert all(d.rule for d in r.decisions)
    assert all(s.source in ("config", "default", "planner", "launcher", "cli") and s.rule for s in r.settings().values())


def test_plan_is_frozen_and_resolve_does_not_mutate_input():
    c = cfg()
    p = resolve(c, CPU)
    assert c.training.learning_rate is None and c.training.gradient_accumulation_steps is None
    assert isinstance(p, Plan)
    with pytest.raises(Exception):
        p.world_size = None  # type: ignore[misc]
