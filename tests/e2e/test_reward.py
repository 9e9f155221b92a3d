"""method.name: reward through the CLI on a tiny Llama: pairwise accuracy on held-out pairs clearly above 0.5,
and the export contract the rl recipe relies on (AutoModelForSequenceClassification folder, `score()`)."""

import json
from pathlib import Path

import pytest
import yaml

from tiny import build_tiny_model, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def write_config(tmp: Path, base: Path, name: str, method: dict, training: dict) -> Path:
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/pairs.jsonl"}], "eval_split": 40, "max_length": 96},
        "method": {"name": "reward", **method},
        "training": {"eval_steps": 20, "logging_steps": 10, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "early_stopping_patience": None, **training},
        "output_dir": str(tmp / f"run-{name}"),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "pairs.jsonl", preference_records(200, seed=7))
    return tmp, base


@pytest.fixture(scope="module")
def full_run(workdir):
    tmp, base = workdir
    assert main(["run", str(write_config(tmp, base, "full", {"peft": "none"}, {"max_steps": 80, "learning_rate": 2e-3}))]) == 0
    return tmp / "run-full"


def test_pairwise_accuracy_clearly_above_chance(full_run):
    s = json.loads((full_run / "summary.json").read_text())
    assert s["final"]["accuracy"] >= 0.75, s["final"]
    assert s["final"]["accuracy"] > s["baseline"]["accuracy"] and s["final"]["loss"] < s["baseline"]["loss"]
    assert s["final"]["margin"] > s["baseline"]["margin"]
    metrics = [json.loads(x) for x in (full_run / "metrics.jsonl").read_text().splitlines()]
    assert any("accuracy" in m and "margin" in m for m in metrics)


def test_export_contract_score_ranks_held_out_pairs(full_run):
    from trainpipe.train.reward import load_reward_model, score

    model_dir = full_run / "model"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and len(cfg["id2label"]) == 1
    assert cfg["pad_token_id"] is not None
    model, tok = load_reward_model(model_dir)
    held_out = preference_records(60, seed=99)  # prompts never seen in training
    prompts = [r["prompt"] for r in held_out]
    good = score(model, tok, prompts, [r["chosen"] for r in held_out])
    bad = score(model, tok, prompts, [r["rejected"] for r in held_out])
    acc = sum(g > b for g, b in zip(good, bad)) / len(held_out)
    assert acc >= 0.75, acc
    # padding does not change a score: the last non-pad token is pooled
    alone = score(model, tok, prompts[:1], [held_out[0]["chosen"]])
    assert abs(alone[0] - good[0]) < 1e-4


def test_lora_reward_model_exports_the_merged_head(workdir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from trainpipe.train.reward import load_reward_model, score

    tmp, base = workdir
    cfg = write_config(tmp, base, "lora", {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}, {"max_steps": 10, "eval_steps": 10, "learning_rate": 5e-3})
    assert main(["run", str(cfg)]) == 0
    run = tmp / "run-lora"
    acfg = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
    assert acfg["task_type"] == "SEQ_CLS" and "score" in acfg["modules_to_save"]
    merged, tok = load_reward_model(run / "model")
    fresh = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    adapted = PeftModel.from_pretrained(fresh, run / "model" / "adapter").eval()
    recs = preference_records(8, seed=5)
    a = score(merged, tok, [r["prompt"] for r in recs], [r["chosen"] for r in recs])
    b = score(adapted, tok, [r["prompt"] for r in recs], [r["chosen"] for r in recs])
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


def test_reward_on_chat_data_is_a_clear_error(workdir, tmp_path, capsys):
    from tiny import chat_records

    _, base = workdir
    write_jsonl(tmp_path / "data" / "pairs.jsonl", chat_records(100))
    cfg = write_config(tmp_path, base, "bad", {"peft": "none"}, {"max_steps": 2})
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "reward needs preference pairs (prompt/chosen/rejected); this data is chat" in out
