"""Sharded strategies with images in the batches (a tiny LLaVA built in the test, tests/vlm_tiny.py; one or two images
a conversation): FSDP2 (LoRA and full fine-tune, the vision tower frozen inside the wrapped model) and DeepSpeed ZeRO-2 /
ZeRO-3 (full fine-tune; ZeRO-3 partitions the frozen tower too and gathers it for each forward) on 2 gloo processes x
micro-batch 4 equal 1 process x micro-batch 8, in the loss of every step and the final weights, within 1e-5."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_distributed import events, finish, launch, max_diff, newest_weights  # noqa: E402
from vlm_tiny import build_tiny_llava, mixed_records, write_jsonl  # noqa: E402

from trainpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlmshard")
    write_jsonl(tmp / "data" / "mixed.jsonl", mixed_records(tmp / "data", 40))
    return tmp, build_tiny_llava(tmp / "llava")


def _config(tmp: Path, base: tuple, name: str, peft: str, strategy: str | None = None) -> Path:
    data_dir, model = base
    two = strategy is not None
    cfg = {
        "model": {"name_or_path": str(model)},
        "data": {"sources": [{"path": str(data_dir / "data" / "mixed.jsonl")}], "eval_split": 8, "max_length": 64},
        "method": {"peft": peft, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "training": {"max_steps": 3, "save_steps": 3, "eval_steps": 3, "logging_steps": 1, "per_device_train_batch_size": 4 if two else 8,
                     "gradient_accumulation_steps": 2 if two else 2, "learning_rate": 3e-3 if peft == "lora" else 1e-3,
                     "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]}, "gates": {"on_fail": "warn"},
        "output_dir": str(tmp / name),
    }
    if two:
        cfg["distributed"] = {"strategy": strategy}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("vlmone")
    out = {}
    for peft in ("lora", "none"):
        cfg = _config(tmp, base, f"one_{peft}", peft)
        assert main(["run", str(cfg)]) == 0
        out[peft] = tmp / f"one_{peft}"
    return out


CASES = [("fsdp", "lora"), ("fsdp", "none"), ("zero2", "none"), ("zero3", "none"), ("zero3", "lora")]


@pytest.mark.parametrize("strategy,peft", CASES, ids=[f"{s}-{'full' if p == 'none' else p}" for s, p in CASES])
def test_sharded_two_processes_equal_one_process_with_images(tmp_path, base, one_process, strategy, peft):
    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed")
    cfg = _config(tmp_path, base, "two", peft, strategy)
    rc, out = finish(launch(cfg), timeout=500)
    assert rc == 0, out[-4000:]
    one, two = one_process[peft], tmp_path / "two"
    l1, l2 = _losses(one), _losses(two)
    loss_diff = max(abs(a - b) for a, b in zip(l1, l2, strict=True))
    diff = max_diff(newest_weights(one), newest_weights(two))
    print(f"\nVLM {strategy} {peft}: max |loss(2 procs x mb 4) - loss(1 proc x mb 8)| = {loss_diff:.2e}, max |w - w| = {diff:.2e}")
    assert len(l1) == 3 and loss_diff < TOLERANCE and diff < TOLERANCE
    started = next(e for e in events(two) if e["event"] == "training_started")
    assert started["world_size"] == 2 and started["effective_batch"] == 16
    if peft == "none":  # the tower and projector stayed frozen under the sharded wrapper (`method.freeze_vision: true`)
        from safetensors.torch import load_file

        w0 = load_file(str(base[1] / "model.safetensors"))
        w2 = load_file(str(two / "model" / "model.safetensors"))
        tower = [k for k in w0 if "language_model" not in k and "lm_head" not in k]
        assert tower and all((w0[k] == w2[k]).all() for k in tower)
