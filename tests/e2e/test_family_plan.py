"""`trainpipe plan` for the tabular, image and custom families (issue 30): the memory of one training step traced on fake
tensors at the planned micro-batch equals, to the byte, the trace `trainpipe run` makes of the same step; the time from
its FLOPs; `batch_size: auto` from the training rows with its rule; none of the text-only decisions (packing, attention
kernel, model dtype); a custom module's code is never imported by `plan` unless `--trace` asks for it."""

from __future__ import annotations

import json

import pytest
import yaml

from test_custom_module import write as write_custom
from test_image_runs import digits_folder, write_config as write_image
from test_tabular import write_config as write_tabular, write_table
from trainpipe.cli import main
from trainpipe.plan.family_plan import MAX_BATCH, MIN_BATCH, auto_micro_batch

pytestmark = pytest.mark.e2e

TEXT_ONLY = {"data.packing", "model.attn_implementation", "data.max_length"}


def plan_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_micro_batch_rule_is_the_largest_power_of_two_with_32_steps_an_epoch():
    assert auto_micro_batch(409, "tabular")[0] == 8  # 409 / 32 = 12.8 -> 8
    assert auto_micro_batch(5000, "tabular")[0] == 128  # 156 -> 128
    assert auto_micro_batch(10**7, "image")[0] == MAX_BATCH and auto_micro_batch(3, "image")[0] == MIN_BATCH
    b, rule = auto_micro_batch(None, "custom")
    assert b == 64 and "data.factory" in rule


def test_tabular_plan_traces_the_step_run_traces_and_chooses_the_batch_from_the_rows(tmp_path, capsys):
    write_table(tmp_path / "table.csv", n=2000)
    cfg = write_tabular(tmp_path, training={"per_device_train_batch_size": "auto", "max_steps": 6, "eval_steps": 6, "save_steps": 6,
                                            "gradient_accumulation_steps": 1})
    out = plan_json(capsys, str(cfg))
    keys = {r["key"] for r in out["decision"]}
    assert not keys & TEXT_ONLY, keys & TEXT_ONLY
    mb = next(r for r in out["decision"] if r["key"] == "micro_batch")
    assert mb["value"] == 32 and "1501 training rows" in mb["rule"], mb  # 2001 rows read (before dedup) - 500 eval = 1501 -> / 32 = 46.9 -> 32
    fam = out["family"]
    assert fam["traced"] and fam["fits"] and fam["micro_batch"] == 32 and fam["peak_bytes"] > fam["weights_bytes"] > 0
    assert fam["step_flops"] > 0 and fam["seconds"] > 0 and fam["optimizer_steps"] == 6
    assert main(["run", str(cfg)]) == 0
    run = json.loads((tmp_path / "run" / "summary.json").read_text())["plan_trace"]
    assert run["micro_batch"] == 32 and run["peak_bytes"] == fam["peak_bytes"] and run["parameters"] == fam["parameters"]
    capsys.readouterr()
    assert main(["plan", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "memory: one training step at micro-batch 32 peaks at" in printed and "time: 6 optimizer steps" in printed
    assert "packing" not in printed and "attn_implementation" not in printed


def test_image_plan_shows_memory_and_time_of_the_classifier(tmp_path, capsys):
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    base = tmp_path / "vit"
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, num_labels=3)).save_pretrained(base)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(base)
    images = digits_folder(tmp_path / "imgs", per_class=8)  # 80 images, 20 held out -> 60 training rows
    cfg = write_image(tmp_path / "a", base, images, per_device_train_batch_size="auto", max_steps=2, eval_steps=2, save_steps=2)
    out = plan_json(capsys, str(cfg))
    assert not {r["key"] for r in out["decision"]} & TEXT_ONLY
    mb = next(r for r in out["decision"] if r["key"] == "micro_batch")
    assert mb["value"] == MIN_BATCH and "60 training rows" in mb["rule"]
    fam = out["family"]
    assert fam["traced"] and fam["micro_batch"] == MIN_BATCH and fam["peak_bytes"] > fam["weights_bytes"] > 0 and fam["step_flops"] > 1e6
    assert main(["run", str(cfg)]) == 0
    run = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())["plan_trace"]
    assert run["peak_bytes"] == fam["peak_bytes"], (run, fam)  # the same step, traced by plan and by run, to the byte


def test_custom_module_plan_imports_user_code_only_under_trace(tmp_path, capsys, monkeypatch):
    mark = tmp_path / "imported.txt"
    monkeypatch.setenv("TRAINPIPE_TEST_IMPORT_MARK", str(mark))
    cfg = write_custom(tmp_path, "c")
    out = plan_json(capsys, str(cfg))
    assert not mark.exists() and not out["family"]["traced"] and "plan --trace" in out["family"]["reason"]
    assert main(["plan", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "memory: measured when the run starts" in printed and "runs your code" in printed and not mark.exists()
    out = plan_json(capsys, str(cfg), "--trace")
    assert mark.exists(), "`plan --trace` traces the module: it imports model.factory"
    fam = out["family"]
    assert fam["traced"] and fam["micro_batch"] == 8 and fam["peak_bytes"] > fam["weights_bytes"] > 0
    mark.unlink()
    capsys.readouterr()
    assert main(["run", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert "model.family = custom" in printed and "data.packing" not in printed and "attn_implementation" not in printed
    run = json.loads((tmp_path / "c" / "summary.json").read_text())["plan_trace"]
    assert run["peak_bytes"] == fam["peak_bytes"] and run["parameters"] == fam["parameters"]
    doc = yaml.safe_load(cfg.read_text())
    assert doc["model"]["factory"] == "net.py:build"
