"""Experiment tracking: MLflow (default), W&B or TensorBoard, through their own libraries.

`trainpipe run` starts a tracker for the run directory (`start`); the tracker listens to the event log and the
metrics writer (the run's `EventLog`, `listen`), so every metric is logged as it is written and every event becomes a tag.
When the run ends, `finish` logs what the run directory holds (the resolved config as params, the data report, the
plan, the summary, the report page, the exported model as artefacts) and registers the model in MLflow's registry
with its lineage. Both go through one idempotent function, `sync_run`, that `trainpipe track sync RUN_DIR` also calls.

The quality gates' verdicts (RUN_DIR/gates.json) travel with the run: tags `trainpipe.gates.passed` (true/false),
`trainpipe.gates.failed` and `trainpipe.gate.<name>` (pass | fail | n/a) on the run and on the registered model
version, whose description says whether it passed. A model that failed a gate under `gates.on_fail: fail` is not
registered at all (tracking.json's `not_registered` says why). A run started by `trainpipe tune` is a child run
(`mlflow.parentRunId`) of its study's run (`start`'s `parent`, passed down by tune/tune.py through `run`).

What has reached the tracker is recorded in `RUN_DIR/tracking.json` (backend, URI, run id, how many lines of
`metrics.jsonl` were logged, whether params, artefacts and the model were logged). A tracker that cannot be reached
does not lose the run: the first failure emits one `tracking_unavailable` warning, the run goes on with its metrics
in `metrics.jsonl`, and `trainpipe track sync RUN_DIR` logs the rest later, from where it stopped.

Nothing secret is logged: params, tags and metric names go through `trainpipe.redact`, and the artefacts are the
files trainpipe itself wrote (already redacted where they were written).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from typing import Any

from trainpipe.errors import TrainpipeError
from trainpipe.events import read_jsonl as _jsonl
from trainpipe.redact import MASK, SecretRefs, redact_obj, redact_text, redact_url, resolve_references, url_secrets
from trainpipe import ui
from trainpipe.config import load_yaml_text  # bounded: an alias bomb is refused (issue 22)
from trainpipe.track.backends import Backend, MlflowBackend, WandbBackend, make_backend
from trainpipe.track.manifest import write_json

STATE = "tracking.json"
BACKENDS = ("mlflow", "wandb", "tensorboard", "none")
# files of the run directory logged as artefacts when present (the report page of issue 11 included)
ARTIFACT_FILES = ("config.resolved.yaml", "manifest.json", "data_report.json", "summary.json", "events.jsonl", "metrics.jsonl",
                  "report.html", "lineage.json")


class TrackingError(TrainpipeError):
    title = "tracking"


# --------------------------------------------------------------------------- settings


def resolve_settings(tracking: Any, run_dir: Path, name: str | None) -> dict:
    """(backend, uri, experiment, ...) for a run: `tracking.backend: auto` is `$TRAINPIPE_TRACKING`, else mlflow; the MLflow
    URI is `tracking.uri`, else `$MLFLOW_TRACKING_URI`, else a SQLite store beside the run (`<parent>/mlflow.db`)."""
    t = tracking if isinstance(tracking, dict) else tracking.model_dump()
    backend = t.get("backend") or "auto"
    if backend == "auto":
        backend = (os.environ.get("TRAINPIPE_TRACKING") or "").strip().lower()
        if not backend:  # MLflow by default, where it is installed (`pip install 'trainpipe[mlflow]'`); else no tracker
            import importlib.util

            backend = "mlflow" if importlib.util.find_spec("mlflow") is not None else "none"
    if backend not in BACKENDS:
        raise TrackingError(f"`$TRAINPIPE_TRACKING` is {backend!r}; use one of {', '.join(BACKENDS)}.")
    run_dir = Path(run_dir)
    uri = t.get("uri")
    if backend == "mlflow" and not uri:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.parent / 'mlflow.db'}"
    if backend == "tensorboard" and not uri:
        uri = str(run_dir / "tensorboard")
    mode = t.get("mode") or "auto"
    if backend == "wandb" and mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return {"backend": backend, "uri": uri, "experiment": t.get("experiment") or name or "trainpipe", "mode": mode,
            "register_model": bool(t.get("register_model", True)), "model_name": t.get("model_name") or name or "trainpipe-model"}


def read_state(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def write_state(run_dir: Path, state: dict) -> None:
    write_json(Path(run_dir) / STATE, state)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out



def metric_values(rec: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl record, keyed by name (not `time`, `step`)."""
    out = {}
    for k, v in rec.items():
        if k in ("time", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if v != v or v in (float("inf"), float("-inf")):  # NaN/Inf: MLflow refuses them on some stores
            continue
        out[str(k)] = float(v)
    return out


# --------------------------------------------------------------------------- what a run directory holds


def run_params(run_dir: Path) -> dict:
    """The resolved config, flattened to dotted keys and redacted."""
    p = Path(run_dir) / "config.resolved.yaml"
    if not p.exists():
        return {}
    cfg = load_yaml_text(p.read_text(encoding="utf-8"), f"`{p}`") or {}
    return {k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in redact_obj(flatten(cfg)).items()}


def lineage_tags(run_dir: Path) -> dict[str, str]:
    """What produced the model: data SHA-256s, config hash, code version and commit, base model, parent (stage) lineage."""
    run_dir = Path(run_dir)
    try:
        m = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    tags = {"trainpipe.config_hash": m.get("config_hash"), "trainpipe.version": m.get("trainpipe_version"),
            "trainpipe.code_commit": (m.get("trainpipe_git") or {}).get("commit"), "trainpipe.git_commit": (m.get("git") or {}).get("commit")}
    for i, f in enumerate(m.get("data_files") or []):
        if isinstance(f, dict):
            tags[f"trainpipe.data.{i}.sha256"] = f.get("sha256")
            tags[f"trainpipe.data.{i}.path"] = f.get("path")
    if m.get("lineage"):
        tags["trainpipe.parent"] = json.dumps(m["lineage"], sort_keys=True, default=str)
    try:
        cfg = load_yaml_text((run_dir / "config.resolved.yaml").read_text(encoding="utf-8"), "config.resolved.yaml") or {}
        tags["trainpipe.base_model"] = (cfg.get("model") or {}).get("name_or_path")
    except (OSError, ValueError):
        pass
    tags["trainpipe.run_dir"] = str(run_dir)
    return {k: redact_text(str(v)) for k, v in tags.items() if v is not None}


def read_gates(run_dir: Path) -> dict | None:
    """The run's quality-gate verdicts (`gates.json`, evaluate/gates.py), or None when the gates were not checked."""
    try:
        block = json.loads((Path(run_dir) / "gates.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return block if isinstance(block, dict) and isinstance(block.get("results"), list) else None


def gate_tags(run_dir: Path) -> dict[str, str]:
    """The gate verdicts as tags: `trainpipe.gates.passed` true/false, `trainpipe.gates.failed` (names), and one
    `trainpipe.gate.<name>` = pass | fail | n/a per gate. Empty when the run has no gates.json."""
    block = read_gates(run_dir)
    if block is None:
        return {}
    tags = {"trainpipe.gates.passed": "true" if block.get("passed") else "false", "trainpipe.gates.on_fail": str(block.get("on_fail") or "warn"),
            "trainpipe.gates.failed": ",".join(str(n) for n in block.get("failed") or [])}
    for r in block["results"]:
        if isinstance(r, dict) and r.get("name"):
            tags[f"trainpipe.gate.{r['name']}"] = str(r.get("status"))
    return {k: redact_text(v) for k, v in tags.items()}


def gates_description(run_dir: Path) -> str | None:
    """A registered version's description: whether its run passed the quality gates (and which failed, with evidence)."""
    block = read_gates(run_dir)
    if block is None:
        return None
    if block.get("passed"):
        return "Quality gates: passed (see the `trainpipe.gate.*` tags and the run's report.html)."
    failed = [r for r in block["results"] if isinstance(r, dict) and r.get("status") == "fail"]
    return redact_text("Quality gates: NOT PASSED. Do not ship this model as is. Failed: "
                       + "; ".join(f"{r.get('name')}: {r.get('evidence')}" for r in failed)[:4000]
                       + ". See the `trainpipe.gate.*` tags, model/quality_gates.json and the run's report.html.")


def gates_block_registration(run_dir: Path) -> str | None:
    """Why the model must not be registered at all (`gates.on_fail: fail` and a gate failed), else None."""
    block = read_gates(run_dir)
    if block is None or block.get("passed") or block.get("on_fail") != "fail":
        return None
    return (f"not registered: quality gate(s) {', '.join(str(n) for n in block.get('failed') or [])} failed under `gates.on_fail: fail` "
            f"(see {Path(run_dir) / 'report.html'})")


def event_tags(events: list[dict]) -> dict[str, str]:
    """One tag per event name: how often it happened and its last occurrence (the full log is the `events.jsonl` artefact)."""
    out: dict[str, str] = {}
    counts: dict[str, int] = {}
    for e in events:
        name = e.get("event", "?")
        counts[name] = counts.get(name, 0) + 1
        out[f"event.{name}"] = json.dumps(redact_obj(e), default=str)[:4900]
    out.update({f"event.{n}.count": str(c) for n, c in counts.items()})
    return out


# --------------------------------------------------------------------------- live tracking during a run


class Tracker:
    """Live tracking of one run directory: a listener of the run's event log (metrics and events as they are written).
    ``parent``: the MLflow run this run is a child of (`trainpipe tune`: the study's run; {"run_id", "uri", "tags"})."""

    def __init__(self, run_dir: Path, settings: dict, events=None, parent: dict | None = None):
        self.run_dir = Path(run_dir).resolve()
        self.settings = settings
        self.events = events
        self.parent = parent or {}
        self.backend: Backend | None = None
        self.available = True
        self.state = read_state(self.run_dir)
        if self.state.get("backend") != settings["backend"] or self.state.get("uri") != _safe_uri(settings["uri"]):
            self.state = {}
        self.state.update({"backend": settings["backend"], "uri": _safe_uri(settings["uri"]), "experiment": settings["experiment"],
                           "mode": settings.get("mode"), "model_name": settings["model_name"], "register_model": settings["register_model"]})
        self.state.setdefault("metrics_logged", 0)
        self._busy = False

    def start(self, run_name: str | None) -> None:
        self.state["run_name"] = run_name
        if self._call(lambda: self._open(run_name)):
            ui.console().print(f"  [dim]tracking: {self.settings['backend']} {_safe_uri(self.settings['uri']) or ''} "
                               f"(experiment {self.settings['experiment']}, run {self.state.get('run_id')})[/]", markup=True, soft_wrap=True)
        write_state(self.run_dir, self.state)
        if self.events is not None:
            self.events.listen(self.on_record)

    def _open(self, run_name: str | None) -> None:
        self.backend = make_backend(self.settings, self.run_dir)
        tags = {"mlflow.runName": run_name or self.run_dir.name, "trainpipe.run_dir": str(self.run_dir)}
        up = self.parent
        parent = up.get("run_id") if up.get("uri") == self.settings["uri"] and self.settings["backend"] == "mlflow" else None
        if parent and not self.state.get("run_id"):  # a tune trial: a child run of its study's run (MLflow's nested runs)
            tags |= {"mlflow.parentRunId": parent, **up.get("tags", {})}
        self.state["run_id"] = self.backend.open(self.state, {}, redact_obj(tags))

    def on_record(self, kind: str, run_dir: Path, record: dict) -> None:
        if self._busy or not self.available or self.backend is None or Path(run_dir).resolve() != self.run_dir:
            return
        if kind == "metric":
            values = metric_values(record)
            if self._call(lambda: self.backend.log_metrics(values, int(record.get("step", 0)), float(record.get("time", time.time())))):
                self.state["metrics_logged"] = self.state.get("metrics_logged", 0) + 1
                write_state(self.run_dir, self.state)  # a killed run: `track sync` continues after the last metric logged
        elif kind == "event" and record.get("event") not in ("tracking_unavailable",):
            self._call(lambda: self.backend.set_tags(event_tags([record])))

    def _call(self, fn) -> bool:
        if not self.available:
            return False
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - any failure of the tracker: the run goes on, the data stays in the run dir
            self.available = False
            self._warn(exc)
            return False

    def _warn(self, exc: BaseException) -> None:
        msg = redact_text(f"{type(exc).__name__}: {exc}")[:400]
        self.state["pending"] = True
        self.state["error"] = msg
        write_state(self.run_dir, self.state)
        if self.events is not None:
            self._busy = True
            try:
                self.events.emit("tracking_unavailable", level="warning", backend=self.settings["backend"], uri=_safe_uri(self.settings["uri"]),
                                 error=msg, fix=f"metrics stay in {self.run_dir / 'metrics.jsonl'}; run `trainpipe track sync {self.run_dir}` once the tracker is reachable")
            finally:
                self._busy = False

    def finish(self, status: str = "FINISHED", *, register: bool = True) -> dict:
        """At the end of the run (however it ends): stop listening, then log what the run directory holds."""
        if self.events is not None:
            self.events.unlisten(self.on_record)
        write_state(self.run_dir, self.state)
        if not self.available:
            return self.state
        try:
            return sync_run(self.run_dir, status=status, backend=self.backend, register=register)
        except Exception as exc:  # noqa: BLE001
            self.available = False
            self.state = read_state(self.run_dir)
            self._warn(exc)
            return self.state


def _safe_uri(uri: str | None) -> str | None:
    return redact_url(uri) if uri and "://" in uri else uri


def start(cfg, run_dir: Path, events=None, parent: dict | None = None) -> Tracker | None:
    """The tracker of a run (None for `tracking.backend: none`), listening to ``events`` (the run's EventLog); never raises
    for an unreachable tracker. ``parent``: the MLflow run it is a child of (`trainpipe tune`'s study run), or None."""
    settings = resolve_settings(cfg.tracking, run_dir, cfg.name)
    if settings["backend"] == "none":
        return None
    tracker = Tracker(run_dir, settings, events, parent)
    tracker.start(cfg.name)
    return tracker


# --------------------------------------------------------------------------- catching up (end of run, `trainpipe track sync`)


def sync_run(run_dir: str | Path, *, status: str | None = None, backend: Backend | None = None, uri: str | None = None,
             register: bool = True) -> dict:
    """Log everything of `run_dir` that has not reached the tracker yet: params, the metrics after the last one logged, event
    tags, the artefacts, the model (registered with its lineage). Idempotent: `tracking.json` records what was logged."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "config.resolved.yaml").exists():
        raise TrackingError(f"`{run_dir}` is not a trainpipe run directory (no config.resolved.yaml); give the `output_dir` of a run.")
    state = read_state(run_dir)
    cfg = load_yaml_text((run_dir / "config.resolved.yaml").read_text(encoding="utf-8"), "config.resolved.yaml") or {}
    tracking = dict(cfg.get("tracking") or {})
    if state.get("backend") and tracking.get("backend", "auto") == "auto":
        tracking["backend"] = state["backend"]
    if uri:
        tracking["uri"] = uri
    settings = resolve_settings(tracking, run_dir, cfg.get("name"))
    if settings["backend"] in ("mlflow", "wandb") and not uri:
        settings["uri"] = _real_uri(settings["uri"], run_dir)
    if settings["backend"] == "none":
        raise TrackingError(f"`{run_dir}` has `tracking.backend: none`; there is nothing to sync. Set `$TRAINPIPE_TRACKING=mlflow` (or the config's `tracking.backend`) to log it.")
    if state.get("uri") and state.get("uri") != _safe_uri(settings["uri"]):
        state = {k: v for k, v in state.items() if k in ("run_name",)}  # another tracker: everything goes there from the start
    state.update({"backend": settings["backend"], "uri": _safe_uri(settings["uri"]), "experiment": settings["experiment"]})
    state.setdefault("metrics_logged", 0)
    if backend is None and settings["backend"] == "wandb" and state.get("mode") == "offline":
        return _wandb_sync(run_dir, state)
    if backend is None:
        backend = make_backend(settings, run_dir)
        state["run_id"] = backend.open(state, {}, redact_obj({"mlflow.runName": cfg.get("name") or run_dir.name, "trainpipe.run_dir": str(run_dir)}))
    if not state.get("params_logged"):
        params = run_params(run_dir)
        if hasattr(backend, "log_params"):
            backend.log_params(params)
        elif isinstance(backend, WandbBackend):
            backend.run.config.update(params, allow_val_change=True)
        state["params_logged"] = True
        write_state(run_dir, state)
    metrics = _jsonl(run_dir / "metrics.jsonl")
    for rec in metrics[state["metrics_logged"]:]:
        backend.log_metrics(metric_values(rec), int(rec.get("step", 0)), float(rec.get("time", time.time())))
        state["metrics_logged"] += 1
    write_state(run_dir, state)
    summary = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    finals = {f"{phase}.{k}": v for phase in ("baseline", "final") for k, v in (summary.get(phase) or {}).items()}
    if finals:
        backend.log_metrics(metric_values(finals), int((summary.get("train") or {}).get("global_step", 0)), time.time())
    backend.set_tags(event_tags(_jsonl(run_dir / "events.jsonl")) | lineage_tags(run_dir) | gate_tags(run_dir))
    finished = (run_dir / "summary.json").exists()
    if finished and not state.get("artifacts_logged"):
        _log_artifacts(run_dir, backend, state)
    if finished and register and settings["register_model"] and not state.get("registered") and isinstance(backend, MlflowBackend):
        _register(run_dir, backend, state, settings["model_name"])
    state["pending"] = False
    state.pop("error", None)
    backend.close(status or ("FINISHED" if finished else "FAILED"))
    state["synced_at"] = time.time()
    write_state(run_dir, state)
    return state


def _log_artifacts(run_dir: Path, backend: Backend, state: dict) -> None:
    """The run's files (ARTIFACT_FILES, the plan, the report pages) and its exported model, once."""
    files = [run_dir / f for f in ARTIFACT_FILES if (run_dir / f).is_file()]
    try:
        plan = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")).get("plan")
    except (OSError, ValueError):
        plan = None
    if plan:  # the plan as its own artefact
        write_json(run_dir / "plan.json", plan)
        files.append(run_dir / "plan.json")
    report = run_dir / "report"
    files += sorted(p for p in report.glob("*.html")) if report.is_dir() else []
    model_dir = run_dir / "model" if (run_dir / "model").is_dir() else None
    backend.log_artifacts(run_dir, files, model_dir)
    state["artifacts_logged"] = True
    state["model_logged"] = model_dir is not None
    write_state(run_dir, state)


def _register(run_dir: Path, backend: MlflowBackend, state: dict, model_name: str) -> None:
    """The logged model in MLflow's registry with its lineage and gate verdicts, unless a gate refuses it."""
    refused = gates_block_registration(run_dir)  # `gates.on_fail: fail` and a gate failed: never in the registry
    if refused:
        state["not_registered"] = refused
        return
    # registered with its gate verdicts (a model failing its gates under `on_fail: warn` says so in its tags and description)
    if backend.model_uri is None and state.get("model_logged"):
        backend.model_uri = f"runs:/{state['run_id']}/model"
    reg = backend.register(model_name, lineage_tags(run_dir) | gate_tags(run_dir), gates_description(run_dir))
    if reg:
        state["registered"] = reg
        state.pop("not_registered", None)


def _real_uri(stored: str | None, run_dir: Path) -> str | None:
    """The tracking URI with its real credentials, in memory only. The run directory's config holds it redacted
    (`http://user:***@host`); sending the mask as the password would fail (or, worse, log in as someone else), so the
    value comes from where the user gave it: the config file the run was started from (manifest.json's `config_path`),
    else `$MLFLOW_TRACKING_URI`, else (in a cluster job) the env vars trainpipe's references name, each only when it
    redacts to the stored URI. Else the credential is left out of the
    URI for MLflow's own `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` when they are set; else TrackingError."""
    if not stored or "://" not in stored or MASK not in stored:
        return stored
    candidates = []
    try:
        config_path = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")).get("config_path")
        if config_path and Path(config_path).is_file():
            given = load_yaml_text(Path(config_path).read_text(encoding="utf-8"), f"`{config_path}`") or {}
            candidates.append((given.get("tracking") or {}).get("uri"))
    except (OSError, ValueError, AttributeError):
        pass
    candidates.append(os.environ.get("MLFLOW_TRACKING_URI"))
    try:  # a Kubeflow task or CronJob pod: the credential from the Kubernetes Secret's env (`$(TRAINPIPE_SECRET_TRACKING_URI_...)`)
        candidates.append(resolve_references(SecretRefs("").url(stored, "tracking.uri")))
    except KeyError:
        pass
    for cand in candidates:
        if isinstance(cand, str) and redact_url(cand) == stored:
            return cand
    secret_query = [part for part, value in url_secrets(stored) if part.startswith("query")]
    if not secret_query and os.environ.get("MLFLOW_TRACKING_PASSWORD"):  # MLflow's basic auth from the environment
        scheme, _, rest = stored.partition("://")
        auth, at, host = rest.partition("/")[0].rpartition("@")
        return f"{scheme}://{host}{rest[len(auth) + len(at) + len(host):]}"
    raise TrackingError(
        f"The run's tracking URI `{stored}` carries a credential, which trainpipe never writes into the run directory, and "
        f"neither the config file the run was started from (manifest.json's `config_path`) nor `$MLFLOW_TRACKING_URI` gives "
        f"it; trainpipe does not send the mask `{MASK}` in its place. Pass the URI with its credential (`trainpipe track sync "
        f"{run_dir} --uri 'http://user:PASSWORD@host'`), or set `$MLFLOW_TRACKING_URI` to it (or `$MLFLOW_TRACKING_USERNAME` and "
        f"`$MLFLOW_TRACKING_PASSWORD`), then run `trainpipe track sync` again. Nothing was sent or written.")


def log_artifact(run_dir: str | Path, path: str | Path) -> bool:
    """Add one file to the run's MLflow run after the run ended (the pipeline's report page). False when the run has no
    MLflow run or the tracker cannot be reached (the file stays in the run directory)."""
    run_dir = Path(run_dir).resolve()
    state = read_state(run_dir)
    if state.get("backend") != "mlflow" or not state.get("run_id"):
        return False
    cfg = load_yaml_text((run_dir / "config.resolved.yaml").read_text(encoding="utf-8"), "config.resolved.yaml") or {}
    try:
        settings = resolve_settings(cfg.get("tracking") or {}, run_dir, cfg.get("name"))
        settings["uri"] = _real_uri(settings["uri"], run_dir)  # the credential as given, never the run directory's mask
        b = MlflowBackend(settings)
        b.client.log_artifact(state["run_id"], str(path))
        return True
    except Exception:  # noqa: BLE001 - the page stays in the run directory and the store
        return False


def register_model(run_dir: str | Path, *, name: str | None = None, tags: dict | None = None) -> dict | None:
    """Register `run_dir`'s logged model (its MLflow run) under `name` with the run's lineage and `tags` (the pipeline's
    register step). Returns {name, version, source}, or None when the run has no MLflow run with a logged model."""
    run_dir = Path(run_dir).resolve()
    state = read_state(run_dir)
    if state.get("backend") != "mlflow" or not state.get("run_id") or not state.get("model_logged"):
        return None
    cfg = load_yaml_text((run_dir / "config.resolved.yaml").read_text(encoding="utf-8"), "config.resolved.yaml") or {}
    refused = gates_block_registration(run_dir)
    if refused:
        raise TrackingError(f"`{run_dir}`'s model is {refused}. Fix the cause, or set `gates.on_fail: warn` to register it tagged "
                            "`trainpipe.gates.passed=false`.")
    settings = resolve_settings(cfg.get("tracking") or {}, run_dir, cfg.get("name"))
    settings["uri"] = _real_uri(settings["uri"], run_dir)  # the credential as given, never the run directory's mask
    b = MlflowBackend(settings)
    b.run_id = state["run_id"]
    b.model_uri = f"runs:/{b.run_id}/model"
    reg = b.register(name or settings["model_name"], lineage_tags(run_dir) | gate_tags(run_dir) | {k: redact_text(str(v)) for k, v in (tags or {}).items()},
                     gates_description(run_dir))
    state["registered"] = reg
    write_state(run_dir, state)
    return reg


def _wandb_sync(run_dir: Path, state: dict) -> dict:
    """An offline W&B run is uploaded by W&B's own `wandb sync` (it holds everything the run logged)."""
    import shutil
    import subprocess

    dirs = sorted(str(p) for p in (run_dir / "wandb").glob("offline-run-*"))
    if not dirs:
        raise TrackingError(f"`{run_dir}/wandb` holds no offline W&B run to sync.")
    exe = shutil.which("wandb")
    if exe is None:
        raise TrackingError("The `wandb` command is not installed; `pip install 'trainpipe[wandb]'`, then run `trainpipe track sync` again.")
    done = subprocess.run([exe, "sync", *dirs], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise TrackingError(f"`wandb sync` failed ({done.returncode}): {redact_text((done.stderr or done.stdout)[-400:])} The offline run stays in `{run_dir / 'wandb'}`.")
    state.update(pending=False, synced_at=time.time(), mode="synced")
    state.pop("error", None)
    write_state(run_dir, state)
    return state
