"""Issue 16, item 5: one run per output folder, and a run's best checkpoint is one of its own.

Before the fix two runs into the same folder both exited 0 and the second exported the first one's checkpoint as its
best. Now the folder is locked (`.trainpipe.lock`: pid, host, start time), a second run is refused naming the holder,
a lock whose process is dead is taken over, and checkpoint selection only sees checkpoints carrying the run's id.
"""

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import cli, project, snapshot
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _lock(folder, pid: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".trainpipe.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": time.time(), "token": "x"}))


def test_second_run_into_a_running_runs_folder_is_refused(tmp_path, base, capsys):
    """A real first run (a child process) holds the folder; a second run into it, even with `resume: auto` or
    `--overwrite`, is refused, naming the first run's pid; the first run finishes unharmed."""
    cfg = project(tmp_path, base, **{"training.max_steps": 24, "training.eval_steps": 8, "training.save_steps": 8})
    run = tmp_path / "run"
    first = cli(["run", str(cfg)])
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints").is_dir() and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.stdout.read()
        for flags in (["--set", "training.resume=auto"], ["--overwrite"]):
            assert main(["run", str(cfg), *flags]) == 2
            out = capsys.readouterr().out
            assert f"pid {first.pid}" in out and "in use by another trainpipe run" in out and "Nothing was" in out
        assert first.wait(timeout=600) == 0, first.stdout.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train"]["global_step"] == 24
    assert not (run / ".trainpipe.lock").exists()


def test_live_lock_is_respected_and_the_folder_untouched(tmp_path, base, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        cfg = project(tmp_path, base)
        run = tmp_path / "run"
        _lock(run, holder.pid)
        (run / "events.jsonl").write_text("")
        before = snapshot(run)
        assert main(["run", str(cfg), "--overwrite"]) == 2
        out = capsys.readouterr().out
        assert f"pid {holder.pid}" in out and ".trainpipe.lock" in out
        assert snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, base):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cfg = project(tmp_path, base, **{"training.max_steps": 2})
    run = tmp_path / "run"
    _lock(run, dead.pid)
    assert main(["run", str(cfg)]) == 0
    assert (run / "summary.json").is_file() and not (run / ".trainpipe.lock").exists()


def test_lock_is_released_when_the_run_fails(tmp_path, base):
    cfg = project(tmp_path, base, **{"training.max_steps": 2})
    assert main(["run", str(cfg), "--resume"]) == 2  # nothing to resume: refused
    assert not (tmp_path / "run").exists()  # the folder the lock made is gone again
    assert main(["run", str(cfg)]) == 0


def test_best_and_latest_only_among_the_runs_own_checkpoints(tmp_path, base):
    """A checkpoint of another run dropped into `checkpoints/` (better metric, newer step) is neither the best, nor the
    newest to resume from, nor deleted by rotation, nor exported."""
    from safetensors.torch import load_file

    from trainpipe.model.checkpoints import CheckpointManager

    a_cfg = project(tmp_path / "a", base)
    b_cfg = project(tmp_path / "b", base, **{"training.learning_rate": 1e-2, "training.seed": 7})
    assert main(["run", str(a_cfg)]) == 0
    assert main(["run", str(b_cfg)]) == 0
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    own_best = CheckpointManager(a / "checkpoints").best()
    foreign = a / "checkpoints" / "step-999"
    shutil.copytree(CheckpointManager(b / "checkpoints").best().path, foreign)
    man = json.loads((foreign / "manifest.json").read_text())
    man["metric"] = 0.0  # the best possible eval loss
    (foreign / "manifest.json").write_text(json.dumps(man))

    ck = CheckpointManager(a / "checkpoints", keep_last=1, keep_best=1)
    assert ck.best().path == own_best.path
    assert ck.latest_valid().step != 999
    ck.rotate()
    assert foreign.is_dir()

    shutil.rmtree(a / "model")
    assert main(["export", str(a)]) == 0

    def tensors(path) -> list[bytes]:  # the weights by value (PEFT's file and the checkpoint name the keys differently)
        return sorted(t.float().contiguous().numpy().tobytes() for t in load_file(str(path)).values())

    exported = tensors(a / "model" / "adapter" / "adapter_model.safetensors")
    assert exported == tensors(own_best.path / "weights.safetensors")
    assert exported != tensors(foreign / "weights.safetensors")
