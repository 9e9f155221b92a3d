"""Label masks: rendered conversations tokenized once, each token carrying loss iff it starts inside a trained span.

An assistant span (data/templates.py, :meth:`Template.spans`) runs from the end of the generation prompt to the end
of the end-of-turn token that closes the reply, so the loss covers exactly the response text plus its end-of-turn
token: nothing of the prompt, nothing after the token. Tool outputs never carry loss, not even with ``train_on: all``.
The text is tokenized once with character offsets (:func:`_labels` maps spans to tokens).

:func:`encode_batch` turns a batch of examples (any kind) into stored rows, or a drop reason for each. The chat
templates (data/templates.py), their sandbox (data/sandbox.py) and the length rules (data/lengths.py) have modules of
their own; their public names are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainpipe.data.lengths import CHARS_PER_TOKEN, MIN_CHARS, bound_example, max_chars, policy, row_loss_tokens, row_tokens, truncate_pair
from trainpipe.data.packing import IGNORE_INDEX
from trainpipe.data.sandbox import TEMPLATE_MAX_CHARS, TEMPLATE_SECONDS, template_watch
from trainpipe.data import vision_chat
from trainpipe.data.templates import (
    ALPACA_TEMPLATE, BUILTIN, CHATML_TEMPLATE, CHATML_TOKENS, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, PROBE, Template, TemplateError,
    check_template, end_of_turn_ids, setup_chat_template,
)
from trainpipe.errors import DataError, ModelLoadError

__all__ = [
    "ALPACA_TEMPLATE", "BUILTIN", "CHARS_PER_TOKEN", "CHATML_TEMPLATE", "CHATML_TOKENS", "LLAMA3_TEMPLATE", "MIN_CHARS",
    "MISTRAL_TEMPLATE", "PROBE", "TEMPLATE_MAX_CHARS", "TEMPLATE_SECONDS", "Encoded", "Template", "TemplateError", "Tokenized",
    "Rendered", "assistant_spans", "bound_example", "check_template", "encode_batch", "encode_texts", "end_of_turn_ids", "finish_batch",
    "generation_prompt", "max_chars", "render_batch", "row_loss_tokens", "row_tokens", "setup_chat_template", "template_watch", "tokenize_conversation", "truncate_pair",
]


def _labels(ids: list[int], offsets, spans, masked) -> list[int]:
    if not ids:
        return []
    if len(spans) == 1 and not masked:  # the common case (one trained span), the same labels without numpy's per-call cost
        a, b = spans[0]
        return [t if a <= s < b and e > s else IGNORE_INDEX for t, (s, e) in zip(ids, offsets)]
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    s, e = off[:, 0], off[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        inside |= (s >= a) & (s < b)
    for a, b in masked:
        inside &= ~((s >= a) & (s < b))
    inside &= e > s
    arr = np.asarray(ids, dtype=np.int64)
    return np.where(inside, arr, IGNORE_INDEX).tolist()


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]

    @property
    def n_loss_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


def encode_texts(tokenizer, texts: list[str]):
    """The Rust tokenizer's encodings (ids and character offsets) of ``texts``, no special tokens added; it holds no
    Python lock while it works (data/workers.py runs it on a thread)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("trainpipe needs a fast (Rust `tokenizers`) tokenizer for exact label masks; load it with `use_fast=True`.")
    return backend.encode_batch(texts, add_special_tokens=False)


def tokenize_conversation(tokenizer, messages: list[dict], train_on: str = "assistant", template: Template | None = None,
                          tools: list | None = None) -> Tokenized:
    """Tokenize a conversation with labels masked to the assistant spans (IGNORE_INDEX elsewhere)."""
    tpl = template or Template(tokenizer)
    text, spans, masked = tpl.spans(messages, train_on, tools)
    (enc,) = encode_texts(tokenizer, [text])
    return Tokenized(list(enc.ids), _labels(enc.ids, enc.offsets, spans, masked))


def assistant_spans(tokenizer, messages: list[dict], train_on: str = "assistant"):
    return Template(tokenizer).spans(messages, train_on)


