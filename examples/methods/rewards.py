"""Reward function for examples/methods/rl.yaml: how much of the reply is the number written in words.

Called by trainpipe as `reward(prompts, completions) -> list[float]`; the prompt ends with the number.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quickstart" / "recipe"))
from numwords import to_words  # noqa: E402


NUMBER_WORDS = set(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand".split()
)


def number_in_words(prompts: list[str], completions: list[str]) -> list[float]:
    """Half for speaking in number words at all (share of the reply's words that are number words, so a model that
    answers with anything else still gets a gradient), half for the right words in the right places."""
    out = []
    for p, c in zip(prompts, completions):
        found = re.findall(r"\d+", p)
        want = to_words(int(found[-1])).replace("-", " ").split() if found else []
        got = c.strip().lower().replace("-", " ").split()
        vocab = sum(1 for w in got if w in NUMBER_WORDS) / max(len(got), 1)
        exact = sum(1 for a, b in zip(want, got) if a == b) / max(len(want), len(got), 1)
        out.append(0.5 * vocab + 0.5 * exact)
    return out
