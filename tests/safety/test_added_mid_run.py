"""A file a person adds under a run folder while the run is going is not sealed as the run's (issue 36).

A real tiny run waits twice on a TEST-ONLY handshake (trainpipe/faults.py): in window 3 (after checkpoint step-2, before
step-4), when the test puts a note into `checkpoints/step-2/`; and just before its last seal (every writer finished,
report.html written), when it puts files into `model/` and `export/prod/` (two of them named as `save_pretrained`'s). The run's manifest must not list them, step-4's
rotation must delete step-2's own files and leave the note, and `--overwrite` must refuse naming each (exit 2, nothing
deleted).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import cli, project, snapshot
from trainpipe import ownership

pytestmark = pytest.mark.e2e

NOTE = "checkpoints/step-2/NOTES.md"
# `notes.txt` and `config.json` have names `save_pretrained` writes: the name proves nothing, only the export's own list does
MINE = {NOTE: "step 2 ok\n", "model/serve.py": "print('serve')\n", "model/notes.txt": "mine\n", "export/prod/deploy.sh": "kubectl apply\n",
        "export/prod/config.json": "{}\n"}


def _put(run, rels):
    for rel in rels:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(MINE[rel])


def _wait_for(p, path):
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline and not path.exists():
        time.sleep(0.05)
    assert p.poll() is None and path.exists(), p.stdout.read()[-3000:]


def test_files_added_during_a_run_stay_foreign(tmp_path, base):
    # 6 steps, a checkpoint every 2, only the newest kept: step-4's save rotates step-2 away while the person's note is in it
    cfg = project(tmp_path, base, **{"training.max_steps": 6, "training.eval_steps": 200, "training.save_total_limit": 1})
    run, go1, go2 = tmp_path / "run", tmp_path / "go1", tmp_path / "go2"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "TRAINPIPE_TEST_FAULTS": json.dumps({
        "sleep_at_window": {"window": 3, "go": str(go1), "seconds": 300}, "pause_before_seal": {"go": str(go2), "seconds": 300}})}
    p = subprocess.Popen([sys.executable, "-m", "trainpipe.cli", "run", str(cfg)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    _wait_for(p, run / "checkpoints" / "step-2" / "manifest.json")  # the run waits in window 3, after step-2, before step-4
    _put(run, [NOTE])
    go1.write_text("go")
    _wait_for(p, run / "report.html")  # the run waits before its last seal: every writer has finished
    _put(run, [rel for rel in MINE if rel != NOTE])
    go2.write_text("go")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]

    assert not (run / "checkpoints" / "step-2" / "weights.safetensors").exists()  # rotated away: its own files only
    assert (run / "checkpoints" / "step-6" / "weights.safetensors").is_file()
    entries = ownership.read_manifest(run)["entries"]
    assert "config.json" in entries["model"]["files"] and not {"serve.py", "notes.txt"} & set(entries["model"]["files"])
    assert "step-6/weights.safetensors" in entries["checkpoints"]["files"] and "step-2/NOTES.md" not in entries["checkpoints"]["files"]
    assert not {"prod/deploy.sh", "prod/config.json"} & set(entries.get("export", {}).get("files", {}))
    assert sorted(ownership.foreign(run)) == sorted(MINE)
    for rel, text in MINE.items():
        assert (run / rel).read_text() == text, rel

    before = snapshot(run)
    q = cli(["run", str(cfg), "--overwrite"])
    out, _ = q.communicate(timeout=300)
    flat = " ".join(out.split())
    assert q.returncode == 2, out[-3000:]
    assert all(f"`{rel}`" in flat for rel in MINE), flat[-1500:]
    assert "Nothing was deleted" in flat and "Traceback" not in out
    assert snapshot(run) == before
