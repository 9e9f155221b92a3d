"""Issue 24: `trainpipe plan --model NAME --set k=v` is honoured (it changes the plan) or refused in one paragraph
(exit 2), never ignored; and a `--method auto` decision states the rule that chose the method, never "as requested"."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from trainpipe.cli import main

MODEL = "meta-llama/Llama-3.1-8B"


def _plan(capsys, *args) -> dict:
    assert main(["plan", "--model", MODEL, "--gpu", "H100-80GB", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _method_rule(p: dict) -> str:
    return next(d["rule"] for d in p["decision"] if d["key"] == "method")


# ------------------------------------------------------------------ --set with --model
def test_set_max_length_changes_activation_memory(capsys):
    short = _plan(capsys, "--set", "data.max_length=512", "--set", "training.per_device_train_batch_size=1")
    long = _plan(capsys, "--set", "data.max_length=4096", "--set", "training.per_device_train_batch_size=1")
    assert long["setup"]["seq_len"] == 4096 and short["setup"]["seq_len"] == 512
    assert long["memory"]["per_device"]["activations_bytes"] > 2 * short["memory"]["per_device"]["activations_bytes"]


def test_set_micro_batch_changes_memory_and_effective_batch(capsys):
    base = _plan(capsys)
    two = _plan(capsys, "--set", "training.per_device_train_batch_size=2", "--set", "training.target_effective_batch_size=8")
    assert two["recommendation"]["micro_batch"] == 2 and two["recommendation"]["effective_batch"] == 8
    assert base["recommendation"]["micro_batch"] != 2
    assert two["memory"]["per_device"]["activations_bytes"] != base["memory"]["per_device"]["activations_bytes"]


def test_set_lora_r_changes_trainable_params(capsys):
    r16 = _plan(capsys, "--set", "method.peft=lora")
    r64 = _plan(capsys, "--set", "method.peft=lora", "--set", "method.lora.r=64")
    assert r64["recommendation"]["lora_r"] == 64
    assert r64["model"]["trainable_params"] == 4 * r16["model"]["trainable_params"]


def test_set_learning_rate_is_the_planned_learning_rate(capsys):
    p = _plan(capsys, "--set", "training.learning_rate=1e-4")
    assert p["recommendation"]["learning_rate"] == 1e-4
    # a GPU only in --gpu-file: the resolver takes its spec with the hardware (the same path as a catalog GPU)
    gpus = Path(tempfile.mkdtemp()) / "gpus.json"
    gpus.write_text(json.dumps({"gpus": [{"name": "MY-H100", "memory_gib": 80, "bf16": True, "bf16_tflops": 989, "fp16_tflops": 989,
                                          "on_demand_usd": 2.0, "spot_usd": 1.0}]}))
    assert main(["plan", "--model", MODEL, "--gpu", "MY-H100", "--gpu-file", str(gpus), "--set", "training.learning_rate=3e-5", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["recommendation"]["gpu"] == "MY-H100" and q["recommendation"]["learning_rate"] == 3e-5


def test_set_key_the_model_path_cannot_honour_is_one_paragraph(capsys):
    assert main(["plan", "--model", MODEL, "--gpu", "H100-80GB", "--set", "training.weight_decay=0.1"]) == 2
    out = capsys.readouterr().out.strip()
    assert "training.weight_decay" in out and "trainpipe plan CONFIG --set" in out
    assert "Traceback" not in out and "\n\n" not in out


def test_set_unknown_key_is_one_paragraph(capsys):
    assert main(["plan", "--model", MODEL, "--gpu", "H100-80GB", "--set", "training.no_such_key=1"]) == 2
    out = capsys.readouterr().out.strip()
    assert "training.no_such_key" in out and "Traceback" not in out and "\n\n" not in out


def test_set_bad_value_is_one_paragraph(capsys):
    assert main(["plan", "--model", MODEL, "--gpu", "H100-80GB", "--set", "data.max_length=lots"]) == 2
    out = capsys.readouterr().out.strip()
    assert "max_length" in out and "Traceback" not in out


# ------------------------------------------------------------------ --method auto says its rule
def test_method_auto_states_its_rule_on_several_gpus(capsys):
    for gpu in ("H100-80GB", "L4"):
        assert main(["plan", "--model", MODEL, "--gpu", gpu, "--set", "method.peft=auto", "--json"]) == 0
        rule = _method_rule(json.loads(capsys.readouterr().out))
        assert rule and "as requested" not in rule


def test_method_auto_with_a_budget_states_the_ranking_rule(capsys):
    p = _plan(capsys, "--set", "method.peft=auto", "--tokens", "1e8", "--budget-usd", "100")
    rule = _method_rule(p)
    assert "as requested" not in rule and "method.peft auto" in rule and "cheapest" in rule


def test_method_auto_without_a_gpu_and_a_budget_states_the_ranking_rule(capsys):
    assert main(["plan", "--model", "Qwen/Qwen2.5-1.5B", "--set", "method.peft=auto", "--tokens", "1e8", "--budget-usd", "100", "--json"]) == 0
    assert "as requested" not in _method_rule(json.loads(capsys.readouterr().out))


def test_explicit_method_stays_as_requested(capsys):
    p = _plan(capsys, "--set", "method.peft=lora")
    assert _method_rule(p) == "as requested"
    p = _plan(capsys, "--set", "method.peft=lora", "--tokens", "1e8", "--budget-usd", "100")
    assert _method_rule(p) == "as requested"
