"""Triggers: `trainpipe pipeline schedule CONFIG --cron "0 3 * * *" [--on-new-data]`.

- **cron**: a long-running loop that sleeps until the next time the five-field cron expression (minute hour day-of-month
  month day-of-week; `*`, `*/n`, `a-b`, `a-b/n`, `a,b,c`, names not supported) matches, then runs the pipeline. The clock
  and the sleep are injected, so a test drives the loop with a fake clock.
- **on new data**: at each tick the data sources are hashed (the same SHA-256 the manifest records); the pipeline runs
  only when a source's content hash differs from the last run's (recorded in the artefact store under `triggers/`), and
  otherwise the tick says "no new data" and does nothing.
- **emitted**: `--emit k8s-cronjob -o cronjob.yaml` writes a Kubernetes CronJob (batch/v1) whose pod runs the same
  command once per schedule (`--once`), the trainpipe image pinned to this version, resources from the plan.
- **Kubeflow recurring run**: `--emit kfp-recurring-run -o recurring-run.yaml` writes the body of the KFP v2beta1 API's
  `POST /apis/v2beta1/recurringruns` (what `kfp.Client().create_recurring_run` sends): `display_name`, `pipeline_spec`
  (the same IR `trainpipe pipeline compile` writes, as kfp's own loader reads it), `trigger.cron_schedule.cron`,
  `max_concurrency: 1`, `no_catchup: true`, `mode: ENABLE`, `runtime_config.parameters` (the store), and beside it the
  compiled package (`recurring-run.pipeline.yaml`); the header and the command's output give the `kfp` CLI line and the
  `kfp.Client().create_recurring_run(...)` call that submit it. KFP's cron (robfig/cron) has six fields, seconds first:
  the five-field expression becomes `0 <minute> <hour> <day> <month> <weekday>` (weekday 7 written as 0), and runs in the
  KFP controller's time zone (UTC unless set), as the loop here. KFP starts the pipeline at every time; with
  `--on-new-data` nothing more is needed there: a run whose data and config did not change reuses every step from the
  store (no training) through trainpipe's own cache.
- **secrets**: neither emitted file nor any printed line holds a credential of the config's URLs: each is a reference
  `$(TRAINPIPE_SECRET_...)` to a key of the Kubernetes Secret `trainpipe-<name>-secrets` (the CronJob's container gets
  them by `secretKeyRef`, and the ConfigMap of the config it mounts, in the same file, holds the references; Kubeflow
  tasks get them by kfp-kubernetes' `secretAsEnv`); the output says which Secret to create. In the pod, the Trigger
  (`--once`) resolves them in memory (`resolve_cluster_config`). Every file goes through the ownership rule.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from trainpipe import ownership
from trainpipe.errors import ConfigError
from trainpipe.launch import cluster_layout
from trainpipe.launch_files import PVC_FILE, WORKSPACE, cluster_config, workspace_pvc
from trainpipe.pipeline.dag import default_store, pipeline_id, run_pipeline
from trainpipe.pipeline.digests import source_sha256
from trainpipe.pipeline.kfp_compile import compile_pipeline, k8s_name, pinned_image, protected_reads, secret_refs
from trainpipe.pipeline.store import ArtifactStore
from trainpipe.redact import MissingReference, redact_obj, redact_text, REF_PREFIX, resolve_obj, resolve_references

FIELDS = ("minute", "hour", "day of month", "month", "day of week")
BOUNDS = {"minute": (0, 59), "hour": (0, 23), "day of month": (1, 31), "month": (1, 12), "day of week": (0, 7)}
_FIELD = re.compile(r"[0-9*,/-]+", re.ASCII)  # digits 0-9 only: `int()` also reads Arabic-Indic and other Unicode digits
NEVER_AFTER = timedelta(days=366 * 5)  # an expression with no time within five years is refused (`0 0 31 2 *`)


@dataclass(frozen=True)
class Cron:
    """A checked five-field expression; the times come from cronsim (a maintained cron library), in UTC."""

    expr: str

    def _times(self, after: datetime):
        from cronsim import CronSim

        aware = after.tzinfo is not None
        it = CronSim(self.expr, after if aware else after.replace(tzinfo=timezone.utc))
        return (t if aware else t.replace(tzinfo=None) for t in it)

    @property
    def weekdays(self) -> frozenset:
        """The days of the week it fires on (0 = Sunday; 7 is written as 0)."""
        from cronsim import CronSim

        return frozenset(d % 7 for d in CronSim(self.expr, datetime(2000, 1, 1, tzinfo=timezone.utc)).weekdays)

    def matches(self, t: datetime) -> bool:
        m = t.replace(second=0, microsecond=0)
        return self.next_after(m - timedelta(minutes=1)) == m

    def next_after(self, t: datetime) -> datetime:
        """The first matching minute strictly after `t`."""
        n = next(self._times(t.replace(second=0, microsecond=0)), None)
        if n is None or n - t > NEVER_AFTER:
            raise ConfigError(f"`--cron {self.expr!r}` never matches (checked five years ahead).", [f"--cron {self.expr}"])
        return n


def _cron_error(expr: str, why: str, where: str) -> ConfigError:
    return ConfigError(
        f"`--cron {expr!r}`{'' if why.startswith(':') else ' '}{why}. A cron expression has five fields of ASCII digits, `*`, `,`, `-` and `/` (minute 0-59, hour 0-23, "
        "day of month 1-31, month 1-12, day of week 0-7 with 0 and 7 Sunday), e.g. `0 3 * * *` (03:00 UTC every day) or `*/15 * * * 1-5` "
        "(every 15 minutes on weekdays).", [f"--cron {expr}: {where}"])


def parse_cron(expr: str) -> Cron:
    """The checked expression: five fields of ASCII digits and `* , - /` (no names, no `L`/`#`/`?`: what Kubernetes and
    KFP read alike), valid for cronsim, and firing at least once in the next five years."""
    if not expr.isascii():
        bad = next(c for c in expr if not c.isascii())
        raise _cron_error(expr, f"holds the non-ASCII character {bad!r} (U+{ord(bad):04X}); write the digits as 0-9", "non-ASCII")
    parts = expr.split()
    if len(parts) != 5:
        raise _cron_error(expr, f"has {len(parts)} fields, not five", "fields")
    for text, name in zip(parts, FIELDS):
        if not _FIELD.fullmatch(text):
            what = "names (MON, JAN) are not supported" if any(c.isalpha() for c in text) else "only digits, `*`, `,`, `-` and `/` are allowed"
            raise _cron_error(expr, f"has `{text}` as its {name} field: {what}", name)
        lo, hi = BOUNDS[name]
        for item in text.split(","):
            rng, _, step = item.partition("/")
            if any(not lo <= int(v) <= hi for v in re.findall(r"[0-9]+", rng)):
                raise _cron_error(expr, f": the {name} field `{text}` is outside {lo}-{hi}", name)
            if step and not (step.isdigit() and int(step) >= 1):
                raise _cron_error(expr, f": the {name} field `{text}` has a step below 1", name)
    from cronsim import CronSimError

    cron = Cron(" ".join(parts))
    try:
        cron.next_after(datetime.now(timezone.utc))
    except CronSimError as exc:
        why = str(exc).rstrip(".").lower()
        never = "day-of-month" in why and all(_FIELD.fullmatch(p) for p in parts)
        raise _cron_error(expr, "never fires (no such day in the months it names)" if never and _days_exist(parts) else f"is not valid ({why})", why) from None
    return cron


def _days_exist(parts: list[str]) -> bool:
    """Every day-of-month number is 1-31 (so cronsim's 'bad day-of-month' means the months have no such day)."""
    return all(1 <= int(n) <= 31 for n in re.findall(r"[0-9]+", parts[2].split("/")[0]))


# --------------------------------------------------------------------------- new data


def source_hashes(cfg, digests=None) -> dict[str, str]:
    """Every data source's content SHA-256 (the run's `data`, every stage's and every adapter's); with `digests` (the
    store's digest cache, digests.py) a data file whose stat is unchanged is not read again."""
    datas = [("data", cfg.data)] if cfg.data is not None else []
    datas += [(f"stages[{i}].data", st.data) for i, st in enumerate(cfg.stages or []) if st.data is not None]
    datas += [(f"adapters.{a.name}.data", a.data) for a in cfg.method.adapters]
    return {f"{where}.sources[{i}]": source_sha256(src, digests) for where, d in datas for i, src in enumerate(d.sources)}


class Trigger:
    """Runs the pipeline of a config when asked, and with `on_new_data` only when a source's hash changed since the
    last run it started (recorded in the artefact store under `triggers/<pipeline id>.json`)."""

    def __init__(self, cfg, *, config_path: str | None, on_new_data: bool, store: str | None = None,
                 run: Callable[[], dict] | None = None, log: Callable[[str], None] = print):
        cfg = resolve_cluster_config(cfg)  # in a CronJob's pod: the Secret's values for the references, in memory
        store = _resolve_store(store)
        self.cfg, self.on_new_data, self.log = cfg, on_new_data, log
        self.store = ArtifactStore(store or default_store(cfg))
        self.state_key = f"triggers/{pipeline_id(cfg)}.json"
        self.run = run or (lambda: run_pipeline(cfg, config_path=config_path, store=self.store.url))
        self.runs = 0

    def tick(self, now: datetime) -> str:
        """One scheduled moment: `ran` or `skipped` (no new data)."""
        hashes = source_hashes(self.cfg, self.store.digests) if self.on_new_data else {}
        if self.on_new_data:
            last = (self.store.get_json(self.state_key) or {}).get("sources")
            if last == hashes:
                self.log(f"{now:%Y-%m-%d %H:%M} no new data: every source hashes as at the last run ({len(hashes)} source(s)); nothing to do")
                return "skipped"
            changed = sorted(k for k in set(hashes) | set(last or {}) if (last or {}).get(k) != hashes.get(k))
            self.log(f"{now:%Y-%m-%d %H:%M} new data in {', '.join(changed)}: running the pipeline" if last is not None else
                     f"{now:%Y-%m-%d %H:%M} first run for these sources: running the pipeline")
        else:
            self.log(f"{now:%Y-%m-%d %H:%M} scheduled: running the pipeline")
        self.run()
        self.runs += 1
        self.store.put_json(self.state_key, {"sources": hashes, "last_run": now.isoformat()})
        return "ran"


def schedule_loop(trigger: Trigger, cron: Cron | None, *, interval_seconds: float = 300.0, max_ticks: int | None = None,
                  clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc), sleep: Callable[[float], None] = time.sleep) -> list[tuple[datetime, str]]:
    """Sleep until each cron time (or every `interval_seconds` without a cron) and tick; `max_ticks` ends the loop
    (None: forever, until Ctrl-C). Returns (time, outcome) per tick."""
    done: list[tuple[datetime, str]] = []
    while max_ticks is None or len(done) < max_ticks:
        now = clock()
        at = cron.next_after(now) if cron else now + timedelta(seconds=interval_seconds if done else 0)
        wait = (at - now).total_seconds()
        if wait > 0:
            sleep(wait)
        done.append((at, trigger.tick(at)))
    return done


