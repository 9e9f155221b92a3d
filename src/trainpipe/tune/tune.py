"""`trainpipe tune CONFIG`: an Optuna study over the config's `tune.space`, every trial an ordinary `trainpipe run`.

Reads top to bottom:

1. check before any trial: the space (every key a config key, every range non-empty, every bound a valid value:
   tune/space.py), the objective metric, the storage (reachable), the budget (pays for at least one trial);
2. the study: sampler (tpe | gp | cmaes | random | grid | qmc), pruner (median | asha | hyperband | none) on the
   intermediate objective metric, storage (SQLite in the study folder, or a shared `postgresql://` database for several
   workers: each worker heartbeats its running trial; a trial whose worker died is failed and retried once,
   Optuna's `RetryFailedTrialCallback`);
3. each trial: sample -> the trial's config (the fidelity: fewer steps or a share of the data) -> the planner's plan
   (a plan that does not fit the memory is never started: the trial is pruned with the reason) -> `pipeline.run.run`
   into `OUTPUT/trials/trial-NNNN/`, with an eval hook that reports the objective metric to the pruner and stops a pruned
   trial cleanly (event `trial_pruned`, no export) -> the final metric;
4. outputs: `best.yaml` (the best trial's config, ready to run, full data and steps), `leaderboard.{csv,html}` and a
   terminal table (tune/leaderboard.py), `best/model` (the best trial's exported model), `tune.json`.

The intermediate value the pruner sees is the study's objective metric (`tune.objective.metric`, in the study's direction)
as the recipe's in-training eval measured it (train/loop.py `loop.eval_metrics`: classification accuracy, preference
accuracy and margins, loss and perplexity, generated metrics with `eval.generate_in_training`), every `training.eval_steps`
on the same eval split as the final metric. An objective the in-training evals never measure is refused before any trial
unless `tune.pruner: none` (then trials are compared on their final value only, and the study says so).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import yaml

from trainpipe import ownership, ui
from trainpipe.config import RunConfig, TuneConfig, apply_overrides, build_config, load_config, read_yaml
from trainpipe.config.family import resolve_family, resolve_task
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.events import read_events
from trainpipe.metrics import (  # noqa: F401 - the table's names, re-exported for tune's callers
    ALIASES, DIRECTIONS, IN_TRAINING_METRICS, METHOD_METRICS, MINIMIZED, NO_DIRECTION, TASK_METRICS, MetricDirectionError, metric_direction, metric_key,
)
from trainpipe.metrics import in_training_metrics as _in_training_metrics
from trainpipe.pipeline.run import run
from trainpipe.redact import MASK, redact_obj, redact_url
from trainpipe.rundir import protected_paths
from trainpipe.track.tracking import resolve_settings
from trainpipe.train.callbacks import EvalHook
from trainpipe.train.errors import StopTrial
from trainpipe.tune import leaderboard as LB
from trainpipe.tune import space as S
from trainpipe.tune.plans import _this_gpu, plan_fits, price_trial, too_big  # noqa: F401 - _this_gpu: automl's and the tests' way in
from trainpipe.tune.study import (
    OBJECTIVE_ATTR, SPACE_ATTR, StudyRun, TuneError, check_study, create_study, distinct_per_trial, fresh_study_name, make_pruner,
    disk_full, make_sampler, no_winner, open_storage, storage_url, study_identity, trial_output,
)

def direction_of(t: TuneConfig) -> str:
    if t.objective.direction != "auto":
        return t.objective.direction
    if t.objective.function and "metric" not in t.objective.model_fields_set:
        raise MetricDirectionError(
            f"`tune.objective.function: {t.objective.function}` returns a number trainpipe cannot interpret, and "
            "`tune.objective.direction` is `auto` (the default): whether a trial with a higher value is better is known only to "
            "that function. Set `tune.objective.direction: minimize` or `maximize`. No trial was started.",
            ["tune.objective.direction: auto with tune.objective.function"],
        )
    return metric_direction(t.objective.metric, key="tune.objective.direction", field="tune.objective.metric")


def rank_checkpoints_by_objective(mapping: dict, cfg: RunConfig, direction: str) -> dict:
    """A trial's config ranks its checkpoints (the exported model, early stopping) by the study's objective when the in-training
    evals measure it, unless the user set `training.metric_for_best` / `greater_is_better` themselves."""
    t = cfg.tune
    if t is None or t.objective.function:
        return mapping
    m = metric_key(t.objective.metric)
    if m not in in_training_metrics(cfg):
        return mapping
    training = mapping.setdefault("training", {})
    if "metric_for_best" not in training:
        training["metric_for_best"] = m
        training.setdefault("greater_is_better", direction == "maximize")
    return mapping


# --------------------------------------------------------------------------- 1. checks before any trial


def load_study_config(path: str | Path, overrides: list[str]) -> tuple[RunConfig, dict, Path]:
    """(the validated config, the raw mapping trials are built from, the config's folder)."""

    path = Path(path)
    cfg = load_config(path, overrides)
    if cfg.tune is None:
        raise ConfigError(f"`{path}` has no `tune:` section. Add one, e.g. `tune: {{space: {{training.learning_rate: {{log_uniform: [1e-5, 1e-3]}}}}, n_trials: 20}}`.")
    raw = apply_overrides(read_yaml(path), overrides)
    raw.pop("tune", None)
    if cfg.stages or cfg.method.adapters:
        raise ConfigError("`trainpipe tune` searches one run; a config with `stages` or `method.adapters` is several. Tune one stage's config on its own.")
    return cfg, raw, path.resolve().parent


def in_training_metrics(cfg: RunConfig) -> tuple[str, ...]:
    """The metrics a run of ``cfg`` measures at every in-training eval (what the pruner can be given)."""
    if resolve_family(cfg.model, cfg.data)[0] != "text":  # tabular, custom, image: the task's metrics at every eval
        return TASK_METRICS[resolve_task(cfg.method, cfg.data)[0]]
    return _in_training_metrics(cfg.method.name, cfg.eval.metrics, cfg.eval.generate_in_training)


def check_metric(cfg: RunConfig) -> str | None:
    """Refuse an objective the run never measures at the end, or (with a pruner) at its in-training evals. Returns a note when
    the objective is measured only at the end and the pruner is `none` (trials are then compared on their final value only)."""
    t = cfg.tune
    if t.objective.function:
        return None
    name = t.objective.metric
    m = metric_key(name)
    shown = m if m == name else f"{name}` (`{m}`"
    allowed = METHOD_METRICS.get(cfg.method.name) or tuple(cfg.eval.metrics)
    if resolve_family(cfg.model, cfg.data)[0] != "text":
        allowed = in_training_metrics(cfg)
    if m not in allowed:
        raise ConfigError(
            f"`tune.objective.metric: {shown}` is not measured by a `{cfg.method.name}` run with this config (it measures {', '.join(allowed)}). "
            + ("Add it to `eval.metrics` or choose one of those." if cfg.method.name not in METHOD_METRICS else "Choose one of those.")
        )
    during = in_training_metrics(cfg)
    if m in during:
        return None
    generated = cfg.method.name in ("sft", "pretrain") and m != "perplexity"
    if t.pruner != "none":
        raise ConfigError(
            f"`tune.objective.metric: {shown}` is measured only at the end of a `{cfg.method.name}` run, but `tune.pruner: {t.pruner}` prunes on "
            f"the in-training evals, which measure {', '.join(during)}: the pruner would stop trials on a different quantity than the study "
            f"selects on. Choose one of those as the objective, "
            + ("set `eval.generate_in_training: true` to generate and score at every eval (slower), " if generated else "")
            + "or set `tune.pruner: none` to compare trials on their final value only. No trial was started."
        )
    return (f"`{name}` is measured at the end of each trial only (the in-training evals measure {', '.join(during)}); with `tune.pruner: none` "
            "every trial runs to the end and is compared on its final value.")


def load_function(ref: str, base_dir: Path) -> Callable:
    mod, _, fn = ref.rpartition(":")
    if not mod or not fn:
        raise ConfigError(f"`tune.objective.function: {ref}` must be `module:function` or `path/to/file.py:function`.")
    try:
        if mod.endswith(".py"):
            p = Path(mod) if Path(mod).is_absolute() else base_dir / mod
            spec = importlib.util.spec_from_file_location(f"trainpipe_tune_objective_{p.stem}", p)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod)
        return getattr(module, fn)
    except (ImportError, FileNotFoundError, AttributeError) as exc:
        raise ConfigError(f"`tune.objective.function: {ref}` cannot be loaded: {exc}. Give an importable module or an existing file, and a function defined there.") from None


