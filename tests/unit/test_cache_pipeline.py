"""The pipeline's parts without training: the fsspec artefact store (`memory://` and `file://`), the step cache
(checksums, a failed entry ignored, gc), the DAG of stages and adapters, cron triggers driven by a fake clock (time is
the one thing a test cannot wait for), new-data triggers on real files, the emitted CronJob."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from trainpipe.config import RunConfig
from trainpipe.errors import ConfigError
from trainpipe.pipeline.cache import StepCache, code_hash, step_key
from trainpipe.pipeline.store import ArtifactStore


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    url = f"memory://trainpipe-test-{uuid.uuid4().hex[:8]}" if request.param == "memory" else (tmp_path / "store").as_uri()
    return ArtifactStore(url)


def _folder(tmp: Path) -> Path:
    d = tmp / "out"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha")
    (d / "sub" / "b.bin").write_bytes(bytes(range(256)))
    return d


def test_store_roundtrip_and_no_temporaries(store, tmp_path):
    files = store.put_path(_folder(tmp_path), "artifacts/x/k1/out")
    assert set(files) == {"a.txt", "sub/b.bin"}
    assert store.get_bytes("artifacts/x/k1/out/a.txt") == b"alpha"
    assert store.file_sha256("artifacts/x/k1/out/sub/b.bin") == files["sub/b.bin"]
    back = store.materialize("artifacts/x/k1/out", tmp_path / "back")
    assert (back / "sub" / "b.bin").read_bytes() == bytes(range(256))
    assert not any(".tmp-" in k for k in store.ls("artifacts/x/k1"))
    assert not list(tmp_path.glob("back.tmp-*"))


def test_store_write_failure_leaves_nothing(store, tmp_path, monkeypatch):
    store.put_bytes("cache/x/k.json", b'{"old": 1}')
    real = store._move

    def broken(tmp, final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_move", broken)
    with pytest.raises(OSError):
        store.put_bytes("cache/x/k.json", b'{"new": 2}')
    monkeypatch.setattr(store, "_move", real)
    assert store.get_bytes("cache/x/k.json") == b'{"old": 1}'  # the previous version intact
    assert store.ls("cache/x") == ["cache/x/k.json"]  # no temporary left


def test_cache_entry_verified_and_bad_checksum_ignored(store, tmp_path):
    cache = StepCache(store)
    key, parts = step_key("evaluate", {"run": "d1"}, {"eval": {"metrics": ["loss"]}}, code_hash(("evaluate",)))
    assert cache.lookup("evaluate", key).entry is None
    (tmp_path / "eval.json").write_text('{"loss": 1.5}')
    cache.save("evaluate", key, parts, {"metrics": tmp_path / "eval.json"}, types={"metrics": "EvalReport"}, lineage={}, seconds=0.1)
    entry = cache.lookup("evaluate", key).entry
    assert entry["outputs"]["metrics"]["type"] == "EvalReport"
    # a flipped byte in an output: ignored with a warning naming the file and both hashes
    store.put_bytes(entry["outputs"]["metrics"]["key"], b'{"loss": 1.6}')
    look = cache.lookup("evaluate", key)
    assert look.entry is None and "sha256" in look.warning and "runs again" in look.warning
    # a tampered entry: its own checksum fails
    cache.save("evaluate", key, parts, {"metrics": tmp_path / "eval.json"}, types={"metrics": "EvalReport"}, lineage={}, seconds=0.1)
    raw = json.loads(store.get_bytes(cache.entry_key("evaluate", key)))
    raw["seconds"] = 99
    store.put_bytes(cache.entry_key("evaluate", key), json.dumps(raw).encode())
    assert "checksum" in cache.lookup("evaluate", key).warning


def test_key_changes_with_each_part():
    base = step_key("train", {"data": "a"}, {"training": {"lr": 1}}, "c1")[0]
    assert step_key("train", {"data": "b"}, {"training": {"lr": 1}}, "c1")[0] != base
    assert step_key("train", {"data": "a"}, {"training": {"lr": 2}}, "c1")[0] != base
    assert step_key("train", {"data": "a"}, {"training": {"lr": 1}}, "c2")[0] != base
    assert step_key("train", {"data": "a"}, {"training": {"lr": 1}}, "c1")[0] == base
    assert code_hash(("data",)) != code_hash(("train",))


def test_gc_keeps_what_is_used(store, tmp_path):
    cache = StepCache(store)
    (tmp_path / "f").write_text("x")
    for k in ("k1", "k2"):
        cache.save("prepare", k, {}, {"data": tmp_path / "f"}, types={}, lineage={}, seconds=0)
    store.put_bytes("artifacts/prepare/orphan/data", b"y")
    removed = cache.gc(keep={("prepare", "k2")})
    assert "cache/prepare/k1.json" in removed and "artifacts/prepare/k1/data" in removed
    # an output with no entry: removed where the ownership manifest proves trainpipe wrote it (a local store); an object
    # store has no such proof, so it stays (issue 22: gc deletes only what it can prove trainpipe's)
    assert ("artifacts/prepare/orphan/data" in removed) == store.local and store.exists("artifacts/prepare/orphan/data") != store.local
    assert [e["key"] for e in cache.entries()] == ["k2"] and cache.lookup("prepare", "k2").entry is not None


def _cfg(tmp: Path, **extra) -> RunConfig:
    (tmp / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    (tmp / "base").mkdir(exist_ok=True)
    return RunConfig.model_validate({"name": "u", "model": {"name_or_path": str(tmp / "base")}, "data": {"sources": [{"path": str(tmp / "d.jsonl")}]},
                                     "output_dir": str(tmp / "run"), **extra})


def test_dag_of_stages_and_adapters(tmp_path):
    from trainpipe.pipeline.dag import build_dag, show

    steps = build_dag(_cfg(tmp_path, stages=["sft", "reward", "rl"]))
    by = {s.id: s for s in steps}
    assert by["reward.train"].inputs["base_model"] == ("sft.export", "model")
    assert by["rl.train"].inputs["base_model"] == ("sft.export", "model") and by["rl.train"].inputs["reward_model"] == ("reward.export", "model")
    assert by["rl.train"].run_dir == (tmp_path / "run" / "rl").resolve()
    text = show(steps)
    assert "sft.export -> rl.train" in text and "reward.export -> rl.train" in text
    # the position of every step after each of its inputs
    order = [s.id for s in steps]
    assert all(order.index(src) < order.index(s.id) for s in steps for src, _ in s.inputs.values())
    ad = build_dag(_cfg(tmp_path, method={"adapters": [{"name": "a", "data": {"sources": [{"path": str(tmp_path / "d.jsonl")}]}},
                                                       {"name": "b", "data": {"sources": [{"path": str(tmp_path / "d.jsonl")}]}}]}))
    assert [s.id for s in ad if s.kind == "train"] == ["adapter-a.train", "adapter-b.train"]
    assert all(not s.inputs.get("base_model") for s in ad)


def test_dag_refuses_mismatched_types(tmp_path):
    from trainpipe.pipeline.dag import PipelineError, Step, check_types

    cfg = _cfg(tmp_path)
    steps = [Step("prepare", "prepare", cfg), Step("evaluate", "evaluate", cfg, {"run": ("prepare", "data"), "data": ("prepare", "data")})]
    with pytest.raises(PipelineError, match="wants RunDir"):
        check_types(steps)


# --------------------------------------------------------------------------- triggers


def test_cron_parse_and_next():
    from trainpipe.pipeline.schedule import parse_cron

    t = datetime(2026, 3, 6, 10, 7, tzinfo=timezone.utc)  # a Friday
    assert parse_cron("*/15 * * * *").next_after(t) == t.replace(minute=15)
    assert parse_cron("0 3 * * *").next_after(t) == datetime(2026, 3, 7, 3, 0, tzinfo=timezone.utc)
    assert parse_cron("30 9 * * 1-5").next_after(t) == datetime(2026, 3, 9, 9, 30, tzinfo=timezone.utc)  # Monday
    assert parse_cron("0 0 1 * *").next_after(t) == datetime(2026, 4, 1, 0, 0, tzinfo=timezone.utc)
    assert parse_cron("0 12 * * 0").next_after(t) == datetime(2026, 3, 8, 12, 0, tzinfo=timezone.utc)  # Sunday
    for bad in ("* * * *", "61 * * * *", "a * * * *"):
        with pytest.raises(ConfigError):
            parse_cron(bad)


class FakeClock:
    """A clock the scheduler sleeps on: sleeping advances it (the test cannot wait hours)."""

    def __init__(self, start: datetime):
        self.t = start
        self.slept: list[float] = []

    def now(self) -> datetime:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += timedelta(seconds=s)


def test_schedule_loop_with_fake_clock_and_new_data(tmp_path):
    from trainpipe.pipeline.schedule import Trigger, parse_cron, schedule_loop

    cfg = _cfg(tmp_path)
    runs = []
    trig = Trigger(cfg, config_path=None, on_new_data=True, store=(tmp_path / "store").as_uri(), run=lambda: runs.append(1) or {}, log=lambda m: None)
    clock = FakeClock(datetime(2026, 3, 6, 2, 30, tzinfo=timezone.utc))
    done = schedule_loop(trig, parse_cron("0 3 * * *"), max_ticks=2, clock=clock.now, sleep=clock.sleep)
    assert [d[0].hour for d in done] == [3, 3] and [d[0].day for d in done] == [6, 7]
    assert clock.slept == [1800.0, 86400.0]
    assert [d[1] for d in done] == ["ran", "skipped"] and len(runs) == 1  # the data did not change on day two
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "c"}\n')  # new data
    done = schedule_loop(trig, parse_cron("0 3 * * *"), max_ticks=2, clock=clock.now, sleep=clock.sleep)
    assert [d[1] for d in done] == ["ran", "skipped"] and len(runs) == 2


def test_emit_k8s_cronjob(tmp_path, capsys):
    from trainpipe.cli import main

    cfg = _cfg(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    assert main(["pipeline", "schedule", str(path), "--cron", "0 3 * * *", "--on-new-data", "--emit", "k8s-cronjob", "-o", str(tmp_path / "cj.yaml")]) == 0
    docs = list(yaml.safe_load_all((tmp_path / "cj.yaml").read_text()))
    cj = next(d for d in docs if d["kind"] == "CronJob")
    # the ConfigMap the CronJob mounts is in the same file, so `kubectl apply -f` creates both
    mounted = {v["configMap"]["name"] for v in cj["spec"]["jobTemplate"]["spec"]["template"]["spec"].get("volumes", []) if "configMap" in v}
    assert mounted and mounted <= {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    import trainpipe

    assert cj["kind"] == "CronJob" and cj["spec"]["schedule"] == "0 3 * * *" and cj["spec"]["concurrencyPolicy"] == "Forbid"
    c = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == f"trainpipe:{trainpipe.__version__}" and "--on-new-data" in c["command"] and "--once" in c["command"]
    assert main(["pipeline", "schedule", str(path), "--cron", "0 3 * *", "--emit", "k8s-cronjob"]) == 2
