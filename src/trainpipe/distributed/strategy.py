"""How the training loop runs on one process or several: the :class:`Strategy` protocol and its implementations.

The loop (train/loop.py) never asks how many processes there are or how the model is spread over them; it asks its
strategy (torchtitan's parallel dims, Lightning Fabric's strategies):

- :meth:`~Strategy.shard` the model in place before the optimizer is built (FSDP2), :meth:`~Strategy.wrap` it after (DDP);
  :attr:`~Strategy.forward` is what forwards run through;
- :meth:`~Strategy.no_sync` for accumulation micro-steps, :meth:`~Strategy.scale_loss` (DDP averages over the ranks; the
  window's gradient is their sum), :meth:`~Strategy.oom_action` (what an OOM inside a micro-step means for the
  collectives), :meth:`~Strategy.agree` (one all-reduce per step: the loss, the figures, an OOM flag and a stop flag, so
  every rank takes the same decision at the same step), :meth:`~Strategy.grad_norm`;
- :meth:`~Strategy.checkpoint` (every rank's RNG and PowerSGD state gathered, the full FSDP state gathered, rank 0
  writes, the others wait for its outcome), :meth:`~Strategy.load` (a full checkpoint into a sharded or a plain model),
  :meth:`~Strategy.evaluate` (sharded over the ranks, or rank 0's figure broadcast), :meth:`~Strategy.release`;
- :meth:`~Strategy.hang_watchdog` and the figures a run records of its topology.

:class:`Single` (one process), :class:`DDP` (distributed/ddp.py) and :class:`FSDP` (distributed/fsdp.py) implement it;
DeepSpeed or sequence parallelism would be another implementation. :func:`make` picks one from the run's settings.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Protocol

from trainpipe.distributed import ddp as ddp_mod
from trainpipe.distributed import fsdp as fsdp_mod
from trainpipe.distributed import zero as zero_mod
from trainpipe.distributed.env import all_reduce_sum, broadcast_object, gather_objects, sharded_eval
from trainpipe.errors import TrainpipeError
from trainpipe.model.checkpoints import CheckpointFailed

Mark = Callable[[str], None]  # the loop's heartbeat: this rank's phase ("compute", "wait", "eval", "checkpoint")


class Strategy(Protocol):
    name: str  # "single", "ddp", "fsdp": what the run manifest records
    rank: int
    world: int
    is_main: bool
    sharded: bool  # parameters are shards (FSDP): the interop files are written from the gathered state
    forward: object  # what forwards run through

    def shard(self, model) -> None: ...
    def wrap(self, model, device) -> None: ...
    def attach(self, optimizer, max_grad_norm: float, loss_scaling: bool = False): ...
    def no_sync(self): ...
    def scale_loss(self, loss): ...
    def before_sync_backward(self, mark: Mark) -> None: ...
    def oom_action(self, forwarding: bool) -> str: ...
    def agree(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple: ...
    def gather(self, obj) -> list: ...
    def grad_norm(self, gnorm): ...
    def stop_signal(self, local: str | None, agreed: str | None) -> str | None: ...
    def checkpoint(self, write: Callable[[dict], object], capture_rng: Callable[[], dict], model, optimizer, mark: Mark): ...
    def load(self, model, optimizer, weights: dict, optim_state: dict, trainable: set, path) -> None: ...
    def load_extra(self, state: dict, resuming: bool, device) -> str | None: ...
    def evaluate(self, run: Callable[[], object], shards: bool, mark: Mark) -> tuple[object, dict]: ...
    def release(self, model) -> bool: ...
    def hang_watchdog(self, *, run_dir, progress, emit): ...
    def describe(self) -> dict: ...
    def world_fields(self, effective: int, micro_batch: int, resumed_world: int | None) -> dict: ...
    def oom_fields(self, effective: int, micro_batch: int, resumed_world: int | None, oom_ranks: list[int]) -> dict: ...


class Single:
    """One process: every collective is a no-op, an OOM is the step's own to recover from."""

    name, rank, world, is_main, sharded = "single", 0, 1, True, False

    def __init__(self):
        self.forward = None

    def shard(self, model) -> None:
        pass

    def wrap(self, model, device) -> None:
        self.forward = model

    def attach(self, optimizer, max_grad_norm: float, loss_scaling: bool = False):
        """The optimizer the loop and the stepper step (DeepSpeed: its engine's step over the partitions); ``optimizer``
        itself everywhere else. ``loss_scaling``: the stepper scales fp16 losses with torch's GradScaler."""
        return optimizer

    def no_sync(self):
        return nullcontext()

    def scale_loss(self, loss):
        return loss

    def before_sync_backward(self, mark: Mark) -> None:
        pass

    def oom_action(self, forwarding: bool) -> str:
        return "raise"  # the loop's OOM recovery retries the window on this process alone

    def agree(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        return total, extras, 0.0, False

    def gather(self, obj) -> list:
        return [obj]

    def grad_norm(self, gnorm):
        return gnorm

    def stop_signal(self, local: str | None, agreed: str | None) -> str | None:
        return local

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        return write({})

    def load(self, model, optimizer, weights: dict, optim_state: dict, trainable: set, path) -> None:
        result = model.load_state_dict(weights, strict=False)
        missing = trainable - set(weights)
        if result.unexpected_keys or missing:
            raise TrainpipeError(f"Checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, unexpected {result.unexpected_keys[:3]}).")
        optimizer.load_state_dict(optim_state)

    def load_extra(self, state: dict, resuming: bool, device) -> str | None:
        return None

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return run(), {}

    def release(self, model) -> bool:
        return False

    def hang_watchdog(self, *, run_dir, progress, emit):
        return None  # the loop's own stack-dumping watchdog (`training.hang_timeout_seconds`)

    def describe(self) -> dict:
        return {"grad_compression": "none", "launcher": None}

    def world_fields(self, effective: int, micro_batch: int, resumed_world: int | None) -> dict:
        """What events say of the topology: nothing for one process, unless it resumed a run of another world size."""
        if self.world == 1 and resumed_world is None:
            return {}
        return {"world_size": self.world, "rank": self.rank, "per_rank_accumulation": math.ceil(effective / (micro_batch * self.world))}

    def oom_fields(self, effective: int, micro_batch: int, resumed_world: int | None, oom_ranks: list[int]) -> dict:
        """What an OOM recovery event says of the other ranks: nothing for one process."""
        return {}


class DDP(Single):
    """Several processes, each with the whole model inside DistributedDataParallel (distributed/ddp.py). Rank 0
    evaluates and writes; an OOM on one rank becomes every rank's OOM at the step's all-reduce."""

    name, sharded = "ddp", False

    def __init__(self, dist):
        super().__init__()
        self.dist = dist
        self.rank, self.world, self.is_main = dist.env.rank, dist.env.world_size, dist.env.rank == 0
        self.timeout = dist.timeout_seconds
        self.ddp = None

    def wrap(self, model, device) -> None:
        self.ddp = ddp_mod.wrap(model, device, self.dist.grad_compression)
        self.forward = self.ddp

    def no_sync(self):
        return self.ddp.no_sync()

    def scale_loss(self, loss):
        return loss * self.world  # DDP averages over the ranks; the window's gradient is their sum

    def before_sync_backward(self, mark: Mark) -> None:
        mark("wait")  # the backward ends in the gradient all-reduce

    def oom_action(self, forwarding: bool) -> str:
        return "break"  # the micro-steps before the last keep their gradients local; the all-reduce is joined after

    def agree(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        import torch

        names = sorted(extras)
        mark("wait")
        red = all_reduce_sum([float(total), float(oom), float(stop), *(extras[k] for k in names)], device)
        mark("compute")
        return torch.tensor(red[0]), dict(zip(names, red[3:])), red[1], bool(red[2])

    def gather(self, obj) -> list:
        return gather_objects(obj)

    def stop_signal(self, local: str | None, agreed: str | None) -> str | None:
        return agreed  # all ranks stop at the step they agreed on

    def _powersgd(self):
        """The live PowerSGD state of this rank's DDP hook (`distributed.grad_compression: powersgd`), else None."""
        return getattr(self.ddp, "trainpipe_hook_state", None) if self.ddp is not None else None

    def _gather_full(self, model, optimizer):
        return None

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        """Every rank calls this: rank 0 writes (with every rank's RNG state), the others wait for its outcome, so that a
        failed write stops (or continues) all of them alike."""
        mark("wait")
        rngs = gather_objects(capture_rng())
        psgd = self._powersgd()
        psgd_ranks = gather_objects(ddp_mod.powersgd_state_dict(psgd)) if psgd is not None else None
        gathered = self._gather_full(model, optimizer)  # FSDP: every rank takes part in gathering the full state
        info, outcome = None, None
        if self.is_main:
            mark("checkpoint")
            try:
                info = write({"rng_ranks": rngs, "powersgd_ranks": psgd_ranks, "gathered": gathered})
            except CheckpointFailed as exc:
                outcome = exc.message
                broadcast_object(outcome)
                raise
        mark("wait")
        outcome = broadcast_object(outcome)
        mark("compute")
        if outcome is not None:
            raise CheckpointFailed(outcome)
        return info

    def load_extra(self, state: dict, resuming: bool, device) -> str | None:
        """A rollback (same processes, same DDP) gives each rank its own PowerSGD state back from the checkpoint (iteration
        count, projections, its error feedback), keyed by the gradient buckets it was saved with. A resume re-warms
        PowerSGD from scratch (plain all-reduce for its first steps again), as stated in `checkpoint_resumed` and the
        manifest: the new processes' DDP lays its buckets out anew (and rebuilds them after its first step), so the saved
        per-bucket residuals and P/Q would land on other parameters; restoring them made a resumed 2-process run differ
        from the uninterrupted one by 3e-4 (not bit-exact) in a test, so they are not restored. Returns what was done."""
        psgd = self._powersgd()
        saved = state.get("powersgd_ranks")
        if psgd is None:
            return None
        start = ddp_mod.POWERSGD_START_STEP
        if resuming:
            return (f"re-warmed from scratch (a resumed run's DDP lays out its gradient buckets anew, so the saved per-bucket "
                    f"state does not apply): plain all-reduce for {start} steps, then rank-1 compression")
        if saved and len(saved) == self.world:
            ddp_mod.load_powersgd_state(psgd, saved[self.rank], device)
            return f"restored (iteration {int(saved[self.rank]['iter'])}, every rank's error feedback)"
        why = f"the checkpoint holds the state of {len(saved)} rank(s), this run has {self.world}" if saved else "the checkpoint holds no PowerSGD state"
        return f"re-warmed from scratch ({why}): plain all-reduce for {start} steps, then rank-1 compression"

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        if shards:
            return self._sharded_eval(run, mark)
        mark("eval" if self.is_main else "wait")  # rank 0 evaluates (the weights are the same on every rank); all take its figure
        metric = broadcast_object(run() if self.is_main else None)
        mark("compute")
        return metric, {}

    def _sharded_eval(self, run, mark: Mark) -> tuple[object, dict]:
        """Rank r evaluates batches r, r + world, ... and the sums of losses and loss tokens are all-reduced, so the figure is
        one process's over the whole set (evaluate/evaluator.eval_loss, evaluate/shard.py). Under FSDP every other
        evaluation runs whole on every rank (a sharded forward needs every rank); rank 0's figure counts."""
        mark("eval")
        with sharded_eval(self.rank, self.world, lockstep=self.sharded) as shard:
            metric = run()
        metric = broadcast_object(metric)
        fields = {"eval_ranks": self.world, "eval_loss_tokens_per_rank": shard.counts} if shard.used else {}
        mark("compute")
        return metric, fields

    def hang_watchdog(self, *, run_dir, progress, emit):
        import torch

        backend = torch.distributed.get_backend()
        return ddp_mod.HangWatchdog(rank=self.rank, world=self.world, timeout=self.timeout, run_dir=run_dir, progress=progress,
                                    emit=emit, event="nccl_timeout" if backend == "nccl" else "distributed_hang")

    def describe(self) -> dict:
        return {"grad_compression": self.dist.grad_compression, "launcher": self.dist.env.launcher}

    def oom_fields(self, effective: int, micro_batch: int, resumed_world: int | None, oom_ranks: list[int]) -> dict:
        """Every rank is in the OOM recovery together: each rank's micro-batch after the decision, gathered, and the ranks
        that ran out of memory."""
        return {**self.world_fields(effective, micro_batch, resumed_world), "micro_batch_per_rank": gather_objects(micro_batch),
                "ranks_out_of_memory": oom_ranks}


class FSDP(DDP):
    """Several processes, the model sharded in place by FSDP2 (distributed/fsdp.py): forwards go through the model
    itself, accumulation micro-steps skip the reduce-scatter, the gradient norm is the global one over the shards, every
    rank takes part in evaluation, and a checkpoint is the full state every rank helps gather and rank 0 writes."""

    name = "fsdp"

    def __init__(self, dist):
        super().__init__(dist)
        self.sharded = True
        self.model = None

    def shard(self, model) -> None:
        fsdp_mod.wrap(model, self.dist.grad_compression, self.dist.offload)  # before the optimizer is built
        self.model = model

    def wrap(self, model, device) -> None:
        self.forward = model

    def no_sync(self):
        return fsdp_mod.no_sync(self.model)

    def oom_action(self, forwarding: bool) -> str:
        # an OOM inside a sharded forward or backward leaves the other ranks in its collectives: fatal; one before the
        # forward keeps every rank in step, and this rank joins the window's remaining micro-steps with a zero loss
        return "fatal" if forwarding else "join"

    def grad_norm(self, gnorm):
        return fsdp_mod.scalar(gnorm)  # the global norm of the sharded gradients (a DTensor)

    def _gather_full(self, model, optimizer):
        return fsdp_mod.full_state(model, optimizer)

    def load(self, model, optimizer, weights: dict, optim_state: dict, trainable: set, path) -> None:
        """Every rank reads the full state and keeps its shard."""
        missing = trainable - set(weights)
        unexpected = sorted(set(weights) - {n for n, _ in model.named_parameters()})
        if unexpected or missing:
            raise TrainpipeError(f"Checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}).")
        fsdp_mod.load_full_state(model, optimizer, weights, optim_state)

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return self._sharded_eval(run, mark)

    def release(self, model) -> bool:
        """Gather the weights on every rank and take FSDP off the model, so that rank 0 evaluates and exports a plain model."""
        if not self.sharded:
            return False
        fsdp_mod.release(model)
        self.sharded = False
        return True


class DeepSpeed(DDP):
    """Several processes under DeepSpeed's ZeRO engine (distributed/zero.py): ZeRO-2 partitions the optimizer state and the
    gradients (every rank keeps the whole model: rank 0 evaluates), ZeRO-3 the parameters too (every forward gathers them:
    every rank evaluates, as under FSDP). The loop's window, denominators, schedule and checkpoints stay trainpipe's."""

    def __init__(self, dist):
        super().__init__(dist)
        self.stage = 3 if dist.strategy == "zero3" else 2
        self.name, self.sharded = dist.strategy, self.stage == 3
        self.engine = self.model = self.base = self.zopt = None
        self.groups: list[list[str]] = []
        zero_mod.hook_state(self)

    def wrap(self, model, device) -> None:
        self.model = model  # the engine is built in attach, when the optimizer exists

    def attach(self, optimizer, max_grad_norm: float, loss_scaling: bool = False):
        if loss_scaling:
            raise TrainpipeError(
                f"`distributed.strategy: {self.name}` with fp16 mixed precision: torch's loss scaler cannot see the gradients ZeRO "
                "keeps in its partitions. Train in bf16 (`training.bf16: true`, Ampere GPUs and newer) or fp32 under ZeRO, or use "
                "`distributed.strategy: fsdp` or `ddp` with fp16."
            )
        if self.engine is not None:  # attached already: the engine wraps trainpipe's optimizer once
            return self.zopt
        # the micro-batch in DeepSpeed's config is bookkeeping only (its batch-size check); the loop's stepper sizes the batches
        cfg = zero_mod.engine_config(self.stage, 1, self.world, max_grad_norm, self.dist.offload)
        self.engine, self.zopt, self.groups = zero_mod.initialize(self.model, optimizer, cfg)
        self.base, self.forward = optimizer, self.engine
        return self.zopt

    def no_sync(self):
        return nullcontext()  # the loop owns the boundary: each backward reduces into the partitions, the step is the boundary

    def scale_loss(self, loss):
        return loss * self.world  # ZeRO averages the gradients over the ranks; the window's gradient is their sum

    def oom_action(self, forwarding: bool) -> str:
        # every backward reduces (a collective) and a ZeRO-3 forward gathers: an OOM inside either leaves the other ranks
        # waiting; one before the forward keeps every rank in step and this rank joins the window with zero losses
        return "fatal" if forwarding else "join"

    def grad_norm(self, gnorm):
        return self.zopt.grad_norm()

    def _gather_full(self, model, optimizer):
        weights, osd = zero_mod.full_state(model, self.groups, self.base, self.engine.optimizer)
        return (weights, osd) if self.is_main else ({}, {})

    def load(self, model, optimizer, weights: dict, optim_state: dict, trainable: set, path) -> None:
        """Every rank reads the full state and sets its partitions from it."""
        missing = trainable - set(weights)
        unexpected = sorted(set(weights) - {n for n, _ in model.named_parameters()})
        if unexpected or missing:
            raise TrainpipeError(f"Checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}).")
        zero_mod.load_full_state(model, self.groups, self.base, self.engine.optimizer, weights, optim_state, self.stage)

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return self._sharded_eval(run, mark) if self.sharded else super().evaluate(run, shards, mark)

    def release(self, model) -> bool:
        """Every parameter whole and plain on every rank, DeepSpeed off the model (so that rank 0 evaluates and exports)."""
        if self.engine is None:
            return False
        zero_mod.release(self.engine, model, self.stage)
        self.engine, self.sharded, self.forward = None, False, model
        return True

    def describe(self) -> dict:
        return {**super().describe(), "zero_stage": self.stage, "offload": self.dist.offload}


def make(dist) -> Strategy:
    """The strategy of a run: one process (``dist`` None or a world of 1), FSDP2 (`distributed.strategy: fsdp`), DeepSpeed
    ZeRO (`zero2`, `zero3`), else DDP."""
    if dist is None or dist.env.world_size <= 1:
        return Single()
    if dist.strategy in ("zero2", "zero3"):
        return DeepSpeed(dist)
    return FSDP(dist) if dist.strategy == "fsdp" else DDP(dist)
