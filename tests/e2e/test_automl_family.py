"""`trainpipe automl --task custom | image-classification | text-classification` for real (issue 32): model selection and
architecture search by trainpipe's budgeted successive halving (tune/automl_family.py), every arm an ordinary run.

- custom: an MLP factory on UCI Wine (examples/custom-module/data/wine.csv); the search over `model.args` (width, depth)
  under `automl.max_params` finds a configuration at least as accurate as the hand default trained for the same steps,
  with fewer parameters; arms over the limit are refused before they train;
- images: scikit-learn's digits as 8x8 PNGs (the shipped example's data), three tiny backbones built from configs into
  local folders (ViT, ConvNeXt, ResNet; nothing from a hub): the search picks one that beats the trivial predictor, and
  the winner predicts through `trainpipe predict`;
- text: a tiny BERT from a config with a sequence-classification head on the classification records of tests/tiny.py.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "custom-module" / "data" / "wine.csv"

MLP = '''
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self, hidden_size, blocks):
        super().__init__()
        layers = [nn.Linear(13, hidden_size), nn.Tanh()]
        for _ in range(blocks - 1):
            layers += [nn.Linear(hidden_size, hidden_size), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden_size, 3))

    def forward(self, x_num, x_cat):
        return self.net(x_num)

def build(hidden_size=128, blocks=3):
    return MLP(hidden_size, blocks)
'''


def wine_config(tmp: Path, **automl) -> Path:
    (tmp / "mlp.py").write_text(MLP)
    cfg = {"name": "wine", "model": {"factory": "mlp.py:build", "args": {"hidden_size": 128, "blocks": 3}},
           "data": {"sources": [{"path": str(WINE)}], "label": "cultivar", "eval_split": 0.25},
           "training": {"learning_rate": 3.0e-2, "max_steps": 20, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
                        "eval_steps": 10, "save_steps": 10, "logging_steps": 10, "seed": 0},
           "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"}, "output_dir": str(tmp / "hand"),
           "automl": {"task": "custom", "output_dir": str(tmp / "automl"), **automl}}
    p = tmp / "wine.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_architecture_search_on_a_custom_module_matches_the_hand_default_with_fewer_parameters(tmp_path, capsys):
    space = {"model.args.hidden_size": {"choice": [4, 8, 16, 32]}, "model.args.blocks": {"choice": [1, 2]}}
    config = wine_config(tmp_path, space=space, arms_per_model=4, min_steps=10, rungs=2, eta=2, max_params=1500, seed=1)
    assert main(["automl", str(config)]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "automl" / "automl.json").read_text())
    checks = res["checks"]
    assert all((c["params"] <= 1500) == c["trained"] for c in checks), checks  # the limit refuses before training, and only the limit
    win = res["winner"]
    assert win["steps"] == 20 and win["params"] <= 1500
    # the hand default (128 wide, 3 deep: 35k parameters) trained the same 20 steps on the same split and seed
    assert main(["run", str(config)]) == 0
    hand = json.loads((tmp_path / "hand" / "summary.json").read_text())
    assert hand["train"]["global_step"] == 20 and hand["parameters"]["trainable"] > 10 * win["params"]
    assert win["accuracy"] >= hand["final"]["accuracy"], (win, hand["final"]["accuracy"])
    assert win["accuracy"] > res["trivial"]["accuracy"] + 0.3, res["trivial"]
    # the leaderboard: metric, parameters, step time, fit time; curves and gates in the report; the console table
    board = list(csv.DictReader((tmp_path / "automl" / "leaderboard.csv").open()))
    assert {"accuracy", "params", "train_step_ms", "probe_step_ms", "fit_seconds"} <= set(board[0])
    assert all(float(r["train_step_ms"]) > 0 and float(r["fit_seconds"]) > 0 for r in board)
    assert [s for s, _ in res["leaderboard"][0]["curve"]] == [0, 10, 20]  # the baseline, then an eval every 10 steps over both rungs (it continued)
    page = (tmp_path / "automl" / "report.html").read_text()
    assert "<svg" in page and "<script" not in page and "beats_trivial" in page
    assert "winner gates:" in out and "trivial" in out
    # the winner is a run's export: `trainpipe predict` takes it
    pred = tmp_path / "pred.csv"
    assert main(["predict", str(tmp_path / "automl" / "winner"), "--data", str(WINE), "--out", str(pred)]) == 0
    rows = list(csv.DictReader(pred.open()))
    truth = [r["cultivar"] for r in csv.DictReader(WINE.open())]
    assert len(rows) == len(truth) and sum(r["prediction"] == t for r, t in zip(rows, truth)) / len(truth) > 0.85
    # and `trainpipe eval` measures it on the config's eval split: the leaderboard's figure again
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "automl" / "winner"), "--config", str(config)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("eval accuracy "))
    assert float(line.split()[-1]) == pytest.approx(win["accuracy"], abs=1e-6)


def test_a_config_of_another_family_is_one_paragraph(tmp_path, capsys):
    config = wine_config(tmp_path)
    assert main(["automl", str(config), "--task", "image-classification"]) == 2
    cap = capsys.readouterr()
    text = " ".join((cap.out + cap.err).split())
    assert "run config of the `image` family" in text and "`custom` config" in text and "Traceback" not in text
    assert not (tmp_path / "automl").exists()


DIGITS = ROOT / "examples" / "image-classification" / "data" / "digits.parquet"


def tiny_backbones(root: Path, names: tuple[str, ...] = ("vit", "convnext", "resnet")) -> list[Path]:
    """Three tiny image classifiers built from configs (random weights, nothing downloaded), each with the example's processor."""
    import torch
    from transformers import (ConvNextConfig, ConvNextForImageClassification, ResNetConfig, ResNetForImageClassification, ViTConfig,
                              ViTForImageClassification, ViTImageProcessor)

    out = []
    for name, model in (
        ("vit", lambda: ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                            intermediate_size=64, num_labels=10))),
        ("convnext", lambda: ConvNextForImageClassification(ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1],
                                                                           num_stages=2, num_labels=10))),
        ("resnet", lambda: ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                                     layer_type="basic", downsample_in_first_stage=False, num_labels=10))),
    ):
        if name not in names:
            continue
        torch.manual_seed(0)
        model().save_pretrained(root / name, safe_serialization=True)
        ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(root / name)
        out.append(root / name)
    return out


