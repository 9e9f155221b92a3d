"""`trainpipe run` resolves its `auto`s through the planner and records plan vs measured in summary.json.

On the CPU the measured figures are the exact bytes of the live parameters, gradients and optimizer
state after the first optimizer step; the planner predicts them from config.json alone (a meta-device
build). They must be equal to the byte.
"""

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _run(tmp: Path, model_dir: Path, name: str, method: dict, training: dict | None = None) -> dict:
    write_jsonl(tmp / "data.jsonl", alpaca_records(80, seed=3))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": str(tmp / "data.jsonl")}], "eval_split": 16, "max_length": 64},
        "method": method,
        "training": {"max_steps": 3, "eval_steps": 3, "logging_steps": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
                     **(training or {})},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / name),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(p)]) == 0
    return json.loads((tmp / name / "summary.json").read_text())


@pytest.mark.parametrize(
    "name,method,training",
    [
        ("full", {"peft": "none"}, {}),
        ("full_sgd", {"peft": "none"}, {"optim": "sgd"}),
        ("lora", {"peft": "lora", "lora": {"r": 4, "alpha": 8}}, {}),
        ("lora_all_linear", {"peft": "lora", "lora": {"r": 2, "alpha": 4, "target_modules": "all-linear"}}, {}),
        ("dora", {"peft": "dora", "lora": {"r": 4, "alpha": 8}}, {}),
        ("qlora", {"peft": "qlora", "lora": {"r": 4, "alpha": 8}}, {}),
        ("qlora_single_quant", {"peft": "qlora", "lora": {"r": 4, "alpha": 8}, "quantization": {"double_quant": False}}, {}),
    ],
)
def test_predicted_state_bytes_equal_measured(tmp_path, tiny_model_dir, name, method, training):
    s = _run(tmp_path, tiny_model_dir, name, method, training)
    plan = s["plan"]
    pred, meas = plan["predicted"]["state_bytes"], plan["measured"]["state_bytes"]
    assert meas["parameters_bytes"] > 0 and meas["gradients_bytes"] > 0 and meas["optimizer_bytes"] > 0
    for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
        assert pred[k] == meas[k], (k, pred[k], meas[k])
    assert plan["state_bytes_equal"] == {"parameters_bytes": True, "gradients_bytes": True, "optimizer_bytes": True}
    # the memory model's breakdown for this setup is recorded beside it, with gradients only for trainable parameters
    mem = plan["predicted"]["memory"]
    assert mem["trainable_params"] == s["parameters"]["trainable"]
    adapters = s["parameters"]["trainable"] if method["peft"] != "none" else 0
    assert mem["total_params"] == s["parameters"]["total"] - adapters  # the memory model counts the base; adapters are the trainable
    assert plan["measured"]["tokens_per_second"] > 0


def test_autos_resolved_by_the_planner(tmp_path, tiny_model_dir):
    s = _run(tmp_path, tiny_model_dir, "auto", {"peft": "auto"}, {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto",
                                                                  "gradient_accumulation_steps": None, "learning_rate": None})
    keys = {d["key"]: d for d in s["plan"]["decisions"]}
    # a 0.2M-parameter model on the CPU: full fine-tune, the largest micro-batch, no checkpointing, one process
    assert keys["method.peft"]["value"] == "none" and "below 1B" in keys["method.peft"]["rule"]
    assert keys["training.per_device_train_batch_size"]["value"] == 8
    assert keys["training.gradient_checkpointing"]["value"] is False
    assert keys["strategy"]["value"] == "single"
    assert keys["training.gradient_accumulation_steps"]["value"] == 4  # 8 x 4 x 1 >= 32
    assert keys["training.learning_rate"]["value"] == 5e-5
    resolved = yaml.safe_load((tmp_path / "auto" / "config.resolved.yaml").read_text())
    assert resolved["method"]["peft"] == "none" and resolved["training"]["per_device_train_batch_size"] == 8
    assert resolved["training"]["gradient_checkpointing"] is False
    manifest = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert {d["key"] for d in manifest["decisions"]} >= {"method.peft", "training.per_device_train_batch_size", "strategy"}
    # the manifest records the resolved plan the run executed: each setting with its source, the exact effective batch
    mp = manifest["plan"]
    assert mp["world_size"] == {"value": 1, "source": "default", "rule": mp["world_size"]["rule"], "watch": ""}
    assert mp["effective_batch_formula"] == "8 x 4 x 1 = 32" and mp["micro_batch"]["source"] == "planner"
    assert mp["learning_rate"]["value"] == resolved["training"]["learning_rate"] and mp["config_hash"]
    assert s["plan"]["state_bytes_equal"] == {"parameters_bytes": True, "gradients_bytes": True, "optimizer_bytes": True}
