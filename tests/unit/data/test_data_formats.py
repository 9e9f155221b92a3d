"""Formats: each normalises to its example kind; auto says what it chose; columns map other names."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.formats import FormatError, apply_columns, detect, to_example
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


def test_sharegpt_roles_map_to_chat():
    rec = {"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Weather?"},
        {"from": "function_call", "value": '{"name": "weather"}'}, {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."},
    ]}
    assert detect(rec)[0] == "sharegpt"
    ex = to_example(rec, "sharegpt")
    assert [m["role"] for m in ex["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    with pytest.raises(FormatError, match=r"conversations\[0\]\.from must be one of"):
        to_example({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt")
    with pytest.raises(FormatError, match="no assistant"):
        to_example({"conversations": [{"from": "human", "value": "x"}]}, "sharegpt")


def test_preference_strings_conversations_and_sharegpt_turns():
    ex = to_example({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "preference")
    assert ex == {"kind": "preference", "prompt": [{"role": "user", "content": "2+2?"}],
                  "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}
    conv = {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}
    assert detect(conv)[0] == "preference"
    ex2 = to_example(conv, "preference")
    assert ex2["prompt"] == ex["prompt"] and ex2["chosen"] == ex["chosen"] and ex2["rejected"] == ex["rejected"]
    sg = {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": "4"}, "rejected": {"from": "gpt", "value": "5"}}
    why = detect(sg)
    assert why[0] == "preference" and "ShareGPT" in why[1]
    assert to_example(sg, "preference") == ex


def test_kto_and_text():
    ex = to_example({"prompt": "Hi", "completion": "Hello!", "label": True}, "kto")
    assert ex["label"] is True and ex["completion"] == [{"role": "assistant", "content": "Hello!"}]
    assert detect({"prompt": "Hi", "completion": "x", "label": False})[0] == "kto"
    with pytest.raises(FormatError, match="`label` must be true or false"):
        to_example({"prompt": "Hi", "completion": "x", "label": "maybe"}, "kto")
    assert to_example({"text": "Once upon a time."}, "text") == {"kind": "text", "text": "Once upon a time."}


def test_columns_map_other_field_names():
    rec = apply_columns({"question": "Q?", "answer": "A."}, {"instruction": "question", "output": "answer"})
    assert detect(rec)[0] == "alpaca"
    assert to_example(rec, "alpaca")["messages"][-1] == {"role": "assistant", "content": "A."}


def test_chat_without_assistant_turn_and_unknown_role():
    with pytest.raises(FormatError, match="no assistant turn"):
        to_example({"messages": [{"role": "user", "content": "hi"}]}, "chat")
    with pytest.raises(FormatError, match=r"messages\[0\]\.role must be one of system, user, assistant, tool, got 'bot'"):
        to_example({"messages": [{"role": "bot", "content": "hi"}]}, "chat")


def test_strings_and_responses_cover_every_kind():
    pref = to_example({"prompt": "p", "chosen": "c", "rejected": "r"}, "preference")
    assert formats.strings(pref) == ["p", "c", "r"] and formats.responses(pref) == ["c", "r"]
    up = formats.map_strings(pref, str.upper)
    assert formats.strings(up) == ["P", "C", "R"] and formats.strings(pref) == ["p", "c", "r"]


def test_preference_and_kto_are_tokenized_for_dpo_style_trainers(tmp_path, tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    p = tmp_path / "pref.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"Say {i} apple.", "chosen": f"apple {i}", "rejected": f"river {i} stone"}) + "\n" for i in range(20)))
    data = prepare(DataConfig(sources=[{"path": str(p), "format": "preference", "columns": {}}], eval_split=2, cache_dir=str(tmp_path / "c")),
                   tiny_tokenizer, train_on="assistant", seed=0)
    row = data.train[0]
    assert set(row) == {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}
    assert tiny_tokenizer.decode(row["prompt_input_ids"]).endswith("<|im_start|>assistant\n")
    chosen = tiny_tokenizer.decode(row["chosen_input_ids"])
    assert chosen.startswith("apple ") and chosen.endswith("<|im_end|>\n")
    k = tmp_path / "kto.jsonl"
    k.write_text("".join(json.dumps({"prompt": f"Say {i}.", "completion": f"{i} said", "label": i % 2 == 0}) + "\n" for i in range(10)))
    kd = prepare(DataConfig(sources=[{"path": str(k)}], eval_split=2, cache_dir=str(tmp_path / "c")), tiny_tokenizer, train_on="assistant", seed=0)
    assert set(kd.train[0]) == {"prompt_input_ids", "completion_input_ids", "label"}
    assert kd.report["sources"][0]["format"] == "kto"


def test_record_that_fits_no_format_is_rejected_with_reason(tmp_path, tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: fits no known format \(fields: question\).*columns:"):
        prepare(DataConfig(sources=[{"path": str(p)}], cache_dir=str(tmp_path / "c")), tiny_tokenizer, train_on="assistant", seed=0)


def test_preference_data_under_sft_is_a_clear_error_and_inspect_shows_pairs(tmp_path, tiny_tokenizer):
    from trainpipe.data.report import inspect_examples

    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    p = tmp_path / "pref.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"Say {i} apple.", "chosen": f"apple {i}", "rejected": f"river {i}"}) + "\n" for i in range(10)))
    cfg = DataConfig(sources=[{"path": str(p)}], eval_split=2, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match="preference pairs .* `method.name: sft` cannot train on"):
        prepare(cfg, tiny_tokenizer, train_on="assistant", seed=0, for_method="sft")
    data = prepare(cfg, tiny_tokenizer, train_on="assistant", seed=0)
    (ex,) = inspect_examples(data, tiny_tokenizer, n=1)
    assert ex["trained_text"].startswith("apple ") and ex["rejected_text"].startswith("river ")
