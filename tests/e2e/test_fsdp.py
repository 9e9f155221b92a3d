"""FSDP2 training (`distributed.strategy: fsdp`, issue 10) on the CPU: 2 gloo processes through
`trainpipe run --nproc-per-node 2`, tiny Llama, the harness of test_distributed.py.

The guarantees: 2 processes x micro-batch b == 1 process x 2b within 1e-5 for sft/LoRA and a full fine-tune; only rank
0 writes (one event stream, a manifest saying `fsdp`); SIGKILL of every worker after a checkpoint then `--resume` equals
the uninterrupted FSDP run; the exported model loads with transformers; a checkpoint written under FSDP resumes on one
process (the same layout as one process's checkpoint); an OOM on one rank halves every rank's micro-batch (before the
forward) or stops every worker with one paragraph (inside the sharded step); a NaN on one rank rolls every rank back
together (DDP and FSDP); FSDP + QLoRA trains and equals one process; the in-training eval is sharded over the ranks.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from test_distributed import _method_config, assert_every_rank_halved, assert_sharded_eval, base, events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker, wait_for, worker_pids  # noqa: F401 - `base` is a fixture
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

FSDP = {"distributed.strategy": "fsdp"}
SHORT = {"training.max_steps": 4, "training.eval_steps": 2, "training.save_steps": 2}


def _run_dir(cfg: Path) -> Path:
    return Path(yaml.safe_load(cfg.read_text())["output_dir"])


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory, base):  # noqa: F811
    """The uninterrupted 2-process FSDP sft/LoRA run (micro-batch 4, accumulation 2: effective batch 16), 4 steps."""
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    cfg = sft_config(tmp, base, **SHORT, **FSDP)
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    return _run_dir(cfg)


KINDS = {
    "sft_lora": {},
    "full": {"method.peft": "none", "training.learning_rate": 1e-3},
    "dora": {"method.peft": "dora"},  # the magnitude vector and the base weight's norm inside a sharded layer
    "offload": {"distributed.offload": "optimizer+params"},  # FSDP2's CPUOffloadPolicy (on the CPU: the same memory)
    "freeze": {"method.peft": "freeze", "method.freeze": {"trainable_layers": 1}, "training.learning_rate": 1e-3},  # whole frozen and trainable blocks in one model
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp_two_processes_equal_one_process_with_twice_the_micro_batch(tmp_path, base, kind, request):  # noqa: F811
    extra = KINDS[kind]
    single = {k: v for k, v in extra.items() if not k.startswith("distributed.")}
    one = sft_config(tmp_path / "one", base, **SHORT, **single, **{"training.per_device_train_batch_size": 8})
    assert main(["run", str(one)]) == 0
    if kind == "sft_lora":
        run2 = request.getfixturevalue("fsdp_reference")
    else:
        two = sft_config(tmp_path / "two", base, **SHORT, **extra, **FSDP)
        rc, out = finish(launch(two))
        assert rc == 0, out[-3000:]
        run2 = _run_dir(two)
    diff = max_diff(newest_weights(_run_dir(one)), newest_weights(run2))
    print(f"\nfsdp {kind}: max |w(2 procs x mb 4, FSDP) - w(1 proc x mb 8)| = {diff:.2e}")
    assert diff < 1e-5
    # rank 0 alone writes: one event stream, one start and one finish; the manifest says fsdp
    ev = events(run2)
    assert sum(e["event"] == "training_started" for e in ev) == 1 and sum(e["event"] == "run_finished" for e in ev) == 1
    assert next(e for e in ev if e["event"] == "training_started")["world_size"] == 2
    man = json.loads((run2 / "manifest.json").read_text())
    assert man["distributed"]["strategy"] == "fsdp" and man["distributed"]["world_size"] == 2
    metrics = [json.loads(x) for x in (run2 / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "loss" in m]) == 2 and len([m for m in metrics if "eval_loss" in m]) == 2  # written once
    # the clipped gradient norm is the global one over the shards: equal to one process's (the full fine-tune clips: > 1)
    norms1 = [m["grad_norm"] for m in map(json.loads, (_run_dir(one) / "metrics.jsonl").read_text().splitlines()) if "grad_norm" in m]
    norms2 = [m["grad_norm"] for m in metrics if "grad_norm" in m]
    assert len(norms2) == 2 and all(abs(a - b) <= 1e-4 * max(1.0, a) for a, b in zip(norms1, norms2, strict=True)), (norms1, norms2)
    assert_sharded_eval(run2, _run_dir(one))  # every rank forwards the same number of eval batches (FSDP), each its own share
    # the checkpoints are rank 0's gathered full state (every trainable parameter, unsharded), checksums over every file
    from trainpipe.model.checkpoints import CheckpointManager, verify

    newest = CheckpointManager(run2 / "checkpoints").latest_valid()
    assert newest is not None and newest.step == 4 and verify(newest.path) is None
    w1 = newest_weights(_run_dir(one))
    assert {k: v.shape for k, v in newest_weights(run2).items()} == {k: v.shape for k, v in w1.items()}
    # the exported model loads with transformers
    model_dir = run2 / "model"
    assert model_dir.is_dir() and (run2 / "summary.json").exists()
    if kind in ("full", "freeze"):
        from transformers import AutoModelForCausalLM

        from safetensors.torch import load_file

        m = AutoModelForCausalLM.from_pretrained(str(model_dir))
        best = CheckpointManager(run2 / "checkpoints").best()
        w = load_file(str(best.path / "weights.safetensors"))  # the export is the best checkpoint's weights, gathered
        key = next(k for k in w if "down_proj" in k)
        assert torch.equal(m.state_dict()[key], w[key])
    else:
        from peft import AutoPeftModelForCausalLM

        adapter = model_dir / "adapter" if (model_dir / "adapter").is_dir() else model_dir
        m = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
        assert any("lora_A" in n for n, _ in m.named_parameters())


def math_finite(x: float) -> bool:
    import math

    return math.isfinite(x)


def test_fsdp_sigkill_all_workers_after_a_checkpoint_then_resume_equals_uninterrupted(tmp_path, base, fsdp_reference):  # noqa: F811
    cfg = sft_config(tmp_path, base, **SHORT, **FSDP, **{"training.resume": "auto"})
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
    a, b = newest_weights(run), newest_weights(fsdp_reference)
    diff = max_diff(a, b)
    print(f"\nfsdp resume: max |w(killed + resumed) - w(uninterrupted)| = {diff:.2e}, bit-identical: {all(torch.equal(a[k], b[k]) for k in a)}")
    assert diff <= 1e-6


def test_fsdp_sigterm_to_one_worker_stops_all_then_the_checkpoint_resumes_on_one_process(tmp_path, base, fsdp_reference):  # noqa: F811
    """SIGTERM to rank 1 stops both ranks at one step with one checkpoint (exit 75); the FSDP checkpoint is the gathered
    full state in one process's layout, so the run continues on 1 process and ends where the FSDP run ends."""
    cfg = sft_config(tmp_path, base, **SHORT, **FSDP)
    run = tmp_path / "run"
    step = sigterm_one_worker(cfg, run, 0.5)
    assert step < 4
    assert main(["run", str(cfg), "--resume"]) == 0
    ev = events(run)
    resumed = next(e for e in ev if e["event"] == "checkpoint_resumed")
    assert resumed["step"] == step
    started = [e for e in ev if e["event"] == "training_started"][-1]
    assert started["world_size"] == 1 and started["effective_batch"] == 16
    diff = max_diff(newest_weights(run), newest_weights(fsdp_reference))
    print(f"\nfsdp checkpoint of step {step} resumed on 1 process: max diff to the 2-process FSDP run = {diff:.2e}")
    assert diff < 1e-5


