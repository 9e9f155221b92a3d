"""The shipped examples of the tabular and custom families (examples/tabular, tabular-regression, custom-module), each
trained through `trainpipe run` with fewer epochs: far above the trivial predictor on held-out rows, exported, and
`trainpipe predict` on the shipped table writes exactly what the run's final eval predicted for its eval rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from trainpipe.cli import main

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name, epochs, data", [
    ("tabular", 4, "breast_cancer.csv"), ("tabular-regression", 10, "diabetes.csv"), ("custom-module", 10, "wine.csv"),
])
def test_example_trains_beats_guessing_and_its_export_predicts_like_the_final_eval(tmp_path, capsys, name, epochs, data):
    run = tmp_path / "run"
    assert main(["run", str(EXAMPLES / name / "run.yaml"), "--set", f"output_dir={run}", "--set", f"training.num_train_epochs={epochs}",
                 "--set", "training.early_stopping_patience=null"]) == 0, capsys.readouterr().out[-3000:]
    s = json.loads((run / "summary.json").read_text())
    final, trivial = s["final"], s["trivial"]
    if s["task"] == "classification":
        assert final["accuracy"] > trivial["majority_accuracy"] + 0.25, (final, trivial)
    else:
        assert final["rmse"] < 0.85 * trivial["rmse"] and final["r2"] > 0.25, (final, trivial)
    out = tmp_path / "pred.csv"
    assert main(["predict", str(run), "--data", str(EXAMPLES / name / "data" / data), "--out", str(out)]) == 0
    with out.open() as fh:
        by_line = {i + 2: row for i, row in enumerate(csv.DictReader(fh))}
    evald = json.loads((run / "eval_predictions.json").read_text())
    assert evald
    for e in evald:
        got = by_line[e["line"]]["prediction"]
        assert (got == e["prediction"]) if s["task"] == "classification" else abs(float(got) - e["prediction"]) < 1e-3, (got, e)
