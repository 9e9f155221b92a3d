"""Two nodes on one machine: two torch elastic agents (`trainpipe run --nproc-per-node 1 --nnodes 2 --node-rank 0|1
--rdzv-endpoint 127.0.0.1:PORT`), one worker each, gloo, the tiny Llama, one output folder both nodes see (the shared
file system of a cluster).

The guarantees: the two-node run equals one node with two processes bit for bit (the same global ranks, the same
batches); the run folder is written by global rank 0 alone (node 1's worker has local rank 0 too); a node whose agent
is killed outright takes its worker with it, the other node names it (`distributed_hang`) within
`distributed.timeout_seconds` and exits 5; `--resume` on both nodes, the roles of the two agents swapped in start
order, continues bit-identically to the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_distributed import events, finish, free_port, launch, newest_weights, run_files, sft_config, wait_for, worker_pids
from tiny import build_tiny_model

pytestmark = pytest.mark.e2e

STEPS = {"training.max_steps": 6, "training.save_steps": 2, "training.eval_steps": 6, "training.logging_steps": 2}


def node(cfg: Path, rank: int, port: int, *args: str, faults: dict | None = None) -> subprocess.Popen:
    """One node's agent: `trainpipe run CFG --nproc-per-node 1 --nnodes 2 --node-rank RANK --rdzv-endpoint 127.0.0.1:PORT`."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("TRAINPIPE_TEST_FAULTS", None)
    if faults:
        env["TRAINPIPE_TEST_FAULTS"] = json.dumps(faults)
    argv = [sys.executable, "-m", "trainpipe.cli", "run", str(cfg), *args, "--nproc-per-node", "1", "--nnodes", "2",
            "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def two_nodes(cfg: Path, *args: str, order=(0, 1)) -> list[tuple[int, str]]:
    port = free_port()
    procs = {r: node(cfg, r, port, *args) for r in order}
    return [finish(procs[r]) for r in (0, 1)]


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("nodes")
    for rc, out in two_nodes(sft_config(tmp, base, **STEPS)):
        assert rc == 0, out[-3000:]
    return tmp / "run"


def test_two_nodes_equal_one_node_with_two_processes(tmp_path, two_node_run, base):
    rc, out = finish(launch(sft_config(tmp_path, base, **STEPS)))
    assert rc == 0, out[-3000:]
    one_node = tmp_path / "run"
    assert equal(newest_weights(two_node_run), newest_weights(one_node)), "two nodes trained other weights than one node with two processes"
    losses = [[m["loss"] for m in map(json.loads, (r / "metrics.jsonl").read_text().splitlines()) if "loss" in m] for r in (two_node_run, one_node)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    # global rank 0 alone wrote the shared folder: one event stream, the same files as the one-node run, every checkpoint once
    ev = events(two_node_run)
    started = [e for e in ev if e["event"] == "training_started"]
    assert len(started) == 1 and started[0]["world_size"] == 2 and started[0]["rank"] == 0
    assert sum(e["event"] == "run_finished" for e in ev) == 1
    assert run_files(two_node_run) == run_files(one_node)
    assert [e["step"] for e in ev if e["event"] == "checkpoint_saved"] == [e["step"] for e in events(one_node) if e["event"] == "checkpoint_saved"]


def test_a_killed_node_is_named_within_the_timeout_and_both_resume_bit_identically(tmp_path, base, two_node_run):
    timeout = 4
    cfg = sft_config(tmp_path, base, **STEPS, **{"distributed.timeout_seconds": timeout})
    run = tmp_path / "run"
    port = free_port()
    nodes = [node(cfg, r, port, faults={"step_seconds": 0.4}) for r in (0, 1)]
    try:
        wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 2 for e in events(run)), nodes[0])
        orphans = worker_pids(nodes[1].pid)
        assert set(orphans) == {1}, orphans  # node 1 runs global rank 1 (its local rank 0)
        os.kill(nodes[1].pid, signal.SIGKILL)  # node 1's agent, killed outright: its worker must not train on alone
        t0 = time.time()
        rc, out = finish(nodes[0], timeout=120)
        took = time.time() - t0
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        nodes[1].wait()
    assert rc == 5, out[-3000:]
    assert took < timeout + 20, took
    assert not any(Path(f"/proc/{pid}").exists() for pid in orphans.values()), "node 1's worker outlived its agent"
    hang = [e for e in events(run) if e["event"] == "distributed_hang"]
    assert len(hang) == 1 and hang[0]["ranks"] == [1] and hang[0]["gone"] == [1], hang
    assert "Traceback" not in out, out[-3000:]
    assert not any(e["event"] == "training_finished" for e in events(run))
    # both nodes resume from the shared folder; node 1's agent starts first this time (it hosts no store, rank 0 still writes)
    for rc, out in two_nodes(cfg, "--resume", order=(1, 0)):
        assert rc == 0, out[-3000:]
    resumed = [e for e in events(run) if e["event"] == "checkpoint_resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 2
    assert equal(newest_weights(run), newest_weights(two_node_run)), "the resumed two-node run differs from the uninterrupted one"
