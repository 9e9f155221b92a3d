"""Your own module (issue 30): `model.factory` + `data.factory` (+ a named loss) trained in trainpipe's loop with its
guarantees: 2 gloo processes equal one process; SIGKILL at random moments then resume is bit-identical to the
uninterrupted run; `config validate`, `plan`, `launch` and `pipeline compile` never import the user's code (a marker file
the module writes on import stays absent); a factory that raises, returns no module, or returns outputs the loss cannot
take is one paragraph naming `model.factory` and the fix (exit 2)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from test_distributed import events, finish, launch, max_diff, newest_weights, wait_for
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

NET = '''
import os, pathlib
if os.environ.get("TRAINPIPE_TEST_IMPORT_MARK"):
    pathlib.Path(os.environ["TRAINPIPE_TEST_IMPORT_MARK"]).write_text("imported")
import torch
from torch import nn

def build(hidden=16, classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, classes))

def raises(**kw):
    raise RuntimeError("no GPU here")

def not_a_module(**kw):
    return {"weights": 1}

def wrong_width(**kw):
    return nn.Linear(4, 7)

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))

class Blocks(nn.Module):
    _no_split_modules = ["Block"]  # what FSDP shards one by one (transformers' convention)

    def __init__(self, hidden, classes):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(4, hidden), nn.ModuleList(Block(hidden) for _ in range(2)), nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)

def blocks(hidden=16, classes=3):
    torch.manual_seed(0)
    return Blocks(hidden, classes)
'''

DATA = '''
import torch
from torch.utils.data import TensorDataset

def build():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(240, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:])
'''


def write(tmp: Path, name: str = "run", **over) -> Path:
    (tmp / "net.py").write_text(NET)
    (tmp / "data.py").write_text(DATA)
    cfg = {
        "name": name, "model": {"factory": "net.py:build", "args": {"hidden": 16, "classes": 3}},
        "method": {"loss": "cross_entropy"}, "data": {"factory": "data.py:build"},
        "training": {"max_steps": 12, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 0.01,
                     "eval_steps": 4, "save_steps": 2, "logging_steps": 2, "early_stopping_patience": None},
        "tracking": {"backend": "none"}, "output_dir": str(tmp / name),
    }
    for k, v in over.items():
        section, _, key = k.partition(".")
        cfg[section][key] = v
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_custom_module_trains_and_two_processes_equal_one(tmp_path):
    one = write(tmp_path, "one")
    assert main(["run", str(one)]) == 0
    s = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert s["family"] == "custom" and s["final"]["accuracy"] > s["trivial"]["majority_accuracy"] + 0.15, (s["final"], s["trivial"])
    two = write(tmp_path, "two", **{"training.per_device_train_batch_size": 4})  # 2 processes x 4 x 2 = 1 process x 8 x 2
    rc, out = finish(launch(two), timeout=400)
    assert rc == 0, out[-3000:]
    diff = max_diff(newest_weights(tmp_path / "one"), newest_weights(tmp_path / "two"))
    assert diff < 1e-6, diff
    started = next(e for e in events(tmp_path / "two") if e["event"] == "training_started")
    assert started["world_size"] == 2 and started["effective_batch"] == 16


def test_custom_module_sigkill_then_resume_is_bit_identical(tmp_path):
    import torch

    ref = write(tmp_path, "ref")
    assert main(["run", str(ref)]) == 0
    cfg = write(tmp_path, "killed", **{"training.resume": "auto"})
    run = tmp_path / "killed"
    rng, kills = random.Random(4), 0
    while kills < 3:
        started = sum(e["event"] == "training_started" for e in events(run))
        p = launch(cfg, nproc=None, faults={"step_seconds": 0.3})
        wait_for(lambda: sum(e["event"] == "training_started" for e in events(run)) > started, p)
        time.sleep(rng.uniform(0.2, 1.2))
        if p.poll() is not None:
            break
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        kills += 1
    rc, out = finish(launch(cfg, nproc=None))
    assert rc == 0, out[-3000:]
    assert kills == 3 and any(e["event"] == "checkpoint_resumed" for e in events(run))
    a, b = newest_weights(run), newest_weights(tmp_path / "ref")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed run differs from the uninterrupted one"


def test_user_code_is_not_imported_by_validate_plan_launch_or_compile(tmp_path, monkeypatch, capsys):
    mark = tmp_path / "imported.txt"
    monkeypatch.setenv("TRAINPIPE_TEST_IMPORT_MARK", str(mark))
    cfg = write(tmp_path)
    assert main(["config", "validate", str(cfg)]) == 0
    assert main(["plan", str(cfg)]) == 0
    assert main(["launch", str(cfg), "--emit", "torchrun", "-o", str(tmp_path / "launch")]) == 0
    if __import__("importlib.util").util.find_spec("kfp") is not None:
        assert main(["pipeline", "compile", str(cfg), "--target", "kfp", "-o", str(tmp_path / "pipe.yaml")]) == 0
    out = capsys.readouterr().out
    assert "model.family" in out and "custom" in out
    assert not mark.exists(), "a command that does not train imported the user's model.factory"


@pytest.mark.parametrize("factory, expect", [
    ("net.py:raises", ["`model.factory: ", "raised RuntimeError: no GPU here"]),
    ("net.py:not_a_module", ["returned a dict, not a `torch.nn.Module`"]),
    ("net.py:wrong_width", ["returns outputs of shape (2, 7)", "has 3 classes", "[batch, 3]"]),
    ("net.py:missing", ["has no function `missing`"]),
])
def test_bad_factories_are_one_paragraph_and_exit_2(tmp_path, capsys, factory, expect):
    cfg = write(tmp_path)
    assert main(["run", str(cfg), "--set", f"model.factory={factory}"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "Traceback" not in out
    for e in expect:
        assert e in out, out[-1500:]


def test_custom_module_recovers_from_an_oom_and_a_nan(tmp_path):
    """An OOM in window 2 halves the micro-batch (same effective batch); a NaN loss in window 6 rolls back to the last
    checkpoint at a lower learning rate; the run still ends well above guessing."""
    cfg = write(tmp_path, "faulty")
    rc, out = finish(launch(cfg, nproc=None, faults={"oom_at_windows": [2], "nan_at_windows": [6]}))
    assert rc == 0, out[-3000:]
    ev = events(tmp_path / "faulty")
    (rec,) = [e for e in ev if e["event"] == "oom_recovered"]
    assert rec["micro_batch"] == 4 and rec["effective_batch"] == 16
    assert any(e["event"] == "rolled_back" for e in ev)
    s = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert s["final"]["accuracy"] > s["trivial"]["majority_accuracy"] + 0.1


def test_custom_module_under_fsdp_equals_one_process(tmp_path):
    """FSDP2 shards your module over 2 gloo processes (the blocks its class lists in `_no_split_modules`, then the root);
    the trained weights equal one process's."""
    one = write(tmp_path, "one", **{"model.factory": "net.py:blocks"})
    assert main(["run", str(one)]) == 0
    two = write(tmp_path, "fsdp", **{"training.per_device_train_batch_size": 4, "model.factory": "net.py:blocks"})
    mapping = yaml.safe_load(two.read_text())
    mapping["distributed"] = {"strategy": "fsdp"}
    two.write_text(yaml.safe_dump(mapping))
    rc, out = finish(launch(two), timeout=400)
    assert rc == 0, out[-3000:]
    started = next(e for e in events(tmp_path / "fsdp") if e["event"] == "training_started")
    assert started["world_size"] == 2 and started.get("strategy", "fsdp") == "fsdp"
    diff = max_diff(newest_weights(tmp_path / "one"), newest_weights(tmp_path / "fsdp"))
    assert diff < 1e-5, diff
