"""`trainpipe tune` on a full disk: exit 74 with one paragraph, no library traceback (issue 36).

The study folder is a real 300 KB tmpfs (root and mount(8), as in CI; skipped elsewhere): the study's SQLite storage,
MLflow's store and the first trial's files run out of space. Before, optuna's storage error ended in six library
tracebacks and exit 0 with no best trial.
"""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tiny import alpaca_records, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k,mode=0755", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


def test_tune_on_a_full_disk_exits_74_with_one_paragraph(tmp_path, base, small_disk):
    write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_records(160, seed=11))
    cfg = {"model": {"name_or_path": str(base)}, "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 16, "max_length": 64},
           "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
           "training": {"eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8, "early_stopping_patience": None},
           "eval": {"metrics": ["loss"]}, "output_dir": str(small_disk / "study"),
           "tune": {"space": {"training.learning_rate": {"choice": [1e-3, 5e-3]}}, "objective": {"metric": "loss"}, "n_trials": 2,
                    "sampler": "grid", "pruner": "none", "fidelity": {"steps": 4}}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TRAINPIPE_CACHE": str(tmp_path / "cache")}
    env.pop("TRAINPIPE_TEST_FAULTS", None)
    p = subprocess.run([sys.executable, "-m", "trainpipe.cli", "tune", str(tmp_path / "tune.yaml")], capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 74, out[-3000:]
    assert "Traceback" not in out and "No space left on device" in out and out.count("write failed:") == 1, out[-3000:]
