"""Deterministic generator of the small datasets the method examples in this folder train on.

All are about the quickstart's skill (integers in English words), so every example can start
from the shipped base model (`examples/quickstart/base`):

- data/preference.jsonl  prompt/chosen/rejected: chosen is the number in words, rejected the same words
                         in a wrong order (a nearby wrong number for one-word numbers) (dpo, orpo, kto, reward)
- data/text.jsonl        {"text": ...} raw sentences "347 is written as three hundred forty-seven." (pretrain)
- data/prompts.jsonl     alpaca prompts with a reference (rl; the reward function scores replies)

    python examples/methods/make_data.py
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quickstart" / "recipe"))
from numwords import MAX_N, to_words  # noqa: E402

INSTRUCTION = "Write the number in words."


def main(seed: int = 1, pairs: int = 600, sentences: int = 1500, prompts: int = 300) -> None:
    rng = random.Random(seed)
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    numbers = rng.sample(range(MAX_N + 1), pairs + prompts)
    with (out / "preference.jsonl").open("w", encoding="utf-8") as f:
        for n in numbers[:pairs]:
            words = to_words(n).split()
            shuffled = words[:]
            while len(words) > 1 and shuffled == words:
                rng.shuffle(shuffled)
            if len(words) > 1:  # the right words in a wrong order
                rejected = " ".join(shuffled)
            else:  # one-word numbers: a nearby wrong number
                rejected = to_words((n + rng.randint(1, 9)) % (MAX_N + 1))
            f.write(json.dumps({"prompt": f"{INSTRUCTION}\n{n}", "chosen": to_words(n), "rejected": rejected}) + "\n")
    with (out / "prompts.jsonl").open("w", encoding="utf-8") as f:
        for n in numbers[pairs:]:
            f.write(json.dumps({"instruction": INSTRUCTION, "input": str(n), "output": to_words(n)}) + "\n")
    with (out / "text.jsonl").open("w", encoding="utf-8") as f:
        for n in rng.sample(range(MAX_N + 1), sentences):
            f.write(json.dumps({"text": f"{n} is written as {to_words(n)}."}) + "\n")
    print(f"wrote {pairs} pairs, {prompts} prompts, {sentences} sentences to {out}")


if __name__ == "__main__":
    main()
