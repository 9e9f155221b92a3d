"""Padding-free and packed batches are exact on the CPU: the same loss and gradients as padded batches, for the objectives
that pack (sft, pretrain), with SDPA and eager; eager and SDPA runs train alike.

Real parts only: the tiny Llama of tests/tiny.py, data prepared by trainpipe's own `prepare`, the training objective's
collator and loss (train/objectives.TokenCrossEntropy), and the real `trainpipe run` for the eager-vs-SDPA run.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main
from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.train.objectives import TokenCrossEntropy

pytestmark = pytest.mark.e2e
PL = Path(__file__).resolve().parents[1] / "assets" / "public_like"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


@pytest.fixture(scope="module")
def tok(base):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(base)
    setup_chat_template(t, "auto", "tiny")
    return t


def _model(base, impl):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, attn_implementation=impl, dtype=torch.float32)


def _step(model, tok, rows):
    """One micro-batch as the training loop runs it: mean loss over the labelled tokens and the gradients."""
    obj = TokenCrossEntropy(tok.pad_token_id)
    model.zero_grad()
    loss_sum, _ = obj.loss_sum(model, obj.collate(rows))
    loss = loss_sum / obj.weight(rows)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


def _rows(tmp_path, tok, src, packing, method, **kw):
    cfg = DataConfig(sources=[src], cache_dir=str(tmp_path / f"c-{packing}"), eval_split=2, min_eval_records=1, packing=packing, **kw)
    return list(prepare(cfg, tok, train_on="all" if method == "pretrain" else "assistant", seed=0, for_method=method).train)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padding_free_equals_padded_for_sft_and_pretrain(tmp_path, base, tok, impl):
    model = _model(base, impl)
    sft = {"path": str(write_jsonl(tmp_path / "a.jsonl", alpaca_records(24)))}
    text = {"path": str(PL / "wiki_like.txt"), "format": "text", "split_by": "paragraph"}
    cases = [("sft", sft, {"max_length": 128}), ("pretrain", text, {"max_length": 96, "pretrain_blocks": "document"}),
             ("pretrain", text, {"max_length": 96, "pretrain_blocks": "stream"})]
    for method, src, kw in cases:
        padded, free = _rows(tmp_path, tok, src, "none", method, **kw), _rows(tmp_path, tok, src, "padding_free", method, **kw)
        by_len = sorted(range(len(padded)), key=lambda i: (len(padded[i]["input_ids"]), i))
        pick = sorted({by_len[k * (len(by_len) - 1) // 5] for k in range(6)})  # short to long: a batch that needs padding
        padded, free = [padded[i] for i in pick], [free[i] for i in pick]
        assert [r["input_ids"] for r in padded] == [r["input_ids"] for r in free] and free[0]["padding_free"]
        assert len({len(r["input_ids"]) for r in padded}) > 1, "the batch must need padding for the test to mean anything"
        loss_p, grad_p = _step(model, tok, padded)
        loss_f, grad_f = _step(model, tok, free)
        assert abs(loss_p - loss_f) <= 1e-5, (method, kw, loss_p, loss_f)
        assert (grad_p - grad_f).abs().max().item() <= 1e-5, (method, kw)
        # and examples do not see each other: the same rows joined without the per-example position ids give another loss
        joined = [{"input_ids": sum((r["input_ids"] for r in free), []), "labels": sum((r["labels"] for r in free), [])}]
        assert abs(_step(model, tok, joined)[0] - loss_f) > 1e-3


def test_packed_rows_equal_padded_over_the_split(tmp_path, base, tok):
    """`pack` regroups the examples into rows of max_length: summed over the split, loss and gradients are the padded ones."""
    model = _model(base, "sdpa")
    src = {"path": str(write_jsonl(tmp_path / "a.jsonl", alpaca_records(20)))}
    padded = _rows(tmp_path, tok, src, "none", "sft", max_length=128)
    packed = _rows(tmp_path, tok, src, "pack", "sft", max_length=128)
    assert len(packed) < len(padded)
    loss_p, grad_p = _step(model, tok, padded)
    loss_k, grad_k = _step(model, tok, packed)
    assert abs(loss_p - loss_k) <= 1e-5 and (grad_p - grad_k).abs().max().item() <= 1e-5


def _run(tmp_path, base, impl, packing):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, alpaca_records(40))
    out = tmp_path / f"out-{impl}"
    cfg = {"model": {"name_or_path": str(base), "attn_implementation": impl},
           "data": {"sources": [{"path": str(data)}], "eval_split": 4, "max_length": 96, "packing": packing},
           "method": {"peft": "none"},
           "training": {"max_steps": 3, "eval_steps": 3, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                        "early_stopping_patience": None, "learning_rate": 1e-3, "logging_steps": 1},
           "eval": {"metrics": ["loss"]}, "output_dir": str(out)}
    p = tmp_path / f"{impl}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(p)]) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    return [m["loss"] for m in metrics if "loss" in m], [m["eval_loss"] for m in metrics if "eval_loss" in m], manifest


def test_eager_and_sdpa_runs_train_alike_and_the_choice_is_recorded(tmp_path, base):
    loss_s, eval_s, man_s = _run(tmp_path, base, "sdpa", "auto")
    loss_e, eval_e, man_e = _run(tmp_path, base, "eager", "auto")
    assert len(loss_s) == len(loss_e) >= 3 and eval_s
    assert max(abs(a - b) for a, b in zip(loss_s + eval_s, loss_e + eval_e)) <= 1e-5
    for man, impl in ((man_s, "sdpa"), (man_e, "eager")):
        keys = {d["key"]: d for d in man["decisions"]}
        assert keys["data.packing"]["value"] == "padding_free"  # `auto` on the CPU for sft: padding-free, with its rule
        assert "block-diagonal" in keys["data.packing"]["rule"]
        assert keys["model.attn_implementation"]["value"] == impl  # printed at run start and recorded, with its rule