# --------------------------------------------------------------------------- 3. one trial


def trial_mapping(raw: dict, values: dict, t: TuneConfig, run_dir: Path, *, fidelity: bool = True, base_dir: Path | None = None) -> dict:
    """A trial's config mapping: the sampled values applied, its run folder, the fidelity (``base_dir``: where the config's
    relative data paths point, for counting the records of a `data_fraction`)."""
    m = S.apply(raw, values)
    m.pop("tune", None)
    m["output_dir"] = str(run_dir)
    if fidelity and t.fidelity.steps:
        m.setdefault("training", {})["max_steps"] = t.fidelity.steps
    if fidelity and t.fidelity.data_fraction and t.fidelity.data_fraction < 1:
        for src in (m.get("data") or {}).get("sources", []):
            n = _count_records(src, base_dir)
            if n:
                src["max_records"] = max(1, int(math.ceil(n * t.fidelity.data_fraction)))
    return m


def _count_records(src: dict, base_dir: Path | None) -> int | None:
    p = src.get("path")
    if not p:
        return None
    path = Path(p) if Path(p).is_absolute() else (base_dir or Path.cwd()) / p
    if not path.is_file() or path.suffix not in (".jsonl", ".txt"):
        return None
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


class Objective:
    """Optuna's objective: one trial = sample -> config -> plan check -> run (or the surrogate function) -> final metric."""

    def __init__(self, cfg: RunConfig, raw: dict, base_dir: Path, study_dir: Path, params: list[S.Param], direction: str, reads: list = ()):
        self.cfg, self.raw, self.base_dir, self.study_dir, self.params, self.direction = cfg, raw, base_dir, study_dir, params, direction
        self.reads = list(reads)
        self.trials_rel = "trials"  # `trials/NAME` for a study started with --new-study: the earlier study's trial folders stay
        self.t: TuneConfig = cfg.tune
        self.fn = load_function(self.t.objective.function, base_dir) if self.t.objective.function else None
        self.study_run: StudyRun | None = None  # the study's MLflow run; each trial's run is its child

    def __call__(self, trial) -> float:
        import optuna

        over = over_budget(trial, self.t.n_trials)
        if over:  # other workers' trials already make up n_trials: this one is not run (no parameters drawn, nothing written)
            trial.set_user_attr("over_budget", True)
            trial.study.stop()
            raise OverBudget(over)
        values = S.sample(trial, self.params, self.cfg.model_dump(mode="json"))  # `when` reads the config's values, defaults included
        trials_dir = ownership.make_dir(self.study_dir / self.trials_rel, what="the study's trials folder", reads=self.reads)
        run_dir = trials_dir / f"trial-{trial.number:04d}"
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("host", os.uname().nodename)
        mapping = trial_mapping(self.raw, values, self.t, run_dir, base_dir=self.base_dir)
        rank_checkpoints_by_objective(mapping, self.cfg, self.direction)  # each trial's exported model is its best by the objective
        con = ui.console()
        con.print(f"[bold]trial {trial.number}[/] " + ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()), markup=True, highlight=False)
        t0 = time.time()
        if self.fn is not None:  # a surrogate objective: a function of the trial's config
            ownership.make_dir(run_dir, what=f"trial {trial.number}'s folder", reads=self.reads)
            ownership.write_text(run_dir / "config.yaml", yaml.safe_dump(mapping, sort_keys=False), what=f"trial {trial.number}'s config", reads=self.reads)
            value = float(self.fn(mapping, trial))
            ownership.write_json(run_dir / "result.json", {"trial": trial.number, "params": values, "value": value, "seconds": round(time.time() - t0, 3)},
                                 what=f"trial {trial.number}'s result", reads=self.reads)
            trial.set_user_attr("seconds", round(time.time() - t0, 3))
            return value

        if self.study_run is not None and self.study_run.active:  # every trial in the study's experiment, not one experiment per trial
            tr = mapping.get("tracking") if isinstance(mapping.get("tracking"), dict) else {}
            mapping["tracking"] = {**tr, "experiment": tr.get("experiment") or self.study_run.experiment}
        cfg = build_config(mapping, source=f"trial {trial.number}", base_dir=self.base_dir)
        cfg.name = f"{self.cfg.name}-trial-{trial.number:04d}"
        price = price_trial(cfg, self.t.gpu)
        if price:
            trial.set_user_attr("cost_usd", round(price["usd"], 6))
            trial.set_user_attr("planned_hours", price["hours"])
        size, big = too_big(cfg, self.t)  # `tune.max_params`: the model is built and counted, not trained
        if big:
            trial.set_user_attr("parameters", size)
            trial.set_user_attr("skipped", f"too large: {big}")
            con.print(f"  [yellow]trial {trial.number} not started:[/] {big}", markup=True, highlight=False)
            raise optuna.TrialPruned(f"too large: {big}")
        fits, why, plan = plan_fits(cfg, self.t)
        trial.set_user_attr("plan_memory", why)
        if not fits:  # never started: no run directory, no weights loaded
            trial.set_user_attr("skipped", f"does not fit: {why}")
            con.print(f"  [yellow]trial {trial.number} not started:[/] {why}", markup=True, highlight=False)
            raise optuna.TrialPruned(f"plan does not fit: {why}")

        metric = metric_key(self.t.objective.metric)

        def report(loop, step: int, eval_loss: float) -> None:
            # the objective metric of this eval (loop.eval_metrics: every metric the recipe's in-training eval measured), in the
            # study's own direction: the pruner compares trials on the quantity the study selects on
            measured = getattr(loop, "eval_metrics", None) or {"loss": eval_loss}
            if metric not in measured:
                raise TuneError(f"trial {trial.number}'s in-training eval at step {step} has no `{metric}` (it measured {', '.join(measured)}); "
                                "choose one of those as `tune.objective.metric`, or set `tune.pruner: none`.")
            value = float(measured[metric])
            trial.report(value, step)
            if trial.should_prune():
                loop.events.emit("trial_pruned", step=step, level="warning", trial=trial.number, metric=metric, value=value, eval_loss=eval_loss,
                                 pruner=self.t.pruner)
                trial.set_user_attr("pruned_at_step", step)
                raise StopTrial()

        parent = None  # the trial's run is a child of the study's MLflow run
        if self.study_run is not None and self.study_run.active:
            parent = dict(run_id=self.study_run.run_id, uri=self.study_run.uri,
                          tags={"trainpipe.tune.study": self.study_run.study, "trainpipe.tune.trial": str(trial.number)})
        log = trials_dir / f"trial-{trial.number:04d}.log"
        try:
            with trial_output(log, self.reads):  # the run's own output in the trial's log; one line per trial here
                summary = run(cfg, overwrite=True, parent_run=parent, callbacks=(EvalHook(report),))  # the pruner sees every in-training eval
        except StopTrial:
            trial.set_user_attr("seconds", round(time.time() - t0, 3))
            trial.set_user_attr("train_steps", _steps_done(run_dir))
            con.print(f"  [yellow]trial {trial.number} pruned[/] at step {trial.user_attrs.get('pruned_at_step')}", markup=True, highlight=False)
            raise optuna.TrialPruned() from None
        except TrainpipeError as exc:
            trial.set_user_attr("error", exc.message[:500])
            con.print(f"  [red]trial {trial.number} failed[/]: {exc.message.splitlines()[0][:200]} (output: {log})", markup=True, highlight=False)
            raise
        final = summary.get("final") or {}
        if metric not in final:
            raise TuneError(f"trial {trial.number}'s summary has no final `{metric}` (it has {', '.join(final)}); set `tune.objective.metric` to one of those.")
        _record(trial, summary, t0)
        con.print(f"  trial {trial.number}: {metric} = {float(final[metric]):.4g} in {time.time() - t0:.1f} s (output: {log})", markup=False, highlight=False)
        return float(final[metric])


