"""How the training loop runs on one process or several: the :class:`Strategy` protocol and its implementations.

The loop (train/loop.py) never asks how many processes there are or how the model is spread over them, and nothing
outside ``distributed/`` compares a strategy's name: a strategy carries its topology (:attr:`~Strategy.dims`, the
:class:`~trainpipe.distributed.topology.ParallelDims` the planner resolved) and its capabilities
(:attr:`~Strategy.caps`: `shards_parameters`, `needs_full_state_gather`, what an OOM means), and implements the
mechanics (14 members; torchtitan's parallel dims, Lightning Fabric's strategies):

- :meth:`~Strategy.wrap`: before the optimizer is built (FSDP2 shards in place) and after it (DDP wraps, DeepSpeed builds
  its engine around the optimizer); :attr:`~Strategy.forward` is what forwards run through;
- :meth:`~Strategy.no_sync` for accumulation micro-steps, :meth:`~Strategy.reduce` (one all-reduce per step: the loss,
  the figures, an OOM flag and a stop flag, so every rank takes the same decision at the same step),
  :meth:`~Strategy.grad_norm`;
- :meth:`~Strategy.checkpoint` (every rank's RNG and PowerSGD state gathered, the full FSDP / ZeRO state gathered, rank 0
  writes, the others wait for its outcome), :meth:`~Strategy.load` (a full checkpoint into a sharded or a plain model),
  :meth:`~Strategy.evaluate` (sharded over the ranks, or rank 0's figure broadcast), :meth:`~Strategy.release`.

What follows from the topology alone is a function of this module, not a member: :func:`scale_loss` (the gradients are
averaged over the data-parallel ranks; the window's gradient is their sum), :func:`oom_action`, :func:`gather`,
:func:`stop_signal`, :func:`hang_watchdog`, and the figures a run records (:func:`describe`, :func:`world_fields`,
:func:`oom_fields`).

:class:`Single` (one process), :class:`DDP` (distributed/ddp.py), :class:`FSDP` (distributed/fsdp.py),
:class:`DeepSpeed` (distributed/zero.py) and :class:`TensorParallel` (distributed/tensor_parallel.py, alone or 2-D
with FSDP2) implement it, none inheriting another (what they share is a function here).
:func:`make` picks one from the run's resolved distributed spec.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Protocol

from trainpipe.distributed import ddp as ddp_mod
from trainpipe.distributed import fsdp as fsdp_mod
from trainpipe.distributed import tensor_parallel as tp_mod
from trainpipe.distributed import zero as zero_mod
from trainpipe.distributed.env import all_reduce_sum, broadcast_object, gather_objects, sharded_eval
from trainpipe.distributed.topology import Capabilities, ParallelDims, capabilities
from trainpipe.errors import TrainpipeError
from trainpipe.model.checkpoints import CheckpointFailed

Mark = Callable[[str], None]  # the loop's heartbeat: this rank's phase ("compute", "wait", "eval", "checkpoint")


class Strategy(Protocol):
    """The mechanics of one topology (14 members): wrapping, no-sync, the reductions, gathering and loading state,
    evaluation. What follows from the topology alone (the loss scale, the OOM action, the figures a run records) is a
    function of this module over :attr:`dims` and :attr:`caps`, not a member."""

    name: str  # "single", "ddp", "fsdp", "zero2", "zero3": what the run manifest records (callers ask `caps`, never the name)
    rank: int
    dims: ParallelDims  # the topology: `dims.world` processes, `dims.dp` data-parallel ranks
    caps: Capabilities  # what the strategy can do (distributed/topology.py)
    forward: object  # what forwards run through

    @property
    def shards_parameters(self) -> bool: ...  # the parameters are shards now (False once released)
    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False): ...  # twice: see Single.wrap
    def no_sync(self): ...
    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple: ...
    def grad_norm(self, gnorm): ...
    def checkpoint(self, write: Callable[[dict], object], capture_rng: Callable[[], dict], model, optimizer, mark: Mark): ...
    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None: ...
    def evaluate(self, run: Callable[[], object], shards: bool, mark: Mark) -> tuple[object, dict]: ...
    def release(self, model) -> bool: ...


class Single:
    """One process: every collective is a no-op, an OOM is the step's own to recover from."""

    name, rank, dims, caps = "single", 0, ParallelDims(), capabilities("single", 1)
    shards_parameters = False

    def __init__(self):
        self.forward = None

    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False):
        """Called twice: before the optimizer exists (``optimizer`` None; FSDP2 shards here) and after it (DDP wraps, DeepSpeed
        builds its engine). Returns the optimizer the loop and the stepper step (DeepSpeed: its engine's step over the
        partitions; ``optimizer`` itself everywhere else). ``loss_scaling``: the stepper scales fp16 losses (torch's GradScaler)."""
        if optimizer is not None:
            self.forward = model
        return optimizer

    def no_sync(self):
        return nullcontext()

    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        return total, extras, 0.0, False

    def grad_norm(self, gnorm):
        return gnorm

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        return write({})

    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None:
        """The checkpoint's weights and optimizer state (``state["optimizer"]``) into the model; returns what was done with
        the strategy's own state (DDP's PowerSGD), or None."""
        _load_plain(model, optimizer, weights, state, trainable, path)
        return None

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return run(), {}

    def release(self, model) -> bool:
        return False