def test_fsdp_oom_on_one_rank_halves_every_ranks_micro_batch(tmp_path, base, fsdp_reference):  # noqa: F811
    """An OOM on rank 1 alone, before its forward of window 1: rank 1 keeps taking part in the window's sharded forwards
    and backwards with zero-loss micro-steps (every FSDP forward is a collective), the all-reduced flag makes both ranks
    retry the window with micro-batch 2, and the run ends where the uninterrupted FSDP run ends (no hang: a timeout)."""
    cfg = sft_config(tmp_path, base, **SHORT, **FSDP)
    rc, out = finish(launch(cfg, faults={"ranks": [1], "oom_at_windows": [1]}), timeout=240)
    assert rc == 0, out[-3000:]
    assert_every_rank_halved(tmp_path / "run")
    diff = max_diff(newest_weights(tmp_path / "run"), newest_weights(fsdp_reference))
    print(f"\nfsdp oom on rank 1: max |w - w(uninterrupted)| = {diff:.2e}")
    assert diff < 1e-5


def test_fsdp_oom_inside_a_sharded_step_stops_every_worker_with_one_paragraph(tmp_path, base):  # noqa: F811
    """An OOM on rank 1 after its sharded forward (rank 0 is already in the backward's all-gathers) cannot be retried in
    place: rank 1 stops with the one-paragraph `out of memory` (exit 4) naming what to lower, and the launcher ends rank 0
    instead of leaving it waiting (a timeout on the test: no hang)."""
    cfg = sft_config(tmp_path, base, **SHORT, **FSDP)
    rc, out = finish(launch(cfg, faults={"ranks": [1], "oom_after_forward_at_windows": [1]}), timeout=240)
    assert rc == 4, out[-3000:]
    assert "inside a sharded forward or backward" in out and "training.per_device_train_batch_size" in out
    assert not any(e["event"] == "training_finished" for e in events(tmp_path / "run"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_divergence_on_one_rank_rolls_every_rank_back_together(tmp_path, base, strategy):  # noqa: F811
    """A NaN loss on rank 1 alone in window 3: the all-reduced loss (and gradient norm) is NaN on every rank, so all roll
    back to the step-2 checkpoint together, each loading it (FSDP: the gathered state, each rank keeping its shard), skip
    window 3 and continue at half the learning rate. The 2-process run ends where one process with micro-batch 8 and the
    same NaN ends: a rank that kept its own weights would have computed other gradients."""
    one = sft_config(tmp_path / "one", base, **SHORT, **{"training.per_device_train_batch_size": 8})
    rc, out = finish(launch(one, nproc=None, faults={"nan_at_windows": [3]}), timeout=240)
    assert rc == 0, out[-3000:]
    two = sft_config(tmp_path / "two", base, **SHORT, **{"distributed.strategy": strategy})
    rc, out = finish(launch(two, faults={"ranks": [1], "nan_at_windows": [3]}), timeout=240)
    assert rc == 0, out[-3000:]
    for run in (_run_dir(one), _run_dir(two)):
        ev = events(run)
        assert [e["event"] for e in ev if e["event"] in ("gradient_overflow", "rolled_back")] == ["gradient_overflow", "rolled_back"]
        rb = next(e for e in ev if e["event"] == "rolled_back")
        assert rb["step"] == 2 and rb["checkpoint"].endswith("step-2") and rb["skipped_windows"] == [3] and rb["lr_scale"] == 0.5
        assert [e for e in ev if e["event"] == "training_finished"]
    assert json.loads((_run_dir(two) / "manifest.json").read_text())["distributed"]["strategy"] == strategy
    diff = max_diff(newest_weights(_run_dir(one)), newest_weights(_run_dir(two)))
    print(f"\n{strategy} rollback after a NaN on rank 1: max |w(2 procs) - w(1 proc, same NaN)| = {diff:.2e}")
    assert diff < 1e-5


def test_fsdp_with_qlora_trains_the_4bit_base_sharded_and_equals_one_process(tmp_path, base):  # noqa: F811
    """FSDP + QLoRA as in PEFT's docs: the 4-bit weights are stored as the float dtype of the other parameters
    (`bnb_4bit_quant_storage`), so FSDP2 shards them with everything else and all-gathers them before each layer; the
    adapters train. 2 processes x micro-batch 4 equal 1 process x 8 on the same 4-bit base, and the eval loss falls."""
    one = sft_config(tmp_path / "one", base, **SHORT, **{"method.peft": "qlora", "training.per_device_train_batch_size": 8})
    assert main(["run", str(one)]) == 0
    two = sft_config(tmp_path / "two", base, **SHORT, **FSDP, **{"method.peft": "qlora"})
    rc, out = finish(launch(two), timeout=300)
    assert rc == 0, out[-3000:]
    run = _run_dir(two)
    ev = events(run)
    assert next(e for e in ev if e["event"] == "training_started")["world_size"] == 2
    assert json.loads((run / "manifest.json").read_text())["distributed"]["strategy"] == "fsdp"
    baseline = next(e["loss"] for e in ev if e["event"] == "eval_done" and e.get("phase") == "baseline")
    evals = [e["eval_loss"] for e in ev if e["event"] == "eval_done" and e.get("phase") == "train"]
    assert evals[-1] < baseline - 0.05, (baseline, evals)
    diff = max_diff(newest_weights(_run_dir(one)), newest_weights(run))
    print(f"\nfsdp qlora: eval loss {baseline:.4f} -> {evals[-1]:.4f}; max |w(2 procs x mb 4, FSDP) - w(1 proc x mb 8)| = {diff:.2e}")
    assert diff < 1e-5
    assert any("lora_A" in k for k in newest_weights(run)) and sum(e["event"] == "model_exported" for e in ev) == 1


def test_four_bit_storage_is_viewed_as_floats_with_the_same_bytes(base):  # noqa: F811
    """The conversion FSDP + QLoRA relies on: every Params4bit becomes float32 storage over the very same bytes, and the
    4-bit model's forward is unchanged (one process, no sharding)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trainpipe.distributed.fsdp import four_bit_storage_as_float

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    m = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=q, dtype=torch.float32)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids).logits
    # bitsandbytes 0.50 repacks the 4-bit bytes for its CPU kernel on the first forward: the bytes are read after it
    before = {n: p.data.clone() for n, p in m.named_parameters() if type(p).__name__ == "Params4bit"}
    assert four_bit_storage_as_float(m) == len(before) > 0
    after = dict(m.named_parameters())
    assert all(after[n].dtype == torch.float32 and type(after[n]).__name__ == "Params4bit" for n in before)
    assert all(torch.equal(after[n].data.reshape(-1).view(torch.uint8), before[n].reshape(-1)) for n in before)
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, ref)


@pytest.mark.parametrize("kind", ["rl", "pretrain", "reward", "dpo", "kto"])
def test_every_method_trains_under_fsdp(tmp_path, base, kind):  # noqa: F811
    """rl samples under FSDP with generate's synced_gpus (ranks step together until every rank's completions end);
    pretrain resizes the embeddings before sharding; the preference objectives' reference is the adapter-free model."""
    cfg = _method_config(tmp_path, base, kind)
    c = yaml.safe_load(cfg.read_text())
    c["distributed"] = {"strategy": "fsdp"}
    cfg.write_text(yaml.safe_dump(c))
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    run = Path(c["output_dir"])
    ev = events(run)
    started = [e for e in ev if e["event"] == "training_started"]
    assert len(started) == 1 and started[0]["world_size"] == 2
    assert json.loads((run / "manifest.json").read_text())["distributed"]["strategy"] == "fsdp"
    assert sum(e["event"] == "model_exported" for e in ev) == 1 and (run / "summary.json").exists()
    assert all(math_finite(m["loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m)