def _record(trial, summary: dict, t0: float) -> None:
    """What a finished trial keeps in the study: its time, steps, final and baseline metrics and its exported model."""
    trial.set_user_attr("seconds", round(time.time() - t0, 3))
    trial.set_user_attr("train_steps", summary.get("train", {}).get("global_step"))
    tr, size = summary.get("train") or {}, (summary.get("parameters") or {}).get("trainable")
    if size is not None:
        trial.set_user_attr("parameters", size)
    if tr.get("global_step") and tr.get("train_seconds"):  # measured seconds per optimizer step (evals and checkpoints included)
        trial.set_user_attr("step_seconds", round(tr["train_seconds"] / tr["global_step"], 5))
    trial.set_user_attr("final", {k: v for k, v in (summary.get("final") or {}).items() if isinstance(v, (int, float))})
    trial.set_user_attr("baseline", {k: v for k, v in (summary.get("baseline") or {}).items() if isinstance(v, (int, float))})
    trial.set_user_attr("model", summary.get("artifacts", {}).get("model"))


class OverBudget(TuneError):
    """A trial created when the study's other trials already made up `n_trials` (workers asking at the same moment): not run."""


def _retried(trials) -> set[int]:
    return {tr.system_attrs["failed_trial"] for tr in trials if tr.system_attrs.get("failed_trial") is not None}


