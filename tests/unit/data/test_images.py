"""The image family's data step (data/images.py): every file accounted for with its name, exact duplicates and train/eval
leakage found by content hash, class counts and classes too small to hold out, bad input as one paragraph; and the
seeded train-only augmentation (data/image_transforms.py). Real PNG/JPEG files written with Pillow."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from trainpipe.config import DataConfig
from trainpipe.data.image_transforms import augment, crop_box, example_seed
from trainpipe.data.images import MAX_PIXELS, check_image, prepare_images
from trainpipe.errors import DataError


def png(value: int, size: int = 8) -> bytes:
    im = Image.new("RGB", (size, size), (value, 255 - value, (value * 7) % 256))
    im.putpixel((0, 0), (value % 251, 3, 5))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def folder(root, per_class: dict[str, int], start: int = 0):
    v = start
    for c, n in per_class.items():
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / c / f"{i}.png").write_bytes(png(v))
            v += 1
    return root


def cfg(*sources, **kw) -> DataConfig:
    return DataConfig(sources=list(sources), **kw)


def test_every_file_is_accounted_for_by_name(tmp_path):
    root = folder(tmp_path / "imgs", {"a": 6, "b": 6})
    (root / "a" / "notes.txt").write_text("not an image")
    noisy = Image.frombytes("RGB", (32, 32), bytes((i * 37) % 256 for i in range(32 * 32 * 3)))
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    (root / "b" / "cut.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])  # truncated mid-stream
    (root / "b" / "dup.png").write_bytes((root / "b" / "0.png").read_bytes())  # exact duplicate
    (root / "stray.png").write_bytes(png(99))  # outside every class folder
    (root / "a" / ".DS_Store").write_bytes(b"\0")
    d = prepare_images(cfg({"path": str(root)}, eval_split=2, on_error="skip"), seed=0)
    r = d.report
    names = {k: [x["name"] for x in v] for k, v in r["dropped_files"].items()}
    assert names["not_image"] == [str(root / "a" / "notes.txt")]
    assert names["corrupt"] == [str(root / "b" / "cut.png")]
    assert names["outside_class_folder"] == [str(root / "stray.png")]
    assert [x["name"] for x in r["duplicate_files"]] == [str(root / "b" / "dup.png")]
    assert r["duplicate_files"][0]["same_as"] == str(root / "b" / "0.png") and r["duplicates"] == {"exact": 1, "near": 0}
    assert r["ignored_files"] == [str(root / "a" / ".DS_Store")]
    # the accounting closes: every record read is usable or dropped with a counted reason
    assert r["records_read"] == 16 == r["images_usable"] + sum(r["dropped"].values())
    assert (len(d.train), len(d.eval)) == (10, 2) and d.labels == ["a", "b"]
    assert r["class_counts"]["eval"] == {"a": 1, "b": 1}  # stratified by class
    assert sum(r["class_counts"]["train"].values()) == 10
    json.dumps(r)  # the report is JSON
    kept = prepare_images(cfg({"path": str(root)}, eval_split=2, on_error="skip", dedup={"exact": False}), seed=0)
    assert kept.report["duplicates"]["exact"] == 0 and len(kept.train) + len(kept.eval) == 13


def test_bad_files_stop_the_run_by_default_naming_them(tmp_path):
    root = folder(tmp_path / "imgs", {"a": 3, "b": 3})
    (root / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    with pytest.raises(DataError) as e:
        prepare_images(cfg({"path": str(root)}, eval_split=1), seed=0)
    msg = str(e.value)
    assert "broken.jpg" in msg and "data.on_error: skip" in msg and "\n" not in msg


def test_leakage_between_train_and_eval_is_removed_from_training(tmp_path):
    train = folder(tmp_path / "train", {"a": 5, "b": 5})
    ev = folder(tmp_path / "eval", {"a": 2, "b": 2}, start=100)
    (ev / "a" / "leak.png").write_bytes((train / "a" / "3.png").read_bytes())
    d = prepare_images(cfg({"path": str(train)}, {"path": str(ev), "role": "eval"}), seed=0)
    assert d.report["leakage"] == [{"name": str(train / "a" / "3.png"), "same_as": str(ev / "a" / "leak.png")}]
    assert len(d.train) == 9 and len(d.eval) == 5
    assert not {x["sha256"] for x in d.train} & {x["sha256"] for x in d.eval}
    assert d.report["dropped"]["leakage"] == 1


def test_table_of_paths_and_bytes_and_missing_label_column(tmp_path):
    data = tmp_path / "data"
    folder(data / "img", {"x": 4, "y": 4})
    (tmp_path / "outside.png").write_bytes(png(77))
    rows = [{"image": f"img/{c}/{i}.png", "label": c} for c in "xy" for i in range(4)]
    rows += [{"image": "img/x/missing.png", "label": "x"}, {"image": "../outside.png", "label": "y"}, {"image": "img/x/0.png", "label": ""}]
    (data / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    d = prepare_images(cfg({"path": str(data / "t.jsonl")}, eval_split=2, on_error="skip"), seed=1)
    assert len(d.train) + len(d.eval) == 8
    assert d.report["dropped"] == {"missing_file": 1, "no_label": 1, "outside_data": 1}, d.report["dropped"]
    assert d.report["records_read"] == 11
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [png(i) for i in range(6)], "cls": ["p", "q"] * 3}), tmp_path / "t.parquet")
    d = prepare_images(cfg({"path": str(tmp_path / "t.parquet")}, eval_split=2, label="cls"), seed=1)
    assert d.labels == ["p", "q"] and len(d.train) == 4
    with pytest.raises(DataError) as e:
        prepare_images(cfg({"path": str(tmp_path / "t.parquet")}, eval_split=2), seed=1)
    assert "no `label` column" in str(e.value) and "`cls`" in str(e.value) and "data.label" in str(e.value)


def test_datasets_folder_with_classlabel(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Image as HFImage

    feats = Features({"image": HFImage(), "label": ClassLabel(names=["cat", "dog"])})
    ds = Dataset.from_dict({"image": [{"bytes": png(i), "path": None} for i in range(8)], "label": [0, 1] * 4}, features=feats)
    ds.save_to_disk(str(tmp_path / "ds"))
    d = prepare_images(cfg({"path": str(tmp_path / "ds")}, eval_split=2), seed=0)
    assert d.labels == ["cat", "dog"] and len(d.train) == 6


def test_class_too_small_to_hold_out_is_said_and_kept(tmp_path):
    root = folder(tmp_path / "imgs", {"big": 20, "tiny": 1})
    d = prepare_images(cfg({"path": str(root)}, eval_split=0.5), seed=0)
    assert [s["class"] for s in d.report["small_classes"]] == ["tiny"]
    assert d.report["class_counts"]["train"]["tiny"] == 1 and "tiny" not in d.report["class_counts"]["eval"]
    assert d.labels == ["big", "tiny"]  # not merged into another class


def _png_header(w: int, h: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("w,h", [(10000, 9000), (20000, 20000)])  # just over the limit (PIL warns) and over twice it (PIL refuses)
def test_decompression_bomb_is_refused_before_decoding(w, h):
    size, kind, reason = check_image(_png_header(w, h))  # a header claiming w x h pixels: nothing that large is ever allocated
    assert size is None and kind == "too_large" and "decompression bomb" in reason and f"{MAX_PIXELS:,}" in reason


def test_augmentation_is_seeded_per_example_and_changes_the_image():
    im = Image.open(io.BytesIO(png(7, size=32))).convert("RGB")
    a, b = augment(im, example_seed(0, 3, 5)), augment(im, example_seed(0, 3, 5))
    assert a.tobytes() == b.tobytes()
    import torch

    boxes = {crop_box(32, 32, torch.Generator().manual_seed(example_seed(0, w, 5))) for w in range(20)}
    assert len(boxes) > 10 and all(0.6 * 1024 * 0.9 <= w * h <= 1024 for _, _, w, h in boxes)
