"""Every `method.peft` learns, end to end through the CLI on the tiny Llama (CPU):

- SFT eval loss falls below the untrained model's;
- every trainable tensor moved from its initial value (the step-0 checkpoint holds it), and the frozen
  weights did not (the exported weights equal the base's outside the adapted modules);
- the exported folder loads with plain transformers and generates; where the adapter is merged, the
  merged model reproduces the trained model's eval loss; prompt/prefix tuning reload with PEFT.

Also: gradient accumulation is exact (8 x 1 and 2 x 4 give the same losses and weights), and the
PEFT bad-input errors come before any weights are read.
"""

import json
import sys
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tokenizer, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

# method -> (learning rate, extra `method` keys)
METHODS = {
    "none": (2e-3, {}),
    "freeze": (2e-3, {"freeze": {"trainable_layers": 1}}),
    "lora": (5e-3, {}),
    "rslora": (5e-3, {}),
    "dora": (5e-3, {}),
    "qlora": (5e-3, {}),
    "qlora8": (5e-3, {}),
    "ia3": (1e-1, {}),
    "prompt_tuning": (1e-1, {"prompt_tuning": {"num_virtual_tokens": 16, "init_text": "Reverse the order of the words."}}),
    "prefix_tuning": (6e-2, {"prompt_tuning": {"num_virtual_tokens": 4}}),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_config(tmp: Path, model_dir: Path, peft: str, *, steps: int = 24, lr: float | None = None, method: dict | None = None,
                 training: dict | None = None, eval_cfg: dict | None = None) -> Path:
    write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(160, seed=5))
    rate, extra = METHODS.get(peft, (5e-3, {}))
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 24, "max_length": 64,
                 "dedup": {"near": False}, "decontamination": {"enabled": False}},
        "method": {"peft": peft, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, **extra, **(method or {})},
        "training": {"max_steps": steps, "eval_steps": steps, "logging_steps": 1, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "learning_rate": lr or rate, "early_stopping_patience": None,
                     "warmup_steps": 0, "hang_timeout_seconds": 0, **(training or {})},
        "eval": eval_cfg or {"metrics": ["loss"]},
        "output_dir": str(tmp / "run"),
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def eval_examples(run: Path) -> list[dict]:
    """The eval split the run measured, prepared again from its resolved config (the data step is deterministic)."""
    from transformers import AutoTokenizer

    from trainpipe.config import load_config
    from trainpipe.data.prepare import prepare
    from trainpipe.data.tokenize import setup_chat_template

    cfg = load_config(run / "config.resolved.yaml")
    tok = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    template = setup_chat_template(tok, cfg.data.chat_template, cfg.model.name_or_path)
    data = prepare(cfg.data, tok, train_on=cfg.method.train_on, seed=cfg.training.seed, rejected_path=run / "rejected-again.jsonl",
                   template_name=template, for_method="sft")
    return list(data.eval), tok


