"""Record formats, each normalised to one of four example kinds.

- ``sft``: ``{"kind": "sft", "messages": [{role, content}, ...]}`` from
  alpaca (``instruction``, ``input``, ``output``, ``system``), chat (``messages`` with
  role system/user/assistant/tool) and ShareGPT (``conversations`` with ``from``/``value``,
  from human/gpt/system/function_call/observation).
- ``preference``: ``{"kind": "preference", "prompt": [msgs], "chosen": [msgs], "rejected": [msgs]}``
  from ``prompt``/``chosen``/``rejected`` as strings or conversations (with or without a
  separate prompt: the shared prefix of the two conversations is the prompt), and
  ShareGPT-style ``conversations`` + ``chosen``/``rejected`` turns.
- ``kto``: ``{"kind": "kto", "prompt": [msgs], "completion": [msgs], "label": bool}`` from ``prompt``/``completion``/
  ``label``, or as LLaMA-Factory writes it (``kto_en_demo``): ``messages`` (or ``conversations``) + a boolean ``label``,
  the last assistant turn being the completion.
- ``text``: ``{"kind": "text", "text": str}`` for continued pretraining (``text`` field, .txt files).

``columns`` (``{format_field: source_field}``) renames a source's fields first.

What real chat data carries besides role and content:

- content-part lists (``"content": [{"type": "text", "text": ...}]``, OpenAI / HF multimodal chat): the text parts
  are joined with a newline; image parts in `messages`/`conversations` become `<image>` placeholders with the image
  kept on the example (data/vision_chat.py, for vision-language models); any other part (audio, video, ...) is refused
  as ``non_text_content`` naming the part's type, or counted and skipped under ``on_error: skip``;
- ``tools`` (a list of function schemas, or a JSON string of one, as in glaive / LLaMA-Factory ``glaive_toolcall_en_demo``):
  kept on the example (``"tools": [...]``) and given to the chat template (tokenize.py);
- tool calls: assistant ``tool_calls`` (OpenAI/HF: ``{"type": "function", "function": {"name", "arguments"}}``), or
  ShareGPT ``function_call`` turns (a JSON ``{"name", "arguments"}`` or a list of them) -> an assistant turn with
  ``tool_calls`` (arguments as an object) and empty content; tool results: role ``tool`` / ShareGPT ``observation``;
- reasoning: an assistant ``reasoning_content`` field, or a leading ``<think>...</think>`` in its content, is kept as
  the message's ``reasoning_content`` (the content without it); ``data.reasoning`` decides at tokenizing time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from trainpipe.data.sources import MAX_DEPTH, Record, Rejected, is_data_file, read_file

Format = Literal["alpaca", "chat", "sharegpt", "preference", "kto", "text", "classification"]
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}


_THINK = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.S)
TEXT_PART_TYPES = ("text", "input_text", "output_text")


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
    if keys & {"messages", "conversations"} and "label" in keys and not {"chosen", "rejected"} <= keys and _is_bool(record["label"]):
        field = "messages" if "messages" in keys else "conversations"
        return "kto", f"it has `{field}` and a true/false `label` (LLaMA-Factory KTO)"
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
        "ShareGPT `conversations`, preference `chosen` and `rejected`, KTO `completion` (or `messages`) and a true/false `label`, raw text `text` "
        "(map other names with `columns:`)"
    )


def _is_bool(label) -> bool:
    return isinstance(label, bool) or label in (0, 1) or (isinstance(label, str) and label.lower() in ("true", "false"))


def detect_file(path: str | Path, columns: dict[str, str] | None = None) -> tuple[Format, str] | None:
    """(format, why) of a local data file from its first record, read by the reader `prepare` uses (JSONL, a JSON
    array, CSV, Parquet, text, compressed or not) and told by :func:`detect`: the one detector of `prepare` and
    `plan --data FILE` (and of `method.name: auto`), after the source's ``columns`` as `prepare` applies them. None
    when it cannot be told here (no readable record, or none that fits a format)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and is_data_file(f))
        if not files:
            return None
        p = files[0]
    if not p.is_file():
        return None
    try:
        for item in read_file(p):
            if isinstance(item, Rejected):
                return None
            if isinstance(item, Record) and isinstance(item.data, dict):
                return detect(apply_columns(item.data, columns or {}))
            return None
    except Exception:  # noqa: BLE001 - an unreadable file: the reader reports it (file, line, fix) when the data loads
        return None
    return None


def _content(value, where: str, *, allow_none: bool = False) -> str:
    """A message's content: a string, or a list of content parts whose text parts are joined (a non-text part is
    refused as ``non_text_content``)."""
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES or (kind is None and isinstance(part, dict) and isinstance(part.get("text"), str)):
                text = part.get("text")
                if not isinstance(text, str):
                    raise FormatError(f"{where}[{j}] is a `{kind}` part without a string `text`")
                texts.append(text)
                continue
            shown = kind if isinstance(kind, str) else (sorted(part)[0] if isinstance(part, dict) and part else type(part).__name__)
            raise FormatError(
                f"{where}[{j}] is a `{shown}` content part: trainpipe reads text parts (`{{\"type\": \"text\", \"text\": ...}}`) "
                "and image parts in `messages`/`conversations` (`image`, `image_url`: vision-language models, docs/vision-language.md); "
                "remove the other parts (or the record), or set "
                "`data.on_error: skip` to drop such records with the reason counted",
                kind="non_text_content",
            )
        return "\n".join(texts)
    raise FormatError(f"{where} must be a string or a list of content parts, got {type(value).__name__}")