def generation_prompt(tokenizer, messages: list[dict], template: Template | None = None, tools: list | None = None) -> tuple[str, str]:
    """(prompt text ending with the generation prompt, reference reply) for the last assistant turn."""
    tpl = template or Template(tokenizer)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return tpl.render(messages[:last], add_generation_prompt=True, tools=tools), messages[last]["content"]


@dataclass
class Encoded:
    row: dict | None  # the stored example, or None when dropped
    reason: str | None = None
    truncated: bool = False
    generation: dict | None = None
    more: list = field(default_factory=list)  # raw text longer than max_length: the blocks after ``row``
    doc: bool = False  # a whole raw-text document for the split's block stream (``pretrain_blocks: stream``, data/blocks.py)
    cut: tuple[int, int] = (0, 0)  # a truncated pair: (prompt tokens, reply tokens) removed


def encode_batch(tokenizer, tpl: Template, examples: list[dict], *, train_on: str, max_length: int, truncation: str,
                 min_tokens: int, max_tokens: int | None, with_generation: bool = False, pretrain_blocks: str = "document") -> list[Encoded]:
    """Tokenize a batch of examples (any kind) into stored rows, or a drop reason for each. Raw text under
    ``pretrain_blocks: stream`` comes back whole (``Encoded.doc``) for the caller's block stream (data/blocks.py)."""
    with template_watch():  # one periodic alarm for the batch, not one per render
        return _encode_batch(tokenizer, tpl, examples, train_on=train_on, max_length=max_length, truncation=truncation,
                             min_tokens=min_tokens, max_tokens=max_tokens, with_generation=with_generation, pretrain_blocks=pretrain_blocks)


def _encode_batch(tokenizer, tpl: Template, examples: list[dict], *, train_on: str, max_length: int, truncation: str,
                  min_tokens: int, max_tokens: int | None, with_generation: bool = False, pretrain_blocks: str = "document") -> list[Encoded]:
    batch = render_batch(tokenizer, tpl, examples, train_on=train_on, max_length=max_length, min_tokens=min_tokens, with_generation=with_generation)
    return finish_batch(tokenizer, tpl, batch, encode_texts(tokenizer, batch.texts) if batch.texts else [], max_length=max_length,
                        truncation=truncation, min_tokens=min_tokens, max_tokens=max_tokens, with_generation=with_generation,
                        pretrain_blocks=pretrain_blocks)


@dataclass
class Rendered:
    """A batch between its two halves (:func:`render_batch`, :func:`finish_batch`): ``texts`` are what the Rust tokenizer
    encodes in between (the conversations and raw texts first, then the prompt and replies of each pair), which holds no
    Python lock, so data/build.py encodes one chunk on a thread while the next is rendered and the last is finished."""

    examples: list[dict]
    out: list  # Encoded per example, where the processor of a vision-language model already made it; else None
    sft: list  # (index, text, (loss spans, masked spans))
    pairs: list  # (index, [prompt, reply, ...])
    texts: list[str]


def render_batch(tokenizer, tpl: Template, examples: list[dict], *, train_on: str, max_length: int, min_tokens: int,
                 with_generation: bool = False) -> Rendered:
    """The first half of :func:`encode_batch`: the chat template rendered (and a vision-language processor's rows made)."""
    out: list[Encoded | None] = [None] * len(examples)
    vision = _vision(tokenizer, examples)  # conversations rendered by a vision-language model's processor (data/vision_chat.py)
    for i in vision:
        proc, ex = vision_chat.processor_of(tokenizer), examples[i]
        row, reason = (vision_chat.encode(proc, ex, train_on=train_on, max_length=max_length, min_tokens=min_tokens) if ex["kind"] == "sft"
                       else vision_chat.encode_pair(proc, ex, max_length=max_length, min_tokens=min_tokens))
        gen = vision_chat.generation(proc, ex) if with_generation and row is not None and ex["kind"] == "sft" else None
        out[i] = Encoded(row, reason, False, gen)
    sft, pairs = _render(tokenizer, tpl, examples, train_on, skip=set(vision))
    texts = [t for _, t, _ in sft]
    texts += [t for _, parts in pairs for t in parts]
    return Rendered(examples, out, sft, pairs, texts)


