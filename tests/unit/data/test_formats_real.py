"""The formats users bring (issue 24, "right on real data"), on extracts made like LLaMA-Factory's demo sets
(tests/assets/formats, written by tests/assets/make_format_assets.py): KTO as `messages` + `label`, content-part
lists, tools and tool calls through a real tool-aware chat template (a Qwen2.5/Hermes-style Jinja template written
here: no hub access), reasoning kept, masked or dropped, and `plan --data FILE` with the detector `prepare` uses."""

import copy
import json
import sys
from pathlib import Path

import pytest

from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import CHATML_TEMPLATE, Template, tokenize_conversation
from trainpipe.errors import DataError

ASSETS = Path(__file__).resolve().parents[2] / "assets"
FMT = ASSETS / "formats"

# Qwen2.5's tool format (Hermes): the schemas in the system turn inside <tools>, calls as <tool_call> JSON, results as
# <tool_response> in a user turn; reasoning_content rendered (Qwen3-style) on the last assistant turn only.
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content and loop.last %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}"
    "{%- for tc in message.tool_calls or [] %}{% if loop.first and message.content %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tiny import build_tokenizer

    t = build_tokenizer()
    t.chat_template = QWEN_TOOLS
    return t


def _cfg(tmp_path, path, **kw):
    src = {"path": str(path), **kw.pop("src", {})}
    return DataConfig(sources=[src], eval_split=kw.pop("eval_split", 1), cache_dir=str(tmp_path / "cache"), **kw)


def _trained(tok, t) -> str:
    return tok.decode([i for i in t.labels if i != IGNORE_INDEX])


def test_assets_are_what_the_script_writes():
    sys.path.insert(0, str(ASSETS))
    from make_format_assets import files

    for name, text in files().items():
        assert (FMT / name).read_text(encoding="utf-8") == text, f"{name} differs: run python tests/assets/make_format_assets.py"


# ----------------------------------------------------------------------------------------------- KTO
def test_kto_messages_and_label_as_llama_factory_writes_it(tmp_path, tok):
    assert formats.detect_file(FMT / "kto_en_demo.json")[0] == "kto"
    rec = json.loads((FMT / "kto_en_demo.json").read_text())[1]
    ex = formats.to_example(rec, "kto")
    assert ex["label"] is False and ex["prompt"] == [{"role": "user", "content": "Name three primary colours."}]
    assert ex["completion"] == [{"role": "assistant", "content": "Green is a colour."}]
    data = prepare(_cfg(tmp_path, FMT / "kto_en_demo.json", eval_split=2), tok, train_on="assistant", seed=0)
    assert data.report["sources"][0]["format"] == "kto"
    rows = data.train.to_list() if hasattr(data.train, "to_list") else list(data.train)
    assert sorted(r["label"] for r in rows) in ([False, False, True, True], [False, True, True, True], [False, False, False, True])
    assert all(r["completion_input_ids"] for r in rows)


def test_kto_through_columns(tmp_path, tok):
    p = tmp_path / "votes.jsonl"
    recs = [{"dialog": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}], "thumbs_up": i % 2 == 0}
            for i, w in enumerate(["one", "two", "three", "four", "five"])]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(_cfg(tmp_path, p, src={"columns": {"messages": "dialog", "label": "thumbs_up"}}), tok, train_on="assistant", seed=0)
    assert data.report["sources"][0]["format"] == "kto"
    assert data.report["records_kept"] == 5


# ----------------------------------------------------------------------------------------------- content parts
def test_content_parts_text_joined_remote_image_dropped_naming_file_and_line(tmp_path, tok):
    rec = json.loads((FMT / "content_parts.jsonl").read_text().splitlines()[0])
    ex = formats.to_example(rec, "chat")
    assert ex["messages"][0]["content"] == "Summarise this sentence:\nThe cat sat on the warm mat all afternoon."
    # line 3's `image_url` is a web address: never downloaded while preparing; the record is dropped and counted
    # (`bad_image`, whatever `on_error` says) with its file and line in rejected.jsonl (data/vision_chat.py)
    data = prepare(_cfg(tmp_path, FMT / "content_parts.jsonl"), tok, train_on="assistant", seed=0, rejected_path=tmp_path / "rej.jsonl")
    assert data.report["dropped"].get("bad_image") == 1 and data.report["records_kept"] == 3
    (rej,) = [json.loads(x) for x in (tmp_path / "rej.jsonl").read_text().splitlines()]
    assert rej["line"] == 3 and rej["source"].endswith("content_parts.jsonl") and "web address" in rej["reason"]
    audio = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, {"role": "assistant", "content": "x"}]}
    with pytest.raises(formats.FormatError) as e:
        formats.to_example(audio, "chat")
    assert "`input_audio`" in str(e.value) and e.value.kind == "non_text_content"


