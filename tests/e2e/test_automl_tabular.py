"""`trainpipe automl --task tabular` for real: AutoGluon 1.6.3 in its own environment (made by scripts/automl_venv.sh, the
setup step this test runs: AutoGluon pins pandas below 2.4, trainpipe pandas 3) beside trainpipe's own tabular model and
the trivial predictor, on scikit-learn's breast cancer table, all scored on the same test split by trainpipe's metric
functions; the test split written only after AutoGluon's fit; the winner predicting through `trainpipe predict`; and,
without AutoGluon, one paragraph saying how to install it."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "examples" / "tabular" / "data" / "breast_cancer.csv"


@pytest.fixture(scope="session")
def autogluon_python() -> str:
    """The AutoGluon interpreter: scripts/automl_venv.sh (reuses an environment that has the pinned AutoGluon)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "automl_venv.sh")], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, "scripts/automl_venv.sh failed:\n" + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def write_config(tmp: Path, **automl) -> Path:
    cfg = {"name": "bc", "model": {"args": {"hidden_size": 64, "depth": 2, "dropout": 0.1}},
           "data": {"sources": [{"path": str(TABLE)}], "label": "diagnosis", "eval_split": 0.2, "test_split": 0.2},
           "training": {"learning_rate": 1.0e-3, "num_train_epochs": 6, "per_device_train_batch_size": 32, "eval_steps": 20, "save_steps": 20},
           "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp / 'mlflow.db'}"}, "gates": {"on_fail": "warn"}, "output_dir": str(tmp / "unused"),
           "automl": {"task": "tabular", "time_limit": 45, "output_dir": str(tmp / "automl"), **automl}}
    p = tmp / "bc.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_autogluon_beats_the_neural_model_and_the_trivial_predictor_on_one_test_split(tmp_path, autogluon_python, capsys):
    config = write_config(tmp_path, python=autogluon_python, memory_gib=4)
    assert main(["automl", str(config)]) == 0
    out = tmp_path / "automl"
    res = json.loads((out / "automl.json").read_text())
    board = res["leaderboard"]
    ag = [r for r in board if r["engine"] == "autogluon"]
    assert {r["model"] for r in ag} >= {"LightGBM", "RandomForest", "ExtraTrees", "KNeighbors", "LinearModel"}, [r["model"] for r in ag]
    assert all(r["fit_seconds"] >= 0 and r["predict_seconds"] > 0 for r in ag)
    best_ag = max(r["accuracy"] for r in ag)
    neural, trivial = res["neural"]["accuracy"], res["trivial"]["accuracy"]
    assert res["winner"]["accuracy"] == max(r["accuracy"] for r in board) and best_ag >= neural, board
    assert best_ag >= trivial + 0.25 and best_ag >= 0.93, (best_ag, trivial)
    # one data step: AutoGluon's splits are the rows trainpipe's own run trained, tuned and was tested on
    neural_summary = json.loads((out / "neural" / "summary.json").read_text())
    import pandas as pd

    n = {k: len(pd.read_parquet(out / "splits" / f"{k}.parquet")) for k in ("train", "eval", "test")}
    assert n == res["rows"] and n["test"] == len([r for r in csv.DictReader(TABLE.open())]) - n["train"] - n["eval"]
    assert neural_summary["test"]["accuracy"] == neural
    # the test split reached no fit: its file was written after every file of AutoGluon's predictor
    fitted = max(p.stat().st_mtime for p in (out / "autogluon").rglob("*") if p.is_file())
    assert (out / "splits" / "test.parquet").stat().st_mtime >= fitted
    from mlflow import MlflowClient  # the search as one MLflow run: every model's test metric

    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(res["mlflow_run_id"])
    assert run.data.params["winner"] == res["winner"]["model"] and run.data.metrics["LightGBM.test_accuracy"] == next(r["accuracy"] for r in ag if r["model"] == "LightGBM")
    page = (out / "report.html").read_text()
    assert "<svg" in page and "<script" not in page and all(r["model"] in page for r in board)
    # the winner predicts through `trainpipe predict`, with the preprocessing fitted at training
    target = tmp_path / "pred.csv"
    assert main(["predict", str(out / "winner"), "--data", str(TABLE), "--out", str(target)]) == 0
    preds = list(csv.DictReader(target.open()))
    truth = [r["diagnosis"] for r in csv.DictReader(TABLE.open())]
    assert len(preds) == len(truth) and sum(p["prediction"] == t for p, t in zip(preds, truth)) / len(truth) > 0.93
    # and `trainpipe eval` measures it on the config's own test split: the leaderboard's figure again
    if res["winner"]["engine"] == "autogluon":
        capsys.readouterr()
        assert main(["eval", str(out / "winner"), "--config", str(config)]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("test accuracy "))
        assert float(line.split()[-1]) == pytest.approx(res["winner"]["accuracy"], abs=1e-6)


def test_without_autogluon_the_command_says_how_to_install_it(tmp_path, capsys):
    config = write_config(tmp_path, python=str(tmp_path / "no-such-python"))
    assert main(["automl", str(config)]) == 2
    cap = capsys.readouterr()
    text = " ".join((cap.out + cap.err).split())
    assert "scripts/automl_venv.sh" in text and "automl.python" in text and "Traceback" not in text
    assert not (tmp_path / "automl").exists()


def test_run_then_automl_on_the_same_config_prepare_the_data_once(tmp_path, autogluon_python, capsys):
    """One cached data step (train/prepared_cache.py): `trainpipe run` prepares the table; `trainpipe automl` on the same
    config, and the neural run inside it, reuse that entry (another output folder, the same content key)."""
    config = write_config(tmp_path, python=autogluon_python, memory_gib=4, time_limit=15)
    raw = yaml.safe_load(config.read_text())
    raw["tracking"] = {"backend": "none"}
    raw["training"]["num_train_epochs"] = 1
    config.write_text(yaml.safe_dump(raw))
    assert main(["run", str(config)]) == 0
    first = capsys.readouterr().out
    assert first.count("data: cache written") == 1 and "data: cache reused" not in first
    assert main(["automl", str(config)]) == 0
    second = capsys.readouterr().out
    assert "data: cache written" not in second and second.count("data: cache reused") == 2  # AutoGluon's splits and the neural run
    ran = json.loads((tmp_path / "unused" / "data_report.json").read_text())
    res = json.loads((tmp_path / "automl" / "automl.json").read_text())
    assert res["rows"] == {"train": ran["train_examples"], "eval": ran["eval_examples"], "test": ran["splits"]["test"]}
