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
from pathlib import Path
from typing import Any, Callable

import yaml

from trainpipe import ui
from trainpipe.config import RunConfig, TuneConfig, apply_overrides, build_config, read_yaml
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.redact import redact_url
from trainpipe.tune import space as S

# The one table of metric directions (`tune.objective.direction: auto`, and `training.greater_is_better: null` for the loop's
# best checkpoint and early stopping), for every metric trainpipe itself emits. A metric not in it has no known direction:
# it is refused with a request for the direction (`metric_direction`), never guessed.
DIRECTIONS = {
    # lower is better: losses, perplexity, and the policy's KL to its reference (a policy further from it is not a better one)
    "loss": "minimize", "eval_loss": "minimize", "perplexity": "minimize", "kl": "minimize", "kl_per_token": "minimize",
    # higher is better: accuracies, overlap with the reference, preference margins, the reward an RL policy earns
    "accuracy": "maximize", "exact_match": "maximize", "rouge_l": "maximize", "bleu": "maximize", "macro_f1": "maximize",
    "accuracy_per_token": "maximize", "reward_accuracy": "maximize", "margin": "maximize", "margin_per_token": "maximize",
    "reward_margin": "maximize", "reward": "maximize", "reward_greedy": "maximize",
}
# metrics trainpipe emits whose direction is the user's call, with the reason given in the refusal
NO_DIRECTION = {
    "completion_length": "a longer or a shorter completion is better only by the task's own standard",
    **dict.fromkeys(("rewards_chosen", "rewards_rejected", "rewards_desirable", "rewards_undesirable"),
                    "a preference objective's implicit reward of one side alone usually falls for chosen and rejected alike while "
                    "training goes well (the margin between them is what the objective raises: `margin`, `accuracy`)"),
    **dict.fromkeys(("reward_chosen", "reward_rejected"),
                    "a Bradley-Terry reward model's scores are defined up to a shift, so only their difference has a direction "
                    "(`margin`, `accuracy`)"),
}
MINIMIZED = tuple(k for k, v in DIRECTIONS.items() if v == "minimize")
_PAIRS = ("loss", "accuracy", "margin", "accuracy_per_token", "margin_per_token", "reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")
_KTO = ("loss", "accuracy", "margin", "reward_accuracy", "rewards_desirable", "rewards_undesirable")
_RL = ("reward", "reward_greedy", "kl", "kl_per_token", "completion_length")
# final metrics each method's summary holds (others are refused before any trial); sft/pretrain: `eval.metrics`
METHOD_METRICS = {
    "reward": ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected"),
    "classification": ("loss", "accuracy", "macro_f1"),
    "dpo": _PAIRS, "orpo": _PAIRS, "kto": _KTO, "rl": _RL,
}
# what each recipe's in-training eval hands the loop's eval hooks (train/loop.py `loop.eval_metrics`), i.e. what a pruner can
# be given; sft/pretrain: loss and perplexity, plus the generated metrics of `eval.metrics` with `eval.generate_in_training`
IN_TRAINING_METRICS = {**METHOD_METRICS, "rl": ("loss", *_RL)}  # rl's in-training loss: minus the KL-regularised reward
# TRL's / transformers' names for the same figures
ALIASES = {"eval_loss": "loss", "eval_accuracy": "accuracy", "rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin",
           "rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected"}


class TuneError(TrainpipeError):
    title = "tune"


class MetricDirectionError(ConfigError):
    """A metric whose direction trainpipe does not know, with no direction given: refused rather than guessed."""


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


def metric_direction(name: str, *, key: str = "tune.objective.direction", field: str = "tune.objective.metric") -> str:
    """`minimize` or `maximize` for a metric trainpipe emits, from the one table (`DIRECTIONS`: loss, perplexity and KL lower;
    accuracies, margins, rewards, exact match higher), under trainpipe's or TRL's / transformers' name. A metric with no known
    direction raises MetricDirectionError naming ``field`` (the key that chose the metric) and ``key`` (where to give the direction:
    `tune.objective.direction`, or `training.greater_is_better` for the best checkpoint)."""
    m = metric_key(name)
    for n in (name, m):
        if n in DIRECTIONS:
            return DIRECTIONS[n]
    shown = name if m == name else f"{name}` (`{m}`"
    why = NO_DIRECTION.get(m)
    value = "`true` (higher is better) or `false` (lower is better)" if key == "training.greater_is_better" else "`maximize` or `minimize`"
    raise MetricDirectionError(
        f"`{field}: {shown}` has no direction trainpipe knows"
        + (f" ({why})" if why else f" (it knows {', '.join(sorted(DIRECTIONS))})")
        + f", so it cannot tell which value is the better one and does not guess. Set `{key}` to {value}"
        + (", or rank by one of the metrics with a known direction." if why else "."),
        [f"{key}: not given for {field} {name}"],
    )


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


