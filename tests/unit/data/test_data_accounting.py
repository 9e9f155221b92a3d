"""Records that would train on something other than the data says are dropped with a counted reason: chat turns out
of order, JSON objects that give a key twice, preference pairs whose chosen and rejected replies are the same; and a
repeated source is streamed to disk."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import read_file
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def chat(*roles):
    return {"messages": [{"role": r, "content": f"{r} says {i}"} for i, r in enumerate(roles)]}


def write(path, recs):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def run(path, tok, tmp_path, **kw):
    cfg = DataConfig(sources=[{"path": str(path)}], eval_split=2, cache_dir=str(tmp_path / "c"), **kw)
    return prepare(cfg, tok, train_on="assistant", seed=0)


OUT_OF_ORDER = [("user", "user", "assistant"), ("assistant", "user", "assistant"), ("user", "assistant", "assistant"),
                ("user", "system", "assistant"), ("system", "assistant", "user", "assistant"), ("user", "tool", "assistant")]
IN_ORDER = [("user", "assistant"), ("system", "user", "assistant"), ("user", "assistant", "user", "assistant"),
            ("user", "assistant", "tool", "assistant"), ("user", "assistant", "tool", "tool", "assistant")]


@pytest.mark.parametrize("roles", OUT_OF_ORDER)
def test_turns_out_of_order_are_a_role_order_error(roles):
    with pytest.raises(formats.FormatError) as exc:
        formats.to_example(chat(*roles), "chat")
    assert exc.value.kind == "role_order" and "turn order" in str(exc.value)


@pytest.mark.parametrize("roles", IN_ORDER)
def test_turns_in_order_pass(roles):
    assert [m["role"] for m in formats.to_example(chat(*roles), "chat")["messages"]] == list(roles)


def test_sharegpt_and_preference_turns_are_checked_too():
    with pytest.raises(formats.FormatError, match=r"conversations\[1\] is a `user` turn after a `user` turn"):
        formats.to_example({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]}, "sharegpt")
    pair = {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "early"}], "chosen": "good", "rejected": "bad"}
    with pytest.raises(formats.FormatError, match=r"chosen\[0\] is a `assistant` turn after a `assistant` turn"):
        formats.to_example(pair, "preference")


def test_out_of_order_chats_are_counted_as_dropped(tmp_path, tok):
    recs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(6)]
    recs += [chat(*roles) for roles in OUT_OF_ORDER]
    path = write(tmp_path / "chat.jsonl", recs)
    r = run(path, tok, tmp_path, on_error="skip").report
    assert r["dropped"]["role_order"] == len(OUT_OF_ORDER) and r["records_kept"] == 6
    assert r["records_read"] == r["records_kept"] + sum(r["dropped"].values())
    with pytest.raises(DataError, match=r"chat.jsonl` line 7: messages\[1\] is a `user` turn after a `user` turn"):
        run(path, tok, tmp_path / "raise")


def test_a_key_given_twice_is_dropped_as_duplicate_key(tmp_path, tok):
    good = [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(6)]
    dup = '{"instruction": "Say x.", "output": "first", "output": "second"}'
    nested = '{"messages": [{"role": "user", "content": "q", "content": "q2"}, {"role": "assistant", "content": "a"}]}'
    path = write(tmp_path / "d.jsonl", good + [dup, nested])
    items = list(read_file(path))
    assert [getattr(i, "kind", "record") for i in items[-2:]] == ["duplicate_key", "duplicate_key"]
    assert "`output` more than once" in items[-2].reason and "`content`" in items[-1].reason
    r = run(path, tok, tmp_path, on_error="skip").report
    assert r["dropped"]["duplicate_key"] == 2 and r["records_kept"] == 6
    with pytest.raises(DataError, match=r"line 7: gives the key `output` more than once"):
        run(path, tok, tmp_path / "raise")

    arr = tmp_path / "d.json"  # a JSON array: the item that repeats a key
    arr.write_text("[" + ", ".join([json.dumps(g) for g in good] + [dup]) + "]")
    kinds = [getattr(i, "kind", "record") for i in read_file(arr)]
    assert kinds == ["record"] * 6 + ["duplicate_key"]
    cols = tmp_path / "cols.json"
    cols.write_text('{"instruction": ["a"], "output": ["b"], "output": ["c"]}')
    with pytest.raises(DataError, match="`output` more than once"):
        list(read_file(cols))
    csv = tmp_path / "d.csv"
    csv.write_text("instruction,output,output\nSay a.,b,c\n")
    with pytest.raises(DataError, match="header names the column `output` more than once"):
        list(read_file(csv))


def test_preference_pairs_with_the_same_reply_are_dropped_as_identical_pair(tmp_path, tok):
    recs = [{"prompt": f"Pick {i}.", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    recs += [{"prompt": "Same?", "chosen": "same", "rejected": "same"}, {"prompt": "Same again?", "chosen": "same ", "rejected": " same"},
             {"prompt": "Mail?", "chosen": "write to a@gmail.com", "rejected": "write to b@gmail.com"}]
    # two different addresses get two different surrogates (consistent within a record), so the mail pair stays a pair
    r = run(write(tmp_path / "p.jsonl", recs), tok, tmp_path).report
    assert r["dropped"] == {"identical_pair": 2} and r["records_kept"] == 7
    assert r["records_read"] == 9


def test_a_repeated_source_is_streamed_in_chunks_and_counted(tmp_path, tok):
    recs = [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(32)]
    cfg = DataConfig(sources=[{"path": str(write(tmp_path / "w.jsonl", recs)), "weight": 100}], eval_split=2, cache_dir=str(tmp_path / "c"))
    data = prepare(cfg, tok, train_on="assistant", seed=0)
    r = data.report
    assert r["splits"]["train"]["records"] == 30 and r["splits"]["train"]["rows"] == 3000 == len(data.train)  # past one chunk of 2000
    assert r["repeated"] == 2970 and r["records_kept"] == 32
