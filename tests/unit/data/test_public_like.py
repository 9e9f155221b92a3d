"""Data made like public data (tests/assets/public_like/, written by make_public_like_assets.py): long preference
pairs kept by default (TRL's truncation rule), pretraining documents as one stream of max_length blocks with their
boundaries carried, and every record of each extract accounted for with no arithmetic answer or code line altered."""

import json
import sys
from pathlib import Path

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.packing import IGNORE_INDEX
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import read_file
from trainpipe.data.tokenize import setup_chat_template

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PL = ASSETS / "public_like"


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_assets_are_what_the_script_writes():
    sys.path.insert(0, str(ASSETS))
    from make_public_like_assets import files

    for name, text in files().items():
        assert (PL / name).read_text(encoding="utf-8") == text, f"{name} differs: run python tests/assets/make_public_like_assets.py"


def _cfg(tmp_path, src: dict, **kw) -> DataConfig:
    return DataConfig(sources=[src], cache_dir=str(tmp_path / "c"), **kw)


# ------------------------------------------------------------------------------ 1. preference truncation by default


def test_long_preference_pairs_kept_by_default_dropped_under_drop(tmp_path, tok):
    src = {"path": str(PL / "preference_long.jsonl")}
    data = prepare(_cfg(tmp_path, src, max_length=512, eval_split=4), tok, train_on="assistant", seed=0)
    rep = data.report
    assert rep["records_read"] == 30 and rep["records_kept"] == 30 and rep["dropped"] == {}
    assert rep["length"]["policy"] == "auto" and rep["length"]["truncated"] >= 20  # most pairs were over max_length
    for row in list(data.train) + list(data.eval):
        assert row["chosen_input_ids"] != row["rejected_input_ids"]
        assert len(row["prompt_input_ids"]) + max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"])) <= 512
    dropped = prepare(_cfg(tmp_path, src, max_length=512, eval_split=4, truncation="drop", min_eval_records=1), tok,
                      train_on="assistant", seed=0).report
    assert dropped["dropped"]["too_long"] == rep["length"]["truncated"]
    assert dropped["records_read"] == dropped["records_kept"] + sum(dropped["dropped"].values())


def test_auto_still_drops_long_sft(tmp_path, tok):
    src = {"path": str(PL / "gsm8k_like_alpaca.jsonl")}
    rep = prepare(_cfg(tmp_path, src, max_length=450, eval_split=1, min_eval_records=1), tok, train_on="assistant", seed=0).report
    assert rep["length"]["truncated"] == 0 and rep["dropped"].get("too_long", 0) > 0  # a cut SFT target is never kept


# ------------------------------------------------------------------------------ 2. pretraining blocks


def _doc_tokens(tok, texts) -> int:
    return sum(len(tok(t + tok.eos_token, add_special_tokens=False)["input_ids"]) for t in texts)


def _check_blocks(rows, eos: int, max_length: int) -> int:
    """Blocks all max_length but the last; positions restart exactly at a block start and after each EOS (a document
    start), where the label is masked. Returns the boundaries found inside blocks."""
    lens = [len(r["input_ids"]) for r in rows]
    assert all(n == max_length for n in lens[:-1]) and 0 < lens[-1] <= max_length
    inside = 0
    for r in rows:
        ids, pos, lab = list(r["input_ids"]), list(r["position_ids"]), list(r["labels"])
        assert pos[0] == 0
        for j in range(1, len(ids)):
            starts = ids[j - 1] == eos
            assert (pos[j] == 0) == starts and (pos[j] == pos[j - 1] + 1 or starts)
            if starts:
                assert lab[j] == IGNORE_INDEX
                inside += 1
    return inside


@pytest.mark.parametrize("source", [{"path": "c4_like.jsonl", "format": "text"},
                                    {"path": "wiki_like.txt", "format": "text", "split_by": "paragraph"}])
def test_stream_blocks_lose_no_token_and_carry_boundaries(tmp_path, tok, source):
    path = PL / source["path"]
    texts = [r.data["text"] for r in read_file(path, split_by=source.get("split_by", "document"))]
    cfg = _cfg(tmp_path, {**source, "path": str(path)}, max_length=256, eval_split=2, min_eval_records=1)
    assert cfg.pretrain_blocks == "stream"
    data = prepare(cfg, tok, train_on="all", seed=0, for_method="pretrain")
    rep = data.report
    assert rep["records_read"] == len(texts) == rep["records_kept"] and rep["dropped"] == {}
    total = _doc_tokens(tok, texts)
    out = sum(len(r["input_ids"]) for split in (data.train, data.eval) for r in split)
    assert out == total  # tokens in = tokens out
    stream = rep["length"]["stream"]
    assert stream["train"]["tokens"] + stream["eval"]["tokens"] == total
    assert stream["train"]["documents"] + stream["eval"]["documents"] == len(texts)
    for name, rows in (("train", list(data.train)), ("eval", list(data.eval))):
        assert stream[name]["blocks"] == len(rows)
        assert _check_blocks(rows, tok.eos_token_id, 256) == stream[name]["boundaries_in_blocks"]
    assert stream["train"]["boundaries_in_blocks"] > 0


