"""`trainpipe tune` on a tiny Llama (real training, CPU): trials are ordinary run directories, a bad trial is pruned at an
eval and stops cleanly (`trial_pruned`, no export), a trial whose plan does not fit `tune.max_memory_gib` is never started,
and the study writes best.yaml (which validates and names the best trial's values), leaderboard CSV/HTML (inline SVG
history and importances) and the best trial's model."""

import csv
import json
from pathlib import Path

import optuna
import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(160, seed=11))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 16, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "training": {"eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "early_stopping_patience": None, "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / "study"),
        "tune": {
            "space": {
                # 1e-7 barely moves the loss: the median pruner stops such a trial at its first eval after two complete trials
                "training.learning_rate": {"choice": [1.0e-7, 5.0e-3]},
                "method.lora.r": {"choice": [4, 8], "when": {"method.peft": "lora"}},
                # 4096 sequences per micro-batch: the planner's memory exceeds tune.max_memory_gib, so that trial is never started
                "training.per_device_train_batch_size": {"choice": [8, 4096]},
            },
            "objective": {"metric": "loss"},
            # grid order with seed 0: two lr 5e-3 trials complete first, then every 1e-7 trial meets the median of those two
            "n_trials": 4, "sampler": "grid", "pruner": "median", "seed": 0,
            "fidelity": {"steps": 6}, "max_memory_gib": 1.0,
        },
    }
    p = tmp / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tune", str(p)]) == 0
    (tmp / "console.txt").write_text(out.getvalue())
    return tmp, tmp / "study"


def test_the_console_has_a_line_or_two_per_trial_and_each_trial_its_log(study):
    tmp, sd = study
    lines = [ln for ln in (tmp / "console.txt").read_text().splitlines() if ln.strip()]
    _, trials = _trials(sd)
    ran = [t for t in trials if "skipped" not in t.user_attrs]
    assert len(lines) <= 2 * len(trials) + 30, "\n".join(lines)  # the study's header, a line or two per trial, the table
    assert not any("train step" in ln for ln in lines)  # the runs' own output is in the trial logs
    for t in ran:
        log = sd / "trials" / f"trial-{t.number:04d}.log"
        assert log.is_file() and "train step" in log.read_text()


def _trials(study_dir: Path):
    s = optuna.load_study(study_name="tune", storage=f"sqlite:///{study_dir / 'study.db'}")
    return s, s.get_trials()


def test_trials_are_run_directories_and_pruning_is_clean(study):
    _, sd = study
    s, trials = _trials(sd)
    states = {t.number: t.state.name for t in trials}
    ran = [t for t in trials if t.state.name == "COMPLETE" or (t.state.name == "PRUNED" and "skipped" not in t.user_attrs)]
    assert len(ran) == 4, states  # n_trials counts trials that ran; plans that did not fit are not among them
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 2 and all(t.params["training.learning_rate"] == 5e-3 for t in complete), states
    for t in complete:  # an ordinary run: summary, events, exported model, fidelity steps
        run = Path(t.user_attrs["run_dir"])
        summary = json.loads((run / "summary.json").read_text())
        assert summary["train"]["global_step"] == 6
        assert (run / "model" / "model.safetensors").is_file()
        assert t.value == pytest.approx(summary["final"]["loss"])
        assert len(t.intermediate_values) == 3  # steps 2, 4, 6 reported to the pruner
    pruned_at_eval = [t for t in trials if t.state.name == "PRUNED" and "pruned_at_step" in t.user_attrs]
    assert len(pruned_at_eval) == 2, states
    for t in pruned_at_eval:
        run = Path(t.user_attrs["run_dir"])
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert "trial_pruned" in kinds and "run_failed" not in kinds and "run_finished" not in kinds
        assert not (run / "model").exists() and not (run / "summary.json").exists()
        assert t.params["training.learning_rate"] == 1e-7  # the trial that did not learn
        pruned_step = next(e for e in events if e["event"] == "trial_pruned")["step"]
        assert pruned_step < 6 and pruned_step == t.user_attrs["pruned_at_step"]


def test_plan_that_does_not_fit_is_never_started(study):
    _, sd = study
    _, trials = _trials(sd)
    big = [t for t in trials if t.params.get("training.per_device_train_batch_size") == 4096]
    assert big, "the seed drew no 4096 trial"
    for t in big:
        assert t.state.name == "PRUNED" and t.user_attrs["skipped"].startswith("does not fit")
        assert "tune.max_memory_gib" in t.user_attrs["skipped"]
        assert not Path(t.user_attrs["run_dir"]).exists()  # no run directory: nothing was loaded or trained


