"""`trainpipe automl` on two tiny Llamas (real CPU training): candidates are models x the planner's method x two learning
rates, successive halving trains the best half twice as long per rung, every candidate run is an ordinary run directory on
the same eval split, the leaderboard has the metric/steps/seconds/cost of each, and the winner's model is exported with its
report. The frozen keys (data loading, eval, timing) cannot be changed by a proposal."""

import csv
import json

import pytest

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main
from trainpipe.errors import ConfigError
from trainpipe.tune.automl import check_proposal

pytestmark = pytest.mark.e2e


def test_successive_halving_picks_and_exports_a_winner(tmp_path, capsys):
    a = build_tiny_model(tmp_path / "model-a", seed=0)
    b = build_tiny_model(tmp_path / "model-b", seed=1)
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(120, seed=8))
    out = tmp_path / "automl"
    assert main(["automl", "--task", "sft", "--data", str(data), "--models", f"{a},{b}", "-o", str(out), "--min-steps", "3", "--rungs", "3",
                 "--eta", "2", "--eval-split", "16", "--max-length", "64", "--gpu", "A10G", "--budget-usd", "5"]) == 0
    r = json.loads((out / "automl.json").read_text())
    rows = list(csv.DictReader((out / "leaderboard.csv").open()))
    by_rung = {k: [x for x in rows if int(x["rung"]) == k] for k in range(3)}
    assert len(by_rung[0]) == 4 and len(by_rung[1]) == 2 and len(by_rung[2]) == 1  # 4 candidates, halved per rung
    assert [int(x["steps"]) for x in (by_rung[0][0], by_rung[1][0], by_rung[2][0])] == [3, 6, 12]
    # the survivors of each rung are its best half by the fixed metric (eval loss)
    for k in (0, 1):
        ranked = sorted(by_rung[k], key=lambda x: float(x["loss"]))
        assert {x["candidate"] for x in by_rung[k + 1]} == {x["candidate"] for x in ranked[: len(by_rung[k + 1])]}
    assert all(float(x["cost_usd"]) > 0 and float(x["seconds"]) > 0 for x in rows) and r["spent_usd"] <= 5
    from trainpipe.config import build_config
    from trainpipe.plan.gpus import find_gpu
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import resolve

    g = find_gpu("A10G")
    for c in r["candidates"]:  # the method is the planner's for that model on the target GPU (`method.peft: auto`)
        probe = build_config({"model": {"name_or_path": c["changes"]["model.name_or_path"]}, "data": {"sources": [{"path": str(data)}], "max_length": 64},
                              "method": {"peft": "auto"}, "training": {"per_device_train_batch_size": 8}})
        want = resolve(probe, Hardware("cuda", 1, (g.name,), g.bf16, 1, ""), 1, env={}).config.method.peft
        assert c["changes"]["method.peft"] == want and c["method_rule"]
    lrs = sorted({c["changes"]["training.learning_rate"] for c in r["candidates"]})
    assert len(lrs) == 2 and lrs[1] == pytest.approx(3 * lrs[0], rel=0.01)
    # every candidate measured on the same held-out records: identical baseline loss for the same base model
    base_losses = {}
    for x in by_rung[0]:
        s = json.loads((tmp_path / "automl" / "runs" / f"rung0-{x['candidate']}" / "summary.json").read_text())
        base_losses.setdefault(x["model.name_or_path"], set()).add(round(s["baseline"]["loss"], 6))
        assert s["data"]["eval_examples"] == 16
    assert all(len(v) == 1 for v in base_losses.values())
    # lineage: a rung-1 run names its rung-0 parent
    man = json.loads((out / "runs" / f"rung1-{by_rung[1][0]['candidate']}" / "manifest.json").read_text())
    assert man["lineage"]["automl"]["parent"].endswith(f"rung0-{by_rung[1][0]['candidate']}")
    winner = r["winner"]
    assert winner["candidate"] == by_rung[2][0]["candidate"]
    assert (out / "winner" / "model" / "model.safetensors").is_file() and (out / "winner" / "summary.json").is_file()
    s = json.loads((out / "winner" / "summary.json").read_text())
    assert s["final"]["loss"] < s["baseline"]["loss"]  # the winner learned
    assert "winner:" in capsys.readouterr().out


def test_frozen_keys_cannot_be_proposed():
    check_proposal({"training.learning_rate": 1e-4, "method.lora.r": 8})
    for key in ("data.max_length", "eval.metrics", "training.max_steps", "training.eval_steps", "training.seed"):
        with pytest.raises(ConfigError, match="fixed for the whole search"):
            check_proposal({key: 1})
    with pytest.raises(ConfigError, match="may not change"):
        check_proposal({"distributed.strategy": "ddp"})


def test_budget_below_the_first_rung_is_one_error(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(60, seed=8))
    assert main(["automl", "--task", "sft", "--data", str(data), "--models", str(tiny_model_dir), "-o", str(tmp_path / "o"),
                 "--gpu", "A10G", "--budget-usd", "1e-9"]) == 2
    assert "cannot pay for the first rung" in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "o" / "runs").exists()
