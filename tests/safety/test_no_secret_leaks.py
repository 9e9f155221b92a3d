"""No credential reaches a file or the console (issue 16, item 8).

Runs the real CLI on a tiny model whose data comes from a SQL source whose URL carries secrets
(`token=`/`password=` query values; a `user:password@` URL in a second run that fails to connect), with
API tokens in the environment and one of them also in the run's inputs, then `export`, `diagnose`,
`config show`, `plan --json`, `prepare --json` and a resume. Every byte of every file under the run
directories, the data cache and the isolated home (safetensors, Arrow, JSON, YAML, Markdown), and
everything printed, must be free of each secret.
"""

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

QUERY_TOKEN = "TOKENSECRET1234"
QUERY_PASSWORD = "PWSECRET4567"
URL_PASSWORD = "S3cr3tPassw0rd"
HF_TOKEN = "hf_SECRETVALUE123456"
API_KEY = "sk-SECRET-abcdef123"
SECRETS = (QUERY_TOKEN, QUERY_PASSWORD, URL_PASSWORD, HF_TOKEN, API_KEY)


def _sqlite_db(path: Path, n: int) -> Path:
    con = sqlite3.connect(path)
    con.execute("create table examples (id integer primary key, instruction text, input text, output text)")
    con.executemany("insert into examples (instruction, input, output) values (?, ?, ?)", [(r["instruction"], r["input"], r["output"]) for r in alpaca_records(n, seed=3)])
    con.commit()
    con.close()
    return path


def _config(tmp: Path, model_dir: Path, url: str, name: str, query: str) -> Path:
    cfg = {
        "name": name,
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"sql": {"url": url, "query": query}}], "eval_split": 8, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 4, "eval_steps": 2, "save_steps": 2, "logging_steps": 2, "per_device_train_batch_size": 4,
                     "gradient_accumulation_steps": 1, "learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / name),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _leaks(roots: list[Path], skip: set[Path]) -> list[str]:
    """`path: secret` for every file under ``roots`` (but ``skip``) whose bytes hold a secret."""
    found, n = [], 0
    for root in roots:
        for p in sorted(root.rglob("*")):
            if not p.is_file() or p in skip:
                continue
            n += 1
            blob = p.read_bytes()
            found += [f"{p}: {s}" for s in SECRETS if s.encode() in blob]
    assert n > 0, f"no file under {roots}"
    return found


