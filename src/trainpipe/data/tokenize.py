"""Chat templates and label masks.

A conversation is rendered with the tokenizer's chat template (or the built-in ChatML
one), tokenized once with character offsets, and each token carries loss iff it starts
inside an assistant span. An assistant span runs from the end of the generation prompt
to the end of the end-of-turn token that closes the reply, so the loss covers exactly the
response text plus its end-of-turn token: nothing of the prompt, nothing after the token.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpipe.errors import ModelLoadError

from trainpipe.data.collate import IGNORE_INDEX  # noqa: E402

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class TemplateError(ValueError):
    """The chat template cannot be used for label masking with this tokenizer."""


def setup_chat_template(tokenizer, choice: str, model_path: str) -> str:
    """Install the chat template chosen by ``data.chat_template`` on ``tokenizer``; return its name."""
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if choice == "tokenizer" and not has_own:
        raise ModelLoadError(
            f"`data.chat_template: tokenizer` but the tokenizer of `{model_path}` has no chat template. "
            "Set `data.chat_template: chatml` (or `auto`) to use the built-in ChatML template."
        )
    if choice == "tokenizer" or (choice == "auto" and has_own):
        return "tokenizer"
    vocab = tokenizer.get_vocab()
    missing = [t for t in CHATML_TOKENS if t not in vocab]
    if missing:
        raise ModelLoadError(
            f"The built-in ChatML template needs the tokens {', '.join(CHATML_TOKENS)}, but the tokenizer of "
            f"`{model_path}` lacks {', '.join(missing)}. Use a tokenizer that has a chat template "
            "(`data.chat_template: tokenizer`) or one that reserves the ChatML tokens."
        )
    tokenizer.chat_template = CHATML_TEMPLATE
    return "chatml"


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted((s for s in specials if s), key=len, reverse=True)


def assistant_spans(tokenizer, messages: list[dict], train_on: str = "assistant") -> tuple[str, list[tuple[int, int]], list[str]]:
    """Render ``messages`` and return (text, character spans that carry loss, end-of-turn tokens seen)."""
    text = render(tokenizer, messages)
    if train_on == "all":
        return text, [(0, len(text))], []
    specials = _special_strings(tokenizer)
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        idx = idx[-1:]
    spans, eots = [], []
    for i in idx:
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not upto.startswith(prefix) or not text.startswith(upto):
            raise TemplateError(
                "the chat template does not render a conversation as a prefix of its continuation, "
                "so the assistant turns cannot be located for label masking; use `data.chat_template: chatml`"
            )
        content = messages[i]["content"].strip()
        pos = upto.find(content, len(prefix)) if content else len(prefix)
        if pos < 0:
            raise TemplateError("the chat template changes the assistant content, so its tokens cannot be located")
        content_end = pos + len(content)
        best = None
        for s in specials:
            j = upto.find(s, content_end)
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            raise TemplateError(
                "the chat template emits no end-of-turn token after an assistant reply, so the model would never "
                "learn to stop; use a template that closes turns with a special token (e.g. `data.chat_template: chatml`)"
            )
        spans.append((len(prefix), best[0] + len(best[1])))
        eots.append(best[1])
    return text, spans, eots


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]

    @property
    def n_loss_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


def tokenize_conversation(tokenizer, messages: list[dict], train_on: str = "assistant") -> Tokenized:
    """Tokenize a conversation with labels masked to the assistant spans (IGNORE_INDEX elsewhere)."""
    text, spans, _ = assistant_spans(tokenizer, messages, train_on)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = []
    for tok, (s, e) in zip(ids, enc["offset_mapping"]):
        inside = any(a <= s < b for a, b in spans) and e > s
        labels.append(tok if inside else IGNORE_INDEX)
    return Tokenized(ids, labels)


def generation_prompt(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(prompt text ending with the generation prompt, reference reply) for the last assistant turn."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render(tokenizer, messages[:last], add_generation_prompt=True), messages[last]["content"]
