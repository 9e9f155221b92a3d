"""FSDP2 training (`distributed.strategy: fsdp`, issue 10) on the CPU: 2 gloo processes through
`trainpipe run --nproc-per-node 2`, tiny Llama, the harness of test_distributed.py.

The guarantees: 2 processes x micro-batch b == 1 process x 2b within 1e-5 for sft/LoRA and a full fine-tune; only rank
0 writes (one event stream, a manifest saying `fsdp`); SIGKILL of every worker after a checkpoint then `--resume` equals
the uninterrupted FSDP run; the exported model loads with transformers; a checkpoint written under FSDP resumes on one
process (the same layout as one process's checkpoint).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from test_distributed import _method_config, base, events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker, wait_for, worker_pids  # noqa: F401 - `base` is a fixture
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
    # the checkpoints are rank 0's gathered full state (every trainable parameter, unsharded), checksums over every file
    from trainpipe.train.checkpoints import CheckpointManager, verify

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


def test_fsdp_with_qlora_stops_before_any_weights_load_naming_what_works(tmp_path, base):  # noqa: F811
    cfg = sft_config(tmp_path, base, **SHORT, **FSDP, **{"method.peft": "qlora"})
    rc, out = finish(launch(cfg))
    assert rc == 2, out[-3000:]
    assert "`distributed.strategy: fsdp` with `method.peft: qlora`" in out and "`distributed.strategy: ddp` with `qlora`" in out
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert not any(e["event"] == "training_started" for e in events(tmp_path / "run"))


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
