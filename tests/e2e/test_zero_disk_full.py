"""A real 2-process DeepSpeed ZeRO run whose output folder's disk fills during training (issue 36).

The run folder is on a small real tmpfs (root and mount(8), as in CI; skipped elsewhere). After the step-2 checkpoint,
another writer takes every free byte of that disk (what happens on a shared scratch disk): the next checkpoints fail
(`checkpoint_failed`, policy continue), then rank 0's next log line cannot be written. The run must end with exit 74
and one paragraph naming the file and the disk's folder and the fix; no library traceback and no launcher noise on the
console of either rank (before: rank 1 waited for a hang verdict that never came until the elastic agent killed it
"forcefully via 9" 30 s later, and DeepSpeed's collectives printed a FutureWarning each step); nothing of the user's
lost (a file beside the run, the other writer's file, the checkpoints saved before the disk filled, which verify).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_distributed import base, events, finish, launch, sft_config, wait_for  # noqa: F401 - `base` is a fixture
from trainpipe.model.checkpoints import CheckpointManager, verify

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> int:
    """Another writer takes every free byte of the disk; the bytes it wrote."""
    with open(disk / "someone-else.bin", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    return (disk / "someone-else.bin").stat().st_size


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_run_on_a_disk_that_fills_exits_74_with_one_paragraph(tmp_path, base, small_disk, stage):  # noqa: F811
    run = small_disk / "run"
    notes = small_disk / "NOTES.md"
    notes.write_text("the user's notes beside the run\n")
    cfg = sft_config(tmp_path, base, **{"training.max_steps": 400, "training.save_steps": 2, "training.eval_steps": 2, "method.peft": "none",
                                        "training.learning_rate": 1e-3, "distributed.strategy": stage, "output_dir": str(run)})
    p = launch(cfg, faults={"step_seconds": 0.3})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 2 for e in events(run)), p, timeout=300)
    filled = fill(small_disk)
    rc, out = finish(p)
    flat = " ".join(out.split())
    assert rc == 74, out[-4000:]
    for noise in ("Traceback", "Error:", "FutureWarning", "forcefully", "closing signal", "exitcode", "ChildFailedError", "another rank left"):
        assert noise not in out, f"{noise!r} on the console:\n{out[-4000:]}"
    assert out.count("write failed:") == 1, out[-4000:]
    para = flat[flat.index("write failed:"):]
    assert "No space left on device" in para and f"writing `{run}/" in para and f"Free space on the disk that holds `{run}`" in para, para
    assert "--resume" in para, para
    assert notes.read_text() == "the user's notes beside the run\n" and (small_disk / "someone-else.bin").stat().st_size == filled
    saved = [c for c in CheckpointManager(run / "checkpoints").all()]
    assert saved and all(verify(c.path) is None for c in saved)
    assert any(e["event"] == "checkpoint_failed" and "No space left on device" in e["cause"] for e in events(run)), events(run)[-5:]
