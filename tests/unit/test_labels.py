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


# --------------------------------------------------------------------------- templates, tools, TRL, packing

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).parents[1]))

from tiny import build_tokenizer  # noqa: E402
from trainpipe.data.tokenize import BUILTIN, Template  # noqa: E402

MULTI = [
    {"role": "system", "content": "You repeat words."},
    {"role": "user", "content": "Say apple then river."},
    {"role": "assistant", "content": "apple river"},
    {"role": "user", "content": "Look it up."},
    {"role": "tool", "content": "stone cloud"},
    {"role": "assistant", "content": "stone cloud"},
]
ALL_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


@pytest.fixture(scope="module")
def rich_tok():
    return build_tokenizer(special=ALL_SPECIALS)


@pytest.mark.parametrize("name,eot", [("chatml", "<|im_end|>"), ("llama-3", "<|eot_id|>"), ("mistral", "<|endoftext|>"), ("alpaca", "<|endoftext|>")])
def test_builtin_templates_train_every_reply_plus_its_end_of_turn_and_no_tool_output(rich_tok, name, eot):
    assert setup_chat_template(rich_tok, name, "rich") == name
    t = tokenize_conversation(rich_tok, MULTI)
    loss = loss_text(rich_tok, t)
    first = "apple river" if name != "mistral" else " apple river"
    second = "stone cloud" if name != "mistral" else " stone cloud"
    assert loss == f"{first}{eot}{second}{eot}", loss
    last = loss_text(rich_tok, tokenize_conversation(rich_tok, MULTI, train_on="last_assistant"))
    assert last == f"{second}{eot}"
    every = tokenize_conversation(rich_tok, MULTI, train_on="all")
    prompt = prompt_text(rich_tok, every)
    assert prompt.strip().startswith("stone cloud") or "stone cloud" in prompt  # the tool output is never trained
    assert "Say apple then river." in loss_text(rich_tok, every)


@pytest.mark.parametrize("name", list(BUILTIN) + ["trl-qwen2.5"])
def test_fast_renderer_equals_apply_chat_template(rich_tok, name):
    if name == "trl-qwen2.5":
        import trl

        rich_tok.chat_template = (_Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    else:
        rich_tok.chat_template = BUILTIN[name][0]
    tpl = Template(rich_tok)
    for msgs in (MULTI, MULTI[:3], MULTI[1:3]):
        for gen in (False, True):
            assert tpl.render(msgs, gen) == rich_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_template_special_token_mismatch_is_an_error_before_training(tok):
    saved = tok.chat_template
    tok.chat_template = "{#- a model's own llama-3 style template -#}" + BUILTIN["llama-3"][0]  # the tiny tokenizer has no <|eot_id|> etc.
    try:
        with pytest.raises(ModelLoadError, match=r"emits <\|begin_of_text\|>.*does not have as special tokens"):
            setup_chat_template(tok, "tokenizer", "tiny")
    finally:
        tok.chat_template = saved
    with pytest.raises(ModelLoadError, match=r"built-in llama-3 template needs .* lacks <\|begin_of_text\|>"):
        setup_chat_template(tok, "llama-3", "tiny")
    setup_chat_template(tok, "chatml", "tiny")


def test_loss_tokens_equal_trl_assistant_only_loss(tiny_model_dir, tok):
    """The tokens that carry loss are the ones TRL's own assistant-only masking selects, on the same template."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    setup_chat_template(tok, "chatml", "tiny")
    convs = [MULTI, MULTI[:3], [{"role": "user", "content": "Say green."}, {"role": "assistant", "content": "green"}]]
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=SFTConfig(output_dir=str(tiny_model_dir.parent / "trl-out"), assistant_only_loss=True, report_to=[], max_length=None, use_cpu=True, dataset_num_proc=None),
        train_dataset=Dataset.from_list([{"messages": c} for c in convs]),
        processing_class=tok,
    )
    for conv, row in zip(convs, trainer.train_dataset):
        ours = tokenize_conversation(tok, conv)
        assert row["input_ids"] == ours.input_ids
        assert row["labels"] == ours.labels


def test_packed_rows_attend_within_each_example_only(tiny_model_dir, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from trainpipe.data.collate import PadCollator
    from trainpipe.data.packing import non_pad_share, pack

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    convs = [to_messages({"instruction": "Reverse the order of the words.", "input": x, "output": " ".join(reversed(x.split()))}, "alpaca")
             for x in ("apple river stone", "green seven", "blue tiger lamp orange")]
    rows = [vars(tokenize_conversation(tok, c)) for c in convs]
    packed = pack(rows, max_length=128)
    assert len(packed) == 1 and packed[0]["position_ids"].count(0) == 3
    batch = PadCollator(tok.pad_token_id)(packed)
    assert "attention_mask" not in batch and batch["use_cache"] is False
    with torch.no_grad():
        out = model(**batch).logits[0]
        off = 0
        for r in rows:
            alone = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
            n = len(r["input_ids"])
            assert torch.allclose(out[off : off + n], alone, atol=1e-4)
            off += n
    # padding-free: one row, no padding, same logits
    flat = PadCollator(tok.pad_token_id)([{**r, "padding_free": 1} for r in rows])
    assert flat["input_ids"].shape[0] == 1 and (flat["input_ids"] != tok.pad_token_id).all()
    assert non_pad_share([len(r["input_ids"]) for r in rows], mode="padding_free", max_length=128) == 1.0


def test_preference_pairs_end_with_the_end_of_turn_token(tok):
    from trainpipe.data.tokenize import encode_batch

    setup_chat_template(tok, "chatml", "tiny")
    ex = {"kind": "preference", "prompt": [{"role": "user", "content": "Say apple."}], "chosen": [{"role": "assistant", "content": "apple"}],
          "rejected": [{"role": "assistant", "content": "river"}]}
    (enc,) = encode_batch(tok, Template(tok), [ex], train_on="assistant", max_length=64, truncation="drop", min_tokens=1, max_tokens=None)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in enc.row["chosen_input_ids"] and im_end in enc.row["rejected_input_ids"]
    assert tok.decode(enc.row["prompt_input_ids"] + enc.row["chosen_input_ids"]) == Template(tok).render(ex["prompt"] + ex["chosen"])