class DDP:
    """Several processes, each with the whole model inside DistributedDataParallel (distributed/ddp.py). Rank 0
    evaluates and writes; an OOM on one rank becomes every rank's OOM at the step's all-reduce."""

    name, shards_parameters = "ddp", False

    def __init__(self, dist):
        self.dist, self.rank, self.forward, self.ddp = dist, dist.env.rank, None, None
        self.dims, self.caps = dist.topology, capabilities("ddp", dist.env.world_size)

    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False):
        if optimizer is not None:
            self.ddp = ddp_mod.wrap(model, device, self.dist.grad_compression)
            self.forward = self.ddp
        return optimizer

    def no_sync(self):
        return self.ddp.no_sync()

    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        return _all_reduce(total, oom, stop, extras, device, mark)

    def grad_norm(self, gnorm):
        return gnorm

    def _powersgd(self):
        """The live PowerSGD state of this rank's DDP hook (`distributed.grad_compression: powersgd`), else None."""
        return getattr(self.ddp, "trainpipe_hook_state", None) if self.ddp is not None else None

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        psgd = self._powersgd()
        return _checkpoint(self, write, capture_rng, mark, lambda: None,
                           powersgd=lambda: gather_objects(ddp_mod.powersgd_state_dict(psgd)) if psgd is not None else None)

    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None:
        _load_plain(model, optimizer, weights, state, trainable, path)
        return _load_powersgd(self, self._powersgd(), state, resuming, device)

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return _sharded_eval(self, run, mark, lockstep=False) if shards else _rank0_eval(self, run, mark)

    def release(self, model) -> bool:
        return False


class FSDP:
    """Several processes, the model sharded in place by FSDP2 (distributed/fsdp.py): forwards go through the model
    itself, accumulation micro-steps skip the reduce-scatter, the gradient norm is the global one over the shards, every
    rank takes part in evaluation, and a checkpoint is the full state every rank helps gather and rank 0 writes."""

    name = "fsdp"

    def __init__(self, dist):
        self.dist, self.rank, self.forward, self.model = dist, dist.env.rank, None, None
        self.dims, self.caps = dist.topology, capabilities("fsdp", dist.env.world_size)
        self.shards_parameters = True

    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False):
        if optimizer is None:
            fsdp_mod.wrap(model, self.dist.grad_compression, self.dist.offload)  # before the optimizer is built
            self.model = model
        else:
            self.forward = model
        return optimizer

    def no_sync(self):
        return fsdp_mod.no_sync(self.model)

    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        return _all_reduce(total, oom, stop, extras, device, mark)

    def grad_norm(self, gnorm):
        return fsdp_mod.scalar(gnorm)  # the global norm of the sharded gradients (a DTensor)

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        return _checkpoint(self, write, capture_rng, mark, lambda: fsdp_mod.full_state(model, optimizer))

    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None:
        """Every rank reads the full state and keeps its shard."""
        _check_loaded(model, weights, trainable, path)
        fsdp_mod.load_full_state(model, optimizer, weights, state["optimizer"])
        return None

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        return _sharded_eval(self, run, mark, lockstep=self.shards_parameters)

    def release(self, model) -> bool:
        """Gather the weights on every rank and take FSDP off the model, so that rank 0 evaluates and exports a plain model."""
        if not self.shards_parameters:
            return False
        fsdp_mod.release(model)
        self.shards_parameters = False
        return True


