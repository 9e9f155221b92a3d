"""`trainpipe run`'s autos resolved by the planner for a given machine.

The GPU machines here are FAKE `Hardware` descriptions (this machine has no GPU): the planner is a
pure function of (config, hardware), so describing an A100 or a T4 is all it needs.
"""

from trainpipe.config import build_config
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.run_plan import plan_run, what_would_fit

FAKE_A100 = Hardware("cuda", 1, ("NVIDIA A100-SXM4-80GB",), True, 8, "fake")
FAKE_T4 = Hardware("cuda", 1, ("Tesla T4",), False, 8, "fake")
FAKE_A10G = Hardware("cuda", 1, ("NVIDIA A10G",), True, 8, "fake")


def cfg(model="meta-llama/Llama-3.1-8B", **training):
    return build_config({
        "model": {"name_or_path": model}, "data": {"sources": [{"path": "x.jsonl"}], "max_length": 2048},
        "method": {"peft": "auto"}, "training": {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto", **training},
    })


def decisions(plan):
    return {d.key: d for d in plan.decisions}


def test_8b_on_an_a100_is_lora_with_a_micro_batch_that_fits():
    p = plan_run(cfg(), FAKE_A100)
    d = decisions(p)
    assert p.config.method.peft == "lora" and "24-80 GB" in d["method.peft"].rule and d["method.peft"].watch
    mb = p.config.training.per_device_train_batch_size
    assert mb in (1, 2, 4, 8)
    assert p.predicted["memory"]["total_bytes"] <= 80 * 1024**3
    assert p.config.training.bf16 is True  # Ampere: bf16 mixed precision
    assert p.config.training.per_device_train_batch_size * p.config.training.gradient_accumulation_steps >= 32
    assert p.predicted["tokens_per_second"] > 0


def test_8b_on_a_t4_is_qlora_in_fp16():
    p = plan_run(cfg(), FAKE_T4)
    assert p.config.method.peft == "qlora"
    assert p.config.training.bf16 is False and p.config.training.fp16 is True  # before Ampere: fp16 with loss scaling


def test_a_smaller_micro_batch_or_checkpointing_when_memory_bound():
    big = plan_run(cfg("Qwen/Qwen2.5-0.5B"), FAKE_A100)
    small = plan_run(cfg(), FAKE_A10G, )
    assert big.config.training.per_device_train_batch_size >= small.config.training.per_device_train_batch_size


def test_out_of_memory_advice_names_setups_that_fit():
    c = build_config({"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}, "data": {"sources": [{"path": "x.jsonl"}], "max_length": 4096},
                      "method": {"peft": "none"}, "training": {"per_device_train_batch_size": 8}})
    advice = what_would_fit(c, FAKE_A10G)
    assert advice and any("qlora" in a or "micro-batch" in a or "GPU" in a for a in advice)
    assert what_would_fit(c, Hardware("cpu", 1, ("cpu",), False, 2, "")) == []


def test_unknown_model_offline_only_drops_the_predictions():
    p = plan_run(cfg("nobody/not-a-model"), FAKE_A100)
    assert p.predicted == {} and p.notes and "could not size" in p.notes[0]
    assert p.config.method.peft == "lora"
