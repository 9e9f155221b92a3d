"""PII scrubbing a person agrees with (issue 35, point 1): reserved and documentation values are left alone, cards
written without groups are found, a value is replaced the same way everywhere in its record (tool call, tool result,
reply), the default replacement is a realistic surrogate (tags on request), and the audit gives type and position.
Measured on tests/assets/pii_by_source.jsonl, labelled by rule from each text's source (make_pii_by_source.py)."""

import importlib.util
import ipaddress
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.clean import Scrubber, iban_ok, luhn_ok
from trainpipe.data.pii import RecordScrubber, surrogate
from trainpipe.data.prepare import prepare
from trainpipe.data.report import summary_lines
from trainpipe.data.tokenize import setup_chat_template

ASSETS = Path(__file__).parents[2] / "assets"
ALL = ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]


def _gen():
    spec = importlib.util.spec_from_file_location("make_pii_by_source", ASSETS / "make_pii_by_source.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_pii_by_source"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_labelled_sample_is_what_its_script_writes_and_keeps_its_provenance():
    assert (ASSETS / "pii_by_source.jsonl").read_bytes() == _gen().fixture(), "run python tests/assets/make_pii_by_source.py"
    recs = [json.loads(x) for x in (ASSETS / "pii_by_source.jsonl").read_text().splitlines()]
    assert len(recs) == 156 and sum(len(r["pii"]) for r in recs) == 86
    assert all(r["from"] and r["licence"] and r["rule"] for r in recs)


def test_precision_and_recall_on_the_sample_labelled_by_source():
    recs = [json.loads(x) for x in (ASSETS / "pii_by_source.jsonl").read_text().splitlines()]
    s = Scrubber(ALL)
    tp, fp, fn = Counter(), Counter(), Counter()
    for r in recs:
        gold = {(p["start"], p["end"], p["type"]) for p in r["pii"]}
        pred = set(s.find(r["text"]))
        tp[r["source"]] += len(gold & pred)
        fp[r["source"]] += len(pred - gold)
        fn[r["source"]] += len(gold - pred)
    T, P, N = sum(tp.values()), sum(fp.values()), sum(fn.values())
    assert T / (T + P) >= 0.95 and T / (T + N) >= 0.95, (tp, fp, fn)
    # the cases, counted: no reserved value or placeholder replaced (the last round replaced 10 of the 20
    # fictional answers), every one of the 24 cards typed without groups found (the last round found none)
    assert fp["alpaca_fictional"] == 0 and fp["code_placeholders"] == 0 and fp["gsm8k_math"] == 0
    assert tp["support_chat"] == 34 and fn["support_chat"] == 0  # 24 cards + 10 phones


@pytest.mark.parametrize("text", [
    "Here is a hypothetical phone number: (555) 123-4567", "call +1 555 123 4567", "Call 415-555-0123",
    "const apiKey = 'YOUR_API_KEY';", 'API_KEY = "xxx"', 'headers = {"Authorization": "Bearer <token>"}',
    "mail jane@example.org, x@y.test or q@host.invalid", "hosts 198.51.100.7 and 2001:db8::42",
])
def test_reserved_values_and_placeholders_are_left_alone(text):
    s = Scrubber(ALL)
    assert s.find(text) == [], s.find(text)


def _glaive_like():
    return {"kind": "sft", "messages": [
        {"role": "user", "content": "Email maria.gonzalez84@gmail.com that my account is reset."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "send_email", "arguments": {
            "recipient": "maria.gonzalez84@gmail.com", "message": "Your account is reset."}}}]},
        {"role": "tool", "content": '{"status": "sent", "password": "Tr0ub4dor&3x"}'},
        {"role": "assistant", "content": "Sent to maria.gonzalez84@gmail.com. The new password is Tr0ub4dor&3x."}]}