def test_no_secret_in_any_artefact_or_output(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("MY_API_KEY", API_KEY)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRAINPIPE_CACHE", str(cache))
    model_dir = build_tiny_model(tmp_path / "base")
    db = _sqlite_db(tmp_path / "train.db", 48)
    # the pysqlite driver ignores these query values; `client=` is not a secret-looking name, only the environment says it is one
    url = f"sqlite:///{db}?token={QUERY_TOKEN}&password={QUERY_PASSWORD}&client={HF_TOKEN}"
    query = f"SELECT instruction, input, output FROM examples /* owner key {API_KEY} */ ORDER BY id"
    ok_cfg = _config(tmp_path, model_dir, url, "ok", query)
    run_dir = tmp_path / "ok"

    assert main(["run", str(ok_cfg)]) == 0
    printed = capfd.readouterr()
    # the run did read the SQL source, and says where from without the secrets
    report = json.loads((run_dir / "data_report.json").read_text())
    labels = [s["source"] for s in report["sources"]]
    assert labels == [f"sql:sqlite:///{db}?token=***&password=***&client=***"], labels
    assert report["records_read"] == 48
    assert (run_dir / "model" / "model.safetensors").is_file() and (run_dir / "model" / "README.md").is_file()
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["data"]["sources"][0]["sql"]["url"] == f"sqlite:///{db}?token=***&password=***&client=***"

    # resume compares the checkpoint's (redacted) config with the current one: a redacted URL is not a change
    (run_dir / "summary.json").unlink()
    assert main(["run", str(ok_cfg), "--resume", "--set", "training.max_steps=6"]) == 0
    out = capfd.readouterr()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "checkpoint_resumed" for e in events), [e["event"] for e in events]
    assert json.loads((run_dir / "summary.json").read_text())["train"]["global_step"] == 6
    printed_all = [printed.out, printed.err, out.out, out.err]

    for argv in (["export", str(run_dir), "--out", str(tmp_path / "exported")], ["diagnose", str(run_dir)], ["config", "show", str(ok_cfg)],
                 ["plan", str(ok_cfg), "--json"], ["data", "prepare", str(ok_cfg), "--json"]):
        assert main(argv) == 0, argv
        out = capfd.readouterr()
        printed_all += [out.out, out.err]
    assert (tmp_path / "exported" / "README.md").is_file()

    # a password in the URL's userinfo: the connection fails (no PostgreSQL here), and the failure names the URL
    bad_url = f"postgresql://reader:{URL_PASSWORD}@127.0.0.1:9/warehouse?sslmode=disable"
    bad_cfg = _config(tmp_path, model_dir, bad_url, "bad", "SELECT instruction, input, output FROM examples")
    assert main(["run", str(bad_cfg)]) == 2
    out = capfd.readouterr()
    printed_all += [out.out, out.err]
    assert "postgresql://reader:***@127.0.0.1:9/warehouse" in out.out + out.err
    failed = [json.loads(x) for x in (tmp_path / "bad" / "events.jsonl").read_text().splitlines()]
    assert failed[-1]["event"] == "run_failed" and "reader:***@" in failed[-1]["message"]
    for argv in (["diagnose", str(tmp_path / "bad")], ["config", "show", str(bad_cfg)]):
        main(argv)
        out = capfd.readouterr()
        printed_all += [out.out, out.err]

    home = Path.home()  # the isolated home of tests/conftest.py (HF_HOME, XDG_CACHE_HOME)
    skip = {ok_cfg, bad_cfg, db}  # the user's own inputs
    roots = [run_dir, tmp_path / "exported", tmp_path / "bad", cache, home]
    assert [p for p in roots if p.is_dir()] == roots
    assert _leaks(roots, skip) == []
    for text in printed_all:
        assert not [s for s in SECRETS if s in text], text[-2000:]
    # the secrets were really in what trainpipe was given: the test would see a leak
    assert QUERY_TOKEN in ok_cfg.read_text() and API_KEY in ok_cfg.read_text() and URL_PASSWORD in bad_cfg.read_text()


def test_password_of_a_postgresql_source_that_trains_is_in_no_artefact(tmp_path, postgres_url, monkeypatch, capfd):
    """A real PostgreSQL source whose URL carries `user:password@` (the throwaway server trusts local connections, so the
    password is sent and ignored): the run trains and exports, and the password is in no file and nothing printed."""
    import sqlalchemy as sa

    setup = sa.create_engine(postgres_url)
    with setup.begin() as conn:
        conn.exec_driver_sql("create table examples (id serial primary key, instruction text, input text, output text)")
        for r in alpaca_records(48, seed=3):
            conn.execute(sa.text("insert into examples (instruction, input, output) values (:i, :x, :o)"), {"i": r["instruction"], "x": r["input"], "o": r["output"]})
    setup.dispose()
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRAINPIPE_CACHE", str(cache))
    url = postgres_url.replace("postgres@/", f"postgres:{URL_PASSWORD}@/", 1)
    assert URL_PASSWORD in url
    model_dir = build_tiny_model(tmp_path / "base")
    cfg = _config(tmp_path, model_dir, url, "pg", "SELECT instruction, input, output FROM examples ORDER BY id")
    assert main(["run", str(cfg)]) == 0
    run_dir = tmp_path / "pg"
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["records_read"] == 48
    assert report["sources"][0]["source"].startswith("sql:postgresql+psycopg://postgres:***@/postgres")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "exported")]) == 0
    printed = capfd.readouterr()
    assert _leaks([run_dir, tmp_path / "exported", cache], {cfg}) == []
    assert URL_PASSWORD not in printed.out + printed.err
