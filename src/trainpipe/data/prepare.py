"""prepare: sources -> records -> examples -> clean -> dedup -> split -> decontaminate -> tokenize -> pack -> cache.

Reads top to bottom in :func:`prepare`. Every input record is accounted for: it is kept in
a split, or dropped with a counted reason (``report["dropped"]``), so
``records_read == records_kept + sum(dropped.values())`` always holds (checked, and in
the report). Records are streamed from the sources; kept examples are spilled to a
JSONL file inside the cache build folder (memory holds only indices, hashes and the LSH
index), tokenized rows are appended to Arrow streams, and the result is memory-mapped.

Bad records stop the run under ``on_error: raise`` (file, line or row, the rule, the
fix) and are counted and written to ``rejected.jsonl`` under ``on_error: skip``.

Resources are bounded per record: a record over ``data.max_record_bytes`` is dropped unparsed
(``too_big``, whatever ``on_error`` says, as ``too_long`` is: a size policy, written to rejected.jsonl
with its reason), one nested deeper than ``sources.MAX_DEPTH`` is a bad record (``too_deep``), and an
example over ``tokenize.max_chars(max_length)`` characters is dropped (``too_long_chars``) or cut
before the template and the tokenizer see it (``tokenize.bound_example``). Chat templates render in
a sandbox with a time and a size limit (``tokenize.Template``). Before a build, the temporaries of
builds whose process died are removed (``cache.clean_stale``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainpipe.config import DataConfig
from trainpipe.data import cache as cache_mod
from trainpipe.data import clean, formats
from trainpipe.data.dedup import Decontaminator, NearDedup, Words, exact_key
from trainpipe.data.sources import Limits, Rejected, default_record_bytes, describe, excerpt, expand, fingerprint, iter_source, read_file, sha256_path
from trainpipe.data.split import split_surviving
from trainpipe.data.tokenize import Template, bound_example, encode_batch, max_chars, row_loss_tokens, row_tokens
from trainpipe.errors import DataError

REJECT_KINDS = ("invalid_json", "not_an_object", "duplicate_key", "ragged_row", "format_mismatch", "role_order", "too_deep", "too_big")
SIZE_KINDS = ("too_big",)  # dropped and counted whatever `on_error` says (a size policy, like `too_long`)
CHUNK = 2000
DECON_LISTED = 100  # decontamination drops named in the report (the n-gram and what it matched); the rest counted


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


def _where(unit: str, line: int) -> str:
    return "(the whole file)" if unit == "file" else f"{unit} {line}"


class _Rejects:
    def __init__(self, on_error: str):
        self.on_error = on_error
        self.items: list[dict] = []
        self.counts: Counter = Counter()

    def add(self, r: Rejected) -> None:
        if self.on_error == "raise" and r.kind not in SIZE_KINDS:
            raise DataError(
                f"`{r.source}` {_where(r.unit, r.line)}: {r.reason}. It reads: `{r.excerpt}`. Fix it, or set "
                "`data.on_error: skip` to drop such records (each is counted and written with its reason to rejected.jsonl)."
            )
        self.counts[r.kind] += 1
        self.items.append(r.to_dict())


def _strings_of(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings_of(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings_of(v)]
    return []


def key_parts(cfg: DataConfig, tokenizer, tpl: Template, *, train_on: str, seed: int) -> dict:
    """What the cache key is made of. ``sources`` (file hashes) and ``benchmarks`` are hashed before the lookup;
    a build replaces them with the hashes of the bytes it read (see :func:`_check_read`)."""
    opts = cfg.model_dump(mode="json", exclude={"cache", "cache_dir", "num_proc"})
    for s in opts["sources"]:
        s.pop("path", None)
    return {
        "sources": [fingerprint(s) for s in cfg.sources], "options": opts,
        "benchmarks": [sha256_path(p) for b in cfg.decontamination.benchmarks for p in expand(b)],
        "tokenizer": cache_mod.tokenizer_fingerprint(tokenizer), "template": tpl.source, "train_on": train_on, "seed": seed,
    }


def cache_key(cfg: DataConfig, tokenizer, tpl: Template, *, train_on: str, seed: int) -> tuple[str, list[dict]]:
    parts = key_parts(cfg, tokenizer, tpl, train_on=train_on, seed=seed)
    return cache_mod.make_key(parts), parts["sources"]


def _check_read(expected: list[dict], digests: dict, changed: list[str]) -> None:
    """Make ``expected`` (``[{"path", "sha256"}]``, hashed before the build) name what the build read: a file whose
    read bytes hash differently changed in between, and takes the hash of what was read, so the cache entry is
    stored under the content it holds, never under the old hash. A Parquet file or Arrow folder (not hashed in the
    read itself) that changed is an error."""
    for f in expected:
        got = digests.get(f["path"])
        if got is None or got["sha256"] == f["sha256"]:
            continue
        if not got["exact"]:
            raise DataError(
                f"`{f['path']}` changed while it was being prepared (SHA-256 {f['sha256'][:12]} before, {got['sha256'][:12]} after). "
                "Prepare again once nothing is writing to it (write a new file and rename it into place, rather than editing it in place)."
            )
        f["sha256"] = got["sha256"]
        changed.append(f["path"])


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
        from trainpipe.data.tokenize import setup_chat_template

        template_name = setup_chat_template(tokenizer, cfg.chat_template, getattr(tokenizer, "name_or_path", "tokenizer"))
    tpl = Template(tokenizer, template_name, reasoning=cfg.reasoning)
    parts = key_parts(cfg, tokenizer, tpl, train_on=train_on, seed=seed)
    key = cache_mod.make_key(parts)
    root = Path(cfg.cache_dir) if cfg.cache_dir else cache_mod.default_dir()

    entry = cache_mod.lookup(root, key) if cfg.cache else None
    hit = entry is not None
    if entry is None:
        cache_mod.clean_stale(root)  # what builds killed before their end left behind
        writer = cache_mod.Writer(root, key)
        try:
            _build(cfg, tokenizer, tpl, writer, parts, train_on=train_on, seed=seed, progress=progress, on_total=on_total, batch_size_hint=batch_size_hint)
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


# --------------------------------------------------------------------------- the build


class _Stages:
    """Remaining record counts after each stage, to name the stage that emptied the dataset."""

    def __init__(self):
        self.after: list[tuple[str, int, int]] = []  # (stage, removed, remaining)

    def mark(self, stage: str, removed: int, remaining: int) -> None:
        self.after.append((stage, removed, remaining))
        if remaining == 0:
            before = [s for s in self.after if s[1] > 0]
            detail = ", ".join(f"{s}: -{r}" for s, r, _ in before) or "nothing was read"
            raise DataError(
                f"No training records are left after the `{stage}` stage, which removed the last {removed} ({detail}). "
                + _FIXES.get(stage, "Check the data and the `data` options.")
            )


_FIXES = {
    "read": "The sources hold no records; check `data.sources`.",
    "format": "Every record was rejected; look at rejected.jsonl (with `data.on_error: skip`) and fix the format or `columns:`.",
    "sample": "Raise `weight` / `max_records` on the sources.",
    "filters": "Relax `data.filters` (e.g. `max_repetition`, `empty_response`, `bad_encoding`); preference pairs whose chosen and rejected replies are the same (`identical_pair`) are always dropped.",
    "dedup": "The data is all duplicates; raise `data.dedup.threshold` or turn `data.dedup.near` off.",
    "decontamination": "Every training record overlaps the eval/test responses or a benchmark (the data report names the n-gram of each); check that they are not the same data, or raise `data.decontamination.ngram` / `min_overlap`.",
    "tokenize": "Every example was too long or has nothing to train on: raise `data.max_length`, set `data.truncation: truncate`, or lower `data.filters.min_tokens`.",
}


def _build(cfg: DataConfig, tokenizer, tpl: Template, writer, parts: dict, *, train_on: str, seed: int, progress, on_total, batch_size_hint: int) -> None:
    dropped: Counter = Counter()
    rejects = _Rejects(cfg.on_error)
    scrub = clean.Scrubber(cfg.pii.types, cfg.pii.presidio) if cfg.pii.enabled else None
    words = Words()
    dd = cfg.dedup
    near = NearDedup(dd.threshold, dd.shingle_size, dd.num_perm) if dd.near else None
    seen: dict[bytes, int] = {}
    duplicates: list[dict] = []
    stages = _Stages()
    pii_records = 0
    prints = parts["sources"]
    changed: list[str] = []  # files whose content changed between the cache lookup and the read
    limits = Limits(cfg.max_record_bytes or default_record_bytes(cfg.max_length))
    chars = max_chars(cfg.max_length)
    cut_early = 0  # examples cut to `chars` characters before tokenizing (truncation: truncate)

    # 1. read, format, sample, clean, dedup: every kept example is spilled with its byte offset
    spill_path = writer.path("examples.spill")
    spill = open(spill_path, "wb")
    offsets: list[int] = []
    meta: list[tuple[int, str, int, Any]] = []  # (source index, role, line, stratum)
    sources_info = []
    n_read = 0
    for si, src in enumerate(cfg.sources):
        fmt = None if src.format == "auto" else src.format
        why = "set in the config" if fmt else None
        s_read = s_kept = 0
        rng = random.Random(f"{seed}:{si}")
        reservoir: list | None = [] if src.max_records else None
        digests: dict = {}
        for item in iter_source(src, digests, limits):
            n_read += 1
            s_read += 1
            if isinstance(item, Rejected):
                rejects.add(item)
                continue
            data = formats.apply_columns(item.data, src.columns)
            try:
                if fmt is None:
                    fmt, why = formats.detect(data)
                    why = f"detected from {_where(item.unit, item.line)}: {why}"
                ex = formats.to_example(data, fmt, cfg.system_prompt)
            except formats.FormatError as exc:
                reason = f"{exc} (format {fmt})" if fmt else str(exc)
                if src.format == "auto" and fmt and exc.kind == "format_mismatch":
                    try:
                        other = formats.detect(data)[0]
                    except formats.FormatError:
                        other = None
                    if other and other != fmt:
                        reason += f"; the record looks like {other}, but this source was {why} (one format per source: split the file, or set `format:`)"
                rejects.add(Rejected(item.source, item.line, reason, excerpt(json.dumps(item.data, default=str)), item.unit, exc.kind))
                continue
            ex, cut = bound_example(ex, chars, cfg.truncation)
            if ex is None:  # far over max_length: never cleaned, deduplicated, rendered or tokenized
                dropped["too_long_chars"] += 1
                continue
            cut_early += cut
            if reservoir is not None:  # max_records: seeded reservoir sample, original order kept
                if len(reservoir) < src.max_records:
                    reservoir.append((item, ex))
                else:
                    j = rng.randrange(s_read)
                    if j < src.max_records:
                        reservoir[j] = (item, ex)
                    dropped["max_records"] += 1
                continue
            if src.weight is not None and src.weight < 1 and rng.random() >= src.weight:
                dropped["subsampled"] += 1
                continue
            s_kept += _keep(item, ex, data, si, src, cfg, scrub, words, near, seen, duplicates, dropped, spill, offsets, meta)
        if reservoir is not None:
            reservoir.sort(key=lambda p: p[0].line)
            for item, ex in reservoir:
                s_kept += _keep(item, ex, formats.apply_columns(item.data, src.columns), si, src, cfg, scrub, words, near, seen, duplicates, dropped, spill, offsets, meta)
        info = {"source": describe(src), "path": describe(src), "role": src.role, "format": fmt, "format_chosen_by": why,
                "records_read": s_read, "records_after_cleaning": s_kept}
        if prints[si]["kind"] == "files":
            files = prints[si]["files"]
            _check_read(files, digests, changed)
            info["files"] = files
            info["sha256"] = files[0]["sha256"] if len(files) == 1 else hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        else:  # hub id / SQL query: identified by what names it, not by content
            info["sha256"] = hashlib.sha256(json.dumps(prints[si], sort_keys=True).encode()).hexdigest()
        sources_info.append(info)
    spill.close()
    del near, seen  # the dedup indexes (the near-dedup LSH is most of the read stage's memory) are done with
    if scrub is not None:
        pii_records = scrub.counts
    _mark_read_stages(stages, n_read, rejects, dropped, len(offsets))

    # 2. split (eval/test sources, or shares of the training records)
    roles = [m[1] for m in meta]
    train_pos = [i for i, r in enumerate(roles) if r == "train"]
    has_eval_src = any(r == "eval" for r in roles)
    has_test_src = any(r == "test" for r in roles)
    strata = None
    if cfg.stratify_by:
        strata = [meta[i][3] for i in train_pos]
    fh = open(spill_path, "rb")

    def load(i: int) -> dict:
        fh.seek(offsets[i])
        return json.loads(fh.readline())

    opts = dict(train_on=train_on, max_length=cfg.max_length, truncation=cfg.truncation, min_tokens=cfg.filters.min_tokens, max_tokens=cfg.filters.max_tokens)
    held_out_dropped: Counter = Counter()  # why eval/test candidates failed the length rules (they stay in train)

    def survives(pos: list[int]) -> list[bool]:
        encs = encode_batch(tokenizer, tpl, [load(train_pos[i]) for i in pos], **opts)
        for e in encs:
            if e.row is None:
                held_out_dropped[e.reason] += 1
        return [e.row is not None for e in encs]

    # eval/test are drawn from the records that pass cleaning, dedup and the length rules (tokenized), in a seeded order
    tr, ev, te, split_info = split_surviving(len(train_pos), 0 if has_eval_src else cfg.eval_split, 0 if has_test_src else cfg.test_split,
                                             seed, survives, strata)
    assign = {"train": [train_pos[i] for i in tr], "eval": sorted([train_pos[i] for i in ev] + [i for i, r in enumerate(roles) if r == "eval"]),
              "test": sorted([train_pos[i] for i in te] + [i for i, r in enumerate(roles) if r == "test"])}
    if not assign["eval"]:
        raise DataError("There is no evaluation data: a source has `role: eval` but no records of it survived cleaning. Check that source.")
    eval_asked = len(assign["eval"]) if has_eval_src else split_info["eval_asked"]
    if not has_eval_src and len(ev) < eval_asked:
        _check_eval_size(cfg, eval_asked, len(ev), held_out_dropped, dropped, "of the training records")

    # 3. decontaminate the training split against eval/test and the benchmark files

    decon_report: dict = {"enabled": cfg.decontamination.enabled}
    if cfg.decontamination.enabled:  # against benchmark files and eval/test responses; boilerplate n-grams ignored
        dc = cfg.decontamination
        cont = Decontaminator(dc.ngram, dc.boilerplate_share, dc.boilerplate_records, dc.min_overlap)
        for name in ("eval", "test"):
            for i in assign[name]:
                ex = load(i)
                for s in (formats.responses(ex) if dc.against == "responses" else formats.strings(ex)):
                    cont.add(words.ids(s)[1], f"{name} split {meta[i][4]}:{meta[i][2]}")
        bench = iter(range(len(parts["benchmarks"])))
        for b in dc.benchmarks:
            for p in expand(b):
                digests = {}
                for rec in read_file(p, digests=digests, limits=limits):  # a huge or deep benchmark record is skipped
                    if not isinstance(rec, Rejected):
                        for s in _strings_of(rec.data):
                            cont.add(words.ids(s)[1], f"benchmark {p}:{rec.line}")
                k = next(bench)
                expected = [{"path": str(p), "sha256": parts["benchmarks"][k]}]
                _check_read(expected, digests, changed)
                parts["benchmarks"][k] = expected[0]["sha256"]
        drops: list[dict] = []
        if len(cont):
            every = assign["train"] + assign["eval"] + assign["test"]
            for k in range(0, len(every), CHUNK):  # how many records each reference n-gram occurs in
                cont.count([words.ids("\n".join(formats.strings(load(i))))[1] for i in every[k : k + CHUNK]])
            keep = []
            for k in range(0, len(assign["train"]), CHUNK):
                part = assign["train"][k : k + CHUNK]
                ws = [words.ids("\n".join(formats.strings(load(i)))) for i in part]
                for i, hit in zip(part, cont.check([w for w, _ in ws], [a for _, a in ws])):
                    if hit is None:
                        keep.append(i)
                        continue
                    dropped["decontaminated"] += 1
                    drops.append({"record": f"{meta[i][4]}:{meta[i][2]}", "ngram": hit[0], "matched": hit[1], "overlap": hit[2]})
            stages.mark("decontamination", len(assign["train"]) - len(keep), len(keep))
            assign["train"] = keep
        decon_report.update({
            "ngram": dc.ngram, "against": f"benchmark files and the eval/test {'responses' if dc.against == 'responses' else 'texts'}",
            "reference_ngrams": len(cont), "boilerplate_records": cont.threshold if len(cont) else None, "min_overlap": dc.min_overlap,
            "boilerplate_ngrams_ignored": cont.boilerplate(), "dropped": len(drops),
            "drops": drops[:DECON_LISTED], "drops_not_listed": max(0, len(drops) - DECON_LISTED),
        })

    # 4. tokenize (chunks, optionally in worker processes), repeat weighted sources, write the splits
    total = sum(len(v) for v in assign.values())
    del roles, train_pos, strata  # per-record lists no longer needed (assign holds the indices)
    if on_total:
        on_total(total)
    num_proc = cfg.num_proc or ((os.cpu_count() or 1) if total >= 20_000 else 1)
    split_stats: dict[str, dict] = {}
    truncated = 0
    chunked = blocks = 0  # raw-text documents over max_length, and the max_length blocks they became
    train_lengths: list[int] = []
    gens: list[dict] = []
    repeat_rng = random.Random(f"{seed}:repeat")
    repeated = 0
    pool = _pool(num_proc, tokenizer, tpl, opts) if num_proc > 1 else None
    try:
        for name in ("train", "eval", "test"):
            idx = assign[name]
            st = {"records": 0, "rows": 0, "tokens": 0, "loss_tokens": 0}
            chunks = [idx[k : k + CHUNK] for k in range(0, len(idx), CHUNK)]
            jobs = (([load(i) for i in c], name == "eval") for c in chunks)
            results = pool.imap(_work, jobs) if pool is not None else (_encode_chunk(tokenizer, tpl, opts, exs, g) for exs, g in jobs)
            for c, encs in zip(chunks, results):
                rows = []
                for i, enc in zip(c, encs):
                    if enc.row is None:
                        dropped[enc.reason] += 1
                        continue
                    truncated += enc.truncated
                    st["records"] += 1
                    copies = 1
                    w = cfg.sources[meta[i][0]].weight
                    if name == "train" and w is not None and w > 1:
                        copies = int(w) + (1 if repeat_rng.random() < w - int(w) else 0)
                        repeated += copies - 1
                    if enc.more:  # a raw-text document longer than max_length, cut into blocks
                        chunked += 1
                        blocks += 1 + len(enc.more)
                    for block in [enc.row, *enc.more]:
                        n_tok, n_loss = row_tokens(block), row_loss_tokens(block)
                        row = {**block, "padding_free": 1} if (name == "train" and cfg.packing == "padding_free") else block
                        for _ in range(copies):
                            rows.append(row)
                            if name == "train":
                                train_lengths.append(n_tok)
                            if len(rows) >= CHUNK:  # repeated copies are streamed out, never all held at once
                                writer.write_rows(f"{name}.arrow.tmp" if (name == "train" and cfg.packing == "pack") else f"{name}.arrow", rows)
                                rows = []
                        st["rows"] += copies
                        st["tokens"] += n_tok * copies
                        st["loss_tokens"] += n_loss * copies
                    if enc.generation is not None:
                        gens.append(enc.generation)
                writer.write_rows(f"{name}.arrow.tmp" if (name == "train" and cfg.packing == "pack") else f"{name}.arrow", rows)
                if progress:
                    progress(len(c))
            split_stats[name] = st
            if name == "train":
                stages.mark("tokenize", len(idx) - st["records"], st["records"])
            if name == "eval" and st["records"] < eval_asked:  # an eval source's records failed the length rules
                _check_eval_size(cfg, eval_asked, st["records"], Counter(dropped), Counter(), "of the `role: eval` source")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        fh.close()

    # 5. batching layout for the training split
    from trainpipe.data.packing import non_pad_share

    if cfg.packing == "pack":
        split_stats["train"]["packed_rows"] = _pack_split(writer, cfg.max_length)
        share = split_stats["train"]["tokens"] / max(1, split_stats["train"]["packed_rows"] * cfg.max_length)
    elif cfg.packing == "padding_free":
        share = 1.0
    else:
        share = non_pad_share(train_lengths, mode="dynamic", max_length=cfg.max_length, batch_size=batch_size_hint, seed=seed)

    # 6. the report
    kept = sum(split_stats[s]["records"] for s in split_stats)
    records_read = n_read
    all_dropped = {**{k: v for k, v in rejects.counts.items()}, **{k: v for k, v in dropped.items() if v}}
    invariant = records_read == kept + sum(all_dropped.values())
    if not invariant:  # a bug, never a user error: fail loudly rather than report wrong numbers
        raise RuntimeError(f"data accounting broken: read {records_read} != kept {kept} + dropped {sum(all_dropped.values())} ({all_dropped})")
    lengths = sorted(train_lengths)

    def pct(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(round(p * (len(lengths) - 1))))] if lengths else 0

    report = {
        "records_read": records_read,
        "records_kept": kept,
        "dropped": dict(sorted(all_dropped.items())),
        "pii": dict(sorted(pii_records.items())) if scrub is not None else {},
        "splits": {k: v for k, v in split_stats.items() if v["records"] or k != "test"},
        "held_out": {"eval_asked": eval_asked, "eval_records": split_stats["eval"]["records"],
                     "test_asked": split_info["test_asked"] if not has_test_src else split_stats["test"]["records"],
                     "test_records": split_stats["test"]["records"], "min_eval_records": _min_eval(cfg, eval_asked),
                     "drawn_from": "records that passed cleaning, dedup and the length rules (seeded order)",
                     "candidates_failed_length_rules": dict(held_out_dropped)},
        "invariant": {"rule": "records_read == records_kept + sum(dropped)", "holds": invariant},
        "sources": sources_info,
        "rejected": dict(rejects.counts),
        "rejected_total": sum(rejects.counts.values()),
        "duplicates": {"exact": dropped.get("exact_duplicate", 0), "near": dropped.get("near_duplicate", 0), "file": "duplicates.jsonl"},
        "decontaminated": dropped.get("decontaminated", 0),
        "decontamination": decon_report,
        "pii_audit": scrub.audit_report() if scrub is not None else None,
        "length": {"p50": pct(0.5), "p95": pct(0.95), "max": lengths[-1] if lengths else 0, "max_length": cfg.max_length,
                   "dropped_too_long": dropped.get("too_long", 0) + dropped.get("too_long_chars", 0),
                   "dropped_before_tokenizing": dropped.get("too_long_chars", 0), "cut_before_tokenizing": cut_early,
                   "max_chars": chars, "max_record_bytes": limits.max_record_bytes, "truncated": truncated, "policy": cfg.truncation,
                   "chunked_documents": chunked, "chunk_blocks": blocks},
        "batching": {"mode": cfg.packing, "non_pad_share": round(share, 4),
                     "basis": {"pack": "tokens / (packed rows x max_length)", "padding_free": "no padding at all",
                               "none": f"dynamic padding, batches of {batch_size_hint} in seeded random order"}[cfg.packing],
                     "padded_to_max_length_share": round(non_pad_share(train_lengths, mode="max_length", max_length=cfg.max_length), 4)},
        "repeated": repeated,
        "changed_while_read": changed,  # prepared from what was read, cached under its hash
        "seed": seed,
        "train_on": train_on,
        # names of the first data report, kept for readers of it
        "records": kept,
        "train_examples": split_stats["train"]["records"],
        "eval_examples": split_stats["eval"]["records"],
        "train_tokens": split_stats["train"]["tokens"],
        "train_loss_tokens": split_stats["train"]["loss_tokens"],
    }
    os.remove(spill_path)
    writer.write_json("report.json", report)
    writer.write_json("eval_generation.json", gens)
    with open(writer.path("rejected.jsonl"), "w", encoding="utf-8") as out:
        for r in rejects.items:
            out.write(json.dumps(r, default=str) + "\n")
    with open(writer.path("duplicates.jsonl"), "w", encoding="utf-8") as out:
        for d in duplicates:
            out.write(json.dumps(d) + "\n")


MIN_EVAL_FLOOR = 20  # `data.min_eval_records` default: this many, or the asked size when smaller


def _min_eval(cfg: DataConfig, asked: int) -> int:
    return cfg.min_eval_records if cfg.min_eval_records is not None else min(MIN_EVAL_FLOOR, asked)


def _check_eval_size(cfg: DataConfig, asked: int, got: int, failed: Counter, dropped: Counter, where: str) -> None:
    """Fewer eval records survived than asked: go on with them when at least `data.min_eval_records` did, else stop."""
    floor = _min_eval(cfg, asked)
    if got >= floor:
        return
    why = ", ".join(f"{k}: {v}" for k, v in sorted((failed + dropped).items()) if v) or "none recorded"
    raise DataError(
        f"The evaluation split asked for {asked} records, but only {got} {where} pass cleaning, dedup and the length rules "
        f"(`data.max_length` {cfg.max_length}, `data.truncation: {cfg.truncation}`), below `data.min_eval_records` ({floor}); "
        f"records were dropped for: {why}. Raise `data.max_length`, set `data.truncation: truncate`, add data, "
        "lower `data.eval_split`, or lower `data.min_eval_records`."
    )


def _mark_read_stages(stages: _Stages, n_read: int, rejects: _Rejects, dropped: Counter, kept: int) -> None:
    remaining = n_read
    stages.mark("read", 0, remaining) if n_read == 0 else None
    for stage, removed in (
        ("format", sum(rejects.counts.values())),
        ("sample", dropped["subsampled"] + dropped["max_records"]),
        ("filters", dropped["too_long_chars"] + dropped["identical_pair"] + dropped["empty_response"] + dropped["bad_encoding"] + dropped["repetitive"]),
        ("dedup", dropped["exact_duplicate"] + dropped["near_duplicate"]),
    ):
        remaining -= removed
        stages.mark(stage, removed, remaining)
    assert remaining == kept, (remaining, kept)


def _keep(item, ex, data, si, src, cfg: DataConfig, scrub, words: Words, near, seen, duplicates, dropped: Counter, spill, offsets, meta) -> int:
    """Clean, filter and dedup one example; spill it when kept. Returns 1 when kept."""
    f = cfg.filters
    if scrub is not None:
        scrub.where = f"{item.source}:{item.line}"
        ex = formats.map_strings(ex, scrub)
    if ex["kind"] == "preference" and _texts(ex["chosen"]) == _texts(ex["rejected"]):
        dropped["identical_pair"] += 1  # nothing to prefer: the loss is flat at log 2 whatever the model does
        return 0
    resp = formats.responses(ex)
    if f.empty_response and (not resp or any(not r.strip() for r in resp)):
        dropped["empty_response"] += 1
        return 0
    if f.bad_encoding and clean.encoding_problem(formats.strings(ex)):
        dropped["bad_encoding"] += 1
        return 0
    if f.max_repetition is not None and any(clean.repetition(r) > f.max_repetition for r in resp):
        dropped["repetitive"] += 1
        return 0
    where = f"{item.source}:{item.line}"
    gid = len(offsets)
    if cfg.dedup.exact or near is not None:
        ws, ids = words.ids("\n".join(formats.strings(ex)))
        if cfg.dedup.exact:
            k = exact_key(ws)
            first = seen.get(k)
            if first is not None:
                dropped["exact_duplicate"] += 1
                duplicates.append({"record": where, "matched": _loc(meta, first, cfg), "kind": "exact", "similarity": 1.0})
                return 0
            seen[k] = gid
        if near is not None:
            hit = near.check_and_add(gid, ids)
            if hit is not None:
                dropped["near_duplicate"] += 1
                duplicates.append({"record": where, "matched": _loc(meta, hit[0], cfg), "kind": "near", "similarity": round(hit[1], 3)})
                if cfg.dedup.exact:
                    del seen[k]
                return 0
    offsets.append(spill.tell())
    spill.write(json.dumps(ex, ensure_ascii=False).encode() + b"\n")
    stratum = data.get(cfg.stratify_by) if cfg.stratify_by else None
    meta.append((si, src.role, item.line, stratum, item.source))
    return 1


def _texts(turns: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], formats.said(m).strip()) for m in turns]  # tool calls and reasoning too: two calls differ


def _loc(meta, gid: int, cfg) -> str:
    m = meta[gid]
    return f"{m[4]}:{m[2]}"


# --------------------------------------------------------------------------- tokenizing in chunks

_STATE: dict = {}


def _encode_chunk(tokenizer, tpl, opts, exs, with_generation):
    return encode_batch(tokenizer, tpl, exs, with_generation=with_generation, **opts)


def _work(job):
    exs, g = job
    return _encode_chunk(_STATE["tok"], _STATE["tpl"], _STATE["opts"], exs, g)


def _pool(n: int, tokenizer, tpl, opts):
    """Forked worker processes for tokenization (None where fork is unavailable: one process). The children are
    told not to use the Rust tokenizer's thread pool, which a fork can leave locked."""
    import multiprocessing as mp

    try:
        ctx = mp.get_context("fork")
    except ValueError:
        return None
    _STATE.update(tok=tokenizer, tpl=tpl, opts=opts)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return ctx.Pool(n)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _pack_split(writer, max_length: int) -> int:
    """Pack the tokenized training rows (written to ``train.arrow.tmp``) into ``train.arrow``; returns the row count.
    Only the lengths are held in memory; rows are taken from the memory-mapped table bin by bin."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from trainpipe.data.packing import pack_bins, pack_rows

    entry = writer._writers.pop("train.arrow.tmp", None)
    if entry is not None:
        entry[1].close()
        entry[0].close()
    tmp = writer.path("train.arrow.tmp")
    if not tmp.exists():
        return 0
    with pa.memory_map(str(tmp)) as src:
        table = pa.ipc.open_stream(src).read_all()
        bins = pack_bins(pc.list_value_length(table["input_ids"]).to_pylist(), max_length)
        for k in range(0, len(bins), CHUNK // 4):
            group = bins[k : k + CHUNK // 4]
            flat = [i for b in group for i in b]
            rows = dict(zip(flat, table.take(pa.array(flat)).to_pylist()))
            writer.write_rows("train.arrow", [pack_rows([rows[i] for i in b]) for b in group])
        del table
    os.remove(tmp)
    return len(bins)
