"""The built-in templates' skeleton render (data/templates.py, ``Template._from_skeleton``) equals the sandboxed Jinja render:
the same text and the same ``{% generation %}`` spans, on random conversations (any roles, contents with markup, braces,
the skeleton's own marker characters, empty ones), and so the same label spans."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))

from tiny import build_tokenizer  # noqa: E402
from trainpipe.data.templates import BUILTIN, Template, setup_chat_template  # noqa: E402

ALL_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PIECES = ["apple", " river ", "<b>&amp;</b>", "{{ x }}", "{% if %}", "\ue000", "0\ue001", "é ☃", "\n\n", "", "<|im_end|>", "'\"\\"]


def _conversation(rng: random.Random) -> list[dict]:
    roles = ["system"] * (rng.random() < 0.4) + [rng.choice(["user", "user", "assistant", "tool", "ipython"]) for _ in range(rng.randint(1, 6))]
    return [{"role": r, "content": "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))} for r in roles]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(special=ALL_SPECIALS)


@pytest.mark.parametrize("name", list(BUILTIN))
def test_skeleton_render_equals_the_sandboxed_render(tok, name):
    setup_chat_template(tok, name, "rich")
    tpl = Template(tok, name)
    assert tpl._one_pass
    rng = random.Random(name)
    fast = 0
    for _ in range(300):
        msgs = _conversation(rng)
        for gen in (False, True):
            want_gens, got_gens = [], []
            want = tpl._sandboxed(msgs, gen, want_gens)
            got = tpl._render(msgs, gen, got_gens)
            assert (got, got_gens) == (want, want_gens), msgs
            assert got == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    fast = sum(v is not None for v in tpl._skeletons.values())
    assert fast > 50  # the skeletons were used, not only the fallback
    # a skeleton built once is reused: the sandbox is not called for a conversation of a known structure
    msgs = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a."}]
    tpl.spans(msgs)
    tpl._sandboxed = None  # type: ignore[assignment]  # any sandboxed render now fails
    text, spans, _ = tpl.spans([{"role": "user", "content": "other"}, {"role": "assistant", "content": "reply"}])
    assert text[spans[0][0] : spans[0][1]].startswith(("reply", " reply"))


def test_skeleton_falls_back_for_what_it_does_not_cover(tok):
    setup_chat_template(tok, "chatml", "rich")
    tpl = Template(tok, "chatml")
    odd = [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "x"}]
    assert tpl._from_skeleton(odd, False, None) is None  # not a string: the sandbox renders (and says what fails)
    mark = [{"role": "us\ue000er", "content": "q"}, {"role": "assistant", "content": "x"}]
    assert tpl._from_skeleton(mark, False, None) is None and tpl._skeletons[(("us\ue000er", "assistant"), False)] is None
