"""AutoML pieces that need no training: the frozen-key guard, the catalogue candidates (filtered by size, GPU and budget,
never silently dropped), the planned cost of every rung, and bad input refused with one paragraph."""

import pytest

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main
from trainpipe.errors import ConfigError
from trainpipe.tune import automl as A


def test_frozen_keys_cannot_be_proposed():
    A.check_proposal({"training.learning_rate": 1e-4, "method.lora.r": 8, "training.weight_decay": 0.0, "training.warmup_ratio": 0.05})
    for key in ("data.max_length", "data.sources", "eval.metrics", "training.max_steps", "training.eval_steps", "training.seed",
                "objective", "metric", "budget_hours", "max_wall_time", "automl.min_steps"):
        with pytest.raises(ConfigError, match="fixed for the whole search"):
            A.check_proposal({key: 1})
    with pytest.raises(ConfigError, match="may not change"):
        A.check_proposal({"distributed.strategy": "ddp"})


def test_catalogue_candidates_are_listed_with_plan_and_reason(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=1))
    base = A.base_mapping("sft", data, 8, 64, None)
    entries, local = A.parse_models([f"Qwen/Qwen2.5-0.5B={tiny_model_dir}"], None)
    cands = A.candidates("sft", entries, local, base, use_catalog=True, gpu="A10G", gpus=1, max_params=2e9, batch=8)
    by = {c["model"]: c for c in cands}
    # every causal-lm catalogue model is listed, none dropped; masked-lm/seq2seq ones are not of this task's kind
    from trainpipe.plan.catalog import _data

    kinds = {e["id"]: e["task"] for e in _data("models.json")["models"]}
    assert set(by) == {i for i, t in kinds.items() if t == "causal-lm"}
    q = by["Qwen/Qwen2.5-0.5B"]  # a catalogue id trained from a local folder: planned as the catalogue model, and as what trains
    assert q["trained"] and q["weights"] == str(tiny_model_dir) and q["catalogue_plan"]["params"] > 4e8 and q["params"] < 1e7
    small = by["HuggingFaceTB/SmolLM-360M"]
    assert not small["trained"] and small["reason"] == A.NO_WEIGHTS and small["method"] and small["memory_gib"] > 0
    big = by["meta-llama/Llama-3.1-70B"]
    assert not big["trained"] and "automl.max_params" in big["reason"]
    # without automl.max_params the GPU decides: a 70B model does not fit one A10G under any method
    cands = A.candidates("sft", [], {}, base, use_catalog=True, gpu="A10G", gpus=1, max_params=None, batch=8)
    big = next(c for c in cands if c["model"] == "meta-llama/Llama-3.1-70B")
    assert not big["trained"] and big["reason"].startswith("does not fit 1 x A10G") and big["memory_gib"] > 24
    # the method is the planner's: a 13B model on a 24 GB GPU is QLoRA, an 8B one LoRA (bf16 weights fit), a 135M one LoRA or full
    assert next(c for c in cands if c["model"] == "meta-llama/Llama-2-13b-hf")["method"] == "qlora"
    assert next(c for c in cands if c["model"] == "meta-llama/Llama-3.1-8B")["method"] == "lora"
    assert next(c for c in cands if c["model"] == "HuggingFaceTB/SmolLM-135M")["method"] in ("lora", "none")
    # 8 A100s fit what one A10G cannot
    cands = A.candidates("sft", [], {}, base, use_catalog=True, gpu="A100-80GB", gpus=8, max_params=None, batch=8)
    assert next(c for c in cands if c["model"] == "meta-llama/Llama-3.1-70B")["fits"]


def test_planned_cost_of_every_rung():
    prices = [{"usd": 3.0}, {"usd": 6.0}, {"usd": 9.0}, {"usd": 12.0}]  # 4 arms, rung 0 of 3 steps: $1, 2, 3, 4 per step
    # rung 0: all four x 3 steps = 30; rung 1 (6 steps): the 2 dearest survive for 3 more steps = 21; rung 2: 1 for 6 more = 24
    assert A._planned_total(prices, [3, 6, 12], 2) == pytest.approx(30 + 21 + 24)


def test_bad_input_is_one_paragraph(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(20, seed=1))
    base = ["--set", f"automl.data={data}", "--set", f"automl.models={tiny_model_dir}"]
    cases = [
        (["--set", "automl.task=summarize", *base], "must be one of"),
        (["--set", "automl.task=sft", "--set", f"automl.data={tmp_path / 'nope.jsonl'}", "--set", f"automl.models={tiny_model_dir}"], "does not exist"),
        (["--set", "automl.task=sft", "--set", f"automl.data={data}"], "needs candidate base models"),
        (["--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", f"automl.models=x={tmp_path}"], "not a model folder"),
        (["--set", "automl.task=sft", *base, "--set", "automl.lr_range=1e-3:1e-4"], "LOW:HIGH"),
        (["--set", "automl.task=sft", *base, "--set", "automl.eta=1"], "greater than or equal to 2"),
        (["--set", "automl.task=sft", *base, "--set", "automl.budget_usd=1"], "set `automl.gpu`"),
        (["--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", "automl.catalog=true"], "bound it with `automl.max_params`"),
        (["--set", "task=sft", *base], "give its keys as `--set automl.KEY=VALUE`"),
    ]
    for args, want in cases:
        assert main(["automl", *args, "--set", f"automl.output_dir={tmp_path / 'o'}"]) == 2, args
        out = " ".join(capsys.readouterr().out.split())
        assert want in out and "Traceback" not in out, (args, out)
    assert not (tmp_path / "o").exists()


def test_the_automl_section_of_a_config_file(tmp_path, capsys):
    """`trainpipe automl CONFIG` reads the file's `automl:` section (relative paths from the file's folder), `--set` wins over
    it, and a file without the section is one paragraph."""
    (tmp_path / "proj" / "model").mkdir(parents=True)
    (tmp_path / "proj" / "automl.yaml").write_text("automl:\n  data: train.jsonl\n  models: [model, Qwen/Qwen2.5-0.5B]\n  eta: 3\n")
    a = A.load_automl(tmp_path / "proj" / "automl.yaml", ["automl.rungs=2", "automl.eta=4"])
    assert a.data == str(tmp_path / "proj" / "train.jsonl") and a.models == [str(tmp_path / "proj" / "model"), "Qwen/Qwen2.5-0.5B"]
    assert (a.eta, a.rungs, a.task) == (4, 2, "sft")
    (tmp_path / "run.yaml").write_text("model: {name_or_path: x}\n")
    assert main(["automl", str(tmp_path / "run.yaml")]) == 2
    assert "has no `automl:` section" in " ".join(capsys.readouterr().out.split())
