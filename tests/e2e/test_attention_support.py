"""`model.attn_implementation` respects what the model supports and runs no code unasked (issue 36).

A tiny Gemma 2 (attention soft-capping, which transformers' SDPA path refuses) trains on the CPU with `auto`, as LoRA and
as a full fine-tune: `auto` picks `eager` and the run names the rule. An explicit `sdpa` for it, an unpinned Hub kernel
and a pinned one while offline are each one paragraph, exit 2, before any weights load.
"""

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tokenizer, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> Path:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = tmp_path_factory.mktemp("models") / "tiny-gemma2"
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=32,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert cfg.attn_logit_softcapping is not None
    Gemma2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _config(tmp: Path, model: Path, peft: str, **model_keys) -> Path:
    write_jsonl(tmp / "train.jsonl", alpaca_records(48, seed=2))
    cfg = {"model": {"name_or_path": str(model), **model_keys}, "data": {"sources": [{"path": str(tmp / "train.jsonl")}], "eval_split": 8, "max_length": 64},
           "method": {"peft": peft, **({"lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if peft == "lora" else {})},
           "training": {"max_steps": 6, "eval_steps": 6, "save_steps": 6, "logging_steps": 1, "per_device_train_batch_size": 4,
                        "gradient_accumulation_steps": 1, "learning_rate": 3e-3, "early_stopping_patience": None},
           "eval": {"metrics": ["loss"]}, "output_dir": str(tmp / "run")}
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("peft", ["lora", "none"])
def test_gemma2_trains_on_the_cpu_with_auto(tmp_path, gemma2, peft, capsys):
    cfg = _config(tmp_path, gemma2, peft)
    assert main(["run", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "attn_logit_softcapping" in out, out[-2000:]  # the decision and its rule, printed at the start
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x and '"eval' not in x]
    assert len(losses) >= 4 and losses[-1] < losses[0], losses
    resolved = yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())
    assert resolved["model"]["attn_implementation"] == "eager"


@pytest.mark.parametrize("impl, words", [
    ("sdpa", "soft-caps its attention scores"),
    ("kernels-community/flash-attn2", "pinned revision"),
    ("kernels-community/flash-attn2@" + "a" * 40, "HF_HUB_OFFLINE"),
])
def test_an_unsupported_explicit_choice_is_one_paragraph(tmp_path, gemma2, impl, words, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _config(tmp_path, gemma2, "lora", attn_implementation=impl)
    assert main(["run", str(cfg)]) == 2
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert words in " ".join(text.split()) and "Traceback" not in text, text[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
