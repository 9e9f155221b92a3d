"""Sharding a whole-set evaluation over the ranks of a distributed run, for the evaluations that are not a token loss
(dpo/orpo/kto preference metrics, the reward model's pairwise accuracy, the rl policy's reward and KL).

train/loop.py sets the eval shard around an in-training evaluation (`distributed.env.sharded_eval`) for objectives
with `shards_eval = True`; the evaluation then asks :func:`batches` for its share (batch k of the set goes to rank
k % world, as `evaluator.eval_loss` does), computes its per-batch results, and :func:`in_order` gathers every rank's
results and returns all of them in batch order on every rank. The evaluation then combines them exactly as one process
would (the same batches, the same order of sums), so the figure equals the one-process figure. Outside a sharded
evaluation (one process; baseline and final evaluations on rank 0) every batch is this process's.

    todo, shard = batches(len(rows), batch_size)
    done = {k: measure(rows[i : i + batch_size]) for k, i, counted in todo if counted}   # FSDP: uncounted ones run too
    results = in_order(done, shard, units=lambda r: r.n)
"""

from __future__ import annotations

from typing import Callable

from trainpipe.distributed import env


def batches(n_rows: int, batch_size: int):
    """([(batch index, first row, counted)] of this process, the shard or None). Under FSDP (lockstep) a rank short of
    batches gets an uncounted repeat to run (every FSDP forward is a collective) and must not record it."""
    starts = list(range(0, n_rows, batch_size))
    shard = env.current_eval_shard()
    if shard is None:
        return [(k, s, True) for k, s in enumerate(starts)], None
    return [(s // batch_size, s, counted) for s, counted in shard.assign(starts)], shard


def in_order(done: dict, shard, *, units: Callable[[object], int] | None = None) -> list:
    """Every batch's result, in batch order: this process's ``done`` ({batch index: result}) alone, or under a shard
    every rank's (an all-gather). ``units(result)`` counts the examples of a result: the shard records them per rank
    (`eval_loss_tokens_per_rank` in the loop's `eval_done` event, examples here rather than tokens)."""
    if shard is None:
        return [done[k] for k in sorted(done)]
    per_rank = env.gather_objects(done)
    if units is not None:
        shard.counts = [sum(units(r) for r in d.values()) for d in per_rank]
    merged: dict = {}
    for d in per_rank:
        merged.update(d)
    return [merged[k] for k in sorted(merged)]