def counts_toward_budget(tr, retried: set[int]) -> bool:
    """Whether a trial takes a place of `n_trials` (all workers together): one that ran or runs (complete, pruned at an eval,
    failed, running); not one the plan skipped (never started), nor a failed one retried as a later trial, nor one not run
    because the budget was already taken, nor one waiting in the queue (enqueued, or a retry: it counts once it runs)."""
    from optuna.trial import TrialState

    ua = tr.user_attrs
    if ua.get("over_budget"):
        return False
    if tr.state == TrialState.PRUNED:
        return "skipped" not in ua
    if tr.state == TrialState.FAIL:
        return tr.number not in retried
    return tr.state in (TrialState.COMPLETE, TrialState.RUNNING)


def over_budget(trial, n_trials: int | None) -> str | None:
    """Why ``trial`` must not run (the trials numbered before it already make up `n_trials`), or None."""
    if not n_trials:
        return None
    trials = trial.study.get_trials(deepcopy=False)
    retried = _retried(trials)
    before = [tr for tr in trials if tr.number < trial.number and counts_toward_budget(tr, retried)]
    if len(before) < n_trials:
        return None
    return (f"trial {trial.number} not run: the study already has {len(before)} trials that ran or run (`tune.n_trials: {n_trials}`, "
            "all workers together); this worker stops.")


