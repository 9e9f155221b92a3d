"""The planner on vision-language models (plan/vision.py): image tokens per image from the processor's settings, their
share of `data.max_length`, the advice with its rule, and a plan of the shipped example that sizes the text decoder."""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe.cli import main
from trainpipe.plan.vision import image_tokens, notes, text_part

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vision-language"


def _qwen_folder(tmp_path: Path, max_pixels: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_vl", "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "depth": 32},
        "text_config": {"model_type": "qwen2_vl_text", "hidden_size": 1536}}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2}))
    return tmp_path


def test_qwen2_vl_tokens_follow_max_pixels_and_the_advice_says_lower_it(tmp_path):
    folder = _qwen_folder(tmp_path, 1003520)  # Qwen2-VL's default: 1280 tokens at most
    assert image_tokens(folder)[0] == 1280 and "max_pixels 1003520" in image_tokens(folder)[1]
    said = notes(folder, max_length=2048, freeze_vision=True, peft="lora", grad_ckpt=False)
    assert "up to 1280 image tokens per image" in said[0] and "62%" in said[0]
    assert any("lower the processor's `max_pixels`" in n and "rule:" in n for n in said)
    assert not any("freeze_vision" in n for n in said)


def test_a_training_tower_gets_the_freeze_and_checkpointing_advice(tmp_path):
    folder = _qwen_folder(tmp_path, 200704)  # 256 tokens
    said = notes(folder, max_length=4096, freeze_vision=False, peft="none", grad_ckpt=False)
    assert not any("max_pixels`" in n for n in said)
    assert any("keep it frozen" in n for n in said) and any("gradient_checkpointing: true" in n and "256 image tokens" in n for n in said)
    assert not any("gradient_checkpointing" in n for n in notes(folder, max_length=4096, freeze_vision=False, peft="none", grad_ckpt=True))


def test_text_models_have_no_vision_notes_and_vlm_configs_plan_their_text_decoder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert notes(tmp_path, max_length=512, freeze_vision=True, peft="lora", grad_ckpt=False) == []
    assert text_part("llava", {"vision_config": {}, "text_config": {"hidden_size": 64}}) == ("llama", {"hidden_size": 64})
    assert text_part("llama", {"hidden_size": 64}) is None


def test_plan_of_the_example_sizes_the_text_decoder_and_names_the_images(capsys):
    assert main(["plan", str(EXAMPLE / "run.yaml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "could not size" not in out and "text decoder is sized" in out
    assert "up to 4 image tokens per image" in out and "tower and projector hold 33,952 parameters" in out and "memory per device" in out
