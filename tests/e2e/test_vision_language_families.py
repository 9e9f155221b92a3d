"""LLaVA-NeXT, Llama 3.2 Vision (mllama) and Idefics3 trained end to end through `trainpipe run`, each a tiny random
model with a tiny processor built in the test (tests/vlm_tiny_families.py), on shapes drawn at three sizes so that
LLaVA-NeXT's anyres, mllama's aspect-ratio tiles and Idefics3's tiles vary within a batch: the loss falls, only the
answers carry loss (image tokens masked), the vision tower stays frozen, and the export loads with plain
transformers' `AutoModelForImageTextToText` + `AutoProcessor` and generates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_tiny import QUESTION, write_jsonl  # noqa: E402
from vlm_tiny_families import build_tiny_idefics3, build_tiny_llava_next, build_tiny_mllama, draw_sized, shape_records_sized  # noqa: E402

from trainpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e

BUILDERS = {"llava_next": build_tiny_llava_next, "mllama": build_tiny_mllama, "idefics3": build_tiny_idefics3}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_families")
    write_jsonl(tmp / "data" / "shapes.jsonl", shape_records_sized(tmp / "data", 48))
    return tmp


def _run(tmp: Path, base: Path, name: str, steps: int = 12) -> Path:
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": str(tmp / "data" / "shapes.jsonl")}], "eval_split": 8, "max_length": 128},
        "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "training": {"max_steps": steps, "eval_steps": steps, "logging_steps": steps // 2, "per_device_train_batch_size": 6,
                     "gradient_accumulation_steps": 1, "learning_rate": 1e-2, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]}, "gates": {"on_fail": "warn"},
        "output_dir": str(tmp / name),
    }
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / f"{name}.yaml")]) == 0
    return tmp / name


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_family_trains_through_run_and_the_export_generates(data_dir, family):
    base = BUILDERS[family](data_dir / f"{family}_base")
    run = _run(data_dir, base, family)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.3, (summary["baseline"], summary["final"])
    report = json.loads((run / "data_report.json").read_text())
    train = report["splits"]["train"]
    assert report["records_read"] == 48 and train["images"] == train["records"] and train["image_tokens"] >= train["images"]
    w0, w1 = _weights(base), _weights(run / "model")
    lang = [k for k in w0 if any(p in k for p in ("language_model.", "text_model.", "lm_head"))]  # Idefics3 calls it `text_model`
    tower = [k for k in w0 if k not in lang]
    assert tower and all((w0[k] == w1[k]).all() for k in tower)  # `method.freeze_vision: true`: tower and projector as they were
    assert any(not (w0[k] == w1[k]).all() for k in lang if "layers" in k)

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(run / "model")
    proc = AutoProcessor.from_pretrained(run / "model")
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                    tokenize=False, add_generation_prompt=True)
    batch = proc(text=[text], images=[[draw_sized("red", "square", 7, (56, 28))]], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    eos = model.generation_config.eos_token_id
    assert out.shape[1] == batch["input_ids"].shape[1] + 3 or int(out[0, -1]) in (eos if isinstance(eos, list) else [eos])