def test_outputs_best_yaml_leaderboard_and_model(study):
    tmp, sd = study
    s, trials = _trials(sd)
    best = s.best_trial
    cfg = yaml.safe_load((sd / "best.yaml").read_text())
    assert cfg["training"]["learning_rate"] == best.params["training.learning_rate"] == 5e-3
    assert cfg["method"]["lora"]["r"] == best.params["method.lora.r"]
    assert "tune" not in cfg and "max_steps" not in cfg["training"]  # the full run, not the fidelity
    from trainpipe.config import build_config

    build_config(cfg)  # ready to run
    rows = list(csv.DictReader((sd / "leaderboard.csv").open()))
    assert len(rows) == len(trials) and rows[0]["rank"] == "1" and int(rows[0]["trial"]) == best.number
    page = (sd / "leaderboard.html").read_text()
    # history and intermediate values as SVG; 2 complete trials are too few for importances (the page says so)
    assert page.count("<svg") >= 2 and "Optimisation history" in page and "need at least three complete trials" in page and "<script" not in page
    from safetensors.torch import load_file

    exported = load_file(sd / "best" / "model" / "model.safetensors")
    again = load_file(Path(best.user_attrs["run_dir"]) / "model" / "model.safetensors")
    assert exported.keys() == again.keys() and all((exported[k] == again[k]).all() for k in exported)
    summary = json.loads((sd / "tune.json").read_text())
    assert summary["best"]["trial"] == best.number and summary["states"]["complete"] == sum(t.state.name == "COMPLETE" for t in trials)


def test_data_fraction_fidelity_and_hyperband(tmp_path):
    """fidelity.data_fraction: every trial trains on the same seeded half of the records (and the same eval split); best.yaml
    is written for all of the data. The hyperband pruner runs on real trials."""
    base = build_tiny_model(tmp_path / "base")
    write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_records(120, seed=12))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 12, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 4, "eval_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp_path / "study"),
        "tune": {"space": {"training.learning_rate": {"log_uniform": [1e-4, 1e-2]}}, "n_trials": 2, "sampler": "random", "pruner": "hyperband",
                 "fidelity": {"data_fraction": 0.5}},
    }
    p = tmp_path / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["tune", str(p)]) == 0
    _, trials = _trials(tmp_path / "study")
    reports = [json.loads((Path(t.user_attrs["run_dir"]) / "data_report.json").read_text()) for t in trials if t.state.name == "COMPLETE"]
    assert len(reports) == 2
    assert all(r["train_examples"] + r["eval_examples"] <= 60 for r in reports)  # half of the 120 records
    assert reports[0]["train_examples"] == reports[1]["train_examples"] and reports[0]["eval_examples"] == reports[1]["eval_examples"] == 12
    # intermediate values are comparable across trials and rungs: every trial's evals run on the same eval records (the same
    # base model measures the same baseline loss in each), at the same steps
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    baselines = [json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())["baseline"]["loss"] for t in complete]
    assert baselines[0] == baselines[1]
    assert sorted(complete[0].intermediate_values) == sorted(complete[1].intermediate_values) == [2, 4]
    best = yaml.safe_load((tmp_path / "study" / "best.yaml").read_text())
    assert "max_records" not in best["data"]["sources"][0]


SLOW = '''
import math, time
from pathlib import Path

def fn(cfg, trial):
    if trial.number == 2 and not Path(MARK).exists():  # the first time trial 2 runs: say so, then hang until killed
        Path(MARK).write_text("started")
        time.sleep(120)
    lr = cfg["training"]["learning_rate"]
    return (math.log10(lr) + 3) ** 2
'''


def test_interrupted_study_resumes_from_the_same_storage(tmp_path):
    """`trainpipe tune` killed mid-trial (SIGKILL), then run again on the same config: the study continues in the same
    SQLite storage (finished trials kept as they were, numbers continue), the trial that was running is failed after the
    heartbeat grace and retried with its parameters, and the study stops at n_trials finished trials in all."""
    import os
    import signal
    import subprocess
    import sys
    import time

    mark = tmp_path / "trial2.started"
    (tmp_path / "slow.py").write_text(f"MARK = {str(mark)!r}\n" + SLOW)
    write_jsonl(tmp_path / "data.jsonl", [{"instruction": "a", "output": "b"}])
    cfg = {
        "model": {"name_or_path": "surrogate"}, "data": {"sources": [{"path": "data.jsonl"}]}, "output_dir": str(tmp_path / "study"),
        "tune": {"space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-1]}}, "objective": {"function": "slow.py:fn", "direction": "minimize"},
                 "n_trials": 4, "sampler": "random", "pruner": "none", "heartbeat_seconds": 1, "max_retries": 1},
    }
    p = tmp_path / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "trainpipe.cli", "tune", str(p)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not mark.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert mark.exists(), "trial 2 never started"
        time.sleep(1.5)  # a heartbeat or two of trial 2 is stored
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = {t.number: t for t in _trials(tmp_path / "study")[1]}
    assert [before[n].state.name for n in sorted(before)] == ["COMPLETE", "COMPLETE", "RUNNING"]
    time.sleep(3.5)  # past the grace period (3 heartbeats): the killed worker's trial is stale
    assert main(["tune", str(p)]) == 0
    _, trials = _trials(tmp_path / "study")
    by = {t.number: t for t in trials}
    assert sorted(by) == list(range(len(trials)))  # one study, numbers continue: nothing restarted from trial 0
    for n in (0, 1):  # finished trials kept as they were
        assert by[n].state.name == "COMPLETE" and by[n].value == before[n].value and by[n].datetime_start == before[n].datetime_start
    assert by[2].state.name == "FAIL"
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 2]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].params == before[2].params
    assert sum(t.state.name == "COMPLETE" for t in trials) == 4 and len(trials) == 5
    assert json.loads((tmp_path / "study" / "tune.json").read_text())["states"]["complete"] == 4
