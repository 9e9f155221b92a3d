"""A full disk during a checkpoint or an export (issue 16, item 7).

Today's main ended in a traceback and left `model.tmp/` (and `.tmp-step-N/`) behind: torch.save
reports a full disk as a RuntimeError and safetensors as a SafetensorError, neither an OSError.
Now: a checkpoint that does not fit is `checkpoint_failed` (then continue or stop as configured),
an export that does not fit is one paragraph with exit code 74, and no temporary is left.

The disk is really full where the test can mount a small tmpfs (root on Linux, as in CI); where it
cannot, those tests skip and the TEST-ONLY injected ENOSPC (trainpipe.faults) still runs.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_export_out import snapshot, tiny_config
from tiny import build_tiny_model
from trainpipe.cli import main
from trainpipe.model.checkpoints import CheckpointManager, CheckpointWriteError, verify

pytestmark = pytest.mark.e2e


@pytest.fixture
def tmpfs(tmp_path):
    """``make(size)``: a fresh folder with a tmpfs of ``size`` (e.g. "512k") mounted on it, unmounted after the test."""
    mounted = []

    def make(size: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root and mount(8); the injected-ENOSPC tests cover this path")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected-ENOSPC tests cover this path")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("diskfull") / "base")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("diskfull-run")
    assert main(["run", str(tiny_config(tmp, base))]) == 0
    return tmp / "run"


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def leftovers(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp-", ".model.old"))]


def with_faults(monkeypatch, spec: dict, args: list[str]) -> int:
    """The CLI in this process with the TEST-ONLY fault spec set (and cleared after)."""
    from trainpipe import faults

    monkeypatch.setenv("TRAINPIPE_TEST_FAULTS", json.dumps(spec))
    faults._spec_cached.cache_clear()
    faults._fired.clear()
    try:
        return main(args)
    finally:
        monkeypatch.delenv("TRAINPIPE_TEST_FAULTS")
        faults._spec_cached.cache_clear()


def one_paragraph(out: str) -> str:
    assert "Traceback" not in out, out
    line = next(x for x in out.splitlines() if x.startswith("export failed:"))
    return " ".join(out[out.index(line):].split())


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("what_fails", ["state.pt (torch.save)", "weights.safetensors (safetensors)"])
def test_checkpoint_that_does_not_fit_real_tmpfs(tmpfs, what_fails):
    import torch

    disk = tmpfs("512k")
    ck = CheckpointManager(disk / "checkpoints")
    small = {"w": torch.zeros(4096)}
    first = ck.save(1, weights=small, state={"opt": torch.zeros(4096)}, config_yaml="a: 1\n", metric=1.0, info={})
    big = torch.zeros(200_000)  # 800 kB: more than the disk holds
    weights, state = (small, {"opt": big}) if what_fails.startswith("state") else ({"w": big}, {"opt": torch.zeros(4096)})
    with pytest.raises(CheckpointWriteError) as exc:
        ck.save(2, weights=weights, state=state, config_yaml="a: 1\n", metric=0.5, info={})
    assert exc.value.errno == 28 and "No space left on device" in str(exc.value)
    assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step-1"]  # no .tmp-step-2-PID
    assert verify(first.path) is None and ck.latest_valid().step == 1


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_run_whose_checkpoint_does_not_fit_real_tmpfs(tmpfs, tmp_path, base, capsys, policy):
    """Full fine-tuning: step-0 takes ~0.4 MB (no optimizer state yet), step-2 ~1.2 MB (weights 0.39 MB + state 0.81 MB);
    on a 2.3 MB disk step-4's weights fit and its state does not, and the final export (0.41 MB) fits again."""
    disk = tmpfs("2300k")
    cfg = tiny_config(tmp_path, base, on_checkpoint_error=policy)
    cfg.write_text(cfg.read_text().replace("peft: lora", "peft: none").replace(str(tmp_path / "run"), str(disk / "run")))
    rc = main(["run", str(cfg)])
    out = capsys.readouterr().out
    assert "Traceback" not in out
    run = disk / "run"
    ev = events(run)
    failed = [e for e in ev if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [4] and "No space left on device" in failed[0]["cause"], failed
    saved = [e["step"] for e in ev if e["event"] == "checkpoint_saved"]
    assert 2 in saved and 4 not in saved
    assert leftovers(run) == []
    ck = CheckpointManager(run / "checkpoints")
    assert [c.step for c in ck.all()] == saved and all(verify(c.path) is None for c in ck.all())
    if policy == "stop":
        assert rc == 1 and "checkpoint failed:" in out and "earlier checkpoints are intact" in out
        assert ev[-1]["event"] == "run_failed"
    else:
        assert rc == 0 and (run / "model" / "model.safetensors").is_file() and ev[-1]["event"] == "run_finished"


# --------------------------------------------------------------------------- exports


def test_run_whose_export_does_not_fit_real_tmpfs(tmpfs, tmp_path, base, capsys):
    """LoRA: the run's files and checkpoints take ~0.45 MB, the merged export ~0.48 MB; the disk holds 0.7 MB."""
    disk = tmpfs("740k")
    cfg = tiny_config(tmp_path, base)
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "run"), str(disk / "run")))
    rc = main(["run", str(cfg)])
    text = one_paragraph(capsys.readouterr().out)
    run = disk / "run"
    assert rc == 74
    assert "No space left on device" in text and str(run / "model") in text and "Free space" in text
    assert not (run / "model.tmp").exists() and not (run / "model").exists() and leftovers(run) == []
    ev = events(run)
    assert ev[-1]["event"] == "run_failed" and ev[-1]["error"] == "ExportWriteError"
    assert [c.step for c in CheckpointManager(run / "checkpoints").all()] == [2, 4]
    assert all(verify(c.path) is None for c in CheckpointManager(run / "checkpoints").all())


