"""AutoGluon as a step of the pipeline DAG (`pipeline.automl: true`, pipeline/automl_step.py): `pipeline run` runs the
`automl` step after the data step (whose cached entry it reuses), a second run reuses every step, a change to the table
reruns the data step and the `automl` step; `pipeline compile --target kfp` compiles it as a component like any step of
one's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from test_automl_tabular import TABLE, autogluon_python  # noqa: F401 - the AutoGluon environment fixture
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _record(out: Path) -> dict:
    return {s["id"]: s for s in json.loads((out / "pipeline.json").read_text())["steps"]}


def test_the_automl_step_is_cached_by_content_like_any_step(tmp_path, autogluon_python, capsys):  # noqa: F811
    table = tmp_path / "bc.csv"
    shutil.copyfile(TABLE, table)
    out = tmp_path / "runs" / "bc"
    cfg = {"name": "bc", "model": {"args": {"hidden_size": 32, "depth": 1}},
           "data": {"sources": [{"path": "bc.csv"}], "label": "diagnosis", "eval_split": 0.2, "test_split": 0.2},
           "training": {"learning_rate": 1.0e-3, "num_train_epochs": 1, "per_device_train_batch_size": 32, "eval_steps": 20, "save_steps": 20},
           "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"}, "output_dir": str(out), "pipeline": {"automl": True},
           "automl": {"task": "tabular", "time_limit": 15, "memory_gib": 4, "python": autogluon_python}}
    config = tmp_path / "bc.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "run", str(config)]) == 0
    first = capsys.readouterr().out
    rec = _record(out)
    assert rec["automl"]["status"] == "ran" and rec["prepare"]["status"] == "ran", first
    published = out.with_name("bc.steps") / "automl" / "automl"  # a step of one's own: beside the built-in chain's run folder
    res = json.loads((published / "automl.json").read_text())
    assert res["winner"]["accuracy"] > res["trivial"]["accuracy"] + 0.2 and (published / "winner").is_dir()
    assert "data: cache reused" in first  # the step's data step is the prepare step's cached entry
    # the same config and data again: every step reused, the automl step included
    assert main(["pipeline", "run", str(config)]) == 0
    said = capsys.readouterr().out
    rec = _record(out)
    assert all(s["status"] == "reused" for s in rec.values()), said
    # one value of the table changes: the data step and the automl step run again
    lines = table.read_text().splitlines()
    cells = lines[1].split(",")
    cells[0] = str(float(cells[0]) + 1)
    table.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    assert main(["pipeline", "run", str(config)]) == 0
    rec = _record(out)
    assert rec["automl"]["status"] == "ran" and rec["prepare"]["status"] == "ran", capsys.readouterr().out
    # Kubeflow: the step compiles as a component beside the built-in ones
    target = tmp_path / "kfp.yaml"
    assert main(["pipeline", "compile", str(config), "--target", "kfp", "-o", str(target)]) == 0
    compiled = target.read_text()
    assert "automl" in compiled and "prepare" in compiled
