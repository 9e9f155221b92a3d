from trainpipe.config import build_config
from trainpipe.plan import resolve
from trainpipe.plan.hardware import Hardware

BASE = {"model": {"name_or_path": "org/m"}, "data": {"sources": [{"path": "t.jsonl"}]}}
CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
A100x4 = Hardware("cuda", 4, ("A100",) * 4, True, 32, "")


def test_learning_rate_defaults_by_method():
    assert resolve(build_config(BASE), CPU).config.training.learning_rate == 2e-4
    full = build_config(BASE, overrides=["method.peft=none"])
    assert resolve(full, CPU).config.training.learning_rate == 5e-5
    explicit = build_config(BASE, overrides=["training.learning_rate=1e-3"])
    assert resolve(explicit, CPU).config.training.learning_rate == 1e-3


def test_accumulation_reaches_effective_batch_32():
    r = resolve(build_config(BASE, overrides=["training.per_device_train_batch_size=4"]), CPU)
    assert r.config.training.gradient_accumulation_steps == 8
    r = resolve(build_config(BASE, overrides=["training.per_device_train_batch_size=4"]), A100x4)
    assert r.config.training.gradient_accumulation_steps == 2
    r = resolve(build_config(BASE, overrides=["training.per_device_train_batch_size=5"]), CPU)
    assert r.config.training.gradient_accumulation_steps == 7  # 35 >= 32


def test_precision_follows_hardware():
    assert resolve(build_config(BASE), CPU).config.training.bf16 is False
    r = resolve(build_config(BASE), A100x4)
    assert r.config.training.bf16 is True and r.config.model.dtype == "bfloat16"


def test_every_decision_names_its_rule():
    r = resolve(build_config(BASE), CPU)
    keys = {d.key for d in r.decisions}
    assert {"training.learning_rate", "training.gradient_accumulation_steps", "training.bf16", "output_dir"} <= keys
    assert all(d.rule for d in r.decisions)


def test_resolve_does_not_mutate_input():
    cfg = build_config(BASE)
    resolve(cfg, CPU)
    assert cfg.training.learning_rate is None