def test_export_that_does_not_fit_keeps_the_earlier_export_real_tmpfs(tmpfs, trained, capsys):
    """The first export (~0.48 MB) fits on a 0.7 MB disk; a second one beside it does not."""
    disk = tmpfs("700k")
    dest = disk / "model"
    assert main(["export", str(trained), "--out", str(dest)]) == 0
    before = snapshot(dest)
    capsys.readouterr()
    assert main(["export", str(trained), "--out", str(dest)]) == 74
    text = one_paragraph(capsys.readouterr().out)
    assert "No space left on device" in text and str(dest) in text and "still holds the earlier export" in text
    assert snapshot(dest) == before and sorted(p.name for p in disk.iterdir()) == [".trainpipe-owned.json", "model"]
    assert all(verify(c.path) is None for c in CheckpointManager(trained / "checkpoints").all())


def test_run_export_injected_enospc(tmp_path, base, monkeypatch, capsys):
    """TEST-ONLY injected OSError(ENOSPC) after the export's files are written, before the rename (any machine)."""
    cfg = tiny_config(tmp_path, base)
    rc = with_faults(monkeypatch, {"export_error": True}, ["run", str(cfg)])
    text = one_paragraph(capsys.readouterr().out)
    run = tmp_path / "run"
    assert rc == 74 and "No space left on device" in text and "checkpoints" in text
    assert not (run / "model.tmp").exists() and not (run / "model").exists() and leftovers(run) == []
    ev = events(run)
    assert ev[-1]["event"] == "run_failed" and ev[-1]["error"] == "ExportWriteError"
    assert all(verify(c.path) is None for c in CheckpointManager(run / "checkpoints").all())


def test_export_injected_enospc_keeps_the_earlier_export(trained, monkeypatch, capsys):
    """TEST-ONLY injected OSError(ENOSPC) in `trainpipe export`: RUN/model stays as it was."""
    before = snapshot(trained / "model")
    assert with_faults(monkeypatch, {"export_error": True}, ["export", str(trained)]) == 74
    text = one_paragraph(capsys.readouterr().out)
    assert "still holds the earlier export" in text and f"trainpipe export {trained}" in text
    assert snapshot(trained / "model") == before and leftovers(trained) == []


# --------------------------------------------------------------------------- small writers


def test_write_json_on_a_full_disk_leaves_the_old_file_and_no_tmp_real_tmpfs(tmpfs):
    from trainpipe.track.manifest import write_json

    disk = tmpfs("64k")
    target = disk / "summary.json"
    write_json(target, {"step": 1})
    before = target.read_bytes()
    with pytest.raises(OSError) as exc:
        write_json(target, {"big": "x" * 200_000})
    assert exc.value.errno == 28
    # the file as it was, no temporary; `.trainpipe-owned.json` is the ownership manifest that recorded the first write (issue 22)
    assert target.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == [".trainpipe-owned.json", "summary.json"]


def test_data_cache_entry_on_a_full_disk_leaves_no_tmp_real_tmpfs(tmpfs):
    from trainpipe.data.cache import Writer

    disk = tmpfs("64k")
    w = Writer(disk / "cache", "k" * 16)
    with pytest.raises(OSError) as exc:
        w.write_rows("train.arrow", [{"input_ids": list(range(512))} for _ in range(64)])
        w.commit()
    w.abort()  # what data/prepare.py does on any failure
    assert "No space left" in str(exc.value) or getattr(exc.value, "errno", None) == 28
    assert list((disk / "cache").iterdir()) == []


def test_run_whose_data_cache_does_not_fit_is_one_paragraph_exit_74_real_tmpfs(tmpfs, tmp_path, base, monkeypatch, capsys):
    """A disk that fills while the data step writes its cache (not a checkpoint, not an export): no traceback, exit 74,
    the cache holds no partial entry and the run folder says `run_failed`."""
    disk = tmpfs("8k")  # two pages: the cache's first Arrow file does not fit
    monkeypatch.setenv("TRAINPIPE_CACHE", str(disk))
    cfg = tiny_config(tmp_path, base)
    rc = main(["run", str(cfg)])
    out = capsys.readouterr().out
    assert rc == 74, out
    assert "Traceback" not in out
    text = " ".join(out[out.index("write failed:"):].split())
    assert "No space left on device" in text and "--resume" in text, text
    from trainpipe import ownership

    entries = [e for e in (disk / "data").iterdir() if not ownership.internal(e.name)] if (disk / "data").exists() else []
    assert [e.name for e in entries if ".tmp-" in e.name] == [] and all((e / "COMPLETE").is_file() for e in entries)
    assert events(tmp_path / "run")[-1]["event"] == "run_failed"


def test_a_log_line_that_does_not_fit_leaves_no_torn_line_real_tmpfs(tmpfs):
    """events.jsonl / metrics.jsonl are appended a whole line or not at all: a full disk cuts the file back (issue 36:
    a ZeRO run's events.jsonl ended in half a line when its disk filled)."""
    from trainpipe.events import append_line, read_events

    disk = tmpfs("64k")
    log = disk / "events.jsonl"
    append_line(log, json.dumps({"event": "run_started"}))
    before = log.read_bytes()
    with pytest.raises(OSError) as exc:
        append_line(log, json.dumps({"event": "eval_done", "blob": "x" * 200_000}), sync=True)
    assert exc.value.errno == 28
    assert log.read_bytes() == before and read_events(log) == [{"event": "run_started"}]
