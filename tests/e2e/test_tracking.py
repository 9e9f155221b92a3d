"""Experiment tracking through the real libraries: MLflow's local store (the default) and a real `mlflow server` started
here on a free localhost port, W&B in offline mode and TensorBoard, each read back with its own reader.

Every metric line of metrics.jsonl must be in the tracker, the model registered with its lineage, and no secret from
the environment anywhere in what was logged. An unreachable server does not lose the run: `tracking_unavailable`,
then `trainpipe track sync RUN_DIR` once the server is up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

SECRETS = {"HF_TOKEN": "hf_tracktestSECRETvalue0123456789", "AWS_SECRET_ACCESS_KEY": "awsSECRETtrack/0123456789abcdefXYZ",
           "WANDB_API_KEY_UNUSED": "wandbSECRETkey0123456789"}


def _config(tmp: Path, model_dir: Path, out: str, tracking: dict) -> Path:
    write_jsonl(tmp / "train.jsonl", alpaca_records(48, seed=5))
    cfg = {
        "name": "tracked",
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 12, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 6, "eval_steps": 3, "logging_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "tracking": tracking,
        "output_dir": str(tmp / out),
    }
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _expected(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) of every metric in metrics.jsonl."""
    out: dict[str, list] = {}
    for rec in _metrics(run_dir):
        for k, v in rec.items():
            if k not in ("time", "step") and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, []).append((int(rec["step"]), float(v)))
    return out


