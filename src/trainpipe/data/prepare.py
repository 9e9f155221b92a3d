"""prepare: source files -> records -> conversations -> split -> tokenized examples + DataReport.

Every input line is accounted for: kept in train or eval, or dropped with a counted reason
(bad JSON, wrong format, too long, nothing to train on). Bad lines stop the run under
``on_error: raise`` and are written to ``rejected.jsonl`` under ``on_error: skip``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.sources import Rejected, read_jsonl
from trainpipe.data.tokenize import TemplateError, generation_prompt, tokenize_conversation
from trainpipe.errors import DataError, ModelLoadError


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Example:
    source: str
    line: int
    messages: list[dict]


@dataclass
class PreparedData:
    train: list[dict]  # {"input_ids", "labels"}
    eval: list[dict]
    eval_generation: list[dict]  # {"prompt", "reference"}
    report: dict = field(default_factory=dict)


def _reject(r: Rejected, on_error: str, rejected: list[Rejected]) -> None:
    if on_error == "raise":
        raise DataError(
            f"`{r.source}` line {r.line}: {r.reason}. The line reads: `{r.excerpt}`. Fix that line, or set "
            "`data.on_error: skip` to drop such lines (each is counted and written with its reason to rejected.jsonl)."
        )
    rejected.append(r)


def load_examples(cfg: DataConfig) -> tuple[list[Example], list[Rejected], list[dict]]:
    """Read every source into conversations; returns (examples, rejected lines, per-source info)."""
    examples: list[Example] = []
    rejected: list[Rejected] = []
    sources = []
    for src in cfg.sources:
        fmt = None if src.format == "auto" else src.format
        chosen_by = "config" if fmt else None
        n_lines = n_kept = 0
        for item in read_jsonl(src.path):
            n_lines += 1
            if isinstance(item, Rejected):
                _reject(item, cfg.on_error, rejected)
                continue
            try:
                if fmt is None:
                    fmt = formats.detect(item.data)
                    chosen_by = f"detected from the fields of line {item.line}"
                msgs = formats.to_messages(item.data, fmt, cfg.system_prompt)
            except formats.FormatError as exc:
                reason = f"{exc} (format {fmt})" if fmt else str(exc)
                _reject(Rejected(item.source, item.line, reason, json.dumps(item.data)[:80]), cfg.on_error, rejected)
                continue
            examples.append(Example(item.source, item.line, msgs))
            n_kept += 1
        sources.append(
            {"path": src.path, "sha256": sha256_file(src.path), "format": fmt, "format_chosen_by": chosen_by, "lines": n_lines, "records": n_kept}
        )
    return examples, rejected, sources


def split(examples: list[Example], eval_split: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Shuffle by ``seed`` and hold out ``eval_split`` (a fraction, or a count when >= 1)."""
    n = len(examples)
    n_eval = int(eval_split) if eval_split >= 1 else max(1, round(n * eval_split))
    if n < 2 or n_eval >= n:
        raise DataError(
            f"There are {n} usable records, too few to hold out {n_eval} for evaluation and still train. "
            "Add data, or lower `data.eval_split`."
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [examples[i] for i in order[n_eval:]]
    ev = [examples[i] for i in sorted(eval_idx)]
    return train, ev


def prepare(
    cfg: DataConfig,
    tokenizer,
    *,
    train_on: str,
    seed: int,
    rejected_path: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> PreparedData:
    examples, rejected, sources = load_examples(cfg)
    if rejected_path is not None and rejected:
        with open(rejected_path, "w", encoding="utf-8") as fh:
            for r in rejected:
                fh.write(json.dumps(r.to_dict()) + "\n")
    if not examples:
        raise DataError(
            f"No usable records in {', '.join(s['path'] for s in sources)} ({len(rejected)} rejected). "
            "Check the files' format (alpaca: instruction/input/output; chat: messages with role/content)."
        )
    train_ex, eval_ex = split(examples, cfg.eval_split, seed)
    if on_total:
        on_total(len(train_ex) + len(eval_ex))

    dropped: Counter = Counter()
    dropped_by_split = {"train": Counter(), "eval": Counter()}

    def encode(exs: list[Example], name: str) -> tuple[list[dict], list[dict]]:
        out, gens = [], []
        for ex in exs:
            try:
                tok = tokenize_conversation(tokenizer, ex.messages, train_on)
            except TemplateError as exc:
                raise ModelLoadError(f"Chat template problem ({ex.source} line {ex.line}): {exc}.") from None
            if progress:
                progress(1)
            if len(tok.input_ids) > cfg.max_length:
                dropped["too_long"] += 1
                dropped_by_split[name]["too_long"] += 1
                continue
            if tok.n_loss_tokens == 0:
                dropped["no_loss_tokens"] += 1
                dropped_by_split[name]["no_loss_tokens"] += 1
                continue
            out.append({"input_ids": tok.input_ids, "labels": tok.labels})
            if name == "eval":
                prompt, ref = generation_prompt(tokenizer, ex.messages)
                gens.append({"prompt": prompt, "reference": ref})
        return out, gens

    train, _ = encode(train_ex, "train")
    ev, ev_gen = encode(eval_ex, "eval")
    if not train or not ev:
        which = "training" if not train else "evaluation"
        raise DataError(
            f"Every {which} example was dropped ({dict(dropped)}); `data.max_length` is {cfg.max_length}. "
            "Raise `data.max_length` or shorten the examples."
        )
    reasons = Counter()
    for r in rejected:
        reasons["invalid_json" if r.reason.startswith("not valid JSON") else ("not_an_object" if "not an object" in r.reason else "format_mismatch")] += 1
    lengths = [len(x["input_ids"]) for x in train]
    report = {
        "sources": sources,
        "lines_read": sum(s["lines"] for s in sources),
        "records": len(examples),
        "rejected": dict(reasons),
        "rejected_total": len(rejected),
        "split": {"seed": seed, "train": len(train_ex), "eval": len(eval_ex)},
        "dropped": dict(dropped),
        "dropped_by_split": {k: dict(v) for k, v in dropped_by_split.items()},
        "train_examples": len(train),
        "eval_examples": len(ev),
        "train_tokens": sum(lengths),
        "train_loss_tokens": sum(sum(1 for t in x["labels"] if t != -100) for x in train),
        "max_length": cfg.max_length,
        "longest_train_example": max(lengths),
    }
    # accounting invariant: every line is kept, rejected or dropped
    assert report["lines_read"] == len(rejected) + len(train) + len(ev) + sum(dropped.values())
    return PreparedData(train, ev, ev_gen, report)