def test_image_model_selection_picks_a_backbone_that_beats_the_trivial_predictor(tmp_path, capsys):
    import pandas as pd

    bases = tiny_backbones(tmp_path / "bases")
    digits = tmp_path / "digits.parquet"  # the first 600 of the example's 1797 digits (about 60 a class): a shorter test
    pd.read_parquet(DIGITS).iloc[:600].to_parquet(digits, index=False)
    cfg = {"name": "digits", "model": {"family": "image", "name_or_path": str(bases[0])},
           "data": {"sources": [{"path": str(digits)}], "label": "label", "eval_split": 0.15},
           "training": {"learning_rate": 3.0e-3, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1, "seed": 0},
           "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"},
           "automl": {"task": "image-classification", "candidates": [str(b) for b in bases], "arms_per_model": 1, "min_steps": 10, "rungs": 2,
                      "eta": 2, "output_dir": str(tmp_path / "automl"), "space": {"training.learning_rate": {"choice": [1.0e-2]}}}}
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["automl", str(config)]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "automl" / "automl.json").read_text())
    assert sorted(Path(c["candidate"]).name for c in res["checks"]) == ["convnext", "resnet", "vit"] and all(c["trained"] for c in res["checks"])
    assert all(c["params"] > 0 and c["peak_mib"] > 0 and c["step_ms"] > 0 for c in res["checks"])  # counted, traced and timed before training
    win, trivial = res["winner"], res["trivial"]["accuracy"]
    assert Path(win["candidate"]).name in ("convnext", "resnet", "vit") and win["steps"] == 20
    assert win["accuracy"] >= trivial + 0.2, (win, trivial)  # 10 classes: the majority class is about 10 %
    assert out.count("data: cache reused") >= 3  # the digits were decoded and split once, every arm's run reused them
    pred = tmp_path / "pred.csv"
    assert main(["predict", str(tmp_path / "automl" / "winner"), "--data", str(digits), "--out", str(pred)]) == 0
    assert len(list(csv.DictReader(pred.open()))) == 600
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "automl" / "winner"), "--config", str(config)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("eval accuracy "))
    assert float(line.split()[-1]) == pytest.approx(win["accuracy"], abs=1e-6)  # the export measures what the run's final eval did


