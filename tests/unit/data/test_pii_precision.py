"""PII removal with precision, not only recall: measured on a labelled sample made like public data
(tests/assets/pii_labelled.jsonl), the regressions seen on real data (arithmetic, code, reserved example
addresses, generated passwords), and every replacement listed for audit in the data report."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.clean import CONTEXT, Scrubber, luhn_ok
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template

ROOT = Path(__file__).parents[3]
ASSETS = ROOT / "tests" / "assets"
ALL = ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_labelled_sample_is_what_the_script_writes():
    gen = _module(ASSETS / "make_real_assets.py", "make_real_assets")
    for name, data in gen.fixtures().items():
        assert (ASSETS / name).read_bytes() == data, f"{name}: run python tests/assets/make_real_assets.py"


def test_precision_and_recall_on_the_labelled_sample_meet_the_targets():
    bench = _module(ROOT / "benchmarks" / "pii_precision.py", "pii_precision")
    items = bench.load(ASSETS / "pii_labelled.jsonl")
    cats = {it["category"] for it in items}
    assert {"math", "code", "chat", "form"} <= cats and sum(len(it["pii"]) for it in items) >= 100
    res = bench.measure(items)["by"]
    a = res["all"]
    assert a["precision"] >= 0.95 and a["recall"] >= 0.95, a
    assert res["math"]["pred"] == 0, "a long number in arithmetic was replaced"
    assert res["code"]["precision"] >= 0.95 and res["code"]["recall"] >= 0.95, res["code"]


# -------------------------------------------------------------------- regressions seen on main

def _luhn_number(n: int, start: int) -> str:
    x = start
    while not luhn_ok(str(x)):
        x += 1
    assert len(str(x)) == n
    return str(x)


KEPT = [
    f"472547338 + {_luhn_number(15, 488_000_000_000_000)} = {472547338 + int(_luhn_number(15, 488_000_000_000_000))}",
    f"In total she sold <<{_luhn_number(16, 4_111_000_000_000_000)}+12={int(_luhn_number(16, 4_111_000_000_000_000)) + 12}>> clips.",
    f"#### {_luhn_number(16, 5_500_000_000_000_000)}",
    "ACCESS_TOKEN = os.environ['access_token']",
    "API_KEY = os.getenv(\"OPENAI_API_KEY\")\nclient = OpenAI(api_key=API_KEY)",
    "tokenizer.pad_token = tokenizer.eos_token",
    "Write to user@example.com, ops@mail.example.org, a@b.example, x@y.test, q@host.invalid or me@box.localhost.",
    "Hosts 192.0.2.1, 198.51.100.7, 203.0.113.42 and 2001:db8::42 are documentation addresses.",
    "Here is a strong password: Xk9#mP2vL7qR\nStore it in a password manager.",
    "Sure! Randomly generated password: `t7GqpLx#Wd92`",
    "export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE",
    "version = '10.0.19041.1'",
    "git clone git@github.com:huggingface/transformers.git",
]


@pytest.mark.parametrize("text", KEPT)
def test_not_pii_is_left_alone(text):
    s = Scrubber(ALL)
    assert s(text) == text and not s.counts, (s(text), dict(s.counts))


REPLACED = [
    (f"Please charge my credit card {_luhn_number(16, 4_111_000_000_000_000)} + the tip", "credit_card", "<CREDIT_CARD>"),
    ("card_number = \"4111111111111111\"  # from the CSV", "credit_card", "<CREDIT_CARD>"),
    ("I typed 4111 1111 1111 1111 into the checkout.", "credit_card", "<CREDIT_CARD>"),
    ("ssn = '123-45-6789'", "ssn", "<SSN>"),
    ("ACCESS_TOKEN = \"ghp_" + "aZ3kQ9" * 6 + "\"", "secret", "<SECRET>"),
    ("{\"api_key\": \"a8f5f167f44f4964e6c998dee827110c\"}", "secret", "<SECRET>"),
    ("HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh", "secret", "<SECRET>"),
    ("curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U'", "secret", "<SECRET>"),
    ("Username: priya_p\nPassword: Qv7rTz2mKx$", "secret", "<SECRET>"),
    ("DATABASE_URL = 'postgres://admin:Xq7TzL2mKv9w@db.acme-corp.io:5432/prod'", "secret", "<SECRET>"),
    ("My email is maria.gonzalez84@gmail.com thanks", "email", "<EMAIL>"),
    ("Login from 81.2.69.142 yesterday.", "ip", "<IP_ADDRESS>"),
]


@pytest.mark.parametrize("text,kind,placeholder", REPLACED)
def test_pii_is_still_replaced(text, kind, placeholder):
    s = Scrubber(ALL)
    out = s(text)
    assert placeholder in out and s.counts[kind] == 1, (out, dict(s.counts))


def test_assignment_keeps_code_intact():
    s = Scrubber(ALL)
    assert s('ACCESS_TOKEN = "ghp_' + "aZ3kQ9" * 6 + '"\nheaders = {"x": ACCESS_TOKEN}') == 'ACCESS_TOKEN = "<SECRET>"\nheaders = {"x": ACCESS_TOKEN}'


# -------------------------------------------------------------------- the audit list

def test_every_replacement_is_listed_with_its_context_capped_per_type():
    s = Scrubber(ALL, audit_cap=2)
    left = "The customer wrote to us yesterday afternoon saying: "
    for k in range(3):
        s(f"{left}mail me at jo{k}@gmail.com and the rest of this sentence is long enough to cut.")
    s("call (415) 555-2671 now")
    rep = s.audit_report()
    emails = [e for e in rep["listed"] if e["type"] == "email"]
    assert len(emails) == 2 and rep["not_listed"] == {"email": 1}
    e = emails[0]
    i = e["context"].index("<EMAIL>")
    assert i == CONTEXT and len(e["context"]) == 2 * CONTEXT + len("<EMAIL>"), e  # 40 characters each side
    # the value itself never reaches the report: its type and position do (54 = len(left) + "mail me at ")
    assert "gmail" not in json.dumps(rep) and (e["start"], e["end"], e["length"]) == (len(left) + 11, len(left) + 24, 13) and "shape" not in e
    assert [x["type"] for x in rep["listed"]].count("phone") == 1


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_data_report_lists_each_replacement_with_record_and_context(tmp_path, tok):
    recs = [{"instruction": f"Add the numbers of row {i}.", "output": f"{472547338 + i} + 4111111111111111 = {472547338 + i + 4111111111111111}"} for i in range(10)]
    recs[3]["output"] = "Sure, write to carla.mendes@outlook.com or user@example.com."
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(DataConfig(sources=[{"path": str(p)}], eval_split=2, cache_dir=str(tmp_path / "c"), dedup={"near": False}),
                   tok, train_on="assistant", seed=0)
    r = data.report
    assert r["pii"] == {"email": 1}  # the arithmetic is left alone, the reserved address too
    [entry] = r["pii_audit"]["listed"]
    assert entry["type"] == "email" and entry["record"] == f"{p}:4"
    # the default replacement is a surrogate: a made-up address at a reserved domain, the original's field and position listed
    assert re.fullmatch(r"Sure, write to [a-z]+\.[a-z]+@example\.(?:com|org|net) or user@example\.com\.", entry["context"]), entry
    assert (entry["field"], entry["start"], entry["end"]) == ("messages[1].content", 15, 39)
    assert "carla" not in json.dumps(r)
    from trainpipe.data.report import summary_lines

    shown = "\n".join(summary_lines(r))
    assert f"    email: 1 replaced\n      {p}:4 messages[1].content characters 15-39: {entry['context']!r}" in shown and "carla" not in shown
