"""Label masks: the tokens that carry loss decode to exactly the response plus its end-of-turn token."""

import pytest

from trainpipe.data.formats import to_messages
from trainpipe.data.tokenize import CHATML_TEMPLATE, TemplateError, generation_prompt, setup_chat_template, tokenize_conversation
from trainpipe.errors import ModelLoadError


@pytest.fixture()
def tok(tiny_tokenizer):
    t = tiny_tokenizer
    t.chat_template = None
    assert setup_chat_template(t, "auto", "tiny") == "chatml"
    return t


def loss_text(tok, t):
    return tok.decode([i for i, l in zip(t.input_ids, t.labels) if l != -100], skip_special_tokens=False)


def prompt_text(tok, t):
    return tok.decode([i for i, l in zip(t.input_ids, t.labels) if l == -100], skip_special_tokens=False)


def test_alpaca_loss_is_response_plus_end_of_turn(tok):
    msgs = to_messages({"instruction": "Reverse the order of the words.", "input": "apple river stone", "output": "stone river apple"}, "alpaca")
    t = tokenize_conversation(tok, msgs)
    assert loss_text(tok, t) == "stone river apple<|im_end|>"
    assert "Reverse" in prompt_text(tok, t) and "apple river stone" in prompt_text(tok, t)
    assert "stone river apple" not in prompt_text(tok, t)


def test_chat_loss_covers_every_assistant_turn_only(tok):
    msgs = [
        {"role": "system", "content": "You repeat words."},
        {"role": "user", "content": "Say apple then river."},
        {"role": "assistant", "content": "apple river"},
        {"role": "user", "content": "Say stone then cloud."},
        {"role": "assistant", "content": "stone cloud"},
    ]
    t = tokenize_conversation(tok, msgs)
    assert loss_text(tok, t) == "apple river<|im_end|>stone cloud<|im_end|>"
    last = tokenize_conversation(tok, msgs, train_on="last_assistant")
    assert loss_text(tok, last) == "stone cloud<|im_end|>"
    every = tokenize_conversation(tok, msgs, train_on="all")
    assert all(l != -100 for l in every.labels)


def test_labels_align_with_input_ids(tok):
    msgs = to_messages({"instruction": "Say it.", "output": "green seven"}, "alpaca")
    t = tokenize_conversation(tok, msgs)
    assert len(t.labels) == len(t.input_ids)
    assert all(l in (-100, i) for i, l in zip(t.input_ids, t.labels))


def test_generation_prompt_ends_with_assistant_header(tok):
    msgs = to_messages({"instruction": "Say it.", "output": "green seven"}, "alpaca")
    prompt, ref = generation_prompt(tok, msgs)
    assert prompt.endswith("<|im_start|>assistant\n") and ref == "green seven"


def test_template_without_end_of_turn_token_is_rejected(tiny_tokenizer):
    tiny_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    msgs = to_messages({"instruction": "Say it.", "output": "green seven"}, "alpaca")
    try:
        with pytest.raises(TemplateError, match="no end-of-turn token"):
            tokenize_conversation(tiny_tokenizer, msgs)
    finally:
        tiny_tokenizer.chat_template = CHATML_TEMPLATE


def test_chatml_needs_its_tokens():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tiny import build_tokenizer

    bare = build_tokenizer(special=("<|endoftext|>", "<|pad|>"))
    with pytest.raises(ModelLoadError, match="lacks <\\|im_start\\|>, <\\|im_end\\|>"):
        setup_chat_template(bare, "chatml", "bare")
    with pytest.raises(ModelLoadError, match="has no chat template"):
        setup_chat_template(bare, "tokenizer", "bare")
