"""The planner's memory model for vision-language models (plan/vision.py `tower_memory`) and the VLM catalogue: the
tower's activations scale with the patches the processor's resolution settings make (Qwen2-VL's max_pixels), a frozen
tower saves none, checkpointing keeps one input a layer, and the catalogued VLMs add up to their published sizes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main
from trainpipe.plan.catalog import find_model
from trainpipe.plan.memory import Setup, estimate
from trainpipe.plan.vision import tower_memory

# Qwen2-VL-7B-Instruct's config.json as the hub has it (flat: the text decoder's keys beside `vision_config`), transcribed
QWEN2_VL_7B = {
    "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}
# published totals (the hub's model pages, transcribed): text decoder + tower + projector
PUBLISHED_B = {"Qwen/Qwen2-VL-2B-Instruct": 2.21, "Qwen/Qwen2-VL-7B-Instruct": 8.29, "Qwen/Qwen2.5-VL-3B-Instruct": 3.75,
               "Qwen/Qwen2.5-VL-7B-Instruct": 8.29, "google/gemma-3-4b-it": 4.30, "llava-hf/llava-1.5-7b-hf": 7.06,
               "llava-hf/llava-v1.6-mistral-7b-hf": 7.57, "HuggingFaceTB/SmolVLM-256M-Instruct": 0.256,
               "HuggingFaceTB/SmolVLM2-2.2B-Instruct": 2.25, "meta-llama/Llama-3.2-11B-Vision-Instruct": 10.67}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_B))
def test_catalogued_vlms_add_up_to_their_published_size_and_name_their_source(model_id):
    spec = find_model(model_id)
    v = spec.vision
    assert v and "transcribed" in v["source"] and v["rule"] and v["tokens_per_image"] >= 1 and v["patches_per_image"] >= 1
    assert all(v[k] > 0 for k in ("params", "layers", "hidden", "intermediate", "heads", "patch"))
    total = (spec.total_params + v["params"]) / 1e9
    assert abs(total - PUBLISHED_B[model_id]) / PUBLISHED_B[model_id] < 0.03, total


def _qwen_run(tmp: Path, max_pixels: int, freeze_vision: bool) -> dict:
    folder = tmp / f"qwen_{max_pixels}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_VL_7B))
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2,
                                                                 "temporal_patch_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}))
    cfg = {"model": {"name_or_path": str(folder)}, "data": {"sources": [{"path": "d.jsonl"}], "max_length": 2048},
           "method": {"peft": "lora", "freeze_vision": freeze_vision}, "training": {"per_device_train_batch_size": 1, "gradient_checkpointing": False}}
    path = tmp / f"run_{max_pixels}_{freeze_vision}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan_json(capsys, path: Path) -> dict:
    assert main(["plan", str(path), "--gpu", "H100", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen2_vl_7b_plans_less_memory_at_lower_max_pixels(tmp_path, capsys):
    high = _plan_json(capsys, _qwen_run(tmp_path, 1280 * 28 * 28, freeze_vision=False))
    low = _plan_json(capsys, _qwen_run(tmp_path, 256 * 28 * 28, freeze_vision=False))
    hv, lv = (p["memory"]["detail"]["activations"]["vision"] for p in (high, low))
    assert hv["patches"] == 1280 * 4 and lv["patches"] == 256 * 4  # each token merges 2 x 2 patches
    assert hv["saved"] == 5 * lv["saved"] == 5 * 256 * 4 * (8 * 1280 + 2 * 5120) * 2 * 32  # every layer's values for every patch
    assert low["memory"]["per_device"]["total_bytes"] < high["memory"]["per_device"]["total_bytes"]
    assert any("up to 1280 image tokens per image" in n for n in high["notes"]) and any("up to 256 image tokens" in n for n in low["notes"])
    # frozen (the default): nothing saved for the backward pass, whatever max_pixels says; never more memory at the lower setting
    fh, fl = (_plan_json(capsys, _qwen_run(tmp_path, mp, freeze_vision=True)) for mp in (1280 * 28 * 28, 256 * 28 * 28))
    assert fh["memory"]["detail"]["activations"]["vision"]["saved"] == 0
    assert fl["memory"]["per_device"]["total_bytes"] <= fh["memory"]["per_device"]["total_bytes"] < high["memory"]["per_device"]["total_bytes"]


def test_tower_memory_rules():
    spec = find_model("llava-hf/llava-1.5-7b-hf")
    s = Setup(method="lora", precision="bf16", micro_batch=2, seq_len=1024, freeze_vision=False)
    v = tower_memory(spec.vision, s)
    per_layer = 2 * 577 * (8 * 1024 + 2 * 4096) * 2  # micro-batch x patches x (8 hidden + 2 MLP width) x 2 bytes
    assert v["saved"] == per_layer * 24 and v["transient"] == per_layer and v["weights"] == spec.vision["params"] * 2
    ck = tower_memory(spec.vision, replace(s, grad_ckpt=True))
    assert ck["saved"] == 2 * 577 * 1024 * 2 * 24 + per_layer < v["saved"]
    frozen = tower_memory(spec.vision, replace(s, freeze_vision=True))
    assert frozen["saved"] == frozen["gradients"] == frozen["optimizer"] == 0 and frozen["weights"] == spec.vision["params"] * 2
    full = tower_memory(spec.vision, replace(s, method="full"))
    assert full["trainable"] == spec.vision["params"] and full["optimizer"] == 8 * spec.vision["params"]
    # the estimate carries it: a training tower costs more than a frozen one, two images more than one
    b = [estimate(spec, x).total_bytes for x in (replace(s, freeze_vision=True), s, replace(s, images_per_example=2))]
    assert b[0] < b[1] < b[2]
