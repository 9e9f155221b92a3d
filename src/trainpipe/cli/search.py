"""`trainpipe tune | lr-find | batch-find | automl`: the search commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import ConfigArg, SetOpt, _numbers, app


@app.command()
def tune(
    config: ConfigArg,
    set_: SetOpt = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="Override `tune.n_trials` (finished trials of the study, all workers).")] = None,
    new_study: Annotated[bool, typer.Option("--new-study", help="Start a fresh study (the name with -2, -3, ...) instead of joining the config's, e.g. after changing the objective or the space (joining a study of another objective or space is refused).")] = False,
    emit: Annotated[Optional[str], typer.Option("--emit", help="katib: write the study as a Katib Experiment (kubeflow.org/v1beta1) and its ConfigMap into -o instead of running it here.")] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="--emit katib: the folder for katib-experiment.yaml.")] = Path("."),
    image: Annotated[Optional[str], typer.Option("--image", help="--emit katib: the trials' container image (default `trainpipe:<version>`, the repository's Dockerfile).")] = None,
    volume_claim: Annotated[Optional[str], typer.Option("--volume-claim", help="--emit katib: the PersistentVolumeClaim mounted at /workspace (default `trainpipe-<name>-workspace`).")] = None,
    parallel: Annotated[int, typer.Option("--parallel", help="--emit katib: trials at once (`parallelTrialCount`; Hyperband may need more).")] = 3,
) -> None:
    """Search the config's `tune.space` with Optuna: every trial an ordinary run under OUTPUT/trials/, bad trials pruned on
    the objective metric (`tune.objective.metric`, eval loss by default) at the in-training evals; writes best.yaml, leaderboard.csv/.html and best/model. Start the same command on several machines with
    `tune.storage: postgresql://...` to share one study."""
    from trainpipe.tune.tune import tune as run_tune

    _numbers(("--n-trials", n_trials, "the number of finished trials", 1), ("--parallel", parallel, "the trials at once", 1))
    if emit is not None:
        from trainpipe import ui
        from trainpipe.errors import ConfigError
        from trainpipe.tune.katib import write_katib

        if emit != "katib":
            raise ConfigError(f"`trainpipe tune --emit {emit}`: the study can be written for Katib only (`--emit katib`); "
                              "`trainpipe launch --emit ...` writes one run's launch files.")
        sets = list(set_ or []) + ([f"tune.n_trials={n_trials}"] if n_trials is not None else [])
        path, notes = write_katib(config, sets, out, image=image, volume_claim=volume_claim, parallel=parallel)
        ui.console().print(f"katib: {path}", markup=False, highlight=False)
        for note in notes:
            ui.console().print(note, markup=False, highlight=False)
        return
    run_tune(config, set_ or [], n_trials=n_trials, new_study=new_study)


@app.command("lr-find")
def lr_find(
    config: ConfigArg,
    set_: SetOpt = None,
    start: Annotated[float, typer.Option("--start", help="First learning rate of the sweep.")] = 1e-7,
    end: Annotated[float, typer.Option("--end", help="Last learning rate of the sweep.")] = 10.0,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps of the sweep (one micro-batch each).")] = 100,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Folder for lr_find.json / lr_find.svg (default OUTPUT_DIR-lr-find).")] = None,
) -> None:
    """LR range test: exponential sweep, smoothed loss, stop at divergence; prints the suggested lr as a `--set` line."""
    from trainpipe.config import load_config
    from trainpipe.tune.lrfind import lr_find as run_lr_find

    _numbers(("--start", start, "the first learning rate", 0.0, "gt"), ("--end", end, "the last learning rate", 0.0, "gt"),
             ("--steps", steps, "the optimizer steps of the sweep", 2))
    if end <= start:
        from trainpipe.numbers import OptionError

        raise OptionError(f"`--start {start:g} --end {end:g}`: the sweep goes up from --start to --end, so --end must be above --start. "
                          "Give e.g. `--start 1e-7 --end 10`.")
    run_lr_find(load_config(config, set_ or []), start=start, end=end, steps=steps, out_dir=out)


@app.command("batch-find")
def batch_find(
    config: ConfigArg,
    set_: SetOpt = None,
    max_memory_gib: Annotated[Optional[float], typer.Option("--max-memory-gib", help="Memory cap per device (GPU: a real allocator limit; CPU: checked against the planner's estimate, a simulated OOM).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Largest micro-batch to try.")] = 256,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Folder for batch_find.json (default OUTPUT_DIR-batch-find).")] = None,
) -> None:
    """The largest micro-batch that fits (doubling, then binary search), and the accumulation for the target effective batch."""
    from trainpipe.config import load_config
    from trainpipe.tune.batchfind import batch_find as run_batch_find

    _numbers(("--max-memory-gib", max_memory_gib, "the memory cap per device in GiB", 0.0, "gt"), ("--max-batch", max_batch, "the largest micro-batch to try", 1))
    run_batch_find(load_config(config, set_ or []), max_memory_gib=max_memory_gib, max_batch=max_batch, out_dir=out)


@app.command()
def automl(
    config: Annotated[Optional[Path], typer.Argument(help="A config with an `automl:` section (only that section is read); or leave it out and give the keys with --set.", show_default=False)] = None,
    set_: SetOpt = None,
    task: Annotated[Optional[str], typer.Option("--task", help="`automl.task`: sft | classification | preference, or tabular (CONFIG is then a tabular run config, searched by AutoGluon beside trainpipe's model), or image-classification | text-classification | custom (CONFIG is a run config of that family; `automl.candidates` and `automl.space` searched by successive halving).")] = None,
) -> None:
    """Candidates (models and catalogue, planner's method) x Optuna hyperparameters -> budgeted successive halving (survivors continue) -> leaderboard -> winner/.

    The settings are the `automl:` section of CONFIG and `--set automl.KEY=VALUE` (task, data, models, catalog, models_dir,
    output_dir, gpu, gpus, max_params, budget_usd, budget_hours, arms_per_model, lr_spread, lr_range, seed, proposer,
    min_steps, rungs, eta, eval_split, max_length, batch_size; `trainpipe config schema` describes each), e.g.
    `trainpipe automl --set automl.data=train.jsonl --set automl.models=path/to/model,Qwen/Qwen2.5-0.5B`.
    `automl.proposer: module:function` runs Python code you name (the built-in proposer otherwise; `none`: no proposals)."""
    from trainpipe.tune.automl import automl as run_automl
    from trainpipe.tune.automl import load_automl

    sets = list(set_ or []) + ([f"automl.task={task}"] if task is not None else [])
    if task in ("tabular", "image-classification", "text-classification", "custom") and config is not None:  # a tabular run config needs no `automl:` section: its settings may all come from --set
        from trainpipe.config import read_yaml

        a = load_automl(config if isinstance(read_yaml(config).get("automl"), dict) else None, sets)
    else:
        a = load_automl(config, sets)
    if a.task == "tabular":  # AutoGluon beside trainpipe's tabular model and the trivial predictor (tune/automl_tabular.py)
        from trainpipe.errors import ConfigError
        from trainpipe.tune.automl_tabular import automl_tabular

        if config is None:
            raise ConfigError("`trainpipe automl --task tabular` needs CONFIG, a run config of the tabular family (`data.sources`, "
                              "`data.label` or `data.target`, `data.test_split`), e.g. `trainpipe automl examples/tabular/run.yaml --task tabular`.")
        automl_tabular(config, sets, a)
        return
    if a.task in ("image-classification", "text-classification", "custom"):  # model selection / architecture search on a run config
        from trainpipe.errors import ConfigError
        from trainpipe.tune.automl_family import automl_family

        if config is None:
            raise ConfigError(f"`trainpipe automl --task {a.task}` needs CONFIG, a run config of the task's family (an image classifier, "
                              "`method.name: classification` on text, or a `model.factory` module), e.g. "
                              "`trainpipe automl examples/image-classification/run.yaml --task image-classification`.")
        automl_family(config, sets, a)
        return
    run_automl(a)
