"""timm image classifiers end to end, in the vision environment (scripts/vision_venv.sh: torch 2.14.1 + torchvision 0.29.1 +
timm; PyPI's torchvision does not import beside the main environment's torch, and timm needs it). trainpipe runs there as a
subprocess with this clone's sources (tests/vision_env.py).

- `model.name_or_path: timm/test_resnet.r160_in1k` with `model.args.pretrained: false` (random weights: the hub is not
  reachable here) and timm's own data config overlaid to 16x16 learns scikit-learn's digits far above the trivial
  predictor; the export is timm's own folder (`config.json` + `model.safetensors`) that `timm.create_model("local-dir:...")`
  loads and that predicts, image by image, what the run's final eval measured; `trainpipe predict` on it agrees.
- a local folder timm wrote (`save_for_hf`) with a 3-class head trains with a new head of the 10 classes found, with the
  train-only augmentation on.
- the augmentation through torchvision's transforms v2 equals the Pillow fallback the main environment uses, pixel for
  pixel, and so do the eval pixels.
- an architecture timm does not know is one paragraph and exit 2.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vision_env import run_vision, trainpipe, vision_python  # noqa: E402,F401  (vision_python is a fixture)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OVERLAY = {"input_size": [3, 16, 16], "crop_pct": 1.0}  # timm's data config: resize the 8x8 digits to 16x16, no crop


def digits_folder(root: Path, per_class: int) -> Path:
    """The first ``per_class`` digits of each class as an image folder (root/<digit>/<n>.png)."""
    spec = importlib.util.spec_from_file_location("make_digits", REPO / "examples" / "image-classification" / "make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen: dict[str, int] = {}
    for i, (data, label) in enumerate(mod.digit_pngs()):
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            (root / label).mkdir(parents=True, exist_ok=True)
            (root / label / f"{i:04d}.png").write_bytes(data)
    return root


def write_config(tmp: Path, model: dict, data: Path, augment: bool = False, **training) -> Path:
    cfg = {"name": "timm", "output_dir": str(tmp / "run"), "model": {"family": "image", **model},
           "data": {"sources": [{"path": str(data)}], "eval_split": 0.2, "augment": augment},
           "training": {"learning_rate": 1e-2, "num_train_epochs": 3, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1,
                        "eval_steps": 1000, "logging_steps": 10, "seed": 0, **training},
           "gates": {"on_fail": "warn"}}
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


PREDICT_WITH_TIMM = """
import io, json, sys
import timm, torch
from PIL import Image
folder, images = sys.argv[1], json.load(open(sys.argv[2]))
model = timm.create_model("local-dir:" + folder, pretrained=True).eval()
cfg = timm.data.resolve_data_config({}, model=model)
tf = timm.data.create_transform(**cfg)
x = torch.stack([tf(Image.open(p).convert("RGB")) for p in images])
with torch.no_grad():
    idx = model(x).argmax(-1).tolist()
