"""Batching: dynamic padding to the longest example of each batch."""

from __future__ import annotations

IGNORE_INDEX = -100


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


class PadCollator:
    """Dynamic padding to the longest example of each batch (a picklable callable for the Trainer)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict:
        return pad_batch([{"input_ids": b["input_ids"], "labels": b["labels"]} for b in batch], self.pad_id)
