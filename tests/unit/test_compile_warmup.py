"""`training.torch_compile: true` in the training loop on the CPU (inductor, which builds C++ with the system compiler):
three steps of a tiny full fine-tune give the eager loop's losses within 1e-5, and the first step's compile warm-up is
stated apart: a `compile_warmup` event (the one console line) and `compile_warmup_seconds` in the first metrics record
only. One row repeated, so the model compiles once and each step's loss is comparable."""

import json
import shutil
from types import SimpleNamespace

import pytest

from trainpipe.config import build_config
from trainpipe.events import EventLog
from trainpipe.plan import resolve
from trainpipe.plan.hardware import CPU
from trainpipe.train.sft import build_loop

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile's inductor backend needs a C++ compiler on the CPU (no g++/c++ here)")


def run_loop(tmp_path, model_dir, compiled: bool):
    import random

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    t = {"learning_rate": 3e-3, "gradient_accumulation_steps": 1, "per_device_train_batch_size": 4, "save_steps": 50, "max_steps": 3,
         "logging_steps": 1, "torch_compile": compiled}
    cfg = build_config({"model": {"name_or_path": "tiny"}, "method": {"peft": "none"}, "data": {"sources": [{"path": "t.jsonl"}]}, "training": t})
    specs = resolve(cfg, CPU, sizing=False).specs
    rng = random.Random(1)
    ids = [rng.randrange(5, 300) for _ in range(12)]
    rows = [{"input_ids": ids, "labels": ids}] * 12  # one row: every step sees the same batch, so its loss falls
    events = EventLog(tmp_path / "events.jsonl")
    loop = build_loop(model, SimpleNamespace(pad_token_id=0), rows, specs, run_dir=tmp_path, events=events, config_yaml="", evaluate=lambda m: 0.0)
    loop.fit()
    read = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines() if x.strip()]  # noqa: E731
    return {m["step"]: m for m in read("metrics.jsonl") if "loss" in m}, read("events.jsonl")


def test_compiled_loop_trains_to_the_eager_losses_and_states_its_warmup(tmp_path, tiny_model_dir):
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    off, off_events = run_loop(tmp_path / "eager", tiny_model_dir, compiled=False)
    on, on_events = run_loop(tmp_path / "compiled", tiny_model_dir, compiled=True)
    assert sorted(on) == sorted(off) == [1, 2, 3]
    for step in off:
        assert abs(on[step]["loss"] - off[step]["loss"]) <= 1e-5, (step, on[step]["loss"], off[step]["loss"])
    assert off[3]["loss"] < off[1]["loss"]  # it trained
    warm = on[1]["compile_warmup_seconds"]
    assert warm > 0 and "compile_warmup_seconds" not in on[2] and not any("compile_warmup_seconds" in m for m in off.values())
    (event,) = [e for e in on_events if e["event"] == "compile_warmup"]
    assert event["step"] == 1 and event["compile_warmup_seconds"] == warm and "warm-up" in event["note"]
    assert not [e for e in off_events if e["event"] == "compile_warmup"]
