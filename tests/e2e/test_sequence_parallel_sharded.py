"""Sequence parallelism (distributed/ulysses.py) beyond plain DDP, through `trainpipe run` on gloo processes, tiny Llama:
under FSDP2 and ZeRO-3 (SP=2 on 2 processes, SP=2 x DP=2 on 4), with packed and padding-free rows, and through an OOM
halving and a NaN rollback. Each run is held to one process on the same examples (losses and weights to 1e-5); a
preempted and resumed SP run under FSDP2 or ZeRO-3 to the uninterrupted one, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

from test_distributed import base, events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker  # noqa: E402,F401

COMMON = {"data.packing": "none", "training.max_steps": 4, "training.save_steps": 2, "training.eval_steps": 2}


def _run(cfg: Path) -> Path:
    return Path(yaml.safe_load(cfg.read_text())["output_dir"])


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x and "eval" not in x]


def _train(cfg: Path, nproc: int | None = 2, faults: dict | None = None) -> Path:
    rc, out = finish(launch(cfg, nproc=nproc, faults=faults), timeout=300)
    assert rc == 0, out[-3000:]
    return _run(cfg)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):  # noqa: F811 - `base` is a fixture
    """One process's run on the same examples, per `data.packing` (micro-batch 4 x accumulation 2)."""
    runs: dict[str, Path] = {}

    def get(packing: str = "none") -> Path:
        if packing not in runs:
            runs[packing] = _train(sft_config(tmp_path_factory.mktemp(f"one-{packing}"), base, **{**COMMON, "data.packing": packing}), nproc=None)
        return runs[packing]

    return get


def assert_equal(run: Path, ref: Path, what: str) -> None:
    diff = max_diff(newest_weights(run), newest_weights(ref))
    a, b = _losses(ref), _losses(run)
    print(f"\n{what} vs one process: weights {diff:.2e}, losses {a} / {b}")
    assert a and len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)
    assert diff < 1e-5, diff


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory, base):  # noqa: F811
    """SP=2 under FSDP2 or ZeRO-3 on 2 processes (one data-parallel rank whose sequences are split over both, parameters
    sharded over both), per strategy."""
    runs: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in runs:
            runs[strategy] = _train(sft_config(tmp_path_factory.mktemp(f"sp-{strategy}"), base, **COMMON,
                                               **{"distributed.strategy": strategy, "distributed.sequence_parallel": 2}))
        return runs[strategy]

    return get


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sp2_under_fsdp_and_zero3_equals_one_process(base, one_process, sp_run, strategy):  # noqa: F811
    run = sp_run(strategy)
    assert_equal(run, one_process(), f"SP=2 under {strategy}")
    man = json.loads((run / "manifest.json").read_text())["distributed"]
    assert man["strategy"] == strategy and man["topology"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}


# zero3 only in CI (the 4-process runs are the slowest here; fsdp measured 1.19e-7 when added): ZeRO-3's engine sees
# dp x cp as its world, the part most likely to break
@pytest.mark.parametrize("strategy", ["zero3"])
def test_sp2_x_dp2_on_four_processes_equals_one_process(tmp_path, base, one_process, strategy):  # noqa: F811
    """4 processes: two sequence groups (ranks 0-1, 2-3), each reading its own micro-batch of 2 (data-parallel degree 2),
    FSDP2 or ZeRO-3 sharding the parameters over all 4; the window is one process's micro-batch 4 x accumulation 2."""
    cfg = sft_config(tmp_path, base, **COMMON, **{"training.per_device_train_batch_size": 2, "distributed.strategy": strategy,
                                                  "distributed.sequence_parallel": 2})
    run = _train(cfg, nproc=4)
    assert_equal(run, one_process(), f"SP=2 x DP=2 under {strategy}")
    assert json.loads((run / "manifest.json").read_text())["distributed"]["topology"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}
    assert next(e for e in events(run) if e["event"] == "training_started")["effective_batch"] == 8  # 2 x 2 x data-parallel 2


# fsdp only in CI (zero3 resume measured bit-identical when added; the 2-process zero3 run is checked for equality above)
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_sp2_preempted_then_resumed_is_bit_identical(tmp_path, base, sp_run, strategy):  # noqa: F811
    cfg = sft_config(tmp_path, base, **COMMON, **{"training.resume": "auto", "distributed.strategy": strategy, "distributed.sequence_parallel": 2})
    sigterm_one_worker(cfg, _run(cfg), 0.4)  # SIGTERM to rank 1 after the step-2 checkpoint: every rank stops at one step, exit 75
    run = _train(cfg)
    assert any(e["event"] == "checkpoint_resumed" for e in events(run))
    a, b = newest_weights(run), newest_weights(sp_run(strategy))
    assert all(torch.equal(a[k], b[k]) for k in a), f"the resumed SP run under {strategy} differs from the uninterrupted one"


@pytest.mark.parametrize("packing", ["padding_free", "pack"])
def test_packed_rows_under_sp2_equal_one_process(tmp_path, base, one_process, packing):  # noqa: F811
    """Packed rows (several examples per row, position ids restarting at each) and padding-free micro-batches (one row of
    every example, no padding) split over 2 sequence ranks: each example attends only to itself on the gathered sequence,
    so the losses and weights are one process's with the same packing."""
    run = _train(sft_config(tmp_path, base, **{**COMMON, "data.packing": packing}, **{"distributed.sequence_parallel": 2}))
    assert_equal(run, one_process(packing), f"SP=2 with data.packing={packing}")


def test_oom_under_sp2_halves_the_micro_batch_and_equals_one_process(tmp_path, base, one_process):  # noqa: F811
    """An OOM on rank 1 before a forward: rank 1 keeps taking part in its sequence group's exchanges (its own micro-batch, zero
    loss), then both halve to micro-batch 2 (2 rows, not padded back to 4) and retry the window; the run ends where one
    process without an OOM ends."""
    run = _train(sft_config(tmp_path, base, **COMMON, **{"distributed.sequence_parallel": 2}), faults={"ranks": [1], "oom_at_windows": [2]})
    ev = events(run)
    oom = [e for e in ev if e["event"] == "cuda_oom"]
    assert len(oom) == 1 and oom[0]["before_micro_batch"] == 4 and oom[0]["micro_batch"] == 2, oom
    assert oom[0]["micro_batch_per_rank"] == [2, 2] and oom[0]["ranks_out_of_memory"] == [1] and oom[0]["effective_batch"] == 8
    assert any(e["event"] == "oom_recovered" for e in ev)
    assert_equal(run, one_process(), "SP=2 after an OOM halving")


def test_nan_under_sp2_rolls_both_ranks_back_and_equals_one_process(tmp_path, base):  # noqa: F811
    one = _train(sft_config(tmp_path / "one", base, **COMMON), nproc=None, faults={"nan_at_windows": [3]})
    two = _train(sft_config(tmp_path / "two", base, **COMMON, **{"distributed.sequence_parallel": 2}), faults={"ranks": [1], "nan_at_windows": [3]})
    for run in (one, two):
        rb = [e for e in events(run) if e["event"] == "rolled_back"]
        assert len(rb) == 1 and rb[0]["step"] == 2 and rb[0]["skipped_windows"] == [3], rb
    assert_equal(two, one, "SP=2 after a NaN rollback")