def metric_key(name: str) -> str:
    """The summary / in-training name of an objective metric (TRL's `rewards/accuracies` is trainpipe's `reward_accuracy`)."""
    return ALIASES.get(name, name)


def in_training_metrics(cfg: RunConfig) -> tuple[str, ...]:
    """The metrics a run of ``cfg`` measures at every in-training eval (what the pruner can be given)."""
    from trainpipe.evaluate.metrics import GENERATED

    if cfg.method.name in IN_TRAINING_METRICS:
        return IN_TRAINING_METRICS[cfg.method.name]
    generated = tuple(m for m in cfg.eval.metrics if m == "exact_match" or m in GENERATED)
    return ("loss", "perplexity") + (generated if cfg.eval.generate_in_training else ())


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

    def __init__(self, cfg: RunConfig, raw: dict, base_dir: Path, study_dir: Path, params: list[S.Param], direction: str):
        self.cfg, self.raw, self.base_dir, self.study_dir, self.params, self.direction = cfg, raw, base_dir, study_dir, params, direction
        self.t: TuneConfig = cfg.tune
        self.fn = load_function(self.t.objective.function, base_dir) if self.t.objective.function else None

    def __call__(self, trial) -> float:
        import optuna

        from trainpipe.pipeline.run import run
        from trainpipe.train import loop as L

        values = S.sample(trial, self.params, self.cfg.model_dump(mode="json"))  # `when` reads the config's values, defaults included
        run_dir = self.study_dir / "trials" / f"trial-{trial.number:04d}"
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("host", os.uname().nodename)
        mapping = trial_mapping(self.raw, values, self.t, run_dir)
        rank_checkpoints_by_objective(mapping, self.cfg, self.direction)  # each trial's exported model is its best by the objective
        con = ui.console()
        con.print(f"[bold]trial {trial.number}[/] " + ", ".join(f"{k}={_fmt(v)}" for k, v in values.items()), markup=True, highlight=False)
        t0 = time.time()
        if self.fn is not None:  # a surrogate objective: a function of the trial's config
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")
            value = float(self.fn(mapping, trial))
            _write_json(run_dir / "result.json", {"trial": trial.number, "params": values, "value": value, "seconds": round(time.time() - t0, 3)})
            trial.set_user_attr("seconds", round(time.time() - t0, 3))
            return value

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
        final = summary.get("final") or {}
        if metric not in final:
            raise TuneError(f"trial {trial.number}'s summary has no final `{metric}` (it has {', '.join(final)}); set `tune.objective.metric` to one of those.")
        trial.set_user_attr("seconds", round(time.time() - t0, 3))
        trial.set_user_attr("train_steps", summary.get("train", {}).get("global_step"))
        trial.set_user_attr("final", {k: v for k, v in final.items() if isinstance(v, (int, float))})
        trial.set_user_attr("baseline", {k: v for k, v in (summary.get("baseline") or {}).items() if isinstance(v, (int, float))})
        trial.set_user_attr("model", summary.get("artifacts", {}).get("model"))
        return float(final[metric])


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


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the command


