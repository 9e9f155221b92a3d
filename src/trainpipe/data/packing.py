"""Packing: several tokenized examples per row of ``max_length`` tokens.

Rows are filled best-fit-decreasing (deterministic: ties broken by example order). Each
row carries ``position_ids`` that restart at 0 for every example, so the model's
packed-sequence mask (transformers builds it from position ids when no attention mask is
given; flash-attention uses them as sequence boundaries) keeps attention inside an
example. The first label of every packed example is masked: in an unpacked batch the
first token is never a target, and packed it would be predicted from the previous example.
"""

from __future__ import annotations

import bisect
import random

IGNORE_INDEX = -100  # the label the loss skips (masked prompts, padding, the first label of a packed example)


def pack_bins(lengths: list[int], max_length: int) -> list[list[int]]:
    """Best-fit-decreasing assignment of examples (by length) to rows of ``max_length`` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, bin index)
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, b = free.pop(j)
            bins[b].append(i)
            bisect.insort(free, (space - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (max_length - n, len(bins) - 1))
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return bins


def pack_rows(rows: list[dict]) -> dict:
    """One packed row from tokenized rows: concatenated, position ids reset, first label of each masked. A row that
    carries its own position ids (a pretraining stream block, data/blocks.py: they restart at each document in it)
    keeps them, so its document boundaries stay boundaries."""
    ids, labels, pos = [], [], []
    for r in rows:
        ids.extend(r["input_ids"])
        lab = list(r["labels"])
        lab[0] = IGNORE_INDEX
        labels.extend(lab)
        own = r.get("position_ids")
        pos.extend(own if own is not None else range(len(r["input_ids"])))
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def pack(rows: list[dict], max_length: int) -> list[dict]:
    return [pack_rows([rows[i] for i in b]) for b in pack_bins([len(r["input_ids"]) for r in rows], max_length)]


def non_pad_share(lengths: list[int], *, mode: str, max_length: int, batch_size: int = 8, seed: int = 0) -> float:
    """Share of non-pad tokens in the batches the mode produces (rows for `pack`, examples otherwise)."""
    if not lengths:
        return 0.0
    if mode == "padding_free":
        return 1.0
    if mode == "max_length":
        return sum(lengths) / (len(lengths) * max_length)
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = padded = 0
    for k in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[k : k + batch_size]]
        real += sum(batch)
        padded += max(batch) * len(batch)
    return real / padded
