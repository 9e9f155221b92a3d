"""Shared pieces of the safety tests (issue 16): a tiny project on disk and byte-for-byte snapshots of folders."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, chat_records, write_jsonl

# a run of a few steps: enough to write checkpoints, cheap on a shared CPU
TINY = {
    "training.max_steps": 4, "training.eval_steps": 2, "training.save_steps": 2, "training.logging_steps": 1,
    "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 1, "eval.metrics": ["loss"],
}


def project(tmp: Path, model_dir: Path, **overrides) -> Path:
    """tmp/run.yaml + tmp/data/{alpaca,chat}.jsonl (as tests/e2e/test_sft.py), output tmp/run unless overridden (dotted
    keys); returns the config path."""
    write_jsonl(tmp / "data" / "alpaca.jsonl", alpaca_records(120, seed=5))
    write_jsonl(tmp / "data" / "chat.jsonl", chat_records(60, seed=6))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "data/alpaca.jsonl"}, {"path": "data/chat.jsonl", "format": "chat"}], "eval_split": 16, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "training": {"learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {},
        "output_dir": str(tmp / "run"),
    }
    for k, v in {**TINY, **overrides}.items():
        node = cfg
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def cli(args: list[str], **kw) -> subprocess.Popen:
    """`python -m trainpipe.cli ARGS` as a child process (the real entry, real signals)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    env.pop("TRAINPIPE_TEST_FAULTS", None)
    return subprocess.Popen([sys.executable, "-m", "trainpipe.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="session")
def base(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture()
def postgres_url():
    """A throwaway PostgreSQL server on a Unix socket (skipped where there is no server binary or driver)."""
    import glob
    import os
    import shutil
    import subprocess
    import tempfile

    pytest.importorskip("psycopg")
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not bins:
        pytest.skip("no PostgreSQL server installed (apt-get install postgresql)")
    bindir = os.path.dirname(bins[-1])
    root = tempfile.mkdtemp(prefix="trainpipe-pg-")
    as_root = os.geteuid() == 0  # initdb refuses root: run the server as the `postgres` user
    if as_root:
        shutil.chown(root, "postgres")

    def sh(cmd: str) -> None:
        argv = ["su", "postgres", "-s", "/bin/sh", "-c", cmd] if as_root else ["/bin/sh", "-c", cmd]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)

    port = 20000 + os.getpid() % 20000
    sh(f"{bindir}/initdb -D {root}/data -A trust -U postgres")
    sh(f"{bindir}/pg_ctl -D {root}/data -o \"-k {root} -c listen_addresses='' -p {port}\" -l {root}/log -w start")
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={root}&port={port}"
    finally:
        sh(f"{bindir}/pg_ctl -D {root}/data -m fast -w stop")
        shutil.rmtree(root, ignore_errors=True)
