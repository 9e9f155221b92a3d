"""DeepSpeed ZeRO-2 / ZeRO-3 on the model families of issue 30 (a user's own `nn.Module` and a tiny ViT image classifier):
2 gloo processes x micro-batch b under ZeRO equal 1 process x 2b (plain trainpipe, no DeepSpeed) in the loss of every step
and the final weights, and SIGKILL of every worker after a checkpoint then `--resume` under ZeRO-3 equals the uninterrupted
ZeRO-3 run bit for bit (custom module). The harness is test_distributed.py's; the custom module and its data are
test_custom_module.py's, the ViT and the digits folder test_image_runs.py's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from test_custom_module import write as write_custom
from test_distributed import events, finish, launch, max_diff, newest_weights, wait_for, worker_pids
from test_image_runs import digits_folder, write_config as write_image
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

TOL = 1e-5  # the text models' ZeRO bound (test_deepspeed.py): float sums over 2 partitions in another order


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _with(cfg: Path, **sections) -> Path:
    doc = yaml.safe_load(cfg.read_text())
    for section, values in sections.items():
        doc.setdefault(section, {}).update(values)
    cfg.write_text(yaml.safe_dump(doc))
    return cfg


def _compare(one: Path, two: Path, stage: str, what: str) -> None:
    l1, l2 = _losses(one), _losses(two)
    assert len(l1) == len(l2) >= 4 and l2[-1] < l2[0], (l1, l2)
    loss_diff = max(abs(a - b) for a, b in zip(l1, l2, strict=True))
    diff = max_diff(newest_weights(one), newest_weights(two))
    print(f"\n{what} {stage}: max |loss(2 procs) - loss(1 proc)| = {loss_diff:.2e}, max |w - w| = {diff:.2e}")
    assert loss_diff < TOL and diff < TOL
    man = json.loads((two / "manifest.json").read_text())
    assert man["distributed"]["strategy"] == stage and man["distributed"]["world_size"] == 2
    assert man["distributed"].get("zero_stage") == int(stage[-1])


@pytest.fixture(scope="module")
def custom_one(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("zero_custom_one")
    cfg = write_custom(tmp, "one", **{"model.factory": "net.py:blocks", "training.logging_steps": 1})
    assert main(["run", str(cfg)]) == 0
    return tmp / "one"


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_custom_module_under_zero_equals_one_process(tmp_path, custom_one, stage):
    cfg = write_custom(tmp_path, stage, **{"model.factory": "net.py:blocks", "training.logging_steps": 1,
                                           "training.per_device_train_batch_size": 4})
    _with(cfg, distributed={"strategy": stage})
    rc, out = finish(launch(cfg), timeout=400)
    assert rc == 0, out[-3000:]
    _compare(custom_one, tmp_path / stage, stage, "custom module")
    s = json.loads((tmp_path / stage / "summary.json").read_text())
    assert s["family"] == "custom"


def test_custom_module_zero3_sigkill_after_a_checkpoint_then_resume_is_bit_identical(tmp_path):
    import torch

    def config(name: str, **extra) -> Path:
        cfg = write_custom(tmp_path, name, **{"model.factory": "net.py:blocks", "training.per_device_train_batch_size": 4, **extra})
        return _with(cfg, distributed={"strategy": "zero3"})

    ref = config("ref")
    rc, out = finish(launch(ref), timeout=400)
    assert rc == 0, out[-3000:]
    cfg = config("killed", **{"training.resume": "auto"})
    run = tmp_path / "killed"
    p = launch(cfg, faults={"step_seconds": 0.4})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 4 for e in events(run)), p, timeout=300)
    for pid in worker_pids(p.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not any(e["event"] == "training_finished" for e in events(run))
    rc, out = finish(launch(cfg), timeout=400)
    assert rc == 0, out[-3000:]
    resumed = [e for e in events(run) if e["event"] == "checkpoint_resumed"]
    assert resumed and resumed[-1]["step"] >= 4
    a, b = newest_weights(run), newest_weights(tmp_path / "ref")
    print(f"\ncustom module zero3 resume: max |w(killed + resumed) - w(uninterrupted)| = {max_diff(a, b):.2e}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


@pytest.fixture(scope="module")
def vit_images(tmp_path_factory) -> tuple[Path, Path]:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    base = tmp_path_factory.mktemp("zero_vit") / "base"
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    ViTForImageClassification(cfg).save_pretrained(base, safe_serialization=True)
    ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(base)
    return base, digits_folder(tmp_path_factory.mktemp("zero_digits") / "imgs")


@pytest.fixture(scope="module")
def vit_one(tmp_path_factory, vit_images) -> Path:
    tmp = tmp_path_factory.mktemp("zero_vit_one")
    cfg = write_image(tmp, *vit_images, max_steps=4, eval_steps=4, save_steps=4, logging_steps=1)
    assert main(["run", str(cfg)]) == 0
    return tmp / "run"


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_vit_under_zero_equals_one_process(tmp_path, vit_images, vit_one, stage):
    cfg = write_image(tmp_path, *vit_images, max_steps=4, eval_steps=4, save_steps=4, logging_steps=1, per_device_train_batch_size=4)
    _with(cfg, distributed={"strategy": stage})
    rc, out = finish(launch(cfg), timeout=400)
    assert rc == 0, out[-3000:]
    _compare(vit_one, tmp_path / "run", stage, "image ViT (augmentation on)")
    assert (tmp_path / "run" / "model" / "preprocessor_config.json").exists()  # the export still carries the image processor