def finish_batch(tokenizer, tpl: Template, batch: Rendered, encs: list, *, max_length: int, truncation: str, min_tokens: int,
                 max_tokens: int | None, with_generation: bool = False, pretrain_blocks: str = "document") -> list[Encoded]:
    """The second half of :func:`encode_batch`: labels and rows from ``encs`` (the encodings of ``batch.texts``)."""
    examples, out = batch.examples, batch.out
    for (i, _, (spans, masked)), enc in zip(batch.sft, encs):
        out[i] = _sft_row(tokenizer, tpl, examples[i], enc, spans, masked, max_length=max_length, truncation=truncation,
                          min_tokens=min_tokens, max_tokens=max_tokens, with_generation=with_generation)
        if pretrain_blocks == "stream" and examples[i]["kind"] == "text" and "label" not in examples[i] and out[i].row is not None:
            out[i] = _whole(out[i])
    if batch.pairs:
        header = answer_header_tokens(tokenizer, tpl)
        k = len(batch.sft)
        for i, parts in batch.pairs:
            ids = [list(e.ids) for e in encs[k : k + len(parts)]]
            k += len(parts)
            out[i] = _pair_row(examples[i], ids[0], ids[1:], max_length=max_length, truncation=truncation, min_tokens=min_tokens, header=header)
    return out  # type: ignore[return-value]


def _vision(tokenizer, examples: list[dict]) -> list[int]:
    """The examples a vision-language model's processor tokenizes: every conversation, preference pair and KTO example when
    the tokenizer carries one (model/vision.py); an example with images is an error without one."""
    proc = vision_chat.processor_of(tokenizer)
    out = []
    for i, ex in enumerate(examples):
        if ex.get("images") and proc is None:
            raise DataError(
                f"The data has images (an example with {len(ex['images'])}), but the model's folder has no image processor "
                f"(`{getattr(tokenizer, 'name_or_path', 'the tokenizer')}`: no processor_config.json / preprocessor_config.json), so it "
                "is a text model. Train a vision-language model (docs/vision-language.md), or remove the images from the data."
            )
        if ex.get("images") and ex["kind"] not in ("sft", "preference", "kto"):
            raise DataError(f"Images in {ex['kind']} examples are not supported: vision-language training is SFT on conversations, "
                            "DPO/ORPO on preference pairs and KTO on labelled replies (`<image>` placeholders in the prompt and `images`).")
        if proc is not None and ex["kind"] in ("sft", "preference", "kto"):
            out.append(i)
    return out


def _render(tokenizer, tpl: Template, examples: list[dict], train_on: str, skip: set = frozenset()) -> tuple[list[tuple], list[tuple]]:
    """The texts to tokenize: ([(index, text, (loss spans, masked spans))] of conversations and raw text,
    [(index, [prompt, reply, ...])] of preference and KTO examples); ``skip``: indices tokenized elsewhere."""
    sft, pairs = [], []
    eos = tokenizer.eos_token or ""
    for i, ex in enumerate(examples):
        if i in skip:
            continue
        kind = ex["kind"]
        try:
            if kind == "sft":
                text, spans, masked = tpl.spans(ex["messages"], train_on, ex.get("tools"))
                sft.append((i, text, (spans, masked)))
            elif kind == "text":
                text = ex["text"] + eos
                sft.append((i, text, ([(0, len(text))], [])))
            else:
                parts = []
                for key in ("chosen", "rejected") if kind == "preference" else ("completion",):
                    prompt, reply = tpl.render_pair(ex["prompt"], ex[key], ex.get("tools"))
                    if not parts:
                        parts.append(prompt)
                    parts.append(reply)
                pairs.append((i, parts))
        except TemplateError as exc:
            raise ModelLoadError(f"Chat template problem: {exc}.") from None
    return sft, pairs


