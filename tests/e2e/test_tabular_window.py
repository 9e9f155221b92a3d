"""A table's training window gathered by row index (train/window.py Rows, train/supervised.py collate) and the loop's
torch-only RNG snapshot for the built-in MLP (Objective.step_rng): both are speed-ups of the training step
(benchmarks/tabular_throughput.py), and neither may change what is trained. Real in-process `trainpipe run`s of the
tabular MLP with dropout on a small table, compared to the bit."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from test_tabular import write_config, write_table
from trainpipe import faults
from trainpipe.cli import main
from trainpipe.train import window
from trainpipe.train.window import Rows

pytestmark = pytest.mark.e2e


def run(tmp_path, name: str, capsys) -> dict:
    cfg = write_config(tmp_path, model={"args": {"hidden_size": 32, "depth": 2, "dropout": 0.3}},
                       training={"num_train_epochs": 2, "per_device_train_batch_size": 32, "eval_steps": 10, "save_steps": 10},
                       output_dir=str(tmp_path / name))
    rc = main(["run", str(cfg)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    events = [json.loads(line) for line in (tmp_path / name / "events.jsonl").read_text().splitlines()]
    return {"weights": load_file(str(tmp_path / name / "model" / "model.safetensors")), "events": events}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_rows_gathered_by_index_train_what_the_per_example_path_trains(tmp_path, capsys, monkeypatch):
    write_table(tmp_path / "table.csv")
    fast = run(tmp_path, "by-index", capsys)
    # the loop handing plain lists (no row indices): the objective looks every example up, as before the index path
    monkeypatch.setattr(window.WindowPlan, "window", lambda self, data, w, by_row=False: [data[i] for i in self.indices(w)])
    slow = run(tmp_path, "per-example", capsys)
    assert same(fast["weights"], slow["weights"])


def test_an_oom_retry_of_the_tabular_mlp_needs_only_torchs_rng(tmp_path, capsys, monkeypatch):
    """The retried step after an OOM (micro-batch halved) restores the RNG snapshot taken before the step: for trainpipe's
    MLP and a named loss only torch's is taken; taking every RNG (what a model or loss of yours gets) trains the same."""
    write_table(tmp_path / "table.csv")
    monkeypatch.setenv(faults.ENV, json.dumps({"oom_at_windows": [2]}))
    monkeypatch.setattr(faults, "_fired", set())
    torch_only = run(tmp_path, "torch-only", capsys)
    (rec,) = [e for e in torch_only["events"] if e["event"] == "oom_recovered"]
    assert rec["micro_batch"] == 16
    monkeypatch.setattr(faults, "_fired", set())
    from trainpipe.train import loop, state

    taken = []
    monkeypatch.setattr(loop, "capture_rng", lambda *sources: taken.append(sources) or state.capture_rng())  # every RNG, as for your module
    every = run(tmp_path, "every-rng", capsys)
    assert (("torch",),) in taken  # before each step the loop asked for torch's only; the stand-in took every one
    assert any(e["event"] == "oom_recovered" for e in every["events"])
    assert same(torch_only["weights"], every["weights"])


def test_rows_slice_keeps_indices_and_collate_equals_the_lookup():
    import torch
    from trainpipe.train.supervised import SupervisedObjective

    data = [{"x_num": [float(i), -float(i)], "x_cat": [i % 3], "y": i % 2} for i in range(10)]
    obj = SupervisedObjective("cross_entropy", "classification")
    obj.stack(data)
    rows = torch.tensor([7, 2, 5, 0])
    win = Rows(data, rows)
    part = win[1:3]
    assert isinstance(part, Rows) and part.rows.tolist() == [2, 5] and list(part) == [data[2], data[5]] and part.source is data
    assert len(win) == 4 and win[0] is data[7] and win[-1] is data[0] and list(win[:1]) == [data[7]]
    by_index, by_lookup = obj.collate(part), obj.collate(list(part))
    assert all(by_index[k].equal(by_lookup[k]) for k in by_lookup)
    assert by_index["x_num"][:, 0].tolist() == [2.0, 5.0]
    other = [dict(e) for e in data]  # a list of equal rows that is not the stacked one: never gathered by index
    alien = Rows(other, torch.tensor([0, 1]))
    assert obj.collate(alien)["x_num"].tolist() == [[0.0, -0.0], [1.0, -1.0]]


def test_a_torch_only_rng_snapshot_restores_torch_and_leaves_the_others():
    import random

    import numpy as np
    import torch
    from trainpipe.train.state import capture_rng, restore_rng

    snap = capture_rng(("torch",))
    assert set(snap) <= {"torch", "cuda"}
    a = torch.rand(3)
    py, npy = random.random(), np.random.rand()
    restore_rng(snap)
    assert torch.rand(3).equal(a)
    assert random.random() != py and np.random.rand() != npy  # not rewound: they were not in the snapshot
    full = capture_rng()
    x, y = random.random(), np.random.rand()
    restore_rng(full)
    assert random.random() == x and np.random.rand() == y
