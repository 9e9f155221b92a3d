"""Resolved specs (`plan.resolve` -> `Plan.specs`): every field of every spec decided, no `auto`, and `None` only where
the spec says what `None` means. FAKE `Hardware` descriptions: the resolver is a pure function of (config, hardware)."""

import dataclasses

import pytest

from trainpipe.config import build_config
from trainpipe.errors import ConfigError
from trainpipe.plan import resolve
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.specs import BatchSpec, CadenceSpec, OptimizerSpec, PrecisionSpec, ResilienceSpec, RunSpecs, unresolved

CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
A100x4 = Hardware("cuda", 4, ("A100",) * 4, True, 32, "")
T4 = Hardware("cuda", 1, ("Tesla T4",), False, 8, "")
MODEL = {"name_or_path": "meta-llama/Llama-3.2-1B"}  # a catalog model: sized without weights
DATA = {"sources": [{"path": "t.jsonl"}]}

CONFIGS = {
    "sft lora, auto batch": {"model": MODEL, "data": DATA, "method": {"name": "sft", "peft": "lora"},
                             "training": {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto"}},
    "dpo": {"model": MODEL, "data": DATA, "method": {"name": "dpo", "peft": "lora"}, "training": {"per_device_train_batch_size": "auto"}},
    "full fine-tune": {"model": MODEL, "data": DATA, "method": {"name": "sft", "peft": "none"},
                       "training": {"per_device_train_batch_size": "auto", "lr_scaling": "sqrt", "warmup_steps": 10}},
    "qlora, peft auto": {"model": MODEL, "data": DATA, "method": {"name": "sft", "peft": "auto"},
                         "training": {"per_device_train_batch_size": "auto", "early_stopping_patience": None}},
    "unsized model": {"model": {"name_or_path": "org/unknown"}, "data": DATA, "training": {"per_device_train_batch_size": "auto"}},
    "classification by accuracy": {"model": MODEL, "data": DATA, "method": {"name": "classification"},
                                   "training": {"metric_for_best": "eval_accuracy"}},
}
MACHINES = {"cpu": (CPU, None), "4 x A100": (A100x4, 4), "T4": (T4, None)}


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_field_of_every_spec_is_resolved(name, machine):
    hw, world = MACHINES[machine]
    plan = resolve(build_config(CONFIGS[name]), hw, world, sizing=False)
    specs = plan.specs
    assert isinstance(specs, RunSpecs)
    assert unresolved(specs) == []
    for spec in (specs.optimizer, specs.batch, specs.precision, specs.cadence, specs.resilience, specs.distributed):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            assert value != "auto", f"{type(spec).__name__}.{f.name}"
            assert value is not None or f.name in type(spec).UNSET_MEANS, f"{type(spec).__name__}.{f.name} is None"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, dataclasses.fields(spec)[0].name, 0)
    b = specs.batch
    assert isinstance(b.micro_batch, int) and isinstance(b.grad_accum, int) and isinstance(b.gradient_checkpointing, bool)
    assert b.micro_batch * b.grad_accum * b.dp_degree == b.effective_batch == plan.effective_batch.value
    assert specs.precision.mixed in ("bf16", "fp16", "fp32") and specs.precision.mixed == plan.precision.value
    assert specs.precision.model_dtype in ("float32", "bfloat16", "float16")
    assert specs.precision.compute_dtype in ("float32", "bfloat16", "float16")
    assert isinstance(specs.optimizer.learning_rate, float) and specs.optimizer.learning_rate == plan.learning_rate.value
    assert isinstance(specs.cadence.greater_is_better, bool) and isinstance(specs.cadence.save_steps, int)


def test_the_specs_match_the_resolved_config():
    plan = resolve(build_config(CONFIGS["full fine-tune"]), A100x4, 4)
    t, s = plan.config.training, plan.specs
    assert s.optimizer == OptimizerSpec(name="adamw_torch", learning_rate=t.learning_rate, weight_decay=0.01, max_grad_norm=1.0,
                                        lr_scheduler_type="cosine", warmup_ratio=0.03, warmup_steps=10)
    assert s.optimizer.learning_rate == pytest.approx(5e-5 * 2)  # x sqrt(4)
    assert s.optimizer.warmup_for(1000) == 10
    assert (s.batch.micro_batch, s.batch.grad_accum, s.batch.dp_degree) == (t.per_device_train_batch_size, t.gradient_accumulation_steps, 4)
    assert s.precision == PrecisionSpec(mixed="bf16", model_dtype="float32", compute_dtype="bfloat16", tf32=True, torch_compile=False,
                                        use_liger_kernel=False)
    assert s.precision.bf16 and not s.precision.fp16
    assert s.cadence.save_steps == t.eval_steps == 50 and s.cadence.greater_is_better is False
    assert s.resilience.oom_recovery is True and s.resilience.collective_timeout_seconds == 600.0
    assert set(s.to_dict()) == {"optimizer", "batch", "precision", "cadence", "resilience", "distributed"}
    d = s.distributed  # the strategy reaches the loop through this spec; its topology is what the batch arithmetic reads
    assert d.strategy == plan.strategy.value
    assert d.dims.world == 4 and d.dims.dp == s.batch.dp_degree == 4 and (d.dims.cp, d.dims.tp) == (1, 1)
    assert (d.dims.dp_shard, d.dims.dp_replicate) == ((4, 1) if d.strategy in ("fsdp", "zero2", "zero3") else (1, 4))


def test_cpu_precision_and_warmup_from_the_ratio():
    s = resolve(build_config(CONFIGS["sft lora, auto batch"]), CPU).specs
    assert s.precision == PrecisionSpec(mixed="fp32", model_dtype="float32", compute_dtype="float32", tf32=False, torch_compile=False,
                                        use_liger_kernel=False)
    assert s.optimizer.warmup_steps is None and s.optimizer.warmup_for(100) == 3  # ceil(0.03 x 100)
    assert s.optimizer.learning_rate == 2e-4


def test_fp16_gpu_and_best_metric_direction_from_the_table():
    s = resolve(build_config(CONFIGS["classification by accuracy"]), T4).specs
    assert s.precision.mixed == "fp16" and s.precision.compute_dtype == "float32"
    assert (s.cadence.metric_for_best, s.cadence.greater_is_better) == ("accuracy", True)
    assert s.cadence.early_stopping_patience == 3


def test_early_stopping_off_is_the_one_meaning_of_none():
    s = resolve(build_config(CONFIGS["qlora, peft auto"]), CPU).specs
    assert s.cadence.early_stopping_patience is None and "early_stopping_patience" in CadenceSpec.UNSET_MEANS


def test_a_metric_without_a_direction_is_refused_by_the_resolver_not_guessed():
    """A stage's config skips build_config's check; resolving it refuses the unknown direction as the loop does."""
    cfg = build_config({"model": MODEL, "data": DATA, "method": {"name": "rl", "rl": {"reward_function": "r.py:f"}}})
    cfg.training.metric_for_best = "completion_length"
    with pytest.raises(ConfigError, match="training.greater_is_better"):
        resolve(cfg, CPU)


def test_spec_classes_declare_what_none_means_only_for_optional_fields():
    for cls in (OptimizerSpec, BatchSpec, PrecisionSpec, CadenceSpec, ResilienceSpec):
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(cls.UNSET_MEANS) <= names
