"""The typed topology of a run: how its processes divide the work (torchtitan's ``ParallelDims``), and what each strategy can do.

:class:`ParallelDims` is a frozen value the planner resolves once (plan/resolve.py) and the specs carry
(``DistributedSpec.dims``, plan/specs.py):

    dp_replicate  data-parallel replicas that each hold the whole training state (DDP)
    dp_shard      data-parallel ranks that shard the state among themselves (FSDP2, ZeRO)
    cp            the sequence (context) degree: ranks that split one sequence's tokens (Ulysses attention)
    tp            the tensor degree: ranks that split each weight matrix

The rules, checked by :meth:`ParallelDims.check`: every degree is >= 1; the product is the world size; DDP replicates
(``dp_shard`` 1), FSDP and ZeRO shard (``dp_replicate`` 1); one process has every degree 1. The batch arithmetic (the
window plan, the stepper's slicing, the accumulation, the effective batch, lr scaling) reads :attr:`ParallelDims.dp`,
the data-parallel degree: the ranks of one sequence or tensor group read the same examples. Pipeline parallelism is not
a degree here yet: above what FSDP and ZeRO hold the planner hands the run to another engine (plan/parallel3d.py).

:class:`Capabilities` is what callers outside ``distributed/`` ask instead of comparing a strategy's name: whether the
parameters are shards (an eval forward then needs every rank), whether a checkpoint gathers the full state from every
rank, and what an out-of-memory error on one rank means for the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpipe.errors import TrainpipeError

SHARDING = ("fsdp", "zero2", "zero3")  # the data-parallel ranks shard the training state (dp_shard); ddp replicates it


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one run (see the module docstring); ``world`` is their product, ``dp`` the data-parallel degree."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many different micro-batches one micro-step reads."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (the mesh is laid out dp_replicate, dp_shard, cp, tp, the last fastest, as
        torchtitan's): the ranks of one sequence or tensor group share it and read the same examples."""
        return rank // (self.cp * self.tp)

    @classmethod
    def of(cls, strategy: str, world: int, *, cp: int = 1, tp: int = 1) -> "ParallelDims":
        """The dims of ``world`` processes under ``strategy`` with sequence degree ``cp`` and tensor degree ``tp``."""
        if world < 1 or cp < 1 or tp < 1 or world % (cp * tp):
            what = " x ".join(x for x, d in ((f"a sequence degree of {cp}", cp), (f"a tensor degree of {tp}", tp)) if d > 1) or f"a degree of {cp * tp}"
            keys = " and ".join(k for k, d in (("`distributed.sequence_parallel`", cp), ("`distributed.tensor_parallel`", tp)) if d > 1) or "the degrees"
            raise TrainpipeError(
                f"A world of {world} processes cannot hold {what}: it must divide the world size (each data-parallel rank gets a "
                f"whole group). Set {keys} so that their product divides {world}, or change the process count."
            )
        dp = world // (cp * tp)
        dims = cls(dp_shard=dp, cp=cp, tp=tp) if strategy in SHARDING else cls(dp_replicate=dp, cp=cp, tp=tp)
        dims.check(strategy, world)
        return dims

    def check(self, strategy: str, world: int) -> None:
        """The topology rules of the module docstring; a broken one is a bug in the resolver, said as such."""
        broken = [why for bad, why in (
            (min(self.dp_replicate, self.dp_shard, self.cp, self.tp) < 1, "every degree is >= 1"),
            (self.world != world, f"the degrees multiply to the world size ({self.world} != {world})"),
            (strategy == "ddp" and self.dp_shard != 1, "DDP replicates: dp_shard is 1"),
            (strategy in SHARDING and self.dp_replicate != 1, f"{strategy} shards: dp_replicate is 1"),
            (strategy == "single" and self.world != 1, "one process has every degree 1"),
        ) if bad]
        if broken:
            raise TrainpipeError(f"The resolved topology {self} breaks the rule(s): {'; '.join(broken)}. This is a bug in trainpipe's resolver.")

    def describe(self) -> dict:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}


@dataclass(frozen=True)
class Capabilities:
    """What a strategy can do, asked by the loop, the recipes and the evals (never the strategy's name)."""

    shards_parameters: bool  # the parameters are shards: every eval forward needs every rank; interop files come from the gathered state
    needs_full_state_gather: bool  # a checkpoint gathers the full weights / optimizer state from every rank's partitions
    oom_before_forward: str  # an OOM before the forward: "raise" (one process retries), "break" (DDP), "join" (sharded)
    oom_in_forward: str  # an OOM inside the forward or backward: "raise", "break" or "fatal" (the other ranks wait in collectives)


CAPABILITIES = {
    "single": Capabilities(False, False, "raise", "raise"),
    "ddp": Capabilities(False, False, "break", "break"),
    "fsdp": Capabilities(True, True, "join", "fatal"),
    "zero2": Capabilities(False, True, "join", "fatal"),
    "zero3": Capabilities(True, True, "join", "fatal"),
}


# a tensor degree above 1 (alone or under FSDP2): every forward and backward is a collective of the tensor group, so an OOM
# on one rank anywhere in the step leaves the others waiting in it
TENSOR = Capabilities(True, True, "fatal", "fatal")


def capabilities(strategy: str, world: int, tp: int = 1) -> Capabilities:
    """The capabilities of ``strategy`` on ``world`` processes with tensor degree ``tp`` (one process: `single`, whatever the
    config says; a tensor degree above 1: :data:`TENSOR`)."""
    if world > 1 and tp > 1:
        return TENSOR
    return CAPABILITIES["single" if world <= 1 else strategy if strategy in CAPABILITIES else "ddp"]


__all__ = ["CAPABILITIES", "SHARDING", "TENSOR", "Capabilities", "ParallelDims", "capabilities"]
