"""What a reader yields (:class:`Record`, or :class:`Rejected` with a reason) and the per-record bounds (:class:`Limits`).

A record nested deeper than :data:`MAX_DEPTH` lists/objects is ``too_deep``; one whose text is longer than
``data.max_record_bytes`` is ``too_big`` (:func:`bounded` applies both to the readers that parse before trainpipe sees
a record; the JSONL reader measures lines while it reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

MAX_DEPTH = 100  # lists/objects inside each other in one record; real records (tool calls, JSON schemas) stay far below
DEFAULT_RECORD_BYTES = 4 << 20



def default_record_bytes(max_length: int) -> int:
    """The rule for ``data.max_record_bytes`` when unset: 4 MiB, or 128 bytes per ``max_length`` token when that is
    more (a token is rarely over 16 characters, a character at most 4 UTF-8 bytes, JSON escapes up to 6, and a
    preference record repeats its prompt): far over any example that fits ``max_length``, far under what hurts."""
    return max(DEFAULT_RECORD_BYTES, 128 * max_length)


@dataclass(frozen=True)
class Limits:
    """Per-record bounds applied while reading (see the module docstring)."""

    max_record_bytes: int | None = None
    max_depth: int = MAX_DEPTH


@dataclass
class Record:
    source: str  # file path, hub id or sql url
    line: int  # 1-based line number, row or item index (see ``unit``)
    data: dict
    unit: str = "line"


@dataclass
class Rejected:
    source: str
    line: int
    reason: str
    excerpt: str
    unit: str = "line"
    kind: str = "format_mismatch"  # the counted reason

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "unit": self.unit, "kind": self.kind, "reason": self.reason, "excerpt": self.excerpt}


def excerpt(text: str, n: int = 80) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def too_big_reason(size: int, cap: int, what: str = "bytes") -> str:
    return (f"the record is {size:,} {what}, over `data.max_record_bytes` ({cap:,}); it was dropped unparsed and untokenized "
            "(raise `data.max_record_bytes` if such records are wanted, or split them)")


def too_deep_reason(limit: int) -> str:
    return (f"the record is nested more than {limit} lists/objects deep, which no training example needs (and which Python's "
            "JSON parser and every later stage would recurse through); flatten it")


def measure(data, cap: int | None, max_depth: int) -> tuple[int, bool]:
    """(characters of text in ``data``, keys included, counting stops past ``cap``; whether it nests deeper than
    ``max_depth``), without recursion."""
    size, stack = 0, [(data, 1)]
    while stack:
        v, d = stack.pop()
        if d > max_depth:
            return size, True
        if isinstance(v, dict):
            for k, x in v.items():
                size += len(k) if isinstance(k, str) else 8
                if isinstance(x, (dict, list, tuple)):
                    stack.append((x, d + 1))
                elif isinstance(x, (str, bytes)):
                    size += len(x)
                else:
                    size += 8
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (dict, list, tuple)):
                    stack.append((x, d + 1))
                elif isinstance(x, (str, bytes)):
                    size += len(x)
                else:
                    size += 8
        if cap is not None and size > cap:
            return size, False
    return size, False


def bounded(items: Iterator[Record | Rejected], limits: Limits | None) -> Iterator[Record | Rejected]:
    """Records of a reader that parses before trainpipe sees a record (JSON, Parquet, CSV, TXT, Arrow, hub, SQL):
    one too long or too deeply nested becomes a counted Rejected before anything else looks at it."""
    if limits is None:
        yield from items
        return
    cap = limits.max_record_bytes
    for item in items:
        if isinstance(item, Record):
            size, deep = measure(item.data, cap, limits.max_depth)
            if deep:
                item = Rejected(item.source, item.line, too_deep_reason(limits.max_depth), "(not shown)", item.unit, "too_deep")
            elif cap is not None and size > cap:
                head = next((x for x in item.data.values() if isinstance(x, str)), "") if isinstance(item.data, dict) else ""
                item = Rejected(item.source, item.line, too_big_reason(size, cap, "characters of text or more"), excerpt(head), item.unit, "too_big")
        yield item