# --------------------------------------------------------------------------- Kubernetes CronJob


def k8s_cronjob(cfg, *, cron: str, config_path: str, on_new_data: bool, store: str | None = None, refs=None) -> dict:
    """The CronJob (a dict). Credentials of the store URL are references (`$(TRAINPIPE_SECRET_...)`, which Kubernetes
    expands in the command) to env vars the container gets from the Secret of `refs` (`valueFrom.secretKeyRef`)."""
    parse_cron(cron)
    refs = secret_refs(cfg) if refs is None else refs
    layout = cluster_layout(cfg)
    name = k8s_name(cfg)
    where = store or default_store(cfg)
    # a folder of this machine is none of the pod's: the store lives on the workspace claim
    store_arg = refs.url(where, "store" if store else "pipeline.store") if "://" in where else f"{WORKSPACE}/store"
    cmd = ["trainpipe", "pipeline", "schedule", f"/config/{Path(config_path).name}", "--once", "--store", store_arg]
    if on_new_data:
        cmd.append("--on-new-data")
    res = {"memory": f"{layout['memory_gib']}Gi", "cpu": str(layout["cpus_per_node"])}
    if layout["gpus_per_node"]:
        res["nvidia.com/gpu"] = layout["gpus_per_node"]
    return {
        "apiVersion": "batch/v1", "kind": "CronJob",
        "metadata": {"name": name[:52], "labels": {"app.kubernetes.io/name": "trainpipe", "trainpipe/version": _label(pinned_image(cfg.pipeline.image))}},
        "spec": {
            "schedule": cron, "concurrencyPolicy": "Forbid", "startingDeadlineSeconds": 3600, "successfulJobsHistoryLimit": 3, "failedJobsHistoryLimit": 3,
            "jobTemplate": {"spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "trainpipe", "image": pinned_image(cfg.pipeline.image), "command": cmd,
                                "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                                "resources": {"limits": res, "requests": res},
                                "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True},
                                                 {"name": "workspace", "mountPath": WORKSPACE}]}],
                "volumes": [{"name": "config", "configMap": {"name": f"{name[:45]}-config"}},
                            {"name": "workspace", "persistentVolumeClaim": {"claimName": workspace_claim(cfg)}}],
            }}}},
        },
    }


