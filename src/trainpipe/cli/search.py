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
) -> None:
    """Search the config's `tune.space` with Optuna: every trial an ordinary run under OUTPUT/trials/, bad trials pruned on
    the objective metric (`tune.objective.metric`, eval loss by default) at the in-training evals; writes best.yaml, leaderboard.csv/.html and best/model. Start the same command on several machines with
    `tune.storage: postgresql://...` to share one study."""
    from trainpipe.tune.tune import tune as run_tune

    _numbers(("--n-trials", n_trials, "the number of finished trials", 1))
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
    task: Annotated[str, typer.Option("--task", help="sft | classification | preference.")],
    data: Annotated[Path, typer.Option("--data", help="Training data (JSONL); the eval split is cut from it once, the same for every candidate.")],
    models: Annotated[str, typer.Option("--models", help="Candidate base models, comma-separated: local folders, hub ids, or ID=PATH (a catalogue id trained from a local folder).")] = "",
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (runs, leaderboard.csv, automl.json, winner/).")] = Path("runs/automl"),
    catalog: Annotated[bool, typer.Option("--catalog", help="Also every catalogue model of the task's kind within the constraints (listed with the reason when not trained).")] = False,
    models_dir: Annotated[Optional[Path], typer.Option("--models-dir", help="Local weights for catalogue ids: subfolders named `org--name` or `org/name`.")] = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs of type --gpu per arm (the method and the price).")] = 1,
    arms_per_model: Annotated[int, typer.Option("--arms-per-model", help="Hyperparameter sets per candidate, sampled by Optuna TPE.")] = 2,
    lr_spread: Annotated[float, typer.Option("--lr-spread", help="Learning rates from the planner's default / spread to x spread (log-uniform).")] = 3.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the hyperparameter sampler.")] = 0,
    lr_range: Annotated[Optional[str], typer.Option("--lr-range", help="LOW:HIGH learning rates to sample from instead of the planner's default / and x --lr-spread.")] = None,
    proposer: Annotated[Optional[str], typer.Option("--proposer", help="module:function or file.py:function (runs Python code you name) proposing changes to surviving arms before each rung; default (sft): the built-in one (an arm whose eval loss moved < 1 % over the rung gets an LR range test on 1 % of the data and, if its suggestion is > 3x away, a new arm at it); `none`: no proposals.")] = None,
    budget_usd: Annotated[Optional[float], typer.Option("--budget-usd", help="Stop before a rung the planner prices above what is left.")] = None,
    budget_hours: Annotated[Optional[float], typer.Option("--budget-hours", help="Start no rung after this much wall time.")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU type that picks the methods and prices the rungs (default: this machine's).")] = None,
    max_params: Annotated[Optional[float], typer.Option("--max-params", help="Largest base model, in parameters (e.g. 8e9).")] = None,
    min_steps: Annotated[int, typer.Option("--min-steps", help="Steps of the first rung.")] = 4,
    rungs: Annotated[int, typer.Option("--rungs", help="Rungs of successive halving.")] = 3,
    eta: Annotated[int, typer.Option("--eta", help="Keep 1/eta of the candidates per rung; survivors train eta x longer.")] = 2,
    eval_split: Annotated[int, typer.Option("--eval-split", help="Held-out records (fixed for the search).")] = 32,
    max_length: Annotated[int, typer.Option("--max-length", help="Longest example in tokens.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Effective batch per optimizer step; the micro-batch and accumulation for it are the planner's on --gpu.")] = 8,
) -> None:
    """Candidates (models and catalogue, planner's method) x Optuna hyperparameters -> budgeted successive halving (survivors continue) -> leaderboard -> winner/."""
    from trainpipe.tune.automl import automl as run_automl

    _numbers(("--gpus", gpus, "the GPUs per arm", 1), ("--arms-per-model", arms_per_model, "the hyperparameter sets per candidate", 1),
             ("--lr-spread", lr_spread, "the learning-rate spread factor", 1.0, "gt"), ("--budget-usd", budget_usd, "the budget in US dollars", 0.0, "gt"),
             ("--budget-hours", budget_hours, "the wall-time budget in hours", 0.0, "gt"), ("--max-params", max_params, "the largest model's parameters", 0.0, "gt"),
             ("--min-steps", min_steps, "the steps of the first rung", 1), ("--rungs", rungs, "the number of rungs", 1),
             ("--eta", eta, "the halving factor", 2), ("--eval-split", eval_split, "the held-out records", 1),
             ("--max-length", max_length, "the longest example in tokens", 1), ("--batch-size", batch_size, "the effective batch", 1))
    run_automl(task=task, data=data, models=[m.strip() for m in models.split(",") if m.strip()], out_dir=out, budget_usd=budget_usd,
               budget_hours=budget_hours, gpu=gpu, max_params=max_params, min_steps=min_steps, eta=eta, rungs=rungs, eval_split=eval_split,
               max_length=max_length, batch_size=batch_size, use_catalog=catalog, models_dir=models_dir, gpus=gpus, arms_per_model=arms_per_model,
               lr_spread=lr_spread, seed=seed, proposer=proposer or "builtin", lr_range=_lr_range(lr_range))

def _lr_range(text: str | None) -> tuple[float, float] | None:
    from trainpipe.errors import ConfigError

    if not text:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"`--lr-range {text}` must be LOW:HIGH, two numbers (e.g. 1e-5:1e-3).") from None
    return lo, hi
