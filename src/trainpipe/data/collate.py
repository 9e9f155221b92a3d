"""Batching: dynamic padding, packed rows and padding-free batches.

- rows with ``input_ids`` and ``labels`` only: right-padded to the longest of the batch,
  with an attention mask (dynamic padding);
- rows with ``position_ids`` (packing): right-padded, the padding a segment of its own,
  no attention mask (so the model builds its packed-sequence mask from the position ids)
  and ``use_cache=False`` (a cache would switch that detection off);
- rows with ``padding_free`` set: concatenated into one row without any padding, position
  ids restarting per example, the first label of each example masked.
"""

from __future__ import annotations

IGNORE_INDEX = -100


def right_pad(seqs: list[list[int]], pad_id: int) -> dict:
    """Token id lists right-padded with ``pad_id`` into ``input_ids`` and ``attention_mask`` tensors."""
    import torch

    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def pad_batch(batch: list[dict], pad_id: int) -> dict:
    """Right-pad ``input_ids`` (with ``pad_id``) and ``labels`` (with -100); build the attention mask."""
    import torch

    n = max(len(x["input_ids"]) for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        k = len(x["input_ids"])
        ids[i, :k] = torch.tensor(x["input_ids"])
        labels[i, :k] = torch.tensor(x["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pad_packed(batch: list[dict], pad_id: int) -> dict:
    import torch

    n = max(len(x["input_ids"]) for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        k = len(x["input_ids"])
        ids[i, :k] = torch.tensor(x["input_ids"])
        labels[i, :k] = torch.tensor(x["labels"])
        pos[i, :k] = torch.tensor(x["position_ids"])
        pos[i, k:] = torch.arange(n - k)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "use_cache": False}


def flatten(batch: list[dict]) -> dict:
    import torch

    ids, labels, pos = [], [], []
    for x in batch:
        ids.extend(x["input_ids"])
        lab = list(x["labels"])
        lab[0] = IGNORE_INDEX
        labels.extend(lab)
        pos.extend(range(len(x["input_ids"])))
    t = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    return {"input_ids": t(ids), "labels": t(labels), "position_ids": t(pos), "use_cache": False}


class PadCollator:
    """Batches for the Trainer (a picklable callable): the layout follows the rows, see the module docstring."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        first = batch[0]
        if first.get("padding_free"):
            return flatten(batch)
        if first.get("position_ids") is not None:
            return pad_packed(batch, self.pad_id)
        return pad_batch([{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batch], self.pad_id)
