"""prepare: sources -> records -> examples -> clean -> dedup -> split -> decontaminate -> tokenize -> pack -> cache.

Reads top to bottom in :func:`prepare`; a cache miss builds the entry in data/build.py. Every input record is accounted for: it is kept in
a split, or dropped with a counted reason (``report["dropped"]``), so
``records_read == records_kept + sum(dropped.values())`` always holds (checked, and in
the report). Records are streamed from the sources; kept examples are spilled to a
JSONL file inside the cache build folder (memory holds only indices, hashes and the LSH
index), tokenized rows are appended to Arrow streams, and the result is memory-mapped.

Bad records stop the run under ``on_error: raise`` (file, line or row, the rule, the
fix) and are counted and written to ``rejected.jsonl`` under ``on_error: skip``.

Resources are bounded per record: a record over ``data.max_record_bytes`` is dropped unparsed
(``too_big``, whatever ``on_error`` says, as ``too_long`` is: a size policy, written to rejected.jsonl
with its reason), one nested deeper than ``records.MAX_DEPTH`` is a bad record (``too_deep``), and an
example over ``lengths.max_chars(max_length)`` characters is dropped (``too_long_chars``) or cut
before the template and the tokenizer see it (``lengths.bound_example``). Chat templates render in
a sandbox with a time and a size limit (``templates.Template``, data/sandbox.py). Before a build, the temporaries of
builds whose process died are removed (``cache.clean_stale``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainpipe.config import DataConfig
from trainpipe.data import cache as cache_mod
from trainpipe.data import vision_chat
from trainpipe.data.build import build
from trainpipe.data.sources import expand, fingerprint, sha256_path
from trainpipe.data.templates import Template, setup_chat_template
from trainpipe.errors import DataError


def sha256_file(path: str | Path) -> str:
    return sha256_path(Path(path))


@dataclass
class PreparedData:
    train: Any  # a memory-mapped datasets.Dataset (or list) of {"input_ids", "labels"[, "position_ids"]} rows
    eval: list[dict]
    eval_generation: list[dict]  # {"prompt", "reference"}
    report: dict = field(default_factory=dict)
    test: list[dict] = field(default_factory=list)
    cache_path: Path | None = None


def key_parts(cfg: DataConfig, tokenizer, tpl: Template, *, train_on: str, seed: int) -> dict:
    """What the cache key is made of. ``sources`` (file hashes) and ``benchmarks`` are hashed before the lookup;
    a build replaces them with the hashes of the bytes it read (see data/intake.py's :func:`check_read`)."""
    opts = cfg.model_dump(mode="json", exclude={"cache", "cache_dir", "num_proc"})
    for s in opts["sources"]:
        s.pop("path", None)
    return {
        "sources": [fingerprint(s) for s in cfg.sources], "options": opts,
        "benchmarks": [sha256_path(p) for b in cfg.decontamination.benchmarks for p in expand(b)],
        "tokenizer": cache_mod.tokenizer_fingerprint(tokenizer), "template": tpl.source, "train_on": train_on, "seed": seed,
        **({"processor": vision_chat.fingerprint(tokenizer)} if vision_chat.processor_of(tokenizer) is not None else {}),
    }


def cache_key(cfg: DataConfig, tokenizer, tpl: Template, *, train_on: str, seed: int) -> tuple[str, list[dict]]:
    parts = key_parts(cfg, tokenizer, tpl, train_on=train_on, seed=seed)
    return cache_mod.make_key(parts), parts["sources"]


def prepare(
    cfg: DataConfig,
    tokenizer,
    *,
    train_on: str,
    seed: int,
    rejected_path: str | Path | None = None,
    report_path: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    template_name: str = "tokenizer",
    batch_size_hint: int = 8,
    for_method: str | None = None,
) -> PreparedData:
    """Prepare (or reuse from the cache) the tokenized splits of ``cfg``; see the module docstring."""
    t0 = time.time()
    if not getattr(tokenizer, "chat_template", None):
        template_name = setup_chat_template(tokenizer, cfg.chat_template, getattr(tokenizer, "name_or_path", "tokenizer"))
    tpl = Template(tokenizer, template_name, reasoning=cfg.reasoning)
    tokenizer.trainpipe_reasoning = cfg.reasoning  # the export's chat template renders reasoning as training did (data/serve_template.py)
    parts = key_parts(cfg, tokenizer, tpl, train_on=train_on, seed=seed)
    key = cache_mod.make_key(parts)
    root = Path(cfg.cache_dir) if cfg.cache_dir else cache_mod.default_dir()

    entry = cache_mod.lookup(root, key) if cfg.cache else None
    hit = entry is not None
    if entry is None:
        cache_mod.clean_stale(root)  # what builds killed before their end left behind
        writer = cache_mod.Writer(root, key)
        try:
            build(cfg, tokenizer, tpl, writer, parts, train_on=train_on, seed=seed, progress=progress, on_total=on_total, batch_size_hint=batch_size_hint)
            key = writer.key = cache_mod.make_key(parts)  # the hashes of what was read (a file may change after the lookup)
            entry = writer.commit()
        except BaseException:
            writer.abort()
            raise
    report = json.loads((entry / "report.json").read_text(encoding="utf-8"))
    report["cache"] = {"key": key, "hit": hit, "path": str(entry)}
    report["chat_template"] = template_name
    report["seconds"] = round(time.time() - t0, 3)
    for src, dst in ((entry / "rejected.jsonl", rejected_path), (None, report_path)):
        if dst is None:
            continue
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        if src is not None:
            if src.exists():
                shutil.copyfile(src, dst)
        else:
            Path(dst).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    train = cache_mod.read_split(entry, "train.arrow")
    if for_method == "sft" and train is not None and "input_ids" not in train.column_names:
        kind = "preference pairs" if "chosen_input_ids" in train.column_names else "KTO examples"
        raise DataError(
            f"The data is {kind} (prompt/chosen/rejected or prompt/completion/label), which `method.name: sft` cannot train on. "
            "Give SFT data (alpaca, chat, ShareGPT or raw text), or prepare it with `trainpipe data prepare` for a DPO/KTO-style trainer."
        )
    if train is not None:
        check_kind_for_method(for_method, train.column_names, report)
        check_text_or_prompts(for_method, report)  # pretrain: raw text; rl: prompts to complete
    gens = json.loads((entry / "eval_generation.json").read_text(encoding="utf-8"))
    return PreparedData(train if train is not None else [], cache_mod.read_rows(entry, "eval.arrow"), gens, report,
                        cache_mod.read_rows(entry, "test.arrow"), entry)


PAIR_METHODS = ("dpo", "orpo", "reward")


def check_kind_for_method(method: str | None, columns: list[str], report: dict) -> None:
    """dpo/orpo/reward train on preference pairs; kto on KTO rows (prompt/completion/label) or on pairs,
    which it unpairs (chosen -> desirable, rejected -> undesirable, as TRL's `unpair_preference_dataset`)."""
    if method not in PAIR_METHODS + ("kto",):
        return
    pairs, unpaired = "chosen_input_ids" in columns, "completion_input_ids" in columns
    if (method == "kto" and (pairs or unpaired)) or (method in PAIR_METHODS and pairs):
        return
    found = ", ".join(sorted({str(s.get("format")) for s in report.get("sources", []) if s.get("format")})) or "not preference data"
    if method == "kto":
        raise DataError(
            f"kto needs KTO rows (prompt/completion/label) or preference pairs (prompt/chosen/rejected); this data is {found}. "
            "Map your fields with `data.sources[].columns` (e.g. `columns: {completion: answer, label: thumbs_up}`, or "
            "`{chosen: good, rejected: bad}` for pairs)."
        )
    if unpaired:
        raise DataError(
            f"{method} needs preference pairs (prompt/chosen/rejected); this data is kto (unpaired prompt/completion/label). "
            "Use `method.name: kto` for unpaired labels, or give pairs with `chosen` and `rejected` fields."
        )
    raise DataError(
        f"{method} needs preference pairs (prompt/chosen/rejected); this data is {found}; map `chosen`/`rejected` with "
        "`data.sources[].columns` (e.g. `columns: {prompt: question, chosen: good_answer, rejected: bad_answer}`)."
    )


def check_text_or_prompts(method: str | None, report: dict) -> None:
    """`pretrain` trains on raw text (`format: text`); `rl` needs prompts to complete (chat, alpaca, ShareGPT,
    preference or KTO records), which raw text has not."""
    found_formats = sorted({str(s.get("format")) for s in report.get("sources", []) if s.get("format")})
    found = ", ".join(found_formats) or "of no known format"
    if method == "pretrain" and any(f != "text" for f in found_formats):
        raise DataError(
            f"pretrain needs raw text; this data is {found}. Set `format: text` on sources whose records have a `text` field "
            "(or map another field with `columns: {text: FIELD}`), or train on conversations with `method.name: sft`."
        )
    if method == "rl" and "text" in found_formats:
        raise DataError(
            f"rl needs prompts to complete; this data is {found}, and raw text has no prompt. Give chat, alpaca, ShareGPT, "
            "preference or KTO records (map fields with `columns:`, e.g. `{instruction: question, output: answer}`)."
        )
