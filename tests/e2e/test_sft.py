"""End to end through the CLI on a tiny Llama built in the test: artefact contract, learning, export."""

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, chat_records, write_jsonl
from trainpipe.cli import main
from trainpipe.config import load_config

pytestmark = pytest.mark.e2e


def make_config(tmp: Path, model_dir: Path, **overrides) -> Path:
    write_jsonl(tmp / "data" / "alpaca.jsonl", alpaca_records(240, seed=5))
    write_jsonl(tmp / "data" / "chat.jsonl", chat_records(120, seed=6))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "data/alpaca.jsonl"}, {"path": "data/chat.jsonl", "format": "chat"}], "eval_split": 36, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "training": {"max_steps": 40, "eval_steps": 10, "logging_steps": 5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss", "perplexity", "exact_match"], "max_new_tokens": 12},
        "output_dir": str(tmp / "run"),
    }
    for k, v in overrides.items():
        node = cfg
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny_model(tmp / "base")
    cfg = make_config(tmp, model_dir)
    rc = main(["run", str(cfg)])
    assert rc == 0
    return tmp / "run", model_dir, cfg


def test_artefact_contract(lora_run):
    run, _, cfg_path = lora_run
    for name in ("config.resolved.yaml", "manifest.json", "events.jsonl", "metrics.jsonl", "summary.json", "data_report.json", "checkpoints", "model", "model/adapter"):
        assert (run / name).exists(), name
    assert not (run / "model.tmp").exists()
    resolved = load_config(run / "config.resolved.yaml")
    assert resolved.training.learning_rate == 3e-3 and resolved.training.bf16 is False
    manifest = json.loads((run / "manifest.json").read_text())
    assert len(manifest["config_hash"]) == 64
    assert [len(f["sha256"]) for f in manifest["data_files"]] == [64, 64]
    assert set(manifest["packages"]) >= {"torch", "transformers", "peft", "trl", "datasets"}
    assert manifest["seed"] == 42 and manifest["hardware"]["accelerator"] == "cpu"
    assert {"commit", "dirty"} <= set(manifest["git"]) and manifest["trainpipe_version"]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    for needed in ("training_started", "eval_done", "checkpoint_saved", "training_finished", "model_exported"):
        assert needed in names, needed
    assert names.index("training_started") < names.index("training_finished") < names.index("model_exported")
    assert all("time" in e and isinstance(e["step"], int) for e in events)
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saves] == [0, 10, 20, 30, 40]  # step 0: the rollback target
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in m for m in metrics) and any("eval_loss" in m for m in metrics)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["baseline"]) == set(summary["final"]) == {"loss", "perplexity", "exact_match"}
    # the best checkpoint (by eval loss) survives save_total_limit
    best = summary["train"]["best_checkpoint"]
    assert Path(best).exists()
    assert (run / "model" / "model.safetensors").exists() and not list((run / "model").glob("*.bin"))


def test_eval_loss_falls_below_baseline(lora_run):
    summary = json.loads((lora_run[0] / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.2
    evals = [json.loads(x) for x in (lora_run[0] / "events.jsonl").read_text().splitlines() if '"eval_done"' in x]
    assert [e["phase"] for e in evals][0] == "baseline" and evals[-1]["phase"] == "final"


def test_lora_parameters_changed_and_frozen_ones_did_not(lora_run):
    import torch
    from safetensors.torch import load_file

    run, base_dir, _ = lora_run
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_file(str(run / "model" / "model.safetensors"))
    adapter = load_file(str(run / "model" / "adapter" / "adapter_model.safetensors"))
    acfg = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
    scale = acfg["lora_alpha"] / acfg["r"]
    pairs = {}
    for k, v in adapter.items():
        assert "lora_" in k
        module = k.split(".lora_")[0].replace("base_model.model.", "")
        pairs.setdefault(module, {})["A" if ".lora_A" in k else "B"] = v
    assert len(pairs) == 2 * 4  # 2 layers x q, k, v, o
    for module, ab in pairs.items():
        assert ab["B"].abs().sum() > 0, f"{module}: lora_B never moved from its zero init"
    # frozen base weights unchanged: untouched tensors identical, adapted ones equal base + scale * B @ A exactly
    assert set(merged) == set(base)
    for name, w in base.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if module in pairs:
            expected = w + scale * pairs[module]["B"] @ pairs[module]["A"]
            torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
            assert not torch.equal(merged[name], w)
        else:
            assert torch.equal(merged[name], w), f"frozen {name} changed"


def test_lora_A_matrices_moved_from_their_init(lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, set_seed

    from trainpipe.config import LoraConfig
    from trainpipe.model.loading import apply_lora

    run, base_dir, _ = lora_run
    set_seed(42)
    init = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=8, alpha=16, dropout=0.0))
    init_sd = {k: v for k, v in init.state_dict().items() if "lora_A" in k}
    set_seed(42)  # the reconstruction of the pipeline's initial adapter is itself deterministic
    again = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=8, alpha=16, dropout=0.0)).state_dict()
    assert all((again[k] == v).all() for k, v in init_sd.items())
    trained = load_file(str(run / "model" / "adapter" / "adapter_model.safetensors"))
    assert init_sd
    for k, v in init_sd.items():
        key = k.replace(".default", "")
        assert key in trained, key
        assert not (trained[key] == v).all(), f"{key} equals its initial value"
    assert isinstance(init, PeftModel)


def test_exported_model_loads_with_plain_transformers_and_generates(lora_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = lora_run[0] / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say apple then river."}], tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


def test_rerun_into_used_dir_refused_then_overwrite(lora_run, capsys):
    _, _, cfg = lora_run
    assert main(["run", str(cfg)]) == 2
    assert "--overwrite" in capsys.readouterr().out


def test_full_finetune_learns_and_changes_every_parameter(tmp_path):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "base")
    cfg = make_config(tmp_path, model_dir, **{"method.peft": "none", "training.max_steps": 20, "training.learning_rate": 2e-3, "eval.metrics": ["loss"]})
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"]
    assert not (run / "model" / "adapter").exists()
    base = load_file(str(model_dir / "model.safetensors"))
    trained = load_file(str(run / "model" / "model.safetensors"))
    for name, w in base.items():
        assert not torch.equal(trained[name], w), f"{name} did not change"
    assert summary["parameters"]["trainable"] == summary["parameters"]["total"]


def test_early_stopping_with_patience(tmp_path):
    # lr so small that fp32 weights cannot move: eval loss never improves after the first eval
    model_dir = build_tiny_model(tmp_path / "base")
    cfg = make_config(tmp_path, model_dir, **{"training.learning_rate": 1e-12, "training.early_stopping_patience": 1, "eval.metrics": ["loss"]})
    assert main(["run", str(cfg)]) == 0
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    stopped = [e for e in events if e["event"] == "early_stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] == 20
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["train"]["stopped_early"] and summary["train"]["global_step"] == 20
    assert summary["train"]["best_checkpoint"].endswith("step-10")


def test_same_seed_same_weights_to_the_bit(tmp_path):
    import torch
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path / "base")
    weights = []
    for i in range(2):
        d = tmp_path / f"r{i}"
        d.mkdir()
        cfg = make_config(d, model_dir, **{"training.max_steps": 10, "training.eval_steps": 5, "eval.metrics": ["loss"]})
        assert main(["run", str(cfg)]) == 0
        weights.append(load_file(str(d / "run" / "model" / "adapter" / "adapter_model.safetensors")))
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
