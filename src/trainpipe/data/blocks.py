"""Pretraining blocks as pretraining tools build them (``data.pretrain_blocks: stream``, the default): raw-text
documents, each ending with EOS, joined into one token stream per split and cut into ``max_length`` blocks (HF
``run_clm``'s ``group_texts``): every block is ``max_length`` tokens but the split's last, and no token is lost.

A block holding the end of one document and the start of the next carries the boundary: its ``position_ids``
restart at 0 at every document start (and at the block's start), as packed rows do (data/packing.py), so the
packed-sequence attention (transformers' mask from position ids, flash-attention's boundaries; the collator sends
such rows without an attention mask) keeps each document to itself; the label of a document's first token is
masked (it would be predicted from the previous document). ``pretrain_blocks: document`` cuts each document on its
own (data/tokenize.py), its last block short.
"""

from __future__ import annotations

from trainpipe.data.packing import IGNORE_INDEX


class BlockStream:
    """One split's stream of documents, cut into ``max_length`` blocks as it fills (:meth:`add`, then :meth:`flush`)."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.pos: list[int] = []
        self.documents = self.tokens = self.blocks = self.boundaries = 0  # boundaries: document starts inside a block

    def add(self, row: dict) -> list[dict]:
        """Append a document's tokens (``row``: input_ids, labels); returns the blocks it completed."""
        ids, labels = list(row["input_ids"]), list(row["labels"])
        if not ids:
            return []
        if self.ids:  # the document starts inside a block: a boundary, its first label masked
            labels[0] = IGNORE_INDEX
            self.boundaries += 1
        self.documents += 1
        self.tokens += len(ids)
        out: list[dict] = []
        k = 0
        while k < len(ids):
            take = min(len(ids) - k, self.max_length - len(self.ids))
            self.ids.extend(ids[k : k + take])
            self.labels.extend(labels[k : k + take])
            self.pos.extend(range(take))  # positions restart at each document start and at each block start
            k += take
            if len(self.ids) == self.max_length:
                out.append(self._block())
        return out

    def flush(self) -> list[dict]:
        """The last block (shorter than ``max_length``), if any tokens are left."""
        return [self._block()] if self.ids else []

    def _block(self) -> dict:
        block = {"input_ids": self.ids, "labels": self.labels, "position_ids": self.pos}
        self.ids, self.labels, self.pos = [], [], []
        self.blocks += 1
        return block

    def report(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "blocks": self.blocks, "boundaries_in_blocks": self.boundaries}
