"""Issue 22: a marker is no proof of ownership. trainpipe clears a run folder only when its manifest
(`.trainpipe-owned.json`, src/trainpipe/ownership.py) proves every entry trainpipe's.

The first part tests ownership.py itself (no model); the second goes through the real CLI (`trainpipe.cli.main`, or a
child process where a run is killed) with the tiny project of tests/safety/conftest.py, and checks the victims byte for
byte. On the trainpipe before issue 22 each refusal below deleted the victims, and `data prepare` then `run` asked for
`--overwrite`.
"""

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from conftest import cli, project, snapshot
from trainpipe import ownership, pending
from trainpipe.cli import main


# ----------------------------------------------------------------------------- ownership.py on its own
def _owned(folder: Path) -> Path:
    """A folder trainpipe made: two files and a sub-folder, sealed."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("a: 1\n")
    (folder / "events.jsonl").write_text('{"event": "run_started"}\n')
    (folder / "model").mkdir()
    (folder / "model" / "weights.bin").write_bytes(b"\x00" * 64)
    ownership.seal(folder, lambda p: True)
    return folder


def test_a_sealed_folder_is_ours_and_a_foreign_entry_is_named(tmp_path):
    folder = _owned(tmp_path / "out")
    assert ownership.foreign(folder) == []
    (folder / "notes.md").write_text("mine")
    (folder / "model" / "serve.py").write_text("print('mine')")
    assert ownership.foreign(folder) == ["model/serve.py", "notes.md"]
    with pytest.raises(ownership.OwnershipError, match="notes.md"):
        ownership.clear_dir(folder, what="a test folder")
    assert (folder / "notes.md").read_text() == "mine" and (folder / "config.yaml").is_file()


def test_a_changed_file_is_not_ours_an_appended_jsonl_still_is(tmp_path):
    folder = _owned(tmp_path / "out")
    with open(folder / "events.jsonl", "a") as fh:
        fh.write('{"event": "run_finished"}\n')
    assert ownership.foreign(folder) == []  # a log that only grew
    (folder / "events.jsonl").write_text('{"event": "edited"}\n' * 3)
    (folder / "config.yaml").write_text("a: 2\n")
    assert ownership.foreign(folder) == ["config.yaml", "events.jsonl"]
    time.sleep(0.01)
    data = bytearray((folder / "model" / "weights.bin").read_bytes())
    data[0] ^= 0xFF
    (folder / "model" / "weights.bin").write_bytes(bytes(data))  # same size, other bytes
    assert "model/weights.bin" in ownership.foreign(folder)


def test_a_copied_or_moved_manifest_proves_nothing(tmp_path):
    folder = _owned(tmp_path / "out")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert sorted(ownership.foreign(copy)) == ["config.yaml", "events.jsonl", "model"]
    moved = tmp_path / "moved"
    folder.rename(moved)
    assert ownership.foreign(moved) != []
    with pytest.raises(ownership.OwnershipError):
        ownership.clear_dir(moved, what="a moved folder")
    assert (moved / "config.yaml").is_file()


def test_pending_entries_accept_only_what_their_writer_could_leave(tmp_path):
    """Issue 36: a pending name is no licence; what lies under it must be its writer's (temporary names, the declared shape:
    checkpoint files their own manifest lists), and anything else is named."""
    import hashlib

    from trainpipe.pending import RUN_SHAPES

    folder = _owned(tmp_path / "out")
    ownership.intend(folder, "checkpoints", shapes=RUN_SHAPES)  # a new folder, registered before the first write into it
    step2 = folder / "checkpoints" / "step-2"
    step2.mkdir(parents=True)
    (step2 / "w").write_bytes(b"2")
    (step2 / "manifest.json").write_text(json.dumps({"files": {"w": {"size": 1, "sha256": hashlib.sha256(b"2").hexdigest()}}}))
    assert ownership.foreign(folder) == []
    (step2 / "NOTES.md").write_text("mine")
    assert ownership.foreign(folder) == ["checkpoints/step-2/NOTES.md"]
    (step2 / "NOTES.md").unlink()
    ownership.seal(folder)  # fingerprinted: its pending mark is gone
    assert ownership.read_manifest(folder)["pending"] == []
    ownership.intend(folder, "checkpoints/.tmp-step-4-123")
    (folder / "checkpoints" / ".tmp-step-4-123").mkdir()
    (folder / "checkpoints" / ".tmp-step-4-123" / "half").write_bytes(b"x")  # killed mid-write
    assert ownership.foreign(folder) == []
    (folder / "checkpoints" / "step-2" / "w").write_bytes(b"changed")
    (folder / "notes.md").write_text("mine")
    assert ownership.foreign(folder) == ["checkpoints/step-2/w", "notes.md"]


def test_foreign_files_under_pending_names_are_named(tmp_path):
    from trainpipe.pending import RUN_SHAPES

    folder = tmp_path / "run"
    ownership.make_dir(folder, what="a run folder")
    ownership.intend(folder, ["model", "export", "tensorboard", "review.json", "events.jsonl", "summary.json"], shapes=RUN_SHAPES)
    build = folder / ".model.build"  # the export writer (export.py export_folder) builds beside, notes its files, renames in
    (build / "adapter").mkdir(parents=True)
    (build / "model.safetensors").write_bytes(b"w")
    (build / "config.json").write_text("{}")
    (build / "adapter" / "adapter_model.safetensors").write_bytes(b"a")  # an export's adapter/ folder
    ownership.expect(folder, pending.tree(build, "model"))
    build.rename(folder / "model")  # killed right after: the noted files are the writer's
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"tb")
    (folder / "events.jsonl").write_text('{"event": "run_started"}\n{"event": "ste')  # a line cut by the kill
    ownership.write_text(folder / "summary.json", "{}", what="a summary")  # renamed in, recorded
    assert ownership.foreign(folder) == []
    (folder / "model" / "serve.py").write_text("mine")
    (folder / "model" / "extra.json").write_text("{}")  # a name save_pretrained could write: only the noted files are proven
    (folder / "export" / "prod").mkdir(parents=True)
    (folder / "export" / "prod" / "deploy.sh").write_text("mine")
    (folder / "tensorboard" / "mine.tfevents").write_text("mine")
    (folder / "review.json").write_text("{}")
    assert ownership.foreign(folder) == ["export/prod/deploy.sh", "model/extra.json", "model/serve.py", "review.json", "tensorboard/mine.tfevents"]
    with pytest.raises(ownership.OwnershipError, match="serve.py"):
        ownership.clear_dir(folder, what="a run folder")
    assert (folder / "model" / "serve.py").read_text() == "mine" and (folder / "review.json").is_file()


def test_an_edit_whose_mtime_is_put_back_is_seen(tmp_path):
    import os

    folder = _owned(tmp_path / "out")
    p = folder / "config.yaml"
    st = p.stat()
    time.sleep(0.01)
    p.write_text("a: 9\n")  # same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the modification time put back
    assert p.stat().st_mtime_ns == st.st_mtime_ns and p.stat().st_size == st.st_size
    assert ownership.foreign(folder) == ["config.yaml"]


def test_replace_dir_keeps_dest_when_the_build_fails_and_refuses_a_foreign_dest(tmp_path):
    dest = tmp_path / "export"

    def build(t: Path) -> None:
        (t / "model.bin").write_bytes(b"new")

    ownership.replace_dir(dest, build, what="a test export")
    assert (dest / "model.bin").read_bytes() == b"new" and ownership.foreign(dest) == []

    def fails(t: Path) -> None:
        (t / "model.bin").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        ownership.replace_dir(dest, fails, what="a test export")
    assert (dest / "model.bin").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")] == []
    (dest / "serve.py").write_text("mine")
    with pytest.raises(ownership.OwnershipError, match="serve.py"):
        ownership.replace_dir(dest, build, what="a test export")
    assert (dest / "serve.py").read_text() == "mine" and (dest / "model.bin").read_bytes() == b"new"


def test_a_write_over_an_input_or_a_foreign_file_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    for target in (data / "train.jsonl", data / "new.json"):
        with pytest.raises(ownership.OwnershipError, match="reads"):
            ownership.write_text(target, "x", what="a report", reads=[(data, "the data")])
    assert (data / "train.jsonl").read_text() == "{}\n" and not (data / "new.json").exists()
    mine = tmp_path / "out.json"
    mine.write_text("mine")
    with pytest.raises(ownership.OwnershipError, match="did not write"):
        ownership.write_text(mine, "x", what="a report")
    ours = ownership.write_text(tmp_path / "report.json", "1", what="a report")
    ownership.write_text(ours, "2", what="a report")  # its own unchanged file: replaced
    assert ours.read_text() == "2" and mine.read_text() == "mine"


# ----------------------------------------------------------------------------- the run folder, through the CLI
def _finished_run(tmp_path: Path, base: Path) -> tuple[Path, Path]:
    cfg = project(tmp_path, base)
    assert main(["run", str(cfg)]) == 0
    return cfg, tmp_path / "run"


@pytest.mark.e2e
@pytest.mark.parametrize("marker", ["copied", "hand-written"])
def test_a_forged_marker_proves_nothing(tmp_path, base, marker, capsys):
    cfg = project(tmp_path / "proj", base, output_dir=str(tmp_path / "mine"))
    mine = tmp_path / "mine"
    (mine / "thesis").mkdir(parents=True)
    (mine / "thesis" / "main.tex").write_text("years of work\n")
    (mine / "events.jsonl").write_text("my own log\n")
    if marker == "copied":
        _, run = _finished_run(tmp_path / "other", base)
        shutil.copy(run / ".trainpipe-run", mine / ".trainpipe-run")
        if (run / ".trainpipe-owned.json").exists():  # even its manifest: recorded for another path, it proves nothing here
            shutil.copy(run / ".trainpipe-owned.json", mine / ".trainpipe-owned.json")
    else:
        (mine / ".trainpipe-run").write_text('{"run_id": "0123456789abcdef"}\n')
    before = snapshot(mine)
    capsys.readouterr()
    for flags in (["--overwrite"], ["--set", "training.resume=auto"]):
        assert main(["run", str(cfg), *flags]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert "`thesis`" in out and "Nothing was deleted" in out and "Traceback" not in out, out
        assert snapshot(mine) == before


@pytest.mark.e2e
def test_users_files_in_a_finished_run_stop_overwrite(tmp_path, base, capsys):
    cfg, run = _finished_run(tmp_path, base)
    (run / "notes.md").write_text("what I learned\n")
    (run / "analysis").mkdir()
    (run / "analysis" / "plot.py").write_text("import matplotlib\n")
    before = snapshot(run)
    capsys.readouterr()
    assert main(["run", str(cfg), "--overwrite"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`analysis`" in out and "`notes.md`" in out and "Nothing was deleted" in out, out
    assert snapshot(run) == before
    # a changed file of the run is no longer provably trainpipe's either
    (run / "notes.md").unlink()
    shutil.rmtree(run / "analysis")
    (run / "summary.json").write_text('{"final": "edited by hand"}\n')
    assert main(["run", str(cfg), "--overwrite"]) == 2
    assert "`summary.json`" in " ".join(capsys.readouterr().out.split())
    assert (run / "summary.json").read_text() == '{"final": "edited by hand"}\n'


@pytest.mark.e2e
def test_every_checkpoint_damaged_and_resume_auto_deletes_nothing(tmp_path, base, capsys):
    cfg, run = _finished_run(tmp_path, base)
    (run / "summary.json").unlink()  # an unfinished run, as a killed job leaves it
    shutil.rmtree(run / "model")
    for ck in (run / "checkpoints").glob("step-*"):
        f = ck / "weights.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["run", str(cfg), "--set", "training.resume=auto"]) == 2  # what the emitted sbatch script runs
    out = " ".join(capsys.readouterr().out.split())
    assert "fails its check" in out or "fail their check" in out, out
    assert "Nothing was deleted" in out and "Traceback" not in out
    assert snapshot(run) == before


@pytest.mark.e2e
def test_data_prepare_then_run_needs_no_overwrite(tmp_path, base, capsys):
    cfg = project(tmp_path, base)
    run = tmp_path / "run"
    assert main(["data", "prepare", str(cfg)]) == 0
    assert (run / "data" / "report.json").is_file()
    assert main(["run", str(cfg)]) == 0, capsys.readouterr().out
    assert (run / "summary.json").is_file() and (run / "data" / "report.json").is_file()
    assert main(["run", str(cfg), "--overwrite"]) == 0  # the run with the prepare's outputs is trainpipe's own, whole
    assert ownership.foreign(run) == []


@pytest.mark.e2e
def test_a_run_killed_mid_training_is_overwritten(tmp_path, base):
    cfg = project(tmp_path, base, **{"training.max_steps": 400, "training.save_steps": 2, "training.eval_steps": 200})
    run = tmp_path / "run"
    p = cli(["run", str(cfg)])
    deadline = time.time() + 180
    while p.poll() is None and time.time() < deadline and not list((run / "checkpoints").glob("step-*")):
        time.sleep(0.05)
    time.sleep(0.3)
    assert p.poll() is None, p.stdout.read()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (run / "summary.json").exists() and json.loads((run / ".trainpipe-run").read_text())["run_id"]
    q = cli(["run", str(cfg), "--overwrite", "--set", "training.max_steps=2", "--set", "training.eval_steps=2"])
    out, _ = q.communicate(timeout=300)
    assert q.returncode == 0, out[-3000:]
    assert (run / "summary.json").is_file() and ownership.foreign(run) == []


def test_a_checkpoint_killed_between_its_rename_and_its_seal_stays_provably_ours(tmp_path, monkeypatch):
    """A kill after `.tmp-step-N` became `step-N` and before the run's manifest fingerprinted it (seen in CI: the next
    `--overwrite` refused every file of `checkpoints/step-20`): `step-N` was registered with the temporary name, so its
    files are proven by its own manifest; a file a person adds there is still named."""
    import torch

    from trainpipe.model.checkpoints import CheckpointManager

    folder = _owned(tmp_path / "run")
    ckpts = CheckpointManager(folder / "checkpoints")
    ckpts.save(2, weights={"w": torch.ones(2)}, state={"step": 2}, config_yaml="a: 1\n", metric=None, info={})
    assert ownership.foreign(folder) == [] and ownership.read_manifest(folder)["pending"] == []

    def killed() -> None:
        raise KeyboardInterrupt("killed before the seal")

    monkeypatch.setattr(ckpts, "_seal", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpts.save(4, weights={"w": torch.zeros(2)}, state={"step": 4}, config_yaml="a: 1\n", metric=None, info={})
    assert (folder / "checkpoints" / "step-4" / "manifest.json").is_file()
    assert ownership.foreign(folder) == []
    (folder / "checkpoints" / "step-4" / "NOTES.md").write_text("mine")
    assert ownership.foreign(folder) == ["checkpoints/step-4/NOTES.md"]
    (folder / "checkpoints" / "step-4" / "NOTES.md").unlink()
    ownership.clear_dir(folder, what="a run folder")
    assert not (folder / "checkpoints").exists()
