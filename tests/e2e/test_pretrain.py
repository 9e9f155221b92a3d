"""`method.name: pretrain` end to end through the CLI: held-out perplexity falls on packed raw text, a vocabulary
extension keeps the old token embeddings equal to the base's (and each new token is one id), and a model built
from scratch with `model.init_from_config` learns too."""

import json
import random
from pathlib import Path

import pytest
import yaml

from tiny import WORDS, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

NEW = ["<gene>", "<prot>"]


def text_records(n: int, seed: int) -> list[dict]:
    """Raw text with structure to learn: short runs of words, new marker tokens between them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.sample(WORDS[:8], 3)
        b = rng.sample(WORDS[8:], 3)
        out.append({"text": f"{' '.join(a)} <gene> {' '.join(b)} <prot> {a[0]}"})
    return out


def write_config(tmp: Path, model_dir: Path, *, method: dict, model: dict | None = None, steps: int = 24, lr: float = 3e-3) -> Path:
    write_jsonl(tmp / "data" / "text.jsonl", text_records(200, seed=3))
    cfg = {
        "model": {"name_or_path": str(model_dir), **(model or {})},
        "data": {"sources": [{"path": "data/text.jsonl", "format": "text"}], "eval_split": 24, "max_length": 64, "packing": "pack",
                 "dedup": {"near": False}, "decontamination": {"enabled": False}},
        "method": {"name": "pretrain", **method},
        "training": {"max_steps": steps, "eval_steps": steps // 2, "logging_steps": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                     "learning_rate": lr, "early_stopping_patience": None, "warmup_steps": 0},
        "output_dir": str(tmp / "run"),
    }
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_packed_loss_equals_unpacked(tiny_model_dir, tiny_tokenizer):
    """Packed rows (position ids restarting per text, no attention mask) give the same summed loss and loss-token
    count as the same texts padded one per row, through the loop's own collator and objective."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainpipe.data.packing import pack
    from trainpipe.train.objectives import TokenCrossEntropy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rows = []
    for r in text_records(6, seed=9):
        ids = tiny_tokenizer(r["text"] + tiny_tokenizer.eos_token, add_special_tokens=False).input_ids
        rows.append({"input_ids": ids, "labels": list(ids)})
    obj = TokenCrossEntropy(tiny_tokenizer.pad_token_id)
    packed = pack(rows, 64)
    assert len(packed) < len(rows)
    # unpacked, the first token of every text is never a target; packing masks it explicitly
    assert obj.weight(packed) == obj.weight(rows)
    with torch.no_grad():
        a, _ = obj.loss_sum(model, obj.collate(packed))
        b, _ = obj.loss_sum(model, obj.collate(rows))
    assert abs(float(a) - float(b)) < 1e-3 * float(b)


