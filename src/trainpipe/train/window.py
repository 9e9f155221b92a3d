"""The window plan: which examples each optimizer step reads, and how many steps a run has. Pure arithmetic of
(seed, number of examples, effective batch, `max_steps` / `num_train_epochs`).

Window ``w`` of epoch ``e`` is the ``w``-th slice of ``effective`` examples of a permutation seeded with ``seed + e``. The
loop position is therefore just the next window, and a resumed run reads exactly the examples the uninterrupted one
would have, none twice and none skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from trainpipe.plan.specs import BatchSpec


@dataclass(frozen=True)
class WindowPlan:
    examples: int  # training examples
    effective: int  # examples per optimizer step, every rank together
    seed: int
    max_steps: int  # > 0: the optimizer steps asked for; else epochs
    epochs: float
    _perm: dict = field(default_factory=dict, compare=False, repr=False)  # the permutation of the epoch read last

    @classmethod
    def of(cls, batch: BatchSpec, examples: int, dp: int) -> "WindowPlan":
        """From the resolved batch (`plan.specs.batch`): micro-batch x accumulation x the data-parallel degree (the strategy's
        `dims.dp`, never the bare world size: the ranks of one sequence or tensor group read the same examples) per step."""
        effective = batch.micro_batch * batch.grad_accum * dp
        return cls(examples=examples, effective=effective, seed=batch.seed, max_steps=batch.max_steps, epochs=batch.num_train_epochs)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.examples / self.effective))

    @property
    def total_windows(self) -> int:
        """The scheduler's length: `max_steps`, or every window of the epochs."""
        return self.max_steps if self.max_steps > 0 else max(1, math.ceil(self.epochs * self.steps_per_epoch))

    def with_effective(self, effective: int) -> "WindowPlan":
        """The plan with a checkpoint's effective batch (a resume under another world size keeps it)."""
        return replace(self, effective=effective, _perm={})

    def indices(self, w: int) -> list[int]:
        """The example indices of window ``w``."""
        return self.rows(w).tolist()

    def rows(self, w: int):
        """The example indices of window ``w`` as a 1-D int64 tensor (a view of the epoch's permutation: no copy)."""
        import torch

        epoch, k = divmod(w, self.steps_per_epoch)
        if epoch not in self._perm:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm.clear()
            self._perm[epoch] = torch.randperm(self.examples, generator=g)
        return self._perm[epoch][k * self.effective : (k + 1) * self.effective]

    def window(self, data: list, w: int, by_row: bool = False):
        """The examples of window ``w``: a list of ``data``'s rows, or (``by_row``: an objective that gathers its micro-batches
        from stacked tensors, Objective.gathers_rows) a :class:`Rows` view that holds only their indices."""
        rows = self.rows(w)
        return Rows(data, rows) if by_row else [data[i] for i in rows.tolist()]

    def finished(self, step: int, window: int) -> bool:
        """`max_steps`: the optimizer steps asked for are trained (a window skipped after a rollback is made up by the next
        window); epochs: every window of them has been read (a skipped one is not repeated)."""
        if self.max_steps > 0:
            return step >= self.max_steps
        return window >= self.total_windows

    def accumulation(self, micro_batch: int, dp: int = 1) -> int:
        """Micro-steps per optimizer step (per rank) at this micro-batch, over ``dp`` data-parallel ranks."""
        return math.ceil(self.effective / (micro_batch * dp))


class Rows(Sequence):
    """A window's (or a micro-batch's) examples as a view: the list they come from (``source``) and their indices in it
    (``rows``, an int64 tensor), so that an objective that keeps its training data stacked in tensors (a table:
    train/supervised.py) gathers a micro-batch with one tensor index, and no per-example Python runs in the step. Reading
    an example (``rows[i]``, iterating) returns ``source``'s; slicing returns a view of the slice."""

    __slots__ = ("source", "rows", "_list")

    def __init__(self, source: list, rows):
        self.source, self.rows, self._list = source, rows, None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Rows(self.source, self.rows[i])
        return self.source[self._indices()[i]]

    def __iter__(self):
        return (self.source[i] for i in self._indices())

    def _indices(self) -> list[int]:
        if self._list is None:
            self._list = self.rows.tolist()
        return self._list