class DeepSpeed:
    """Several processes under DeepSpeed's ZeRO engine (distributed/zero.py): ZeRO-2 partitions the optimizer state and the
    gradients (every rank keeps the whole model: rank 0 evaluates), ZeRO-3 the parameters too (every forward gathers them:
    every rank evaluates, as under FSDP). The loop's window, denominators, schedule and checkpoints stay trainpipe's."""

    def __init__(self, dist):
        self.dist, self.rank, self.forward = dist, dist.env.rank, None
        self.stage = 3 if dist.strategy == "zero3" else 2
        self.name = dist.strategy
        self.dims, self.caps = dist.topology, capabilities(dist.strategy, dist.env.world_size)
        self.shards_parameters = self.caps.shards_parameters
        self.engine = self.model = self.base = self.zopt = None
        self.groups: list[list[str]] = []
        zero_mod.hook_state(self)

    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False):
        if optimizer is None:
            return None
        self.model = model
        if loss_scaling:
            raise TrainpipeError(
                f"`distributed.strategy: {self.name}` with fp16 mixed precision: torch's loss scaler cannot see the gradients ZeRO "
                "keeps in its partitions. Train in bf16 (`training.bf16: true`, Ampere GPUs and newer) or fp32 under ZeRO, or use "
                "`distributed.strategy: fsdp` or `ddp` with fp16."
            )
        if self.engine is not None:  # attached already: the engine wraps trainpipe's optimizer once
            return self.zopt
        # the micro-batch in DeepSpeed's config is bookkeeping only (its batch-size check); the loop's stepper sizes the batches
        cfg = zero_mod.engine_config(self.stage, 1, self.dims.dp * self.dims.cp, max_grad_norm, self.dist.offload)  # sequence ranks: data-parallel to ZeRO
        self.engine, self.zopt, self.groups = zero_mod.initialize(self.model, optimizer, cfg)
        self.base, self.forward = optimizer, self.engine
        return self.zopt

    def no_sync(self):
        return nullcontext()  # the loop owns the boundary: each backward reduces into the partitions, the step is the boundary

    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        return _all_reduce(total, oom, stop, extras, device, mark)

    def grad_norm(self, gnorm):
        return self.zopt.grad_norm()

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        def gather():
            weights, osd = zero_mod.full_state(model, self.groups, self.base, self.engine.optimizer)
            return (weights, osd) if self.rank == 0 else ({}, {})

        return _checkpoint(self, write, capture_rng, mark, gather)

    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None:
        """Every rank reads the full state and sets its partitions from it."""
        _check_loaded(model, weights, trainable, path)
        zero_mod.load_full_state(model, self.groups, self.base, self.engine.optimizer, weights, state["optimizer"], self.stage)
        return None

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        if self.shards_parameters:
            return _sharded_eval(self, run, mark, lockstep=True)
        return _sharded_eval(self, run, mark, lockstep=False) if shards else _rank0_eval(self, run, mark)

    def release(self, model) -> bool:
        """Every parameter whole and plain on every rank, DeepSpeed off the model (so that rank 0 evaluates and exports)."""
        if self.engine is None:
            return False
        zero_mod.release(self.engine, model, self.stage)
        self.engine, self.shards_parameters, self.forward = None, False, model
        return True