def workspace_claim(cfg) -> str:
    """The claim the pods mount at /workspace: the one `trainpipe launch --emit k8s` names for the same config."""
    return f"{k8s_name(cfg)[:52].rstrip('-')[:40]}-workspace"


def _secret_env(cj: dict, refs) -> None:
    """Give the CronJob's container each reference of `refs` as an env var from the Kubernetes Secret (declared before
    use: Kubernetes expands `$(VAR)` in the command from the container's env)."""
    c = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    c["env"] += [{"name": env, "valueFrom": {"secretKeyRef": {"name": refs.name, "key": env}}} for env in refs.refs]


def emit_k8s_cronjob(cfg, *, cron: str | None, config_path: str | Path, out: Path | None, on_new_data: bool = False, store: str | None = None,
                     echo: Callable[[str], None] = print) -> dict:
    """`--emit k8s-cronjob`: the CronJob, written to `out` through the ownership rule (or printed). When the config's URLs
    carry credentials, the ConfigMap the pod mounts, in the same file, has references in their place and
    the container reads them from a Kubernetes Secret; the console says which Secret to create. Returns the CronJob."""
    import yaml

    if not cron:
        raise ConfigError("`--emit k8s-cronjob` needs `--cron \"...\"` (the CronJob's schedule).", ["--cron missing"])
    what = "the Kubernetes CronJob"
    reads = protected_reads(cfg, config_path)
    if out is not None:
        ownership.check_writable(out, what=what, reads=reads)
    refs = secret_refs(cfg)
    cj = k8s_cronjob(cfg, cron=cron, config_path=str(config_path), on_new_data=on_new_data, store=store, refs=refs)
    pod_config, copy = cluster_config(cfg, str(config_path))  # its paths the pod's (the workspace claim), never this machine's
    mounted = refs.obj(pod_config)  # the config the pod reads, credentials as references
    vol = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    docs = [cj, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": vol, "labels": {"app.kubernetes.io/name": "trainpipe"}},
                 "data": {Path(config_path).name: _Block(yaml.safe_dump(mounted, sort_keys=False))}}]  # the config the pod mounts, always
    if refs:
        _secret_env(cj, refs)
    text = yaml.dump_all(docs, Dumper=_block_dumper(), sort_keys=False)
    notes = refs.note("the CronJob")
    notes.append(f"the config the pod mounts is the ConfigMap `{vol}` in the same file" + (" (the credentials as references)" if refs else "")
                 + "; `kubectl apply -f` creates both.")
    claim = workspace_claim(cfg)
    notes.append(f"data, store and outputs live on the volume claim `{claim}` at {WORKSPACE}" + (f" ({PVC_FILE} beside the CronJob: "
                 f"`kubectl apply -f {PVC_FILE}` first)" if out is not None else "") + (": copy there " + "; ".join(copy) if copy else "."))
    if out is not None:
        pvc = ownership.check_writable(Path(out).parent / PVC_FILE, what="the workspace volume claim", reads=reads)
        ownership.write_text(out, text, what=what, reads=reads)
        ownership.write_text(pvc, yaml.safe_dump(workspace_pvc(claim), sort_keys=False), what="the workspace volume claim", reads=reads)
        echo(redact_text(f"k8s-cronjob: {out}"))
    else:
        echo(redact_text(text).rstrip("\n"))
    for n in notes:
        echo(redact_text(n))
    return cj