def _arguments(value, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = _loads(value, where) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise FormatError(f"{where} is not valid JSON ({exc.msg} at character {exc.pos}); give the arguments as an object or a JSON string of one") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where} must be an object (or a JSON string of one), got {type(value).__name__}")
    return value


def _parsed(value, where: str, hint: str):
    """``value`` with a JSON string parsed and one object made a list of one; invalid JSON is a FormatError naming
    ``where`` and saying what is expected (``hint``)."""
    if isinstance(value, str):
        try:
            value = _loads(value, where)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{where} is not valid JSON ({exc.msg} at character {exc.pos}); {hint}") from None
    return [value] if isinstance(value, dict) else value


def _loads(text: str, where: str):
    """``json.loads`` of a JSON string inside a record (tool calls, arguments, tools), refusing (FormatError, so the record is
    dropped or named) one nested deeper than :data:`MAX_DEPTH`, before the parser recurses into it."""
    depth, in_str, esc = 0, False, False
    for ch in text if text.count("[") + text.count("{") > MAX_DEPTH else ():
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise FormatError(f"{where} nests lists or objects more than {MAX_DEPTH} deep; no function call or schema does, so the record is not read")
        elif ch in "]}":
            depth -= 1
    return json.loads(text)


def _tool_calls(value, where: str) -> list[dict]:
    """Tool calls as ``[{"type": "function", "function": {"name", "arguments": {...}}}]`` from the OpenAI/HF form or
    a bare ``{"name", "arguments"}`` (one or a list)."""
    value = _parsed(value, where, "a function call is `{\"name\": ..., \"arguments\": {...}}` (or a list of them)")
    if not isinstance(value, list) or not value:
        raise FormatError(f"{where} must be a function call `{{\"name\": ..., \"arguments\": {{...}}}}` or a non-empty list of them")
    out = []
    for k, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise FormatError(f"{where}[{k}] has no function `name`")
        out.append({"type": "function", "function": {"name": name, "arguments": _arguments(fn.get("arguments", {}), f"{where}[{k}].arguments")}})
    return out


def tools_of(record: dict) -> list[dict] | None:
    """The record's ``tools`` (function schemas) as a list, or None when it has none; a JSON string is parsed."""
    value = record.get("tools")
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    value = _parsed(value, "field `tools`", "give a list of function schemas (`[{\"name\": ..., \"description\": ..., "
                    "\"parameters\": {...}}]`) or a JSON string of one")
    if not isinstance(value, list):
        raise FormatError(f"field `tools` must be a list of function schemas, got {type(value).__name__}")
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise FormatError(f"`tools[{k}]` has no function `name` (a schema is `{{\"name\": ..., \"description\": ..., \"parameters\": {{...}}}}`)")
    return value or None


def tool_names(tools: list[dict] | None) -> list[str]:
    return [t.get("function", t)["name"] for t in tools or []]


def _assistant(msg: dict, m: dict, where: str) -> dict:
    """Reasoning (``reasoning_content``, or a leading ``<think>...</think>`` in the content) and tool calls of an assistant turn."""
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise FormatError(f"{where}.reasoning_content must be a string, got {type(reasoning).__name__}")
    think = _THINK.match(msg["content"])
    if think:
        reasoning = ((reasoning + "\n") if reasoning else "") + think.group(1).strip()
        msg["content"] = msg["content"][think.end():]
    if reasoning and reasoning.strip():
        msg["reasoning_content"] = reasoning.strip()
    if m.get("tool_calls"):
        msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return msg


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
        role = m.get("role")
        if role not in ROLES:
            raise FormatError(f"{field}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        calls = role == "assistant" and bool(m.get("tool_calls"))
        msg = {"role": role, "content": _content(m.get("content"), f"{field}[{i}].content", allow_none=calls)}
        if role == "assistant":
            msg = _assistant(msg, m, f"{field}[{i}]")
        elif role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
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
        if frm == "function_call":  # LLaMA-Factory: the call as JSON in `value`
            out.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(value, f"{field}[{i}].value")})
            continue
        role = SHAREGPT_ROLES[frm]
        msg = {"role": role, "content": _content(value, f"{field}[{i}].value")}
        out.append(_assistant(msg, t, f"{field}[{i}]") if role == "assistant" else msg)
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
        return _tooled({"kind": "sft", "messages": _with_system(msgs, system_prompt)}, record)
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise missing(record, "conversations")
        msgs = _sharegpt(record["conversations"])
        check_order([(f"conversations[{i}]", m) for i, m in enumerate(msgs)])
        return _tooled({"kind": "sft", "messages": _with_system(msgs, _own_system(record) or system_prompt)}, record)
    if fmt == "text":
        return {"kind": "text", "text": _require_str(record, "text")}
    if fmt == "classification":  # text + a class label (`method.name: classification`); a text example that carries its label
        label = record.get("label")
        if label is None or isinstance(label, (dict, list)) or (isinstance(label, str) and not label.strip()):
            raise FormatError("classification records need a `label` (a string, number or bool; map another field with `columns: {label: FIELD}`)", kind="missing_label")
        return {"kind": "text", "text": _require_str(record, "text"), "label": str(label)}
    if fmt == "kto":
        if "completion" not in record and ("messages" in record or "conversations" in record):
            return _kto_conversation(record, system_prompt)
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
        return _tooled({"kind": "kto", "prompt": _with_system(prompt, system_prompt), "completion": completion, "label": bool(label)}, record)
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
        sys_ = _own_system(record) if "conversations" in record else None
        return _tooled({"kind": "preference", "prompt": _with_system(prompt, sys_ or system_prompt), "chosen": chosen, "rejected": rejected}, record)
    raise FormatError(f"unknown format {fmt!r}")


