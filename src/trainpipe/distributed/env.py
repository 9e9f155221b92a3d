"""The process's place in a distributed run, read from the environment its launcher set.

torchrun (and ``trainpipe run --nproc-per-node``, which uses torchrun's elastic agent) sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``; ``accelerate launch``
sets the same variables (plus ``ACCELERATE_*``). Without them the run is one process (world size 1) and
nothing here touches torch.distributed, so single-process behaviour is exactly what it was.

The planner will own the world size once its resolver takes one (``plan_run(cfg, hw, world_size=...)``);
until then :func:`fit_accumulation` makes micro-batch x accumulation x world size equal the effective batch.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from trainpipe import ui
from trainpipe.errors import TrainpipeError
from trainpipe.events import EVENT_NAMES, LEVELS


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str | None = None  # "torchrun" | "accelerate" | None (one process)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect(environ: dict | None = None) -> DistEnv:
    """This process's rank and world from the launcher's environment variables (one process when there are none)."""
    e = os.environ if environ is None else environ
    if "WORLD_SIZE" not in e or "RANK" not in e:
        return DistEnv()
    world = int(e["WORLD_SIZE"])
    launcher = "accelerate" if any(k.startswith("ACCELERATE_") for k in e) else "torchrun"
    return DistEnv(
        rank=int(e["RANK"]), local_rank=int(e.get("LOCAL_RANK", e["RANK"])), world_size=world,
        local_world_size=int(e.get("LOCAL_WORLD_SIZE", world)), launcher=launcher,
    )


def is_main() -> bool:
    return detect().is_main


def backend_for(requested: str, cuda: bool) -> str:
    """`auto`: NCCL when this process has a GPU, gloo otherwise."""
    if requested != "auto":
        return requested
    return "nccl" if cuda else "gloo"


def init(backend: str = "auto", timeout_seconds: float = 600.0) -> DistEnv:
    """Join the process group of this run (once); a no-op for a single process.

    The group's own timeout is set well above ``timeout_seconds``: the hang watchdog (distributed/ddp.py) fires at
    ``timeout_seconds`` and names the rank; the backend's timeout only backs it up."""
    env = detect()
    if not env.distributed:
        check_single_process_launch()
        return env
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return env
    cuda = torch.cuda.is_available()
    be = backend_for(backend, cuda)
    if be == "nccl" and not cuda:
        raise TrainpipeError(
            f"`distributed.backend: nccl` needs CUDA GPUs, and this process (rank {env.rank}) has none. "
            "Use `distributed.backend: gloo` (or `auto`) to train on the CPU."
        )
    if be == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend=be, timeout=datetime.timedelta(seconds=2 * timeout_seconds + 30))
    if not env.is_main:
        silence_console()
    follow_agent()
    return env


def follow_agent(environ: dict | None = None) -> None:
    """A worker of torch's elastic agent (torchrun, `trainpipe run --nproc-per-node`, accelerate) ends when its agent
    is killed: an agent killed outright (SIGKILL, its node going down) leaves its workers behind, training on with the
    other nodes, which then wait for that node's agent forever. The worker stops as a lost node does (exit 5, nothing
    written); the other ranks see its connection close and name it (`distributed_hang`)."""
    import threading

    e = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in e:
        return
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(0.5)
        print(f"trainpipe: rank {detect().rank}: this node's launcher (pid {agent}) is gone; stopping as a lost node (exit 5).",
              file=sys.stderr, flush=True)
        os._exit(5)

    threading.Thread(target=watch, name="trainpipe-follow-agent", daemon=True).start()


def check_single_process_launch(environ: dict | None = None) -> None:
    """`accelerate launch --cpu --num_processes N` (N > 1) without an MPI host file starts ONE process: accelerate's
    multi-CPU mode expects `mpirun` to start the others, and sets MASTER_ADDR but no RANK / WORLD_SIZE. Training would
    silently run on one process with a plan for N; stop instead and name the launch lines that start N workers."""
    e = os.environ if environ is None else environ
    mpi = any(k in e for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"))
    if e.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") and "MASTER_ADDR" in e and "WORLD_SIZE" not in e and not mpi:
        raise TrainpipeError(
            "`accelerate launch --cpu` with more than one process started a single process: accelerate's multi-CPU mode leaves "
            "starting the other processes to `mpirun` (`--mpirun_hostfile`), so this process has no RANK or WORLD_SIZE and would "
            "train alone. Start the workers with `accelerate launch --multi_gpu --num_processes N -m trainpipe.cli run CONFIG` "
            "(torchrun underneath; on a machine without GPUs the workers use gloo on the CPU), `trainpipe run CONFIG "
            "--nproc-per-node N`, or `torchrun --nproc-per-node N -m trainpipe.cli run CONFIG`."
        )


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def silence_console() -> None:
    """Ranks other than 0 print nothing through trainpipe's console (rank 0 speaks for the run); errors still reach
    stderr through the CLI."""
    from rich.console import Console

    ui._console = Console(file=open(os.devnull, "w"), no_color=True)  # noqa: SIM115 - lives as long as the process


def device_for(env: DistEnv):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank if env.distributed else torch.cuda.current_device())
    return torch.device("cpu")


