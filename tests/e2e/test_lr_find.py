"""`trainpipe lr-find` and `trainpipe batch-find` on a tiny Llama (real forward/backward on the CPU).

lr-find: the smoothed loss falls, then diverges and the sweep stops early; the suggestion lies where the loss fell
fastest (below the divergence point, with a lower smoothed loss than at the start) and is printed as a `--set` line;
training with it learns faster than with a lr 1000x smaller.
batch-find: on the CPU the memory cap is checked against the planner's peak estimate (a SIMULATED out-of-memory, since
a real CPU OOM kills the process); the found micro-batch is the largest whose estimate fits the cap, every micro-batch
that passed really ran a step, and the accumulation reaches the target effective batch."""

import json
import math

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lrfind")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(200, seed=21))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 16, "max_length": 64},
        "method": {"peft": "none"},
        "training": {"per_device_train_batch_size": 8, "weight_decay": 0.0},
        "output_dir": str(tmp / "run"),
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return tmp, p


def test_lr_find_stops_at_divergence_and_suggests_the_steepest_point(project, capsys):
    tmp, cfg = project
    assert main(["lr-find", str(cfg), "--start", "1e-5", "--end", "100", "--steps", "60", "-o", str(tmp / "lr")]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp / "lr" / "lr_find.json").read_text())
    assert r["diverged"] and r["steps_run"] < 60  # stopped at divergence, before --end
    pts = [p for p in r["points"] if math.isfinite(p["smoothed"])]
    first, at = pts[0]["smoothed"], next(p for p in pts if p["lr"] == r["suggested_lr"])
    assert min(p["loss"] for p in pts) < 0.8 * pts[0]["loss"] and min(p["smoothed"] for p in pts) < first  # the loss fell during the sweep
    assert at["smoothed"] < first and r["suggested_lr"] < pts[-1]["lr"]
    assert r["suggested_lr"] <= r["min_loss_lr"]  # the steepest fall comes before the minimum
    assert f"--set training.learning_rate={r['suggested_lr']:.3g}" in out
    svg = (tmp / "lr" / "lr_find.svg").read_text()
    assert svg.startswith("<svg") and "polyline" in svg and "suggested" in svg
    assert not (tmp / "run").exists()  # the config's run directory is not touched

    # the suggestion trains: 20 steps at it lower the loss far more than 20 steps at a lr 1000x smaller
    def train(lr: float) -> dict:
        name = f"run-{lr:g}"
        assert main(["run", str(cfg), "--set", f"training.learning_rate={lr}", "--set", "training.max_steps=20", "--set", "training.eval_steps=20",
                     "--set", "training.gradient_accumulation_steps=1", "--set", "training.early_stopping_patience=null",
                     "--set", "eval.metrics=[loss]", "--set", f"output_dir={tmp / name}"]) == 0
        return json.loads((tmp / name / "summary.json").read_text())

    fast, slow = train(r["suggested_lr"]), train(r["suggested_lr"] / 1000)
    assert fast["final"]["loss"] < fast["baseline"]["loss"] - 0.5
    assert fast["final"]["loss"] < slow["final"]["loss"] - 0.3


def test_batch_find_under_a_memory_cap(project, capsys):
    """The largest micro-batch that fits (13) does not divide the target effective batch 32: the proposal is 8 x 4 = 32."""
    from trainpipe.config import load_config
    from trainpipe.tune.batchfind import _planner_bytes

    tmp, cfg = project
    rc = load_config(cfg)
    est = {mb: _planner_bytes(rc, mb) for mb in (8, 13, 14, 16)}
    cap_gib = (est[13] + est[14]) / 2 / 1024**3  # between the estimates of 13 and 14 sequences
    assert main(["batch-find", str(cfg), "--max-memory-gib", repr(cap_gib), "-o", str(tmp / "bf")]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp / "bf" / "batch_find.json").read_text())
    assert r["simulated"] and r["largest_fitting_micro_batch"] == 13 and r["limited_by"] == "memory"
    assert r["micro_batch"] == 8 and r["gradient_accumulation_steps"] == 4 and r["effective_batch"] == 32 == r["target_effective_batch"]
    ran = [t["micro_batch"] for t in r["tries"] if t.get("fits")]
    refused = [t for t in r["tries"] if t.get("fits") is False]
    assert 13 in ran and max(ran) == 13 and all(t["why"].startswith("simulated OOM") for t in refused)
    assert {t["micro_batch"] for t in refused} >= {14, 16}
    assert "--set training.per_device_train_batch_size=8" in out and "--set training.gradient_accumulation_steps=4" in out
    assert "keeping the effective batch 32: micro-batch 8 x accumulation 4 = 32" in out


def test_batch_find_keeps_the_effective_batch_when_more_than_the_target_fits(project, capsys):
    """Issue 24: with room for 85 sequences and a target effective batch of 32, batch-find proposed micro-batch 85 (an
    effective batch of 85). It must keep the target: micro-batch 32, accumulation 1, and say that 85 fits."""
    from trainpipe.config import load_config
    from trainpipe.tune.batchfind import _planner_bytes

    tmp, cfg = project
    rc = load_config(cfg)
    cap_gib = (_planner_bytes(rc, 85) + _planner_bytes(rc, 86)) / 2 / 1024**3
    assert main(["batch-find", str(cfg), "--max-memory-gib", repr(cap_gib), "-o", str(tmp / "bf85")]) == 0
    out = capsys.readouterr().out
    r = json.loads((tmp / "bf85" / "batch_find.json").read_text())
    assert r["largest_fitting_micro_batch"] == 85 and 85 in [t["micro_batch"] for t in r["tries"] if t.get("fits")]
    assert (r["micro_batch"], r["gradient_accumulation_steps"], r["effective_batch"]) == (32, 1, 32)
    assert "--set training.per_device_train_batch_size=32" in out and "--set training.gradient_accumulation_steps=1" in out
    assert "85 fits but would change the effective batch" in out
    # a target of 24 with room for 85: 24 x 1
    assert main(["batch-find", str(cfg), "--max-memory-gib", repr(cap_gib), "--set", "training.target_effective_batch_size=24", "-o", str(tmp / "bf24")]) == 0
    r = json.loads((tmp / "bf24" / "batch_find.json").read_text())
    assert (r["micro_batch"], r["gradient_accumulation_steps"], r["effective_batch"]) == (24, 1, 24)


def test_keep_effective_batch_splits_the_target_exactly():
    from trainpipe.errors import ConfigError
    from trainpipe.tune.batchfind import keep_effective_batch

    assert keep_effective_batch(85, 32) == (32, 1)
    assert keep_effective_batch(13, 32) == (8, 4)
    assert keep_effective_batch(13, 36) == (12, 3)
    assert keep_effective_batch(7, 13) == (1, 13)  # a prime target: only 1 divides it below 13
    assert keep_effective_batch(85, 32, world=4) == (8, 1) and keep_effective_batch(3, 32, world=4) == (2, 4)
    for largest in range(1, 100):
        for target, world in ((32, 1), (48, 2), (30, 3), (64, 8)):
            mb, accum = keep_effective_batch(largest, target, world)
            assert mb <= largest and mb * accum * world == target
    with pytest.raises(ConfigError, match="not a multiple of the 3 processes"):
        keep_effective_batch(8, 32, world=3)
