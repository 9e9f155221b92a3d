"""A cache entry's build, the steps of data/prepare.py's :func:`prepare` on a cache miss, in order (:func:`build`):

1. read, format, sample, clean and dedup the sources (data/intake.py), kept examples spilled to a file;
2. split: eval/test sources, or seeded shares of the training records that pass the length rules;
3. decontaminate the training split against the eval/test splits and the benchmark files;
4. tokenize in chunks (in worker processes for large data), repeat weighted sources, write the Arrow splits;
5. the batching layout of the training split (packing) and its padding share;
6. the report (every record read is kept or dropped with a counted reason) and the entry's other files.
"""

from __future__ import annotations

import gc
import json
import os
import random
from collections import Counter
from contextlib import contextmanager

from trainpipe.config import DataConfig
from trainpipe.data import formats, vision_chat
from trainpipe.data.blocks import BlockStream
from trainpipe.data.dedup import Decontaminator
from trainpipe.data.intake import DROP_RULES, Intake, Stages, check_read, unspill
from trainpipe.data.lengths import row_loss_tokens, row_tokens
from trainpipe.data.packing import non_pad_share, pack_bins, pack_rows
from trainpipe.data.sources import Rejected, expand, read_file
from trainpipe.data.split import split_surviving
from trainpipe.data.templates import Template
from trainpipe.data.tokenize import encode_batch
from trainpipe.data.workers import pipelined, pool, work
from trainpipe.errors import DataError

CHUNK = 2000
DECON_LISTED = 100  # decontamination drops named in the report (the n-gram and what it matched); the rest counted
MIN_EVAL_FLOOR = 20  # `data.min_eval_records` default: this many, or the asked size when smaller


def build(cfg: DataConfig, tokenizer, tpl: Template, writer, parts: dict, *, train_on: str, seed: int, progress, on_total, batch_size_hint: int) -> None:
    """Build the entry's files into ``writer`` (a cache.Writer); ``parts`` (the key's parts) take the hashes of what was read."""
    with fewer_collections():
        _build(cfg, tokenizer, tpl, writer, parts, train_on=train_on, seed=seed, progress=progress, on_total=on_total, batch_size_hint=batch_size_hint)


@contextmanager
def fewer_collections():
    """Python's cycle collector, far less often while a build runs. A build allocates a few containers per record (the
    examples, their messages, their rows) and makes almost no cyclic garbage (~8,000 objects over a million records,
    measured), yet at the default thresholds the collector ran ~34,000 times over that million and traversed everything
    the process had imported at each full pass: ~30 % of the build's time at 1M records (161.6 s -> 117.6 s with this).
    The objects alive before the build are frozen out of the collector's passes (``gc.freeze``) and the young
    generation is collected every 50,000 allocations instead of 700; both are put back after, whatever happens."""
    old, ours = gc.get_threshold(), gc.get_freeze_count() == 0  # a process that froze objects itself keeps them so
    if ours:
        gc.freeze()
    gc.set_threshold(50_000, 20, 10)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if ours:
            gc.unfreeze()


def _build(cfg: DataConfig, tokenizer, tpl: Template, writer, parts: dict, *, train_on: str, seed: int, progress, on_total, batch_size_hint: int) -> None:
    b = _Build(cfg, tokenizer, tpl, writer, parts, train_on=train_on, seed=seed)
    b.intake.read_all(b.stages)  # 1
    b.fh = open(b.intake.spill_path, "rb")
    try:
        b.split()  # 2
        b.decontaminate()  # 3
        b.tokenize(progress, on_total)  # 4
    finally:
        b.fh.close()
    share = b.batching(batch_size_hint)  # 5
    b.write(b.report(share, batch_size_hint))  # 6


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


