"""The emitted sbatch script, run by bash as SLURM runs it, on a FAKE SLURM: `srun` and `scontrol` are stand-ins written by
this test (there is no cluster here): the fake `srun` starts its command on this machine (one task, as on one node), the
fake `scontrol show hostnames` answers 127.0.0.1. Everything else is real: the script, trainpipe's launcher, two gloo
workers training the tiny Llama.

SLURM's warning signal (`--signal=B:TERM@120`) goes to the batch shell alone; the script's trap must forward it to the
step, so that every worker saves one checkpoint and the job ends with 75 (preempted) well inside the grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_distributed import events, free_port, sft_config, wait_for
from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

FAKE_SRUN = """#!/usr/bin/env bash
# FAKE srun (no SLURM here): drop srun's own options and run the task on this machine, as one node's task.
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# FAKE scontrol (no SLURM here): `scontrol show hostnames LIST` names this machine.
echo 127.0.0.1
"""


def fake_slurm(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.skipif(sys.platform != "linux", reason="bash and /proc")
def test_term_to_the_batch_shell_reaches_every_worker(tmp_path):
    base = build_tiny_model(tmp_path / "base")
    cfg = sft_config(tmp_path, base, **{"training.max_steps": 8, "training.save_steps": 2, "training.eval_steps": 8})
    out = tmp_path / "job"
    assert main(["launch", str(cfg), "--emit", "slurm", "-o", str(out), "--nproc-per-node", "2", "--nnodes", "1"]) == 0
    script = out / "launch.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    bin_dir = fake_slurm(tmp_path / "fake-slurm-bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0]",
           "SLURM_JOB_ID": "1", "SLURM_SUBMIT_DIR": str(out), "MASTER_PORT": str(free_port()), "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "TRAINPIPE_TEST_FAULTS": json.dumps({"step_seconds": 0.4})}
    batch = subprocess.Popen(["bash", str(script)], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    run = tmp_path / "run"
    try:
        wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 2 for e in events(run)), batch)
        t0 = time.time()
        os.kill(batch.pid, signal.SIGTERM)  # what `--signal=B:TERM` does: the batch shell alone
        output, _ = batch.communicate(timeout=120)
        took = time.time() - t0
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
    assert batch.returncode == 75, output[-3000:]
    assert took < 120, took  # inside the grace period
    ev = events(run)
    pre = [e for e in ev if e["event"] == "preempted"]
    assert len(pre) == 1, output[-3000:]
    saved = [e["step"] for e in ev if e["event"] == "checkpoint_saved"]
    assert saved[-1] == pre[0]["step"] and not any(e["event"] == "training_finished" for e in ev)
    started = next(e for e in ev if e["event"] == "training_started")
    assert started["world_size"] == 2
