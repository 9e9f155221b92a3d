"""Write the example's data, `data/digits.parquet`: scikit-learn's copy of the UCI "Optical Recognition of Handwritten
Digits" test set (1,797 images of 8x8 pixels, 16 grey levels, classes 0-9; `sklearn.datasets.load_digits`, shipped
inside scikit-learn, public domain per its UCI page), each image as the bytes of a PNG file (grey levels 0-16 scaled to
0-255) in the `image` column and its digit in `label`: the table-of-image-bytes form trainpipe's image family reads.

    python examples/image-classification/make_data.py               # rewrites data/digits.parquet
    python examples/image-classification/make_data.py --folder DIR  # the same images as DIR/<digit>/<n>.png (an image folder)
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

HERE = Path(__file__).resolve().parent


def digit_pngs() -> list[tuple[bytes, str]]:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    out = []
    for img, label in zip(d.images, d.target):
        buf = io.BytesIO()
        Image.fromarray(np.round(img * 255 / 16).astype("uint8"), mode="L").save(buf, format="PNG", optimize=True)
        out.append((buf.getvalue(), str(int(label))))
    return out


def write_parquet(out: Path = HERE / "data" / "digits.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = digit_pngs()
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": [b for b, _ in rows], "label": [l for _, l in rows]}), out)
    return out


def write_folder(root: Path) -> Path:
    for i, (data, label) in enumerate(digit_pngs()):
        (root / label).mkdir(parents=True, exist_ok=True)
        (root / label / f"{i:04d}.png").write_bytes(data)
    return root


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", type=Path, help="write an image folder here instead of the Parquet file")
    a = ap.parse_args()
    print(write_folder(a.folder) if a.folder else write_parquet())
