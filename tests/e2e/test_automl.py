"""`trainpipe automl` end to end on tiny Llamas (real CPU training), for each of the three tasks.

sft: candidates from `--models` (a local folder) and from the catalogue (`--catalog`, filtered by `--max-params` and the
GPU; one catalogue id trained from a tiny local folder through `--models-dir`, the others listed with their plan and the
reason they are not trained); per candidate, Optuna TPE samples learning rate, LoRA rank, weight decay and warmup; successive
halving keeps the best half of all arms, and a surviving arm CONTINUES from its checkpoint (`checkpoint_resumed`, its total
optimizer steps equal its rung's budget); a proposer's change is a new arm with lineage, a proposal touching a frozen key is
refused and logged. classification (accuracy) and preference (DPO, margin per token) run the same search. Each writes the
leaderboard (terminal, CSV, HTML) with time and planned cost per arm and exports the winner with its report."""

import csv
import json
from pathlib import Path

import pytest

from tiny import alpaca_records, build_tiny_model, classification_records, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

PROPOSER = '''
def propose(state):
    if state["rung"] != 1:
        return []
    best = min((a for a in state["arms"] if a["alive"]), key=lambda a: a["value"])
    return [
        {"parent": best["id"], "changes": {"training.learning_rate": best["changes"]["training.learning_rate"] * 2}, "why": "a higher lr"},
        {"parent": best["id"], "changes": {"data.max_length": 16}, "why": "shorter examples train faster"},
        {"parent": best["id"], "changes": {"eval.metrics": ["loss", "exact_match"]}},
        {"parent": best["id"], "changes": {"objective": "exact_match"}},
        {"parent": best["id"], "changes": {"max_wall_time": 10}},
    ]
'''


def _events(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "events.jsonl").read_text().splitlines() if x.strip()]


def _common_outputs(out: Path, metric: str, direction: str) -> dict:
    r = json.loads((out / "automl.json").read_text())
    board = list(csv.DictReader((out / "leaderboard.csv").open()))
    assert board and all(float(x["seconds"]) > 0 and float(x["cost_usd"]) > 0 for x in board)  # time and planned cost per arm
    page = (out / "leaderboard.html").read_text()
    assert "Leaderboard" in page and all(x["arm"] in page for x in board) and "winner/report.html" in page
    w = out / "winner"
    assert (w / "model" / "config.json").is_file() and (w / "summary.json").is_file() and (w / "report.html").is_file()
    assert "<html" in (w / "report.html").read_text().lower()
    assert r["winner"]["arm"] == board[0]["arm"]
    values = [float(x[metric]) for x in board]
    worst = max(values) if direction == "minimize" else min(values)
    win = r["winner"][metric]
    assert (win < worst) if direction == "minimize" else (win > worst), (win, values)  # the winner beats the worst arm
    assert r["spent_usd"] <= r["budget"]["usd"] and r["planned_usd"] > 0
    return r


