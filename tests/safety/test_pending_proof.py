"""After a SIGKILL, the names a run left pending are no licence (issue 36).

A real run (child process) is killed mid-training, which leaves about 25 names pending in its folder's manifest. A
person then puts files under some of those names (`model/serve.py`, `export/prod/deploy.sh`, `tensorboard/mine.tfevents`,
`review.json`) and a note into a checkpoint (`checkpoints/step-2/NOTES.md`), and appends a line to `events.jsonl`.
`--overwrite` must refuse, naming each, and delete nothing; `training.resume=auto` (what the emitted sbatch runs)
resumes beside them, and its checkpoint rotation removes only checkpoint files: every file of the person's survives.
"""

import json
import signal
import time

import pytest

from conftest import cli, project, snapshot
from trainpipe import ownership

pytestmark = pytest.mark.e2e

MINE = {"model/serve.py": "print('serve')\n", "export/prod/deploy.sh": "kubectl apply\n", "tensorboard/mine.tfevents": "mine\n",
        "review.json": '{"ok": true}\n', "checkpoints/step-2/NOTES.md": "step 2 looked fine\n"}


def test_files_under_pending_names_survive_overwrite_and_resume(tmp_path, base):
    cfg = project(tmp_path, base, **{"training.max_steps": 400, "training.save_steps": 2, "training.eval_steps": 200})
    run = tmp_path / "run"
    p = cli(["run", str(cfg)])
    deadline = time.time() + 180
    while p.poll() is None and time.time() < deadline and not (run / "checkpoints" / "step-2" / "manifest.json").exists():
        time.sleep(0.05)
    time.sleep(0.2)
    assert p.poll() is None, p.stdout.read()
    p.send_signal(signal.SIGKILL)
    p.wait()
    pending = ownership.read_manifest(run)["pending"]
    assert {"model", "export", "tensorboard", "review.json"} <= set(pending), pending
    assert ownership.foreign(run) == []  # what the killed run left is provably its own
    for rel, text in MINE.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    before = {k: v for k, v in snapshot(run).items() if k != ".trainpipe.lock"}  # the killed run's stale lock is taken over

    q = cli(["run", str(cfg), "--overwrite", "--set", "training.max_steps=2"])
    out, _ = q.communicate(timeout=300)
    flat = " ".join(out.split())
    assert q.returncode == 2, out[-3000:]
    for rel in MINE:
        assert f"`{rel}`" in flat or rel in flat.replace("and 1 more", ""), (rel, flat[-1500:])
    assert "Nothing was deleted" in flat and "Traceback" not in out
    assert {k: v for k, v in snapshot(run).items() if k != ".trainpipe.lock"} == before

    steps = sorted(int(c.name.split("-")[1]) for c in (run / "checkpoints").glob("step-*") if (c / "manifest.json").exists())
    r = cli(["run", str(cfg), "--set", "training.resume=auto", "--set", f"training.max_steps={steps[-1] + 4}",
             "--set", "training.save_steps=2", "--set", "training.eval_steps=200"])
    out, _ = r.communicate(timeout=600)
    assert "Traceback" not in out, out[-3000:]
    assert any(json.loads(x)["event"] == "checkpoint_resumed" for x in (run / "events.jsonl").read_text().splitlines() if x.startswith("{"))
    for rel, text in MINE.items():
        assert (run / rel).read_text() == text, rel  # nothing of the person's deleted, resumed or not
    assert not (run / "checkpoints" / "step-2" / "weights.safetensors").exists()  # step-2 was rotated away: its files only
    assert "checkpoints/step-2/NOTES.md" in ownership.foreign(run)  # and the note is not taken for the run's