def _steps_done(run_dir: Path) -> int | None:

    try:
        evs = read_events(run_dir / "events.jsonl")
    except (OSError, ValueError):
        return None
    steps = [e.get("step") for e in evs if e.get("event") == "trial_pruned"]
    return steps[-1] if steps else None


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- the command


OUTPUT_FILES = {"best.yaml": "the best trial's config", "leaderboard.csv": "the study's leaderboard (CSV)",
                "leaderboard.html": "the study's leaderboard (HTML)", "tune.json": "the study's summary"}


def input_paths(cfg: RunConfig, config: str | Path) -> list[tuple[Path, str]]:
    """What the study reads (the config, its data, the model folder): never written over. The working and home directories
    are not inputs here: the study folder usually lives below them."""

    return [(p, w) for p, w in protected_paths(cfg, str(config)) if w not in ("the working directory", "the home directory")]


def check_outputs(study_dir: Path, t: TuneConfig, reads: list) -> None:
    """Before any trial: every file the study writes at the end may be written (new, or trainpipe's own and unchanged), and
    `best/model` may be replaced; a user's file or folder in the way is refused now, not after hours of trials."""
    for name, what in OUTPUT_FILES.items():
        ownership.check_writable(study_dir / name, what=what, reads=reads)
    if t.export_best:
        ownership.check_clearable(study_dir / "best" / "model", what="the best trial's model", reads=reads)


