"""`method.name: auto` in `trainpipe run` (issue 15 item 1): the objective rule (plan/objective.py) on the config's goal
and the data's kinds resolves to a concrete objective, or to `stages:` where the tree says several, and that is what
trains (tiny Llama on the CPU; each run's eval loss falls below the base's).

- goal `knowledge` with raw text and instruction data -> continued pretraining on the text, then SFT on the instructions
  (two stages, the second starting from the first's model, each reading the sources of its kind).

Every other branch (DPO, SFT -> reward -> RL, SFT, adapters, continued) is resolved to its config in
tests/unit/test_plan_objective.py; those objectives' training is proven by their own e2e tests (test_preference.py,
test_stages.py, test_sft.py, test_adapters.py).
"""

import json
import random
from pathlib import Path

import pytest
import yaml

from tiny import WORDS, alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

SMALL = {"dedup": {"near": False}, "decontamination": {"enabled": False}, "max_length": 64, "eval_split": 16}


def text_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.sample(WORDS[:8], 4) + rng.sample(WORDS[8:], 4))} for _ in range(n)]


def write_config(tmp: Path, base: Path, name: str, sources: list[dict], method: dict, steps: int = 16, lr: float = 5e-3) -> Path:
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": sources, **SMALL},
        "method": {"name": "auto", "peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}, **method},
        "training": {"max_steps": steps, "eval_steps": steps, "logging_steps": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": lr, "early_stopping_patience": None, "warmup_steps": 0},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / name),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "text.jsonl", text_records(120, seed=5))
    write_jsonl(tmp / "data" / "sft.jsonl", alpaca_records(120, seed=6))
    return tmp, base


def test_new_knowledge_runs_pretrain_then_sft(work, capsys):
    tmp, base = work
    cfg = write_config(tmp, base, "knowledge", [{"path": "data/text.jsonl"}, {"path": "data/sft.jsonl"}], {"goal": "knowledge"})
    assert main(["run", str(cfg)]) == 0
    assert "objective (method.name: auto): pretrain -> sft" in " ".join(capsys.readouterr().out.split())
    root = tmp / "knowledge"
    s = json.loads((root / "summary.json").read_text())
    assert [st["name"] for st in s["stages"]] == ["pretrain", "sft"]
    pre, sft = s["stages"]
    assert sft["input_model"] == str(root / "pretrain" / "model")  # instruction tuning starts from the continued-pretrained model
    for st in (pre, sft):
        assert st["final"]["loss"] < st["baseline"]["loss"], st
    resolved = {n: yaml.safe_load((root / n / "config.resolved.yaml").read_text()) for n in ("pretrain", "sft")}
    assert resolved["pretrain"]["method"]["name"] == "pretrain" and resolved["sft"]["method"]["name"] == "sft"
    assert [Path(x["path"]).name for x in resolved["pretrain"]["data"]["sources"]] == ["text.jsonl"]
    assert [Path(x["path"]).name for x in resolved["sft"]["data"]["sources"]] == ["sft.jsonl"]

