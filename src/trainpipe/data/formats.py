"""Record formats, each normalised to one of four example kinds.

- ``sft``: ``{"kind": "sft", "messages": [{role, content}, ...]}`` from
  alpaca (``instruction``, ``input``, ``output``, ``system``), chat (``messages`` with
  role system/user/assistant/tool) and ShareGPT (``conversations`` with ``from``/``value``,
  from human/gpt/system/function_call/observation).
- ``preference``: ``{"kind": "preference", "prompt": [msgs], "chosen": [msgs], "rejected": [msgs]}``
  from ``prompt``/``chosen``/``rejected`` as strings or conversations (with or without a
  separate prompt: the shared prefix of the two conversations is the prompt), and
  ShareGPT-style ``conversations`` + ``chosen``/``rejected`` turns.
- ``kto``: ``{"kind": "kto", "prompt": [msgs], "completion": [msgs], "label": bool}``.
- ``text``: ``{"kind": "text", "text": str}`` for continued pretraining (``text`` field, .txt files).

``columns`` (``{format_field: source_field}``) renames a source's fields first.
"""

from __future__ import annotations

from typing import Literal

Format = Literal["alpaca", "chat", "sharegpt", "preference", "kto", "text", "classification"]
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}


class FormatError(ValueError):
    """A record does not fit its format; the message is the reason recorded for it, ``kind`` the counted reason."""

    def __init__(self, message: str, kind: str = "format_mismatch"):
        super().__init__(message)
        self.kind = kind


# The turn that may follow each role (None: the start, after an optional system turn). A conversation out of this
# order (two user turns in a row, an assistant turn first, a system turn in the middle) is dropped as `role_order`:
# chat templates reject it or render it as something else than the data says.
_NEXT = {None: ("user",), "user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant", "user")}


def check_order(turns: list[tuple[str, dict]]) -> None:
    """``turns``: (where, message) in conversation order; FormatError(kind="role_order") at the first turn out of order."""
    prev = None
    for i, (where, m) in enumerate(turns):
        role = m["role"]
        if role == "system" and i == 0:
            continue
        if role not in _NEXT[prev]:
            after = f"after a `{prev}` turn" if prev else ("first" if i == 0 else "right after the system turn")
            expected = " or ".join(f"`{r}`" for r in _NEXT[prev])
            raise FormatError(
                f"{where} is a `{role}` turn {after}, where {expected} must come (turn order: an optional system turn first, "
                "then user and assistant alternating, tool turns after an assistant turn); fix the order or merge the turns",
                kind="role_order",
            )
        prev = role


class _Mapped(dict):
    """A record after `columns:`; ``unmapped`` names each mapping whose source field the record lacks
    ({format field: source field}), so that a missing field is reported with the mapping that should have filled it."""

    unmapped: dict = {}
    source_fields: tuple = ()


def apply_columns(record: dict, columns: dict[str, str]) -> dict:
    if not columns:
        return record
    out = _Mapped(record)
    unmapped = {}
    for canonical, field in columns.items():
        if field in out:
            out[canonical] = out.pop(field)
        elif canonical not in out:
            unmapped[canonical] = field
    out.unmapped, out.source_fields = unmapped, tuple(record)
    return out


def missing(record: dict, key: str) -> FormatError:
    """"missing field `key`", naming the `columns:` mapping that should have filled it (and the fields the record has)."""
    field = getattr(record, "unmapped", {}).get(key)
    if field is None:
        return FormatError(f"missing field `{key}`")
    have = ", ".join(f"`{k}`" for k in getattr(record, "source_fields", record)) or "none"
    return FormatError(
        f"missing field `{key}`: `columns:` maps `{key}` to the source field `{field}`, which this record does not have "
        f"(its fields: {have}); fix the mapping in `data.sources[].columns`"
    )


