"""The Optuna study of `trainpipe tune`: its storage (SQLite in the study folder, or a shared database with heartbeats and
retries), sampler, pruner, the identity a joining worker is checked against, per-trial seeding, and the study's MLflow run."""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import RunConfig, TuneConfig
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.redact import redact_text, redact_url
from trainpipe.track import tracking
from trainpipe.tune import space as S


class TuneError(TrainpipeError):
    title = "tune"


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
        # Optuna *prunes* a trial while its rung holds no more than `bootstrap_count` trials. A large study (>= 10 x the
        # reduction factor of trials) waits for 4 at a rung, so the random start-up trials do not all train to the end
        # (benchmarks/tune_asha.py); a smaller one uses 0, else every trial of a study of 4 or fewer was pruned at the first
        # rung and the study ended with no best trial (with 0 the first trials to reach a rung are its top quarter).
        bootstrap = 4 if (t.n_trials or 0) >= 40 else 0
        return p.SuccessiveHalvingPruner(min_resource=max(1, max_steps // 9) if max_steps else "auto", reduction_factor=4, bootstrap_count=bootstrap)
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


class StudyRun:
    """The study's run in MLflow (`tracking.backend` mlflow): one parent run per study in the study's experiment
    (`tracking.experiment`, else the study config's `name`), its id kept in the study's storage (`mlflow_parent_run_id`)
    so every worker and every later `trainpipe tune` of the study nests its trials under the same run. Each trial's run
    is created as its child (`mlflow.parentRunId`, the run's `parent_run`). An unreachable tracker warns once
    and the study goes on (the trials' own runs keep their metrics for `trainpipe track sync`)."""

    ATTR = "mlflow_parent_run_id"

    def __init__(self, settings: dict, study_name: str):
        self.settings, self.study, self.uri, self.experiment = settings, study_name, settings["uri"], settings["experiment"]
        self.run_id: str | None = None
        self.active = False
        self.client = None

    @classmethod
    def open(cls, cfg: RunConfig, study, trial_dir: Path) -> "StudyRun | None":

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


def no_winner(out: dict, trials, study_dir: Path) -> str:
    """One paragraph: the study ended without a finished trial, why (the first failure, the pruner, the plan), what to do."""
    states = ", ".join(f"{n} {s}" for s, n in out["states"].items() if n)
    errors = [tr.user_attrs.get("error") for tr in trials if tr.user_attrs.get("error")]
    skipped = sum(1 for tr in trials if tr.user_attrs.get("skipped"))
    why = []
    if errors:
        why.append(f"the first failure: {errors[0].splitlines()[0][:300]}")
    if skipped:
        why.append(f"{skipped} never started: their plan did not fit (`tune.max_memory_gib`) or their model was above `tune.max_params`")
    if out["states"].get("pruned", 0) > skipped:
        why.append(f"the `{out['pruner']}` pruner stopped {out['states']['pruned'] - skipped} at an in-training eval")
    return (f"study `{out['study']}` ended without a best trial: none of its {len(trials)} trials finished ({states}); "
            + ("; ".join(why) + ". " if why else "")
            + f"No best.yaml was written; {study_dir / 'leaderboard.csv'} and each trial's folder under {study_dir / 'trials'} say more. "
            "Fix the failure and run the same command again (the study continues), or let trials finish: `tune.pruner: none`, "
            "a larger `tune.max_memory_gib`, more `tune.n_trials`.")


@contextlib.contextmanager
def trial_output(path: Path, reads=()):
    """A trial's console output (its run's tables, event lines, progress) into ``path`` (`trials/trial-NNNN.log`, through the
    ownership rule and redaction) instead of the terminal, where the study prints one line per trial: a 3-trial study
    printed 144 lines."""
    import io

    buf = io.StringIO()
    previous = ui._console
    ui._console = ui.RedactingConsole(file=buf, width=120, no_color=True, highlight=False, soft_wrap=False)
    try:
        yield path
    finally:
        ui._console = previous
        ownership.write_text(path, buf.getvalue(), what="the trial's console output", reads=reads)


def disk_full(exc: BaseException, where: Path) -> OSError | None:
    """The full disk behind a failed study (an OSError, or the SQLite storage's "database or disk is full" that optuna and
    SQLAlchemy wrap in their own errors, down the cause/context chain), as one ENOSPC OSError: the CLI's exit 74 paragraph."""
    import errno

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if "database or disk is full" in str(e) or "No space left on device" in str(e):
            return OSError(errno.ENOSPC, "No space left on device (the study's storage or a trial's files)", str(where))
        todo += [e.__cause__, e.__context__, getattr(e, "orig", None)]
    return None
