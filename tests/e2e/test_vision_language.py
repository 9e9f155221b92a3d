"""Vision-language fine-tuning end to end through the CLI on a tiny LLaVA built in the test (tests/vlm_tiny.py):
LLaMA-Factory's multimodal layout trains as it comes, the loss falls, the vision tower and projector stay frozen by
default (LoRA and full fine-tune) and train with `method.freeze_vision: false`, and the export loads with plain
transformers' `AutoModelForImageTextToText` + `AutoProcessor` and generates; QLoRA and DPO on pairs sharing an image train."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_tiny import QUESTION, build_tiny_gemma3, build_tiny_llava, draw, shape_records, write_jsonl  # noqa: E402

from trainpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


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

    _report_shows_thumbnails(run, tmp)

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


def _report_shows_thumbnails(run: Path, data_dir: Path) -> None:
    """report.html shows each shown sample's image as a small JPEG data URI beside the prompt, reference, base and trained
    answers; no data path or image file name gets into the page; it renders in headless Chromium with every image decoded."""
    import base64
    import io
    import re

    from PIL import Image

    summary = json.loads((run / "summary.json").read_text())
    html = (run / "report.html").read_text()
    shown = summary["samples"][:10]
    srcs = re.findall(r'<img class="thumb" src="([^"]+)"', html)
    assert len(srcs) == len(shown) == 10 and all(s.startswith("data:image/jpeg;base64,") for s in srcs)
    for src in srcs:
        raw = base64.b64decode(src.split(",", 1)[1])
        assert len(raw) < 4_000 and max(Image.open(io.BytesIO(raw)).size) <= 96
    assert "<th>image</th><th>prompt</th><th>reference</th><th>base model</th><th>trained</th>" in html
    section = html.split('<h2 id="samples">', 1)[1].split("<h2", 1)[0]
    assert str(data_dir) not in section and "images/" not in section and ".png" not in section  # no path, no file name
    assert "images/0_" not in html  # the image files are named nowhere in the page (the config names the data file only)
    chromium = CHROMIUM
    if chromium:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page()
            errors: list = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto((run / "report.html").as_uri())
            widths = page.eval_on_selector_all("img.thumb", "els => els.map(e => [e.complete, e.naturalWidth, e.getBoundingClientRect().width])")
            page.screenshot(path=str(run.parent / f"{run.name}_report.png"), full_page=True)
            browser.close()
        assert errors == [] and len(widths) == 10 and all(ok and 0 < natural <= 96 and 0 < drawn <= 96 for ok, natural, drawn in widths)


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


def test_kto_with_images_rewards_the_right_colour(base, capsys):
    from vlm_tiny import shape_kto

    tmp, model_dir = base
    write_jsonl(tmp / "kto" / "kto.jsonl", shape_kto(tmp / "kto", 64))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": str(tmp / "kto" / "kto.jsonl")}], "eval_split": 16, "max_length": 64},
        "method": {"name": "kto", "peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "preference": {"beta": 0.5}},
        "training": {"max_steps": 12, "eval_steps": 6, "logging_steps": 6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "gates": {"on_fail": "warn"}, "output_dir": str(tmp / "kto_run"),
    }
    (tmp / "kto.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "kto.yaml")]) == 0
    report = json.loads((tmp / "kto_run" / "data_report.json").read_text())
    assert report["sources"][0]["format"] == "kto" and report["splits"]["train"]["images"] == report["splits"]["train"]["records"] == 48
    summary = json.loads((tmp / "kto_run" / "summary.json").read_text())
    b, f = summary["baseline"], summary["final"]
    with capsys.disabled():
        print(f"\nVLM KTO: loss {b['loss']:.4f} -> {f['loss']:.4f}, rewards desirable {f['rewards_desirable']:.3f} vs undesirable "
              f"{f['rewards_undesirable']:.3f}, accuracy {b['accuracy']:.3f} -> {f['accuracy']:.3f}")
    # 0.5 at the start (policy = reference: every reward 0) -> 0.480 measured; the right colour gains more than the wrong one
    assert f["loss"] < b["loss"] - 0.01 and b["reward_ties"] == 1.0
    assert f["rewards_desirable"] > f["rewards_undesirable"] + 0.05 and f["accuracy"] > b["accuracy"] + 0.2

    # a KTO record whose `<image>` placeholders do not match its images: one paragraph naming the file and line, exit 2
    recs = shape_kto(tmp / "kto_bad", 8)
    recs[3]["images"] = recs[3]["images"] * 2
    write_jsonl(tmp / "kto_bad" / "kto.jsonl", recs)
    bad = {**cfg, "data": {**cfg["data"], "sources": [{"path": str(tmp / "kto_bad" / "kto.jsonl")}], "eval_split": 2},
           "output_dir": str(tmp / "kto_bad_run")}
    (tmp / "kto_bad.yaml").write_text(yaml.safe_dump(bad))
    capsys.readouterr()
    assert main(["run", str(tmp / "kto_bad.yaml")]) == 2
    err = capsys.readouterr()
    text = " ".join((err.out + err.err).split())
    assert "kto.jsonl" in text and "line 4" in text and "1 `<image>` placeholder(s)" in text and "2 image(s)" in text
    assert "Traceback" not in err.out + err.err