def generates(model, tok) -> bool:
    import torch

    prompt = tok.apply_chat_template([{"role": "user", "content": "Reverse the order of the words.\n\napple river stone"}], tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return out.shape[1] > enc["input_ids"].shape[1]


@pytest.mark.parametrize("peft", list(METHODS))
def test_method_learns_changes_only_its_parameters_and_exports(peft, tiny_model_dir, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainpipe.evaluate.evaluator import eval_loss

    # prompt/prefix tuning also generate in the eval (exact_match): virtual tokens through evaluator.generate
    ev = {"metrics": ["loss", "exact_match"], "max_new_tokens": 4, "max_samples": 4} if peft in ("prompt_tuning", "prefix_tuning") else None
    assert main(["run", str(write_config(tmp_path, tiny_model_dir, peft, eval_cfg=ev))]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("never into quantized weights") == (1 if peft in ("qlora", "qlora8") else 0)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    if (run / "model" / "adapter").is_dir():
        acfg = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
        assert acfg.get("use_rslora", False) == (peft == "rslora") and acfg.get("use_dora", False) == (peft == "dora")
        assert acfg["peft_type"] == {"ia3": "IA3", "prompt_tuning": "PROMPT_TUNING", "prefix_tuning": "PREFIX_TUNING"}.get(peft, "LORA")

    # 1. it learned (eval is deterministic, so any drop is real; the few-hundred-parameter methods move less in 24 steps)
    drop = 0.05 if peft in ("ia3", "prompt_tuning", "prefix_tuning") else 0.2
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - drop, (summary["baseline"], summary["final"])

    # 2. every trainable tensor moved from its initial value (step-0 checkpoint) -- and only the method's tensors train
    initial = load_file(str(run / "checkpoints" / "step-0" / "weights.safetensors"))
    best = load_file(str(Path(summary["train"]["best_checkpoint"]) / "weights.safetensors"))
    assert set(initial) == set(best) and initial
    for name, w in initial.items():
        assert not torch.equal(best[name], w), f"{peft}: trainable {name} did not move"
    trainable = set(initial)
    if peft == "none":
        assert summary["parameters"]["trainable"] == summary["parameters"]["total"]
    elif peft == "freeze":
        assert all(n.startswith(("model.layers.1.", "model.norm.")) for n in trainable), trainable
        assert any(n.startswith("model.layers.1.") for n in trainable) and "model.norm.weight" in trainable
    elif peft in ("lora", "rslora", "dora", "qlora", "qlora8"):
        assert all("lora_" in n for n in trainable), trainable
        assert {n.split(".")[-4] for n in trainable if "lora_A" in n} == set(ATTENTION)
        assert any("lora_magnitude_vector" in n for n in trainable) == (peft == "dora")
    elif peft == "ia3":
        assert {n.split(".")[-3] for n in trainable} == {"k_proj", "v_proj", "down_proj"}, trainable
    else:
        assert trainable == {"prompt_encoder.default.embedding.weight"}
    params = summary["parameters"]
    assert 0 < params["trainable"] <= params["total"] and params["trainable_pct"] == round(100 * params["trainable"] / params["total"], 4)

    # 3. frozen weights unchanged: outside the adapted modules, the exported weights are the base's to the bit
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    exported = load_file(str(run / "model" / "model.safetensors"))
    assert set(exported) == set(base)
    adapted = {
        "none": lambda n: True,
        "freeze": lambda n: n.startswith(("model.layers.1.", "model.norm.")),
        "ia3": lambda n: any(f".{m}." in n for m in ("k_proj", "v_proj", "down_proj")),
        "prompt_tuning": lambda n: False,
        "prefix_tuning": lambda n: False,
    }.get(peft, lambda n: any(f".{m}." in n for m in ATTENTION))
    for name, w in base.items():
        if adapted(name):
            assert not torch.equal(exported[name], w), f"{peft}: {name} should carry the training"
        else:
            assert torch.equal(exported[name], w), f"{peft}: frozen {name} changed"

    # 4. the export loads with plain transformers, generates, and (merged) reproduces the trained model's eval loss
    assert (run / "model" / "adapter").is_dir() == (peft not in ("none", "freeze"))
    assert not list((run / "model").rglob("*.bin"))
    examples, tok = eval_examples(run)
    plain = AutoModelForCausalLM.from_pretrained(run / "model")
    assert generates(plain, tok)
    card = (run / "model" / "README.md").read_text()
    assert "## Loading" in card
    if peft in ("prompt_tuning", "prefix_tuning"):
        from peft import PeftModel

        assert 0.0 <= summary["final"]["exact_match"] <= 1.0 and len(summary["samples"]) == 4

        assert "PeftModel.from_pretrained" in card
        model = PeftModel.from_pretrained(plain, run / "model" / "adapter")
        assert generates(model, tok)
    else:
        model = plain
    reloaded = eval_loss(model, examples, batch_size=8, pad_id=tok.pad_token_id)["loss"]
    # qlora: the adapter was trained on a quantized base and merged into the unquantized one (measured: 1.3e-4 for
    # 4-bit, 3e-5 for 8-bit; the others agree to float32 rounding)
    tol = 2e-3 if peft in ("qlora", "qlora8") else 1e-5
    assert abs(reloaded - summary["final"]["loss"]) < tol, (reloaded, summary["final"]["loss"])


def test_qlora_base_really_is_4bit_nf4_with_double_quantization(tiny_model_dir):
    import bitsandbytes as bnb

    from trainpipe.config import MethodConfig, ModelConfig
    from trainpipe.model.loading import build_model

    model = build_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32"), MethodConfig(peft="qlora"))
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q, bnb.nn.Linear4bit)
    assert q.weight.quant_state.quant_type == "nf4" and q.weight.quant_state.nested  # double quantization
    assert q.compute_dtype is not None


def test_gradient_accumulation_is_exact(tiny_model_dir, tmp_path):
    """8 x 1 and 2 x 4: the same examples per step, the loss the sum over the window / its loss tokens."""
    from safetensors.torch import load_file

    runs = []
    for micro, accum in ((8, 1), (2, 4)):
        tmp = tmp_path / f"b{micro}x{accum}"
        # full fine-tune, every weight compared; lr small enough that Adam's m/sqrt(v) does not blow float32 rounding of
        # near-zero gradient entries up past 1e-5 (at 2e-3 one entry of 300k reaches 1.3e-5; the losses agree to 1e-6)
        cfg = write_config(tmp, tiny_model_dir, "none", steps=8, lr=1e-3,
                           training={"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, "max_recoveries": 0})
        assert main(["run", str(cfg)]) == 0
        losses = [m["loss"] for m in map(json.loads, (tmp / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
        runs.append((losses, load_file(str(tmp / "run" / "model" / "model.safetensors"))))
    (l1, w1), (l2, w2) = runs
    assert len(l1) == len(l2) == 8
    assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-5, (l1, l2)
    assert l1[-1] < l1[0]
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst


# ------------------------------------------------------------------------------ bad input


def config_only_model(path: Path, config: dict) -> Path:
    """A model folder with a config.json and a tokenizer but no weights: an error here proves it came first."""
    path.mkdir(parents=True)
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 356, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def test_target_modules_naming_no_module_lists_the_ones_that_exist(tmp_path, capsys):
    model = config_only_model(tmp_path / "m", LLAMA)
    cfg = write_config(tmp_path, model, "lora", method={"lora": {"target_modules": ["q_proj", "query"]}})
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    # the planner (plan/catalog.py) or check_peft (train/model.py) says it first, both before any weights load
    assert "`query`" in out or "['query']" in out
    for name in ("q_proj", "k_proj", "down_proj"):
        assert name in out


def test_check_peft_lists_the_module_names_that_exist(tmp_path):
    from trainpipe.config import MethodConfig, ModelConfig
    from trainpipe.errors import ModelLoadError
    from trainpipe.model.loading import check_peft

    model = config_only_model(tmp_path / "m", LLAMA)
    with pytest.raises(ModelLoadError) as err:
        check_peft(ModelConfig(name_or_path=str(model)), MethodConfig(peft="dora", lora={"target_modules": ["q_proj", "query"]}))
    msg = err.value.message
    assert "`method.lora.target_modules` names ['query']" in msg
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        assert name in msg


def test_ia3_target_modules_naming_no_module(tmp_path, capsys):
    model = config_only_model(tmp_path / "m", LLAMA)
    cfg = write_config(tmp_path, model, "ia3", method={"ia3": {"target_modules": ["fc9"]}})
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`method.ia3.target_modules` names ['fc9']" in out and "mlp.down_proj" in out


def test_freeze_more_layers_than_the_model_has(tmp_path, capsys):
    model = config_only_model(tmp_path / "m", LLAMA)
    cfg = write_config(tmp_path, model, "freeze", method={"freeze": {"trainable_layers": 5}})
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`method.freeze.trainable_layers` is 5" in out and "has 2 blocks" in out


def test_prefix_tuning_on_an_architecture_without_kv_cache(tmp_path, capsys):
    mamba = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "vocab_size": 356, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}
    model = config_only_model(tmp_path / "m", mamba)
    cfg = write_config(tmp_path, model, "prefix_tuning")
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`method.peft: prefix_tuning` does not work with `mamba`" in out and "prompt_tuning" in out


def test_qlora_without_bitsandbytes(tmp_path, capsys, monkeypatch):
    model = config_only_model(tmp_path / "m", LLAMA)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError, as when not installed
    cfg = write_config(tmp_path, model, "qlora")
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "pip install 'trainpipe[qlora]'" in out and "bitsandbytes" in out


# ------------------------------------------------------------------------------ optimizers


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"])
def test_optimizer_learns(optim, tiny_model_dir, tmp_path, capsys):
    import torch

    # a full fine-tune: bitsandbytes quantizes the state of tensors of 4096+ elements, so the tiny model's matrices qualify
    lr = {"sgd": 1e-1, "adafactor": 1e-3}.get(optim, 2e-3)
    cfg = write_config(tmp_path, tiny_model_dir, "none", lr=lr, training={"optim": optim})
    assert main(["run", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # paged optimizers page state between GPU and CPU memory: on the CPU one warning, and the unpaged 8-bit AdamW
    assert out.count("nothing to page") == (1 if optim == "paged_adamw_8bit" else 0)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"] - 0.2, (summary["baseline"], summary["final"])
    state = torch.load(Path(summary["train"]["best_checkpoint"]) / "state.pt", weights_only=True)["optimizer"]["state"]
    if optim.endswith("adamw_8bit"):
        # the moments of the big matrices really are 8-bit (bitsandbytes keeps tensors under 4096 elements in fp32)
        moments = [s["__bnb_optimizer_quant_state__"]["state1"] for s in state.values()]
        assert any(m.dtype == torch.uint8 for m in moments) and any(m.dtype == torch.float32 for m in moments)


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("peft,optim", [("none", "adamw_8bit"), ("qlora", "adamw_torch"), ("prompt_tuning", "adamw_torch")])
def test_resume_is_bit_identical(peft, optim, tiny_model_dir, tmp_path):
    """Quantized optimizer state, a 4-bit base, a soft prompt: all resume to the bit. The run is cut back to its
    step-4 checkpoint (as a kill after that save leaves it) and resumed; step 8 must equal the uninterrupted step 8."""
    import shutil

    import torch
    from safetensors.torch import load_file

    def step8(tmp: Path, cut: bool) -> dict:
        cfg = write_config(tmp, tiny_model_dir, peft, steps=8, training={"eval_steps": 4, "optim": optim})
        assert main(["run", str(cfg)]) == 0
        run = tmp / "run"
        if cut:
            for p in (run / "summary.json", run / "model", run / "checkpoints" / "step-8"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            assert main(["run", str(cfg), "--resume"]) == 0
            resumed = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if '"checkpoint_resumed"' in x]
            assert [e["step"] for e in resumed] == [4]
        return load_file(str(run / "checkpoints" / "step-8" / "weights.safetensors"))

    a, b = step8(tmp_path / "straight", cut=False), step8(tmp_path / "resumed", cut=True)
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_prefix_tuning_with_gradient_checkpointing_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_model_dir, "prefix_tuning", steps=2, training={"gradient_checkpointing": True})
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "cannot train with gradient checkpointing" in out and "`training.gradient_checkpointing: false`" in out


def test_prompt_tuning_on_packed_rows_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_model_dir, "prompt_tuning", steps=2)
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["packing"] = "pack"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "cannot train on packed rows" in out and "`data.packing: none`" in out
