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

import importlib
import importlib.util
import json
import math
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import yaml

from trainpipe import ownership, ui
from trainpipe.config import RunConfig, TuneConfig, apply_overrides, build_config, read_yaml
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.redact import redact_url
from trainpipe.metrics import (  # noqa: F401 - the table's names, re-exported for tune's callers
    ALIASES, DIRECTIONS, IN_TRAINING_METRICS, METHOD_METRICS, MINIMIZED, NO_DIRECTION, MetricDirectionError, metric_direction, metric_key,
)
from trainpipe.metrics import in_training_metrics as _in_training_metrics
from trainpipe.tune import space as S

class TuneError(TrainpipeError):
    title = "tune"


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
    from trainpipe.config import load_config

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


def storage_url(t: TuneConfig, study_dir: Path) -> str:
    if t.storage == "memory":
        return "memory"
    url = t.storage or f"sqlite:///{study_dir / 'study.db'}"
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        try:  # SQLAlchemy's default postgresql driver is psycopg2; psycopg 3 is what trainpipe installs
            import psycopg2  # noqa: F401
        except ImportError:
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def open_storage(t: TuneConfig, study_dir: Path):
    """The RDB storage with heartbeats and retries of trials whose worker died; an unreachable URL is a one-paragraph error."""
    import optuna
    from optuna.storages import RDBStorage

    try:  # Optuna >= 4.9 names it for what it does; RetryFailedTrialCallback before
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry

    if t.storage == "memory":  # one process, nothing kept (benchmarks, quick experiments): no heartbeat, no sharing
        return optuna.storages.InMemoryStorage()
    url = storage_url(t, study_dir)
    last: Exception | None = None
    for attempt in range(5):  # several workers creating the schema at once: one wins, the others retry
        try:
            return RDBStorage(
                url, heartbeat_interval=t.heartbeat_seconds, grace_period=3 * t.heartbeat_seconds,
                heartbeat_stale_trial_callback=Retry(max_retry=t.max_retries), engine_kwargs={"pool_pre_ping": True},
            )
        except Exception as exc:  # noqa: BLE001 - sqlalchemy's errors vary by driver
            last = exc
            text = str(exc).lower()
            if "already exists" in text or "duplicate" in text or "unique" in text:
                time.sleep(0.2 * (attempt + 1))
                continue
            break
    first = str(last).strip().splitlines()[0][:300] if last else "unknown error"
    if isinstance(last, ModuleNotFoundError):
        first = f"the driver is not installed ({last.name}); `pip install 'psycopg[binary]'` for PostgreSQL"
    raise TuneError(
        f"`tune.storage` {redact_url(url)} cannot be reached: {redact_url(first)}. Check that the database server runs and the host, port, "
        "user and database name are right (every worker needs the same URL), or delete `tune.storage` for a local SQLite study in the "
        f"output folder. No trial was started. ({optuna.__name__} {optuna.__version__})"
    ) from None


def price_trial(cfg: RunConfig, gpu_name: str | None) -> dict | None:
    """The planner's time and on-demand cost of one trial (its config as run) on `gpu_name`, or None when there is no GPU to price on."""
    from trainpipe.plan import compute as C
    from trainpipe.plan.command import _data_size
    from trainpipe.plan.gpus import find_gpu
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import PLAN_METHOD, model_spec, resolve

    if not gpu_name:
        return None
    g = find_gpu(gpu_name)
    hw = Hardware("cuda", 1, (g.name,), g.bf16, os.cpu_count() or 1, f"tune.gpu {g.name}")
    plan = resolve(cfg, hw, 1, env={})
    rc = plan.config
    spec = model_spec(rc)
    mem = plan.predicted.get("memory") or {}
    seq = rc.first_data().max_length
    examples, avg = _data_size(rc)
    if rc.training.max_steps > 0:
        tokens = rc.training.max_steps * plan.effective_batch.value * (avg or seq)
    else:
        tokens = (examples or 0) * (avg or seq) * rc.training.num_train_epochs
    method = PLAN_METHOD.get(rc.method.peft, "lora")
    comp = C.compute(spec, method, float(tokens), seq, bool(rc.training.gradient_checkpointing), g, 1, plan.precision.value, None,
                     mem.get("trainable_params"), 1)
    usd = comp.hours * g.on_demand_usd
    return {"gpu": g.name, "hours": comp.hours, "usd": usd, "tokens": tokens}