def detect(record: dict) -> tuple[Format, str]:
    """(format, why) from the record's fields; FormatError when none fits."""
    keys = set(record)
    if "messages" in keys:
        return "chat", "it has a `messages` field"
    if "conversations" in keys and {"chosen", "rejected"} <= keys:
        return "preference", "it has `conversations` with `chosen` and `rejected` turns (ShareGPT preference)"
    if "conversations" in keys:
        return "sharegpt", "it has a `conversations` field"
    if {"chosen", "rejected"} <= keys:
        return "preference", "it has `chosen` and `rejected` fields"
    if {"completion", "label"} <= keys:
        return "kto", "it has `completion` and a `label` field"
    if {"instruction", "output"} <= keys:
        return "alpaca", "it has `instruction` and `output` fields"
    if "text" in keys:
        return "text", "it has a `text` field"
    fields = ", ".join(sorted(keys)) or "none"
    unmapped = getattr(record, "unmapped", {})
    mapped = ("; `columns:` maps " + ", ".join(f"`{k}` to `{v}`" for k, v in unmapped.items()) + ", which this record does not have") if unmapped else ""
    raise FormatError(
        f"fits no known format (fields: {fields}{mapped}); alpaca needs `instruction` and `output`, chat needs `messages`, "
        "ShareGPT `conversations`, preference `chosen` and `rejected`, KTO `completion` and `label`, raw text `text` "
        "(map other names with `columns:`)"
    )


def _require_str(record: dict, key: str, *, optional: bool = False) -> str:
    if key not in record or record[key] is None:
        if optional:
            return ""
        raise missing(record, key)
    value = record[key]
    if not isinstance(value, str):
        raise FormatError(f"field `{key}` must be a string, got {type(value).__name__}")
    return value


