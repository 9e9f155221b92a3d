"""`trainpipe run`'s entry: a `stages:` / `method.adapters` config goes to the pipeline DAG, any other config is one run.

    run(cfg) --stages / adapters--> run_parts -> dag.run_pipeline -> steps._step_train -> trainpipe.run.run (each branch)
             --otherwise----------> trainpipe.run.run

`method.name: auto` is resolved here first by the objective rule (plan/objective.py): one objective, or `stages:` where
the rule says several. The DAG's train step calls one run (trainpipe/run.py) downward; nothing below calls back up here.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe import run as one_run
from trainpipe import rundir, ui
from trainpipe.config import RunConfig
from trainpipe.pipeline.dag import build_dag, run_pipeline
from trainpipe.pipeline.parts import part_names, prepare_parent_dir, seal_root
from trainpipe.plan.objective import expand_auto

RUN_STORE = ".trainpipe-store"  # `trainpipe run` of stages/adapters: the artefact store inside OUTPUT_DIR (trainpipe's own, rundir.ARTEFACTS)


def run(cfg: RunConfig, *, config_path: str | None = None, overwrite: bool = False, resume: bool = False, **options) -> dict:
    """`trainpipe run CONFIG`: the run's summary. ``options`` (`lineage`, `register`, `parent_run`, ...) go to the one run
    (trainpipe/run.py `run`); a stages / adapters run passes each branch's own to its runs from the DAG's train step."""
    if cfg.method.name == "auto":  # the objective rule (plan/objective.py): one objective, or `stages:` where it says several
        cfg, choice = expand_auto(cfg)
        ui.console().print(f"objective (method.name: auto): {choice.value}: {choice.rule}", markup=False, soft_wrap=True)
    if cfg.stages or cfg.method.adapters:  # several stages (e.g. RLHF: sft, reward, rl; pipeline/stages.py) or one adapter per
        # task (pipeline/adapters.py): the pipeline DAG of `trainpipe pipeline run`, one chain per part
        return run_parts(cfg, config_path=config_path, overwrite=overwrite, resume=resume)
    return one_run.run(cfg, config_path=config_path, overwrite=overwrite, resume=resume, **options)


def run_parts(cfg: RunConfig, *, config_path: str | None, overwrite: bool, resume: bool) -> dict:
    """`trainpipe run` of a `stages:` or `method.adapters` config: the same DAG as `trainpipe pipeline run`, executed by
    `run_pipeline` under OUTPUT_DIR's lock. Every branch's config is built and checked before anything is written.
    OUTPUT_DIR is refused when it holds an earlier run, unless `--resume` (finished steps are reused from the step
    cache, an unfinished train step continues from its newest valid checkpoint, later steps run) or `--overwrite` (cleared
    when trainpipe made it, and every step runs). The store is `pipeline.store`, else `OUTPUT_DIR/.trainpipe-store`.
    Returns the root summary (OUTPUT_DIR/summary.json)."""
    if cfg.output_dir is None:
        cfg = cfg.model_copy(update={"output_dir": f"runs/{cfg.name or 'run'}"})
    root = Path(cfg.output_dir).resolve()
    build_dag(cfg, check_inputs=True)  # every stage's / adapter's config, data files and base checked before the folder is touched
    rundir.check_not_data(root, rundir.protected_paths(cfg, config_path))
    with rundir.RunLock(root):  # one run per folder: the whole DAG holds OUTPUT_DIR, each branch's run its own folder
        prepare_parent_dir(cfg, overwrite, resume, "stages" if cfg.stages else "adapters", config_path=config_path)
        try:
            record = run_pipeline(cfg, config_path=config_path, store=cfg.pipeline.store or str(root / RUN_STORE), no_cache=overwrite, root_locked=True)
        finally:  # however the DAG ended: the root's artefacts and sub-run folders fingerprinted into its manifest
            seal_root(root, part_names(cfg))
    return json.loads(Path(record["summary"]).read_text(encoding="utf-8"))
