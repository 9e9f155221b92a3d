"""Triggers: `trainpipe pipeline schedule CONFIG --cron "0 3 * * *" [--on-new-data]`.

- **cron**: a long-running loop that sleeps until the next time the five-field cron expression (minute hour day-of-month
  month day-of-week; `*`, `*/n`, `a-b`, `a-b/n`, `a,b,c`, names not supported) matches, then runs the pipeline. The clock
  and the sleep are injected, so a test drives the loop with a fake clock.
- **on new data**: at each tick the data sources are hashed (the same SHA-256 the manifest records); the pipeline runs
  only when a source's content hash differs from the last run's (recorded in the artefact store under `triggers/`), and
  otherwise the tick says "no new data" and does nothing.
- **emitted**: `--emit k8s-cronjob -o cronjob.yaml` writes a Kubernetes CronJob (batch/v1) whose pod runs the same
  command once per schedule (`--once`), the trainpipe image pinned to this version, resources from the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from trainpipe.errors import ConfigError

FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 6))


@dataclass(frozen=True)
class Cron:
    expr: str
    minutes: frozenset
    hours: frozenset
    days: frozenset
    months: frozenset
    weekdays: frozenset
    dom_any: bool
    dow_any: bool

    def matches(self, t: datetime) -> bool:
        if t.minute not in self.minutes or t.hour not in self.hours or t.month not in self.months:
            return False
        dom, dow = t.day in self.days, (t.isoweekday() % 7) in self.weekdays
        if self.dom_any or self.dow_any:  # cron: when both are restricted, either may match
            return dom and dow
        return dom or dow

    def next_after(self, t: datetime) -> datetime:
        """The first matching minute strictly after `t`."""
        n = t.replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = n + timedelta(days=366 * 5)
        while n < limit:
            if n.month not in self.months:
                n = (n.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
                continue
            if not self._day_ok(n):
                n = n.replace(hour=0, minute=0) + timedelta(days=1)
                continue
            if n.hour not in self.hours:
                n = n.replace(minute=0) + timedelta(hours=1)
                continue
            if n.minute in self.minutes:
                return n
            n += timedelta(minutes=1)
        raise ConfigError(f"`--cron {self.expr}` never matches (checked five years ahead).", [f"--cron {self.expr}"])

    def _day_ok(self, t: datetime) -> bool:
        dom, dow = t.day in self.days, (t.isoweekday() % 7) in self.weekdays
        return (dom and dow) if (self.dom_any or self.dow_any) else (dom or dow)


def parse_cron(expr: str) -> Cron:
    parts = expr.split()
    if len(parts) != 5:
        raise ConfigError(
            f"`--cron {expr!r}` has {len(parts)} fields; a cron expression has five: minute hour day-of-month month day-of-week, "
            "e.g. `0 3 * * *` (03:00 every day) or `*/15 * * * 1-5` (every 15 minutes on weekdays).", [f"--cron {expr}"])
    sets = []
    for text, (name, lo, hi) in zip(parts, FIELDS):
        values: set[int] = set()
        for item in text.split(","):
            rng, _, step_s = item.partition("/")
            try:
                step = int(step_s) if step_s else 1
                if rng == "*":
                    a, b = lo, hi
                elif "-" in rng:
                    a, b = (int(x) for x in rng.split("-", 1))
                else:
                    a = b = int(rng)
                    if step_s:
                        b = hi
            except ValueError:
                raise ConfigError(f"`--cron {expr!r}`: the {name} field `{text}` is not a number, `*`, a range `a-b` or a step `*/n`.",
                                  [f"--cron {expr}: {name}"]) from None
            if name == "day of week" and b == 7:
                values.add(0)  # 7 is Sunday too
                b = 6 if a <= 6 else 0
            if not (lo <= a <= hi and lo <= b <= hi and a <= b and step >= 1):
                raise ConfigError(f"`--cron {expr!r}`: the {name} field `{text}` is outside {lo}-{hi}.", [f"--cron {expr}: {name}"])
            values |= set(range(a, b + 1, step))
        sets.append(frozenset(values))
    return Cron(expr, *sets, dom_any=parts[2] == "*", dow_any=parts[4] == "*")


# --------------------------------------------------------------------------- new data


def source_hashes(cfg, digests=None) -> dict[str, str]:
    """Every data source's content SHA-256 (the run's `data`, every stage's and every adapter's); with `digests` (the
    store's digest cache, digests.py) a data file whose stat is unchanged is not read again."""
    from trainpipe.pipeline.digests import source_sha256

    datas = [("data", cfg.data)] if cfg.data is not None else []
    datas += [(f"stages[{i}].data", st.data) for i, st in enumerate(cfg.stages or []) if st.data is not None]
    datas += [(f"adapters.{a.name}.data", a.data) for a in cfg.method.adapters]
    return {f"{where}.sources[{i}]": source_sha256(src, digests) for where, d in datas for i, src in enumerate(d.sources)}


class Trigger:
    """Runs the pipeline of a config when asked, and with `on_new_data` only when a source's hash changed since the
    last run it started (recorded in the artefact store under `triggers/<pipeline id>.json`)."""

    def __init__(self, cfg, *, config_path: str | None, on_new_data: bool, store: str | None = None,
                 run: Callable[[], dict] | None = None, log: Callable[[str], None] = print):
        from trainpipe.pipeline.dag import default_store, pipeline_id, run_pipeline
        from trainpipe.pipeline.store import ArtifactStore

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


def k8s_cronjob(cfg, *, cron: str, config_path: str, on_new_data: bool, store: str | None = None) -> dict:
    from trainpipe.distributed.launch import cluster_layout
    from trainpipe.pipeline.dag import default_store
    from trainpipe.pipeline.kfp_compile import pinned_image

    parse_cron(cron)
    layout = cluster_layout(cfg)
    name = "trainpipe-" + "".join(c if c.isalnum() else "-" for c in (cfg.name or "run").lower())
    cmd = ["trainpipe", "pipeline", "schedule", f"/config/{Path(config_path).name}", "--once", "--store", store or default_store(cfg)]
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
                                "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}]}],
                "volumes": [{"name": "config", "configMap": {"name": f"{name[:45]}-config"}}],
            }}}},
        },
    }


def _label(image: str) -> str:
    return image.rsplit(":", 1)[-1][:63]