@pytest.fixture(scope="module")
def vocab_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    base = build_tiny_model(tmp / "base")
    cfg = write_config(tmp, base, method={"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "pretrain": {"new_tokens": NEW}}, steps=32, lr=5e-3)
    assert main(["run", str(cfg)]) == 0
    return tmp / "run", base


def test_perplexity_falls_with_new_tokens(vocab_run):
    run, _ = vocab_run
    s = json.loads((run / "summary.json").read_text())
    assert s["method"] == "pretrain" and s["data"]["train_examples"] > 100
    assert s["final"]["perplexity"] < 0.6 * s["baseline"]["perplexity"], (s["baseline"], s["final"])
    assert s["vocabulary"]["size_after"] == s["vocabulary"]["size_before"] + 2 and s["vocabulary"]["new_tokens"] == NEW
    assert json.loads((run / "data_report.json").read_text())["batching"]["mode"] == "pack"


def test_vocab_extension_keeps_old_rows(vocab_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, base_dir = vocab_run
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    out = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    old = base.get_input_embeddings().weight
    new = out.get_input_embeddings().weight
    n = old.shape[0]
    assert new.shape[0] == n + 2 and out.config.vocab_size == n + 2
    assert torch.equal(new[:n], old[:n])  # every old token's embedding is exactly the base's
    mean = old.mean(dim=0)
    assert all((new[i] - mean).abs().max() > 1e-3 for i in (n, n + 1))  # the new rows trained away from their mean init
    # the exported tokenizer has the new tokens, each one id, and the model generates with them
    ids = tok("apple <gene> river<prot>", add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids(NEW) == [n, n + 1] and n in ids and n + 1 in ids
    gen = out.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > len(ids)


def test_init_from_config_trains_from_scratch(tmp_path, tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    cfg = write_config(tmp_path, tiny_model_dir, method={"peft": "none"}, model={"init_from_config": str(tiny_model_dir / "config.json")}, steps=16, lr=3e-3)
    assert main(["run", str(cfg)]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["init"] == "from_config"
    assert s["final"]["perplexity"] < 0.6 * s["baseline"]["perplexity"], (s["baseline"], s["final"])
    # random init, not the weights in name_or_path: the baseline is near-uniform over the vocabulary
    assert s["baseline"]["perplexity"] > 200
    w0 = load_file(str(tiny_model_dir / "model.safetensors"))
    w1 = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    assert w1[key].shape == w0[key].shape and not torch.allclose(w1[key], w0[key])


def test_chat_data_is_not_raw_text(tmp_path, tiny_model_dir, capsys):
    from tiny import chat_records

    cfg = write_config(tmp_path, tiny_model_dir, method={"peft": "lora"})
    write_jsonl(tmp_path / "data" / "text.jsonl", chat_records(40, seed=2))
    data = yaml.safe_load(cfg.read_text())
    data["data"]["sources"][0]["format"] = "auto"
    cfg.write_text(yaml.safe_dump(data))
    assert main(["run", str(cfg)]) == 2
    assert "pretrain needs raw text; this data is chat" in capsys.readouterr().out.replace("\n", " ")


def test_extend_embeddings_starts_new_rows_at_the_mean(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainpipe.train.pretrain import extend_embeddings

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    old = model.get_input_embeddings().weight.detach().clone()
    n = old.shape[0]
    tok.add_tokens(NEW)
    info = extend_embeddings(model, tok, [n, n + 1])
    w = model.get_input_embeddings().weight
    assert info["size_before"] == n and info["size_after"] == n + 2 and info["new_tokens"] == NEW
    assert torch.equal(w[:n], old) and torch.allclose(w[n], old.mean(0)) and torch.allclose(w[n + 1], old.mean(0))
    assert model.get_output_embeddings().weight is w  # tied: the head has the same rows


def test_a_resumed_pretrain_rewrites_its_own_base_and_refuses_a_file_added_to_it(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """`base/` (the random-init base exported before training) is the run's only through the files its writer noted
    (issue 36): a resumed run rewrites it; a file a person put into it is named and kept, never deleted."""
    from trainpipe import faults

    cfg = write_config(tmp_path, tiny_model_dir, method={"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
                       model={"init_from_config": str(tiny_model_dir / "config.json")}, steps=4, lr=3e-3)
    monkeypatch.setenv(faults.ENV, json.dumps({"nan_always": True}))  # the first attempt diverges: a run to resume
    assert main(["run", str(cfg)]) != 0
    monkeypatch.delenv(faults.ENV)
    assert (tmp_path / "run" / "base" / "model.safetensors").is_file() and not (tmp_path / "run" / "summary.json").exists()
    (tmp_path / "run" / "base" / "NOTES.md").write_text("mine")
    capsys.readouterr()
    assert main(["run", str(cfg), "--resume"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "NOTES.md" in out and "Traceback" not in out, out[-2000:]
    assert (tmp_path / "run" / "base" / "NOTES.md").read_text() == "mine"
    (tmp_path / "run" / "base" / "NOTES.md").unlink()
    assert main(["run", str(cfg), "--resume"]) == 0, capsys.readouterr().out[-3000:]
    assert (tmp_path / "run" / "base" / "model.safetensors").is_file() and (tmp_path / "run" / "summary.json").is_file()
