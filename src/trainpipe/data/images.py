"""Image-classification data: every file read, decoded once at prepare time, accounted for, split and checked for leakage.

Sources (`data.sources[].path`):

- an **image folder**: one sub-folder per class (`root/cat/001.png`); the sub-folder's name is the label. A file directly
  in the root, outside every class folder, is counted as `outside_class_folder`; hidden files (`.DS_Store`) as `hidden`.
- a **table** (CSV/TSV, JSONL/JSON, Parquet) with an `image` column (a path relative to the table's folder, the image's
  bytes, or a `{bytes, path}` struct as `datasets` writes it) and a label column (`data.label`, default `label`); other
  names through `data.sources[].columns: {image: COLUMN}`.
- a **`datasets` folder** written by `save_to_disk` whose image column is an `Image` feature (read undecoded, then
  checked here like any other file) and whose label is a `ClassLabel` (its names become the classes) or a plain value.

Every image is decoded in full here, never later: a file that is not an image, is truncated or corrupt, is larger than
:data:`MAX_IMAGE_BYTES` or has more pixels than :data:`MAX_PIXELS` (a decompression bomb: the size is read from the header
before anything is decoded) is *named* with its reason. Under `data.on_error: raise` (the default) one paragraph lists them
and the run stops (exit 2); under `skip` they are dropped and counted with their names in the data report. Exact duplicates
(the same bytes, by SHA-256) are dropped after the first; an image in both the training pool and an eval/test source is
leakage: it is removed from training and named. The split is stratified by class; a class too small to hold out is named
and kept in training only (never merged into another).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainpipe.data.files import sha256_path
from trainpipe.data.sources import read_file
from trainpipe.data.records import Record
from trainpipe.errors import DataError

MAX_IMAGE_BYTES = 64 << 20  # one encoded image file; far above any photo a classifier trains on
MAX_PIXELS = 89_478_485  # PIL's own default Image.MAX_IMAGE_PIXELS (a 0.25 GB RGB bitmap); checked from the header first
NAMES_KEPT = 200  # dropped files named in the report per reason (the counts are always complete)
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


@dataclass
class ImageData:
    """The prepared splits (lists of example dicts: `image` bytes, `label`, `name`, `sha256`, `index`), the class list
    (sorted) and the data report."""

    train: list[dict]
    eval: list[dict]
    test: list[dict]
    labels: list[str]
    report: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ one image


def check_image(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[tuple[int, int] | None, str, str]:
    """((width, height) or None, the counted kind, the reason): decodes ``data`` in full, refusing a bomb before decoding."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError("the image family decodes images with Pillow, which is not installed: `pip install 'trainpipe[images]'`.") from None

    if len(data) > MAX_IMAGE_BYTES:
        return None, "too_large", f"{len(data):,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit for one image"
    if not data:
        return None, "not_image", "the file is empty (0 bytes)"
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
                if w * h > max_pixels:
                    return None, "too_large", (f"{w}x{h} = {w * h:,} pixels, over the {max_pixels:,}-pixel limit (a decompression bomb "
                                               "is refused before it is decoded); resize the image")
                im.load()  # the whole image: a truncated or corrupt file fails here, at prepare time, not mid-epoch
                im.convert("RGB")
        except UnidentifiedImageError:
            return None, "not_image", "not an image format Pillow can read"
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            return None, "too_large", f"over the {max_pixels:,}-pixel limit: a decompression bomb is refused before it is decoded ({exc})"
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            return None, "corrupt", f"truncated or corrupt ({type(exc).__name__}: {exc})"
    return (w, h), "", ""


