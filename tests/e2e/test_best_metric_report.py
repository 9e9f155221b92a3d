"""The best checkpoint is named with the metric that chose it: a tiny classifier trained with `training.metric_for_best:
accuracy` has "ranked by accuracy, higher is better" beside its best checkpoint in report.html and in `trainpipe run`'s
closing lines (they said "eval loss" whatever the ranking was), and summary.json records the direction."""

import json
import re

import pytest
import yaml

from tiny import build_tiny_model, classification_records, write_jsonl
from trainpipe.cli import main
from trainpipe.report.html import best_ranking

pytestmark = pytest.mark.e2e


def test_run_with_metric_for_best_accuracy_names_accuracy_in_report_and_cli(tmp_path, capsys):
    base = build_tiny_model(tmp_path / "base")
    write_jsonl(tmp_path / "data" / "train.jsonl", classification_records(80, seed=5))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl", "format": "classification"}], "eval_split": 16, "max_length": 24},
        "method": {"name": "classification", "peft": "none"},
        "training": {"max_steps": 6, "learning_rate": 3e-3, "eval_steps": 3, "logging_steps": 3, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "early_stopping_patience": None, "save_total_limit": 1, "keep_best": 1,
                     "metric_for_best": "accuracy"},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "run.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    run = tmp_path / "run"
    tr = json.loads((run / "summary.json").read_text())["train"]
    assert tr["best_metric_name"] == "accuracy" and tr["best_metric_greater_is_better"] is True
    step = tr["best_checkpoint"].rsplit("/", 1)[-1]
    # the CLI's closing lines
    m = re.search(rf"best checkpoint: {step} \(ranked by accuracy, higher is better: ([0-9.]+); eval loss ([0-9.]+)\)", out)
    assert m, out[-600:]
    assert float(m.group(1)) == pytest.approx(tr["best_metric_value"], rel=1e-3)
    assert float(m.group(2)) == pytest.approx(tr["best_eval_loss"], rel=1e-3)
    # the report page written at the end of the run
    page = (run / "report.html").read_text()
    line = next(ln for ln in page.splitlines() if "best checkpoint <code>" in ln)
    assert "ranked by accuracy, higher is better" in line and "(eval loss" not in line and "ranked by eval loss" not in line


@pytest.mark.parametrize("train,want", [
    ({"best_metric_name": "loss", "best_eval_loss": 0.5, "best_metric_value": 0.5, "best_metric_greater_is_better": False},
     "ranked by eval loss, lower is better: 0.5"),
    ({"best_eval_loss": 0.75}, "ranked by eval loss, lower is better: 0.75"),  # a summary written before metrics were named
    ({"best_metric_name": "kl", "best_metric_value": 0.02, "best_eval_loss": 1.5}, "ranked by kl, lower is better: 0.02; eval loss 1.5"),
    ({"best_metric_name": "margin_per_token", "best_metric_value": 0.3, "best_eval_loss": 0.6, "best_metric_greater_is_better": True},
     "ranked by margin_per_token, higher is better: 0.3; eval loss 0.6"),
    ({"best_metric_name": "completion_length", "best_metric_value": 12.0, "best_metric_greater_is_better": False},
     "ranked by completion_length, lower is better: 12"),  # the user's stated direction, not the table's (it has none)
    ({"best_metric_name": "completion_length", "best_metric_value": 12.0}, "ranked by completion_length: 12"),  # unknown: not invented
])
def test_best_ranking_words(train, want):
    assert best_ranking(train) == want