# ----------------------------------------------------------------------------------------------- tools
def test_glaive_tools_reach_the_template_and_calls_are_trained_not_results(tok):
    recs = json.loads((FMT / "glaive_toolcall_en_demo.json").read_text())
    ex = formats.to_example(recs[1], formats.detect(recs[1])[0])
    assert [t["name"] for t in ex["tools"]] == ["convert_currency", "get_current_weather"]
    assert [m["role"] for m in ex["messages"]] == ["user", "assistant", "tool", "assistant"]
    tpl = Template(tok)
    text, _, _ = tpl.spans(ex["messages"], "assistant", ex["tools"])
    assert "<tools>" in text and '"name": "convert_currency"' in text and "Convert an amount from one currency" in text
    assert '"name": "get_current_weather"' in text
    trained = _trained(tok, tokenize_conversation(tok, ex["messages"], template=tpl, tools=ex["tools"]))
    assert '<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 250' in trained  # the call is trained
    assert "231.50 euros" in trained
    assert "converted_amount" not in trained and "<tools>" not in trained  # the result and the schemas are not
    assert formats.to_example(recs[3], "sharegpt").get("tools") is None  # `"tools": ""`: none


def test_openai_tool_calls_render_and_prepare(tmp_path, tok):
    rec = json.loads((FMT / "tool_calls.jsonl").read_text().splitlines()[0])
    ex = formats.to_example(rec, "chat")
    assert ex["messages"][1]["tool_calls"][0]["function"] == {"name": "get_current_weather", "arguments": {"city": "Lisbon"}}
    # the tiny tokenizer spends a token on most JSON characters: room for the schemas
    data = prepare(_cfg(tmp_path, FMT / "glaive_toolcall_en_demo.json", eval_split=1, max_length=4096), tok, train_on="assistant", seed=0)
    assert data.report["records_kept"] == 4 and not data.report["dropped"]


def test_template_that_ignores_tools_gets_them_in_the_system_message_said_once(tok, capsys, monkeypatch):
    from trainpipe.data import templates

    monkeypatch.setattr(templates, "_SAID", set())  # "once" is per process: an earlier test may have said it for the same template
    t2 = copy.deepcopy(tok)
    t2.chat_template = CHATML_TEMPLATE
    tpl = Template(t2, "chatml")
    ex = formats.to_example(json.loads((FMT / "glaive_toolcall_en_demo.json").read_text())[0], "sharegpt")
    text, spans, _ = tpl.spans(ex["messages"], "assistant", ex["tools"])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions") and '"name": "get_current_weather"' in text
    assert '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Oslo"' in text  # calls written Hermes-style
    tpl.spans(ex["messages"], "assistant", ex["tools"])
    out = capsys.readouterr().out
    assert out.count("ignores `tools`") == 1 and out.count("does not render assistant `tool_calls`") == 1


def test_template_that_names_tools_only_partly_is_refused(tok):
    from trainpipe.errors import ModelLoadError

    t2 = copy.deepcopy(tok)  # renders the first tool only: the second would be trained without its schema
    t2.chat_template = QWEN_TOOLS.replace("{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}", "\n{{ tools[0] | tojson }}")
    ex = formats.to_example(json.loads((FMT / "glaive_toolcall_en_demo.json").read_text())[1], "sharegpt")
    with pytest.raises(ModelLoadError, match="get_current_weather"):
        Template(t2).spans(ex["messages"], "assistant", ex["tools"])


def test_preference_pairs_that_differ_only_in_their_tool_call_are_kept(tmp_path, tok):
    call = lambda city: {"role": "assistant", "content": "", "tool_calls": [  # noqa: E731
        {"type": "function", "function": {"name": "get_current_weather", "arguments": {"city": city}}}]}
    p = tmp_path / "pairs.jsonl"
    recs = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "chosen": [call(c)], "rejected": [call("Paris")]}
            for c in ("Oslo", "Rome", "Lima")]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(_cfg(tmp_path, p), tok, train_on="assistant", seed=0)
    assert "identical_pair" not in data.report["dropped"] and "empty_response" not in data.report["dropped"]
    assert data.report["records_kept"] == 3


