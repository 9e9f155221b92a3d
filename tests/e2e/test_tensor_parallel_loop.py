"""Tensor parallelism inside trainpipe's loop (`distributed.tensor_parallel`, distributed/strategy.py `TensorParallel`) on gloo
with the tiny Llama built from a config: `trainpipe run --nproc-per-node 2` with a tensor degree of 2 (each decoder weight
split in two, one data-parallel rank) gives one process's losses and weights; a run preempted after a checkpoint and resumed
ends bit-identical to the uninterrupted one; FSDP2 x TP on 4 processes (2-D) gives one process's weights.

SGD keeps the comparison to the weights' rounding: the split matmuls round differently from the whole ones (1e-7 relative),
and AdamW's first steps divide each gradient by its own magnitude, which can turn that rounding on near-zero gradients into
differences of up to the learning rate (the same 4-step run with AdamW at lr 1e-3 ended 6.0e-8 apart; a 3-step probe
outside the loop at lr 1e-2 with clipping at 0.5, 2.1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from test_distributed import base, events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker  # noqa: F401
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

COMMON = {"method.peft": "none", "training.optim": "sgd", "training.learning_rate": 0.05, "training.max_steps": 4, "training.save_steps": 2,
          "training.eval_steps": 2}


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x and "eval" not in x]


def _run_dir(cfg: Path) -> Path:
    return Path(yaml.safe_load(cfg.read_text())["output_dir"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):  # noqa: F811 - `base` is a fixture
    cfg = sft_config(tmp_path_factory.mktemp("tp1"), base, **COMMON)
    assert main(["run", str(cfg)]) == 0
    return _run_dir(cfg)


def test_trainpipe_run_with_tensor_parallel_2_equals_one_process_and_resumes_bit_identical(tmp_path, base, one_process):  # noqa: F811
    from safetensors.torch import load_file

    two = sft_config(tmp_path / "two", base, **COMMON, **{"distributed.tensor_parallel": 2})
    rc, out = finish(launch(two))
    assert rc == 0, out[-3000:]
    run2 = _run_dir(two)
    diff = max_diff(newest_weights(one_process), newest_weights(run2))
    export = max_diff(load_file(str(one_process / "model" / "model.safetensors")), load_file(str(run2 / "model" / "model.safetensors")))
    moved = max_diff(newest_weights(one_process), load_file(str(base / "model.safetensors")))
    losses = [_losses(one_process), _losses(run2)]
    print(f"\nTP=2 vs one process: weights {diff:.2e}, export {export:.2e}, moved {moved:.2e}, losses {losses}")
    assert diff < 1e-5 and export < 1e-5 and moved > 1e-3
    assert losses[0] and all(abs(a - b) < 1e-5 for a, b in zip(*losses, strict=True))
    started = next(e for e in events(run2) if e["event"] == "training_started")
    assert started["effective_batch"] == 8  # micro-batch 4 x accumulation 2 x data-parallel degree 1 (not the 2 processes)
    man = json.loads((run2 / "manifest.json").read_text())
    assert man["distributed"]["topology"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert man["plan"]["effective_batch_formula"] == "4 x 2 x 1 = 8"
    evals = [(e["step"], round(e["eval_loss"], 6)) for r in (one_process, run2) for e in events(r) if e["event"] == "eval_done" and e.get("phase") == "train"]
    assert evals[: len(evals) // 2] == evals[len(evals) // 2 :], evals  # the in-training eval (every rank in lockstep) is one process's
    # preempted after its step-2 checkpoint (SIGTERM to rank 1: every rank stops at one step, exit 75), then resumed: the same
    # weights, to the bit, as the uninterrupted tensor-parallel run
    three = sft_config(tmp_path / "three", base, **COMMON, **{"training.resume": "auto", "distributed.tensor_parallel": 2})
    run3 = _run_dir(three)
    sigterm_one_worker(three, run3, 0.4)
    rc, out = finish(launch(three))
    assert rc == 0, out[-3000:]
    assert any(e["event"] == "checkpoint_resumed" for e in events(run3))
    a, b = newest_weights(run3), newest_weights(run2)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed tensor-parallel run differs from the uninterrupted one"


def test_fsdp_2_by_tensor_parallel_2_on_4_processes_equals_one_process(tmp_path, base, one_process):  # noqa: F811
    """2-D: FSDP2 over 2 data-parallel ranks x a tensor degree of 2. Micro-batch 2 over 2 data-parallel ranks reads the
    window one process reads with micro-batch 4."""
    four = sft_config(tmp_path / "four", base, **{**COMMON, "training.per_device_train_batch_size": 2},
                      **{"distributed.tensor_parallel": 2, "distributed.strategy": "fsdp"})
    rc, out = finish(launch(four, nproc=4), timeout=420)
    assert rc == 0, out[-3000:]
    run4 = _run_dir(four)
    diff = max_diff(newest_weights(one_process), newest_weights(run4))
    losses = [_losses(one_process), _losses(run4)]
    print(f"\nFSDP 2 x TP 2 vs one process: weights {diff:.2e}, losses {losses}")
    assert diff < 1e-5 and all(abs(a - b) < 1e-5 for a, b in zip(*losses, strict=True))
    man = json.loads((run4 / "manifest.json").read_text())
    assert man["distributed"]["topology"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert man["distributed"]["strategy"] == "fsdp"