def fit_accumulation(micro_batch: int, target_effective: int, world: int) -> int:
    """Accumulation steps so that micro-batch x accumulation x world >= the target effective batch."""
    return max(1, math.ceil(target_effective / (micro_batch * world)))


# ------------------------------------------------------------------------------ collectives (no-ops for one process)


# what gloo / NCCL / the TCP store say on the ranks still waiting when another rank's process has ended
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def peer_gone(exc: BaseException) -> bool:
    """Whether a collective failed because another rank's process (or its node) ended."""
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in PEER_GONE)


class PeerLeft(TrainpipeError):
    """This rank waited for the others and one of them had ended (it printed why). Not the run's own error: the CLI
    reports it as one line on this rank's stderr, and `trainpipe run --nproc-per-node` not at all when the rank that
    left said why (launch.py)."""

    exit_code = 5
    title = "another rank left the run"

    def __init__(self, rank: int, cause: BaseException):
        super().__init__(f"rank {rank} was waiting at a barrier when another rank's process ended "
                         f"({' '.join(str(cause).split())[:200]}); that rank's own error says why.")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as exc:  # torch's DistBackendError too
            if not peer_gone(exc):
                raise
            raise PeerLeft(dist.get_rank(), exc) from exc


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float], device=None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks (float64 on the wire)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class EvalShard:
    """This rank's share of an evaluation under several processes (train/loop.py sets it around its eval; the evaluator
    reads it with :func:`current_eval_shard`). Batch k of the eval set goes to rank ``k % world``; ``lockstep`` (FSDP,
    where every forward is a collective) gives every rank the same number of forwards, a rank short of batches
    repeating one uncounted. :meth:`reduce` sums the losses and loss tokens over the ranks, so the mean is the one a
    single process computes over the whole set."""

    def __init__(self, rank: int, world: int, lockstep: bool):
        self.rank, self.world, self.lockstep = rank, world, lockstep
        self.used = False
        self.counts: list[int] = []  # loss tokens each rank evaluated, after reduce

    def assign(self, starts) -> list[tuple[int, bool]]:
        """(batch start, counted) for this rank from the starts of every batch."""
        starts = list(starts)
        mine = [(i, True) for i in starts[self.rank :: self.world]]
        if self.lockstep and starts:
            mine += [(starts[0], False)] * (math.ceil(len(starts) / self.world) - len(mine))
        self.used = True
        return mine

    def reduce(self, total: float, count: int) -> tuple[float, int]:
        own = [0.0] * self.world
        own[self.rank] = float(count)
        red = all_reduce_sum([total, float(count), *own])
        self.counts = [int(x) for x in red[2:]]
        return red[0], int(red[1])


# the shard of the evaluation running in this context: set only inside `sharded_eval` / `outside_eval_shard` and reset when
# the block ends (a context variable, not a module attribute that callers reassign)
_EVAL_SHARD: ContextVar[EvalShard | None] = ContextVar("trainpipe_eval_shard", default=None)


def current_eval_shard() -> EvalShard | None:
    """The evaluation shard of this rank while train/loop.py evaluates under several processes, else None."""
    return _EVAL_SHARD.get()


@contextmanager
def sharded_eval(rank: int, world: int, lockstep: bool):
    token = _EVAL_SHARD.set(EvalShard(rank, world, lockstep))
    try:
        yield _EVAL_SHARD.get()
    finally:
        _EVAL_SHARD.reset(token)


@contextmanager
def outside_eval_shard():
    """Measure on this process alone inside a sharded eval (rank 0's forgetting sets): no shard until the block ends."""
    token = _EVAL_SHARD.set(None)
    try:
        yield
    finally:
        _EVAL_SHARD.reset(token)


class NullEventLog:
    """The event log of ranks other than 0: the same checks as trainpipe.events.EventLog, nothing written (rank 0
    writes the run's events)."""

    path = None
    echo = None

    def emit(self, event: str, *, step: int = 0, level: str = "info", **fields) -> dict:
        if event not in EVENT_NAMES or level not in LEVELS:
            raise ValueError(f"unknown event {event!r} or level {level!r}")
        return {"event": event, "level": level, "step": int(step), **fields}


def follow_rank0():
    """What rank 0 shares before training (the resume point); a rank 0 that stopped on an error before sharing it
    (a refused run directory, a config change) ends this rank with one line instead of a backend traceback."""
    try:
        return broadcast_object(None)
    except RuntimeError:
        raise SystemExit(f"trainpipe: rank {detect().rank}: rank 0 stopped before training started; its error above says why.") from None


def same_effective_batch(checkpoint_dir, t) -> bool:
    """Whether resuming the checkpoint in ``checkpoint_dir`` under this process's world size keeps its effective batch
    with training settings ``t`` (the accumulation the resolver chose for another world size may differ)."""
    import json
    from pathlib import Path

    try:
        state = json.loads((Path(checkpoint_dir) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    eff = state.get("effective_batch")
    mb, acc = t.per_device_train_batch_size, t.gradient_accumulation_steps
    return bool(eff) and isinstance(mb, int) and isinstance(acc, int) and mb * acc * detect().world_size == eff