def _strings_of(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings_of(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings_of(v)]
    return []


class _Build:
    """The state one build carries from step to step; each method is one step of :func:`build`."""

    def __init__(self, cfg: DataConfig, tokenizer, tpl: Template, writer, parts: dict, *, train_on: str, seed: int):
        self.cfg, self.tokenizer, self.tpl, self.writer, self.parts = cfg, tokenizer, tpl, writer, parts
        self.flat_vision = vision_chat.flattens(vision_chat.processor_of(tokenizer))  # VLM rows this family may flatten
        self.train_on, self.seed = train_on, seed
        self.intake = Intake(cfg, parts["sources"], writer.path("examples.spill"), seed=seed)
        self.dropped = self.intake.dropped
        self.stages = Stages()
        self.fh = None
        self.opts = dict(train_on=train_on, max_length=cfg.max_length, truncation=cfg.truncation, min_tokens=cfg.filters.min_tokens, max_tokens=cfg.filters.max_tokens,
                         pretrain_blocks=cfg.pretrain_blocks)
        self.decon_report: dict = {"enabled": cfg.decontamination.enabled}
        self.split_stats: dict[str, dict] = {}
        self.truncated = 0
        self.cut = [0, 0]  # truncated pairs: prompt and reply tokens removed (data/lengths.truncate_pair)
        self.chunked = self.blocks = 0  # raw-text documents over max_length, and the max_length blocks they became
        self.streams: dict[str, BlockStream] = {}  # `pretrain_blocks: stream`: each split's raw-text block stream
        self.train_lengths: list[int] = []
        self.gens: list[dict] = []
        self.repeat_rng = random.Random(f"{seed}:repeat")
        self.repeated = 0

    def load(self, i: int) -> dict:
        """The kept example ``i``, read back from the spill file."""
        return self.load_many([i])[0]

    def load_many(self, idx: list[int]) -> list[dict]:
        """The kept examples ``idx``, read back from the spill file, each record read whole by its offsets (one pread, no
        buffer refill per record)."""
        fd, offsets, n = self.fh.fileno(), self.intake.offsets, len(self.intake.offsets)
        end = self.intake.spill_end
        return [unspill(os.pread(fd, (offsets[i + 1] if i + 1 < n else end) - offsets[i], offsets[i])) for i in idx]

    # 2. split (eval/test sources, or shares of the training records)
    def split(self) -> None:
        cfg, meta = self.cfg, self.intake.meta
        roles = [m[1] for m in meta]
        train_pos = [i for i, r in enumerate(roles) if r == "train"]
        self.has_eval_src = any(r == "eval" for r in roles)
        self.has_test_src = any(r == "test" for r in roles)
        strata = [meta[i][3] for i in train_pos] if cfg.stratify_by else None
        self.held_out_dropped: Counter = Counter()  # why eval/test candidates failed the length rules (they stay in train)

        def survives(pos: list[int]) -> list[bool]:
            encs = encode_batch(self.tokenizer, self.tpl, self.load_many([train_pos[i] for i in pos]), **self.opts)
            for e in encs:
                if e.row is None:
                    self.held_out_dropped[e.reason] += 1
            return [e.row is not None for e in encs]

        # eval/test are drawn from the records that pass cleaning, dedup and the length rules (tokenized), in a seeded order
        tr, ev, te, self.split_info = split_surviving(len(train_pos), 0 if self.has_eval_src else cfg.eval_split,
                                                      0 if self.has_test_src else cfg.test_split, self.seed, survives, strata)
        self.assign = {"train": [train_pos[i] for i in tr], "eval": sorted([train_pos[i] for i in ev] + [i for i, r in enumerate(roles) if r == "eval"]),
                       "test": sorted([train_pos[i] for i in te] + [i for i, r in enumerate(roles) if r == "test"])}
        if not self.assign["eval"]:
            raise DataError("There is no evaluation data: a source has `role: eval` but no records of it survived cleaning. Check that source.")
        self.eval_asked = len(self.assign["eval"]) if self.has_eval_src else self.split_info["eval_asked"]
        if not self.has_eval_src and len(ev) < self.eval_asked:
            _check_eval_size(cfg, self.eval_asked, len(ev), self.held_out_dropped, self.dropped, "of the training records")

    # 3. decontaminate the training split against eval/test and the benchmark files
    def decontaminate(self) -> None:
        if not self.cfg.decontamination.enabled:
            return
        dc = self.cfg.decontamination  # against benchmark files and eval/test responses; boilerplate n-grams ignored
        cont = Decontaminator(dc.ngram, dc.boilerplate_share, dc.boilerplate_records, dc.min_overlap)
        self._add_references(cont)
        drops: list[dict] = []
        if len(cont):
            drops = self._drop_contaminated(cont)
        self.decon_report.update({
            "ngram": dc.ngram, "against": f"benchmark files and the eval/test {'responses' if dc.against == 'responses' else 'texts'}",
            "reference_ngrams": len(cont), "boilerplate_records": cont.threshold if len(cont) else None, "min_overlap": dc.min_overlap,
            "boilerplate_ngrams_ignored": cont.boilerplate(), "dropped": len(drops),
            "drops": drops[:DECON_LISTED], "drops_not_listed": max(0, len(drops) - DECON_LISTED),
        })

    def _add_references(self, cont: Decontaminator) -> None:
        """The reference n-grams: the eval/test splits' responses (or texts) and every string of the benchmark files."""
        dc, words, meta, parts = self.cfg.decontamination, self.intake.words, self.intake.meta, self.parts
        for name in ("eval", "test"):
            for i in self.assign[name]:
                ex = self.load(i)
                for s in (formats.responses(ex) if dc.against == "responses" else formats.strings(ex)):
                    cont.add(words.ids(s)[1], f"{name} split {meta[i][4]}:{meta[i][2]}")
        bench = iter(range(len(parts["benchmarks"])))
        for b in dc.benchmarks:
            for p in expand(b):
                digests: dict = {}
                for rec in read_file(p, digests=digests, limits=self.intake.limits):  # a huge or deep benchmark record is skipped
                    if not isinstance(rec, Rejected):
                        for s in _strings_of(rec.data):
                            cont.add(words.ids(s)[1], f"benchmark {p}:{rec.line}")
                k = next(bench)
                expected = [{"path": str(p), "sha256": parts["benchmarks"][k]}]
                check_read(expected, digests, self.intake.changed)
                parts["benchmarks"][k] = expected[0]["sha256"]

    def _drop_contaminated(self, cont: Decontaminator) -> list[dict]:
        """Drop the training records that overlap a reference n-gram (not a boilerplate one); returns the drops."""
        words, meta, assign = self.intake.words, self.intake.meta, self.assign
        drops: list[dict] = []
        every = assign["train"] + assign["eval"] + assign["test"]
        for k in range(0, len(every), CHUNK):  # how many records each reference n-gram occurs in
            cont.count([words.ids("\n".join(formats.strings(self.load(i))))[1] for i in every[k : k + CHUNK]])
        keep = []
        for k in range(0, len(assign["train"]), CHUNK):
            part = assign["train"][k : k + CHUNK]
            ws = [words.ids("\n".join(formats.strings(self.load(i)))) for i in part]
            for i, hit in zip(part, cont.check([w for w, _ in ws], [a for _, a in ws])):
                if hit is None:
                    keep.append(i)
                    continue
                self.dropped["decontaminated"] += 1
                self.intake.filtered.append({"source": str(meta[i][4]), "line": meta[i][2], "unit": "line", "kind": "decontaminated",
                                             "stage": "decontamination", "reason": DROP_RULES["decontaminated"]})
                drops.append({"record": f"{meta[i][4]}:{meta[i][2]}", "ngram": hit[0], "matched": hit[1], "overlap": hit[2]})
        self.stages.mark("decontamination", len(assign["train"]) - len(keep), len(keep))
        assign["train"] = keep
        return drops

    # 4. tokenize (chunks, optionally in worker processes), repeat weighted sources, write the splits
    def tokenize(self, progress, on_total) -> None:
        total = sum(len(v) for v in self.assign.values())
        if on_total:
            on_total(total)
        num_proc = self.cfg.num_proc or ((os.cpu_count() or 1) if total >= 20_000 else 1)
        workers = pool(num_proc, self.tokenizer, self.tpl, self.opts) if num_proc > 1 else None
        try:
            for name in ("train", "eval", "test"):
                self._tokenize_split(name, workers, progress)
        finally:
            if workers is not None:
                workers.close()
                workers.join()

    def _tokenize_split(self, name: str, workers, progress) -> None:
        idx = self.assign[name]
        st = {"records": 0, "rows": 0, "tokens": 0, "loss_tokens": 0}
        chunks = [idx[k : k + CHUNK] for k in range(0, len(idx), CHUNK)]
        jobs = ((self.load_many(c), name == "eval") for c in chunks)
        results = workers.imap(work, jobs) if workers is not None else pipelined(self.tokenizer, self.tpl, self.opts, jobs)
        out = f"{name}.arrow.tmp" if (name == "train" and self.cfg.packing == "pack") else f"{name}.arrow"
        if self.cfg.pretrain_blocks == "stream" and any(self.intake.meta[i][5] for i in idx):
            self.streams[name] = BlockStream(self.cfg.max_length)
        for c, encs in zip(chunks, results):
            rows: list[dict] = []
            for i, enc in zip(c, encs):
                rows = self._rows(name, i, enc, st, rows, out)
            self.writer.write_rows(out, rows)
            if progress:
                progress(len(c))
        stream = self.streams.get(name)
        if stream is not None:  # the split's last, short block
            self.writer.write_rows(out, self._emit(name, stream.flush(), 1, st, [], out))
        self.split_stats[name] = st
        if name == "train":
            self.stages.mark("tokenize", len(idx) - st["records"], st["records"])
        if name == "eval" and st["records"] < self.eval_asked:  # an eval source's records failed the length rules
            _check_eval_size(self.cfg, self.eval_asked, st["records"], Counter(self.dropped), Counter(), "of the `role: eval` source")

    def _rows(self, name: str, i: int, enc, st: dict, rows: list[dict], out: str) -> list[dict]:
        """Add record ``i``'s encoded rows (its blocks, times its copies) to ``rows`` and ``st``; full chunks are streamed
        out to ``out``. Returns the rows not yet written."""
        if enc.row is None:
            self.dropped[enc.reason] += 1
            m = self.intake.meta[i]
            self.intake.filtered.append({"source": str(m[4]), "line": m[2], "unit": "line", "kind": enc.reason, "stage": "length",
                                         "split": name, "reason": DROP_RULES.get(enc.reason, enc.reason)})
            return rows
        self.truncated += enc.truncated
        self.cut[0] += enc.cut[0]
        self.cut[1] += enc.cut[1]
        st["records"] += 1
        copies = 1
        w = self.cfg.sources[self.intake.meta[i][0]].weight
        if name == "train" and w is not None and w > 1:
            copies = int(w) + (1 if self.repeat_rng.random() < w - int(w) else 0)
            self.repeated += copies - 1
        if enc.generation is not None:
            self.gens.append(enc.generation)
        if enc.doc:  # a raw-text document joins the split's stream (`pretrain_blocks: stream`), once per copy
            stream = self.streams[name]
            return self._emit(name, [b for _ in range(copies) for b in stream.add(enc.row)], 1, st, rows, out)
        if enc.more:  # a raw-text document longer than max_length, cut into blocks
            self.chunked += 1
            self.blocks += 1 + len(enc.more)
        return self._emit(name, [enc.row, *enc.more], copies, st, rows, out)

    def _emit(self, name: str, blocks: list[dict], copies: int, st: dict, rows: list[dict], out: str) -> list[dict]:
        """Add ``blocks`` (``copies`` times each) to ``rows`` and ``st``, streaming full chunks out to ``out``."""
        for block in blocks:
            n_tok, n_loss = row_tokens(block), row_loss_tokens(block)
            if "mm" in block:  # a vision-language row (data/vision_chat.py): its images and the tokens they take
                st["images"] = st.get("images", 0) + block["n_images"] * copies
                st["image_tokens"] = st.get("image_tokens", 0) + block["image_tokens"] * copies
            if name in self.streams and "input_ids" in block and "position_ids" not in block:  # one schema for the split
                block = {**block, "position_ids": list(range(n_tok))}
            flat = name == "train" and self.cfg.packing == "padding_free" and ("mm" not in block or self.flat_vision)  # plan/attention.py
            row = {**block, "padding_free": 1} if flat else block
            for _ in range(copies):
                rows.append(row)
                if name == "train":
                    self.train_lengths.append(n_tok)
                if len(rows) >= CHUNK:  # repeated copies are streamed out, never all held at once
                    self.writer.write_rows(out, rows)
                    rows = []
            st["rows"] += copies
            st["tokens"] += n_tok * copies
            st["loss_tokens"] += n_loss * copies
        return rows

    # 5. batching layout for the training split
    def batching(self, batch_size_hint: int) -> float:
        cfg, train = self.cfg, self.split_stats["train"]
        if cfg.packing == "pack" and "images" in train:
            raise DataError("`data.packing: pack` joins examples into rows of `data.max_length`, which would cut through an image's "
                            "tokens; a vision-language model's rows are padded instead: set `data.packing: none` (or `auto`).")
        if cfg.packing == "pack":
            train["packed_rows"] = _pack_split(self.writer, cfg.max_length)
            return train["tokens"] / max(1, train["packed_rows"] * cfg.max_length)
        if cfg.packing == "padding_free" and ("images" not in train or self.flat_vision):
            return 1.0
        return non_pad_share(self.train_lengths, mode="dynamic", max_length=cfg.max_length, batch_size=batch_size_hint, seed=self.seed)

    # 6. the report
    def _vision_padded(self) -> bool:
        """Rows with images under `padding_free` (a config the planner did not resolve): padded all the same, said so."""
        return self.cfg.packing == "padding_free" and "images" in self.split_stats["train"] and not self.flat_vision

    def report(self, share: float, batch_size_hint: int) -> dict:
        cfg, intake, dropped, split_stats = self.cfg, self.intake, self.dropped, self.split_stats
        rejects, scrub = intake.rejects, intake.scrub
        kept = sum(split_stats[s]["records"] for s in split_stats)
        records_read = intake.n_read
        all_dropped = {**{k: v for k, v in rejects.counts.items()}, **{k: v for k, v in dropped.items() if v}}
        invariant = records_read == kept + sum(all_dropped.values())
        if not invariant:  # a bug, never a user error: fail loudly rather than report wrong numbers
            raise RuntimeError(f"data accounting broken: read {records_read} != kept {kept} + dropped {sum(all_dropped.values())} ({all_dropped})")
        return {
            "records_read": records_read,
            "records_kept": kept,
            "dropped": dict(sorted(all_dropped.items())),
            "pii": dict(sorted(scrub.counts.items())) if scrub is not None else {},
            "splits": {k: v for k, v in split_stats.items() if v["records"] or k != "test"},
            "held_out": self._held_out(),
            "invariant": {"rule": "records_read == records_kept + sum(dropped)", "holds": invariant},
            "sources": intake.sources_info,
            "rejected": dict(rejects.counts),
            "rejected_total": sum(rejects.counts.values()),
            "duplicates": {"exact": dropped.get("exact_duplicate", 0), "near": dropped.get("near_duplicate", 0), "file": "duplicates.jsonl"},
            "decontaminated": dropped.get("decontaminated", 0),
            "decontamination": self.decon_report,
            "pii_audit": scrub.audit_report() if scrub is not None else None,
            "length": self._length(),
            "batching": {"mode": "padded (vision-language rows)" if self._vision_padded() else cfg.packing, "non_pad_share": round(share, 4),
                         "basis": {"pack": "tokens / (packed rows x max_length)", "padding_free": "no padding at all",
                                   "none": f"dynamic padding, batches of {batch_size_hint} in seeded random order"}.get(
                                       "none" if self._vision_padded() else cfg.packing, f"dynamic padding (`{cfg.packing}` not resolved by a plan), batches of {batch_size_hint}"),
                         "padded_to_max_length_share": round(non_pad_share(self.train_lengths, mode="max_length", max_length=cfg.max_length), 4)},
            "repeated": self.repeated,
            "changed_while_read": intake.changed,  # prepared from what was read, cached under its hash
            "seed": self.seed,
            "train_on": self.train_on,
            # names of the first data report, kept for readers of it
            "records": kept,
            "train_examples": split_stats["train"]["records"],
            "eval_examples": split_stats["eval"]["records"],
            "train_tokens": split_stats["train"]["tokens"],
            "train_loss_tokens": split_stats["train"]["loss_tokens"],
        }

    def _held_out(self) -> dict:
        split_stats = self.split_stats
        return {"eval_asked": self.eval_asked, "eval_records": split_stats["eval"]["records"],
                "test_asked": self.split_info["test_asked"] if not self.has_test_src else split_stats["test"]["records"],
                "test_records": split_stats["test"]["records"], "min_eval_records": _min_eval(self.cfg, self.eval_asked),
                "drawn_from": "records that passed cleaning, dedup and the length rules (seeded order)",
                "candidates_failed_length_rules": dict(self.held_out_dropped)}

    def _length(self) -> dict:
        cfg, dropped = self.cfg, self.dropped
        lengths = sorted(self.train_lengths)

        def pct(p: float) -> int:
            return lengths[min(len(lengths) - 1, int(round(p * (len(lengths) - 1))))] if lengths else 0

        return {"p50": pct(0.5), "p95": pct(0.95), "max": lengths[-1] if lengths else 0, "max_length": cfg.max_length,
                "dropped_too_long": dropped.get("too_long", 0) + dropped.get("too_long_chars", 0) + dropped.get("too_long_prompt", 0),
                "truncated_tokens": {"prompt": self.cut[0], "replies": self.cut[1],
                                     "prompt_mean": round(self.cut[0] / self.truncated, 1) if self.truncated else 0.0},
                "dropped_before_tokenizing": dropped.get("too_long_chars", 0), "cut_before_tokenizing": self.intake.cut_early,
                "max_chars": self.intake.chars, "max_record_bytes": self.intake.limits.max_record_bytes, "truncated": self.truncated,
                "policy": cfg.truncation, "chunked_documents": self.chunked, "chunk_blocks": self.blocks,
                "pretrain_blocks": cfg.pretrain_blocks, "stream": {k: v.report() for k, v in self.streams.items()}}

    def write(self, report: dict) -> None:
        """The entry's report, eval generations, rejected records and duplicates; the spill file is removed."""
        writer = self.writer
        os.remove(self.intake.spill_path)
        writer.write_json("report.json", report)
        writer.write_json("eval_generation.json", self.gens)
        with open(writer.path("rejected.jsonl"), "w", encoding="utf-8") as out:
            for r in self.intake.rejects.items:
                out.write(json.dumps(r, default=str) + "\n")
            for r in self.intake.filtered:  # every filter's drops too, each with its file, line and rule
                out.write(json.dumps(r, default=str) + "\n")
        with open(writer.path("duplicates.jsonl"), "w", encoding="utf-8") as out:
            for d in self.intake.duplicates:
                out.write(json.dumps(d) + "\n")


def _pack_split(writer, max_length: int) -> int:
    """Pack the tokenized training rows (written to ``train.arrow.tmp``) into ``train.arrow``; returns the row count.
    Only the lengths are held in memory; rows are taken from the memory-mapped table bin by bin."""
    import pyarrow as pa
    import pyarrow.compute as pc

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
