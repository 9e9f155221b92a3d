"""DDP around the model, gradient compression, and the hang watchdog of a distributed run.

- :func:`wrap`: ``DistributedDataParallel`` with ``broadcast_buffers=False`` (a causal LM's buffers, rotary
  frequencies, are the same on every rank, and a buffer broadcast in every forward would be a collective that
  ranks must pair up even when one skips a micro-step after an OOM), plus the communication hook of
  ``distributed.grad_compression``.
- :class:`HangWatchdog`: every rank publishes, once a second, which step it is on, what it is doing
  (``compute`` / ``wait`` in a collective / ``eval``) and for how long it has made no progress, in the
  launcher's key-value store. A rank computing without progress for longer than ``distributed.timeout_seconds``
  is named; every rank dumps its stacks, rank 0 writes ``distributed_hang`` (``nccl_timeout`` under NCCL)
  naming it, and all exit with ``EXIT_HANG``. A rank whose record stops changing for longer than the timeout (its
  process or its whole node is gone) is named the same way; a rank whose collective failed because the peer's
  connection closed waits for that verdict instead of crashing (:meth:`HangWatchdog.stop`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from trainpipe.distributed.env import PeerLeft, peer_gone
from trainpipe.errors import ConfigError

EXIT_HANG = 5
POWERSGD_START_STEP = 10  # plain all-reduce for the first steps (PowerSGD's warm-up, its paper's advice), then rank-1 compression
POWERSGD_RANK = 1


def unwrap(model):
    """The model inside a DDP wrapper (or the model itself): for generation, adapters, references and saving."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def wrap(model, device, grad_compression: str = "none"):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
    ddp.trainpipe_hook_state = register_compression(ddp, grad_compression)  # PowerSGD's state (checkpointed per rank), else None
    return ddp


def register_compression(ddp, kind: str):
    """`distributed.grad_compression` as a DDP communication hook (torch.distributed.algorithms.ddp_comm_hooks); returns
    PowerSGD's state for `powersgd` (None otherwise)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "none":
        return None
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        import torch.distributed as dist

        if dist.get_backend() == "gloo":  # gloo has no bfloat16 all-reduce: the first backward would fail inside the hook
            raise ConfigError("`distributed.grad_compression: bf16` needs a backend that all-reduces bfloat16 (NCCL, on GPUs); "
                              "these processes use gloo (the CPU), which has no bfloat16 reduction. Use `grad_compression: fp16` "
                              "or `powersgd`, or `none`.")
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START_STEP, use_error_feedback=True,
            warm_start=True, random_seed=0,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    else:
        raise ValueError(f"unknown grad_compression {kind!r}")
    return None


def powersgd_state_dict(state) -> dict:
    """This rank's PowerSGD state as plain tensors and numbers (a checkpoint loads with ``weights_only=True``): the
    iteration count (plain all-reduce until POWERSGD_START_STEP), the RNG that seeds new projections (the same on every
    rank), the warm-started P and Q of each bucket and this rank's own error-feedback residuals (different per rank)."""
    import torch

    kind, keys, pos, has_gauss, cached = state.rng.get_state()
    cpu = lambda d: {int(k): v.detach().to("cpu", copy=True) for k, v in d.items()}  # noqa: E731
    return {
        "iter": int(state.iter), "start_iter": int(state.start_powerSGD_iter), "matrix_rank": int(state.matrix_approximation_rank),
        "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "error": cpu(state.error_dict), "p": cpu(state.p_memory_dict), "q": cpu(state.q_memory_dict),
    }


def load_powersgd_state(state, sd: dict, device) -> None:
    """Restore :func:`powersgd_state_dict` into this rank's live PowerSGD state (its tensors moved to ``device``)."""
    r = sd["rng"]
    state.rng.set_state((r["kind"], r["keys"].numpy().astype("uint32"), r["pos"], r["has_gauss"], r["cached"]))
    state.iter = int(sd["iter"])
    for name, attr in (("error", "error_dict"), ("p", "p_memory_dict"), ("q", "q_memory_dict")):
        live = getattr(state, attr)
        live.clear()
        live.update({int(k): v.to(device) for k, v in sd[name].items()})


