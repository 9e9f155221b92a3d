"""Write the example's data: `data/shapes.jsonl` in LLaMA-Factory's multimodal layout (`messages` with an `<image>`
placeholder + an `images` list of paths relative to the file) and the 28x28 PNGs it names under `data/images/`: a
red, green, blue or yellow square or circle at a random place, and the question "What colour is the shape?" whose
answer is the colour's name (checked exactly by evaluate.py). Seeded: rerunning writes the same files.

    python examples/vision-language/make_data.py     # rewrites examples/vision-language/data/
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("square", "circle")
QUESTION = "What colour is the shape?"


def draw(colour: str, shape: str, seed: int, size: int = 28):
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(img)
    r = rng.randint(6, 10)
    cx, cy = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
    (d.rectangle if shape == "square" else d.ellipse)((cx - r, cy - r, cx + r, cy + r), fill=COLOURS[colour])
    return img


def pick(rng: random.Random) -> tuple[str, str]:
    return rng.choice(sorted(COLOURS)), rng.choice(SHAPES)


def main(n: int = 240, out: Path = HERE / "data") -> Path:
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = []
    for i in range(n):
        colour, shape = pick(rng)
        name = f"images/{i:04d}.png"
        draw(colour, shape, i).save(out / name, optimize=True)
        lines.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": colour}],
                      "images": [name]})
    path = out / "shapes.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(main())
