"""Remake the eval test assets (run from anywhere: `python tests/assets/eval/make_assets.py`).

- reverse_words/reverse_words.jsonl: 60 multiple-choice documents of the tiny models' task (tests/tiny.py:
  reverse three words). Choice 0 is the reversal (the answer); choices 1 and 2 are three-word phrases of the
  general text (`is near the`, `and the WORD`), so a model that answers in the task's form picks 0 and a model
  that only knows the general text prefers the distractors. Seed 11 (a document may repeat a training record).
- forgetting/general.jsonl: 120 lines of general-domain raw text (`{"text": ...}`) for forgetting sets, in the
  vocabulary of the tiny tokenizer.
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from tiny import WORDS  # noqa: E402


def main() -> None:
    rng = random.Random(11)
    docs = []
    for _ in range(60):
        w = rng.sample(WORDS, 4)
        w, other = w[:3], w[3]
        docs.append({"words": " ".join(w), "choices": [" ".join(reversed(w)), "is near the", f"and the {other}"], "label": 0})
    (HERE / "reverse_words" / "reverse_words.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    rng = random.Random(12)
    lines = []
    for _ in range(120):
        a, b, c = rng.sample(WORDS, 3)
        lines.append({"text": f"The {a} is near the {b}, and the {c} is green."})
    (HERE / "forgetting").mkdir(exist_ok=True)
    (HERE / "forgetting" / "general.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines), encoding="utf-8")


if __name__ == "__main__":
    main()
