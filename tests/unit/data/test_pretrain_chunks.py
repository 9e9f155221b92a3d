"""Raw text for continued pretraining: a document longer than max_length becomes ceil(tokens / max_length) blocks
with no token lost (on main it was cut to its first max_length tokens or dropped), and a .txt file is read per
paragraph or per line with `split_by` (on main: one record for the whole file)."""

import json
import math

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import read_file
from trainpipe.data.tokenize import setup_chat_template


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def n_tokens(tok, text):
    return len(tok(text + tok.eos_token, add_special_tokens=False)["input_ids"])


LONG = " ".join(f"Sentence {k} tells of river {k * 3} and hill {k * 7}." for k in range(400))


@pytest.mark.parametrize("packing", ["none", "pack"])
def test_long_document_becomes_blocks_and_no_token_is_lost(  # `pretrain_blocks: document` (default now `stream`)
        tmp_path, tok, packing):
    docs = [{"text": LONG}, {"text": "A short note about the weather today."}]
    train = tmp_path / "t.jsonl"
    train.write_text("".join(json.dumps(d) + "\n" for d in docs))
    ev = tmp_path / "e.jsonl"
    ev.write_text(json.dumps({"text": "Held out text for evaluation, a few words long."}) + "\n")
    cfg = DataConfig(sources=[{"path": str(train), "format": "text"}, {"path": str(ev), "format": "text", "role": "eval"}],
                     max_length=128, packing=packing, min_eval_records=1, cache_dir=str(tmp_path / "c"), pretrain_blocks="document")
    data = prepare(cfg, tok, train_on="all", seed=0, for_method="pretrain")
    want = n_tokens(tok, LONG)
    assert want > 4 * 128
    rep = data.report
    assert rep["length"]["chunked_documents"] == 1 and rep["length"]["chunk_blocks"] == math.ceil(want / 128)
    assert rep["dropped"] == {} and rep["length"]["truncated"] == 0
    total = want + n_tokens(tok, docs[1]["text"])
    assert rep["splits"]["train"]["tokens"] == total
    assert sum(len(r["input_ids"]) for r in data.train) == total  # every token is in a training row
    assert all(len(r["input_ids"]) <= 128 for r in data.train)
    if packing == "none":
        assert rep["splits"]["train"]["rows"] == math.ceil(want / 128) + 1
        full = tok(LONG + tok.eos_token, add_special_tokens=False)["input_ids"]
        rows = [list(r["input_ids"]) for r in data.train]
        j = rows.index(full[:128])  # the document's blocks, in order, are the document
        assert [i for r in rows[j : j + math.ceil(want / 128)] for i in r] == full


def test_txt_split_by_paragraph_and_line(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_text("First paragraph line one.\nline two.\n\nSecond paragraph.\n\n\n  \nThird paragraph\nwith two lines.\n")
    paras = list(read_file(p, split_by="paragraph"))
    assert [r.data["text"] for r in paras] == ["First paragraph line one.\nline two.", "Second paragraph.", "Third paragraph\nwith two lines."]
    assert [r.line for r in paras] == [1, 4, 8]
    assert len(list(read_file(p, split_by="line"))) == 5
    assert len(list(read_file(p))) == 1  # document: the whole file, as before


def test_txt_source_option_reaches_prepare(tmp_path, tok):
    p = tmp_path / "wiki.txt"
    p.write_text("\n\n".join(f"Paragraph {k} speaks of valley {k} and its {k * 11} trees." for k in range(3)) + "\n")
    cfg = DataConfig(sources=[{"path": str(p), "format": "text", "split_by": "paragraph"}], eval_split=1, min_eval_records=1,
                     cache_dir=str(tmp_path / "c"))
    data = prepare(cfg, tok, train_on="all", seed=0, for_method="pretrain")
    assert data.report["records_read"] == 3 and data.report["records_kept"] == 3
