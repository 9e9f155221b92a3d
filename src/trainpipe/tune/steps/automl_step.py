"""The `automl` step of the pipeline DAG (`pipeline.automl: true`; pipeline/automl_step.py adds it): `trainpipe automl
--task tabular` of the config's `automl:` section, run by the DAG like a step of one's own (`python -m
trainpipe.pipeline.invoke`, its own process), so it is cached by content like any other step: its key is the data
sources' bytes, the prepare step's data report, the config (its parameter) and this function's source.

It writes only into the two outputs it is given: `config` (the run config it searched, YAML) and `automl` (the search's
folder: leaderboard, report, the neural run, AutoGluon's predictor, `winner/`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainpipe import ownership
from trainpipe.config import AutomlConfig
from trainpipe.tune.automl_tabular import automl_tabular


def run_step(inputs: dict, outputs: dict, params: dict) -> None:
    mapping = dict(params["config"])
    out = Path(outputs["automl"])
    mapping["automl"] = {**(mapping.get("automl") or {}), "output_dir": str(out)}
    mapping["output_dir"] = str(out / "neural")  # never read: the search's neural run goes to OUTPUT/neural
    config = ownership.write_text(Path(outputs["config"]), yaml.safe_dump(mapping, sort_keys=False), what="the config the AutoML step searched")
    automl_tabular(config, [], AutomlConfig.model_validate(mapping["automl"]))