def test_one_value_one_surrogate_everywhere_in_the_record():
    s = Scrubber(ALL)
    out = RecordScrubber(s)(_glaive_like(), "demo.json:1")
    m = out["messages"]
    email = m[1]["tool_calls"][0]["function"]["arguments"]["recipient"]
    assert re.fullmatch(r"[a-z]+\.[a-z]+@example\.(?:com|org|net)", email) and "<EMAIL>" not in json.dumps(out)
    assert email in m[0]["content"] and email in m[3]["content"]  # the same surrogate in the request, the call and the reply
    pw = json.loads(m[2]["content"])["password"]
    assert pw != "Tr0ub4dor&3x" and len(pw) == 12 and pw in m[3]["content"]  # the reply states what the tool returned
    assert "maria" not in json.dumps(out) and "Tr0ub4dor" not in json.dumps(out)
    assert dict(s.counts) == {"email": 3, "secret": 2}
    fields = [(e["type"], e["field"], e["start"], e["end"]) for e in s.audit]
    assert ("email", "messages[1].tool_calls[0].arguments.recipient", 0, 26) in fields
    assert ("secret", "messages[3].content", 56, 68) in fields  # found through the tool result, replaced in the reply too
    assert RecordScrubber(Scrubber(ALL))(_glaive_like(), "x") == out  # reproducible
    tags = RecordScrubber(Scrubber(ALL), "tag")(_glaive_like(), "x")["messages"]
    assert tags[3]["content"] == "Sent to <EMAIL>. The new password is <SECRET>."


def test_surrogates_are_well_formed_and_never_real():
    salt = "r"
    card = surrogate("4539578763621486", "credit_card", salt)
    assert luhn_ok(card) and card[0] == "4" and len(card) == 16 and card != "4539578763621486"
    grouped = surrogate("3714 496353 98431", "credit_card", salt)
    assert re.fullmatch(r"37\d\d \d{6} \d{5}", grouped) and luhn_ok(grouped.replace(" ", ""))
    assert re.fullmatch(r"\(\d{3}\) 555-01\d\d", surrogate("(415) 823-4567", "phone", salt))
    assert ipaddress.ip_address(surrogate("81.2.69.142", "ip", salt)).is_private  # RFC 5737 documentation ranges
    assert surrogate("2a02:8071::7334", "ip", salt).startswith("2001:db8::")
    ib = surrogate("GB82 WEST 1234 5698 7654 32", "iban", salt)
    assert ib.startswith("GB") and iban_ok(ib) and len(ib) == len("GB82 WEST 1234 5698 7654 32")
    assert surrogate("123-45-6789", "ssn", salt).startswith("666-")
    key = surrogate("sk-proj-Ab3x9KqLm2Zt7Yw4Rv8Np1Hs6Jd0Fg5C", "secret", salt)
    assert key.startswith("sk-proj-") and len(key) == 40 and key != "sk-proj-Ab3x9KqLm2Zt7Yw4Rv8Np1Hs6Jd0Fg5C"
    assert surrogate("4539578763621486", "credit_card", "other record") != card


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_prepare_scrubs_records_and_reports_three_examples_per_type(tmp_path, tok):
    recs = [{"instruction": f"Answer {i}.", "output": f"Reach me at person{i}@outlook.com or (212) 8{i:02d}-4567."} for i in range(5)]
    recs += [{"instruction": "Generate a hypothetical phone number.", "output": "(555) 123-4567"}] * 1
    recs += [{"instruction": f"Fact {i}.", "output": f"Fact number {i} is true."} for i in range(10)]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(DataConfig(sources=[{"path": str(p)}], eval_split=2, cache_dir=str(tmp_path / "c"), dedup={"near": False}), tok, train_on="assistant", seed=0)
    r = data.report
    assert r["pii"] == {"email": 5, "phone": 5}  # the 555 answer is left alone
    shown = "\n".join(summary_lines(r))
    assert "    email: 5 replaced" in shown and "    phone: 5 replaced" in shown
    blocks = shown.split("    phone: 5 replaced")
    assert blocks[1].count(f"{p}:") == 3  # three examples per type
    assert "outlook" not in json.dumps(r) and "(555) 123-4567" in "".join(tok.decode(x["input_ids"]) for x in list(data.train) + data.eval)
