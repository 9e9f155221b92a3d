"""Issue 16, item 10: `--resume` after a data file changed is refused with both hashes, before anything is trained or
rewritten (before the fix it trained on the new data, compared the old baseline with a new eval split and overwrote the
manifest's data hash)."""

import json
import shutil

import pytest

from conftest import project, snapshot
from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def test_resume_after_the_data_changed_is_refused_with_both_hashes(tmp_path, base, capsys):
    cfg = project(tmp_path, base)
    run = tmp_path / "run"
    assert main(["run", str(cfg)]) == 0
    for p in (run / "summary.json", run / "model", run / "checkpoints" / "step-4"):  # as a kill after step 2's save leaves it
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    old_sha = json.loads((run / "manifest.json").read_text())["data_files"][0]["sha256"]
    write_jsonl(tmp_path / "data" / "alpaca.jsonl", alpaca_records(120, seed=99))  # the data changed
    before = snapshot(run)
    capsys.readouterr()
    for flags in (["--resume"], ["--set", "training.resume=auto"]):
        assert main(["run", str(cfg), *flags]) == 2
        out = capsys.readouterr().out
        from trainpipe.hashing import file_sha256

        new_sha = file_sha256(tmp_path / "data" / "alpaca.jsonl")
        assert old_sha in out and new_sha in out and old_sha != new_sha
        assert "data.sources[0]" in out and "--overwrite" in out
        assert snapshot(run) == before  # manifest, events, checkpoints: nothing rewritten


def test_resume_with_the_same_data_continues(tmp_path, base):
    cfg = project(tmp_path, base)
    run = tmp_path / "run"
    assert main(["run", str(cfg)]) == 0
    for p in (run / "summary.json", run / "model", run / "checkpoints" / "step-4"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert main(["run", str(cfg), "--resume"]) == 0
    resumed = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if '"checkpoint_resumed"' in x]
    assert [e["step"] for e in resumed] == [2]
