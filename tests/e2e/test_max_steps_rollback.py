"""`max_steps` is the number of optimizer steps trained, also when a window is skipped after a rollback (issue 15.6)."""

import json

import pytest

from test_resilience import events, run_with_faults
from test_sft import make_config
from tiny import build_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def test_max_steps_10_with_a_skipped_window_trains_10_steps(tmp_path, base, monkeypatch):
    cfg = make_config(tmp_path, base, **{
        "training.max_steps": 10, "training.eval_steps": 5, "training.save_steps": 2, "training.logging_steps": 1,
        "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 2, "eval.metrics": ["loss"],
    })
    assert run_with_faults(monkeypatch, cfg, {"nan_at_windows": [5]}) == 0  # an injected divergence in window 5 (step 6)
    run = tmp_path / "run"
    ev = events(run)
    (over,) = [e for e in ev if e["event"] == "gradient_overflow"]
    (back,) = [e for e in ev if e["event"] == "rolled_back"]
    assert over["window"] == 5 and back["step"] == 5 and back["skipped_windows"] == [5]  # back to step 5 (its eval was saved)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train"]["global_step"] == 10 and summary["train"]["skipped_windows"] == [5]
    (done,) = [e for e in ev if e["event"] == "training_finished"]
    assert done["step"] == 10
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert sorted(set(steps)) == list(range(1, 11))  # ten optimizer steps (none lost to the skipped window)
    # ten windows trained: 0-4, then 6-10 (window 5 skipped): the last step reads window 10, one past max_steps
    per_step = {}
    for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        if "tokens_seen" in m:
            per_step[m["step"]] = m["tokens_seen"]
    assert per_step[10] > per_step[9] > per_step[5]
    assert [e["step"] for e in ev if e["event"] == "checkpoint_saved"][-1] == 10
