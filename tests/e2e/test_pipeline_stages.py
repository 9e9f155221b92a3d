"""`stages:` as one DAG: `trainpipe pipeline run` of two SFT stages, the second training from the model the first
exported (an input edge `sft.export -> sft-2.train`), then a change in the second stage alone re-runs only its chain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _write(tmp: Path, model_dir: Path, lr2: float) -> Path:
    cfg = {
        "name": "staged",
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 8, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 3, "eval_steps": 3, "logging_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "stages": [{"method": {"name": "sft"}}, {"method": {"name": "sft"}, "training": {"learning_rate": lr2}}],
        "tracking": {"backend": "none"},
        "output_dir": str(tmp / "run"),
    }
    path = tmp / "s.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps(tmp: Path) -> dict:
    return {s["id"]: s for s in json.loads((tmp / "run" / "pipeline.json").read_text())["steps"]}


def test_stages_run_as_one_dag(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=31))
    cfg = _write(tmp_path, tiny_model_dir, 4e-3)
    assert main(["pipeline", "run", str(cfg)]) == 0
    steps = _steps(tmp_path)
    assert [k for k in steps if k.endswith(".train")] == ["sft.train", "sft-2.train"]
    assert all(s["status"] == "ran" for s in steps.values())
    # the second stage trained from the first stage's export: its input is that artefact, by content
    assert steps["sft-2.train"]["parts"]["inputs"]["base_model"] == steps["sft.export"]["outputs"]["model"]["digest"]
    m2 = yaml.safe_load((tmp_path / "run" / "sft-2" / "config.resolved.yaml").read_text())
    assert Path(m2["model"]["name_or_path"]) == (tmp_path / "run" / "sft" / "model").resolve()
    s1 = json.loads((tmp_path / "run" / "sft" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "run" / "sft-2" / "summary.json").read_text())
    assert s2["baseline"]["loss"] == pytest.approx(s1["final"]["loss"], abs=1e-4)  # stage 2 starts where stage 1 ended

    cfg = _write(tmp_path, tiny_model_dir, 3e-3)  # only the second stage's learning rate
    assert main(["pipeline", "run", str(cfg)]) == 0
    steps = _steps(tmp_path)
    assert {k: s["status"] for k, s in steps.items() if k.startswith("sft.")} == {f"sft.{k}": "reused" for k in
                                                                                 ("prepare", "train", "evaluate", "export", "register", "report")}
    assert steps["sft-2.prepare"]["status"] == "reused" and steps["sft-2.train"]["status"] == "ran"
    assert "config changed: training.learning_rate" in steps["sft-2.train"]["why"]
