"""Saving without evaluating (issue 14.2): `save_steps` (a spot-training interval, say the planner's Young/Daly one) need
not be a multiple of `eval_steps`. A checkpoint between evaluations has no eval loss and counts among the newest
`save_total_limit`; every evaluation that is the best so far is saved, so the best checkpoint is chosen by eval loss and
holds the evaluated weights. A SIGKILL between evaluations and `--resume` continue to the bit."""

import json
import signal
import time
from pathlib import Path

import pytest

from test_resilience import assert_bit_identical, cli, events, weights
from test_sft import make_config
from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

SETTINGS = {
    "training.max_steps": 20, "training.eval_steps": 10, "training.save_steps": 3, "training.logging_steps": 5,
    "training.save_total_limit": 2, "training.keep_best": 1, "training.per_device_train_batch_size": 4,
    "training.gradient_accumulation_steps": 2, "eval.metrics": ["loss"], "method.lora.dropout": 0.1,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("ref")
    assert main(["run", str(make_config(tmp, base, **SETTINGS))]) == 0
    return tmp / "run"


def test_checkpoints_between_evals_and_the_best_by_eval_loss(reference):
    ev = events(reference)
    saved = [e["step"] for e in ev if e["event"] == "checkpoint_saved"]
    assert saved == [0, 3, 6, 9, 10, 12, 15, 18, 20]  # every 3 steps, plus each evaluation that is the best so far, plus the last
    evals = {e["step"]: e["eval_loss"] for e in ev if e["event"] == "eval_done" and e.get("phase") == "train"}
    assert sorted(evals) == [10, 20]
    by_step = {e["step"]: e["eval_loss"] for e in ev if e["event"] == "checkpoint_saved"}
    assert all(by_step[s] is None for s in (3, 6, 9, 12, 15, 18))  # saved without an evaluation: no metric to rank by
    best_step = min(evals, key=evals.get)
    summary = json.loads((reference / "summary.json").read_text())
    assert Path(summary["train"]["best_checkpoint"]).name == f"step-{best_step}"
    assert summary["train"]["best_eval_loss"] == evals[best_step]
    man = json.loads((reference / "checkpoints" / f"step-{best_step}" / "manifest.json").read_text())
    assert man["metric"] == evals[best_step]
    kept = sorted(int(p.name.split("-")[1]) for p in (reference / "checkpoints").glob("step-*"))
    assert kept == sorted({18, 20, best_step})  # the newest 2 plus the best by eval loss
    assert summary["final"]["loss"] < summary["baseline"]["loss"]


def test_sigkill_between_evals_then_resume_is_bit_identical(tmp_path, base, reference):
    cfg = make_config(tmp_path, base, **SETTINGS)
    run = tmp_path / "run"
    p = cli(["run", str(cfg)], faults={"step_seconds": 0.05})
    deadline = time.time() + 600
    while p.poll() is None and time.time() < deadline and not (run / "checkpoints" / "step-12").is_dir():
        time.sleep(0.01)
    assert p.poll() is None and (run / "checkpoints" / "step-12").is_dir(), "the run ended (or never reached step 12) before the kill"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (run / "summary.json").exists()
    r = cli(["run", str(cfg), "--resume"])
    out, _ = r.communicate(timeout=300)
    assert r.returncode == 0, out[-2000:]
    (resumed,) = [e for e in events(run) if e["event"] == "checkpoint_resumed"]
    assert resumed["step"] in (12, 15, 18)  # a checkpoint saved without an evaluation (the eval of step 10 lies before it)
    assert_bit_identical(weights(run), weights(reference))
    s, r_ = json.loads((run / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert s["final"] == r_["final"]
    assert Path(s["train"]["best_checkpoint"]).name == Path(r_["train"]["best_checkpoint"]).name