def price_one_trial(raw: dict, t: TuneConfig, study_dir: Path, base_dir: Path) -> dict:
    """The budget pays for at least one trial: the base config at the fidelity, priced by the planner on `tune.gpu` (this
    machine's GPU when unset: written into ``t``)."""
    gpu = t.gpu or _this_gpu()
    if gpu is None:
        raise ConfigError("`tune.budget_usd` prices each trial on a GPU by the planner; this machine has none. Set `tune.gpu` (e.g. `A100-80GB`) to price the trials as if run there, or delete `tune.budget_usd`.")
    t.gpu = gpu
    probe = build_config(trial_mapping(raw, {}, t, study_dir / "trials" / "probe", base_dir=base_dir), source="tune", base_dir=base_dir)
    per_trial = price_trial(probe, gpu)
    if per_trial["usd"] > t.budget_usd:
        raise ConfigError(
            f"`tune.budget_usd: {t.budget_usd:g}` cannot pay for one trial: the planner prices one at ${per_trial['usd']:.4f} "
            f"({per_trial['hours']:.4g} h on {gpu}, {per_trial['tokens']:.3g} tokens). Raise the budget to at least ${per_trial['usd'] * (t.n_trials or 1):.4f} "
            f"for {t.n_trials} trials, or make trials cheaper (`tune.fidelity.steps`, `tune.fidelity.data_fraction`)."
        )
    return per_trial


def stop_callbacks(t: TuneConfig, per_trial: dict | None) -> list:
    """The study's stop rules after each trial: `tune.n_trials` reached (all workers together), the budget spent."""
    callbacks = []
    if t.n_trials:
        def enough(study, trial) -> None:
            # n_trials counts the trials that ran or run (all workers together, other workers' running ones included), so a
            # worker stops asking once the study is full; a trial created at the same moment by two workers is not run (OverBudget)
            trials = study.get_trials(deepcopy=False)
            retried = _retried(trials)
            taken = sum(1 for tr in trials if counts_toward_budget(tr, retried))
            if taken >= t.n_trials or len(trials) >= 10 * t.n_trials:  # the second: a space where almost nothing fits
                study.stop()
        callbacks.append(enough)
    if t.budget_usd is not None and per_trial is not None:
        def budget(study, trial) -> None:
            spent = sum(float(tr.user_attrs.get("cost_usd") or 0) for tr in study.get_trials(deepcopy=False))
            if spent + per_trial["usd"] > t.budget_usd:
                ui.console().print(f"budget: ${spent:.4f} spent of ${t.budget_usd:g}; the next trial (${per_trial['usd']:.4f}) would exceed it: stopping.")
                study.stop()
        callbacks.append(budget)
    return callbacks


def study_is_full(study, n_trials: int) -> bool:
    """Whether the study already has `n_trials` trials that ran or run (a dead worker's RUNNING trial failed and retried first)."""
    import optuna
    from optuna.storages import fail_stale_trials
    from optuna.storages._heartbeat import is_heartbeat_enabled

    if is_heartbeat_enabled(study._storage):  # a dead worker's RUNNING trial is failed (and retried) before it is counted
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return sum(1 for tr in trials if counts_toward_budget(tr, retried)) >= n_trials


