"""A password with `/`, `#`, `?`, blanks and quotes (issue 36) is in no file and nothing printed, end to end.

A real run on a tiny model reads its data from a real PostgreSQL server through a URL whose password holds
`/ # ? " ' \\` `` and a space (SQLAlchemy reads such a password raw: it runs to its `@`; the throwaway server trusts
local connections, so the password is sent and ignored). Then `config show`, `launch --emit k8s` and `--emit skypilot`,
`pipeline compile` and `pipeline schedule --emit k8s-cronjob` on the same config. Every byte of every file written (the
run folder with its model card, report, events, manifests and resolved configs, the data cache, the isolated home,
every emitted file) and everything printed must be free of the password, raw or percent-decoded; the cluster files hold
a reference instead, and the "create this Secret" note names it.
"""

import json
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

PASSWORD = 'Kq7/x#Zr?p w"d\'e`Bn9+/=='  # base64-like, with the characters that used to end the URL early
ENCODED = PASSWORD  # SQLAlchemy needs only `%` and `@` encoded: none here
SQL_ENV = "TRAINPIPE_SECRET_DATA_SOURCES_0_SQL_URL_PASSWORD"


def _files(roots: list[Path], skip: set[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for r in roots for p in sorted(r.rglob("*")) if p.is_file() and p not in skip}


def _leaks(blobs: dict[str, bytes | str]) -> list[str]:
    forms = {PASSWORD, unquote(PASSWORD), "w\"d'e`Bn9", "Kq7/x#Zr?p"}  # the whole, and its halves around the blank
    out = []
    for where, blob in blobs.items():
        data = blob if isinstance(blob, bytes) else blob.encode()
        out += [f"{where}: {f!r}" for f in forms if f.encode() in data]
    return out


def test_password_with_url_delimiters_reaches_no_file_or_console(tmp_path, postgres_url, monkeypatch, capfd):
    import sqlalchemy as sa

    setup = sa.create_engine(postgres_url)
    with setup.begin() as conn:
        conn.exec_driver_sql("create table examples (id serial primary key, instruction text, input text, output text)")
        for r in alpaca_records(40, seed=4):
            conn.execute(sa.text("insert into examples (instruction, input, output) values (:i, :x, :o)"), {"i": r["instruction"], "x": r["input"], "o": r["output"]})
    setup.dispose()
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRAINPIPE_CACHE", str(cache))
    url = postgres_url.replace("postgres@/", f"postgres:{ENCODED}@/", 1)
    assert sa.engine.make_url(url).password == PASSWORD  # the library reads the whole password
    model_dir = build_tiny_model(tmp_path / "base")
    cfg = {
        "name": "nasty",
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"sql": {"url": url, "query": "SELECT instruction, input, output FROM examples ORDER BY id"}}], "eval_split": 8, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 2, "eval_steps": 2, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 4,
                     "gradient_accumulation_steps": 1, "learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp_path / "run"),
    }
    config = tmp_path / "nasty.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(config)]) == 0
    printed = {"run": capfd.readouterr()}
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["records_read"] == 40
    assert report["sources"][0]["source"].startswith("sql:postgresql+psycopg://postgres:***@/postgres?host=")
    assert (run_dir / "model" / "README.md").is_file() and (run_dir / "config.resolved.yaml").is_file()

    emitted = tmp_path / "emitted"
    for name, argv in {
        "config show": ["config", "show", str(config)],
        "k8s": ["launch", str(config), "--emit", "k8s", "-o", str(emitted / "k8s")],
        "skypilot": ["launch", str(config), "--emit", "skypilot", "-o", str(emitted / "sky")],
        "compile": ["pipeline", "compile", str(config), "-o", str(emitted / "pipeline.yaml")],
        "cronjob": ["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "k8s-cronjob", "-o", str(emitted / "cron.yaml")],
    }.items():
        assert main(argv) == 0, name
        printed[name] = capfd.readouterr()
    # the cluster files carry a reference, and each command's note names the Secret key to create
    for name in ("k8s", "skypilot", "compile", "cronjob"):
        assert SQL_ENV in printed[name].out + printed[name].err, name
    trainjob = (emitted / "k8s" / "trainjob.yaml").read_text()
    assert f"$({SQL_ENV})" in trainjob and SQL_ENV in (emitted / "cron.yaml").read_text()

    home = Path.home()
    blobs = _files([run_dir, cache, home, emitted], {config})
    assert any(k.endswith("events.jsonl") for k in blobs) and any(k.endswith("manifest.json") for k in blobs)
    for name, out in printed.items():
        blobs[f"console of {name}"] = out.out + out.err
    assert _leaks(blobs) == []
    assert _leaks({"config": config.read_bytes()}) != []  # the test would see a leak: the password was given
