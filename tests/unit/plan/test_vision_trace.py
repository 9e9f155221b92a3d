"""`plan --trace` on vision-language models (plan/trace_vision.py): a step with pixel tensors of the planned image size
made by the model's own processor, on fake tensors, equal to the same step on real CPU tensors to the byte (the text
trace's tolerance) for LLaVA, Gemma 3 and mllama built tiny in the test; a training tower and a second image cost more;
families whose forward reads tensor values (LLaVA-NeXT) get one paragraph instead."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vlm_tiny import build_tiny_gemma3, build_tiny_llava  # noqa: E402
from vlm_tiny_families import build_tiny_llava_next, build_tiny_mllama  # noqa: E402

from trainpipe.cli import main  # noqa: E402
from trainpipe.plan.catalog import find_model  # noqa: E402
from trainpipe.plan.memory import Setup  # noqa: E402
from trainpipe.plan.trace import trace_plan, trace_step  # noqa: E402
from trainpipe.plan.trace_vision import VisionTraceError, batch  # noqa: E402

BUILDERS = {"llava": build_tiny_llava, "gemma3": build_tiny_gemma3, "mllama": build_tiny_mllama}
SETUP = Setup(method="lora", precision="fp32", micro_batch=2, seq_len=48, lora_r=4, lora_dropout=0.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_trace")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_fake_vlm_trace_equals_the_real_step_to_the_byte(folders, family):
    fake = trace_step(str(folders[family]), SETUP, steps=2)
    real = trace_step(str(folders[family]), SETUP, steps=2, fake=False)
    assert fake.peak_bytes == real.peak_bytes and fake.step_peaks == real.step_peaks and fake.phase == real.phase


def test_the_batch_has_the_planned_images_and_a_training_tower_costs_more(folders):
    spec = find_model(str(folders["llava"]))
    one = batch(folders["llava"], spec, SETUP)
    two = batch(folders["llava"], spec, replace(SETUP, images_per_example=2))
    assert tuple(one["pixel_values"].shape) == (2, 3, 28, 28) and tuple(two["pixel_values"].shape) == (4, 3, 28, 28)
    assert one["input_ids"].shape == (2, 48) and int((one["labels"] == -100).sum()) == 2 * 4  # 4 image tokens a row, masked
    frozen = trace_step(spec, SETUP, steps=2).peak_bytes
    trains = trace_step(spec, replace(SETUP, freeze_vision=False), steps=2, fake=False).peak_bytes
    assert trains == trace_step(spec, replace(SETUP, freeze_vision=False), steps=2).peak_bytes > frozen


def test_cli_plan_trace_runs_a_vlm_step(folders, capsys):
    args = ["plan", "--model", str(folders["llava"]), "--gpu", "A100-80GB", "--set", "data.max_length=48",
            "--set", "training.per_device_train_batch_size=2", "--trace", "--json"]
    assert main(args) == 0
    t = json.loads(capsys.readouterr().out)["trace"]
    assert t["traced"] and t["trace_peak_bytes"] > 0 and abs(t["difference_pct"]) < 25


def test_a_family_whose_forward_reads_values_is_one_paragraph(tmp_path):
    folder = build_tiny_llava_next(tmp_path / "next")
    with pytest.raises(VisionTraceError) as e:
        trace_step(str(folder), SETUP, steps=1)
    assert "LLaVA-NeXT" in str(e.value) and "\n" not in str(e.value)
    plan = {"setup": {"method": "lora", "precision": "fp32", "micro_batch": 2, "seq_len": 48}, "model": {"id": str(folder)}, "memory": {}}
    out = trace_plan(plan)
    assert out["traced"] is False and "fake-tensor trace" in out["reason"]