def tune(config: str | Path, overrides: list[str] | None = None, *, n_trials: int | None = None) -> dict:
    """Run (or join) the study of CONFIG's `tune:` section; returns what `tune.json` holds."""
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
    study_dir.mkdir(parents=True, exist_ok=True)
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
    storage = open_storage(t, study_dir)
    shared = t.storage not in (None, "memory")
    seed = None if t.seed is None else t.seed + (os.getpid() % 100003 if shared else 0)  # workers of one study sample differently
    sampler = make_sampler(t, params, seed)
    pruner = make_pruner(t, t.fidelity.steps or (cfg.training.max_steps if cfg.training.max_steps > 0 else None))
    name = t.study_name or cfg.name or "study"
    study = create_study(t, name, storage, sampler, pruner, direction)
    ui.console().print(f"[bold]trainpipe tune[/] study `{name}` ({direction} {t.objective.metric}; {t.sampler} + {t.pruner}) on {redact_url(storage_url(t, study_dir))}", markup=True, highlight=False)

    callbacks = []
    if t.n_trials:
        def enough(study, trial) -> None:  # n_trials counts trials that ran (complete or pruned at an eval), all workers together
            trials = study.get_trials(deepcopy=False)
            ran = sum(1 for tr in trials if tr.state == TrialState.COMPLETE or (tr.state == TrialState.PRUNED and "skipped" not in tr.user_attrs))
            if ran >= t.n_trials or len(trials) >= 10 * t.n_trials:  # the second: a space where almost nothing fits
                study.stop()
        callbacks.append(enough)
    if t.budget_usd is not None and per_trial is not None:
        def budget(study, trial) -> None:
            spent = sum(float(tr.user_attrs.get("cost_usd") or 0) for tr in study.get_trials(deepcopy=False))
            if spent + per_trial["usd"] > t.budget_usd:
                ui.console().print(f"budget: ${spent:.4f} spent of ${t.budget_usd:g}; the next trial (${per_trial['usd']:.4f}) would exceed it: stopping.")
                study.stop()
        callbacks.append(budget)

    objective = Objective(cfg, raw, base_dir, study_dir, params, direction)
    study.optimize(objective, n_trials=None, timeout=t.timeout_hours * 3600 if t.timeout_hours else None, callbacks=callbacks,
                   catch=(TrainpipeError,), gc_after_trial=True)
    return finish(study, cfg, raw, base_dir, study_dir, direction)


def _this_gpu() -> str | None:
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.resolve import catalog_gpu

    g = catalog_gpu(detect())
    return g.name if g else None


# --------------------------------------------------------------------------- 4. outputs


def finish(study, cfg: RunConfig, raw: dict, base_dir: Path, study_dir: Path, direction: str) -> dict:
    from optuna.trial import TrialState

    from trainpipe.tune import leaderboard as LB

    t = cfg.tune
    trials = study.get_trials(deepcopy=False)
    rows = LB.rows(trials)
    complete = [tr for tr in trials if tr.state == TrialState.COMPLETE]
    out: dict = {"study": study.study_name, "direction": direction, "metric": t.objective.metric, "sampler": t.sampler, "pruner": t.pruner,
                 "storage": redact_url(storage_url(t, study_dir)), "trials": len(trials),
                 "states": {s.name.lower(): sum(1 for tr in trials if tr.state == s) for s in TrialState}, "best": None,
                 "train_steps": sum(int(r.get("train_steps") or 0) for r in rows)}
    importances = LB.importances(study)
    out["importances"] = importances
    if complete:
        best = study.best_trial
        values = dict(best.params)
        mapping = trial_mapping(raw, values, t, Path(cfg.output_dir or f"runs/{cfg.name}") / "best-run", fidelity=False)
        _absolute_paths(mapping, base_dir)
        text = (f"# best trial of study `{study.study_name}`: trial {best.number}, {t.objective.metric} = {best.value:.6g} ({direction})\n"
                f"# run it: trainpipe run best.yaml\n" + yaml.safe_dump(mapping, sort_keys=False))
        build_config(yaml.safe_load(text), source="best.yaml")  # ready to run: it validates
        tmp = study_dir / "best.yaml.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, study_dir / "best.yaml")
        out["best"] = {"trial": best.number, "value": best.value, "params": values, "run_dir": best.user_attrs.get("run_dir"), "config": str(study_dir / "best.yaml")}
        model = best.user_attrs.get("model")
        if t.export_best and model and Path(model).is_dir():
            dest = study_dir / "best" / "model"
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmpd = study_dir / "best" / "model.tmp"
            shutil.rmtree(tmpd, ignore_errors=True)
            shutil.copytree(model, tmpd)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmpd, dest)
            out["best"]["model"] = str(dest)
    LB.write_all(study_dir, rows, out, study, direction, t.objective.metric)
    _write_json(study_dir / "tune.json", out)
    LB.print_table(rows, out, direction)
    return out


def _absolute_paths(m: dict, base_dir: Path) -> None:
    """best.yaml lives in the study folder: the config's relative paths are made absolute so it runs from anywhere."""
    def fix(p):
        return str((base_dir / p).resolve()) if isinstance(p, str) and not Path(p).is_absolute() and (base_dir / p).exists() else p

    if isinstance(m.get("model"), dict) and "name_or_path" in m["model"]:
        m["model"]["name_or_path"] = fix(m["model"]["name_or_path"])
    for src in (m.get("data") or {}).get("sources", []) or []:
        if isinstance(src, dict) and "path" in src:
            src["path"] = fix(src["path"])