def plan_fits(cfg: RunConfig, t: TuneConfig) -> tuple[bool, str, Any]:
    """(fits, why, plan): the planner's memory for this trial's config against `tune.max_memory_gib`, the GPU less headroom, or
    the CPU share of the RAM."""
    from trainpipe.plan import decisions as D
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.resolve import CPU_MEMORY_SHARE, _ram_bytes, catalog_gpu
    from trainpipe.plan.run_plan import plan_run

    hw = detect()
    plan = plan_run(cfg, hw)
    mem = (plan.predicted or {}).get("memory")
    if not mem:
        return True, "the planner could not size this model", plan
    gpu = catalog_gpu(hw)
    if t.max_memory_gib is not None:
        limit, where = t.max_memory_gib * 1024**3, f"`tune.max_memory_gib` {t.max_memory_gib:g} GiB"
    elif gpu is not None:
        limit, where = gpu.memory_bytes * (1 - D.HEADROOM), f"{gpu.name} less {int(D.HEADROOM * 100)} % headroom"
    else:
        limit, where = _ram_bytes() * CPU_MEMORY_SHARE, f"{CPU_MEMORY_SHARE:.0%} of the RAM"
    need = mem["total_bytes"]
    why = f"the plan needs {need / 1024**3:.3f} GiB per device, {where} is {limit / 1024**3:.3f} GiB"
    return need <= limit, why, plan


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


# --------------------------------------------------------------------------- 2. the study


