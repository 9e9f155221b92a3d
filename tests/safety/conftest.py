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


# `postgres_url` (a throwaway PostgreSQL server) lives in tests/conftest.py: the tune tests share it
