"""Reading source files into records, line by line, with the line number kept.

Every line ends up either as a record or as a rejection with a reason; a bad line under
``on_error: raise`` stops the run naming the file, the line and an excerpt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainpipe.errors import DataError


@dataclass
class Record:
    source: str  # file path
    line: int  # 1-based line number
    data: dict


@dataclass
class Rejected:
    source: str
    line: int
    reason: str
    excerpt: str

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "reason": self.reason, "excerpt": self.excerpt}


def excerpt(text: str, n: int = 80) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def read_jsonl(path: str | Path) -> Iterator[Record | Rejected]:
    """Yield a Record for each JSON object line and a Rejected for each bad line (blank lines are skipped)."""
    p = Path(path)
    if not p.is_file():
        hint = "it is a folder; name a .jsonl file inside it" if p.is_dir() else "check `data.sources[].path` (relative paths are resolved against the config file's folder)"
        raise DataError(f"Data file `{p}` does not exist: {hint}.")
    with open(p, encoding="utf-8", errors="strict") as fh:
        lineno = 0
        while True:
            try:
                line = fh.readline()
            except UnicodeDecodeError as exc:
                raise DataError(f"`{p}` line {lineno + 1} is not valid UTF-8 ({exc.reason}). Re-encode the file as UTF-8.") from None
            if not line:
                break
            lineno += 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Rejected(str(p), lineno, f"not valid JSON: {exc.msg} at column {exc.colno}", excerpt(line))
                continue
            if not isinstance(obj, dict):
                yield Rejected(str(p), lineno, f"a JSON {type(obj).__name__}, not an object", excerpt(line))
                continue
            yield Record(str(p), lineno, obj)
