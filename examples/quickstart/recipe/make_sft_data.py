"""Deterministic generator of the quickstart's instruction dataset (alpaca format).

Each record asks for an integer 0..9999 in words:

    {"instruction": "Write the number in words.", "input": "347", "output": "three hundred forty-seven"}

Every record uses a distinct number, so whatever split the pipeline draws, the
held-out numbers never occur in the training records (they do occur in the
pretraining corpus, in a different, non-instruction surface form: that is the
skill the base model already has).

    python examples/quickstart/recipe/make_sft_data.py --seed 0 --n 2000
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from numwords import MAX_N, to_words  # noqa: E402

HERE = Path(__file__).resolve().parent
INSTRUCTION = "Write the number in words."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=2000, help="number of records (distinct numbers)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "data" / "train.jsonl")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    numbers = rng.sample(range(MAX_N + 1), args.n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for n in numbers:
            rec = {"instruction": INSTRUCTION, "input": str(n), "output": to_words(n)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {args.n} records to {args.out}")


if __name__ == "__main__":
    main()