def decode_rgb(data: bytes):
    """The RGB PIL image of bytes :func:`check_image` accepted."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


# ------------------------------------------------------------------------------ reading the sources


class _Reader:
    """Collects the examples of every source and every file it could not use, with its name and reason."""

    def __init__(self, label_col: str):
        self.label_col = label_col
        self.items: list[dict] = []  # name, data, label, role
        self.dropped: list[dict] = []  # name, kind, reason
        self.ignored: list[dict] = []  # hidden files: named, not errors
        self.sources: list[dict] = []
        self.seen = 0  # files and rows read (hidden files apart)

    def drop(self, name: str, kind: str, reason: str) -> None:
        self.dropped.append({"name": name, "kind": kind, "reason": reason})

    def add(self, name: str, read, label, role: str) -> None:
        """One record: ``read()`` gives its bytes (or None once it dropped the record with the reason)."""
        if label is None or (isinstance(label, str) and not label.strip()):
            self.drop(name, "no_label", f"the label (`{self.label_col}`) is empty")
            return
        data = read()
        if data is None:
            return
        self.items.append({"name": name, "data": data, "label": str(label), "role": role})

    def source(self, src, index: int) -> None:
        p = Path(src.path or "")
        if src.path is None or not p.exists():
            raise DataError(f"`data.sources[{index}].path` `{src.path}` does not exist. The image family reads an image folder (one "
                            "sub-folder per class), a CSV/JSONL/Parquet table of `image` + label, or a `datasets` folder from save_to_disk.")
        before = self.seen
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            self._arrow(p, src, index)
        elif p.is_dir():
            self._folder(p, src.role)
        elif p.suffix.lower() in TABLE_SUFFIXES:
            self._table(p, src, index)
        else:
            raise DataError(f"`data.sources[{index}].path` `{p}` is a {p.suffix or 'suffix-less'} file; the image family reads an image "
                            "folder (one sub-folder per class), a .csv/.tsv/.jsonl/.json/.parquet table of `image` + label, or a "
                            "`datasets` save_to_disk folder.")
        self.sources.append({"path": str(p), "role": src.role, "records": self.seen - before, "sha256": sha256_path(p)})

    def _folder(self, root: Path, role: str) -> None:
        classes = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not classes:
            raise DataError(f"`{root}` has no sub-folders: an image folder holds one sub-folder per class (`{root}/cat/1.png`, "
                            f"`{root}/dog/2.png`), whose names become the labels.")
        for f in sorted(root.iterdir()):
            if f.is_file():
                self.seen += not f.name.startswith(".")
                (self.ignored if f.name.startswith(".") else self.dropped).append(
                    {"name": str(f), "kind": "hidden" if f.name.startswith(".") else "outside_class_folder",
                     "reason": "hidden file" if f.name.startswith(".") else "a file in the root, outside every class sub-folder"})
        for d in classes:
            for f in sorted(x for x in d.rglob("*") if x.is_file()):
                if any(part.startswith(".") for part in f.relative_to(d).parts):
                    self.ignored.append({"name": str(f), "kind": "hidden", "reason": "hidden file"})
                    continue
                self.seen += 1
                self.add(str(f), lambda f=f: _read_bounded(f, self), d.name, role)

    def _table(self, p: Path, src, index: int) -> None:
        img_col = src.columns.get("image", "image")
        label_col = src.columns.get("label", self.label_col)
        checked = False
        for rec in read_file(p):
            self.seen += 1
            if not isinstance(rec, Record):
                self.drop(f"{p} {rec.unit} {rec.line}", "unreadable_row", rec.reason)
                continue
            row = rec.data if isinstance(rec.data, dict) else {}
            if not checked:
                _check_columns(p, index, row, img_col, label_col)
                checked = True
            name = f"{p} {rec.unit} {rec.line}"
            self.add(name, lambda: self._value(row.get(img_col), p, name), row.get(label_col), src.role)

    def _value(self, v, table: Path, name: str) -> bytes | None:
        if isinstance(v, dict):  # datasets' Image struct: {bytes, path}
            v = v.get("bytes") or v.get("path")
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, str) and v.strip():
            root = table.parent.resolve()
            f = (root / v).resolve()
            if f != root and root not in f.parents:  # no `..`, absolute paths or symlinks out of the table's folder
                self.drop(f"{name} ({v})", "outside_data", f"`{v}` resolves to `{f}`, outside the table's folder `{root}`; images are "
                          "read only from the table's folder and below: move them there")
                return None
            if not f.is_file():
                self.drop(f"{name} ({v})", "missing_file", f"`{f}` does not exist (image paths are relative to the table's folder)")
                return None
            return _read_bounded(f, self, label=f"{name} ({v})")
        self.drop(name, "no_image", "the image cell is empty")
        return None

    def _arrow(self, p: Path, src, index: int) -> None:
        from datasets import DatasetDict, Image, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):
            if src.hub_split not in ds:
                raise DataError(f"`{p}` is a DatasetDict with splits {', '.join(ds)}; set `hub_split` on `data.sources[{index}]` to one of them.")
            ds = ds[src.hub_split]
        img_col = src.columns.get("image", "image")
        label_col = src.columns.get("label", self.label_col)
        _check_columns(p, index, dict.fromkeys(ds.column_names), img_col, label_col)
        if isinstance(ds.features[img_col], Image):
            ds = ds.cast_column(img_col, Image(decode=False))  # bytes as stored: checked here like every other file
        names = getattr(ds.features[label_col], "names", None)  # a ClassLabel: its names are the classes
        for i, row in enumerate(ds, 1):
            self.seen += 1
            label = row[label_col]
            if names is not None and isinstance(label, int) and 0 <= label < len(names):
                label = names[label]
            name = f"{p} row {i}"
            self.add(name, lambda: self._value(row[img_col], p, name), label, src.role)


def _check_columns(p: Path, index: int, row: dict, img_col: str, label_col: str) -> None:
    have = ", ".join(f"`{c}`" for c in row) or "none"
    for col, what, key in ((img_col, "image", "image"), (label_col, "label", "label")):
        if col not in row:
            fix = (f"set `data.label: COLUMN` to the column that holds the class" if what == "label"
                   else f"map it with `data.sources[{index}].columns: {{image: COLUMN}}`")
            raise DataError(f"`{p}` has no `{col}` column (the {what} of each row; columns found: {have}). Add it, or {fix}. "
                            "Nothing was trained.")


def _read_bounded(f: Path, reader: _Reader, label: str | None = None) -> bytes | None:
    size = f.stat().st_size
    if size > MAX_IMAGE_BYTES:
        reader.drop(label or str(f), "too_large", f"{size:,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit for one image")
        return None
    return f.read_bytes()


def image_source_sha256(src) -> str:
    """The SHA-256 of an image source as `manifest.json` `data_files` records it (run.py compares it before a resume)."""
    return sha256_path(Path(src.path))  # a file's own hash; a folder's over every file's relative path and bytes


def check_image_sources(sources) -> None:
    """Fail fast, before a run directory is written, when an image source names nothing."""
    for i, src in enumerate(sources):
        if src.path is None or not Path(src.path).exists():
            raise DataError(f"`data.sources[{i}].path` `{src.path}` does not exist. The image family reads an image folder (one "
                            "sub-folder per class), a CSV/JSONL/Parquet table of `image` + label, or a `datasets` folder from save_to_disk "
                            "(relative paths are resolved against the config file's folder).")


# ------------------------------------------------------------------------------ prepare


def prepare_images(data_cfg, *, seed: int) -> ImageData:
    """Read, decode-check, deduplicate, split (stratified by class) and leakage-check the image sources of ``data_cfg``."""
    label_col = data_cfg.label or "label"
    reader = _Reader(label_col)
    for i, src in enumerate(data_cfg.sources):
        if src.hub is not None or src.sql is not None:
            raise DataError(f"`data.sources[{i}]`: the image family reads local files (`path`): an image folder, a table of `image` + "
                            "label, or a `datasets` save_to_disk folder (save a hub dataset with `save_to_disk` first).")
        reader.source(src, i)
    for it in reader.items:  # decode every image now: nothing can fail mid-epoch
        size, kind, reason = check_image(it["data"])
        it["size"] = size
        if size is None:
            reader.drop(it["name"], kind, reason)
    bad = [d for d in reader.dropped if d["kind"] not in ("no_label",)]
    if bad and data_cfg.on_error == "raise":
        shown = "; ".join(f"`{d['name']}`: {d['reason']}" for d in bad[:5])
        raise DataError(f"{len(bad)} input file(s) cannot be used as training images ({shown}{'; ...' if len(bad) > 5 else ''}). Replace or "
                        "remove them, or set `data.on_error: skip` to drop them (each is then named with its reason in data_report.json). "
                        "Nothing was trained.")
    items = [it for it in reader.items if it.get("size")]
    pool, held, dup = _dedup(items, exact=data_cfg.dedup.exact)
    train, ev, te, small = _split(pool, held, data_cfg, seed)
    held_hash = {it["sha256"]: it["name"] for it in ev + te}
    leak = [{"name": it["name"], "same_as": held_hash[it["sha256"]]} for it in train if it["sha256"] in held_hash]
    train = [it for it in train if it["sha256"] not in held_hash]
    labels = sorted({it["label"] for it in train})
    if len(labels) < 2:
        raise DataError(f"the training split has {len(labels)} class(es) ({', '.join(labels) or 'none'}) after "
                        f"{len(reader.dropped)} file(s) were dropped; an image classifier needs at least two. Check the sources and "
                        "data_report.json.")
    unseen = sorted({it["label"] for it in ev + te} - set(labels))
    if unseen:
        raise DataError(f"the eval/test split has classes the training split never shows ({', '.join(unseen[:5])}); add training images for "
                        "them or remove them from the eval/test source.")
    splits = [[_example(it, i) for i, it in enumerate(part)] for part in (train, ev, te)]
    report = _report(reader, splits, labels, dup, leak, small, data_cfg)
    return ImageData(*splits, labels=labels, report=report)


def _dedup(items: list[dict], exact: bool = True) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """(training pool, {eval|test: items}, dropped duplicates): the first copy of each exact image is kept within a role
    (`data.dedup.exact: false`: every copy is kept; an image in both training and eval/test is still leakage)."""
    seen: dict[tuple[str, str], dict] = {}
    pool: list[dict] = []
    held: dict[str, list[dict]] = {"eval": [], "test": []}
    dup: list[dict] = []
    for it in items:
        it["sha256"] = hashlib.sha256(it["data"]).hexdigest()
        role = it["role"]
        first = seen.get((role, it["sha256"]))
        if first is not None and exact:
            note = "" if first["label"] == it["label"] else f" (labelled `{it['label']}` here, `{first['label']}` there: the first label is kept)"
            dup.append({"name": it["name"], "same_as": first["name"], "reason": "exact duplicate" + note})
            continue
        seen[(role, it["sha256"])] = it
        (pool if role == "train" else held[role]).append(it)
    return pool, held, dup


def _count(share: float, n: int) -> int:
    if share <= 0:
        return 0
    return int(share) if share >= 1 else max(1, round(n * share))


def _split(pool: list[dict], held: dict, data_cfg, seed: int):
    """(train, eval, test, classes too small to hold out): eval/test sources when given, else a seeded share of each class."""
    import random

    want = {"eval": 0 if held["eval"] else _count(data_cfg.eval_split, len(pool)),
            "test": 0 if held["test"] else _count(data_cfg.test_split, len(pool))}
    by_class: dict[str, list[dict]] = {}
    for it in pool:
        by_class.setdefault(it["label"], []).append(it)
    rng = random.Random(seed)
    small = []
    out = {"eval": list(held["eval"]), "test": list(held["test"])}
    classes = sorted(by_class)
    for part in ("eval", "test"):
        if not want[part]:
            continue
        n = sum(len(v) for v in by_class.values())
        quotas = {c: want[part] * len(by_class[c]) / max(n, 1) for c in classes}
        take = {c: int(q) for c, q in quotas.items()}
        for c in sorted(classes, key=lambda c: (-(quotas[c] - take[c]), c))[: max(0, want[part] - sum(take.values()))]:
            take[c] += 1
        for c in classes:
            members = by_class[c]
            rng.shuffle(members)
            k = min(take[c], len(members) - 1)  # at least one image of every class stays in training
            if k < take[c] or (take[c] == 0 and quotas[c] > 0):
                small.append({"class": c, "images": len(members), "split": part,
                              "reason": f"{len(members)} image(s): too few to hold out {max(take[c], 1)} for {part} and keep one for training; "
                                        f"it is trained on, not measured in {part}"})
            out[part] += members[:k]
            by_class[c] = members[k:]
    train = [it for c in classes for it in by_class[c]]
    rng.shuffle(train)
    return train, sorted(out["eval"], key=lambda x: x["name"]), sorted(out["test"], key=lambda x: x["name"]), small


def _example(it: dict, index: int) -> dict:
    return {"image": it["data"], "label": it["label"], "name": it["name"], "sha256": it["sha256"], "index": index,
            "width": it["size"][0], "height": it["size"][1]}


def _report(reader: _Reader, splits, labels: list[str], dup: list, leak: list, small: list, data_cfg) -> dict:
    kinds = Counter(d["kind"] for d in reader.dropped)
    named: dict[str, list] = {}
    for d in reader.dropped:
        lst = named.setdefault(d["kind"], [])
        if len(lst) < NAMES_KEPT:
            lst.append({"name": d["name"], "reason": d["reason"]})
    train, ev, te = splits
    return {
        "family": "image",
        "sources": reader.sources,
        "records_read": reader.seen,
        "hidden_files_ignored": len(reader.ignored),
        "images_usable": len(train) + len(ev) + len(te),
        "train_examples": len(train), "eval_examples": len(ev), "test_examples": len(te),
        "dropped": dict(sorted(kinds.items())) | ({"duplicate": len(dup)} if dup else {}) | ({"leakage": len(leak)} if leak else {}),
        "dropped_files": named,
        "ignored_files": [d["name"] for d in reader.ignored[:NAMES_KEPT]],
        "duplicates": {"exact": len(dup), "near": 0},  # exact: same bytes (SHA-256); near-duplicate images are not searched
        "duplicate_files": dup[:NAMES_KEPT],
        "leakage": leak[:NAMES_KEPT],
        "rejected_total": sum(kinds.values()),
        "classes": labels,
        "class_counts": {name: dict(sorted(Counter(x["label"] for x in part).items())) for name, part in (("train", train), ("eval", ev), ("test", te))},
        "small_classes": small,
        "split_rule": ("eval/test from the sources with `role: eval`/`test`" if any(s["role"] != "train" for s in reader.sources)
                       else f"stratified by class (seeded): eval {data_cfg.eval_split}, test {data_cfg.test_split}; every class keeps at least one training image"),
        "augment": bool(getattr(data_cfg, "augment", False)),
    }


def describe(report: dict) -> list[str]:
    """The data report in a few lines for the console: what was read, kept, dropped (by reason), the classes."""
    dropped = ", ".join(f"{k} {v}" for k, v in report["dropped"].items()) or "none"
    lines = [f"images: {report['records_read']} read, {report['images_usable']} usable (train {report['train_examples']}, eval "
             f"{report['eval_examples']}, test {report['test_examples']}); dropped: {dropped}"]
    counts = report["class_counts"]["train"]
    lines.append(f"classes ({len(counts)}), training images each: " + ", ".join(f"{c} {n}" for c, n in counts.items()))
    for s in report["small_classes"]:
        lines.append(f"class `{s['class']}`: {s['reason']}")
    named = [d for v in report["dropped_files"].values() for d in v][:5]
    lines += [f"dropped `{d['name']}`: {d['reason']}" for d in named]
    return lines
