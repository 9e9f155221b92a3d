"""A study shared through a real PostgreSQL server (started by the test, tests/conftest.py `postgres_url`): four
concurrent `trainpipe tune` worker processes lose and duplicate no trial, and a worker SIGKILLed mid-trial leaves its
trial FAIL (no heartbeat) and retried by the next worker, not RUNNING forever. The objective is a cheap function of the
sampled config (`tune.objective.function`), so the test exercises the study machinery in seconds."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

pytestmark = pytest.mark.e2e

OBJECTIVE = '''
import os, time, math

def score(cfg, trial):
    lr = cfg["training"]["learning_rate"]
    wd = cfg["training"]["weight_decay"]
    with open(os.environ["TUNE_LOG"], "a") as fh:  # one line per evaluation: trial number, worker pid
        fh.write(f"{trial.number} {os.getpid()}\\n")
    time.sleep(float(os.environ.get("TUNE_SLEEP", "0.2")))
    return (math.log10(lr) + 3) ** 2 + (wd - 0.05) ** 2
'''


def project(tmp: Path, url: str, n_trials: int, heartbeat: int = 2) -> Path:
    (tmp / "objective.py").write_text(OBJECTIVE)
    (tmp / "data.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = {
        "model": {"name_or_path": "gpt2"},
        "data": {"sources": [{"path": "data.jsonl"}]},
        "output_dir": str(tmp / "study"),
        "tune": {
            "space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-1]}, "training.weight_decay": {"uniform": [0.0, 0.1]}},
            "objective": {"function": "objective.py:score", "direction": "minimize"},
            "n_trials": n_trials, "sampler": "tpe", "pruner": "none", "storage": url, "study_name": "shared",
            "heartbeat_seconds": heartbeat, "max_retries": 1,
        },
    }
    p = tmp / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def worker(cfg: Path, log: Path, **env) -> subprocess.Popen:
    e = {**os.environ, "TUNE_LOG": str(log), "NO_COLOR": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "trainpipe.cli", "tune", str(cfg)], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_four_workers_share_one_study_without_loss_or_duplicates(tmp_path, postgres_url):
    cfg = project(tmp_path, postgres_url, n_trials=16)
    log = tmp_path / "evaluations.log"
    procs = [worker(cfg, log) for _ in range(4)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    study = optuna.load_study(study_name="shared", storage=postgres_url)
    trials = study.get_trials()
    lines = [ln.split() for ln in log.read_text().splitlines()]
    evaluated = [int(n) for n, _ in lines]
    assert len(evaluated) == len(set(evaluated)), "a trial was evaluated twice"
    complete = {t.number for t in trials if t.state.name == "COMPLETE"}
    assert complete == set(evaluated), "a trial evaluated by a worker is missing from the study (or the reverse)"
    # n_trials is a study-wide count of trials that ran or run: exact; a trial two workers created at the same moment past
    # it is not run (FAIL, `over_budget`, nothing evaluated)
    ran = [t for t in trials if not t.user_attrs.get("over_budget")]
    assert len(complete) == 16 and all(t.state.name == "COMPLETE" for t in ran)
    assert len({pid for _, pid in lines}) >= 2, "only one worker ran trials"
    assert study.best_value < 0.5  # TPE found the basin around lr 1e-3


def test_sigkilled_worker_leaves_its_trial_failed_and_retried(tmp_path, postgres_url):
    cfg = project(tmp_path, postgres_url, n_trials=3, heartbeat=1)
    log = tmp_path / "evaluations.log"
    slow = worker(cfg, log, TUNE_SLEEP="120")
    study = None
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the slow worker's first trial is RUNNING in the database
        try:
            study = optuna.load_study(study_name="shared", storage=postgres_url)
            if any(t.state.name == "RUNNING" for t in study.get_trials()) and log.exists():
                break
        except KeyError:
            pass
        time.sleep(0.5)
    else:
        slow.kill()
        pytest.fail("the worker never started a trial: " + slow.communicate()[0])
    killed = next(t for t in study.get_trials() if t.state.name == "RUNNING")
    os.kill(slow.pid, signal.SIGKILL)
    slow.wait()
    time.sleep(4)  # past the grace period (3 heartbeats of 1 s): the trial is stale
    assert study.get_trials()[killed.number].state.name == "RUNNING"  # nobody has looked yet
    fresh = worker(cfg, log)
    out = fresh.communicate(timeout=240)[0]
    assert fresh.returncode == 0, out
    trials = study.get_trials()
    assert trials[killed.number].state.name == "FAIL"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1 and retries[0].state.name == "COMPLETE" and retries[0].params == killed.params
    assert not any(t.state.name == "RUNNING" for t in trials)
    study_dir = tmp_path / "study"
    assert (study_dir / "leaderboard.csv").read_text().count("retry of trial") == 1
