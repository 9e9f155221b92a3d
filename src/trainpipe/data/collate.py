"""Batching: dynamic padding, packed rows and padding-free batches.

- rows with ``input_ids`` and ``labels`` only: right-padded to the longest of the batch,
  with an attention mask (dynamic padding);
- rows with ``position_ids`` (packing): right-padded, the padding a segment of its own,
  no attention mask (so the model builds its packed-sequence mask from the position ids)
  and ``use_cache=False`` (a cache would switch that detection off);
- rows with ``padding_free`` set: concatenated into one row without any padding, position
  ids restarting per example, the first label of each example masked;
- rows with ``mm`` (a vision-language model's images, data/vision_chat.py): right-padded, the pixel tensors
  concatenated (padding-free and packing would cut through an image's tokens, so they pad).
"""

from __future__ import annotations

from trainpipe.data import vision_chat
from trainpipe.data.packing import IGNORE_INDEX, pack_rows

__all__ = ["IGNORE_INDEX", "PadCollator", "flatten", "pad_batch", "pad_packed", "right_pad"]


def _pad(rows: list, fill: int, n: int):
    """Lists of ints right-padded with ``fill`` to length ``n``, as one long tensor."""
    import torch

    out = torch.full((len(rows), n), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def right_pad(seqs: list[list[int]], pad_id: int) -> dict:
    """Token id lists right-padded with ``pad_id`` into ``input_ids`` and ``attention_mask`` tensors."""
    n = max(len(s) for s in seqs)
    return {"input_ids": _pad(seqs, pad_id, n), "attention_mask": _pad([[1] * len(s) for s in seqs], 0, n)}


def pad_batch(batch: list[dict], pad_id: int) -> dict:
    """Right-pad ``input_ids`` (with ``pad_id``) and ``labels`` (with -100); build the attention mask."""
    out = right_pad([x["input_ids"] for x in batch], pad_id)
    out["labels"] = _pad([x["labels"] for x in batch], IGNORE_INDEX, out["input_ids"].shape[1])
    return out


def pad_packed(batch: list[dict], pad_id: int) -> dict:
    n = max(len(x["input_ids"]) for x in batch)
    # the padding is a segment of its own: its positions count from 0 again
    pos = _pad([list(x["position_ids"]) + list(range(n - len(x["input_ids"]))) for x in batch], 0, n)
    return {"input_ids": _pad([x["input_ids"] for x in batch], pad_id, n), "labels": _pad([x["labels"] for x in batch], IGNORE_INDEX, n),
            "position_ids": pos, "use_cache": False}


def flatten(batch: list[dict]) -> dict:
    return {k: _pad([v], 0, len(v)) for k, v in pack_rows(batch).items()} | {"use_cache": False}


class PadCollator:
    """Batches for the Trainer (a picklable callable): the layout follows the rows, see the module docstring."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        first = batch[0]
        if "mm" in first:
            return vision_chat.collate(batch, self.pad_id)
        if first.get("padding_free"):
            return flatten(batch)
        if first.get("position_ids") is not None:
            return pad_packed(batch, self.pad_id)
        return pad_batch([{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batch], self.pad_id)