# ----------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("template", ["qwen", "chatml"])
def test_reasoning_train_mask_drop_last_turn_only(tok, template):
    t2 = copy.deepcopy(tok)
    if template == "chatml":
        t2.chat_template = CHATML_TEMPLATE
    recs = [json.loads(line) for line in (FMT / "reasoning.jsonl").read_text().splitlines()]
    think = formats.to_example(recs[1], "chat")["messages"][1]
    assert think["content"] == "No: 91 = 7 x 13." and think["reasoning_content"].startswith("91 = 7 x 13, so")
    multi = formats.to_example(recs[2], "chat")["messages"]
    name = "chatml" if template == "chatml" else "tokenizer"
    for mode in ("train", "mask", "drop"):
        tpl = Template(t2, name, reasoning=mode)
        t = tokenize_conversation(t2, multi, template=tpl)
        text = t2.decode(t.input_ids)
        trained = _trained(t2, t)
        assert "8 x 2 = 16." not in text  # an earlier turn without its thinking
        assert "16" in trained and "32" in trained
        if mode == "drop":
            assert "16 x 2 = 32." not in text
        else:
            assert "<think>\n16 x 2 = 32.\n</think>" in text
            assert ("16 x 2 = 32." in trained) == (mode == "train")
            if mode == "mask":
                assert "<think>" not in trained and trained.rstrip().endswith("32<|im_end|>")


def test_reasoning_option_reaches_prepare(tmp_path, tok):
    loss = {}
    for mode in ("train", "mask", "drop"):
        d = prepare(_cfg(tmp_path, FMT / "reasoning.jsonl", reasoning=mode, eval_split=1), tok, train_on="assistant", seed=0)
        loss[mode] = (d.report["splits"]["train"]["tokens"], d.report["splits"]["train"]["loss_tokens"])
    assert loss["train"][0] == loss["mask"][0] > loss["drop"][0]  # mask renders the reasoning, drop does not
    assert loss["train"][1] > loss["mask"][1]  # and only train puts loss on it


def test_reasoning_tool_calls_and_schemas_count_toward_the_character_bound():
    from trainpipe.data.tokenize import bound_example

    think = {"kind": "sft", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "x" * 500}]}
    assert bound_example(think, 400, "drop") == (None, False)  # the reasoning is rendered: it counts
    cut, was_cut = bound_example(think, 400, "truncate")
    assert was_cut and "reasoning_content" not in cut["messages"][-1] and cut["messages"][-1]["content"] == "a"
    tooled = {"kind": "sft", "tools": [{"name": "f", "description": "d" * 500}], "messages": think["messages"][:1] + [{"role": "assistant", "content": "a"}]}
    assert bound_example(tooled, 400, "drop") == (None, False)
    assert bound_example(tooled, 4000, "drop") == (tooled, False)


# ----------------------------------------------------------------------------------------------- plan --data
def test_plan_data_file_uses_the_prepare_detector(capsys):
    from trainpipe.cli import main

    for name, stages in (("dpo_en_demo.json", ["dpo"]), ("kto_en_demo.json", ["kto"]), ("glaive_toolcall_en_demo.json", ["sft"])):
        assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "A100-80GB", "--data", str(FMT / name), "--json"]) == 0, name
        assert json.loads(capsys.readouterr().out)["objective"]["stages"] == stages, name


def test_method_auto_reads_the_data_kind_with_the_same_detector(tmp_path):
    from trainpipe.config import build_config
    from trainpipe.plan.objective import expand_auto

    for src, method in (({"path": str(FMT / "dpo_en_demo.json")}, "dpo"),  # a JSON array, as LLaMA-Factory ships it
                        ({"path": str(ASSETS / "data" / "columns.csv"), "columns": {"instruction": "question", "output": "answer"}}, "sft")):
        cfg = build_config({"model": {"name_or_path": "m"}, "data": {"sources": [src]}, "method": {"name": "auto"}}, base_dir=tmp_path)
        assert expand_auto(cfg)[0].method.name == method