def tune(config: str | Path, overrides: list[str] | None = None, *, n_trials: int | None = None, new_study: bool = False) -> dict:
    """Run (or join) the study of CONFIG's `tune:` section; returns what `tune.json` holds. ``new_study``: start a fresh study
    (a new name) instead of joining the config's, e.g. after changing the objective or the space."""
    import logging

    import optuna

    cfg, raw, base_dir = load_study_config(config, overrides or [])
    t = cfg.tune
    if n_trials is not None:
        t.n_trials = n_trials
    direction = direction_of(t)
    params = S.parse_space(t.space, raw)
    note = check_metric(cfg)
    if note:
        ui.console().print(f"note: {note}", highlight=False)
    study_dir = Path(cfg.output_dir or f"runs/{cfg.name}").resolve()
    reads = input_paths(cfg, config)
    check_outputs(study_dir, t, reads)
    fn = t.objective.function

    per_trial = None if t.budget_usd is None or fn else price_one_trial(raw, t, study_dir, base_dir)
    optuna.logging.set_verbosity(logging.ERROR)  # a failed trial is one line of ours (with its log), not optuna's traceback
    ownership.make_dir(study_dir, what="the study's output folder", reads=reads)  # the default SQLite storage lives in it
    storage = open_storage(t, study_dir)
    # every trial draws from its own stream, seeded by (tune.seed, trial number): workers of one study never replay one
    # another's draws, on any storage, and one worker with a fixed seed is reproducible
    sampler = distinct_per_trial(make_sampler(t, params, t.seed), t.seed)
    pruner = make_pruner(t, t.fidelity.steps or (cfg.training.max_steps if cfg.training.max_steps > 0 else None))
    name = t.study_name or cfg.name or "study"
    where = f"`tune.storage` {redact_url(storage_url(t, study_dir))}"
    objective_id, space_id = study_identity(t, direction)
    if new_study and t.storage != "memory":
        name = fresh_study_name(storage, name)
        ui.console().print(f"--new-study: a fresh study `{name}`; other workers join it with `--set tune.study_name={name}`", highlight=False)
    elif t.storage != "memory":
        check_study(storage, name, objective_id, space_id, where=where)
    study = create_study(t, name, storage, sampler, pruner, direction)
    if OBJECTIVE_ATTR not in study.user_attrs:  # what later workers and re-runs are checked against
        study.set_user_attr(OBJECTIVE_ATTR, objective_id)
        study.set_user_attr(SPACE_ATTR, space_id)
    ui.console().print(f"[bold]trainpipe tune[/] study `{name}` ({direction} {t.objective.metric}; {t.sampler} + {t.pruner}) on {redact_url(storage_url(t, study_dir))}", markup=True, highlight=False)

    callbacks = stop_callbacks(t, per_trial)
    objective = Objective(cfg, raw, base_dir, study_dir, params, direction, reads)
    if name != (t.study_name or cfg.name or "study"):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "study"
        objective.trials_rel = f"trials/{safe}"
    if not fn:  # real trials: one MLflow run for the study, each trial's run its child, all in the study's experiment
        if resolve_settings(cfg.tracking, study_dir / objective.trials_rel / "trial-0000", cfg.name)["backend"] == "mlflow":
            # the trials' default MLflow store lives in the trials folder (`<trials>/mlflow.db`): the folder first
            ownership.make_dir(study_dir / objective.trials_rel, what="the study's trials folder", reads=reads)
            objective.study_run = StudyRun.open(cfg, study, study_dir / objective.trials_rel / "trial-0000")
    if t.n_trials and study_is_full(study, t.n_trials):
        ui.console().print(f"the study already has `tune.n_trials: {t.n_trials}` trials: no new trial (raise `tune.n_trials` or `--n-trials` to add some)", highlight=False)
        out = finish(study, cfg, raw, base_dir, study_dir, direction, reads)
        if objective.study_run is not None:
            objective.study_run.close(out)
        return out
    try:
        study.optimize(objective, n_trials=None, timeout=t.timeout_hours * 3600 if t.timeout_hours else None, callbacks=callbacks,
                       catch=(TrainpipeError,), gc_after_trial=True)
        out = finish(study, cfg, raw, base_dir, study_dir, direction, reads)
    except BaseException as exc:
        if objective.study_run is not None:
            with contextlib.suppress(Exception):  # on a full disk the tracker's own store may fail too: the disk is the news
                objective.study_run.close(None, status="FAILED")
        if (full := disk_full(exc, study_dir)) is not None:  # one paragraph, exit 74 (cli/main.py), no library's traceback:
            raise full from None
        raise
    if objective.study_run is not None:
        objective.study_run.close(out)
    return out


# --------------------------------------------------------------------------- 4. outputs


