"""Vision-language fine-tuning end to end through the CLI on a tiny LLaVA built in the test (tests/vlm_tiny.py):
LLaMA-Factory's multimodal layout trains as it comes, the loss falls, the vision tower and projector stay frozen by
default (LoRA and full fine-tune) and train with `method.freeze_vision: false`, and the export loads with plain
transformers' `AutoModelForImageTextToText` + `AutoProcessor` and generates; QLoRA and DPO on pairs sharing an image train."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_tiny import QUESTION, build_tiny_gemma3, build_tiny_llava, draw, shape_records, write_jsonl  # noqa: E402

from trainpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e


def _run(tmp: Path, base: Path, name: str, steps: int = 12, **method) -> Path:
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": str(tmp / "data" / "shapes.jsonl")}], "eval_split": 12, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **method},
        "training": {"max_steps": steps, "eval_steps": steps // 2, "logging_steps": steps // 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss", "exact_match"], "max_new_tokens": 3}, "gates": {"on_fail": "warn"},
        "output_dir": str(tmp / name),
    }
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / f"{name}.yaml")]) == 0
    return tmp / name


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _split(weights: dict) -> tuple[dict, dict]:
    lang = {k: v for k, v in weights.items() if "language_model." in k or "lm_head" in k}
    return lang, {k: v for k, v in weights.items() if k not in lang}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    write_jsonl(tmp / "data" / "shapes.jsonl", shape_records(tmp / "data", 72))
    return tmp


@pytest.fixture(scope="module")
def base(data_dir):
    return data_dir, build_tiny_llava(data_dir / "llava")


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_lora_trains_the_language_model_only_and_the_export_generates(data_dir, family):
    tmp = data_dir
    model_dir = (build_tiny_llava if family == "llava" else build_tiny_gemma3)(tmp / f"{family}_base")
    run = _run(tmp, model_dir, f"lora_{family}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.3
    # the held-out answers are generated from the images (the processor batches them) before and after training
    assert summary["metric_examples"]["exact_match"] == 12 and 0.0 <= summary["final"]["exact_match"] <= 1.0
    assert all(isinstance(x["prediction"], str) and x["reference"] in ("red", "green", "blue", "yellow") for x in summary["samples"])
    report = json.loads((run / "data_report.json").read_text())
    assert report["records_read"] == 72 and report["splits"]["train"]["images"] == report["splits"]["train"]["records"]
    lang0, vis0 = _split(_weights(model_dir))
    lang1, vis1 = _split(_weights(run / "model"))
    assert all((vis0[k] == vis1[k]).all() for k in vis0)  # tower and projector frozen (`method.freeze_vision: true`)
    assert any(not (lang0[k] == lang1[k]).all() for k in lang0 if "layers" in k)
    adapter = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
    assert all(".language_model." in t for t in adapter["target_modules"])

    card = (run / "model" / "README.md").read_text()
    assert "## Images" in card and ("Llava" if family == "llava" else "Gemma3") in card and "- size:" in card

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(run / "model")
    proc = AutoProcessor.from_pretrained(run / "model")
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                    tokenize=False, add_generation_prompt=True)
    batch = proc(text=[text], images=[draw("red", "square", 7)], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3 or int(out[0, -1]) in model.generation_config.eos_token_id


def test_full_fine_tune_freezes_the_tower_unless_asked(base):
    tmp, model_dir = base
    frozen = _run(tmp, model_dir, "full", steps=4, peft="none")
    free = _run(tmp, model_dir, "full_free", steps=4, peft="none", freeze_vision=False)
    _, vis0 = _split(_weights(model_dir))
    _, vis_frozen = _split(_weights(frozen / "model"))
    _, vis_free = _split(_weights(free / "model"))
    assert all((vis0[k] == vis_frozen[k]).all() for k in vis0)
    assert any(not (vis0[k] == vis_free[k]).all() for k in vis0 if "multi_modal_projector" in k)


def test_qlora_on_a_4bit_vision_language_base(base):
    pytest.importorskip("bitsandbytes")
    tmp, model_dir = base
    run = _run(tmp, model_dir, "qlora", steps=8, peft="qlora")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.2
    adapter = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_modules"] and all(".language_model." in t for t in adapter["target_modules"])


def test_dpo_with_images_prefers_the_right_colour(base):
    from vlm_tiny import shape_pairs

    tmp, model_dir = base
    write_jsonl(tmp / "pairs" / "pairs.jsonl", shape_pairs(tmp / "pairs", 64))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": str(tmp / "pairs" / "pairs.jsonl")}], "eval_split": 12, "max_length": 64},
        "method": {"name": "dpo", "peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "preference": {"beta": 0.5}},
        "training": {"max_steps": 10, "eval_steps": 5, "logging_steps": 5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "gates": {"on_fail": "warn"}, "output_dir": str(tmp / "dpo"),
    }
    (tmp / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "dpo.yaml")]) == 0
    report = json.loads((tmp / "dpo" / "data_report.json").read_text())
    assert report["sources"][0]["format"] == "preference" and report["splits"]["train"]["images"] == report["splits"]["train"]["records"]
    summary = json.loads((tmp / "dpo" / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.03  # 0.693 (policy = reference) -> 0.627 measured
    assert summary["final"]["reward_accuracy"] > 0.6 > summary["baseline"]["reward_accuracy"]
