"""Exact match of a model folder on freshly drawn shapes, with plain transformers (`AutoModelForImageTextToText` +
`AutoProcessor`, greedy decoding): the answer must be the colour's name exactly. Images drawn with seeds the training
data never used (make_data.py uses 0..239).

    python examples/vision-language/evaluate.py examples/vision-language/base runs/vision-language/model
"""

from __future__ import annotations

import json
import random
import sys

from transformers import AutoModelForImageTextToText, AutoProcessor

from make_data import QUESTION, draw, pick


def exact_match(folder: str, n: int = 60) -> tuple[float, list[dict]]:
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    proc = AutoProcessor.from_pretrained(folder)
    prompt = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                      tokenize=False, add_generation_prompt=True)
    rng, hits, rows = random.Random(12345), 0, []
    for i in range(n):
        colour, shape = pick(rng)
        batch = proc(text=[prompt], images=[draw(colour, shape, 100_000 + i)], return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
        answer = proc.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        hits += answer == colour
        rows.append({"shape": shape, "colour": colour, "answer": answer})
    return hits / n, rows


if __name__ == "__main__":
    result = {}
    for folder in sys.argv[1:]:
        em, rows = exact_match(folder)
        result[folder] = {"exact_match": round(em, 3), "first": rows[:4]}
    print(json.dumps(result, indent=1))
