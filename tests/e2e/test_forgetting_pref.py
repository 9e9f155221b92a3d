"""Forgetting sets, lm-eval benchmarks and the test split under the policy recipes (dpo, rl): a preference- or
RL-tuned policy is a causal LM, and what it forgets of general text is what its users must watch.

The base is the tiny Llama of test_eval_runs after 40 steps on the general text (so it has something to forget).
- `harsh`: dpo with a full fine-tune at a high learning rate: the general text's loss rises past 5 %, the alert
  fires during training and at the end, the `no_forgetting` gate fails; the figures in forgetting.json equal an
  independent recomputation (plain transformers, `labels=`) of the exported model's loss on the set; the held-out test
  pairs are measured with the preference metrics.
- `gentle`: dpo with LoRA at a low learning rate: the set moves by well under 5 %, no alert; the local lm-eval task
  runs on the base policy and on the trained one.
- `rl`: GRPO with a forgetting set: baseline, in-training and final measurements, like sft.
"""

import json
from pathlib import Path

import pytest
import yaml

from test_eval_runs import ASSETS, pretrain_on_general
from tiny import chat_records, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

GENERAL = {"path": str(ASSETS / "forgetting" / "general.jsonl"), "name": "general", "max_samples": 40}


def letter_reward(prompts, completions):
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def write_config(tmp: Path, name: str, base: Path, method: dict, training: dict, data: dict | None = None, **sections) -> Path:
    cfg = {
        "name": name,
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/pairs.jsonl"}], "eval_split": 16, "max_length": 64, **(data or {})},
        "method": method,
        "training": {"max_steps": 12, "eval_steps": 6, "logging_steps": 6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "early_stopping_patience": None, "warmup_steps": 0, **training},
        "eval": {"forgetting": [GENERAL]},
        "output_dir": str(tmp / name),
        **sections,
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forgetpref")
    base = pretrain_on_general(tmp / "base")
    write_jsonl(tmp / "data" / "pairs.jsonl", preference_records(140, seed=7))
    write_jsonl(tmp / "data" / "chat.jsonl", chat_records(40, seed=4))
    harsh = write_config(tmp, "harsh", base, {"name": "dpo", "peft": "none", "preference": {"beta": 0.5}}, {"learning_rate": 3e-3},
                         data={"test_split": 16})
    gentle = write_config(
        tmp, "gentle", base, {"name": "dpo", "peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "preference": {"beta": 0.5}},
        {"learning_rate": 3e-3},
        eval={"forgetting": [GENERAL], "benchmarks": [{"task": "reverse_words", "include_path": str(ASSETS / "reverse_words"), "limit": 10}]},
    )
    rl = write_config(
        tmp, "rl", base, {"name": "rl", "peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                          "rl": {"reward_function": f"{__file__}:letter_reward", "num_generations": 2, "max_new_tokens": 6}},
        {"learning_rate": 1e-2, "max_steps": 2, "eval_steps": 1, "per_device_train_batch_size": 4},
        data={"sources": [{"path": "data/chat.jsonl"}], "eval_split": 4, "dedup": {"near": False}, "decontamination": {"enabled": False}},
    )
    return {"tmp": tmp, **{name: (main(["run", str(cfg)]), tmp / name) for name, cfg in (("harsh", harsh), ("gentle", gentle), ("rl", rl))}}


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def recompute(model_dir: Path, rows: list[dict]) -> float:
    """The token-weighted LM loss of the exported model on the set's rows: transformers' own `labels=` loss, one row at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids, labels = torch.tensor([r["input_ids"]]), torch.tensor([r["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            count += n
    return total / count


def test_harsh_dpo_forgets_general_text_and_the_alert_and_gate_fire(runs):
    rc, run = runs["harsh"]
    assert rc == 0  # gates.on_fail: warn
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "dpo" and s["baseline"]["reward_margin"] == 0 and s["final"]["reward_margin"] != 0  # the policy left its reference
    f = s["forgetting"]["sets"]["general"]
    assert f["forgot"] is True and f["final"]["loss"] > f["baseline"]["loss"] * 1.05, f
    rec = json.loads((run / "forgetting.json").read_text())["sets"]["general"]
    assert [(h["step"], h["phase"]) for h in rec["history"]] == [(0, "baseline"), (6, "train"), (12, "train"), (12, "final")]
    assert rec["baseline"]["loss"] == pytest.approx(f["baseline"]["loss"]) and rec["final"]["loss"] == pytest.approx(f["final"]["loss"])
    alerts = [e for e in events(run) if e["event"] == "forgetting_detected"]
    assert {a["phase"] for a in alerts} == {"train", "final"} and all(a["task"] == "general" for a in alerts)
    gates = {g["name"]: g for g in s["gates"]["results"]}
    assert gates["no_forgetting"]["status"] == "fail" and "general" in gates["no_forgetting"]["evidence"]
    # the figures are the exported model's LM loss on the set, recomputed independently (full fine-tune: the same weights)
    from transformers import AutoTokenizer

    from trainpipe.config import load_config
    from trainpipe.data.tokenize import setup_chat_template
    from trainpipe.evaluate.forgetting import load_sets

    cfg = load_config(run / "config.resolved.yaml")
    tok = AutoTokenizer.from_pretrained(run / "model")
    template = setup_chat_template(tok, cfg.data.chat_template, str(run / "model"))
    rows = load_sets(cfg.eval.forgetting, tok, template, max_length=cfg.data.max_length)[0].rows  # the set's tokens, as the run read them
    assert len(rows) == 40
    assert recompute(run / "model", rows) == pytest.approx(f["final"]["loss"], rel=1e-4)
    # the held-out test pairs, on the chosen checkpoint, with the preference metrics
    assert s["test"]["examples"] == 16 and {"loss", "accuracy", "margin", "margin_per_token"} <= set(s["test"])
    assert [e for e in events(run) if e["event"] == "eval_done" and e.get("phase") == "test"]
    print(f"\nharsh dpo: general {f['baseline']['loss']:.4f} -> {f['final']['loss']:.4f} ({100 * f['change']:+.1f} %), "
          f"accuracy {s['baseline']['accuracy']:.3f} -> {s['final']['accuracy']:.3f}")


def test_gentle_dpo_keeps_general_text_and_runs_the_benchmark_on_the_policy(runs):
    rc, run = runs["gentle"]
    assert rc == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["final"]["loss"] < s["baseline"]["loss"]  # the preference was learned (measured: 0.6931 -> 0.6893)
    f = s["forgetting"]["sets"]["general"]
    assert f["forgot"] is False and abs(f["change"]) < 0.05, f  # measured: +1.3 %
    assert not [e for e in events(run) if e["event"] == "forgetting_detected"]
    assert {g["name"]: g["status"] for g in s["gates"]["results"]}["no_forgetting"] == "pass"
    b = s["benchmarks"]["reverse_words"]
    assert b["metric"] == "acc" and b["samples"] == 10 and 0 <= b["baseline"] <= 1 and 0 <= b["final"] <= 1
    assert json.loads((run / "benchmarks_baseline.json").read_text())["reverse_words"]["value"] == pytest.approx(b["baseline"])
    assert [e["phase"] for e in events(run) if e["event"] == "eval_done" and "benchmarks" in e] == ["baseline", "final"]
    print(f"\ngentle dpo: general {f['baseline']['loss']:.4f} -> {f['final']['loss']:.4f} ({100 * f['change']:+.2f} %), "
          f"reverse_words acc {b['baseline']:.3f} -> {b['final']:.3f}")


def test_rl_policy_measures_the_forgetting_set_at_baseline_every_eval_and_the_end(runs):
    rc, run = runs["rl"]
    assert rc == 0
    s = json.loads((run / "summary.json").read_text())
    rec = json.loads((run / "forgetting.json").read_text())["sets"]["general"]
    assert [(h["step"], h["phase"]) for h in rec["history"]] == [(0, "baseline"), (1, "train"), (2, "train"), (2, "final")]
    f = s["forgetting"]["sets"]["general"]
    assert f["baseline"]["loss"] > 0 and f["final"]["loss"] == pytest.approx(rec["final"]["loss"]) and isinstance(f["forgot"], bool)
    assert "reward" in s["final"] and "kl" in s["final"]