class _Block(str):
    """A multi-line string written as a YAML literal block (`|`): the ConfigMap's config reads as the file it is."""


def _block_dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Block, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style="|"))
    return Dumper


def resolve_cluster_config(cfg):
    """`cfg` with its references (`$(TRAINPIPE_SECRET_...)`, written by `--emit k8s-cronjob` / `pipeline compile` in place of
    credentials) replaced by the environment's values (in the pod: from the Kubernetes Secret), in memory only; `cfg`
    itself when it has none. A missing variable: ConfigError naming it and the Secret to create."""
    import json

    data = cfg.model_dump(mode="json")
    if "$(" + REF_PREFIX not in json.dumps(data):
        return cfg
    try:
        resolved = resolve_obj(data)
    except MissingReference as exc:
        raise ConfigError(str(exc), [f"${exc.env} missing"]) from None
    return type(cfg).model_validate(resolved)


def _resolve_store(store: str | None) -> str | None:
    try:
        return resolve_references(store) if store else store
    except MissingReference as exc:
        raise ConfigError(str(exc), [f"${exc.env} missing"]) from None


def _label(image: str) -> str:
    return image.rsplit(":", 1)[-1][:63]


# --------------------------------------------------------------------------- Kubeflow Pipelines recurring run


def kfp_cron(expr: str) -> str:
    """A five-field cron expression as KFP's six-field one (robfig/cron: seconds first; weekday 0-6, so 7 -> 0)."""
    parts = expr.split()
    if len(parts) == 6:
        raise ConfigError(
            f"`--cron {expr!r}` has six fields. Give the usual five (minute hour day-of-month month day-of-week, e.g. `0 3 * * *`): "
            "trainpipe adds the seconds field KFP's cron wants (`0 0 3 * * *`).", [f"--cron {expr}"])
    c = parse_cron(expr)
    dow = parts[4]
    if any("7" in x for x in dow.replace("/", ",").replace("-", ",").split(",")):
        dow = ",".join(str(d) for d in sorted(c.weekdays))
    return " ".join(["0", *parts[:4], dow])


