"""`trainpipe diagnose` on recorded run directories of each failure kind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_resilience import config, events, run_with_faults
from tiny import build_tiny_model
from trainpipe.cli import main
from trainpipe.report.diagnose import diagnose

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def kinds(run):
    return [f.kind for f in diagnose(run)]


def test_finished_run_is_ok(tmp_path, base):
    assert main(["run", str(config(tmp_path, base, **{"training.max_steps": 4}))]) == 0
    failed = json.loads((tmp_path / "run" / "gates.json").read_text())["failed"]  # a 4-step run fails some gates (effective batch 8 < 32)
    assert kinds(tmp_path / "run") == ([f"gate_{n}" for n in failed] or ["ok"])  # each explained; "ok" only with none failed


def test_never_started_names_the_data_error(tmp_path, base):
    cfg = config(tmp_path, base)
    (tmp_path / "data" / "alpaca.jsonl").write_text('{"instruction": "x"\n')
    assert main(["run", str(cfg)]) == 2
    (f,) = diagnose(tmp_path / "run")
    assert f.kind == "never_started" and "DataError" in f.cause and "line 1" in f.evidence


def test_oom(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{"training.per_device_train_batch_size": 1})
    assert run_with_faults(monkeypatch, cfg, {"oom_always_at_windows": [1]}) == 4
    f = diagnose(tmp_path / "run")[0]
    assert f.kind == "oom" and "max_length" in f.fix


def test_divergence_lr_too_high_or_nan(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{"training.max_recoveries": 1})
    assert run_with_faults(monkeypatch, cfg, {"nan_always": True}) == 3
    f = diagnose(tmp_path / "run")[0]
    assert f.kind == "divergence" and "learning_rate" in f.fix


def test_loss_not_decreasing_lr_too_low(tmp_path, base):
    cfg = config(tmp_path, base, **{"training.learning_rate": 1e-12, "training.max_steps": 16, "training.early_stopping_patience": None})
    assert main(["run", str(cfg)]) == 0
    fs = diagnose(tmp_path / "run")
    assert fs[0].kind == "loss_flat" and "too low" in fs[0].cause


def test_hang(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{"training.max_steps": 6, "training.hang_timeout_seconds": 0.3})
    assert run_with_faults(monkeypatch, cfg, {"sleep_at_window": {"window": 3, "seconds": 1.2}}) == 0
    assert "hang" in kinds(tmp_path / "run")


def test_preempted(tmp_path, base):
    cfg = config(tmp_path, base)
    run = tmp_path / "run"
    env = {**os.environ, "TRAINPIPE_TEST_FAULTS": json.dumps({"step_seconds": 0.05})}
    p = subprocess.Popen([sys.executable, "-m", "trainpipe.cli", "run", str(cfg)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and not ((run / "events.jsonl").exists() and any(e["event"] == "training_started" for e in events(run))):
        time.sleep(0.02)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 75
    f = diagnose(run)[0]
    assert f.kind == "preempted" and "--resume" in f.fix


def _write(run, events_list, metrics):
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events_list))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_overfitting_synthetic_record(tmp_path):
    # a hand-written record (an overfitting run takes too long to train here)
    ev = [{"time": "t", "event": e, "level": "info", "step": s} for e, s in [("run_started", 0), ("training_started", 0), ("run_finished", 40)]]
    metrics = [{"step": s, "loss": 2.0 - 0.04 * s} for s in range(1, 41)] + [
        {"step": s, "eval_loss": v} for s, v in [(10, 1.5), (20, 1.2), (30, 1.4), (40, 1.6)]
    ]
    _write(tmp_path / "run", ev, metrics)
    assert kinds(tmp_path / "run") == ["overfitting"]


def test_input_bound_synthetic_gpu_record(tmp_path):
    # FAKE: gpu_util_low only fires on a GPU, which this machine does not have; the record is hand-written
    ev = [{"time": "t", "event": "training_started", "level": "info", "step": 0},
          {"time": "t", "event": "gpu_util_low", "level": "warning", "step": 50, "gpu_util": 31, "dataloader_share": 0.62},
          {"time": "t", "event": "run_finished", "level": "info", "step": 100}]
    _write(tmp_path / "run", ev, [])
    (f,) = diagnose(tmp_path / "run")
    assert f.kind == "input_bound" and "data.packing" in f.settings


def test_cli_diagnose_json_on_a_crashed_run(tmp_path, base, capsys, monkeypatch):
    cfg = config(tmp_path, base, **{"training.max_recoveries": 0})
    assert run_with_faults(monkeypatch, cfg, {"nan_at_windows": [2]}) == 3
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["kind"] == "divergence" and out[0]["evidence"]