class TensorParallel:
    """Several processes with a tensor degree above 1 (`distributed.tensor_parallel`, distributed/tensor_parallel.py): each
    weight matrix split over the ranks of a tensor group with torch's DTensor, and under `distributed.strategy: fsdp` with
    several data-parallel ranks FSDP2 over those (2-D: a device mesh dp_shard x tp, the tensor ranks consecutive). The
    ranks of a tensor group read the same examples and compute the same loss; only the group's first rank counts it in the
    step's all-reduce. Every rank evaluates every batch (each forward is a collective of the tensor group); a checkpoint is
    the full state gathered from the DTensors, in one process's layout."""

    def __init__(self, dist):
        self.dist, self.rank, self.forward, self.model, self.hooks = dist, dist.env.rank, None, None, []
        self.dims, self.caps = dist.topology, capabilities(dist.strategy, dist.env.world_size, dist.topology.tp)
        self.name, self.shards_parameters = dist.strategy, True

    def wrap(self, model, device, optimizer=None, *, max_grad_norm: float = 0.0, loss_scaling: bool = False):
        if optimizer is not None:
            self.forward = model
            return optimizer
        from torch.distributed.device_mesh import init_device_mesh

        d = self.dims
        mesh = init_device_mesh(device.type, (d.dp, d.tp), mesh_dim_names=("dp_shard", "tp"))  # tp fastest: dims.dp_rank
        self.hooks = tp_mod.parallelize(model, mesh["tp"], d.tp)
        if d.dp > 1:
            fsdp_mod.wrap(model, self.dist.grad_compression, self.dist.offload, mesh=mesh["dp_shard"])
        self.model = model
        return None

    def no_sync(self):
        return fsdp_mod.no_sync(self.model) if self.dims.dp > 1 else nullcontext()

    def reduce(self, total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
        if self.rank % self.dims.tp:  # the tensor group's loss is one loss: its first rank carries it
            total, extras = total * 0.0, {k: 0.0 for k in extras}
        return _all_reduce(total, oom, stop, extras, device, mark)

    def grad_norm(self, gnorm):
        return float(gnorm)  # clip_grad_norm below computed the global norm over the DTensor shards already

    def checkpoint(self, write, capture_rng, model, optimizer, mark: Mark):
        return _checkpoint(self, write, capture_rng, mark, lambda: fsdp_mod.full_state(model, optimizer))

    def load(self, model, optimizer, weights: dict, state: dict, trainable: set, path, *, resuming: bool, device) -> str | None:
        """Every rank reads the full state and keeps its slices (and shards)."""
        _check_loaded(model, weights, trainable, path)
        fsdp_mod.load_full_state(model, optimizer, weights, state["optimizer"])
        return None

    def evaluate(self, run, shards: bool, mark: Mark) -> tuple[object, dict]:
        mark("eval")  # every rank runs every batch in lockstep (no eval shard): rank 0's figure counts
        metric = broadcast_object(run())
        mark("compute")
        return metric, {}

    def release(self, model) -> bool:
        """Every weight gathered whole on every rank, FSDP and the tensor-parallel hooks off the model (rank 0 evaluates and exports)."""
        if not self.shards_parameters:
            return False
        if self.dims.dp > 1:
            fsdp_mod.release(model)
        tp_mod.release(model, self.hooks)
        self.shards_parameters, self.hooks = False, []
        return True


def make(dist) -> Strategy:
    """The strategy of a run: one process (``dist`` None or a world of 1), FSDP2 (`distributed.strategy: fsdp`), DeepSpeed
    ZeRO (`zero2`, `zero3`), else DDP."""
    if dist is None or dist.env.world_size <= 1:
        return Single()
    if dist.topology.tp > 1:
        return TensorParallel(dist)
    if dist.strategy in ("zero2", "zero3"):
        return DeepSpeed(dist)
    return FSDP(dist) if dist.strategy == "fsdp" else DDP(dist)


# ------------------------------------------------------------------ the mechanics the implementations share (no inheritance)
def _all_reduce(total, oom: bool, stop: bool, extras: dict, device, mark: Mark) -> tuple:
    """One all-reduce per step: the loss, the figures, an OOM flag and a stop flag, so that every rank decides alike."""
    import torch

    names = sorted(extras)
    mark("wait")
    red = all_reduce_sum([float(total), float(oom), float(stop), *(extras[k] for k in names)], device)
    mark("compute")
    return torch.tensor(red[0]), dict(zip(names, red[3:])), red[1], bool(red[2])


def _checkpoint(s, write, capture_rng, mark: Mark, gather_full: Callable[[], object], powersgd: Callable[[], object] = lambda: None):
    """Every rank calls this: rank 0 writes (with every rank's RNG state), the others wait for its outcome, so that a failed
    write stops (or continues) all of them alike. ``gather_full``: the full state every rank helps gather (FSDP, ZeRO)."""
    mark("wait")
    rngs = gather_objects(capture_rng())
    psgd_ranks = powersgd()
    gathered = gather_full()
    info, outcome = None, None
    if s.rank == 0:
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


def _load_powersgd(s, psgd, state: dict, resuming: bool, device) -> str | None:
    """A rollback (same processes, same DDP) gives each rank its own PowerSGD state back from the checkpoint (iteration
    count, projections, its error feedback), keyed by the gradient buckets it was saved with. A resume re-warms
    PowerSGD from scratch (plain all-reduce for its first steps again), as stated in `checkpoint_resumed` and the
    manifest: the new processes' DDP lays its buckets out anew (and rebuilds them after its first step), so the saved
    per-bucket residuals and P/Q would land on other parameters; restoring them made a resumed 2-process run differ
    from the uninterrupted one by 3e-4 (not bit-exact) in a test, so they are not restored. Returns what was done."""
    saved = state.get("powersgd_ranks")
    if psgd is None:
        return None
    start = ddp_mod.POWERSGD_START_STEP
    if resuming:
        return (f"re-warmed from scratch (a resumed run's DDP lays out its gradient buckets anew, so the saved per-bucket "
                f"state does not apply): plain all-reduce for {start} steps, then rank-1 compression")
    if saved and len(saved) == s.dims.world:
        ddp_mod.load_powersgd_state(psgd, saved[s.rank], device)
        return f"restored (iteration {int(saved[s.rank]['iter'])}, every rank's error feedback)"
    why = f"the checkpoint holds the state of {len(saved)} rank(s), this run has {s.dims.world}" if saved else "the checkpoint holds no PowerSGD state"
    return f"re-warmed from scratch ({why}): plain all-reduce for {start} steps, then rank-1 compression"


def _load_plain(model, optimizer, weights: dict, state: dict, trainable: set, path) -> None:
    result = model.load_state_dict(weights, strict=False)
    missing = trainable - set(weights)
    if result.unexpected_keys or missing:
        raise TrainpipeError(f"Checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, unexpected {result.unexpected_keys[:3]}).")
    optimizer.load_state_dict(state["optimizer"])


def _check_loaded(model, weights: dict, trainable: set, path) -> None:
    missing = trainable - set(weights)
    unexpected = sorted(set(weights) - {n for n, _ in model.named_parameters()} - {n for n, _ in model.named_buffers()})
    if unexpected or missing:
        raise TrainpipeError(f"Checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}).")


def _rank0_eval(s, run, mark: Mark) -> tuple[object, dict]:
    mark("eval" if s.rank == 0 else "wait")  # rank 0 evaluates (the weights are the same on every rank); all take its figure
    metric = broadcast_object(run() if s.rank == 0 else None)
    mark("compute")
    return metric, {}


def _sharded_eval(s, run, mark: Mark, lockstep: bool) -> tuple[object, dict]:
    """Rank r evaluates batches r, r + world, ... and the sums of losses and loss tokens are all-reduced, so the figure is
    one process's over the whole set (evaluate/evaluator.eval_loss, evaluate/shard.py). With sharded parameters
    (``lockstep``) every other evaluation runs whole on every rank (a sharded forward needs every rank); rank 0's figure counts."""
    mark("eval")
    with sharded_eval(s.rank, s.dims.world, lockstep=lockstep) as shard:
        metric = run()
    metric = broadcast_object(metric)
    fields = {"eval_ranks": s.dims.world, "eval_loss_tokens_per_rank": shard.counts} if shard.used else {}
    mark("compute")
    return metric, fields


# ------------------------------------------------------------------ what follows from the topology alone (not members)
def is_main(s: Strategy) -> bool:
    """Rank 0 (or the only process): it speaks for the run (events, metrics, checkpoints, exports)."""
    return s.rank == 0


def scale_loss(s: Strategy, loss):
    """The backward's loss: DDP, FSDP and ZeRO average the gradients over the ranks that hold different tokens (the
    data-parallel ranks, and the sequence ranks of each: `dims.dp x dims.cp`; tensor ranks hold slices of one gradient);
    the window's gradient is their sum, so the loss is scaled by that count (one process: the loss itself)."""
    return loss if s.dims.world == 1 else loss * (s.dims.dp * s.dims.cp)


def clip_grad_norm(s: Strategy, params: list, max_norm: float) -> float:
    """The window's gradients clipped to ``max_norm``; returns the global norm before clipping. A tensor degree above 1 mixes
    DTensor slices and whole weights (distributed/tensor_parallel.py); everywhere else torch's own clipping."""
    import torch

    if s.dims.tp > 1:
        return tp_mod.clip_grad_norm(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def before_sync_backward(s: Strategy, mark: Mark) -> None:
    """The window's last backward ends in the gradient reduction: this rank is waiting in a collective."""
    if s.dims.world > 1:
        mark("wait")


def oom_action(s: Strategy, forwarding: bool) -> str:
    """What an OOM on this rank means: "raise" (one process retries the window alone), "break" (DDP: the micro-steps before
    the last keep their gradients local; the all-reduce is joined after), "join" (sharded, before the forward: every rank
    is still in step and this rank joins the window with zero losses), "fatal" (inside a sharded forward or backward the
    other ranks wait in its collectives). Under sequence parallelism every forward is a collective of the sequence group
    (Ulysses' all-to-alls), so an OOM before the forward joins and one inside it is fatal, whatever the strategy."""
    if s.dims.cp > 1 and s.caps.oom_before_forward != "raise":
        return "fatal" if forwarding else "join"
    return s.caps.oom_in_forward if forwarding else s.caps.oom_before_forward


def gather(s: Strategy, obj) -> list:
    return [obj] if s.dims.world == 1 else gather_objects(obj)


def stop_signal(s: Strategy, local: str | None, agreed: str | None) -> str | None:
    """The stop the loop obeys: this process's own signal, or under several processes the one every rank agreed on."""
    return local if s.dims.world == 1 else agreed


def hang_watchdog(s: Strategy, *, run_dir, progress, emit):
    """The cross-rank hang watchdog of several processes (distributed/ddp.py); None for one process (the loop's own
    stack-dumping watchdog, `training.hang_timeout_seconds`)."""
    if s.dims.world == 1:
        return None
    import torch

    backend = torch.distributed.get_backend()
    return ddp_mod.HangWatchdog(rank=s.rank, world=s.dims.world, timeout=s.dist.timeout_seconds, run_dir=run_dir, progress=progress,
                                emit=emit, event="nccl_timeout" if backend == "nccl" else "distributed_hang")


def describe(s: Strategy) -> dict:
    """What the run manifest records of the strategy beside its name and world size."""
    dist = getattr(s, "dist", None)
    out = {"grad_compression": dist.grad_compression if dist else "none", "launcher": dist.env.launcher if dist else None}
    if isinstance(s, DeepSpeed):
        out.update({"zero_stage": s.stage, "offload": s.dist.offload})
    if s.dims.world > 1:
        out["topology"] = s.dims.describe()
    return out


def world_fields(s: Strategy, effective: int, micro_batch: int, resumed_world: int | None) -> dict:
    """What events say of the topology: nothing for one process, unless it resumed a run of another world size."""
    if s.dims.world == 1 and resumed_world is None:
        return {}
    return {"world_size": s.dims.world, "rank": s.rank, "per_rank_accumulation": math.ceil(effective / (micro_batch * s.dims.dp))}


def oom_fields(s: Strategy, effective: int, micro_batch: int, resumed_world: int | None, oom_ranks: list[int]) -> dict:
    """What an OOM recovery event says of the other ranks (several processes: every rank is in the recovery together):
    each rank's micro-batch after the decision, gathered, and the ranks that ran out of memory."""
    if s.dims.world == 1:
        return {}
    return {**world_fields(s, effective, micro_batch, resumed_world), "micro_batch_per_rank": gather_objects(micro_batch),
            "ranks_out_of_memory": oom_ranks}
