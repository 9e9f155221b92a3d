"""Secrets never reach emitted cluster files, printed submit lines or `track sync`'s wire (issue 22, redaction at every sink).

A config whose URLs carry credentials (a store `s3://KEY:SECRET@bucket/...?session_token=...`, a SQL source
`postgresql://user:PASSWORD@host/db`, a tracking URI `http://user:PASSWORD@host`) goes through every command that
writes something for a cluster: `pipeline compile` (kfp 2.17's real compiler, and kfp's own loader for the package),
`pipeline schedule --emit k8s-cronjob` and `--emit kfp-recurring-run` (to a file and to stdout). No secret may appear
in any file written or any line printed; where the job needs it, the file holds a reference instead (`$(TRAINPIPE_SECRET_...)`,
an environment variable filled from a Kubernetes Secret by `secretKeyRef` / kfp-kubernetes' `secretAsEnv`), and the
output says which Secret to create (`kubectl create secret generic ...` with placeholders). Every file goes through
the ownership rule: `-o` onto the config or a file trainpipe did not write is refused (exit 2, nothing written).

`track sync` of a run whose tracking URI carries a password: a real HTTP server on 127.0.0.1 (started here) records the
Authorization header MLflow's client sends; it must carry the real password (kept in memory from the config as given),
never the `***` that the run directory's redacted config holds, and no file written may hold the password.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"

STORE_SECRET = "STORESECRET123"
STORE_TOKEN = "QTOKEN_ABC987xyz"
SQL_PASSWORD = "PGPASS_S3CRET"
TRACK_PASSWORD = "TRACKPASS999"
SECRETS = (STORE_SECRET, STORE_TOKEN, SQL_PASSWORD, TRACK_PASSWORD)
STORE = f"s3://AKIAEXAMPLE:{STORE_SECRET}@bucket/trainpipe?session_token={STORE_TOKEN}"
SQL = f"postgresql://trainer:{SQL_PASSWORD}@db.example:5432/train?sslmode=require"
SECRET_NAME = "trainpipe-quickstart-secrets"
STORE_PW_ENV = "TRAINPIPE_SECRET_PIPELINE_STORE_PASSWORD"
STORE_TOKEN_ENV = "TRAINPIPE_SECRET_PIPELINE_STORE_SESSION_TOKEN"
SQL_ENV = "TRAINPIPE_SECRET_DATA_SOURCES_1_SQL_URL_PASSWORD"


def _config(tmp: Path) -> Path:
    cfg = yaml.safe_load((QUICKSTART / "run.yaml").read_text())
    cfg["model"]["name_or_path"] = str(QUICKSTART / "base")
    cfg["data"]["sources"] = [
        {"path": str(QUICKSTART / "data" / "train.jsonl"), "format": "alpaca"},
        {"sql": {"url": SQL, "query": "SELECT instruction, input, output FROM examples"}, "format": "alpaca"},
    ]
    cfg["pipeline"] = {"store": STORE}
    cfg["tracking"] = {"backend": "mlflow", "uri": f"http://mlf:{TRACK_PASSWORD}@mlflow.example:5000"}
    cfg["output_dir"] = str(tmp / "qs")
    path = tmp / "qs.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _no_secret(texts: dict[str, str]) -> None:
    leaks = [f"{where}: {s}" for where, text in texts.items() for s in SECRETS if s in text]
    assert not leaks, leaks


def _files(folder: Path) -> dict[str, str]:
    return {str(p): p.read_text(errors="replace") for p in sorted(folder.rglob("*")) if p.is_file()}


def _emitted(tmp: Path, config: Path) -> dict[str, str]:
    """Every file under tmp but the config the user wrote (which holds the secrets, as given)."""
    return {k: v for k, v in _files(tmp).items() if k != str(config)}


def test_compile_writes_references_not_secrets(tmp_path, capfd):
    from trainpipe.pipeline.schedule import load_kfp_package
    from trainpipe.redact import resolve_obj

    config = _config(tmp_path)
    out = tmp_path / "pipeline.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(out)]) == 0
    printed = capfd.readouterr()
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_emitted(tmp_path, config)})
    # kfp's own loader (what kfp.Client sends): the tasks get the Secret's keys as env vars (kfp-kubernetes' secretAsEnv)
    doc = load_kfp_package(out)
    executors = doc["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == {f"exec-{k}" for k in ("prepare", "train", "evaluate", "export", "register", "report")}
    for ex in executors.values():
        (ref,) = ex["secretAsEnv"]
        assert ref["secretName"] == SECRET_NAME
        assert {(k["secretKey"], k["envVar"]) for k in ref["keyToEnv"]} >= {(STORE_PW_ENV, STORE_PW_ENV), (STORE_TOKEN_ENV, STORE_TOKEN_ENV), (SQL_ENV, SQL_ENV)}
    params = doc["pipeline_spec"]["root"]["inputDefinitions"]["parameters"]
    store = params["store"]["defaultValue"]
    assert store == f"s3://AKIAEXAMPLE:$({STORE_PW_ENV})@bucket/trainpipe?session_token=$({STORE_TOKEN_ENV})"
    cfg = json.loads(params["config_yaml"]["defaultValue"])
    assert cfg["data"]["sources"][1]["sql"]["url"] == f"postgresql://trainer:$({SQL_ENV})@db.example:5432/train?sslmode=require"
    # in the pod, the references resolve to the real values (from the Secret's env), in memory
    env = {STORE_PW_ENV: STORE_SECRET, STORE_TOKEN_ENV: STORE_TOKEN, SQL_ENV: SQL_PASSWORD}
    assert resolve_obj(store, env) == STORE
    assert resolve_obj(cfg, {**env, "TRAINPIPE_SECRET_TRACKING_URI_PASSWORD": TRACK_PASSWORD})["data"]["sources"][1]["sql"]["url"] == SQL
    # the console says a reference replaced the secret, and which Secret to create (placeholders, never the value)
    assert f"kubectl create secret generic {SECRET_NAME}" in printed.out and f"--from-literal={SQL_ENV}=" in printed.out


def test_cronjob_reads_secrets_from_a_kubernetes_secret(tmp_path, capfd):
    config = _config(tmp_path)
    out = tmp_path / "cronjob.yaml"
    assert main(["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--on-new-data", "--emit", "k8s-cronjob", "-o", str(out)]) == 0
    printed = capfd.readouterr()
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_emitted(tmp_path, config)})
    docs = list(yaml.safe_load_all(out.read_text()))
    cj = next(d for d in docs if d["kind"] == "CronJob")
    c = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    for name in (STORE_PW_ENV, STORE_TOKEN_ENV, SQL_ENV):
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": SECRET_NAME, "key": name}}
    # Kubernetes expands $(VAR) in a container's command from its env
    assert c["command"][c["command"].index("--store") + 1] == f"s3://AKIAEXAMPLE:$({STORE_PW_ENV})@bucket/trainpipe?session_token=$({STORE_TOKEN_ENV})"
    # the config the pod reads (the ConfigMap the volume mounts) holds the reference, and resolves in the pod
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["name"] == cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    mounted = yaml.safe_load(cm["data"][config.name])
    assert mounted["data"]["sources"][1]["sql"]["url"] == f"postgresql://trainer:$({SQL_ENV})@db.example:5432/train?sslmode=require"
    assert f"kubectl create secret generic {SECRET_NAME}" in printed.out


def test_cronjob_config_resolves_in_the_pod(tmp_path, monkeypatch):
    """What `trainpipe pipeline schedule /config/qs.yaml --once` does in the pod: the mounted config's references are
    resolved from the env the Secret fills, in memory; without the Secret, one paragraph naming the variable."""
    from trainpipe.config import load_config
    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.schedule import resolve_cluster_config

    config = _config(tmp_path)
    out = tmp_path / "cronjob.yaml"
    assert main(["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "k8s-cronjob", "-o", str(out)]) == 0
    cm = next(d for d in yaml.safe_load_all(out.read_text()) if d["kind"] == "ConfigMap")
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / config.name).write_text(cm["data"][config.name])
    cfg = load_config(pod / config.name)
    with pytest.raises(ConfigError, match=SQL_ENV):
        resolve_cluster_config(cfg)
    for k, v in {STORE_PW_ENV: STORE_SECRET, STORE_TOKEN_ENV: STORE_TOKEN, SQL_ENV: SQL_PASSWORD,
                 "TRAINPIPE_SECRET_TRACKING_URI_PASSWORD": TRACK_PASSWORD}.items():
        monkeypatch.setenv(k, v)
    resolved = resolve_cluster_config(cfg)
    assert resolved.data.sources[1].sql.url == SQL and resolved.pipeline.store == STORE
    assert resolved.tracking.uri == f"http://mlf:{TRACK_PASSWORD}@mlflow.example:5000"


@pytest.mark.parametrize("name", ["rr.yaml", "rr.json"])
def test_kfp_recurring_run_files_and_submit_lines_hold_no_secret(tmp_path, capfd, monkeypatch, name):
    from trainpipe.pipeline.schedule import load_kfp_package

    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path)
    assert main(["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "kfp-recurring-run", "-o", name]) == 0
    printed = capfd.readouterr()
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_emitted(tmp_path, config)})
    text = (tmp_path / name).read_text()
    body = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    ref_store = f"s3://AKIAEXAMPLE:$({STORE_PW_ENV})@bucket/trainpipe?session_token=$({STORE_TOKEN_ENV})"
    assert body["runtime_config"]["parameters"]["store"] == ref_store
    assert body["pipeline_spec"] == load_kfp_package(tmp_path / "rr.pipeline.yaml")
    assert body["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]["secretAsEnv"][0]["secretName"] == SECRET_NAME
    assert f"store={ref_store}" in printed.out and f"'store': '{ref_store}'" in printed.out  # the kfp CLI and kfp.Client lines
    assert f"kubectl create secret generic {SECRET_NAME}" in printed.out


def test_kfp_recurring_run_to_stdout_holds_no_secret(tmp_path, capfd):
    config = _config(tmp_path)
    assert main(["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "kfp-recurring-run"]) == 0
    printed = capfd.readouterr()
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_emitted(tmp_path, config)})
    assert f"$({STORE_PW_ENV})" in printed.out and f"kubectl create secret generic {SECRET_NAME}" in printed.out


def _commands(config: Path, out: Path) -> dict[str, list[str]]:
    return {
        "compile": ["pipeline", "compile", str(config), "-o", str(out)],
        "k8s-cronjob": ["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "k8s-cronjob", "-o", str(out)],
        "kfp-recurring-run": ["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "kfp-recurring-run", "-o", str(out)],
    }


@pytest.mark.parametrize("command", ["compile", "k8s-cronjob", "kfp-recurring-run"])
def test_output_onto_the_config_or_a_user_file_is_refused(tmp_path, capfd, command):
    config = _config(tmp_path)
    user = tmp_path / "notes.yaml"
    user.write_text("mine: true\n")
    before = {p: p.read_bytes() for p in (config, user)}
    for target in (config, user):
        assert main(_commands(config, target)[command]) == 2
        err = capfd.readouterr()
        assert "Refusing to write" in err.out + err.err and "Traceback" not in err.out + err.err
        _no_secret({"stdout": err.out, "stderr": err.err})
        assert {p: p.read_bytes() for p in (config, user)} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.yaml", "qs.yaml"]  # nothing written, not the package either


def test_recurring_run_refuses_a_user_file_where_the_package_goes(tmp_path, capfd):
    config = _config(tmp_path)
    (tmp_path / "rr.pipeline.yaml").write_text("mine: true\n")
    assert main(_commands(config, tmp_path / "rr.yaml")["kfp-recurring-run"]) == 2
    assert not (tmp_path / "rr.yaml").exists() and (tmp_path / "rr.pipeline.yaml").read_text() == "mine: true\n"


@pytest.mark.parametrize("command", ["compile", "k8s-cronjob", "kfp-recurring-run"])
def test_reemit_to_the_same_path_works(tmp_path, capfd, command):
    config = _config(tmp_path)
    out = tmp_path / "out" / "emitted.yaml"
    assert main(_commands(config, out)[command]) == 0
    first = out.read_text()
    assert main(_commands(config, out)[command]) == 0  # trainpipe's own unchanged file: replaced
    assert out.read_text() == first
    out.write_text(first + "# edited\n")  # changed by the user since: no longer provably trainpipe's
    assert main(_commands(config, out)[command]) == 2
    assert out.read_text().endswith("# edited\n")


# --------------------------------------------------------------------------- track sync


class _Recorder(BaseHTTPRequestHandler):
    """A real HTTP server's handler: records each request's Authorization header and answers 401."""

    seen: list[tuple[str, str | None]] = []

    def _any(self):
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"error_code": "UNAUTHENTICATED", "message": "recorded"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _run_dir(tmp: Path, uri: str) -> tuple[Path, Path]:
    """A run directory as `trainpipe run` leaves it (config.resolved.yaml and manifest.json written by trainpipe's own
    writers, redacted), for the config file `tmp/track.yaml` whose tracking URI is `uri`."""
    from trainpipe.config import dump_yaml, load_config
    from trainpipe.track.manifest import build_manifest, write_json

    config = tmp / "track.yaml"
    config.write_text(yaml.safe_dump({"name": "tracked", "model": {"name_or_path": str(QUICKSTART / "base")},
                                      "data": {"sources": [{"path": str(QUICKSTART / "data" / "train.jsonl"), "format": "alpaca"}]},
                                      "tracking": {"backend": "mlflow", "uri": uri}, "output_dir": str(tmp / "run")}))
    cfg = load_config(config)
    run_dir = tmp / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.yaml").write_text(dump_yaml(cfg))
    write_json(run_dir / "manifest.json", build_manifest(config_hash=cfg.hash(), config_path=str(config.resolve()), data_files=[], seed=0,
                                                         hardware={}, decisions=[]))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.5, "time": 1.0}\n')
    assert TRACK_PASSWORD not in (run_dir / "config.resolved.yaml").read_text()  # the run directory holds the mask only
    return config, run_dir


def _auths(seen) -> set[str]:
    out = set()
    for _path, auth in seen:
        assert auth and auth.startswith("Basic "), seen
        out.add(base64.b64decode(auth[6:]).decode())
    return out


def test_track_sync_sends_the_real_password_not_the_mask(tmp_path, capfd, recorder, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = recorder.server_address[1]
    _config_path, run_dir = _run_dir(tmp_path, f"http://mlf:{TRACK_PASSWORD}@127.0.0.1:{port}")
    assert main(["track", "sync", str(run_dir)]) == 2  # the recorder answers 401: one paragraph, exit 2
    printed = capfd.readouterr()
    assert _Recorder.seen, "the tracker was not contacted"
    assert _auths(_Recorder.seen) == {f"mlf:{TRACK_PASSWORD}"}  # the credential of the config as given, never `***`
    assert all(TRACK_PASSWORD not in path and "***" not in path for path, _ in _Recorder.seen)
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_files(run_dir)})


def test_track_sync_uses_the_environment_or_says_what_is_missing(tmp_path, capfd, recorder, monkeypatch):
    """The config file moved away: the password comes from `$MLFLOW_TRACKING_URI` as given; without it, a paragraph
    that names the missing credential and sends nothing (never `***`)."""
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = recorder.server_address[1]
    config, run_dir = _run_dir(tmp_path, f"http://mlf:{TRACK_PASSWORD}@127.0.0.1:{port}")
    config.unlink()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["track", "sync", str(run_dir)]) == 2
    printed = capfd.readouterr()
    assert not _Recorder.seen  # nothing sent with a masked password
    assert "MLFLOW_TRACKING_PASSWORD" in printed.out + printed.err and "Traceback" not in printed.out + printed.err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://mlf:{TRACK_PASSWORD}@127.0.0.1:{port}")
    assert main(["track", "sync", str(run_dir)]) == 2
    printed = capfd.readouterr()
    assert _auths(_Recorder.seen) == {f"mlf:{TRACK_PASSWORD}"}
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_files(run_dir)})
    # in a cluster job (a CronJob pod, a Kubeflow task): the Kubernetes Secret's env var that the emitted files reference
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("TRAINPIPE_SECRET_TRACKING_URI_PASSWORD", TRACK_PASSWORD)
    _Recorder.seen.clear()
    assert main(["track", "sync", str(run_dir)]) == 2
    printed = capfd.readouterr()
    assert _auths(_Recorder.seen) == {f"mlf:{TRACK_PASSWORD}"}
    _no_secret({"stdout": printed.out, "stderr": printed.err, **_files(run_dir)})
