"""`trainpipe prepare` and `trainpipe data inspect` through the real entry point: report contract, cache reuse, errors."""

import json

import pytest
import yaml

from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def make(tmp_path, base, records, **data):
    d = tmp_path / "data.jsonl"
    d.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    cfg = {"model": {"name_or_path": str(base)}, "data": {"sources": [{"path": "data.jsonl"}], "eval_split": 3, "max_length": 96, **data},
           "output_dir": str(tmp_path / "out")}
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


RECS = [{"instruction": "Reverse the order of the words.", "input": f"apple river w{i}", "output": f"w{i} river apple"} for i in range(30)]


def test_prepare_writes_and_prints_the_report(tmp_path, base, capsys):
    recs = RECS + [RECS[0], {"instruction": "Mail me.", "output": "write to ann@annmail.net"}]
    cfg = make(tmp_path, base, recs)
    assert main(["data", "prepare", str(cfg)]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "data" / "report.json").read_text())
    for key in ("records_read", "records_kept", "dropped", "pii", "splits"):
        assert key in report, key
    assert report["records_read"] == 32 == report["records_kept"] + sum(report["dropped"].values())
    assert report["dropped"] == {"exact_duplicate": 1} and report["pii"] == {"email": 1}
    assert report["splits"]["eval"]["records"] == 3 and report["splits"]["train"]["records"] == 28
    assert "records read 32, kept 31, dropped 1" in out and "pii replaced: email 1" in out and "holds" in out
    assert main(["data", "prepare", str(cfg), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["cache"]["hit"] is True and again["splits"] == report["splits"]


def test_data_inspect_shows_trained_tokens(tmp_path, base, capsys):
    cfg = make(tmp_path, base, RECS)
    assert main(["data", "inspect", str(cfg), "-n", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    for r in rows:
        trained = "".join(p["text"] for p in r["pieces"] if p["trained"])
        assert trained == r["trained_text"] and trained.endswith("<|im_end|>") and "Reverse" not in trained
        assert any(p["special"] and p["text"] == "<|im_start|>" for p in r["pieces"])
    assert main(["data", "inspect", str(cfg), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "«" in out and "river apple<|im_end|>»" in out and "<|im_start|>" in out


def test_bad_data_exit_2_without_traceback_and_skip_writes_rejected(tmp_path, base, capsys):
    cfg = make(tmp_path, base, RECS[:5] + ['{"instruction": "broken"'] + RECS[5:])
    assert main(["data", "prepare", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "data.jsonl` line 6: not valid JSON" in out and "Traceback" not in out and "on_error: skip" in out
    cfg = make(tmp_path, base, RECS[:5] + ['{"instruction": "broken"', json.dumps({"messages": [{"role": "user", "content": "hi"}]})] + RECS[5:], on_error="skip")
    assert main(["data", "prepare", str(cfg)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "data" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["kind"]) for r in rows] == [(6, "invalid_json"), (7, "format_mismatch")]
    assert "missing field `instruction`" in rows[1]["reason"] and "looks like chat" in rows[1]["reason"]


@pytest.mark.parametrize("packing", ["pack", "padding_free"])
def test_run_trains_on_packed_and_padding_free_batches(tmp_path, base, packing):
    cfg = make(tmp_path, base, RECS * 1 + [{"instruction": "Reverse the order of the words.", "input": f"stone lamp v{i}", "output": f"v{i} lamp stone"} for i in range(30)],
               packing=packing)
    data = yaml.safe_load(cfg.read_text())
    data["training"] = {"max_steps": 4, "eval_steps": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "early_stopping_patience": None}
    data["eval"] = {"metrics": ["loss"]}
    cfg.write_text(yaml.safe_dump(data))
    assert main(["run", str(cfg)]) == 0
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert report["batching"]["mode"] == packing
    if packing == "pack":
        assert report["splits"]["train"]["packed_rows"] < report["splits"]["train"]["records"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["train"]["global_step"] == 4 and summary["data"]["records_kept"] == 60