def kfp_recurring_run(cfg, *, cron: str, pipeline_spec: dict, store: str | None = None, refs=None) -> dict:
    """The v2beta1 RecurringRun body (the JSON names of `kfp_server_api.V2beta1RecurringRun`) for the compiled pipeline
    `pipeline_spec`; `experiment_id` is left out (the server's default experiment, or add it). The store's credentials are
    references to the Secret of `refs` (as in the compiled pipeline), never values."""
    refs = secret_refs(cfg) if refs is None else refs
    name = k8s_name(cfg)
    return {
        "display_name": name,
        "description": f"trainpipe pipeline {cfg.name or ''} on cron `{cron}` (UTC)".replace("  ", " "),
        "pipeline_spec": pipeline_spec,
        "runtime_config": {"parameters": {"store": refs.url(store, "store") if store else refs.url(default_store(cfg), "pipeline.store")}},
        "trigger": {"cron_schedule": {"cron": kfp_cron(cron)}},
        "max_concurrency": 1,  # one training at a time, as the CronJob's concurrencyPolicy: Forbid
        "no_catchup": True,  # after a pause, one run now, not one per missed time
        "mode": "ENABLE",
    }


def load_kfp_package(path: str | Path) -> dict:
    """The compiled IR as `kfp.Client` reads it before sending (kfp's loader: protobuf parse, then dict)."""
    from kfp.client.client import _extract_pipeline_yaml

    return _extract_pipeline_yaml(str(path)).to_dict()


