"""The formats users bring, trained end to end through the CLI on a tiny Llama (tests/tiny.py): LLaMA-Factory's KTO
layout (`messages` + `label`, a JSON array) with `method.name: kto`, and reasoning traces with `data.reasoning: mask`
(the data report's loss tokens leave the reasoning out; the run trains). Extracts: tests/assets/formats."""

import json
from pathlib import Path

import pytest
import yaml

from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

FMT = Path(__file__).resolve().parents[1] / "assets" / "formats"


def _run(tmp: Path, base: Path, name: str, source: str, method: dict, data: dict | None = None) -> Path:
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": source}], "eval_split": 1, "max_length": 128, **(data or {})},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, **method},
        "training": {"max_steps": 2, "eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 1, "early_stopping_patience": None},
        "output_dir": str(tmp / f"run-{name}"),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(p)]) == 0
    return tmp / f"run-{name}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fmt") / "base")


def test_kto_as_llama_factory_writes_it_trains(tmp_path, base):
    run = _run(tmp_path, base, "kto", str(FMT / "kto_en_demo.json"), {"name": "kto"}, {"eval_split": 2})
    report = json.loads((run / "data_report.json").read_text())
    assert report["sources"][0]["format"] == "kto" and report["records_kept"] == 6
    assert (run / "model" / "adapter").exists()


def test_reasoning_masked_trains_on_the_answers_only(tmp_path, base):
    loss = {}
    for mode in ("train", "mask"):
        run = _run(tmp_path, base, f"think-{mode}", str(FMT / "reasoning.jsonl"), {"name": "sft"}, {"reasoning": mode})
        report = json.loads((run / "data_report.json").read_text())
        loss[mode] = (report["splits"]["train"]["tokens"], report["splits"]["train"]["loss_tokens"])
        assert (run / "model" / "adapter").exists()
    assert loss["mask"][0] == loss["train"][0] and loss["mask"][1] < loss["train"][1]
