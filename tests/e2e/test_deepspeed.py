"""DeepSpeed ZeRO-2 / ZeRO-3 as a strategy of trainpipe's loop (`distributed.strategy: zero2 | zero3`) on the CPU: 2 gloo
processes through `trainpipe run --nproc-per-node 2` (DeepSpeed's CPU accelerator), tiny Llama, the harness of
test_distributed.py.

The guarantees: 2 processes x micro-batch b under ZeRO equal 1 process x 2b (plain trainpipe, no DeepSpeed) within 1e-5
in the losses of every step and the final weights, for ZeRO-2 and for ZeRO-3 with the optimizer and the parameters
offloaded to the CPU (`distributed.offload: optimizer+params`, trainpipe's own optimizer stepping the CPU partitions);
ZeRO-2 with an OOM on one rank on the way (every rank halves its micro-batch and retries the window, the
gradients already reduced into the partitions dropped); the checkpoint is the gathered full state
(checksummed, one process's layout); SIGKILL of every worker after a checkpoint then `--resume` equals the uninterrupted
ZeRO run bit for bit; SIGTERM to one worker stops every rank with a checkpoint and exit 75; a NaN on one rank rolls
every rank back together (ZeRO-2), ending where one process with the same NaN ends.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from test_distributed import assert_every_rank_halved, base, events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker, wait_for, worker_pids  # noqa: F401 - `base` is a fixture
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

SHORT = {"training.max_steps": 4, "training.eval_steps": 2, "training.save_steps": 2}


def _run_dir(cfg: Path) -> Path:
    return Path(yaml.safe_load(cfg.read_text())["output_dir"])


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):  # noqa: F811
    """Plain trainpipe on one process, micro-batch 8 (the effective batch 16 of the 2-process runs), full fine-tune."""
    tmp = tmp_path_factory.mktemp("ds_one")
    cfg = sft_config(tmp, base, **SHORT, **{"method.peft": "none", "training.learning_rate": 1e-3, "training.logging_steps": 1,
                                             "training.per_device_train_batch_size": 8})
    assert main(["run", str(cfg)]) == 0
    return _run_dir(cfg)


def _zero(tmp: Path, base: Path, stage: str, **extra) -> Path:  # noqa: F811
    return sft_config(tmp, base, **SHORT, **{"method.peft": "none", "training.learning_rate": 1e-3, "training.logging_steps": 1,
                                             "distributed.strategy": stage, **extra})


ZERO3 = {"distributed.offload": "optimizer+params"}  # ZeRO-3 with the optimizer step and the parameters on the CPU (ZeRO-Offload)


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory, base):  # noqa: F811
    """The uninterrupted 2-process ZeRO-3 run with `distributed.offload: optimizer+params` (micro-batch 4, accumulation 2)."""
    tmp = tmp_path_factory.mktemp("ds_zero3")
    cfg = _zero(tmp, base, "zero3", **ZERO3)
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    return _run_dir(cfg)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_two_processes_equal_one_process_with_twice_the_micro_batch(tmp_path, base, stage, one_process, request):  # noqa: F811
    if stage == "zero3":
        run2 = request.getfixturevalue("zero3_reference")
    else:  # with an OOM on rank 1 alone before its forward of window 1 on the way (the fault injection of faults.py)
        cfg = _zero(tmp_path, base, stage)
        rc, out = finish(launch(cfg, faults={"ranks": [1], "oom_at_windows": [1]}))
        assert rc == 0, out[-3000:]
        run2 = _run_dir(cfg)
        assert_every_rank_halved(run2)  # both ranks dropped the window's reduced gradients and retried it with micro-batch 2
    l1, l2 = _losses(one_process), _losses(run2)
    assert len(l1) == len(l2) == 4 and l2[-1] < l2[0]
    loss_diff = max(abs(a - b) for a, b in zip(l1, l2, strict=True))
    diff = max_diff(newest_weights(one_process), newest_weights(run2))
    print(f"\n{stage}{' + offload optimizer+params' if stage == 'zero3' else ''}: max |loss(2 procs x mb 4) - loss(1 proc x mb 8)| = {loss_diff:.2e}, max |w - w| = {diff:.2e}")
    assert loss_diff < 1e-5 and diff < 1e-5
    man = json.loads((run2 / "manifest.json").read_text())
    assert man["distributed"]["strategy"] == stage and man["distributed"]["world_size"] == 2
    assert man["distributed"].get("zero_stage") == int(stage[-1])
    ev = events(run2)
    assert sum(e["event"] == "training_started" for e in ev) == 1 and sum(e["event"] == "run_finished" for e in ev) == 1
    from trainpipe.model.checkpoints import CheckpointManager, verify

    newest = CheckpointManager(run2 / "checkpoints").latest_valid()
    assert newest is not None and newest.step == 4 and verify(newest.path) is None  # checksummed, the gathered full state
    w1 = newest_weights(one_process)
    assert {k: v.shape for k, v in newest_weights(run2).items()} == {k: v.shape for k, v in w1.items()}
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(run2 / "model"))  # the exported model: whole weights, loads with transformers
    key = next(k for k in w1 if "down_proj" in k)
    assert m.state_dict()[key].shape == w1[key].shape


def test_zero3_sigkill_all_workers_after_a_checkpoint_then_resume_is_bit_identical(tmp_path, base, zero3_reference):  # noqa: F811
    cfg = _zero(tmp_path, base, "zero3", **ZERO3, **{"training.resume": "auto"})
    run = tmp_path / "run"
    p = launch(cfg, faults={"step_seconds": 0.5})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] == 2 for e in events(run)), p)
    for pid in worker_pids(p.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not any(e["event"] == "training_finished" for e in events(run))
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    resumed = [e for e in events(run) if e["event"] == "checkpoint_resumed"]
    assert resumed and resumed[-1]["step"] >= 2
    a, b = newest_weights(run), newest_weights(zero3_reference)
    print(f"\nzero3 resume: max |w(killed + resumed) - w(uninterrupted)| = {max_diff(a, b):.2e}")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert _losses(run)[-2:] == _losses(zero3_reference)[-2:]


def test_zero2_sigterm_to_one_worker_stops_every_rank_with_a_checkpoint(tmp_path, base):  # noqa: F811
    """SIGTERM to rank 1: both ranks stop at the same step, rank 0 writes one checkpoint, the launcher exits 75."""
    cfg = _zero(tmp_path, base, "zero2")
    step = sigterm_one_worker(cfg, tmp_path / "run", 0.5)
    assert step < 4



def test_zero2_nan_on_one_rank_rolls_every_rank_back_together(tmp_path, base):  # noqa: F811
    """A NaN loss on rank 1 alone in window 3: the agreed loss (and the global gradient norm over the partitions) is not
    finite on every rank, both drop the window's reduced gradients, roll back to the step-2 checkpoint (each setting its
    partitions from the gathered state), skip window 3 at half the learning rate, and end where one process with
    micro-batch 8 and the same NaN ends."""
    one = sft_config(tmp_path / "one", base, **SHORT, **{"method.peft": "none", "training.learning_rate": 1e-3,
                                                         "training.per_device_train_batch_size": 8})
    rc, out = finish(launch(one, nproc=None, faults={"nan_at_windows": [3]}), timeout=240)
    assert rc == 0, out[-3000:]
    two = _zero(tmp_path / "two", base, "zero2")
    rc, out = finish(launch(two, faults={"ranks": [1], "nan_at_windows": [3]}), timeout=240)
    assert rc == 0, out[-3000:]
    for run in (_run_dir(one), _run_dir(two)):
        ev = events(run)
        rb = [e for e in ev if e["event"] == "rolled_back"]
        assert len(rb) == 1 and rb[0]["step"] == 2 and rb[0]["skipped_windows"] == [3] and rb[0]["lr_scale"] == 0.5
        assert [e for e in ev if e["event"] == "training_finished"]
    diff = max_diff(newest_weights(_run_dir(one)), newest_weights(_run_dir(two)))
    print(f"\nzero2 rollback after a NaN on rank 1: max |w(2 procs) - w(1 proc, same NaN)| = {diff:.2e}")
    assert diff < 1e-5
