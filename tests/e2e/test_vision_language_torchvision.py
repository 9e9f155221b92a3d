"""Vision-language families whose processors need torchvision (they build a video processor), in the vision environment
(scripts/vision_venv.sh: torch 2.14.1 + torchvision 0.29.1; tests/vision_env.py): a tiny random Qwen2-VL, Qwen2.5-VL and
SmolVLM (Idefics3's architecture), each built from a config with a tiny processor and a trained tiny tokenizer
(tests/vlm_tiny.py), trained through `trainpipe run` on LLaMA-Factory's multimodal layout as it comes: the loss falls, the
image tokens carry no loss and only the answer does, the data report counts the images and their tokens (Qwen2-VL's vary
with the image's size between its min and max pixels: a 28x28 image is 1 token, a 56x56 one 4), and the export loads with
plain `AutoModelForImageTextToText` + `AutoProcessor` and generates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vision_env import run_vision, trainpipe, vision_python  # noqa: E402,F401  (vision_python is a fixture)
from vlm_tiny import shape_records, write_jsonl  # noqa: E402

pytestmark = pytest.mark.e2e

BUILDERS = {"qwen2_vl": "build_tiny_qwen2vl(path)", "qwen2_5_vl": "build_tiny_qwen2vl(path, version='2.5')", "smolvlm": "build_tiny_smolvlm(path)"}
TOKENS_PER_IMAGE = {"qwen2_vl": {28: 1, 56: 4}, "qwen2_5_vl": {28: 1, 56: 4}, "smolvlm": {28: 4, 56: 4}}  # SmolVLM resizes to 28

BUILD_AND_CHECK_LABELS = """
import json, sys
from pathlib import Path
from transformers import AutoProcessor
import vlm_tiny
from trainpipe.data import vision_chat
folder, data = sys.argv[1], Path(sys.argv[2])
path = folder
vlm_tiny.%s
proc = AutoProcessor.from_pretrained(folder)
rec = json.loads(data.read_text().splitlines()[0])
ex = vision_chat.attach({"messages": rec["messages"]}, rec["images"], str(data))
row, why = vision_chat.encode(proc, ex, train_on="assistant", max_length=256, min_tokens=1)
image_ids = vision_chat.image_token_ids(proc)
ids, labels = row["input_ids"], row["labels"]
print(json.dumps({"image_tokens": row["image_tokens"], "image_labels": [l for t, l in zip(ids, labels) if t in image_ids],
                  "answer": proc.tokenizer.decode([l for l in labels if l != -100]), "reply": rec["messages"][1]["content"],
                  "n": len(ids)}))
"""

GENERATE = """
import json, sys
sys.path.insert(0, sys.argv[2])
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_tiny import QUESTION, draw
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1])
proc = AutoProcessor.from_pretrained(sys.argv[1])
text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                tokenize=False, add_generation_prompt=True)
batch = proc(text=[text], images=[draw("red", "square", 7)], return_tensors="pt")
out = model.generate(**batch, max_new_tokens=3, do_sample=False)
print(json.dumps({"prompt": batch["input_ids"].shape[1], "out": out.shape[1], "model": type(model).__name__,
                  "text": proc.tokenizer.decode(out[0, batch["input_ids"].shape[1]:])}))
"""


def _data(tmp: Path, n: int = 48) -> tuple[Path, list[int]]:
    """``n`` shape conversations in LLaMA-Factory's layout; every third image enlarged to 56x56 (the others 28x28); the
    second conversation shows two images (the first's, then its own: a batch's examples hold different numbers of
    images). Returns the data file and the size of every image shown, in order."""
    from PIL import Image

    recs = shape_records(tmp / "data", n)
    for i, r in enumerate(recs):
        if i % 3 == 2:
            p = tmp / "data" / r["images"][0]
            Image.open(p).resize((56, 56)).save(p)
    recs[1]["images"] = [recs[0]["images"][0], *recs[1]["images"]]
    recs[1]["messages"][0]["content"] = "<image>" + recs[1]["messages"][0]["content"]
    sizes = [Image.open(tmp / "data" / name).width for r in recs for name in r["images"]]
    return write_jsonl(tmp / "data" / "shapes.jsonl", recs), sizes


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm", "qwen2_5_vl"])
def test_tiny_vlm_trains_masks_image_tokens_counts_them_and_its_export_generates(tmp_path, vision_python, family):
    base = tmp_path / "base"
    data, sizes = _data(tmp_path)

    # the tiny model and processor; the labels of one conversation: image tokens never carry loss, only the reply (and its
    # end-of-turn token) does
    proc = run_vision(vision_python, ["-c", BUILD_AND_CHECK_LABELS % BUILDERS[family], str(base), str(data)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["image_tokens"] == TOKENS_PER_IMAGE[family][28] and got["image_labels"] == [-100] * got["image_tokens"]
    assert got["answer"].startswith(got["reply"]) and got["answer"].replace(got["reply"], "", 1).strip() in ("<|im_end|>", "")

    steps = 12
    cfg = {"model": {"name_or_path": str(base)},
           "data": {"sources": [{"path": str(data)}], "eval_split": 8, "max_length": 64},
           "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
           "training": {"max_steps": steps, "eval_steps": steps, "logging_steps": steps // 2, "per_device_train_batch_size": 8,
                        "gradient_accumulation_steps": 1, "learning_rate": 5e-3, "early_stopping_patience": None},
           "eval": {"metrics": ["loss", "exact_match"], "max_new_tokens": 3}, "gates": {"on_fail": "warn"}, "output_dir": str(tmp_path / "run")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = trainpipe(vision_python, "run", str(tmp_path / "run.yaml"), timeout=400).stdout
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    print(f"\n{family}: eval loss {s['baseline']['loss']:.3f} -> {s['final']['loss']:.3f} in {steps} LoRA steps")
    assert s["final"]["loss"] < s["baseline"]["loss"] - 0.2, (s["baseline"], s["final"])
    assert "LoRA on" in out and "vision tower and projector stay frozen" in out

    # every record and image accounted for; the image tokens counted by each image's own size
    report = json.loads((run / "data_report.json").read_text())
    assert report["records_read"] == 48
    splits = report["splits"]
    assert splits["train"]["images"] + splits["eval"]["images"] == 49 and splits["eval"]["records"] == 8
    per = TOKENS_PER_IMAGE[family]
    want = sum(per[v] for v in sizes)
    assert splits["train"]["image_tokens"] + splits["eval"]["image_tokens"] == want, (splits, want)

    # the export: plain transformers loads the merged model and its processor, and generates from an image
    proc = run_vision(vision_python, ["-c", GENERATE, str(run / "model"), str(Path(__file__).resolve().parents[1])], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gen["out"] > gen["prompt"] and gen["model"].endswith("ForConditionalGeneration"), gen
    assert (run / "model" / "adapter" / "adapter_config.json").is_file()
