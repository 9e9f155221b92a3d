"""Step 1 of a build (data/build.py): read every source, format, sample, clean, filter and deduplicate its records.

Every record read is either rejected (:class:`Rejects`, with its reason), dropped with a counted reason
(``Intake.dropped``) or kept: a kept example is spilled as one MessagePack record (:func:`spill_bytes`; JSON where
MessagePack cannot hold it) to a file in the cache build folder, and
memory holds only its byte offset and a little metadata (``Intake.meta``), the dedup hashes and the LSH index.
:class:`Stages` names the stage that emptied the dataset, when one does.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import msgpack

from trainpipe.config import DataConfig
from trainpipe.data import clean, formats, vision_chat
from trainpipe.data.dedup import NearDedup, Words, exact_key
from trainpipe.data import pii
from trainpipe.data.sources import Limits, Rejected, default_record_bytes, describe, excerpt, iter_source
from trainpipe.data.lengths import bound_example, max_chars
from trainpipe.errors import DataError

DEDUP_BLOCK = 1024  # records whose dedup inputs are computed together (Intake.flush); the decisions stay one by one, in order
REJECT_KINDS = ("invalid_json", "not_an_object", "duplicate_key", "ragged_row", "format_mismatch", "role_order", "too_deep", "too_big",
                "bad_image", "image_outside_data")
# dropped and counted whatever `on_error` says: a size policy (like `too_long`), and an image that is missing or cannot be
# decoded (data/vision_chat.py: the record is dropped with its file and record number, never a crash mid-epoch)
SIZE_KINDS = ("too_big", "bad_image")


# what each drop rule means, as rejected.jsonl states it beside the record's file and line
DROP_RULES = {
    "too_long_chars": "far over max_length in characters (`data.max_length`, `data.truncation`)",
    "identical_pair": "chosen and rejected are the same: nothing to prefer",
    "empty_response": "a response is empty (`data.filters.empty_response`)",
    "bad_encoding": "control characters or mojibake (`data.filters.bad_encoding`)",
    "repetitive": "a trained response repeats itself over `data.filters.max_repetition` of its word 3-grams",
    "exact_duplicate": "the same text as an earlier record (`data.dedup.exact`; the match is in duplicates.jsonl)",
    "near_duplicate": "nearly the same text as an earlier record (`data.dedup.near`; the match is in duplicates.jsonl)",
    "decontaminated": "shares an n-gram with an eval/test response or a benchmark item (`data.decontamination`)",
    "too_long": "over `data.max_length` tokens (`data.truncation`)",
    "too_long_prompt": "the prompt's budget cannot hold the answer's header: truncating would break the turn",
    "too_short": "fewer loss tokens than `data.filters.min_tokens`",
    "no_loss_tokens": "no token carries loss",
    "too_long_response": "more response tokens than `data.filters.max_tokens`",
}


def _at(at: str) -> tuple[str, int]:
    src, _, line = at.rpartition(":")
    return src, int(line) if line.isdigit() else 0


def _taught(ex: dict) -> list[str]:
    """The responses the repetition filter judges: the ones the model is taught to produce. A KTO example labelled
    undesirable (`label: false`) and a pair's rejected reply are there to teach what NOT to say: a repetitive one is what
    they are for, so they are never dropped for it."""
    if ex["kind"] == "preference":
        return [formats.said(m) for m in ex["chosen"] if m["role"] == "assistant"]
    if ex["kind"] == "kto" and not ex.get("label", True):
        return []
    return formats.responses(ex)


def where(unit: str, line: int) -> str:
    return "(the whole file)" if unit == "file" else f"{unit} {line}"


class Rejects:
    def __init__(self, on_error: str):
        self.on_error = on_error
        self.items: list[dict] = []
        self.counts: Counter = Counter()

    def add(self, r: Rejected) -> None:
        if self.on_error == "raise" and r.kind not in SIZE_KINDS:
            raise DataError(
                f"`{r.source}` {where(r.unit, r.line)}: {r.reason}. It reads: `{r.excerpt}`. Fix it, or set "
                "`data.on_error: skip` to drop such records (each is counted and written with its reason to rejected.jsonl)."
            )
        self.counts[r.kind] += 1
        self.items.append(r.to_dict())


class Stages:
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


def check_read(expected: list[dict], digests: dict, changed: list[str]) -> None:
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


class Intake:
    """Reads ``cfg.sources`` into the spill file ``spill_path``; ``prints`` are the sources' fingerprints taken for the
    cache lookup (a file's hash is replaced by the hash of the bytes read, see :func:`check_read`)."""

    def __init__(self, cfg: DataConfig, prints: list[dict], spill_path: Path, *, seed: int):
        self.cfg, self.prints, self.spill_path, self.seed = cfg, prints, spill_path, seed
        self.dropped: Counter = Counter()
        self.rejects = Rejects(cfg.on_error)
        self.scrub = clean.Scrubber(cfg.pii.types, cfg.pii.presidio) if cfg.pii.enabled else None
        self.scrub_record = pii.RecordScrubber(self.scrub, cfg.pii.replace) if self.scrub is not None else None  # data/pii.py
        self.words = Words()
        dd = cfg.dedup
        self.near = NearDedup(dd.threshold, dd.shingle_size, dd.num_perm) if dd.near else None
        self.seen: dict[bytes, int] | None = {}
        self.duplicates: list[dict] = []
        self.filtered: list[dict] = []  # every record a filter, dedup, length or decontamination rule dropped: rejected.jsonl
        self._pending: list[tuple] = []  # records past the filters waiting for their block's dedup (:meth:`flush`)
        self.changed: list[str] = []  # files whose content changed between the cache lookup and the read
        self.limits = Limits(cfg.max_record_bytes or default_record_bytes(cfg.max_length))
        self.chars = max_chars(cfg.max_length)
        self.cut_early = 0  # examples cut to `chars` characters before tokenizing (truncation: truncate)
        self.offsets: list[int] = []
        self.meta: list[tuple] = []  # (source index, role, line, stratum, source, raw text for the block stream)
        self.sources_info: list[dict] = []
        self.n_read = 0

    def read_all(self, stages: Stages) -> None:
        """Every source in turn; then the read stages are marked (the stage that emptied the dataset is an error)."""
        self._spill_at = self.spill_end = 0
        with open(self.spill_path, "wb") as self._spill:
            for si, src in enumerate(self.cfg.sources):
                self.sources_info.append(self._read_source(si, src))
        self.near = self.seen = None  # the dedup indexes (the near-dedup LSH is most of the read stage's memory) are done with
        self._mark_read_stages(stages)

    def _read_source(self, si: int, src) -> dict:
        """One source: its records formatted, sampled (`max_records`, `weight` < 1) and kept; returns its report entry."""
        fmt = None if src.format == "auto" else src.format
        why = "set in the config" if fmt else None
        s_read = s_kept = 0
        rng = random.Random(f"{self.seed}:{si}")
        reservoir: list | None = [] if src.max_records else None
        digests: dict = {}
        for item in iter_source(src, digests, self.limits):
            self.n_read += 1
            s_read += 1
            if isinstance(item, Rejected):
                self.rejects.add(item)
                continue
            data = formats.apply_columns(item.data, src.columns)
            ex, fmt, why = self._example(item, data, src, fmt, why)
            if ex is None:
                continue
            ex, cut = bound_example(ex, self.chars, self.cfg.truncation)
            if ex is None:  # far over max_length: never cleaned, deduplicated, rendered or tokenized
                self.drop("too_long_chars", item.source, item.line, "length")
                continue
            self.cut_early += cut
            if reservoir is not None:  # max_records: seeded reservoir sample, original order kept
                if len(reservoir) < src.max_records:
                    reservoir.append((item, ex))
                else:
                    j = rng.randrange(s_read)
                    if j < src.max_records:
                        reservoir[j] = (item, ex)
                    self.dropped["max_records"] += 1
                continue
            if src.weight is not None and src.weight < 1 and rng.random() >= src.weight:
                self.dropped["subsampled"] += 1
                continue
            s_kept += self.keep(item, ex, data, si, src)
        s_kept += self.flush()
        if reservoir is not None:
            reservoir.sort(key=lambda p: p[0].line)
            for item, ex in reservoir:
                s_kept += self.keep(item, ex, formats.apply_columns(item.data, src.columns), si, src)
            s_kept += self.flush()
        return self._source_info(si, src, fmt, why, s_read, s_kept, digests)

    def _example(self, item, data: dict, src, fmt: str | None, why: str | None):
        """(the record as an example, or None when it is rejected; the source's format and why, told from the first record)."""
        try:
            if fmt is None:
                fmt, why = formats.detect(data)
                why = f"detected from {where(item.unit, item.line)}: {why}"
            if not vision_chat.has_images(data):
                return formats.to_example(data, fmt, self.cfg.system_prompt), fmt, why
            lifted, refs = vision_chat.lift(data)  # image content parts -> `<image>` placeholders; decoded and checked here
            ex = formats.to_example(lifted, fmt, self.cfg.system_prompt)
            return vision_chat.attach(ex, refs, item.source if item.unit != "item" else None), fmt, why
        except formats.FormatError as exc:
            reason = f"{exc} (format {fmt})" if fmt else str(exc)
            if src.format == "auto" and fmt and exc.kind == "format_mismatch":
                try:
                    other = formats.detect(data)[0]
                except formats.FormatError:
                    other = None
                if other and other != fmt:
                    reason += f"; the record looks like {other}, but this source was {why} (one format per source: split the file, or set `format:`)"
            self.rejects.add(Rejected(item.source, item.line, reason, excerpt(json.dumps(item.data, default=str)), item.unit, exc.kind))
            return None, fmt, why

    def _source_info(self, si: int, src, fmt, why, s_read: int, s_kept: int, digests: dict) -> dict:
        info = {"source": describe(src), "path": describe(src), "role": src.role, "format": fmt, "format_chosen_by": why,
                "records_read": s_read, "records_after_cleaning": s_kept}
        if self.prints[si]["kind"] == "files":
            files = self.prints[si]["files"]
            check_read(files, digests, self.changed)
            info["files"] = files
            info["sha256"] = files[0]["sha256"] if len(files) == 1 else hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        else:  # hub id / SQL query: identified by what names it, not by content
            info["sha256"] = hashlib.sha256(json.dumps(self.prints[si], sort_keys=True).encode()).hexdigest()
        return info

    def _mark_read_stages(self, stages: Stages) -> None:
        dropped = self.dropped
        remaining = self.n_read
        stages.mark("read", 0, remaining) if self.n_read == 0 else None
        for stage, removed in (
            ("format", sum(self.rejects.counts.values())),
            ("sample", dropped["subsampled"] + dropped["max_records"]),
            ("filters", dropped["too_long_chars"] + dropped["identical_pair"] + dropped["empty_response"] + dropped["bad_encoding"] + dropped["repetitive"]),
            ("dedup", dropped["exact_duplicate"] + dropped["near_duplicate"]),
        ):
            remaining -= removed
            stages.mark(stage, removed, remaining)
        assert remaining == len(self.offsets), (remaining, len(self.offsets))

    def keep(self, item, ex, data, si, src) -> int:
        """Clean and filter one example; one that passes waits for its block's dedup (:meth:`flush`, in record order), or is
        spilled at once when dedup is off. Returns how many records this call kept (a flush keeps a block's worth)."""
        cfg = self.cfg
        f = cfg.filters
        if self.scrub_record is not None:  # one value, one replacement, in every text of the record (data/pii.py)
            ex = self.scrub_record(ex, f"{item.source}:{item.line}")
        at = (item.source, item.line)
        if ex["kind"] == "preference" and _texts(ex["chosen"]) == _texts(ex["rejected"]):
            return self.drop("identical_pair", *at)  # nothing to prefer: the loss is flat at log 2 whatever the model does
        resp = formats.responses(ex)
        if f.empty_response and (not resp or any(not r.strip() for r in resp)):
            return self.drop("empty_response", *at)
        if f.bad_encoding and clean.encoding_problem(formats.strings(ex)):
            return self.drop("bad_encoding", *at)
        if f.max_repetition is not None and any(clean.repetition(r) > f.max_repetition for r in _taught(ex)):
            return self.drop("repetitive", *at)
        if cfg.dedup.exact or self.near is not None:
            self._pending.append((item, ex, data, si, src, len(self.filtered)))
            self.filtered.append(None)  # its place in rejected.jsonl, should dedup drop it
            return self.flush() if len(self._pending) >= DEDUP_BLOCK else 0
        return self._spill_one(item, ex, data, si, src)

    def flush(self) -> int:
        """Dedup the waiting records, in record order, and spill those kept: their word ids and near-dedup signatures are
        computed for the whole block first (NearDedup.signatures), then each is checked against the records kept before
        it, as one at a time would be. Returns how many were kept."""
        pending, self._pending = self._pending, []
        if not pending:
            return 0
        words = [self.words.ids("\n".join(formats.strings(p[1]))) for p in pending]
        raw = self.near.signatures([ids for _, ids in words]) if self.near is not None else None
        sigs = self.near.prepare(raw) if raw is not None else None
        kept = 0
        for j, (item, ex, data, si, src, hole) in enumerate(pending):
            if sigs is not None and sigs[j][3] != self.near._merges:  # the index merged its band dict: look the rest up again
                sigs[j:] = self.near.prepare(raw[j:])
            if not self._duplicate(ex, f"{item.source}:{item.line}", words[j], None if sigs is None else sigs[j], hole):
                kept += self._spill_one(item, ex, data, si, src)
        start = pending[0][5]
        self.filtered[start:] = [x for x in self.filtered[start:] if x is not None]  # the places of the records kept
        return kept

    def _spill_one(self, item, ex, data, si, src) -> int:
        cfg = self.cfg
        line = spill_bytes(ex)
        self.offsets.append(self._spill_at)
        self._spill.write(line)
        self._spill_at += len(line)  # the file's position, kept here (tell() asks the OS each time)
        self.spill_end = self._spill_at
        stratum = data.get(cfg.stratify_by) if cfg.stratify_by else None
        self.meta.append((si, src.role, item.line, stratum, item.source, ex["kind"] == "text" and "label" not in ex))
        return 1

    def drop(self, rule: str, source: str, line: int, stage: str = "filters", place: int | None = None) -> int:
        """Count a dropped record under ``rule`` and list it (file, line, rule, stage) for rejected.jsonl (at ``place`` when
        one was kept for it); returns 0 (kept none)."""
        self.dropped[rule] += 1
        entry = {"source": str(source), "line": line, "unit": "line", "kind": rule, "stage": stage, "reason": DROP_RULES.get(rule, rule)}
        if place is None:
            self.filtered.append(entry)
        else:
            self.filtered[place] = entry
        return 0

    def _duplicate(self, ex: dict, at: str, words: tuple, sig, place: int) -> bool:
        """Exact, then near dedup against the examples kept so far (the first of a group is kept); a duplicate is
        counted and listed in duplicates.jsonl with the record it matched. ``words``: (words, ids) of the record's text,
        ``sig``: its near-dedup inputs (NearDedup.prepare); ``place``: its place in rejected.jsonl."""
        cfg, near, seen = self.cfg, self.near, self.seen
        gid = len(self.offsets)
        ws, ids = words
        if cfg.dedup.exact:
            k = exact_key(ws)
            first = seen.get(k)
            if first is not None:
                self.drop("exact_duplicate", *_at(at), "dedup", place)
                self.duplicates.append({"record": at, "matched": self._loc(first), "kind": "exact", "similarity": 1.0})
                return True
            seen[k] = gid
        if near is not None and not ex.get("image_sha256"):  # images: same text about different pictures is no duplicate
            hit = near.check_and_add(gid, ids, sig)
            if hit is not None:
                self.drop("near_duplicate", *_at(at), "dedup", place)
                self.duplicates.append({"record": at, "matched": self._loc(hit[0]), "kind": "near", "similarity": round(hit[1], 3)})
                if cfg.dedup.exact:
                    del seen[k]
                return True
        return False

    def _loc(self, gid: int) -> str:
        m = self.meta[gid]
        return f"{m[4]}:{m[2]}"


_PACK = msgpack.Packer(use_bin_type=True).pack
_JSON = b"\x00"  # marks a record spilled as JSON: a packed example (a map) never starts with this byte


def spill_bytes(ex: dict) -> bytes:
    """One example as spilled: MessagePack (exact for what JSON holds, and several times faster to write and read back), or
    JSON behind ``_JSON`` for what MessagePack cannot hold (an integer beyond 64 bits); JSON's own error for anything else."""
    try:
        return _PACK(ex)
    except (OverflowError, TypeError, ValueError):
        return _JSON + json.dumps(ex, ensure_ascii=False).encode()


def unspill(raw: bytes) -> dict:
    """The example :func:`spill_bytes` wrote."""
    return json.loads(raw[1:]) if raw[:1] == _JSON else msgpack.unpackb(raw, raw=False)


def _texts(turns: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], formats.said(m).strip()) for m in turns]  # tool calls and reasoning too: two calls differ
