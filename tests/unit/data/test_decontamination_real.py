"""Decontamination against what can contaminate: on templated data (100 preference pairs sharing a
boilerplate system prompt and a stock opening, tests/assets/templated_preference.jsonl, made like the
LLaMA-Factory demo sets) nothing is dropped when the eval split is drawn from the same file, while a record
whose response truly copies an eval response is dropped, with the n-gram and the eval record named."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainpipe.config import DataConfig
from trainpipe.data.dedup import Decontaminator, Words
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template

ASSET = Path(__file__).parents[2] / "assets" / "templated_preference.jsonl"


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def _cfg(tmp_path, sources, **kw):
    return DataConfig(sources=sources, cache_dir=str(tmp_path / "c"), **kw)


def test_templated_pairs_with_an_eval_split_from_the_same_file_lose_nothing(tmp_path, tok):
    p = tmp_path / "pairs.jsonl"
    shutil.copyfile(ASSET, p)
    r = prepare(_cfg(tmp_path, [{"path": str(p)}], eval_split=10), tok, train_on="assistant", seed=0).report
    assert r["dropped"].get("decontaminated", 0) == 0, r["decontamination"]["drops"][:3]
    assert r["splits"]["train"]["records"] == 90 and r["splits"]["eval"]["records"] == 10
    d = r["decontamination"]
    assert d["boilerplate_ngrams_ignored"] > 0 and d["boilerplate_records"] == 5  # the stock opening of the replies


def test_a_response_copied_from_an_eval_response_is_dropped_and_named(tmp_path, tok):
    rows = [json.loads(x) for x in ASSET.read_text().splitlines()]
    train, ev = rows[10:], rows[:10]
    leak = dict(train[0])
    leak["conversations"] = [train[0]["conversations"][0], {"from": "human", "value": "Tell me anything you like."}]
    leak["chosen"] = {"from": "gpt", "value": "Here it is. " + ev[3]["chosen"]["value"]}
    leak["conversations"][1]["value"] = "Tell me anything you like about a subject of your choice: " + " ".join(f"topic{k}" for k in range(30))
    leak["rejected"] = {"from": "gpt", "value": "No. " + " ".join(f"refusal{k}" for k in range(40))}
    pt, pe = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    pt.write_text("".join(json.dumps(x) + "\n" for x in train + [leak]))
    pe.write_text("".join(json.dumps(x) + "\n" for x in ev))
    r = prepare(_cfg(tmp_path, [{"path": str(pt)}, {"path": str(pe), "role": "eval"}]), tok, train_on="assistant", seed=0).report
    assert r["dropped"] == {"decontaminated": 1} and r["splits"]["train"]["records"] == 90
    [drop] = r["decontamination"]["drops"]
    assert drop["record"] == f"{pt}:{len(train) + 1}" and drop["matched"] == f"eval split {pe}:4" and drop["overlap"] == 1.0
    words = drop["ngram"].split()
    assert len(words) == 13 and drop["ngram"] in " ".join(Words().ids(ev[3]["chosen"]["value"])[0])
    assert "step by step and justify" not in drop["ngram"]  # not the shared opening, which is boilerplate
    from trainpipe.data.report import summary_lines

    shown = "\n".join(summary_lines(r))
    assert "1 dropped" in shown and repr(drop["ngram"]) in shown and f"eval split {pe}:4" in shown


def test_shared_prompts_of_the_eval_split_are_not_contamination(tmp_path, tok):
    # the eval records ask the training records' questions (same prompt, different reply): not contamination by default
    q = "Explain in detail how the tides of the ocean are caused by the moon and the sun together every day"
    train = [{"instruction": q + f" (variant {i})", "output": f"answer {i}: " + " ".join(f"w{i}_{k}" for k in range(15))} for i in range(12)]
    train += [{"instruction": f"Name fruit {i}.", "output": f"fruit {i}"} for i in range(3)]
    ev = [{"instruction": q + " (variant 0)", "output": "a different reply entirely about gravity and water levels"}]
    pt, pe = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    pt.write_text("".join(json.dumps(x) + "\n" for x in train))
    pe.write_text("".join(json.dumps(x) + "\n" for x in ev))
    srcs = [{"path": str(pt)}, {"path": str(pe), "role": "eval"}]
    r = prepare(_cfg(tmp_path, srcs, dedup={"near": False}), tok, train_on="assistant", seed=0).report
    assert r["dropped"].get("decontaminated", 0) == 0
    r_all = prepare(_cfg(tmp_path, srcs, dedup={"near": False}, decontamination={"against": "all", "boilerplate_records": 20}),
                    tok, train_on="assistant", seed=0).report
    assert r_all["dropped"]["decontaminated"] == 12  # `against: all` (and a higher boilerplate bar) counts the prompts


def test_decontaminator_ignores_ngrams_in_many_records():
    w = Words()
    d = Decontaminator(4, share=0.0, min_records=2, min_overlap=0.5)
    d.add(w.ids("alpha beta gamma delta epsilon")[1], "eval 1")
    d.add(w.ids("one two three four five")[1], "eval 2")
    d.add(w.ids("red green blue cyan magenta yellow black white")[1], "eval 3")
    recs = [f"x{i} alpha beta gamma delta" for i in range(3)] + ["y one two three four z", "red green blue cyan and more"]
    arrays = [w.ids(t) for t in recs]
    d.count([a for _, a in arrays])
    assert d.threshold == 2 and d.boilerplate() == 1  # "alpha beta gamma delta": in 3 records
    hits = d.check([ws for ws, _ in arrays], [a for _, a in arrays])
    assert hits[:3] == [None, None, None]  # boilerplate
    assert hits[3] == ("one two three four", "eval 2", 0.5)  # half of the reference's n-grams
    assert hits[4] is None  # 1 of the 5 n-grams of "eval 3": a phrase in common, not a copy
    assert isinstance(arrays[0][1], np.ndarray)


TOOLS_SYSTEM = ("You are a helpful assistant with access to the following functions. Use them if required. "
                '[{"name": "get_weather", "description": "Get the current weather in a given city", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}, '
                '{"name": "convert_currency", "description": "Convert an amount from one currency to another", "parameters": '
                '{"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}}}]')


def test_tool_call_dialogues_sharing_a_system_prompt_lose_nothing(tmp_path, tok):
    cities = ["Paris", "Lagos", "Lima", "Oslo", "Hanoi", "Quito", "Perth", "Cairo", "Dhaka", "Riga"]
    rows = []
    for i in range(60):
        c = cities[i % 10]
        rows.append({"messages": [
            {"role": "system", "content": TOOLS_SYSTEM},
            {"role": "user", "content": f"Ticket {i}: " + " ".join(f"note{i}x{k}" for k in range(12)) + f". What's the weather like in {c} right now?"},
            {"role": "assistant", "content": f'{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}'},
            {"role": "tool", "content": f'{{"temperature": {10 + i % 17}, "condition": "clear", "ticket": {i}}}'},
            {"role": "assistant", "content": f"The current weather in {c} is {10 + i % 17} degrees Celsius and the sky is clear. "
                                             "Let me know if there is anything else I can help you with today."},
        ]})
    p = tmp_path / "tools.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = prepare(_cfg(tmp_path, [{"path": str(p)}], eval_split=6, max_length=1024), tok, train_on="assistant", seed=0).report
    assert r["dropped"] == {}, (r["dropped"], r["decontamination"]["drops"][:3])
    assert r["splits"]["train"]["records"] == 54 and r["decontamination"]["boilerplate_ngrams_ignored"] > 0
