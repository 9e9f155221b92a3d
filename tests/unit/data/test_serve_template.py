"""Serve as trained (issue 35, points 5-6): the exported tokenizer's chat template renders `tools=`, assistant
`tool_calls` turns and reasoning exactly as training rendered them: the same token ids through
`AutoTokenizer.from_pretrained(export).apply_chat_template(..., tools=...)` as through the training path
(data/tokenize.py), for the built-in templates and for a template that renders tools itself."""

import json

import pytest
from transformers import AutoTokenizer

from trainpipe.data.serve_template import MARK, describe
from trainpipe.data.templates import Template, setup_chat_template
from trainpipe.data.tokenize import generation_prompt, tokenize_conversation
from trainpipe.export import model_card, save_tokenizer

TOOLS = [{"name": "send_email", "description": "Send an email", "parameters": {"type": "object", "properties": {
    "recipient": {"type": "string"}, "message": {"type": "string"}}, "required": ["recipient"]}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": {"type": "object", "properties": {}}}}]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant with tools."},
    {"role": "user", "content": "Email taylor.smith@example.org that the café opens at 9."},
    {"role": "assistant", "content": "", "reasoning_content": "An earlier thought, never rendered.",
     "tool_calls": [{"type": "function", "function": {"name": "send_email", "arguments": {"recipient": "taylor.smith@example.org", "message": "Opens at 9."}}}]},
    {"role": "tool", "content": json.dumps({"status": "sent"})},
    {"role": "assistant", "content": "Sent: the café opens at 9.", "reasoning_content": "The tool returned sent, so confirm."},
]
# a template that renders tools and tool calls itself (Qwen2.5/Hermes style): trainpipe's prelude must leave it alone
OWN = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _served(conversation):
    """What a serving client sends: OpenAI-style, content None on a tool-call turn."""
    return [{**m, "content": None} if m.get("tool_calls") else m for m in conversation]


def _ids(out):
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("template,reasoning", [("chatml", "train"), ("chatml", "drop"), ("llama-3", "train"), ("own", "train")])
def test_the_export_renders_tools_calls_and_reasoning_as_training_did(tmp_path, tiny_model_dir, template, reasoning):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})
    if template == "own":
        tok.chat_template = OWN
    name = setup_chat_template(tok, "tokenizer" if template == "own" else template, "tiny")
    tok.trainpipe_reasoning = reasoning  # what data/prepare.py records
    tpl = Template(tok, name, reasoning=reasoning)
    trained = tokenize_conversation(tok, CONVERSATION, "assistant", template=tpl, tools=TOOLS).input_ids
    save_tokenizer(tok, tmp_path / "export")
    assert tok.chat_template.startswith(MARK) is False  # the live tokenizer keeps the template training renders with
    served = AutoTokenizer.from_pretrained(tmp_path / "export")
    ids = _ids(served.apply_chat_template(_served(CONVERSATION), tools=TOOLS, tokenize=True))
    assert ids == trained
    text = served.decode(ids)
    assert ("The tool returned sent" in text) == (reasoning != "drop") and "An earlier thought" not in text
    assert "send_email" in text and "get_time" in text
    # the prompt a served model continues equals the eval prompt training built
    prompt, _ = generation_prompt(tok, CONVERSATION, template=tpl, tools=TOOLS)
    assert served.apply_chat_template(_served(CONVERSATION[:-1]), tools=TOOLS, tokenize=False, add_generation_prompt=True) == prompt
    # without tools, calls or reasoning the export renders as the run's own template does
    plain = CONVERSATION[:2] + [{"role": "assistant", "content": "Sure."}]
    assert served.apply_chat_template(plain, tokenize=False) == tpl.render(plain)


def test_the_model_card_says_which_format_the_model_learned(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    setup_chat_template(tok, "chatml", "tiny")
    text = model_card({"name": "m", "chat_format": describe(tok, "train")})
    assert "## Chat format" in text and "Hermes `<tools>` block" in text and "<tool_call>" in text and "<think>" in text
