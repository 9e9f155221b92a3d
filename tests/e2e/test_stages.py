"""`stages: [sft, reward, rl]` (RLHF in one run) through the CLI: each stage's exported model is the next one's input,
the reward stage's model scores the rl stage, the lineage is in every stage's manifest, one summary lists them, and
`--resume` keeps finished stages (their DAG steps reused from the step cache in OUTPUT_DIR/.trainpipe-store). The stage plan (merging, naming, chaining) is checked without training too."""

import json
import random
from pathlib import Path

import pytest
import yaml

from tiny import WORDS, build_tiny_model, chat_records, write_jsonl
from trainpipe.cli import main
from trainpipe.config import build_config

pytestmark = pytest.mark.e2e


def pairs(n: int, seed: int) -> list[dict]:
    """Preference pairs with a learnable rule: the chosen reply repeats the two words in order, the rejected one reverses them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        out.append({"prompt": f"Say {a} then {b}.", "chosen": f"{a} {b}", "rejected": f"{b} {a}"})
    return out


def write_config(tmp: Path, model_dir: Path) -> Path:
    write_jsonl(tmp / "data" / "chat.jsonl", chat_records(60, seed=7))
    write_jsonl(tmp / "data" / "pairs.jsonl", pairs(60, seed=8))
    small = {"dedup": {"near": False}, "decontamination": {"enabled": False}, "max_length": 64, "eval_split": 8}
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "data/chat.jsonl"}], **small},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "rl": {"num_generations": 4, "max_new_tokens": 6}},
        "training": {"max_steps": 4, "eval_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None, "warmup_steps": 0},
        "eval": {"metrics": ["loss"]},
        "stages": ["sft", {"method": {"name": "reward"}, "data": {"sources": [{"path": "data/pairs.jsonl"}], **small}}, "rl"],
        "output_dir": str(tmp / "rlhf"),
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def rlhf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    base = build_tiny_model(tmp / "base")
    cfg = write_config(tmp, base)
    assert main(["run", str(cfg)]) == 0
    return tmp / "rlhf", base, cfg


def test_each_stage_feeds_the_next(rlhf):
    root, base, _ = rlhf
    s = json.loads((root / "summary.json").read_text())
    assert [st["name"] for st in s["stages"]] == ["sft", "reward", "rl"] and s["method"] == "stages"
    sft, reward, rl = s["stages"]
    assert sft["input_model"] == str(base)
    assert reward["input_model"] == str(root / "sft" / "model")  # the reward model starts from the SFT model
    assert rl["input_model"] == str(root / "sft" / "model") and rl["reward_model"] == str(root / "reward" / "model")
    assert s["final_model"] == str(root / "rl" / "model") and (root / "rl" / "model" / "model.safetensors").exists()
    for st in s["stages"]:
        assert (root / st["name"] / "summary.json").exists() and st["train"]["global_step"] == 4 and st["final"]
    resolved = yaml.safe_load((root / "rl" / "config.resolved.yaml").read_text())
    assert resolved["method"]["name"] == "rl" and resolved["method"]["rl"]["reward_model"] == str(root / "reward" / "model")
    assert resolved["stages"] is None and resolved["output_dir"] == str(root / "rl")


def test_lineage_in_the_manifests(rlhf):
    import hashlib

    root, base, _ = rlhf
    lin = {n: json.loads((root / n / "manifest.json").read_text())["lineage"] for n in ("sft", "reward", "rl")}
    assert lin["sft"]["input_model"]["produced_by"] == "the run's model" and lin["sft"]["index"] == 0 and lin["sft"]["stages"] == 3
    sft_manifest = json.loads((root / "sft" / "manifest.json").read_text())
    for n in ("reward", "rl"):
        inp = lin[n]["input_model"]
        assert inp["path"] == str(root / "sft" / "model") and inp["produced_by"] == "stage sft"
        assert inp["run_config_hash"] == sft_manifest["config_hash"]
        weights = (root / "sft" / "model" / "model.safetensors").read_bytes()
        assert inp["weights_sha256"]["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    assert lin["rl"]["reward_model"]["produced_by"] == "stage reward" and lin["sft"]["reward_model"] is None


def test_resume_keeps_finished_stages(rlhf, capsys):
    root, _, cfg = rlhf
    before = {n: (root / n / "model" / "model.safetensors").stat().st_mtime_ns for n in ("sft", "reward", "rl")}
    assert main(["run", str(cfg), "--resume"]) == 0
    s = json.loads((root / "summary.json").read_text())
    assert all(st["kept_from_earlier_run"] for st in s["stages"])
    assert before == {n: (root / n / "model" / "model.safetensors").stat().st_mtime_ns for n in ("sft", "reward", "rl")}
    assert "finished earlier, kept" in capsys.readouterr().out
    assert main(["run", str(cfg)]) == 2  # neither --resume nor --overwrite: the earlier run is not touched
    # an unfinished last stage (no summary, no export, and so no cache entry of its DAG train step: pipeline/dag.py saves
    # the entry after the stage's run finished) continues from its newest checkpoint; the others stay kept
    import shutil

    from trainpipe.pipeline.cache import StepCache

    rl_train = next(s for s in json.loads((root / "pipeline.json").read_text())["steps"] if s["id"] == "rl.train")
    (root / ".trainpipe-store" / StepCache.entry_key("train", rl_train["key"])).unlink()
    (root / "rl" / "summary.json").unlink()
    shutil.rmtree(root / "rl" / "model")
    assert main(["run", str(cfg), "--resume"]) == 0
    s = json.loads((root / "summary.json").read_text())
    assert [st["kept_from_earlier_run"] for st in s["stages"]] == [True, True, False]
    events = [json.loads(x) for x in (root / "rl" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "checkpoint_resumed" and e["step"] == 4 for e in events)
    assert (root / "rl" / "model" / "model.safetensors").exists() and json.loads((root / "rl" / "manifest.json").read_text())["lineage"]["stage"] == "rl"


def test_stage_plan_merges_and_chains(tmp_path):
    from trainpipe.pipeline.stages import stage_plan

    cfg = build_config({
        "model": {"name_or_path": "org/base"}, "data": {"sources": [{"path": "a.jsonl"}]},
        "method": {"peft": "lora", "lora": {"r": 4}, "rl": {"kl_coef": 0.1}}, "training": {"learning_rate": 1e-4},
        "stages": ["sft", {"name": "rm", "method": {"name": "reward", "lora": {"r": 8}}, "training": {"learning_rate": 1e-5}},
                   {"method": {"name": "rl", "rl": {"reward_function": "m:f"}}}, "sft", "rl"],
    })
    plan = stage_plan(cfg, tmp_path)
    assert [p["name"] for p in plan] == ["sft", "rm", "rl", "sft-2", "rl-2"]
    sft, rm, rl, sft2, rl2 = (p["config"] for p in plan)
    assert rm.method.lora.r == 8 and sft.method.lora.r == 4 and rm.training.learning_rate == 1e-5 and sft.training.learning_rate == 1e-4
    assert rl.method.rl.reward_function == "m:f" and rl.method.rl.reward_model is None and rl.method.rl.kl_coef == 0.1  # its own reward kept
    assert rl2.method.rl.reward_model == str(tmp_path / "rm" / "model")
    assert rm.model.name_or_path == rl.model.name_or_path == str(tmp_path / "sft" / "model")
    assert sft2.model.name_or_path == str(tmp_path / "rl" / "model") and rl2.model.name_or_path == str(tmp_path / "sft-2" / "model")
    assert all(p["config"].stages is None and p["config"].output_dir == str(tmp_path / p["name"]) for p in plan)
