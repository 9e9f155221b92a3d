"""`data prepare`'s block paths (dedup inputs computed per block, built-in templates rendered from skeletons, label masks
without numpy for one span) give exactly what the record-by-record path gives: the same rows (token ids, labels), the
same kept and dropped records with the same reasons, the same duplicates and rejected lists, the same splits and report."""

import json
import random

import numpy as np

from trainpipe.config import DataConfig
from trainpipe.data import intake, templates
from trainpipe.data.dedup import NearDedup
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import _labels, setup_chat_template

WORDS = "apple river stone cloud green seven blue tiger lamp orange music window paper silver garden rocket".split()


def _records(n: int, rng: random.Random) -> list[dict]:
    out: list[dict] = []
    for i in range(n):
        r = rng.random()
        if out and r < 0.1:
            rec = dict(rng.choice(out))  # an exact duplicate
        elif out and r < 0.18:
            rec = dict(rng.choice(out))
            ws = rec["output"].split() or ["x"]
            ws[rng.randrange(len(ws))] = "zebra"  # a near duplicate
            rec["output"] = " ".join(ws)
        else:
            rec = {"instruction": " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + f" {i}?",
                   "output": " ".join(rng.choices(WORDS, k=rng.randint(6, 40)))}
            if r > 0.93:
                rec["output"] += f" Write to user{i}@corp.io or call +44 20 7946 {1000 + i:04d}."  # PII, replaced
            elif r > 0.91:
                rec["output"] = "  "  # an empty response
            elif r > 0.89:
                rec["output"] = " ".join(rng.choices(WORDS, k=300))  # too long for max_length
        out.append(rec)
    return out


def _chats(n: int, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            msgs += [{"role": "user", "content": " ".join(rng.choices(WORDS, k=5))}, {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=7))}]
        out += [{"messages": msgs}] * (1 + (i % 11 == 0))
    return out


def _prepare(tmp_path, tok, name: str, files: list, monkeypatch, block: int, skeletons: int):
    monkeypatch.setattr(intake, "DEDUP_BLOCK", block)
    monkeypatch.setattr(templates, "_SKELETONS", skeletons)
    monkeypatch.setattr(NearDedup, "_RECENT", 256)  # the band dict merges into the sorted array many times, inside blocks too
    cfg = DataConfig(sources=[{"path": str(f)} for f in files], eval_split=0.05, max_length=96, cache_dir=str(tmp_path / name))
    data = prepare(cfg, tok, train_on="assistant", seed=0)
    entry = data.cache_path
    lists = {f: (entry / f).read_text() for f in ("rejected.jsonl", "duplicates.jsonl")}
    report = {k: data.report[k] for k in ("records_kept", "dropped", "splits", "stages", "pii") if k in data.report}
    return entry.name, [(list(r["input_ids"]), list(r["labels"])) for r in data.train], [list(r["input_ids"]) for r in data.eval], lists, report


def test_block_paths_equal_the_record_by_record_path(tmp_path, tiny_tokenizer, monkeypatch):
    setup_chat_template(tiny_tokenizer, "chatml", "tiny")
    rng = random.Random(0)
    files = []
    for name, recs in (("a.jsonl", _records(700, rng)), ("c.jsonl", _chats(150, rng))):
        files.append(tmp_path / name)
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in recs))
    blocks = _prepare(tmp_path, tiny_tokenizer, "blocks", files, monkeypatch, block=64, skeletons=4096)
    one = _prepare(tmp_path, tiny_tokenizer, "one", files, monkeypatch, block=1, skeletons=0)
    assert blocks == one
    key, train, _, lists, report = blocks
    dropped = report["dropped"]
    assert dropped["exact_duplicate"] > 50 and dropped["near_duplicate"] > 20 and dropped["empty_response"] > 5 and dropped["too_long"] > 5
    assert report["pii"]["email"] > 20 and len(train) > 500  # every rule had work to do


def test_label_mask_of_one_span_equals_the_general_rule():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        starts = np.sort(rng.integers(0, 200, n))
        offsets = [(int(s), int(s + rng.integers(0, 3))) for s in starts]
        ids = rng.integers(0, 1000, n).tolist()
        a = int(rng.integers(0, 200))
        span = [(a, a + int(rng.integers(0, 100)))]
        assert _labels(ids, offsets, span, []) == _labels(ids, offsets, span * 2, [])  # two equal spans: the numpy rule


def test_pii_prechecks_never_skip_a_match():
    """Scrubber.find runs a number type's regex only when the text has the digits (and hint) every match needs."""
    from trainpipe.data import clean

    rng = random.Random(1)
    pieces = ["4111 1111 1111 1111", "123-45-6789", "192.168.1.20", "+44 20 7946 0958", "(415) 555-2671", "DE89 3704 0044 0532 0130 00",
              "GB82WEST12345698765432", "+1 2 34", "030 12 34", "٤١١١ ١١١١ ١١١١ ١١١١", "١٢٣-٤٥-٦٧٨٩", "1.2.3.4", "7", "12-34"]
    for _ in range(3000):
        text = " ".join(rng.choice(pieces + WORDS) for _ in range(rng.randint(1, 8)))
        nd = len(clean._DIGIT.findall(text))
        if clean._CARD.search(text):
            assert nd >= 13, text
        if clean._SSN.search(text):
            assert nd >= 9, text
        if clean._IPV4.search(text):
            assert nd >= 4 and clean._IPV4_HINT.search(text), text
        if clean._PHONE.search(text):
            assert nd >= 4, text
        if clean._IBAN.search(text):
            assert nd >= 2 and clean._IBAN_HINT.search(text), text