def finish(study, cfg: RunConfig, raw: dict, base_dir: Path, study_dir: Path, direction: str, reads: list = ()) -> dict:
    from optuna.trial import TrialState

    t = cfg.tune
    everything = study.get_trials(deepcopy=False)
    trials = [tr for tr in everything if not tr.user_attrs.get("over_budget")]  # created at the same moment as the last one: never run
    rows = LB.rows(trials)
    complete = [tr for tr in trials if tr.state == TrialState.COMPLETE]
    out: dict = {"study": study.study_name, "direction": direction, "metric": t.objective.metric, "sampler": t.sampler, "pruner": t.pruner,
                 "storage": redact_url(storage_url(t, study_dir)), "trials": len(trials),
                 "states": {s.name.lower(): sum(1 for tr in trials if tr.state == s) for s in TrialState}, "best": None,
                 "not_run_over_budget": len(everything) - len(trials),
                 "train_steps": sum(int(r.get("train_steps") or 0) for r in rows)}
    importances = LB.importances(study)
    out["importances"] = importances
    if complete:
        best = study.best_trial
        values = dict(best.params)
        mapping = trial_mapping(raw, values, t, Path(cfg.output_dir or f"runs/{cfg.name}") / "best-run", fidelity=False)
        _absolute_paths(mapping, base_dir)
        body = yaml.safe_dump(mapping, sort_keys=False)
        build_config(yaml.safe_load(body), source="best.yaml")  # ready to run: it validates
        text = (f"# best trial of study `{study.study_name}`: trial {best.number}, {t.objective.metric} = {best.value:.6g} ({direction})\n"
                f"# run it: trainpipe run best.yaml\n" + "".join(f"# {n}\n" for n in secret_notes(mapping)) + body)
        ownership.write_text(study_dir / "best.yaml", text, what=OUTPUT_FILES["best.yaml"], reads=reads)  # redacted on its way out
        out["best"] = {"trial": best.number, "value": best.value, "params": values, "run_dir": best.user_attrs.get("run_dir"), "config": str(study_dir / "best.yaml")}
        model = best.user_attrs.get("model")
        if t.export_best and model and Path(model).is_dir():
            best_dir = ownership.make_dir(study_dir / "best", what="the best trial's folder", reads=reads)
            dest = ownership.replace_dir(best_dir / "model", lambda tmp: shutil.copytree(model, tmp, dirs_exist_ok=True, symlinks=True),
                                         what="the best trial's model", reads=reads)
            out["best"]["model"] = str(dest)
    LB.write_all(study_dir, rows, out, study, direction, t.objective.metric, reads=reads)
    ownership.write_json(study_dir / "tune.json", out, what=OUTPUT_FILES["tune.json"], reads=reads)
    LB.print_table(rows, out, direction)
    # a study without a winner is a failure the user must see, not `best: null` and exit 0; in a shared study a worker may end
    # while the other workers' trials still run (none finished yet): that is not the study's end
    still_running = any(tr.state in (TrialState.RUNNING, TrialState.WAITING) for tr in trials)
    if not complete and trials and not still_running:
        raise TuneError(no_winner(out, trials, study_dir))
    return out


def secret_notes(mapping: dict) -> list[str]:
    """One comment line per config key whose value loses a secret on its way into best.yaml (a URL's password, a token in a
    query, a secret environment value): the key to set again before running it. The secret itself is never written."""

    notes: list[str] = []

    def walk(a, b, path: str) -> None:
        if isinstance(a, dict):
            for k, v in a.items():
                walk(v, b.get(k) if isinstance(b, dict) else None, f"{path}.{k}" if path else str(k))
        elif isinstance(a, list):
            for i, v in enumerate(a):
                walk(v, b[i] if isinstance(b, list) and i < len(b) else None, f"{path}[{i}]")
        elif isinstance(a, str) and a != b:
            how = ("or leave the password out of the URL and give it through the database's own means, e.g. PGPASSWORD or ~/.pgpass "
                   "for PostgreSQL" if path.endswith("sql.url") or "://" in a and "@" in a else
                   "or leave it out and give the credential through the environment the library reads (e.g. AWS_SECRET_ACCESS_KEY for s3://)")
            notes.append(f"`{path}`: a secret (password, token or secret environment value) was left out of this file and reads `{MASK}`; "
                         f"set it in this key again before `trainpipe run best.yaml`, {how}")

    walk(mapping, redact_obj(mapping), "")
    return notes


def _absolute_paths(m: dict, base_dir: Path) -> None:
    """best.yaml lives in the study folder: the config's relative paths are made absolute so it runs from anywhere."""
    def fix(p):
        return str((base_dir / p).resolve()) if isinstance(p, str) and not Path(p).is_absolute() and (base_dir / p).exists() else p

    if isinstance(m.get("model"), dict) and "name_or_path" in m["model"]:
        m["model"]["name_or_path"] = fix(m["model"]["name_or_path"])
    for src in (m.get("data") or {}).get("sources", []) or []:
        if isinstance(src, dict) and "path" in src:
            src["path"] = fix(src["path"])
