"""Results travel (issue 24): what a run decided reaches the places people look, through a REAL local MLflow store
(SQLite, as tests/e2e/test_tracking.py) and the console of `trainpipe run`.

- a model failing its quality gates under `gates.on_fail: warn` is registered, but its run and its registered version
  carry `trainpipe.gates.passed=false` and `trainpipe.gate.<name>=fail` (and its version's description says NOT PASSED);
  under `gates.on_fail: fail` it is not registered at all; a passing one carries `trainpipe.gates.passed=true`;
- the end of `trainpipe run` prints one line per failed gate with its evidence, the count passed, and report.html's path;
- `trainpipe tune`: the trials are child runs (`mlflow.parentRunId`) of one run per study, in the study's experiment,
  not one experiment per trial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

QUIET_GATES = {"val_loss_decreasing": {"enabled": False}, "beats_baseline": {"enabled": False}, "best_checkpoint_by_val_loss": {"enabled": False},
               "no_forgetting": {"enabled": False}, "beats_trivial": {"enabled": False}}  # 2 steps do not beat token frequencies


def _config(tmp: Path, model_dir: Path, out: str, uri: str, gates: dict, **extra) -> Path:
    write_jsonl(tmp / "train.jsonl", alpaca_records(48, seed=5))
    cfg = {
        "name": "travel",
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 12, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 2, "eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "gates": gates,
        "tracking": {"backend": "mlflow", "uri": uri, "model_name": "travel-model"},
        "output_dir": str(tmp / out),
        **extra,
    }
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_gate_verdicts_travel_to_mlflow_and_the_console(tmp_path, tiny_model_dir, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    # 1. gates fail (effective batch 8 x 1 < 32), `on_fail: warn`: registered, tagged and described as NOT PASSED
    assert main(["run", str(_config(tmp_path, tiny_model_dir, "warned", uri, {"on_fail": "warn", **QUIET_GATES}))]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "warned"
    gates = json.loads((run_dir / "gates.json").read_text())
    assert gates["passed"] is False and "effective_batch" in gates["failed"]
    state = json.loads((run_dir / "tracking.json").read_text())
    tags = client.get_run(state["run_id"]).data.tags
    assert tags["trainpipe.gates.passed"] == "false" and tags["trainpipe.gate.effective_batch"] == "fail"
    assert tags["trainpipe.gate.gpu_utilization"] == "n/a" and tags["trainpipe.gates.failed"] == ",".join(gates["failed"])
    assert {tags[f"trainpipe.gate.{r['name']}"] for r in gates["results"]} <= {"pass", "fail", "n/a"}
    mv = client.get_model_version("travel-model", state["registered"]["version"])
    assert mv.run_id == state["run_id"] and mv.tags["trainpipe.gates.passed"] == "false" and mv.tags["trainpipe.gate.effective_batch"] == "fail"
    assert "NOT PASSED" in mv.description and "effective batch 8 x 1 x 1 = 8" in mv.description
    # the console: the verdict, one line per failed gate with its evidence, how many passed, and the report's path
    n_pass = sum(r["status"] == "pass" for r in gates["results"])
    assert f"quality gates: NOT PASSED ({n_pass} passed, {len(gates['failed'])} failed" in out
    effective = next(r for r in gates["results"] if r["name"] == "effective_batch")
    assert f"FAILED effective_batch: {effective['evidence']}" in out.replace("\n", " ") or f"FAILED effective_batch: {effective['evidence']}" in out
    assert f"report: {run_dir / 'report.html'}" in out and (run_dir / "report.html").is_file()

    # 2. the same failure under `on_fail: fail` (exit 6): the run is tracked with its verdicts, the model is NOT registered
    assert main(["run", str(_config(tmp_path, tiny_model_dir, "refused", uri, {"on_fail": "fail", **QUIET_GATES}))]) == 6
    out = capsys.readouterr().out
    state2 = json.loads((tmp_path / "refused" / "tracking.json").read_text())
    assert not state2.get("registered") and "on_fail: fail" in state2["not_registered"]
    assert client.get_run(state2["run_id"]).data.tags["trainpipe.gates.passed"] == "false"
    versions = client.search_model_versions("name='travel-model'")
    assert [v.run_id for v in versions] == [state["run_id"]]  # only the first run's model is in the registry
    assert "quality gates: NOT PASSED" in out and "FAILED effective_batch" in out and f"report: {tmp_path / 'refused' / 'report.html'}" in out

    # 3. a run that passes its gates: `trainpipe.gates.passed=true` on the run and the registered version
    passing = {"on_fail": "fail", **QUIET_GATES, "effective_batch": {"threshold": 8}}
    assert main(["run", str(_config(tmp_path, tiny_model_dir, "passed", uri, passing))]) == 0
    out = capsys.readouterr().out
    state3 = json.loads((tmp_path / "passed" / "tracking.json").read_text())
    assert client.get_run(state3["run_id"]).data.tags["trainpipe.gates.passed"] == "true"
    mv3 = client.get_model_version("travel-model", state3["registered"]["version"])
    assert mv3.tags["trainpipe.gates.passed"] == "true" and mv3.tags["trainpipe.gate.effective_batch"] == "pass" and "passed" in mv3.description
    assert "quality gates: passed" in out and "FAILED" not in out


def test_tune_trials_are_child_runs_of_the_study_run(tmp_path, tiny_model_dir):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tune = {"space": {"training.learning_rate": {"choice": [1.0e-3, 5.0e-3]}}, "objective": {"metric": "loss"}, "n_trials": 2,
            "sampler": "grid", "pruner": "none", "seed": 0, "fidelity": {"steps": 2}}
    cfg = _config(tmp_path, tiny_model_dir, "study", uri, {"on_fail": "warn"}, tune=tune)
    assert main(["tune", str(cfg)]) == 0
    client = MlflowClient(tracking_uri=uri)
    exps = {e.name: e for e in client.search_experiments()}
    assert "travel" in exps and not [n for n in exps if "trial" in n]  # the study's experiment, none per trial
    runs = client.search_runs([exps["travel"].experiment_id])
    parents = [r for r in runs if r.data.tags.get("trainpipe.tune.role") == "study"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and len(runs) == 3
    assert sorted(r.data.tags["trainpipe.tune.trial"] for r in children) == ["0", "1"]
    for r in children:  # each trial's run is its run directory's run, with its metrics
        trial_dir = Path(r.data.tags["trainpipe.run_dir"])
        assert json.loads((trial_dir / "tracking.json").read_text())["run_id"] == r.info.run_id and "loss" in r.data.metrics
    result = json.loads((tmp_path / "study" / "tune.json").read_text())
    assert parent.info.status == "FINISHED" and parent.data.tags["trainpipe.tune.best_trial"] == str(result["best"]["trial"])
    assert parent.data.metrics["best_loss"] == pytest.approx(result["best"]["value"])


def test_tune_default_store_beside_the_trials_holds_the_study_and_its_children(tmp_path, tiny_model_dir, monkeypatch):
    """No `tracking.uri`: the trials' runs and the study's run share the default store `<study>/trials/mlflow.db`."""
    from mlflow import MlflowClient

    monkeypatch.setenv("TRAINPIPE_TRACKING", "mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tune = {"space": {"training.learning_rate": {"choice": [1.0e-3]}}, "objective": {"metric": "loss"}, "n_trials": 1,
            "sampler": "grid", "pruner": "none", "seed": 0, "fidelity": {"steps": 2}}
    cfg = _config(tmp_path, tiny_model_dir, "study", "", {"on_fail": "warn"}, tune=tune)
    raw = yaml.safe_load(cfg.read_text())
    raw["tracking"] = {"backend": "auto"}
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["tune", str(cfg)]) == 0
    uri = f"sqlite:///{tmp_path / 'study' / 'trials' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("travel")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("trainpipe.tune.role") == "study")
    assert [r.data.tags.get("mlflow.parentRunId") for r in runs if r is not parent] == [parent.info.run_id]
