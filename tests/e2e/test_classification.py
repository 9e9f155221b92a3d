"""method.name: classification through `trainpipe run` on a tiny Llama: records of `format: classification` (with a label
column mapped by `columns:`), a sequence-classification head, baseline vs final accuracy on the held-out split (final
clearly above chance and above the baseline), and an exported AutoModelForSequenceClassification folder whose id2label names
the classes and whose predictions on unseen texts agree with the labels."""

import json

import pytest
import yaml

from tiny import build_tiny_model, classification_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

def records(n: int, seed: int) -> list[dict]:
    return classification_records(n, seed, text="sentence", label="topic")  # class "first-half": the first word is one of WORDS[:8]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("classify")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", records(320, seed=5))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl", "format": "classification", "columns": {"text": "sentence", "label": "topic"}}],
                 "eval_split": 48, "max_length": 32},
        "method": {"name": "classification", "peft": "none"},
        "training": {"max_steps": 60, "learning_rate": 2e-3, "eval_steps": 20, "logging_steps": 10, "per_device_train_batch_size": 16,
                     "gradient_accumulation_steps": 1, "early_stopping_patience": None},
        "output_dir": str(tmp / "run"),
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(p)]) == 0
    return tmp / "run"


def test_accuracy_rises_well_above_chance(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["method"] == "classification" and s["classes"] == ["first-half", "second-half"]
    assert s["final"]["accuracy"] >= 0.8, s["final"]
    assert s["final"]["accuracy"] >= s["baseline"]["accuracy"] + 0.2 and s["final"]["loss"] < s["baseline"]["loss"]
    assert 0 <= s["final"]["macro_f1"] <= 1 and s["final"]["macro_f1"] >= 0.75


def test_export_predicts_unseen_texts(run_dir):
    from trainpipe.train.classify import predict

    cfg = json.loads((run_dir / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    assert set(cfg["id2label"].values()) == {"first-half", "second-half"}
    held = records(60, seed=99)
    pred = predict(run_dir / "model", [r["sentence"] for r in held])
    acc = sum(p == r["topic"] for p, r in zip(pred, held)) / len(held)
    assert acc >= 0.8, acc


def test_classification_without_labels_is_one_error(tmp_path, tiny_model_dir, capsys):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "apple river"}] * 20)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model_dir)}, "data": {"sources": [{"path": "d.jsonl", "format": "classification"}], "on_error": "raise"},
                                 "method": {"name": "classification"}, "output_dir": str(tmp_path / "run")}))
    assert main(["run", str(p)]) == 2
    assert "label" in capsys.readouterr().out