names = model.pretrained_cfg["label_names"]
print(json.dumps({"pred": [names[i] for i in idx], "num_classes": model.num_classes, "input_size": list(cfg["input_size"])}))
"""


def test_timm_hub_name_learns_digits_and_its_timm_export_predicts_what_the_final_eval_measured(tmp_path, vision_python):
    from trainpipe.config import load_config
    from trainpipe.data.images import prepare_images

    data = digits_folder(tmp_path / "digits", per_class=30)
    config = write_config(tmp_path, {"name_or_path": "timm/test_resnet.r160_in1k", "args": {"pretrained": False, "pretrained_cfg_overlay": OVERLAY}},
                          data)
    trainpipe(vision_python, "run", str(config), timeout=300)
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    print(f"\ntimm test_resnet on digits: trivial accuracy {s['baseline']['accuracy']:.3f}, untrained {s['untrained']['accuracy']:.3f}, "
          f"final {s['final']['accuracy']:.3f} ({sum(map(sum, s['task_report']['confusion']['matrix']))} held out)")
    assert s["baseline"]["accuracy"] <= 0.15 and s["final"]["accuracy"] >= 0.7, s["final"]

    # timm's own folder: config.json (architecture, the 10 classes' names, the overlaid data config) + model.safetensors
    conf = json.loads((run / "model" / "config.json").read_text())
    assert conf["architecture"] == "test_resnet" and conf["num_classes"] == 10 and conf["label_names"] == s["classes"]
    assert (run / "model" / "model.safetensors").is_file() and not list((run / "model").glob("*.bin"))

    # the same eval split (the config and the seed), classified by plain timm from the export, image by image
    ev = prepare_images(load_config(config).data, seed=0).eval
    folder = tmp_path / "eval_images"
    folder.mkdir()
    paths = []
    for i, x in enumerate(ev):
        paths.append(folder / f"{i:03d}.png")
        paths[-1].write_bytes(x["image"])
    (tmp_path / "images.json").write_text(json.dumps([str(p) for p in paths]))
    proc = run_vision(vision_python, ["-c", PREDICT_WITH_TIMM, str(run / "model"), str(tmp_path / "images.json")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["num_classes"] == 10 and got["input_size"] == [3, 16, 16]
    classes = s["task_report"]["confusion"]["classes"]
    matrix = [[0] * len(classes) for _ in classes]
    for x, y in zip(ev, got["pred"]):
        matrix[classes.index(x["label"])][classes.index(y)] += 1
    assert matrix == s["task_report"]["confusion"]["matrix"]  # every eval image classified as the run's final eval did

    # `trainpipe predict RUN --data FOLDER` loads the timm export the same way
    trainpipe(vision_python, "predict", str(run), "--data", str(folder), "--out", str(tmp_path / "pred.csv"), timeout=120)
    rows = (tmp_path / "pred.csv").read_text().splitlines()[1:]
    assert [r.split(",")[1] for r in rows] == got["pred"]


BUILD_TIMM_FOLDER = """
import sys, timm, torch
torch.manual_seed(0)
m = timm.create_model("test_resnet", pretrained=False, num_classes=3, pretrained_cfg_overlay={"input_size": (3, 16, 16), "crop_pct": 1.0})
timm.models.save_for_hf(m, sys.argv[1], model_config={"label_names": ["a", "b", "c"]}, safe_serialization=True)
"""


def test_a_local_timm_folder_gets_a_new_head_of_the_classes_found_and_trains_with_augmentation(tmp_path, vision_python):
    base = tmp_path / "base"
    proc = run_vision(vision_python, ["-c", BUILD_TIMM_FOLDER, str(base)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((base / "config.json").read_text())["num_classes"] == 3
    data = digits_folder(tmp_path / "digits", per_class=20)
    config = write_config(tmp_path, {"name_or_path": str(base)}, data, augment=True, num_train_epochs=2, per_device_train_batch_size=16)
    out = trainpipe(vision_python, "run", str(config), timeout=300).stdout
    assert "augmentation on (training only)" in out
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    conf = json.loads((run / "model" / "config.json").read_text())
    assert conf["architecture"] == "test_resnet" and conf["num_classes"] == 10 and conf["label_names"] == s["classes"]
    assert conf["pretrained_cfg"]["input_size"] == [3, 16, 16]  # the base folder's own data config, kept
    assert s["train"]["global_step"] > 0 and s["final"]["loss"] < s["untrained"]["loss"]


SAME_PIXELS = """
import io, json, torch
import numpy as np
from PIL import Image
from transformers import ViTImageProcessor
from trainpipe.data import image_transforms as it
assert it.torchvision_v2() is not None
digits = json.loads(open(__import__("sys").argv[1]).read())
images = [Image.open(p).convert("RGB").resize((24, 20)) for p in digits]
proc = ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
examples = [{"image": open(p, "rb").read(), "index": i} for i, p in enumerate(digits)]
def run():
    crops = [np.asarray(it.augment(im, it.example_seed(3, w, i))) for w in range(3) for i, im in enumerate(images)]
    return crops, it.pixel_values(proc, examples, augment_seed=(3, 1)), it.pixel_values(proc, examples)
with_v2 = run()
it.torchvision_v2 = lambda: None  # the main environment's path: Pillow
with_pil = run()
same = all(np.array_equal(a, b) for a, b in zip(with_v2[0], with_pil[0]))
flipped = sum(1 for a, im in zip(with_v2[0], images * 3) if a.shape != np.asarray(im).shape)
print(json.dumps({"crops": len(with_v2[0]), "same_crops": same, "cropped": flipped, "train_equal": bool(torch.equal(with_v2[1], with_pil[1])),
                  "eval_equal": bool(torch.equal(with_v2[2], with_pil[2]))}))
"""


def test_torchvision_v2_augmentation_and_eval_pixels_equal_the_pillow_fallback(tmp_path, vision_python):
    data = digits_folder(tmp_path / "digits", per_class=2)
    (tmp_path / "list.json").write_text(json.dumps([str(p) for p in sorted(data.rglob("*.png"))]))
    proc = run_vision(vision_python, ["-c", SAME_PIXELS, str(tmp_path / "list.json")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["crops"] == 60 and got["cropped"] > 30  # most draws really crop (60-100 % of the area)
    assert got["same_crops"] and got["train_equal"] and got["eval_equal"], got


def test_an_architecture_timm_does_not_know_is_one_paragraph_and_exit_2(tmp_path, vision_python):
    data = digits_folder(tmp_path / "digits", per_class=3)
    config = write_config(tmp_path, {"name_or_path": "timm/no_such_net", "args": {"pretrained": False}}, data)
    proc = run_vision(vision_python, ["-m", "trainpipe.cli", "run", str(config)], timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "timm cannot build `model.name_or_path` `timm/no_such_net`" in out and "Unknown model" in out and "Traceback" not in out
