"""PII scrubbing with typed placeholders and counts; filters with counted reasons; emptied data names the stage."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.clean import Scrubber, encoding_problem, iban_ok, luhn_ok, repetition
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError

ALL = ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]

PLANTED = [
    ("Write to jane.doe+news@example.co.uk today.", "email", "<EMAIL>"),
    ("Call +44 20 7946 0958 after six.", "phone", "<PHONE>"),
    ("Call (415) 823-4567 now.", "phone", "<PHONE>"),
    ("Ring +49 30 12345678 please.", "phone", "<PHONE>"),
    ("Server at 192.168.10.254 is down.", "ip", "<IP_ADDRESS>"),
    ("IPv6 2a02:8071:85a3::8a2e:370:7334 works.", "ip", "<IP_ADDRESS>"),
    ("Card 4111 1111 1111 1111 expires.", "credit_card", "<CREDIT_CARD>"),
    ("Pay to GB82 WEST 1234 5698 7654 32 now.", "iban", "<IBAN>"),
    ("SSN 123-45-6789 on file.", "ssn", "<SSN>"),
    ("key AKIAI44QH8DHBF3KP2XY here", "secret", "<SECRET>"),
    ("token ghp_" + "a1B2" * 9 + " leaked", "secret", "<SECRET>"),
    ("slack xoxb-1234567890-abcdefghij here", "secret", "<SECRET>"),
    ("openai sk-proj-Ab3x9KqLm2Zt7Yw4Rv8Np1Hs6Jd0Fg5C here", "secret", "<SECRET>"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "secret", "<SECRET>"),
]

CLEAN = [
    "The meeting is on 2024-03-15 at 10:30.",
    "Version 1.2.3 fixed 45 bugs in 2023.",
    "Order 12 apples and 3 pears for 4.50 dollars.",
    "The ratio was 3:2 and the score 21-17.",
    "Chapter 12, page 345, line 6.",
    "Use the password field below to log in.",
    "Room 101 on floor 3; call me tomorrow.",
    "The number 1234567 is not a phone by itself here.",
]


@pytest.mark.parametrize("text,kind,placeholder", PLANTED)
def test_each_type_is_replaced_and_counted(text, kind, placeholder):
    s = Scrubber(ALL)
    out = s(text)
    assert placeholder in out and s.counts[kind] == 1, (out, dict(s.counts))


def test_password_assignment_keeps_the_key():
    s = Scrubber(ALL)
    assert s('db password="hunter22" and api_key=abcd1234efgh') == 'db password="<SECRET>" and api_key=<SECRET>'
    assert s.counts["secret"] == 2


def test_no_false_replacements_on_clean_text():
    s = Scrubber(ALL)
    for t in CLEAN:
        assert s(t) == t, t
    assert not s.counts


def test_checksums_reject_lookalikes():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert iban_ok("GB82WEST12345698765432") and not iban_ok("GB82WEST12345698765433")
    s = Scrubber(["credit_card", "iban"])
    assert s("Card 4111 1111 1111 1112 is invalid.") == "Card 4111 1111 1111 1112 is invalid."


def test_only_the_configured_types_are_replaced():
    s = Scrubber(["email"])
    assert s("mail a@b.io or call (555) 123-4567") == "mail <EMAIL> or call (555) 123-4567"


def test_presidio_on_without_it_installed_names_the_extra():
    pytest.importorskip("trainpipe")
    try:
        import presidio_analyzer  # noqa: F401

        pytest.skip("presidio is installed here")
    except ImportError:
        pass
    with pytest.raises(DataError, match=r"trainpipe\[presidio\]"):
        Scrubber(ALL, presidio="on")
    assert Scrubber(ALL, presidio="auto")._presidio is None


def test_filters():
    assert encoding_problem(["fine text"]) is None
    assert "control character U+0007" in encoding_problem(["bell\x07"])
    assert "broken encoding" in encoding_problem(["cafÃ© au lait"])
    assert "broken encoding" in encoding_problem(["bad \ufffd char"])
    assert repetition("the cat sat on the mat " * 10) > 0.5
    assert repetition(" ".join(f"word{i}" for i in range(40))) == 0.0


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_prepare_counts_pii_and_filter_reasons(tmp_path, tok):
    recs = [{"instruction": f"Say item {i}.", "output": f"item {i} said"} for i in range(20)]
    recs[0]["output"] = "mail me at bob@bobsmail.net"
    recs[1]["input"] = "my card is 4111 1111 1111 1111"
    recs[2]["output"] = "   "
    recs[3]["output"] = "caf\u00c3\u00a9 broken"
    recs[4]["output"] = "apple river stone " * 20
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(DataConfig(sources=[{"path": str(p)}], eval_split=2, cache_dir=str(tmp_path / "c"), pii={"replace": "tag"}), tok, train_on="assistant", seed=0)
    r = data.report
    assert r["pii"] == {"credit_card": 1, "email": 1}
    assert r["dropped"] == {"bad_encoding": 1, "empty_response": 1, "repetitive": 1}
    assert r["records_kept"] == 17
    texts = [tok.decode(x["input_ids"]) for x in list(data.train) + data.eval]
    assert any("<EMAIL>" in t for t in texts) and not any("bob@bobsmail.net" in t for t in texts)


def test_dataset_emptied_by_filters_names_the_stage(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": " "}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match=r"after the `filters` stage, which removed the last 5.*data.filters"):
        prepare(DataConfig(sources=[{"path": str(p)}], cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)
