"""Reward function for examples/methods/rl.yaml: how much of the reply is the number written in words.

Called by trainpipe as `reward(prompts, completions) -> list[float]`; the prompt ends with the number.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quickstart" / "recipe"))
from numwords import to_words  # noqa: E402


def number_in_words(prompts: list[str], completions: list[str]) -> list[float]:
    out = []
    for p, c in zip(prompts, completions):
        found = re.findall(r"\d+", p)
        want = to_words(int(found[-1])).split() if found else []
        got = c.strip().split()
        hits = sum(1 for a, b in zip(want, got) if a == b)
        out.append(hits / max(len(want), len(got), 1))
    return out
