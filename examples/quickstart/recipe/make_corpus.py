"""Deterministic generator of the quickstart's synthetic pretraining corpus.

The corpus teaches one skill -- writing integers 0..9999 in English words -- in
plain declarative sentences ("347 is written as three hundred forty-seven."),
never in the instruction phrasing used by the SFT data. A small share of the
documents are generic ChatML conversations about unrelated trivia (next weekday,
opposites, repeating a word, ...) so that the base model has seen the
<|im_start|>/<|im_end|> tokens and the turn layout; none of them mention numbers
in words.

Output: one document per line in a text file (default recipe/_work/corpus.txt,
git-ignored). Documents are later joined with <|endoftext|> by make_base.py.

    python examples/quickstart/recipe/make_corpus.py --seed 0 --docs 40000
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import sys
sys.path.insert(0, str(Path(__file__).resolve().parent))
from numwords import MAX_N, to_words  # noqa: E402

HERE = Path(__file__).resolve().parent

SENTENCES = [
    "{n} is written as {w}.",
    "The number {n} is spelled {w}.",
    "In words, {n} is {w}.",
    "We read {n} as {w}.",
    "{n} reads as {w}.",
    "Spelled out, {n} becomes {w}.",
    "{n} means {w}.",
    "The words for {n} are {w}.",
]
REVERSE = [
    "{W} is the number {n}.",
    "The number {w} is written {n} in digits.",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"),
             ("fast", "slow"), ("old", "new"), ("open", "closed"), ("light", "dark"),
             ("early", "late"), ("wet", "dry"), ("happy", "sad"), ("left", "right"),
             ("full", "empty"), ("hard", "soft"), ("high", "low"), ("near", "far")]
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "tiger", "pencil",
         "orange", "mountain", "candle", "forest", "silver", "rocket", "summer", "bridge",
         "coffee", "planet", "yellow", "button", "dragon", "island", "violin", "winter"]
COLORS = [("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
          ("a banana", "yellow"), ("a tomato", "red"), ("an orange", "orange"),
          ("a lemon", "yellow"), ("blood", "red"), ("the sea", "blue")]


def chat_pair(rng: random.Random) -> tuple[str, str]:
    k = rng.randrange(7)
    if k == 0:
        i = rng.randrange(7)
        return rng.choice(["What day comes after {d}?", "Which day follows {d}?"]).format(d=DAYS[i]), DAYS[(i + 1) % 7]
    if k == 1:
        i = rng.randrange(12)
        return rng.choice(["Which month comes after {m}?", "Name the month after {m}."]).format(m=MONTHS[i]), MONTHS[(i + 1) % 12]
    if k == 2:
        a, b = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            a, b = b, a
        return rng.choice(["What is the opposite of {a}?", "Give the opposite of \"{a}\"."]).format(a=a), b
    if k == 3:
        ws = " ".join(rng.sample(WORDS, rng.randint(1, 3)))
        return rng.choice(["Repeat after me: {w}", "Say this back to me.\n\n{w}"]).format(w=ws), ws
    if k == 4:
        t, c = rng.choice(COLORS)
        return f"What color is {t}?", c
    if k == 5:
        w = rng.choice(WORDS)
        return rng.choice(["Write this word in capital letters.\n\n{w}", "Uppercase: {w}"]).format(w=w), w.upper()
    w = rng.choice(WORDS)
    return rng.choice(["What is the first letter of {w}?", "Which letter does \"{w}\" start with?"]).format(w=w), w[0]


def chat_doc(rng: random.Random) -> str:
    turns = []
    if rng.random() < 0.3:
        turns.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    for _ in range(rng.randint(1, 3)):
        q, a = chat_pair(rng)
        turns.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
    return "".join(turns)


def sample_n(rng: random.Random) -> int:
    # mix of magnitudes so that short numbers are not drowned by 4-digit ones
    r = rng.random()
    if r < 0.1:
        return rng.randrange(100)
    if r < 0.3:
        return rng.randrange(1000)
    return rng.randrange(MAX_N + 1)


def number_doc(rng: random.Random) -> str:
    sents = []
    for _ in range(rng.randint(3, 8)):
        n = sample_n(rng)
        w = to_words(n)
        if rng.random() < 0.1:
            s = rng.choice(REVERSE).format(n=n, w=w, W=w[0].upper() + w[1:])
        elif rng.random() < 0.05 and n <= MAX_N - 3:
            s = "Counting up from {n}: {a}, {b}, {c}.".format(n=n, a=w, b=to_words(n + 1), c=to_words(n + 2))
        else:
            s = rng.choice(SENTENCES).format(n=n, w=w)
        sents.append(s)
    sep = rng.choice([" ", "\n"])
    return sep.join(sents)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", type=int, default=40000, help="number of documents")
    ap.add_argument("--chat-fraction", type=float, default=0.1,
                    help="share of generic ChatML conversation documents")
    ap.add_argument("--out", type=Path, default=HERE / "_work" / "corpus.txt")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n_chat = 0
    with args.out.open("w", encoding="utf-8") as f:
        for _ in range(args.docs):
            if rng.random() < args.chat_fraction:
                doc = chat_doc(rng)
                n_chat += 1
            else:
                doc = number_doc(rng)
            f.write(json.dumps(doc) + "\n")  # JSON string per line: documents may contain newlines
    print(f"wrote {args.docs} documents ({n_chat} chat) to {args.out}")


if __name__ == "__main__":
    main()
