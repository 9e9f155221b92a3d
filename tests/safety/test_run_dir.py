"""Issue 16, items 1-3 (issue 22: ownership is the manifest, not the marker): trainpipe deletes only a folder its manifest proves its own, never one holding the run's inputs,
and never writes or deletes outside the output folder through a stage or adapter name.

Every case goes through the real CLI (`trainpipe.cli.main`) and asserts that the victim files are still there,
byte for byte. On the trainpipe before the fix each of these deleted the victims.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import project, snapshot
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _project_folder(tmp: Path, base: Path, **overrides) -> tuple[Path, Path]:
    """A user's project: run.yaml, data/, and a script of theirs; returns (folder, config)."""
    cfg = project(tmp, base, **overrides)
    (tmp / "train.sh").write_text("#!/bin/sh\ntrainpipe run run.yaml\n")
    return tmp, cfg


def test_resume_auto_into_the_working_directory_deletes_nothing(tmp_path, base, monkeypatch, capsys):
    folder, cfg = _project_folder(tmp_path / "proj", base, output_dir=".", **{"training.resume": "auto"})
    monkeypatch.chdir(folder)
    before = snapshot(folder)
    assert main(["run", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "Nothing was" in out and str(folder) in out
    assert snapshot(folder) == before


@pytest.mark.parametrize("flags", [["--set", "training.resume=auto"], ["--overwrite"], ["--overwrite", "--set", "training.resume=auto"]])
def test_project_folder_with_config_and_data_is_never_cleared(tmp_path, base, flags, capsys):
    folder, cfg = _project_folder(tmp_path / "proj", base, output_dir=str(tmp_path / "proj"))  # the project folder itself
    before = snapshot(folder)
    assert main(["run", str(cfg), *flags]) == 2
    out = capsys.readouterr().out
    assert "Nothing was" in out and "output_dir" in out
    assert snapshot(folder) == before


def test_foreign_folder_is_not_cleared_even_with_overwrite(tmp_path, base, capsys):
    cfg = project(tmp_path / "proj", base, output_dir=str(tmp_path / "mine"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    (mine / "checkpoints").mkdir()  # looks a bit like a run, but the notes are not trainpipe's
    before = snapshot(mine)
    for flags in (["--overwrite"], ["--set", "training.resume=auto"]):
        assert main(["run", str(cfg), *flags]) == 2
        out = capsys.readouterr().out
        assert "it holds `checkpoints`, `notes.txt`, which trainpipe cannot prove it wrote" in " ".join(out.split()), out
        assert "Nothing was deleted" in out
        assert snapshot(mine) == before


@pytest.mark.parametrize("where", ["equal", "parent"])
def test_output_folder_holding_the_data_deletes_no_data(tmp_path, base, where, capsys):
    folder = tmp_path / "proj"
    folder, cfg = _project_folder(folder, base, output_dir=str(folder / "data" if where == "equal" else folder))
    before = snapshot(folder)
    assert main(["run", str(cfg), "--overwrite"]) == 2
    out = capsys.readouterr().out
    assert "data source" in out and "Nothing was" in out
    assert snapshot(folder) == before


def test_own_run_folder_with_data_put_into_it_is_not_cleared(tmp_path, base, capsys):
    """Even a folder trainpipe marked as its own is not cleared once it holds a data source of the run."""
    cfg = project(tmp_path, base)
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    assert json.loads((run / ".trainpipe-run").read_text())["run_id"]
    shutil.copy(tmp_path / "data" / "chat.jsonl", run / "chat.jsonl")
    d = yaml.safe_load(cfg.read_text())
    d["data"]["sources"][1]["path"] = str(run / "chat.jsonl")
    cfg.write_text(yaml.safe_dump(d))
    before = snapshot(run)
    assert main(["run", str(cfg), "--overwrite"]) == 2
    assert "data source" in capsys.readouterr().out
    assert snapshot(run) == before


def test_own_run_is_overwritten_and_unfinished_own_run_restarts(tmp_path, base):
    cfg = project(tmp_path, base)
    run = tmp_path / "run"
    assert main(["run", str(cfg)]) == 0
    first = json.loads((run / ".trainpipe-run").read_text())["run_id"]
    assert main(["run", str(cfg), "--overwrite"]) == 0  # ours: cleared and run again, under a new run id
    assert json.loads((run / ".trainpipe-run").read_text())["run_id"] != first
    assert not (run / ".trainpipe.lock").exists()


def test_legacy_run_folder_resumes_and_is_never_cleared(tmp_path, base, capsys):
    """A run folder of a trainpipe older than the marker and the manifest (run artefacts only) is continued by `--resume`
    and its checkpoints are used; but nothing proves it trainpipe's, so neither a resume with nothing to continue nor
    `--overwrite` clears it (issue 22: the legacy rule is gone); the refusal says to delete it by hand."""
    cfg = project(tmp_path, base)
    run = tmp_path / "run"
    assert main(["run", str(cfg)]) == 0
    (run / ".trainpipe-run").unlink()
    (run / ".trainpipe-owned.json").unlink()
    (run / "summary.json").unlink()
    shutil.rmtree(run / "model")
    shutil.rmtree(run / "checkpoints" / "step-4")
    assert main(["run", str(cfg), "--resume"]) == 0
    resumed = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if '"checkpoint_resumed"' in x]
    assert [e["step"] for e in resumed] == [2]
    assert json.loads((run / ".trainpipe-run").read_text())["accepts_unlabelled_checkpoints"] is True

    (run / ".trainpipe-run").unlink()
    (run / ".trainpipe-owned.json").unlink()
    (run / "summary.json").unlink()
    shutil.rmtree(run / "model")
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    capsys.readouterr()
    for flags in (["--set", "training.resume=auto"], ["--overwrite"]):
        assert main(["run", str(cfg), *flags]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert "older trainpipe" in out and "delete the folder by hand" in out and "`events.jsonl`" in out, out
        assert snapshot(run) == before


@pytest.mark.parametrize("name", ["../../victim", "..", "a/b", ".hidden"])
def test_stage_name_cannot_leave_the_output_folder(tmp_path, base, name, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    cfg = project(tmp_path / "proj", base, output_dir=str(tmp_path / "proj" / "runs" / "x"))
    d = yaml.safe_load(cfg.read_text())
    d["stages"] = [{"name": name, "method": {"name": "sft"}}]
    cfg.write_text(yaml.safe_dump(d))
    before = snapshot(victim)
    assert main(["run", str(cfg), "--overwrite"]) == 2
    out = capsys.readouterr().out
    assert "stages" in out and "name" in out
    assert snapshot(victim) == before


@pytest.mark.parametrize("name", ["../../victim", ".."])
def test_adapter_name_cannot_leave_the_output_folder(tmp_path, base, name, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    cfg = project(tmp_path / "proj", base, output_dir=str(tmp_path / "proj" / "runs" / "x"))
    d = yaml.safe_load(cfg.read_text())
    d["method"]["adapters"] = [{"name": name, "data": d.pop("data")}]
    cfg.write_text(yaml.safe_dump(d))
    before = snapshot(victim)
    assert main(["run", str(cfg), "--overwrite"]) == 2
    assert "name" in capsys.readouterr().out
    assert snapshot(victim) == before


def test_inside_refuses_names_that_escape(tmp_path):
    from trainpipe.errors import RunDirError
    from trainpipe.rundir import inside

    assert inside(tmp_path, "sft-2", "Stage name") == tmp_path.resolve() / "sft-2"
    for bad in ("../x", "..", "a/b", "a\\b", "", ".x", "a..b"):
        with pytest.raises(RunDirError):
            inside(tmp_path, bad, "Stage name")


def test_ownership_rules(tmp_path):
    """The manifest decides (issue 22): artefact names, a plausible layout or a marker prove nothing."""
    from trainpipe import ownership as owned
    from trainpipe.pending import tree
    from trainpipe.rundir import begin, ownership, write_marker

    def folder(name: str, files: dict) -> Path:
        root = tmp_path / name
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        root.mkdir(exist_ok=True)
        return root

    assert ownership(tmp_path / "missing") == ("empty", [])
    assert ownership(folder("only-lock", {".trainpipe.lock": "{}"})) == ("empty", [])
    assert ownership(folder("only-marker", {".trainpipe-run": '{"run_id": "0123456789abcdef"}'})) == ("empty", [])
    assert ownership(folder("legacy", {"events.jsonl": "", "checkpoints/step-2/manifest.json": "{}"})) == ("foreign", ["checkpoints", "events.jsonl"])
    assert ownership(folder("user-data", {"data/train.jsonl": "{}"})) == ("foreign", ["data"])
    forged = folder("forged", {"anything.txt": "x", ".trainpipe-run": '{"run_id": "0123456789abcdef"}'})
    assert ownership(forged) == ("foreign", ["anything.txt"])
    ours = folder("ours", {"events.jsonl": "", "checkpoints/step-2/manifest.json": "{}", "notes.txt": "x"})
    write_marker(ours)
    begin(ours)
    assert ownership(ours) == ("foreign", ["notes.txt"])  # a person's file is never sealed
    (ours / "notes.txt").unlink()
    assert ownership(ours) == ("ours", [])
    (ours / "model.tmp").mkdir()  # a run killed while it wrote: what its writer writes under a pending name is still its own
    (ours / "model.tmp" / "model.safetensors").write_bytes(b"x")
    assert ownership(ours) == ("ours", [])
    owned.expect(ours, tree(ours / "model.tmp", "model"))  # the export notes its files, then renames its folder in
    (ours / "model.tmp").rename(ours / "model")
    assert ownership(ours) == ("ours", [])
    (ours / "model" / "serve.py").write_text("mine")  # ... and nothing else is (issue 36)
    assert ownership(ours) == ("foreign", ["model/serve.py"])
    (ours / "model" / "serve.py").unlink()
    prepared = folder("prepared", {"data/report.json": "{}"})
    assert ownership(prepared) == ("foreign", ["data"])
    owned.record(prepared / "data")
    assert ownership(prepared) == ("prepared", [])
