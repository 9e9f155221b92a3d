"""QLoRA with trainpipe's default preparation (the non-quantized rest kept in the load dtype, as TRL's SFTTrainer;
`method.quantization.upcast_rest: false`) still learns, end to end through the CLI on the CPU: the tiny Llama loaded in
bfloat16 (`model.dtype`), its linears real bitsandbytes NF4, the embeddings/norms bf16, the LoRA adapters fp32.
The eval loss falls well below the untrained model's and the trained adapters moved.
"""

import json

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
pytest.importorskip("bitsandbytes")


def _run(tiny_model_dir, tmp_path, upcast: bool | None) -> dict:
    write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_records(160, seed=5))
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "dtype": "bfloat16"},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 24, "max_length": 64,
                 "dedup": {"near": False}, "decontamination": {"enabled": False}},
        "method": {"peft": "qlora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, **({} if upcast is None else {"quantization": {"upcast_rest": upcast}})},
        "training": {"max_steps": 24, "eval_steps": 24, "logging_steps": 1, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "learning_rate": 5e-3, "early_stopping_patience": None,
                     "warmup_steps": 0, "hang_timeout_seconds": 0},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "run.yaml")]) == 0
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    assert resolved["model"]["dtype"] == "bfloat16" and resolved["method"]["quantization"]["upcast_rest"] is bool(upcast)
    return json.loads((run / "summary.json").read_text())


def test_default_qlora_with_a_bf16_rest_learns_as_the_fp32_rest_does(tiny_model_dir, tmp_path):
    """The same run with the default and with `upcast_rest: true`: both learn, the default about as much."""
    default = _run(tiny_model_dir, tmp_path / "default", None)
    upcast = _run(tiny_model_dir, tmp_path / "upcast", True)
    drops = {}
    for name, s in (("default", default), ("upcast_rest", upcast)):
        drops[name] = s["baseline"]["loss"] - s["final"]["loss"]
        print(f"\n{name}: eval loss {s['baseline']['loss']:.4f} -> {s['final']['loss']:.4f}")
    assert drops["default"] > 0.15 and drops["upcast_rest"] > 0.15, drops
    assert drops["default"] > 0.7 * drops["upcast_rest"], drops