def submit_lines(body: dict, package: str, body_file: str | None) -> list[str]:
    """The `kfp` CLI line, the Python call and the REST call that create `body`'s recurring run."""
    import shlex

    cron, store = body["trigger"]["cron_schedule"]["cron"], body["runtime_config"]["parameters"]["store"]
    cli = ["kfp", "--endpoint", "$KFP_ENDPOINT", "recurring-run", "create", "--experiment-name", "trainpipe", "--job-name", body["display_name"],
           "--description", body["description"], "--cron-expression", cron, "--max-concurrency", str(body["max_concurrency"]),
           "--no-catchup", "--enabled", "--pipeline-package-path", package, f"store={store}"]
    lines = [
        " ".join(a if a == "$KFP_ENDPOINT" else shlex.quote(a) for a in cli),
        "import kfp, os; c = kfp.Client(host=os.environ['KFP_ENDPOINT']); c.create_recurring_run("
        f"experiment_id=c.create_experiment('trainpipe').experiment_id, job_name={body['display_name']!r}, description={body['description']!r}, "
        f"cron_expression={cron!r}, max_concurrency={body['max_concurrency']}, no_catchup=True, enabled=True, "
        f"params={{'store': {store!r}}}, pipeline_package_path={package!r})",
    ]
    if body_file and body_file.endswith(".json"):
        lines.append(f"curl -X POST \"$KFP_ENDPOINT/apis/v2beta1/recurringruns\" -H 'Content-Type: application/json' -d @{shlex.quote(body_file)}"
                     "   # add \"experiment_id\" to the body for an experiment other than the default")
    return lines


def emit_kfp_recurring_run(cfg, *, cron: str | None, out: Path | None, store: str | None = None, image: str | None = None,
                           on_new_data: bool = False, echo: Callable[[str], None] = print, config_path: str | Path | None = None) -> dict:
    """`--emit kfp-recurring-run`: compile the pipeline, write the body (`out`: YAML, or JSON for a .json name; none:
    stdout) and the package beside it, both through the ownership rule (checked before either is written), and print the
    submit lines. Credentials are references to a Kubernetes Secret (said on the console). Returns the body."""
    import json
    import tempfile

    import yaml

    if not cron:
        raise ConfigError("`--emit kfp-recurring-run` needs `--cron \"...\"` (the recurring run's schedule, five fields, e.g. `0 3 * * *`).", ["--cron missing"])
    kfp_cron(cron)  # a bad expression stops before anything is compiled or written
    reads = protected_reads(cfg, config_path)
    package = out.with_name(f"{out.stem}.pipeline.yaml") if out else None
    if out:
        ownership.check_writable(out, what="the Kubeflow recurring run", reads=reads)
        ownership.check_writable(package, what="the compiled Kubeflow pipeline", reads=reads)
    refs = secret_refs(cfg)
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_pipeline(cfg, None, store=store, image=image, refs=refs)
        tmp = Path(d) / "pipeline.yaml"
        tmp.write_text(compiled["text"], encoding="utf-8")
        body = redact_obj(kfp_recurring_run(cfg, cron=cron, pipeline_spec=load_kfp_package(tmp), store=store, refs=refs))
    lines = submit_lines(body, str(package) if out else "pipeline.yaml", str(out) if out else None)
    notes = [f"KFP cron has six fields (seconds first): `{cron}` -> `{body['trigger']['cron_schedule']['cron']}`, in the KFP controller's time zone (UTC unless set)."]
    if on_new_data:
        notes.append("--on-new-data: KFP starts the pipeline at every time; with unchanged data and config every step is reused from the store (no training).")
    if not out:
        notes.append(f"The package for the lines below: `trainpipe pipeline compile CONFIG -o pipeline.yaml` (the same IR as `pipeline_spec`).")
    secret_notes = refs.note("the recurring run")
    if out and out.suffix == ".json":
        text = json.dumps(body, indent=2) + "\n"
    else:
        header = ["# Kubeflow Pipelines v2beta1 recurring run (POST /apis/v2beta1/recurringruns), written by trainpipe.", *[f"# {n}" for n in notes + secret_notes],
                  "# Submit with one of:", *[f"#   {x}" for x in lines]]
        text = "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, width=1 << 16)
    if out:
        ownership.write_text(package, compiled["text"], what="the compiled Kubeflow pipeline", reads=reads)
        ownership.write_text(out, text, what="the Kubeflow recurring run", reads=reads)
        echo(redact_text(f"kfp-recurring-run: {out} (body), {package} (compiled pipeline)"))
        for n in notes + secret_notes:
            echo(redact_text(n))
        echo("submit with one of:")
        for x in lines:
            echo(redact_text(f"  {x}"))
    else:
        echo(redact_text(text).rstrip("\n"))
    return body