def _assert_mlflow_has_everything(uri: str, run_dir: Path) -> "object":
    from mlflow import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run = client.get_run(state["run_id"])
    expected = _expected(run_dir)
    assert {"loss", "eval_loss", "learning_rate"} <= set(expected)
    for key, points in expected.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert got == sorted(points), key  # each point once: no line lost, none logged twice
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert float(params["training.learning_rate"]) == 5e-3 and params["method.peft"] == "lora"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "event.run_finished" in run.data.tags
    assert run.data.tags["event.eval_done.count"] == str(sum(e["event"] == "eval_done" for e in events))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["final.loss"] == pytest.approx(summary["final"]["loss"]) and summary["final"]["loss"] < summary["baseline"]["loss"]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.resolved.yaml", "data_report.json", "plan.json", "manifest.json", "summary.json", "model"} <= names
    assert "model.safetensors" in {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    # registered with its lineage: data hash, config hash, code version
    reg = state["registered"]
    mv = client.get_model_version(reg["name"], reg["version"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert mv.run_id == run.info.run_id
    assert mv.tags["trainpipe.config_hash"] == manifest["config_hash"]
    assert mv.tags["trainpipe.data.0.sha256"] == manifest["data_files"][0]["sha256"]
    assert mv.tags["trainpipe.version"] == manifest["trainpipe_version"]
    return client, run


def _no_secret_under(*roots: Path) -> None:
    for root in roots:
        for p in [root] if root.is_file() else root.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                for name, value in SECRETS.items():
                    assert value.encode() not in data, f"{name} leaked into {p}"


@pytest.fixture
def secret_env(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)


def test_mlflow_local_store_by_default(tmp_path, tiny_model_dir, secret_env, monkeypatch):
    """No `tracking` in the config and no TRAINPIPE_TRACKING: MLflow, in a SQLite store beside the run."""
    monkeypatch.delenv("TRAINPIPE_TRACKING", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _config(tmp_path, tiny_model_dir, "run", {})
    data = yaml.safe_load(cfg.read_text())
    del data["tracking"]
    cfg.write_text(yaml.safe_dump(data))
    assert main(["run", str(cfg)]) == 0
    run_dir = tmp_path / "run"
    assert (tmp_path / "mlflow.db").is_file()
    client, run = _assert_mlflow_has_everything(f"sqlite:///{tmp_path / 'mlflow.db'}", run_dir)
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path / "mlartifacts")
    _no_secret_under(tmp_path / "mlflow.db", tmp_path / "mlartifacts", run_dir)
    # a second sync changes nothing (idempotent: every point still once)
    assert main(["track", "sync", str(run_dir)]) == 0
    _assert_mlflow_has_everything(f"sqlite:///{tmp_path / 'mlflow.db'}", run_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(tmp: Path, port: int) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}", "--artifacts-destination", str(tmp / "server-artifacts")],
        stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("mlflow server exited:\n" + (tmp / "server.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("mlflow server did not answer in 120 s:\n" + (tmp / "server.log").read_text()[-3000:])


def _stop(proc: subprocess.Popen) -> None:
    """The server and its workers (their own process group, started by this test)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    except ProcessLookupError:
        pass


def test_mlflow_server_unreachable_then_synced_then_live(tmp_path, tiny_model_dir, secret_env):
    """A run against a server that is not up finishes with `tracking_unavailable` and everything in the run dir; once a
    real `mlflow server` listens there, `trainpipe track sync` logs all of it; a run while it is up logs live."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    cfg = _config(tmp_path, tiny_model_dir, "offline-run", {"backend": "mlflow", "uri": uri, "experiment": "server-exp"})
    assert main(["run", str(cfg)]) == 0  # the run is not lost
    run_dir = tmp_path / "offline-run"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    warn = [e for e in events if e["event"] == "tracking_unavailable"]
    assert len(warn) == 1 and warn[0]["level"] == "warning" and "track sync" in warn[0]["fix"]
    assert (run_dir / "model").is_dir() and len(_metrics(run_dir)) >= 4  # 3 training lines, 2 evals
    assert json.loads((run_dir / "tracking.json").read_text())["pending"] is True
    assert main(["track", "sync", str(run_dir)]) == 2  # still down: one paragraph, exit 2, nothing lost

    server = _start_server(tmp_path, port)
    try:
        assert main(["track", "sync", str(run_dir)]) == 0
        _assert_mlflow_has_everything(uri, run_dir)
        assert json.loads((run_dir / "tracking.json").read_text())["pending"] is False

        cfg2 = _config(tmp_path, tiny_model_dir, "live-run", {"backend": "mlflow", "uri": uri, "experiment": "server-exp"})
        assert main(["run", str(cfg2)]) == 0
        live = tmp_path / "live-run"
        assert not any(json.loads(line)["event"] == "tracking_unavailable" for line in (live / "events.jsonl").read_text().splitlines())
        client, run = _assert_mlflow_has_everything(uri, live)
        assert json.loads((live / "tracking.json").read_text())["registered"]["version"] == "2"  # the second version of `tracked`
    finally:
        _stop(server)
    _no_secret_under(tmp_path / "server.db", tmp_path / "server-artifacts", tmp_path / "server.log", run_dir)


def test_tensorboard_offline(tmp_path, tiny_model_dir, secret_env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _config(tmp_path, tiny_model_dir, "tb-run", {"backend": "tensorboard"})
    assert main(["run", str(cfg)]) == 0
    run_dir = tmp_path / "tb-run"
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for key, points in _expected(run_dir).items():
        got = sorted((e.step, e.value) for e in acc.Scalars(key))
        assert [s for s, _ in got] == sorted(s for s, _ in points), key
        assert [v for _, v in got] == pytest.approx([v for _, v in sorted(points)], rel=1e-6), key
    assert "final.loss" in acc.Tags()["scalars"]
    _no_secret_under(run_dir)


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a `.wandb` file: W&B's LevelDB-style log (a 7-byte `:W&B` header, then 32 KiB blocks of
    [crc32, length, type] chunks; type 1 a whole record, 2/3/4 its first/middle/last parts)."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return out


def _wandb_history(run_dir: Path) -> tuple[dict, dict]:
    """(history rows by step, config) read back from the offline run's own `.wandb` record log."""
    from wandb.proto import wandb_internal_pb2

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    rows: dict[int, dict] = {}
    config: dict = {}
    for data in _wandb_records(files[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            rows.setdefault(int(items.get("_step", rec.history.step.num)), {}).update(items)
        elif kind == "config":
            for i in rec.config.update:
                config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return rows, config


def test_wandb_offline(tmp_path, tiny_model_dir, secret_env):
    cfg = _config(tmp_path, tiny_model_dir, "wb-run", {"backend": "wandb", "mode": "offline", "experiment": "trainpipe-test"})
    assert main(["run", str(cfg)]) == 0
    run_dir = tmp_path / "wb-run"
    rows, config = _wandb_history(run_dir)
    for key, points in _expected(run_dir).items():
        for step, value in points:
            assert rows[step][key] == pytest.approx(value, rel=1e-6), (key, step)
    assert config["training.learning_rate"] == 5e-3
    _no_secret_under(run_dir)
