"""`trainpipe data prepare CONFIG`: the tokenized cache and the data report, without loading weights or training;
the run that follows reuses the cache."""

import json

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def test_data_prepare_writes_cache_and_report_and_trains_nothing(tmp_path, capsys):
    base = build_tiny_model(tmp_path / "base")
    recs = alpaca_records(40, seed=2)
    write_jsonl(tmp_path / "data.jsonl", recs + [recs[0]])  # one exact duplicate to account for
    cfg = {"model": {"name_or_path": str(base)}, "data": {"sources": [{"path": "data.jsonl"}], "eval_split": 4, "max_length": 96},
           "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
           "training": {"max_steps": 2, "eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
           "eval": {"metrics": ["loss"]}, "output_dir": str(tmp_path / "out")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))

    # no weights: prepare needs only the tokenizer, so it works with the weight file moved away
    weights = base / "model.safetensors"
    weights.rename(tmp_path / "aside.safetensors")
    capsys.readouterr()  # what building the tiny model printed
    assert main(["data", "prepare", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    out = tmp_path / "out"
    on_disk = json.loads((out / "data" / "report.json").read_text())
    assert on_disk["records_read"] == 41 == report["records_read"]
    assert report["dropped"] == {"exact_duplicate": 1}
    assert report["splits"]["eval"]["records"] == 4 and report["splits"]["train"]["records"] == 36
    assert report["splits"]["train"]["loss_tokens"] > 0
    assert report["cache"]["hit"] is False
    from pathlib import Path

    cache = Path(report["cache"]["path"])
    assert cache.is_dir() and any(cache.iterdir())
    assert not (out / "checkpoints").exists() and not (out / "model").exists() and not (out / "metrics.jsonl").exists()

    # the run afterwards starts from the same cache entry
    (tmp_path / "aside.safetensors").rename(weights)
    assert main(["run", str(path), "--overwrite"]) == 0
    run_report = json.loads((out / "data_report.json").read_text())
    assert run_report["cache"]["hit"] is True and run_report["cache"]["key"] == report["cache"]["key"]
    assert (out / "model").is_dir()
