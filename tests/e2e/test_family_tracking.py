"""MLflow on the model families of issue 30, through the real library (a SQLite store beside the run, as the text runs'
default): a tabular classification run, a tabular regression run and a custom-module run each log their parameters
(`model.args.*`, the resolved family and task), every metric line of metrics.jsonl, the task metrics of the baseline and
the final eval (accuracy, macro-F1, balanced accuracy, log-loss; RMSE, MAE, R²), and the exported model (weights, the
fitted preprocessing, the family's metadata), registered with its lineage."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import yaml

from test_custom_module import write as write_custom
from test_tabular import write_config as write_tabular, write_table
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _mlflow_run(run_dir: Path, uri: str):
    from mlflow import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return client, client.get_run(state["run_id"]), state


def _assert_logged(run_dir: Path, uri: str, task_metrics: tuple[str, ...], model_files: set[str]) -> dict:
    client, run, state = _mlflow_run(run_dir, uri)
    assert run.info.status == "FINISHED"
    summary = json.loads((run_dir / "summary.json").read_text())
    for k in task_metrics:  # the task metrics of the final eval and of the baseline (the trivial predictor), as summary.json has them
        assert run.data.metrics[f"final.{k}"] == pytest.approx(summary["final"][k]), k
        assert run.data.metrics[f"baseline.{k}"] == pytest.approx(summary["baseline"][k]), k
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for key in ("loss", *(f"eval_{k}" for k in task_metrics if any(f"eval_{k}" in r for r in lines))):
        want = sorted((int(r["step"]), float(r[key])) for r in lines if key in r)
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert want and got == want, key  # every point once
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.resolved.yaml", "data_report.json", "plan.json", "summary.json", "model"} <= names
    assert model_files <= {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    mv = client.get_model_version(state["registered"]["name"], state["registered"]["version"])
    assert mv.run_id == run.info.run_id
    assert mv.tags["trainpipe.config_hash"] == json.loads((run_dir / "manifest.json").read_text())["config_hash"]
    return run.data.params


def _tracked(cfg: Path, uri: str) -> Path:
    doc = yaml.safe_load(cfg.read_text())
    doc["tracking"] = {"backend": "mlflow", "uri": uri, "experiment": "families"}
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def test_tabular_classification_and_regression_runs_log_task_metrics_and_the_model_to_mlflow(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_table(tmp_path / "table.csv")
    cfg = _tracked(write_tabular(tmp_path, training={"num_train_epochs": 3}), uri)
    assert main(["run", str(cfg)]) == 0
    params = _assert_logged(tmp_path / "run", uri, ("accuracy", "macro_f1", "balanced_accuracy", "log_loss"),
                            {"model.safetensors", "preprocessing.json", "trainpipe_model.json"})
    assert params["model.args.hidden_size"] == "32" and params["model.args.depth"] == "2" and params["data.label"] == "label"
    assert params["model.family"] in ("auto", "tabular")

    rng = random.Random(1)
    with (tmp_path / "reg.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["a", "b", "y"])
        for _ in range(300):
            a, b = rng.gauss(0, 1), rng.gauss(0, 1)
            w.writerow([round(a, 4), round(b, 4), round(3 * a - 2 * b + rng.gauss(0, 0.1), 4)])
    reg = tmp_path / "reg"
    reg.mkdir()
    cfg = write_tabular(reg, data={"sources": [{"path": str(tmp_path / "reg.csv")}], "label": None, "target": "y", "eval_split": 0.25},
                        training={"num_train_epochs": 3})
    assert main(["run", str(_tracked(cfg, uri))]) == 0
    params = _assert_logged(reg / "run", uri, ("rmse", "mae", "r2"), {"model.safetensors", "preprocessing.json", "trainpipe_model.json"})
    assert params["data.target"] == "y"
    s = json.loads((reg / "run" / "summary.json").read_text())
    assert s["final"]["rmse"] < s["baseline"]["rmse"]  # learnt more than the training mean


def test_custom_module_run_logs_its_args_metrics_and_model_to_mlflow(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _tracked(write_custom(tmp_path, "custom"), uri)
    assert main(["run", str(cfg)]) == 0
    params = _assert_logged(tmp_path / "custom", uri, ("accuracy", "macro_f1", "balanced_accuracy"), {"model.safetensors", "trainpipe_model.json"})
    assert params["model.factory"].endswith("net.py:build") and params["model.args.hidden"] == "16" and params["method.loss"] == "cross_entropy"