def _store():
    """A client of the launcher's key-value store (torchrun's agent store at MASTER_ADDR:MASTER_PORT), used only by the
    watchdog thread so that it never shares a socket with the training thread."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
    )


class HangWatchdog:
    """See the module docstring. ``progress()`` returns (step, phase, time of the last progress) of this rank."""

    def __init__(self, *, rank: int, world: int, timeout: float, run_dir: Path, progress: Callable[[], tuple[int, str, float]],
                 emit: Callable[..., None] | None, event: str = "distributed_hang", exit_code: int = EXIT_HANG):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.run_dir, self.progress, self.emit, self.event, self.exit_code = Path(run_dir), progress, emit, event, exit_code
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainpipe-hang-watchdog", daemon=True)
        self.interval = min(max(timeout / 6, 0.2), 1.0)
        self._waiting = False  # the training thread found a peer gone and waits for the verdict

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing. The loop calls this in its ``finally``; when the loop is unwinding because a collective
        found another rank's connection closed (a process or a node gone), this rank instead waits like a rank in a
        collective, so that the watchdog names the rank that went silent (``distributed_hang``, exit ``EXIT_HANG``)
        within the timeout. Without the key-value store (its host is the node that went), or when the rank that went
        published "done" (it left its loop on an error of its own, e.g. a full disk on rank 0, and said so), `PeerLeft`
        (exit 5) at once: no wait, so that the launcher's SIGTERM does not find this rank still waiting 30 s later."""
        exc = sys.exc_info()[1]
        if exc is not None and peer_gone(exc) and self._thread.is_alive():
            self._waiting = True
            self._thread.join(timeout=2 * self.timeout + 30)  # the watchdog ends the process when it fires
            raise PeerLeft(self.rank, exc) from exc
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            store = _store()
        except Exception as exc:  # noqa: BLE001 - without the store there is no cross-rank view; the backend's timeout still applies
            print(f"trainpipe: rank {self.rank}: hang watchdog off (no key-value store: {exc})", flush=True)
            return
        seen: dict[int, tuple[bytes, float]] = {}  # each rank's last record and when (this process's clock) it changed
        while not self._stop.wait(self.interval):
            step, phase, since = self.progress()
            stalled = time.time() - since
            phase = "wait" if self._waiting else phase
            try:
                store.set(f"trainpipe/hb/{self.rank}", json.dumps({"step": step, "phase": phase, "stalled": stalled}))
                keys = [f"trainpipe/hb/{r}" for r in range(self.world)]
                if not store.check(keys):
                    continue
                raw = [store.get(k) for k in keys]
            except Exception:  # noqa: BLE001 - the store's host is gone: stop() says PeerLeft
                return
            now = time.monotonic()
            for r, x in enumerate(raw):
                if seen.get(r, (None, 0.0))[0] != x:
                    seen[r] = (x, now)
            recs = [json.loads(x) for x in raw]
            if self._waiting and any(x["phase"] == "done" for r, x in enumerate(recs) if r != self.rank):
                return  # the rank that went left its loop on its own error (said by it): nobody to name, stop() says PeerLeft now
            silent = [r for r in range(self.world) if r != self.rank and recs[r]["phase"] != "done" and now - seen[r][1] > self.timeout]
            culprits = silent or self.culprits(recs, self.timeout)
            if culprits:
                self._fire(store, step, recs, culprits, silent)
                return
        try:  # left the loop: a rank that stops publishing now is not silent
            store.set(f"trainpipe/hb/{self.rank}", json.dumps({"step": self.progress()[0], "phase": "done", "stalled": 0.0}))
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def culprits(recs: list[dict], timeout: float) -> list[int]:
        """Ranks computing (not waiting in a collective, not evaluating on rank 0's behalf) with no progress for longer
        than ``timeout``; every rank when all of them have been stuck that long (a collective nobody completes)."""
        slow = [r for r, x in enumerate(recs) if x["phase"] not in ("wait", "eval", "done") and x["stalled"] > timeout]
        if slow:
            return slow
        if all(x["stalled"] > timeout and x["phase"] not in ("eval", "done") for x in recs):
            return list(range(len(recs)))
        return []

    def _fire(self, store, step: int, recs: list[dict], culprits: list[int], silent: list[int]) -> None:
        path = self.run_dir / f"hang-stacks-rank{self.rank}-step{step}.txt"
        with open(path, "w") as fh:
            fh.write(f"rank {self.rank}: step {step}, phase {recs[self.rank]['phase']}, {recs[self.rank]['stalled']:.1f} s without progress\n")
            faulthandler.dump_traceback(file=fh, all_threads=True)
        store.set(f"trainpipe/dumped/{self.rank}", str(path))
        if self.rank == 0:
            deadline = time.time() + 10
            keys = [f"trainpipe/dumped/{r}" for r in range(self.world) if r not in silent]  # a silent rank dumps nothing
            while time.time() < deadline and not store.check(keys):
                time.sleep(0.1)
            stacks = [store.get(k).decode() for k in keys if store.check([k])]
            if self.emit is not None:
                self.emit(
                    self.event, step=step, level="fatal", ranks=culprits,
                    phases={str(r): "gone (no heartbeat)" if r in silent else f"{x['phase']} at step {x['step']}, {x['stalled']:.1f} s without progress"
                            for r, x in enumerate(recs)},
                    seconds_without_progress=round(max(recs[r]["stalled"] for r in culprits), 1), gone=silent, timeout_seconds=self.timeout, stacks=stacks,
                    message=f"rank(s) {culprits} stopped answering at step {step}",
                )
            store.set("trainpipe/reported", "1")
        else:
            deadline = time.time() + 15
            while time.time() < deadline and not store.check(["trainpipe/reported"]):
                time.sleep(0.1)
        print(
            f"trainpipe: rank {self.rank}: {self.event}: rank(s) {culprits} made no progress for more than {self.timeout:g} s "
            f"(`distributed.timeout_seconds`) at step {step}; stacks in {path}. Exiting with {self.exit_code}.",
            file=sys.stderr, flush=True,
        )
        os._exit(self.exit_code)
