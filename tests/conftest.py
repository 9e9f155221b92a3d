import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Offline, deterministic, isolated from the user's home and caches.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["NO_COLOR"] = "1"
os.environ["COLUMNS"] = "120"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Experiment tracking (MLflow by default) is off unless a test turns it on: tests/e2e/test_tracking*.py set `tracking.backend`
# explicitly (an MLflow store per run would cost every e2e test seconds of MLflow import and database setup).
os.environ.setdefault("TRAINPIPE_TRACKING", "none")

REPO = Path(__file__).resolve().parent.parent


_PROCESS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _process_state_restored():
    """A test that changes the process's torch thread count or its distributed variables (an in-process
    `main(["--local_rank=0", ...])` sets LOCAL_RANK, as DeepSpeed's launcher expects) must not change the tests after it:
    both are put back after every test."""
    import torch

    threads, env = torch.get_num_threads(), {k: os.environ.get(k) for k in _PROCESS_ENV}
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


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

    import socket

    with socket.socket() as sock:  # a free port number (the server listens on a Unix socket in `root` only)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sh(f"{bindir}/initdb -D {root}/data -A trust -U postgres")
    sh(f"{bindir}/pg_ctl -D {root}/data -o \"-k {root} -c listen_addresses='' -p {port}\" -l {root}/log -w start")
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={root}&port={port}"
    finally:
        sh(f"{bindir}/pg_ctl -D {root}/data -m fast -w stop")
        shutil.rmtree(root, ignore_errors=True)
