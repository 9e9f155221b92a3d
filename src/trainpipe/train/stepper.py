"""One optimizer step's forward and backward passes over a window: micro-batches and exact denominators.

The loss of a step is the sum of the objective's per-unit losses over the whole window divided by the window's weight
(loss tokens for cross-entropy, pairs for DPO, prompts for RL), so splitting a window into smaller micro-batches (after an
OOM) changes nothing but rounding. Under several processes each micro-step reads ``micro_batch x dp`` examples (dp: the data-parallel degree) of the
window and rank r takes its r-th slice, so the optimizer step's global batch is the one a single process reads; the
strategy sums the gradients over the ranks and carries the loss, the figures, an OOM flag and a stop flag in one
all-reduce, so every rank takes the same decision at the same step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from trainpipe import faults
from trainpipe.distributed import strategy as strategies
from trainpipe.plan.specs import BatchSpec, PrecisionSpec
from trainpipe.train.errors import OutOfMemoryPlan
from trainpipe.train.objectives import Objective
from trainpipe.train.preemption import Heartbeat, Preemption
from trainpipe.train.recovery import is_oom


class Stepper:
    """Forward and backward over one window; :meth:`run` returns (loss, tokens, gradient norm) and leaves the gradients
    (clipped to the optimizer spec's `max_grad_norm`) for the optimizer step. The recipe builds it with the resolved
    batch and precision (`plan.specs`): ``micro_batch`` is the micro-batch the run starts with (the loop's state takes
    it from here, halves it after an OOM and hands the current one to :meth:`run`). ``figures`` holds the objective's
    figures of the last window, per unit of weight; ``input_seconds`` the time spent preparing inputs since the loop
    last read it."""

    def __init__(self, *, objective: Objective, strategy, device, batch: BatchSpec, precision: PrecisionSpec, max_grad_norm: float,
                 optimizer, params: list, heartbeat: Heartbeat, preemption: Preemption):
        import torch

        self.objective, self.strategy, self.device, self.optimizer, self.params = objective, strategy, device, optimizer, params
        self.micro_batch, self.grad_accum = batch.micro_batch, batch.grad_accum
        self.max_grad_norm, self.heartbeat, self.preemption = max_grad_norm, heartbeat, preemption
        self.amp = device.type == "cuda" and precision.mixed in ("bf16", "fp16")
        self.bf16 = precision.bf16
        self.scaler = torch.amp.GradScaler("cuda") if (precision.fp16 and device.type == "cuda") else None  # fp16's loss scaling
        self.figures: dict[str, float] = {}
        self.input_seconds = 0.0
        self.agreed_stop: str | None = None  # the stop signal as all ranks agreed it
        self.oom_ranks: list[int] = []  # the ranks that ran out of memory in the last OOM every rank recovered from
        self.sequence = None  # sequence parallelism: this rank's cut of each micro-batch (distributed/ulysses.py SequenceShard)

    def run(self, examples: list[dict], w: int, micro: int, step: int) -> tuple[float, int, float]:
        import torch

        obj, strategy, mark = self.objective, self.strategy, self.heartbeat.mark
        obj.begin_window(w)
        denom = max(obj.weight(examples), 1)  # loss = sum over the whole window / its weight: exact under any micro-batching
        n_tokens = obj.tokens(examples)
        total = torch.zeros((), device=self.device)
        amp_dtype = torch.bfloat16 if self.bf16 else torch.float16
        extras: dict[str, float] = {}
        world, rank = strategy.dims.dp, strategy.dims.dp_rank(strategy.rank)  # the data-parallel degree and this rank's place in it
        starts = range(0, len(examples), micro * world)  # one micro-step: micro x dp examples, data-parallel rank r takes the r-th slice
        oom: BaseException | None = None
        synced = False
        injecting = faults.active()  # TEST-ONLY fault injection (trainpipe/faults.py): its environment read once a window
        for j, i in enumerate(starts):
            part = examples[i + rank * micro : i + (rank + 1) * micro]
            idle = not part  # the window's last micro-step has fewer examples than ranks x micro: join the sync with a zero loss
            sync = j == len(starts) - 1
            if oom is not None:  # FSDP or sequence parallelism: this rank ran out of memory earlier in the window; every sharded
                # forward and backward (every Ulysses attention) is a collective, so it keeps taking part (zero loss) until the window ends
                self._join_step(self._joined(examples, part), amp_dtype, sync)
                synced = synced or sync
                continue
            forwarding = False  # an OOM before the forward leaves the collectives of every rank in step (FSDP can recover from it)
            try:
                with strategy.no_sync() if not sync else nullcontext():
                    if injecting:
                        faults.before_forward(w)
                    tc = time.perf_counter()
                    if injecting:
                        faults.slow_input()
                    batch = self._batch(part or examples[:1])
                    self.input_seconds += time.perf_counter() - tc
                    forwarding = True
                    with torch.autocast(self.device.type, dtype=amp_dtype) if self.amp else nullcontext():
                        loss_sum, extra = obj.loss_sum(strategy.forward, batch)
                    if idle:
                        loss_sum, extra = loss_sum * 0.0, {k: 0.0 for k in extra}
                    for k, v in extra.items():
                        extras[k] = extras.get(k, 0.0) + float(v)
                    loss = faults.poison_loss(w, loss_sum / denom) if injecting else loss_sum / denom
                    back = strategies.scale_loss(strategy, loss)
                    if sync:
                        strategies.before_sync_backward(strategy, mark)
                    (self.scaler.scale(back) if self.scaler else back).backward()
                    synced = synced or sync
                    total += loss.detach()
            except Exception as exc:  # noqa: BLE001 - an OOM on one rank must become every rank's OOM (below)
                action = strategies.oom_action(strategy, forwarding) if is_oom(exc) else "raise"
                if action == "raise":
                    raise
                if action == "fatal":
                    raise OutOfMemoryPlan(
                        f"Out of memory on rank {strategy.rank} inside a sharded forward or backward at step {step + 1} ({str(exc)[:120]}). "
                        f"Under `distributed.strategy: {strategy.name}` the other ranks are then waiting in that step's collectives, so this rank "
                        "cannot retry with a smaller micro-batch; the launcher stops every worker. Resume with `--resume` after setting a "
                        "smaller `training.per_device_train_batch_size` (the accumulation grows, the effective batch stays) or "
                        "`training.gradient_checkpointing: true`."
                    ) from None
                oom = exc
                if action == "break":
                    break  # DDP: the micro-steps before the last keep their gradients local; the all-reduce is joined below
                self._join_step(self._joined(examples, part), amp_dtype, sync)
                synced = synced or sync
        if oom is not None and not synced:  # this rank ran out of memory before the gradient all-reduce: take part in it, then all retry
            self._join_sync(examples[:1], amp_dtype)
        total, extras = self._agree(total, oom, extras, strategy.dims.world)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        gnorm = strategies.clip_grad_norm(strategy, [p for _, p in self.params], self.max_grad_norm)
        gnorm = strategy.grad_norm(gnorm)  # FSDP: the global norm of the sharded gradients (a DTensor)
        self.figures = {k: v / denom for k, v in extras.items()}
        return float(total), n_tokens, float(gnorm)

    def _agree(self, total, oom: BaseException | None, extras: dict, world: int):
        """Every rank's loss, figures, OOM and stop flags in one all-reduce; an OOM anywhere is raised on every rank."""
        import torch

        total, extras, ooms, stop = self.strategy.reduce(total, oom is not None, self.preemption.signal is not None, extras, self.device,
                                                        self.heartbeat.mark)
        if stop and self.agreed_stop is None:
            self.agreed_stop = self.preemption.signal or "SIGTERM"
        if ooms:
            self.oom_ranks = [r for r, hit in enumerate(strategies.gather(self.strategy, oom is not None)) if hit]
            self.optimizer.zero_grad(set_to_none=True)
            raise oom if oom is not None else torch.OutOfMemoryError(f"out of memory on another rank ({int(ooms)} of {world} ranks)")
        return total, extras

    def _batch(self, examples: list[dict]) -> dict:
        """The collated micro-batch on the device; under sequence parallelism this rank's share of its tokens."""
        batch = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in self.objective.collate(examples).items()}
        return self.sequence(batch) if self.sequence is not None else batch

    def _joined(self, examples: list[dict], part: list[dict]) -> list[dict]:
        """What a rank that ran out of memory forwards (zero loss) to keep in step: one example; under sequence parallelism its
        own micro-batch, whose shape the other ranks of its sequence group exchange in every attention."""
        return (part or examples[:1]) if self.sequence is not None else examples[:1]

    def _join_sync(self, examples: list[dict], amp_dtype) -> None:
        """A zero-loss micro-step that only takes part in the gradient all-reduce (after an OOM on this rank)."""
        import torch

        batch = self._batch(examples)
        with torch.autocast(self.device.type, dtype=amp_dtype, enabled=self.amp):
            loss_sum, _ = self.objective.loss_sum(self.strategy.forward, batch)
        self.heartbeat.mark("wait")
        (loss_sum * 0.0).backward()

    def _join_step(self, examples: list[dict], amp_dtype, sync: bool) -> None:
        """FSDP, after an OOM on this rank: a zero-loss micro-step on one example, so that this rank's all-gathers (and, on the
        window's last micro-step, reduce-scatter) pair with the other ranks'; then every rank retries the window together."""
        with self.strategy.no_sync() if not sync else nullcontext():
            self._join_sync(examples, amp_dtype)