def test_stream_blocks_keep_their_boundaries_when_packed(tmp_path, tok):
    src = {"path": str(PL / "wiki_like.txt"), "format": "text", "split_by": "paragraph"}
    plain = prepare(_cfg(tmp_path, src, max_length=256, eval_split=2, min_eval_records=1), tok, train_on="all", seed=0, for_method="pretrain")
    packed = prepare(_cfg(tmp_path, src, max_length=256, eval_split=2, min_eval_records=1, packing="pack"), tok, train_on="all", seed=0,
                     for_method="pretrain")
    rows = sorted((list(r["input_ids"]), list(r["position_ids"])) for r in packed.train)
    assert rows == sorted((list(r["input_ids"]), list(r["position_ids"])) for r in plain.train)  # full blocks stay whole


def test_document_blocks_still_choosable(tmp_path, tok):
    src = {"path": str(PL / "c4_like.jsonl"), "format": "text"}
    rep = prepare(_cfg(tmp_path, src, max_length=256, eval_split=2, min_eval_records=1, pretrain_blocks="document"), tok,
                  train_on="all", seed=0, for_method="pretrain").report
    assert rep["length"]["chunked_documents"] > 0 and rep["length"]["stream"] == {}


# ------------------------------------------------------------------------------ 3. every record accounted for


def _outputs(path: Path) -> list[str]:
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [r["output"] if "output" in r else r["messages"][-1]["content"] for r in recs]


@pytest.mark.parametrize("name", ["c4_like.jsonl", "wiki_like.txt", "gsm8k_like_alpaca.jsonl", "code_alpaca.jsonl",
                                  "code_chat.jsonl", "preference_long.jsonl"])
def test_prepare_accounts_for_every_record_and_alters_no_answer(tmp_path, tok, name):
    path = PL / name
    src = {"path": str(path)} | ({"format": "text", "split_by": "paragraph"} if name.endswith(".txt") else {})
    method = "pretrain" if name.startswith(("c4", "wiki")) else None
    kw = {"for_method": method} if method else {}
    rep = prepare(_cfg(tmp_path, src, max_length=1024, eval_split=2, min_eval_records=1), tok,
                  train_on="all" if method else "assistant", seed=0, **kw).report
    assert rep["invariant"]["holds"] and rep["records_read"] == rep["records_kept"] + sum(rep["dropped"].values())
    assert rep["records_read"] > 0 and not rep["rejected"]
    if name.startswith(("gsm8k", "code")):
        assert rep["pii"] == {} or sum(rep["pii"].values()) == 0, rep["pii_audit"]
        assert not rep["pii_audit"]["listed"]
        assert rep["records_kept"] == rep["records_read"] - rep["dropped"].get("exact_duplicate", 0) - rep["dropped"].get("near_duplicate", 0)
    if name.startswith("gsm8k"):
        assert any(len(o.split("#### ")[1]) >= 13 for o in _outputs(path))  # long answers, some passing Luhn


def test_padding_free_batches_keep_stream_boundaries(tmp_path, tok):
    from trainpipe.data.collate import PadCollator

    src = {"path": str(PL / "wiki_like.txt"), "format": "text", "split_by": "paragraph"}
    data = prepare(_cfg(tmp_path, src, max_length=256, eval_split=2, min_eval_records=1, packing="padding_free"), tok,
                   train_on="all", seed=0, for_method="pretrain")
    rows = list(data.train)[:3]
    batch = PadCollator(tok.pad_token_id or 0)(rows)
    assert batch["position_ids"][0].tolist() == [p for r in rows for p in r["position_ids"]]  # boundaries inside blocks kept
    unpadded = PadCollator(tok.pad_token_id or 0)([{k: v for k, v in r.items() if k != "padding_free"} for r in rows])
    assert "attention_mask" not in unpadded and unpadded["position_ids"][0].tolist()[:256] == list(rows[0]["position_ids"])


def test_auto_policy_per_kind():
    from trainpipe.data.lengths import bound_example, policy

    assert [policy("auto", k) for k in ("preference", "kto", "sft", "text")] == ["truncate", "truncate", "drop", "drop"]
    assert policy("drop", "kto") == "drop" and policy("truncate", "sft") == "truncate"
    kto = {"kind": "kto", "prompt": [{"role": "user", "content": "q " * 400}], "completion": [{"role": "assistant", "content": "a"}], "label": True}
    cut, was_cut = bound_example(kto, 300, "auto")
    assert was_cut and cut["completion"] == kto["completion"]  # the long KTO prompt cut, the example kept
    assert bound_example(kto, 300, "drop") == (None, False)
