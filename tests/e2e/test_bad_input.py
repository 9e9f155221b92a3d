"""Bad data and bad models stop the run with one paragraph naming the problem and the fix; nothing lands in model/."""

import json

import pytest

from test_sft import make_config
from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def test_malformed_line_stops_with_file_and_line(tmp_path, base, capsys):
    cfg = make_config(tmp_path, base)
    data = tmp_path / "data" / "alpaca.jsonl"
    lines = data.read_text().splitlines()
    lines[6] = '{"instruction": "oops", "output": "x"'
    data.write_text("\n".join(lines) + "\n")
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert f"{data}` line 7" in out and "not valid JSON" in out and "Traceback" not in out
    assert not (tmp_path / "run" / "model").exists()
    last = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "run_failed" and last["error"] == "DataError" and "line 7" in last["message"]


def test_skip_drops_counts_and_trains(tmp_path, base):
    cfg = make_config(tmp_path, base, **{"data.on_error": "skip", "training.max_steps": 5, "training.eval_steps": 5, "eval.metrics": ["loss"]})
    data = tmp_path / "data" / "alpaca.jsonl"
    lines = data.read_text().splitlines()
    lines[6] = "not json"
    lines[9] = json.dumps({"instruction": "no output"})
    data.write_text("\n".join(lines) + "\n")
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["rejected_total"] == 2
    assert summary["data"]["rejected"] == {"invalid_json": 1, "format_mismatch": 1}
    rows = [json.loads(x) for x in (run / "rejected.jsonl").read_text().splitlines()]
    # the two bad lines by their reading rule; every other filter's drops (dedup, length, ...) are listed too, by their own rule
    assert sorted(r["line"] for r in rows if r["kind"] in ("invalid_json", "format_mismatch")) == [7, 10]
    assert all(r.get("line") and r.get("kind") for r in rows)


def test_missing_model_folder(tmp_path, capsys):
    cfg = make_config(tmp_path, tmp_path / "no-such-model")
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "does not exist" in out and "model.name_or_path" in out
    assert not (tmp_path / "run" / "model").exists()


def test_unknown_hub_id_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_config(tmp_path, "nobody/no-such-model")
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "nobody/no-such-model" in out and "--local-dir" in out and "Traceback" not in out


def test_tokenizer_without_pad_token(tmp_path, capsys):
    nopad = build_tiny_model(tmp_path / "nopad", pad=False)
    cfg = make_config(tmp_path, nopad)
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "no pad token" in out and "model.pad_token" in out
    # the fix the message gives works
    cfg2 = make_config(tmp_path, nopad, **{"model": {"name_or_path": str(nopad), "pad_token": "<|endoftext|>"}, "training.max_steps": 5, "training.eval_steps": 5, "eval.metrics": ["loss"]})
    assert main(["run", str(cfg2), "--overwrite"]) == 0


@pytest.mark.parametrize("method", ["reward", "classification"])  # scoring heads, not LMs (dpo/orpo/kto/rl measure them: test_forgetting_pref.py)
def test_forgetting_sets_under_a_recipe_that_does_not_measure_them_are_refused_not_skipped(tmp_path, base, capsys, method):
    forget = tmp_path / "general.jsonl"
    forget.write_text("".join(json.dumps({"text": f"general text number {i}."}) + "\n" for i in range(8)))
    cfg = make_config(tmp_path, base, **{"method.name": method, "eval.forgetting": [{"path": str(forget)}]})
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "`eval.forgetting`" in out and f"`{method}`" in out and "trainpipe eval" in out and "Traceback" not in out
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "checkpoints").exists()