def _sft_row(tokenizer, tpl: Template, ex: dict, enc, spans, masked, *, max_length: int, truncation: str, min_tokens: int,
             max_tokens: int | None, with_generation: bool) -> Encoded:
    """A conversation's or raw text's row (its tokens, their labels), or the reason it is dropped."""
    ids = enc.ids  # a new list on each access
    labels = _labels(ids, enc.offsets, spans, masked)
    truncated = False
    if len(ids) > max_length and ex["kind"] == "text" and "label" not in ex:
        # raw text (continued pretraining): every token kept, in blocks of max_length (as HF's run_clm
        # group_texts, per document: the EOS ends it; `packing: pack` joins the short last blocks, positions reset)
        if len(ids) < max(1, min_tokens):
            return Encoded(None, "too_short")
        blocks = [{"input_ids": ids[k : k + max_length], "labels": labels[k : k + max_length]} for k in range(0, len(ids), max_length)]
        return Encoded(blocks[0], None, False, None, blocks[1:])
    if len(ids) > max_length:
        if policy(truncation, ex["kind"]) == "drop":
            return Encoded(None, "too_long")
        if ex["kind"] == "text":
            ids, labels = ids[:max_length], labels[:max_length]
        else:  # keep the response: cut the prompt from the left
            ids, labels = ids[-max_length:], labels[-max_length:]
        truncated = True
    n_loss = len(labels) - labels.count(IGNORE_INDEX)
    if n_loss < max(1, min_tokens):
        return Encoded(None, "no_loss_tokens" if n_loss == 0 else "too_short", truncated)
    if max_tokens is not None and n_loss > max_tokens:
        return Encoded(None, "too_long_response", truncated)
    gen = None
    if with_generation and ex["kind"] == "sft":
        p, ref = generation_prompt(tokenizer, ex["messages"], tpl, ex.get("tools"))
        gen = {"prompt": p, "reference": ref}
    row = {"input_ids": ids, "labels": labels}
    if "label" in ex:  # `format: classification`: the class label rides with the text's tokens
        row["class_label"] = ex["label"]
    return Encoded(row, None, truncated, gen)


def _whole(enc: Encoded) -> Encoded:
    """A raw-text document's row, its blocks joined again: the whole document for the split's stream."""
    parts = [enc.row, *enc.more]
    row = {"input_ids": [t for p in parts for t in p["input_ids"]], "labels": [t for p in parts for t in p["labels"]]}
    return Encoded(row, None, False, None, [], True)


def answer_header_tokens(tokenizer, tpl: Template) -> int:
    """How many tokens the template's generation prompt (the answer's header, `<|im_start|>assistant\\n`) adds at the end
    of a prompt: what pair truncation must never cut (measured once per template on a probe turn)."""
    key = ("_answer_header", tpl.source)
    cached = getattr(tokenizer, "_trainpipe_header", None)
    if cached and cached[0] == key:
        return cached[1]
    probe = [{"role": "user", "content": "Hello there."}]
    plain, with_header = tpl.render(probe), tpl.render(probe, add_generation_prompt=True)
    a, b = encode_texts(tokenizer, [plain, with_header])
    n = max(1, len(b.ids) - len(a.ids))
    tokenizer._trainpipe_header = (key, n)
    return n


def _pair_row(ex: dict, prompt: list[int], replies: list[list[int]], *, max_length: int, truncation: str, min_tokens: int, header: int = 0) -> Encoded:
    """A preference pair's or KTO example's row (prompt and reply tokens), or the reason it is dropped. A prompt that must
    be cut keeps its end (the answer's header whole); one whose budget cannot hold the header is dropped as
    `too_long_prompt`, never mangled. ``Encoded.cut``: the prompt and reply tokens truncation removed."""
    truncated = False
    cut = (0, 0)
    longest = max(len(r) for r in replies)
    if len(prompt) + longest > max_length:
        if policy(truncation, ex["kind"]) == "drop":
            return Encoded(None, "too_long")
        before = (len(prompt), sum(len(r) for r in replies))
        prompt, replies = truncate_pair(prompt, replies, max_length, header)
        if prompt is None:
            return Encoded(None, "too_long_prompt" if max(max_length - longest, max_length // 2) <= header else "too_long")
        truncated = True
        cut = (before[0] - len(prompt), before[1] - sum(len(r) for r in replies))
    if min(len(r) for r in replies) < max(1, min_tokens):
        return Encoded(None, "too_short")
    if ex["kind"] == "preference":
        row = {"prompt_input_ids": prompt, "chosen_input_ids": replies[0], "rejected_input_ids": replies[1]}
    else:
        row = {"prompt_input_ids": prompt, "completion_input_ids": replies[0], "label": ex["label"]}
    return Encoded(row, None, truncated, cut=cut)