def make_sampler(t: TuneConfig, params: list[S.Param], seed: int | None):
    import optuna.samplers as s

    if t.sampler == "tpe":
        return s.TPESampler(seed=seed, n_startup_trials=max(2, min(10, (t.n_trials or 20) // 3)), multivariate=True, group=True,
                            constant_liar=True)
    if t.sampler == "gp":
        return s.GPSampler(seed=seed, n_startup_trials=max(2, min(10, (t.n_trials or 20) // 3)))
    if t.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise ConfigError("`tune.sampler: cmaes` needs the `cmaes` package: `pip install 'trainpipe[tune]'` (or choose tpe, gp, random, grid, qmc).") from None
        return s.CmaEsSampler(seed=seed, n_startup_trials=1, warn_independent_sampling=False)
    if t.sampler == "random":
        return s.RandomSampler(seed=seed)
    if t.sampler == "grid":
        return s.GridSampler(S.grid(params), seed=seed)
    return s.QMCSampler(seed=seed, warn_independent_sampling=False)


def make_pruner(t: TuneConfig, max_steps: int | None):
    import optuna.pruners as p

    if t.pruner == "median":
        return p.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if t.pruner == "asha":  # rungs at R/9, 4R/9 (and R) steps: a first rung too early ranks by speed, not by where a trial ends up.
        # bootstrap_count = the reduction factor: a rung promotes its top quarter only once it holds 4 trials (with none, the first
        # trials to reach a rung are alone there, so "top quarter" promotes each of them: the random start-up trials ran to the end)
        return p.SuccessiveHalvingPruner(min_resource=max(1, max_steps // 9) if max_steps else "auto", reduction_factor=4, bootstrap_count=4)
    if t.pruner == "hyperband":
        return p.HyperbandPruner(min_resource=1, max_resource=max_steps or "auto", reduction_factor=3)
    return p.NopPruner()


def create_study(t: TuneConfig, name: str, storage, sampler, pruner, direction: str):
    import optuna

    for attempt in range(5):  # concurrent workers: create-or-load can race on the first insert
        try:
            return optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner, direction=direction, load_if_exists=True)
        except optuna.exceptions.DuplicatedStudyError:
            time.sleep(0.2 * (attempt + 1))
        except Exception as exc:  # noqa: BLE001 - an IntegrityError under a race
            if "unique" not in str(exc).lower() and "duplicate" not in str(exc).lower():
                raise
            time.sleep(0.2 * (attempt + 1))
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)


OBJECTIVE_ATTR, SPACE_ATTR = "trainpipe_objective", "trainpipe_space"


def study_identity(t: TuneConfig, direction: str) -> tuple[dict, dict]:
    """(the objective, the search space) a study is for, as stored in its user attrs: trials of one study are comparable only
    when they measured the same quantity in the same direction over the same space."""
    objective = {"metric": None if t.objective.function and "metric" not in t.objective.model_fields_set else t.objective.metric,
                 "function": t.objective.function, "direction": direction}
    return objective, json.loads(json.dumps(t.space, default=str))


def _shown_objective(o: dict) -> str:
    what = f"function `{o['function']}`" if o.get("function") else f"metric `{o.get('metric')}`"
    if o.get("function") and o.get("metric"):
        what += f" (metric `{o['metric']}`)"
    return f"{o.get('direction')} {what}"


def _space_changes(old: dict, new: dict) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            out.append(f"`{k}`: {json.dumps(old[k]) if k in old else '(absent)'} -> {json.dumps(new[k]) if k in new else '(absent)'}")
    return out


def check_study(storage, name: str, objective: dict, space: dict, *, where: str) -> bool:
    """Refuse to join an existing study whose objective or search space differs from this config's (its trials measured
    another quantity, or sampled another space: their scores are not comparable with this config's). Returns whether the
    study exists. A study made before trainpipe stored these is checked on its direction and adopted."""
    import optuna

    try:
        sid = storage.get_study_id_from_name(name)
    except KeyError:
        return False
    attrs = storage.get_study_user_attrs(sid)
    old_obj, old_space = attrs.get(OBJECTIVE_ATTR), attrs.get(SPACE_ATTR)
    if old_obj is None:
        dirs = storage.get_study_directions(sid)
        old_dir = dirs[0].name.lower() if dirs else None
        if old_dir and old_dir != objective["direction"]:
            old_obj = {"metric": "(not recorded)", "function": None, "direction": old_dir}
    problems = []
    if old_obj is not None and any(old_obj.get(k) != objective.get(k) for k in ("metric", "function", "direction")):
        problems.append(f"its objective is {_shown_objective(old_obj)}, this config's is {_shown_objective(objective)}")
    if old_space is not None and old_space != space:
        problems.append("its search space differs: " + "; ".join(_space_changes(old_space, space)) + " (study -> this config)")
    if problems:
        raise TuneError(
            f"The study `{name}` in {where} was started for another search: {' and '.join(problems)}. Its trials' scores are not "
            "comparable with this config's, so trainpipe does not add trials to it. Nothing was run. Pass `--new-study` to start a "
            "fresh study (a new name, in the same storage), set `tune.study_name` to another name, or restore the study's "
            f"objective and space. (optuna {optuna.__version__})"
        )
    return True


def fresh_study_name(storage, name: str) -> str:
    """NAME itself when no study has it yet, else `NAME-2`, `NAME-3`, ...: the first name no study in the storage has."""
    import optuna

    taken = set(optuna.get_all_study_names(storage=storage))
    if name not in taken:
        return name
    k = 2
    while f"{name}-{k}" in taken:
        k += 1
    return f"{name}-{k}"


def distinct_per_trial(sampler, seed: int | None):
    """Reseed the sampler's random streams from (seed, trial number) before every trial: each trial of a study draws from its
    own stream, so workers sharing a study (on any storage) never replay one another's draws, and a single worker with a fixed
    seed draws the same trials every time (trial numbers are the study's, handed out one by one by the storage)."""
    if seed is None:
        return sampler
    inner = sampler.before_trial

    def before_trial(study, trial) -> None:
        _reseed(sampler, seed, trial.number, set())
        inner(study, trial)

    sampler.before_trial = before_trial
    return sampler


def _reseed(obj, seed: int, number: int, seen: set, path: str = "") -> None:
    from optuna.samplers import BaseSampler

    if id(obj) in seen:
        return
    seen.add(id(obj))
    for attr, value in sorted(vars(obj).items()):
        if type(value).__name__ == "LazyRandomState":
            value.rng.seed(zlib.crc32(f"{seed}:{number}:{path}{attr}".encode()))
        elif isinstance(value, BaseSampler):
            _reseed(value, seed, number, seen, f"{path}{attr}.")


# --------------------------------------------------------------------------- 3. one trial


def trial_mapping(raw: dict, values: dict, t: TuneConfig, run_dir: Path, *, fidelity: bool = True) -> dict:
    m = S.apply(raw, values)
    m.pop("tune", None)
    m["output_dir"] = str(run_dir)
    if fidelity and t.fidelity.steps:
        m.setdefault("training", {})["max_steps"] = t.fidelity.steps
    if fidelity and t.fidelity.data_fraction and t.fidelity.data_fraction < 1:
        for src in (m.get("data") or {}).get("sources", []):
            n = _count_records(src)
            if n:
                src["max_records"] = max(1, int(math.ceil(n * t.fidelity.data_fraction)))
    return m


_BASE_DIR: Path | None = None


def _count_records(src: dict) -> int | None:
    p = src.get("path")
    if not p:
        return None
    path = Path(p) if Path(p).is_absolute() else (_BASE_DIR or Path.cwd()) / p
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

        from trainpipe.pipeline.run import run
        from trainpipe.train import loop as L

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
        mapping = trial_mapping(self.raw, values, self.t, run_dir)
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
                raise L.StopTrial()

        L.EVAL_HOOKS.append(report)
        from trainpipe.track import tracking

        if self.study_run is not None and self.study_run.active:
            tracking.PARENT_RUN.update(run_id=self.study_run.run_id, uri=self.study_run.uri,
                                       tags={"trainpipe.tune.study": self.study_run.study, "trainpipe.tune.trial": str(trial.number)})
        try:
            summary = run(cfg, overwrite=True)
        except L.StopTrial:
            trial.set_user_attr("seconds", round(time.time() - t0, 3))
            trial.set_user_attr("train_steps", _steps_done(run_dir))
            con.print(f"  [yellow]trial {trial.number} pruned[/] at step {trial.user_attrs.get('pruned_at_step')}", markup=True, highlight=False)
            raise optuna.TrialPruned() from None
        except TrainpipeError as exc:
            trial.set_user_attr("error", exc.message[:500])
            raise
        finally:
            L.EVAL_HOOKS.remove(report)
            tracking.PARENT_RUN.clear()
        final = summary.get("final") or {}
        if metric not in final:
            raise TuneError(f"trial {trial.number}'s summary has no final `{metric}` (it has {', '.join(final)}); set `tune.objective.metric` to one of those.")
        trial.set_user_attr("seconds", round(time.time() - t0, 3))
        trial.set_user_attr("train_steps", summary.get("train", {}).get("global_step"))
        trial.set_user_attr("final", {k: v for k, v in final.items() if isinstance(v, (int, float))})
        trial.set_user_attr("baseline", {k: v for k, v in (summary.get("baseline") or {}).items() if isinstance(v, (int, float))})
        trial.set_user_attr("model", summary.get("artifacts", {}).get("model"))
        return float(final[metric])


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
    from trainpipe.events import read_events

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
    from trainpipe.rundir import protected_paths

    return [(p, w) for p, w in protected_paths(cfg, str(config)) if w not in ("the working directory", "the home directory")]


def check_outputs(study_dir: Path, t: TuneConfig, reads: list) -> None:
    """Before any trial: every file the study writes at the end may be written (new, or trainpipe's own and unchanged), and
    `best/model` may be replaced; a user's file or folder in the way is refused now, not after hours of trials."""
    for name, what in OUTPUT_FILES.items():
        ownership.check_writable(study_dir / name, what=what, reads=reads)
    if t.export_best:
        ownership.check_clearable(study_dir / "best" / "model", what="the best trial's model", reads=reads)


def tune(config: str | Path, overrides: list[str] | None = None, *, n_trials: int | None = None, new_study: bool = False) -> dict:
    """Run (or join) the study of CONFIG's `tune:` section; returns what `tune.json` holds. ``new_study``: start a fresh study
    (a new name) instead of joining the config's, e.g. after changing the objective or the space."""
    import logging

    import optuna
    from optuna.trial import TrialState

    global _BASE_DIR
    cfg, raw, base_dir = load_study_config(config, overrides or [])
    _BASE_DIR = base_dir
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

    # the budget pays for at least one trial (the base config at the fidelity, priced by the planner)
    per_trial = None
    if t.budget_usd is not None and not fn:
        gpu = t.gpu or _this_gpu()
        if gpu is None:
            raise ConfigError("`tune.budget_usd` prices each trial on a GPU by the planner; this machine has none. Set `tune.gpu` (e.g. `A100-80GB`) to price the trials as if run there, or delete `tune.budget_usd`.")
        t.gpu = gpu
        probe = build_config(trial_mapping(raw, {}, t, study_dir / "trials" / "probe"), source="tune", base_dir=base_dir)
        per_trial = price_trial(probe, gpu)
        if per_trial["usd"] > t.budget_usd:
            raise ConfigError(
                f"`tune.budget_usd: {t.budget_usd:g}` cannot pay for one trial: the planner prices one at ${per_trial['usd']:.4f} "
                f"({per_trial['hours']:.4g} h on {gpu}, {per_trial['tokens']:.3g} tokens). Raise the budget to at least ${per_trial['usd'] * (t.n_trials or 1):.4f} "
                f"for {t.n_trials} trials, or make trials cheaper (`tune.fidelity.steps`, `tune.fidelity.data_fraction`)."
            )
    optuna.logging.set_verbosity(logging.WARNING)
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

    objective = Objective(cfg, raw, base_dir, study_dir, params, direction, reads)
    if name != (t.study_name or cfg.name or "study"):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "study"
        objective.trials_rel = f"trials/{safe}"
    if not fn:  # real trials: one MLflow run for the study, each trial's run its child, all in the study's experiment
        from trainpipe.track.tracking import resolve_settings

        if resolve_settings(cfg.tracking, study_dir / objective.trials_rel / "trial-0000", cfg.name)["backend"] == "mlflow":
            # the trials' default MLflow store lives in the trials folder (`<trials>/mlflow.db`): the folder first
            ownership.make_dir(study_dir / objective.trials_rel, what="the study's trials folder", reads=reads)
            objective.study_run = StudyRun.open(cfg, study, study_dir / objective.trials_rel / "trial-0000")
    if t.n_trials:
        from optuna.storages import fail_stale_trials
        from optuna.storages._heartbeat import is_heartbeat_enabled

        if is_heartbeat_enabled(study._storage):  # a dead worker's RUNNING trial is failed (and retried) before it is counted
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False)
        retried = _retried(trials)
        if sum(1 for tr in trials if counts_toward_budget(tr, retried)) >= t.n_trials:
            ui.console().print(f"the study already has `tune.n_trials: {t.n_trials}` trials: no new trial (raise `tune.n_trials` or `--n-trials` to add some)", highlight=False)
            out = finish(study, cfg, raw, base_dir, study_dir, direction, reads)
            if objective.study_run is not None:
                objective.study_run.close(out)
            return out
    try:
        study.optimize(objective, n_trials=None, timeout=t.timeout_hours * 3600 if t.timeout_hours else None, callbacks=callbacks,
                       catch=(TrainpipeError,), gc_after_trial=True)
        out = finish(study, cfg, raw, base_dir, study_dir, direction, reads)
    except BaseException:
        if objective.study_run is not None:
            objective.study_run.close(None, status="FAILED")
        raise
    if objective.study_run is not None:
        objective.study_run.close(out)
    return out


class StudyRun:
    """The study's run in MLflow (`tracking.backend` mlflow): one parent run per study in the study's experiment
    (`tracking.experiment`, else the study config's `name`), its id kept in the study's storage (`mlflow_parent_run_id`)
    so every worker and every later `trainpipe tune` of the study nests its trials under the same run. Each trial's run
    is created as its child (`mlflow.parentRunId`, track/tracking.py `PARENT_RUN`). An unreachable tracker warns once
    and the study goes on (the trials' own runs keep their metrics for `trainpipe track sync`)."""

    ATTR = "mlflow_parent_run_id"

    def __init__(self, settings: dict, study_name: str):
        self.settings, self.study, self.uri, self.experiment = settings, study_name, settings["uri"], settings["experiment"]
        self.run_id: str | None = None
        self.active = False
        self.client = None

    @classmethod
    def open(cls, cfg: RunConfig, study, trial_dir: Path) -> "StudyRun | None":
        from trainpipe.track import tracking

        settings = tracking.resolve_settings(cfg.tracking, trial_dir, cfg.name)  # the store the trials' runs use (beside their folders)
        if settings["backend"] != "mlflow":
            return None
        me = cls(settings, study.study_name)
        try:
            backend = tracking.MlflowBackend(settings)
            me.client = backend.client
            known = study.user_attrs.get(cls.ATTR)
            if isinstance(known, dict) and known.get("uri") == tracking._safe_uri(me.uri) and known.get("run_id"):
                from mlflow.exceptions import MlflowException

                try:  # the study's run from an earlier `trainpipe tune` or another worker: reopened
                    run = me.client.get_run(known["run_id"])
                    me.run_id = run.info.run_id
                    if run.info.status != "RUNNING":
                        me.client.update_run(me.run_id, status="RUNNING")
                except MlflowException:
                    me.run_id = None
            if me.run_id is None:
                me.run_id = backend.open({}, {}, {"mlflow.runName": f"study {study.study_name}", "trainpipe.tune.study": study.study_name,
                                                   "trainpipe.tune.role": "study"})
            study.set_user_attr(cls.ATTR, {"run_id": me.run_id, "uri": tracking._safe_uri(me.uri)})
            me.active = True
            ui.console().print(f"  tracking: study run {me.run_id} in experiment {me.experiment} (each trial a child run)", markup=False, highlight=False)
        except Exception as exc:  # noqa: BLE001 - the study goes on without its parent run
            ui.console().print(f"warning: the study's MLflow run could not be opened ({type(exc).__name__}: {str(exc)[:200]}); trials are tracked on their own",
                               markup=False, highlight=False)
        return me

    def close(self, out: dict | None, status: str = "FINISHED") -> None:
        """The study's result on its run (best value, trial counts, tune.json), then the run ended."""
        if not self.active:
            return
        from mlflow.entities import Metric, Param, RunTag

        from trainpipe.redact import redact_text

        try:
            if out:
                best = out.get("best") or {}
                tags = [RunTag("trainpipe.tune.trials", str(out.get("trials"))), RunTag("trainpipe.tune.direction", str(out.get("direction")))]
                metrics, params = [], []
                if best:
                    tags += [RunTag("trainpipe.tune.best_trial", str(best.get("trial")))]
                    metrics.append(Metric(f"best_{out.get('metric')}", float(best["value"]), int(time.time() * 1000), 0))
                    params = [Param(f"best.{k}"[:250], redact_text(str(v))[:6000]) for k, v in (best.get("params") or {}).items()]
                existing = set(self.client.get_run(self.run_id).data.params)
                params = [p for p in params if p.key not in existing]  # params are write-once in MLflow: a later worker's best stays in the tags
                self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags, synchronous=True)
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:  # noqa: BLE001
            ui.console().print(f"warning: the study's MLflow run was not updated ({type(exc).__name__}: {str(exc)[:200]})", markup=False, highlight=False)


def _this_gpu() -> str | None:
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.resolve import catalog_gpu

    g = catalog_gpu(detect())
    return g.name if g else None


# --------------------------------------------------------------------------- 4. outputs


def finish(study, cfg: RunConfig, raw: dict, base_dir: Path, study_dir: Path, direction: str, reads: list = ()) -> dict:
    from optuna.trial import TrialState

    from trainpipe.tune import leaderboard as LB

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
    return out


def secret_notes(mapping: dict) -> list[str]:
    """One comment line per config key whose value loses a secret on its way into best.yaml (a URL's password, a token in a
    query, a secret environment value): the key to set again before running it. The secret itself is never written."""
    from trainpipe.redact import MASK, redact_obj

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
