"""`tune.max_params` on an architecture search: `tune.space` over the tabular MLP's `model.args.hidden_size`; a trial whose
model (built on the CPU from the trial's config, counted, not trained) is above the limit is never started (no run folder,
pruned with its count, not counted in `n_trials`); the trials within it train and the study ends with a winner."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import yaml

from trainpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_a_model_above_max_params_is_never_started(tmp_path):
    cfg = {"name": "arch", "model": {"args": {"hidden_size": 8, "depth": 1, "dropout": 0.0}},
           "data": {"sources": [{"path": str(ROOT / "examples" / "tabular" / "data" / "breast_cancer.csv")}], "label": "diagnosis", "eval_split": 0.2},
           "training": {"learning_rate": 3.0e-3, "max_steps": 6, "per_device_train_batch_size": 32, "eval_steps": 3, "save_steps": 3},
           "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"}, "output_dir": str(tmp_path / "study"),
           "tune": {"space": {"model.args.hidden_size": {"choice": [4, 512]}}, "objective": {"metric": "accuracy"}, "n_trials": 1,
                    "sampler": "grid", "pruner": "none", "seed": 0, "max_params": 2000, "storage": "sqlite:///" + str(tmp_path / "s.db")}}
    p = tmp_path / "arch.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["tune", str(p)]) == 0
    trials = optuna.load_study(study_name="arch", storage=cfg["tune"]["storage"]).get_trials()
    big = [t for t in trials if t.params["model.args.hidden_size"] == 512]
    small = [t for t in trials if t.params["model.args.hidden_size"] == 4]
    assert big and all(t.state.name == "PRUNED" and "tune.max_params" in t.user_attrs["skipped"] for t in big)
    assert all(t.user_attrs["parameters"] > 2000 and not Path(t.user_attrs["run_dir"]).exists() for t in big)
    assert len(small) == 1 and small[0].state.name == "COMPLETE"  # the one trial of n_trials: the skipped one did not count
    out = json.loads((tmp_path / "study" / "tune.json").read_text())
    assert out["best"]["params"] == {"model.args.hidden_size": 4}