def test_pipelined_chunks_equal_encode_batch(tiny_tokenizer):
    """The tokenize step's pipeline (the Rust tokenizer on a thread for chunk k while chunk k+1 is rendered) gives the
    rows `encode_batch` gives chunk by chunk: conversations, raw text, preference pairs and KTO examples, kept and dropped."""
    from trainpipe.data.templates import Template
    from trainpipe.data.tokenize import encode_batch
    from trainpipe.data.workers import pipelined

    setup_chat_template(tiny_tokenizer, "chatml", "tiny")
    tpl = Template(tiny_tokenizer)
    rng = random.Random(3)
    exs = []
    for i in range(300):
        q, a = " ".join(rng.choices(WORDS, k=rng.randint(1, 30))), " ".join(rng.choices(WORDS, k=rng.randint(0, 30)))
        kind = i % 4
        if kind == 0:
            exs.append({"kind": "sft", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        elif kind == 1:
            exs.append({"kind": "text", "text": q + " " + a})
        elif kind == 2:
            exs.append({"kind": "preference", "prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": a}],
                        "rejected": [{"role": "assistant", "content": a[::-1]}]})
        else:
            exs.append({"kind": "kto", "prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}], "label": i % 8 == 3})
    opts = dict(train_on="assistant", max_length=96, truncation="drop", min_tokens=1, max_tokens=None, pretrain_blocks="document")
    jobs = [(exs[k : k + 37], k % 74 == 0) for k in range(0, len(exs), 37)]
    got = list(pipelined(tiny_tokenizer, tpl, opts, iter(jobs)))
    want = [encode_batch(tiny_tokenizer, tpl, chunk, with_generation=g, **opts) for chunk, g in jobs]
    assert got == want
    flat = [e for chunk in got for e in chunk]
    n_drop, n_kept = sum(e.row is None for e in flat), sum(e.row is not None for e in flat)
    assert n_drop > 10 and n_kept > 150, (n_drop, n_kept)  # some dropped (too long), most kept
    assert any(e.generation for e in flat)


def test_spilled_examples_read_back_as_json_would():
    """A kept example goes to the build's spill file as MessagePack (JSON where MessagePack cannot hold it) and comes back
    equal to a JSON round trip: unicode, floats, NaN, deep nesting, an integer beyond 64 bits."""
    import math

    from trainpipe.data.intake import spill_bytes, unspill

    exs = [
        {"kind": "sft", "messages": [{"role": "user", "content": "héllo ✓ \u2028 \x00"}, {"role": "assistant", "content": ""}]},
        {"kind": "sft", "messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"max": 1.5e308, "n": -(2**63), "u": 2**64 - 1}}}]},
        {"kind": "kto", "prompt": [], "completion": [], "label": False, "x": [[[[None, True, 0.1]]]]},
        {"kind": "text", "text": "big", "n": 2**70},  # MessagePack holds 64-bit integers: this one is spilled as JSON
    ]
    for ex in exs:
        raw = spill_bytes(ex)
        assert unspill(raw) == json.loads(json.dumps(ex, ensure_ascii=False))
    assert spill_bytes(exs[3])[:1] == b"\x00" and spill_bytes(exs[0])[:1] != b"\x00"
    nan = unspill(spill_bytes({"kind": "text", "text": "t", "v": float("nan")}))["v"]
    assert math.isnan(nan)


def test_a_build_puts_the_cycle_collector_back(tmp_path, tiny_tokenizer, monkeypatch):
    """A build collects less often (data/build.py, fewer_collections) and puts the thresholds and the frozen objects back
    after it, when it fails too."""
    import gc

    from trainpipe.data import build as build_mod
    from trainpipe.errors import DataError

    setup_chat_template(tiny_tokenizer, "chatml", "tiny")
    before = gc.get_threshold()
    seen = []
    real = build_mod._Build.split

    def split(self):
        seen.append((gc.get_threshold()[0], gc.get_freeze_count()))
        return real(self)

    monkeypatch.setattr(build_mod._Build, "split", split)
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _records(200, random.Random(5))))
    prepare(DataConfig(sources=[{"path": str(f)}], eval_split=0.05, max_length=96, cache_dir=str(tmp_path / "c")), tiny_tokenizer,
            train_on="assistant", seed=0)
    assert seen[0][0] == 50_000 and seen[0][1] > 1000  # during the build: collected less often, the objects before it frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    f.write_text("")
    try:
        prepare(DataConfig(sources=[{"path": str(f)}], eval_split=0.05, max_length=96, cache_dir=str(tmp_path / "d")), tiny_tokenizer,
                train_on="assistant", seed=0)
    except DataError:
        pass
    else:
        raise AssertionError("an empty file prepares")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