def _chat(messages, field: str = "messages", *, need_assistant: bool = True) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise FormatError(f"field `{field}` must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FormatError(f"{field}[{i}] must be an object with `role` and `content`")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise FormatError(f"{field}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise FormatError(f"{field}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise FormatError(f"`{field}` has no assistant turn to train on")
    return out


def _sharegpt(turns, field: str = "conversations", *, need_assistant: bool = True) -> list[dict]:
    if isinstance(turns, dict):
        turns = [turns]
    if not isinstance(turns, list) or not turns:
        raise FormatError(f"field `{field}` must be a non-empty list of turns")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise FormatError(f"{field}[{i}] must be an object with `from` and `value`")
        frm, value = t.get("from", t.get("role")), t.get("value", t.get("content"))
        if frm not in SHAREGPT_ROLES:
            raise FormatError(f"{field}[{i}].from must be one of {', '.join(SHAREGPT_ROLES)}, got {frm!r}")
        if not isinstance(value, str):
            raise FormatError(f"{field}[{i}].value must be a string, got {type(value).__name__}")
        out.append({"role": SHAREGPT_ROLES[frm], "content": value})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise FormatError(f"`{field}` has no assistant (gpt) turn to train on")
    return out


def _turns(value, field: str, *, default_role: str, need_assistant: bool = False) -> list[dict]:
    """A string (one turn of ``default_role``), a chat message list, or ShareGPT turns."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and isinstance(value[0], dict) and ("from" in value[0] or "value" in value[0]):
        return _sharegpt(value, field, need_assistant=need_assistant)
    if isinstance(value, list):
        return _chat(value, field, need_assistant=need_assistant)
    raise FormatError(f"field `{field}` must be a string or a list of turns, got {type(value).__name__}")


def _with_system(msgs: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt and (not msgs or msgs[0]["role"] != "system"):
        return [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def to_example(record: dict, fmt: Format, system_prompt: str | None = None) -> dict:
    """Convert one record of format ``fmt`` into an example dict; raises FormatError with the reason."""
    if fmt == "alpaca":
        return {"kind": "sft", "messages": to_messages(record, "alpaca", system_prompt)}
    if fmt == "chat":
        if "messages" not in record:
            raise missing(record, "messages")
        msgs = _chat(record.get("messages"))
        check_order([(f"messages[{i}]", m) for i, m in enumerate(msgs)])
        return {"kind": "sft", "messages": _with_system(msgs, system_prompt)}
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise missing(record, "conversations")
        msgs = _sharegpt(record["conversations"])
        check_order([(f"conversations[{i}]", m) for i, m in enumerate(msgs)])
        return {"kind": "sft", "messages": _with_system(msgs, system_prompt)}
    if fmt == "text":
        return {"kind": "text", "text": _require_str(record, "text")}
    if fmt == "classification":  # text + a class label (`method.name: classification`); a text example that carries its label
        label = record.get("label")
        if label is None or isinstance(label, (dict, list)) or (isinstance(label, str) and not label.strip()):
            raise FormatError("classification records need a `label` (a string, number or bool; map another field with `columns: {label: FIELD}`)", kind="missing_label")
        return {"kind": "text", "text": _require_str(record, "text"), "label": str(label)}
    if fmt == "kto":
        if "completion" not in record:
            raise missing(record, "completion")
        label = record.get("label")
        if isinstance(label, str) and label.lower() in ("true", "false", "1", "0"):
            label = label.lower() in ("true", "1")
        if not isinstance(label, bool) and label not in (0, 1):
            raise FormatError(f"field `label` must be true or false, got {label!r}")
        prompt = _turns(record.get("prompt", ""), "prompt", default_role="user")
        completion = _turns(record["completion"], "completion", default_role="assistant")
        check_order(_named("prompt", prompt) + _named("completion", completion))
        return {"kind": "kto", "prompt": _with_system(prompt, system_prompt), "completion": completion, "label": bool(label)}
    if fmt == "preference":
        for k in ("chosen", "rejected"):
            if k not in record:
                raise missing(record, k)
        if "conversations" in record:
            prompt = _sharegpt(record["conversations"], need_assistant=False)
        elif "prompt" in record and record["prompt"] not in (None, ""):
            prompt = _turns(record["prompt"], "prompt", default_role="user")
        else:
            prompt = []
        chosen = _turns(record["chosen"], "chosen", default_role="assistant")
        rejected = _turns(record["rejected"], "rejected", default_role="assistant")
        if not prompt:  # full conversations: the shared prefix is the prompt
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
            if not prompt:
                raise FormatError("has no prompt: give `prompt`, or `chosen`/`rejected` conversations that start with the same user turn")
        for name, turns in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" for m in turns):
                raise FormatError(f"`{name}` has no assistant turn")
            check_order(_named("prompt", prompt) + _named(name, turns))
        return {"kind": "preference", "prompt": _with_system(prompt, system_prompt), "chosen": chosen, "rejected": rejected}
    raise FormatError(f"unknown format {fmt!r}")


def _named(field: str, turns: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{field}[{i}]", m) for i, m in enumerate(turns)]


def to_messages(record: dict, fmt: Format, system_prompt: str | None = None) -> list[dict]:
    """Convert one alpaca or chat record into messages (kept for callers of the first API)."""
    if fmt == "alpaca":
        instruction = _require_str(record, "instruction")
        inp = _require_str(record, "input", optional=True)
        output = _require_str(record, "output")
        system = _require_str(record, "system", optional=True) or system_prompt
        if not instruction.strip():
            raise FormatError("field `instruction` is empty")
        user = instruction if not inp.strip() else f"{instruction}\n\n{inp}"
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return to_example(record, fmt, system_prompt)["messages"]


def strings(ex: dict) -> list[str]:
    """Every text of an example, in order (for PII, dedup and n-gram checks)."""
    if ex["kind"] == "text":
        return [ex["text"]]
    if ex["kind"] == "sft":
        return [m["content"] for m in ex["messages"]]
    keys = ("prompt", "chosen", "rejected") if ex["kind"] == "preference" else ("prompt", "completion")
    return [m["content"] for k in keys for m in ex[k]]


def responses(ex: dict) -> list[str]:
    """The texts a model is trained to produce (for the empty-response and repetition filters)."""
    if ex["kind"] == "text":
        return [ex["text"]]
    if ex["kind"] == "sft":
        return [m["content"] for m in ex["messages"] if m["role"] == "assistant"]
    keys = ("chosen", "rejected") if ex["kind"] == "preference" else ("completion",)
    return [m["content"] for k in keys for m in ex[k] if m["role"] == "assistant"]


def map_strings(ex: dict, fn) -> dict:
    """A copy of ``ex`` with ``fn`` applied to every text."""
    if ex["kind"] == "text":
        return {**ex, "text": fn(ex["text"])}
    out = dict(ex)
    for k in ("messages", "prompt", "chosen", "rejected", "completion"):
        if k in ex:
            out[k] = [{**m, "content": fn(m["content"])} for m in ex[k]]
    return out
