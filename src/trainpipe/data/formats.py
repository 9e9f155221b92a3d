"""Record formats, all normalised to a conversation: a list of ``{role, content}`` messages.

- alpaca: ``instruction``, ``input`` (optional), ``output``, ``system`` (optional)
- chat: ``messages`` with ``role`` in system/user/assistant/tool and string ``content``
"""

from __future__ import annotations

from typing import Literal

Format = Literal["alpaca", "chat"]
ROLES = ("system", "user", "assistant", "tool")


class FormatError(ValueError):
    """A record does not fit its format; the message is the reason recorded for it."""


def detect(record: dict) -> Format:
    """Pick the format from the record's fields."""
    if "messages" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca"
    fields = ", ".join(sorted(record)) or "none"
    raise FormatError(
        f"fits no known format (fields: {fields}); alpaca needs `instruction` and `output`, chat needs `messages`"
    )


def _require_str(record: dict, key: str, *, optional: bool = False) -> str:
    if key not in record or record[key] is None:
        if optional:
            return ""
        raise FormatError(f"missing field `{key}`")
    value = record[key]
    if not isinstance(value, str):
        raise FormatError(f"field `{key}` must be a string, got {type(value).__name__}")
    return value


def to_messages(record: dict, fmt: Format, system_prompt: str | None = None) -> list[dict]:
    """Convert one record of format ``fmt`` into messages; raises FormatError with the reason."""
    if fmt == "alpaca":
        instruction = _require_str(record, "instruction")
        inp = _require_str(record, "input", optional=True)
        output = _require_str(record, "output")
        system = _require_str(record, "system", optional=True) or system_prompt
        if not instruction.strip():
            raise FormatError("field `instruction` is empty")
        if not output.strip():
            raise FormatError("field `output` is empty")
        user = instruction if not inp.strip() else f"{instruction}\n\n{inp}"
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]

    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FormatError("field `messages` must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FormatError(f"messages[{i}] must be an object with `role` and `content`")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise FormatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise FormatError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise FormatError("has no non-empty assistant message to train on")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out
