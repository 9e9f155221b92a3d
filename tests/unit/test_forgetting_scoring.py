"""The forgetting check scores every record of its set (issue 24: a 40-record set was reported as `examples: 1`), in
batches, and its loss is the token-weighted mean next-token loss over the whole set, recomputed here record by record
with a plain forward pass of the same real tiny model (no trainpipe code in the reference computation)."""

import json
import random

import pytest

from tiny import WORDS, alpaca_records, write_jsonl


def _direct_loss(model, rows) -> tuple[float, int]:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:  # one record at a time: no padding, no batching
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1].float()
            keep = labels != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count, count


@pytest.mark.parametrize("kind", ["text", "alpaca"])
def test_every_record_is_scored_and_the_loss_is_the_token_weighted_mean(tmp_path, tiny_model_dir, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainpipe.config import ForgettingSetConfig
    from trainpipe.data.tokenize import setup_chat_template
    from trainpipe.evaluate.forgetting import ForgettingMonitor, load_sets

    rng = random.Random(3)
    records = ([{"text": " ".join(rng.sample(WORDS, rng.randint(2, 9)))} for _ in range(40)] if kind == "text" else alpaca_records(40, seed=4))
    path = write_jsonl(tmp_path / "general.jsonl", records)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = setup_chat_template(tok, "auto", str(tiny_model_dir))
    sets = load_sets([ForgettingSetConfig(path=str(path), name="general")], tok, template, max_length=96)
    assert len(sets[0].rows) == 40
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    want, tokens = _direct_loss(model, sets[0].rows)

    class Events:
        def emit(self, *a, **k):
            pass

    for bs in (8, 3, 64):  # batches that divide the set, that do not, and one batch larger than the set
        mon = ForgettingMonitor(sets, 0.05, tmp_path / f"forgetting-{bs}.json", Events(), batch_size=bs, pad_id=tok.pad_token_id)
        base = mon.baseline(model)["general"]
        assert base["examples"] == 40 and base["loss_tokens"] == tokens
        assert base["loss"] == pytest.approx(want, rel=1e-5)
        rec = json.loads((tmp_path / f"forgetting-{bs}.json").read_text())["sets"]["general"]
        assert rec["examples"] == 40 and rec["baseline"]["loss"] == pytest.approx(want, rel=1e-5)
