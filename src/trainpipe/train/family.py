"""Model families: where a new kind of model plugs in (docs/architecture.md, "Model families: where a new one plugs in").

A family is the parts that differ between a text LM, a table and your own module; everything else (the plan, the run
directory, the resilient loop with its strategies, checkpoints, resume, recovery, gates, report, tracking, the
pipeline DAG) is shared. :class:`Family` names the parts; :func:`family` maps a family's name (config/family.py
`resolve_family`: `model.family`, or the `auto` rule, printed with the plan) to them. It is a function over a fixed
set of names, not a registry: a new family adds a branch here and its parts beside the layers that own them.

- ``prepare(cfg)``: the data step. Reads and accounts for every record, splits, fits what is fitted on the training
  split only (through train/prepared_cache.py: one content key, whichever command asks); returns an object with ``train``, ``eval``, ``test`` (lists the loop indexes) and ``report`` (the data
  report: `records_read`, `records_kept`, `dropped`, `rejected_total`, `sources`, `train_examples`, `eval_examples`).
  The text family's data step is run.py's own (tokenizer, chat template, cache): ``prepare`` is None for it.
- ``run(ctx)``: the recipe: build the model, the objective (train/objectives.py `Objective`: weight, collate, loss_sum),
  measure the baseline (with a trivial predictor), train with train/sft.py `build_loop` + `train`, measure again,
  export; returns the summary.
- ``predict(model_or_run_dir, data_path, out_path)``: `trainpipe predict`: the exported model on new data, written to
  ``out_path``; returns a small summary. None where the family has no predict command yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainpipe.config.family import FAMILIES
from trainpipe.errors import ConfigError
from trainpipe.export_family import META, model_folder, predict_file
from trainpipe.train import image, supervised, textgen
from trainpipe.train.prepared_cache import cached
from trainpipe.train.context import RunContext


@dataclass(frozen=True)
class Family:
    name: str
    prepare: Callable[[Any], Any] | None  # cfg -> prepared data (train, eval, test, report); None: run.py's text data step
    run: Callable[[RunContext], dict] | None  # the recipe; None: the text recipes of `method.name` (run.py `recipe_for`)
    predict: Callable[[Path, Path, Path], dict] | None  # (run dir or model folder, data file, output file) -> summary


def family(name: str) -> Family:
    """The parts of the family ``name`` (one of config/family.py `FAMILIES`)."""
    if name == "text":  # generation (causal LM) or a class per text (classifier): train/textgen.py
        return Family("text", None, None, textgen.predict_file)
    if name in ("tabular", "custom"):
        return Family(name, functools.partial(cached, name, supervised.prepare), supervised.run, predict_file)
    if name == "image":
        return Family(name, functools.partial(cached, name, image.prepare), image.run, image.predict_file)
    raise ConfigError(f"`model.family: {name}` has no implementation in this version of trainpipe (families: {', '.join(FAMILIES)}).")


def family_of_export(path: Path) -> str:
    """The family of a run directory's (or model folder's) export: `trainpipe_model.json` names it (tabular, custom, ...);
    a folder without one is a text model (transformers' `config.json`)."""
    import json

    p = Path(path)
    if (p / META).is_file() or (p / "model" / META).is_file():
        return json.loads((model_folder(p) / META).read_text(encoding="utf-8"))["family"]
    if (p / "config.json").is_file() or (p / "model" / "config.json").is_file():
        return "text"
    raise ConfigError(f"`{path}` holds no exported model (no `model/` folder with `{META}` or `config.json`); give the directory of a finished run.")