def tiny_bert(path: Path) -> Path:
    """A 2-layer, 32-wide BERT from a config with the tests' BPE tokenizer (random weights; a sequence-classification head is
    added by the run)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=64, pad_token_id=tok.pad_token_id)).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def test_text_classification_selects_between_a_tiny_bert_and_a_tiny_llama(tmp_path, capsys):
    from tiny import build_tiny_model, classification_records, write_jsonl

    bert, llama = tiny_bert(tmp_path / "bert"), build_tiny_model(tmp_path / "llama")
    write_jsonl(tmp_path / "train.jsonl", classification_records(240, seed=5))
    cfg = {"name": "topics", "model": {"name_or_path": str(bert)}, "method": {"name": "classification", "peft": "none"},
           "data": {"sources": [{"path": str(tmp_path / "train.jsonl"), "format": "classification"}], "eval_split": 48, "max_length": 32},
           "training": {"learning_rate": 2.0e-3, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "seed": 0},
           "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"},
           "automl": {"task": "text-classification", "candidates": [str(bert), str(llama)], "arms_per_model": 1, "min_steps": 15, "rungs": 2,
                      "eta": 2, "output_dir": str(tmp_path / "automl"), "space": {"training.learning_rate": {"choice": [2.0e-3]}}}}
    config = tmp_path / "topics.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["automl", str(config)]) == 0
    res = json.loads((tmp_path / "automl" / "automl.json").read_text())
    assert sorted(Path(c["candidate"]).name for c in res["checks"]) == ["bert", "llama"] and all(c["params"] > 0 for c in res["checks"])
    bert_params = next(c["params"] for c in res["checks"] if c["candidate"].endswith("bert"))
    assert bert_params < next(c["params"] for c in res["checks"] if c["candidate"].endswith("llama"))
    win = res["winner"]
    assert win["steps"] == 30 and win["accuracy"] >= res["trivial"]["accuracy"] + 0.15, (win, res["trivial"])
    model_cfg = json.loads((tmp_path / "automl" / "winner" / "model" / "config.json").read_text())
    assert model_cfg["architectures"][0].endswith("ForSequenceClassification")


def test_candidates_that_cannot_be_built_or_are_too_big_are_listed_then_one_paragraph(tmp_path, capsys):
    """Offline, a hub id with no local weights cannot be built; a local backbone over `automl.max_params` is refused: each
    is listed with its reason before anything trains, and with no arm left the search is one paragraph (exit 2)."""
    import pandas as pd

    bases = tiny_backbones(tmp_path / "bases", ("resnet",))
    digits = tmp_path / "digits.parquet"
    pd.read_parquet(DIGITS).iloc[:100].to_parquet(digits, index=False)
    cfg = {"name": "digits", "model": {"family": "image", "name_or_path": str(bases[0])},
           "data": {"sources": [{"path": str(digits)}], "label": "label", "eval_split": 0.2}, "tracking": {"backend": "none"},
           "automl": {"task": "image-classification", "candidates": ["no-such-org/no-such-model", str(bases[0])], "max_params": 1000,
                      "arms_per_model": 1, "output_dir": str(tmp_path / "automl")}}
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["automl", str(config)]) == 2
    cap = capsys.readouterr()
    text = " ".join((cap.out + cap.err).split())
    assert "no AutoML arm can be trained" in text and "no-such-model" in text and "> automl.max_params 1,000" in text, text
    assert "Traceback" not in text and not list((tmp_path / "automl" / "runs").glob("rung*"))  # nothing trained
