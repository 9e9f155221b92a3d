"""Lengths: text bounded before it reaches the template or the tokenizer, token budgets of preference pairs, and the
token counts of stored rows.

An example with more than ``max_length`` x :data:`CHARS_PER_TOKEN` characters is dropped as ``too_long_chars``
(``truncation: drop``), or cut to that many characters (``truncation: truncate``: raw text keeps its start, a
conversation its end) by :func:`bound_example`. ``truncation: auto`` (the default) is :func:`policy`: ``truncate``
for preference and KTO examples (TRL's DPO rule keeps the pair), ``drop`` for everything else.
"""

from __future__ import annotations

import json

from trainpipe.data.packing import IGNORE_INDEX

CHARS_PER_TOKEN = 16  # no tokenizer averages more characters a token over a whole example
MIN_CHARS = 1 << 16  # below this, tokenizing costs nothing: the tokens decide (as `too_long`)


def max_chars(max_length: int) -> int:
    """Characters an example may hold before it is tokenized: max_length x CHARS_PER_TOKEN, at least MIN_CHARS."""
    return max(max_length * CHARS_PER_TOKEN, MIN_CHARS)


PAIR_KINDS = ("preference", "kto")


def policy(truncation: str, kind: str) -> str:
    """The rule an example of ``kind`` follows under ``data.truncation``: ``auto`` is ``truncate`` for preference and
    KTO pairs (TRL's DPO rule: the prompt keeps its start, the completions are cut, the pair is kept) and ``drop`` for
    conversations and text (a silently cut SFT target is worse than a counted drop); ``drop``/``truncate`` as given."""
    if truncation != "auto":
        return truncation
    return "truncate" if kind in PAIR_KINDS else "drop"


def _content_len(m) -> int:
    """Characters a message brings to the template: content, reasoning and tool calls."""
    if not isinstance(m, dict):
        return 0
    c, r = m.get("content"), m.get("reasoning_content")
    n = (len(c) if isinstance(c, str) else 0) + (len(r) if isinstance(r, str) else 0)
    if m.get("tool_calls"):
        n += len(json.dumps(m["tool_calls"], ensure_ascii=False))
    return n


def _keep_end(messages: list[dict], budget: int) -> list[dict]:
    """The last messages whose contents fit ``budget`` characters; the earliest one kept is cut from its start."""
    kept: list[dict] = []
    for m in reversed(messages):
        n = _content_len(m)
        if n <= budget:
            kept.append(m)
            budget -= n
            continue
        if budget > 0 and not m.get("tool_calls"):  # a call is kept whole or not at all; reasoning goes first
            kept.append({k: v for k, v in m.items() if k != "reasoning_content"} | {"content": m["content"][-budget:]})
        break
    return kept[::-1]


def bound_example(ex: dict, limit: int, truncation: str) -> tuple[dict | None, bool]:
    """(``ex``, False) when its text fits ``limit`` characters; else, before any template or tokenizer sees it,
    (None, False) under ``truncation: drop`` (counted as ``too_long_chars``) or (the example cut to ``limit``
    characters, True) under ``truncate``: raw text keeps its start; a conversation keeps its end (the last messages,
    the earliest one cut from its start, as the token truncation cuts the prompt from the left); a preference or KTO
    example keeps its replies whole (one longer than ``limit`` alone is dropped) and cuts its prompt the same way."""
    kind = ex["kind"]
    truncation = policy(truncation, kind)
    if kind == "text" and "label" not in ex:  # raw text is cut into max_length blocks after tokenizing, never dropped
        return ex, False
    if kind == "text":
        if len(ex["text"]) <= limit:
            return ex, False
        return (None, False) if truncation == "drop" else ({**ex, "text": ex["text"][:limit]}, True)
    tools = len(json.dumps(ex["tools"], ensure_ascii=False)) if ex.get("tools") else 0  # the schemas are rendered too
    if kind == "sft":
        if tools + sum(_content_len(m) for m in ex["messages"]) <= limit:
            return ex, False
        if truncation == "drop" or tools >= limit:
            return None, False
        return {**ex, "messages": _keep_end(ex["messages"], limit - tools)}, True
    replies = [ex[k] for k in ("chosen", "rejected", "completion") if k in ex]
    longest = max((sum(_content_len(m) for m in r) for r in replies), default=0)
    prompt = tools + sum(_content_len(m) for m in ex["prompt"])
    if prompt + longest <= limit:
        return ex, False
    if truncation == "drop" or longest + tools >= limit:
        return None, False
    return {**ex, "prompt": _keep_end(ex["prompt"], limit - longest - tools)}, True


def truncate_pair(prompt: list[int], replies: list[list[int]], max_length: int, header: int = 0) -> tuple[list[int] | None, list[list[int]]]:
    """TRL's DPO rule with `truncation_mode: keep_end` for the prompt (`max_prompt_length` half of `max_length`): the
    prompt keeps what the longest reply leaves, but at least its budget of half `max_length`, cut from its START so the
    turns nearest the answer and the answer's header (the template's generation prompt, ``header`` tokens at the end)
    stay whole; then each reply keeps its start up to what is left. (None, replies) when even that cannot train: the
    budget cannot hold the answer's header (a cut through it would glue the reply onto a broken turn), no room for a
    reply, or chosen and rejected become the same tokens (nothing left to prefer)."""
    longest = max(len(r) for r in replies)
    budget = max(max_length - longest, max_length // 2)
    if len(prompt) > budget:
        if budget <= header:
            return None, replies
        prompt = prompt[len(prompt) - budget:]
    room = max_length - len(prompt)
    replies = [r[:room] for r in replies]
    if room < 1 or (len(replies) == 2 and replies[0] == replies[1]):
        return None, replies
    return prompt, replies


def row_tokens(row: dict) -> int:
    if "input_ids" in row:
        return len(row["input_ids"])
    return sum(len(v) for k, v in row.items() if k.endswith("_input_ids"))


def row_loss_tokens(row: dict) -> int:
    if "labels" in row:
        labels = row["labels"]
        return len(labels) - labels.count(IGNORE_INDEX) if type(labels) is list else sum(1 for x in labels if x != IGNORE_INDEX)
    return sum(len(v) for k, v in row.items() if k.endswith("_input_ids") and not k.startswith("prompt"))