def test_sft_catalogue_candidates_halving_continues_and_the_loop_refuses_frozen_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = build_tiny_model(tmp_path / "model-a", seed=0)
    build_tiny_model(tmp_path / "weights" / "HuggingFaceTB--SmolLM-135M", seed=1)  # stands in for the catalogue model's weights
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(120, seed=8))
    (tmp_path / "prop.py").write_text(PROPOSER)
    out = tmp_path / "automl"
    assert main(["automl", "--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", f"automl.models={a}", "--set",
                 "automl.catalog=true", "--set", f"automl.models_dir={tmp_path / 'weights'}", "--set", "automl.max_params=6e8", "--set",
                 f"automl.output_dir={out}", "--set", "automl.min_steps=3", "--set", "automl.rungs=3", "--set", "automl.eta=2", "--set",
                 "automl.arms_per_model=2", "--set", "automl.eval_split=16", "--set", "automl.max_length=64", "--set", "automl.gpu=A10G",
                 "--set", "automl.budget_usd=5", "--set", "automl.lr_spread=10", "--set",
                 f"automl.proposer={tmp_path / 'prop.py'}:propose"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    r = _common_outputs(out, "loss", "minimize")
    assert "winner:" in printed and "not trained" in printed

    # 1. candidates: the local folder, the catalogue model with local weights, every other catalogue model listed with its plan and reason
    cands = {c["model"]: c for c in csv.DictReader((out / "candidates.csv").open())}
    assert cands[str(a)]["trained"] == "True" and cands["HuggingFaceTB/SmolLM-135M"]["trained"] == "True"
    assert cands["HuggingFaceTB/SmolLM-135M"]["source"] == "catalogue"
    qwen = cands["Qwen/Qwen2.5-0.5B"]  # within automl.max_params, fits an A10G, no weights offline
    assert qwen["trained"] == "False" and "no local weights" in qwen["reason"] and "automl.models: [ID=PATH]" in qwen["reason"]
    assert qwen["method"] and float(qwen["memory_gib"]) > 0 and float(qwen["rung0_usd"]) > 0
    assert "automl.max_params" in cands["meta-llama/Llama-3.1-8B"]["reason"]
    assert not any(c["trained"] == "True" for c in cands.values() if c["model"] not in (str(a), "HuggingFaceTB/SmolLM-135M"))
    from trainpipe.config import build_config
    from trainpipe.plan.gpus import find_gpu
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import resolve

    g = find_gpu("A10G")
    for c in r["candidates"]:
        if c["trained"]:  # the method is the planner's for the weights trained, on the target GPU (`method.peft: auto`)
            probe = build_config({"model": {"name_or_path": c["weights"]}, "data": {"sources": [{"path": str(data)}], "max_length": 64},
                                  "method": {"peft": "auto"}, "training": {"per_device_train_batch_size": "auto", "target_effective_batch_size": 8}})
            plan = resolve(probe, Hardware("cuda", 1, (g.name,), g.bf16, 1, ""), 1, env={})
            assert c["method"] == plan.config.method.peft and c["method_rule"]

    # 2. hyperparameters: sampled per candidate (lr around the planner's default, LoRA rank when LoRA, weight decay, warmup)
    first = [x for x in r["arms"] if x["parent"] is None]
    assert len(first) == 4 and {x["candidate"] for x in first} == {str(a), "HuggingFaceTB/SmolLM-135M"}
    for arm in first:
        ch = arm["changes"]
        cand = next(c for c in r["candidates"] if c["model"] == arm["candidate"])
        assert cand["lr"] / 10 <= ch["training.learning_rate"] <= cand["lr"] * 10
        assert 0 <= ch["training.weight_decay"] <= 0.1 and 0 <= ch["training.warmup_ratio"] <= 0.1
        assert ch["training.per_device_train_batch_size"] * ch["training.gradient_accumulation_steps"] >= 8
        if ch["method.peft"] in ("lora", "qlora"):
            assert ch["method.lora.r"] in (4, 8, 16) and ch["method.lora.alpha"] == 2 * ch["method.lora.r"]
    assert len({x["changes"]["training.learning_rate"] for x in first}) == 4

    # 3. halving across arms; survivors continue from their checkpoint
    rows = r["rows"]
    by_rung = {k: [x for x in rows if x["rung"] == k] for k in range(3)}
    assert [len(by_rung[k]) for k in range(3)] == [4, 3, 1]  # 4 arms; the best 2 continue + 1 proposed; the best 1 of 3
    assert {x["steps"] for x in rows} == {3, 6, 12} and all(x["steps"] == 3 * 2 ** x["rung"] for x in rows)
    ranked0 = sorted(by_rung[0], key=lambda x: x["loss"])
    cont1 = [x for x in by_rung[1] if x["continued"]]
    assert {x["arm"] for x in cont1} == {x["arm"] for x in ranked0[:2]}
    last = by_rung[2][0]
    assert last["continued"] and last["optimizer_steps"] == 12 and last["steps_trained"] == 6
    resumed = [e for e in _events(last["run_dir"]) if e.get("event") == "checkpoint_resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 6  # continued from rung 1's step 6, not retrained from 0
    trained_here = [json.loads(x)["step"] for x in (Path(last["run_dir"]) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x and '"learning_rate"' in x]
    assert trained_here and min(trained_here) == 7 and max(trained_here) == 12
    for x in cont1:
        s = json.loads((Path(x["run_dir"]) / "summary.json").read_text())
        assert s["train"]["global_step"] == 6 and s["train"]["resumed_from"]
        man = json.loads((Path(x["run_dir"]) / "manifest.json").read_text())["lineage"]["automl"]
        assert man["continued"] and man["parent"].endswith(f"rung0-{x['arm']}") and man["change"] == {"training.max_steps": [3, 6]}

    # 5. the loop: the proposal to a surviving arm is a new arm with lineage; frozen keys are refused, logged, not applied
    proposed = [x for x in r["arms"] if x["parent"] is not None]
    assert len(proposed) == 1
    p = proposed[0]
    parent = next(x for x in r["arms"] if x["id"] == p["parent"])
    assert p["change"] == {"training.learning_rate": pytest.approx(parent["changes"]["training.learning_rate"] * 2)}
    prow = next(x for x in by_rung[1] if x["arm"] == p["id"])
    assert not prow["continued"] and prow["optimizer_steps"] == 6  # another lr cannot resume: trained from scratch to the rung's steps
    man = json.loads((Path(prow["run_dir"]) / "manifest.json").read_text())["lineage"]["automl"]
    assert man["parent_arm"] == parent["id"] and man["parent"].endswith(f"rung0-{parent['id']}") and "training.learning_rate" in man["change"]
    assert {tuple(x["changes"]) for x in r["refused"]} == {("data.max_length",), ("eval.metrics",), ("objective",), ("max_wall_time",)}
    assert all("fixed for the whole search" in x["why"] for x in r["refused"])
    logged = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "proposal_refused" for e in logged) == 4 and sum(e["event"] == "proposal_applied" for e in logged) == 1
    import yaml

    for x in rows:  # nothing refused was applied: every arm ran on the same data, eval split and metric
        cfg = yaml.safe_load((Path(x["run_dir"]) / "config.yaml").read_text()) if (Path(x["run_dir"]) / "config.yaml").is_file() else None
        s = json.loads((Path(x["run_dir"]) / "summary.json").read_text())
        assert s["data"]["eval_examples"] == 16
        if cfg:
            assert cfg["data"]["max_length"] == 64 and cfg["eval"]["metrics"] == ["loss"]

    # the winner learned, and is the best at the last rung
    s = json.loads((out / "winner" / "summary.json").read_text())
    assert s["final"]["loss"] < s["baseline"]["loss"] and r["winner"]["rung"] == 2


def test_classification_task(tmp_path):
    base = build_tiny_model(tmp_path / "base", seed=0)
    data = write_jsonl(tmp_path / "cls.jsonl", classification_records(240, seed=5))
    out = tmp_path / "automl"
    assert main(["automl", "--set", "automl.task=classification", "--set", f"automl.data={data}", "--set", f"automl.models={base}",
                 "--set", f"automl.output_dir={out}", "--set", "automl.min_steps=8", "--set", "automl.rungs=2", "--set",
                 "automl.arms_per_model=2", "--set", "automl.lr_range=1e-4:3e-3", "--set", "automl.eval_split=32", "--set",
                 "automl.max_length=32", "--set", "automl.batch_size=16", "--set", "automl.gpu=A10G", "--set", "automl.budget_usd=5",
                 "--set", "automl.seed=1"]) == 0
    r = _common_outputs(out, "accuracy", "maximize")
    assert r["metric"] == "accuracy" and r["direction"] == "maximize" and len(r["rows"]) == 3 and r["rows"][-1]["continued"]
    assert all(1e-4 <= a["changes"]["training.learning_rate"] <= 3e-3 for a in r["arms"])
    s = json.loads((out / "winner" / "summary.json").read_text())
    assert s["method"] == "classification" and s["final"]["accuracy"] > s["baseline"]["accuracy"]


def test_preference_task(tmp_path):
    base = build_tiny_model(tmp_path / "base", seed=0)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_records(100, seed=3))
    out = tmp_path / "automl"
    assert main(["automl", "--set", "automl.task=preference", "--set", f"automl.data={data}", "--set", f"automl.models={base}", "--set",
                 f"automl.output_dir={out}", "--set", "automl.min_steps=5", "--set", "automl.rungs=2", "--set", "automl.arms_per_model=2",
                 "--set", "automl.lr_range=1e-2:3e-2", "--set", "automl.eval_split=24", "--set", "automl.max_length=64", "--set",
                 "automl.gpu=A10G", "--set", "automl.budget_usd=5"]) == 0
    r = _common_outputs(out, "margin_per_token", "maximize")
    assert len(r["rows"]) == 3 and r["rows"][-1]["continued"]
    s = json.loads((out / "winner" / "summary.json").read_text())
    assert s["method"] == "dpo" and s["final"]["margin_per_token"] > s["baseline"]["margin_per_token"]


def test_budget_below_the_first_rung_is_one_error(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(60, seed=8))
    assert main(["automl", "--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", f"automl.models={tiny_model_dir}", "--set",
                 f"automl.output_dir={tmp_path / 'o'}", "--set", "automl.gpu=A10G", "--set", "automl.budget_usd=1e-9"]) == 2
    assert "cannot pay for the first rung" in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "o" / "runs").exists()


def test_budget_pays_for_the_rungs_it_starts(tmp_path, tiny_model_dir, capsys):
    """A budget that pays for rung 0 but not the next: rung 0 trains, rung 1 is never started, the winner of rung 0 is exported."""
    import re

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(60, seed=8))
    args = ["automl", "--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", f"automl.models={tiny_model_dir}", "--set",
            "automl.gpu=A10G", "--set", "automl.min_steps=2", "--set", "automl.rungs=2", "--set", "automl.arms_per_model=2", "--set",
            "automl.eval_split=8", "--set", "automl.max_length=48", "--set", "automl.lr_range=1e-3:1e-2"]
    assert main([*args, "--set", f"automl.output_dir={tmp_path / 'probe'}", "--set", "automl.budget_usd=1e-12"]) == 2
    one = float(re.search(r"costs \$([0-9.e+-]+) for one arm's 2 steps", " ".join(capsys.readouterr().out.split())).group(1))
    out = tmp_path / "o"  # rung 0: 2 arms x 2 steps = 2 x one; rung 1 adds the survivor's 2 more steps = one more: 3 x one in all
    assert main([*args, "--set", f"automl.output_dir={out}", "--set", f"automl.budget_usd={2.5 * one}"]) == 0
    r = json.loads((out / "automl.json").read_text())
    assert [x["rung"] for x in r["rows"]] == [0, 0] and "rung 1 would cost" in r["stopped"]
    assert r["spent_usd"] <= 2.5 * one < r["planned_usd"] and r["planned_usd"] == pytest.approx(3 * one, rel=0.05)
    assert not (out / "runs" / f"rung1-{r['winner']['arm']}").exists() and (out / "winner" / "model" / "config.json").is_file()
    logged = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["rung"] for e in logged if e["event"] == "budget_stop"] == [1]