def _label(record: dict) -> bool:
    if "label" not in record:
        raise missing(record, "label")
    label = record["label"]
    if not _is_bool(label):
        raise FormatError(f"field `label` must be true or false, got {label!r}")
    return label.lower() in ("true", "1") if isinstance(label, str) else bool(label)


def _kto_conversation(record: dict, system_prompt: str | None) -> dict:
    """LLaMA-Factory's KTO layout: a conversation + `label`; its last assistant turn is the completion."""
    if "messages" in record:
        msgs, field = _chat(record["messages"]), "messages"
    else:
        msgs, field = _sharegpt(record["conversations"]), "conversations"
    check_order(_named(field, msgs))
    label = _label(record)
    if msgs[-1]["role"] != "assistant":
        raise FormatError(f"`{field}` ends with a `{msgs[-1]['role']}` turn: a KTO record's last turn is the assistant reply the `label` judges")
    prompt = msgs[:-1]
    if not any(m["role"] == "user" for m in prompt):
        raise FormatError(f"`{field}` has no user turn before the judged reply")
    own = _own_system(record) if field == "conversations" else None
    return _tooled({"kind": "kto", "prompt": _with_system(prompt, own or system_prompt), "completion": msgs[-1:], "label": label}, record)


def _own_system(record: dict) -> str | None:
    """A ShareGPT record's own `system` field (LLaMA-Factory)."""
    s = record.get("system")
    return s if isinstance(s, str) and s.strip() else None


def _tooled(ex: dict, record: dict) -> dict:
    tools = tools_of(record)
    if tools:
        ex["tools"] = tools
    return ex


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


def said(m: dict) -> str:
    """All a message says: its reasoning, its content and its tool calls (as JSON)."""
    if not (m.get("reasoning_content") or m.get("tool_calls")):
        return m["content"]  # the common case: the content alone
    parts = [m["reasoning_content"]] if m.get("reasoning_content") else []
    parts.append(m["content"])
    parts += [json.dumps(c["function"], ensure_ascii=False, sort_keys=True) for c in m.get("tool_calls") or []]
    return "\n".join(p for p in parts if p) if len(parts) > 1 else parts[0]


def strings(ex: dict) -> list[str]:
    """Every text of an example, in order (for PII, dedup and n-gram checks)."""
    images = [f"image:{h}" for h in ex.get("image_sha256") or []]  # the images' bytes count with the text (dedup, decontamination)
    if ex["kind"] == "text":
        return [ex["text"]]
    if ex["kind"] == "sft":
        return [said(m) for m in ex["messages"]] + images
    keys = ("prompt", "chosen", "rejected") if ex["kind"] == "preference" else ("prompt", "completion")
    return [said(m) for k in keys for m in ex[k]] + images


def responses(ex: dict) -> list[str]:
    """The texts a model is trained to produce (for the empty-response and repetition filters): a tool call counts."""
    if ex["kind"] == "text":
        return [ex["text"]]
    if ex["kind"] == "sft":
        return [said(m) for m in ex["messages"] if m["role"] == "assistant"]
    keys = ("chosen", "rejected") if ex["kind"] == "preference" else ("completion",)
    return [said(m) for k in keys for m in ex[k] if m["role"] == "assistant"]


def map_strings(ex: dict, fn) -> dict:
    """A copy of ``ex`` with ``fn`` applied to every text."""
    if ex["kind"] == "text":
        return {**ex, "text": fn(ex["text"])}
    out = dict(ex)
    for k in ("messages", "prompt", "chosen", "rejected", "completion"):
        if k in ex:
            out[k] = [_map_message(m, fn) for m in ex[k]]
    return out


def _map_message(m: dict, fn) -> dict:
    out = {**m, "content": fn(m["content"])}
    if m.get("reasoning_content"):
        out["reasoning_content"] = fn(m["reasoning_content"])
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _map_json(c["function"]["arguments"], fn)}} for c in m["tool_calls"]]
    return out


def _map_json(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_json(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_json(v, fn) for v in value]
    return value
