"""Sequence parallelism for long contexts: the rule that splits one sequence over several GPUs, and its memory.

Ulysses-style sequence parallelism (DeepSpeed-Ulysses; torchtitan's context parallelism plays the same part) gives each of
`d` ranks `seq_len / d` tokens of every sequence; around attention an all-to-all regroups them by heads (each rank
attends the whole sequence on `heads / d` heads), so every activation of a layer, attention's included, is the
single-rank figure at `seq_len / d` tokens, while the weight-sized terms stay those of the data-parallel strategy (FSDP and
ZeRO-3 shard over every rank, the sequence ranks too). The memory model is therefore `memory.estimate` of the setup at
`seq_len / d`; the all-to-all buffers (one layer's q, k, v and output, at `seq_len / d` tokens) are inside the per-layer
working set already counted.

The rule (:func:`decide`): at `LONG_CONTEXT` tokens and above, when the plan without it does not fit or its activations
take more than `HEAVY` of the GPU, the sequence degree is the smallest `d` > 1 that divides the GPUs of one node (the
all-to-all stays on NVLink), the attention and key/value heads (each rank keeps whole heads) and the sequence, whose
estimate fits with the planner's headroom and whose activations fall to at most `LIGHT` of the GPU; else the smallest such
`d` that fits. The data-parallel degree is the GPUs over `d`, so the accumulation grows to keep the effective batch.
"""

from __future__ import annotations

from dataclasses import replace

from trainpipe.distributed import ulysses
from trainpipe.errors import ConfigError
from trainpipe.plan import decisions as D
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.decisions import Decision
from trainpipe.plan.gpus import GIB, GPU
from trainpipe.plan.memory import Breakdown, Setup, estimate

LONG_CONTEXT = 32768  # tokens: where one sequence's activations start to dominate a 7-8B model's memory
HEAVY = 1 / 3  # activations above this share of the GPU: split the sequence
LIGHT = 1 / 4  # ... until they are at most this share


def degrees(spec: ModelSpec, seq_len: int, gpus_per_node: int) -> list[int]:
    """The sequence degrees Ulysses can use: > 1, dividing the node's GPUs, the attention and key/value heads and the sequence."""
    heads = spec.arch.get("heads") or 0
    kv = spec.arch.get("kv_heads") or heads
    return [d for d in range(2, gpus_per_node + 1)
            if gpus_per_node % d == 0 and seq_len % d == 0 and (not heads or heads % d == 0) and (not kv or kv % d == 0)]


def memory(spec: ModelSpec, s: Setup, d: int) -> Breakdown:
    """One GPU's memory with the sequence split over ``d`` ranks (the module docstring)."""
    b = estimate(spec, replace(s, seq_len=s.seq_len // d) if d > 1 else s)
    b.detail = {**b.detail, "sequence_parallel": d, "tokens_per_rank": s.seq_len // d}
    return b


def decide(spec: ModelSpec, s: Setup, gpu: GPU, gpus_per_node: int) -> tuple[Decision, Breakdown] | None:
    """The sequence-parallel decision for the setup ``s`` (its strategy and micro-batch already chosen), with the memory
    it gives; None when the rule does not apply (short sequences, one GPU, or the plan is light without it)."""
    if s.seq_len < LONG_CONTEXT or s.num_gpus < 2:
        return None
    limit = gpu.memory_bytes * (1 - D.HEADROOM)
    base = estimate(spec, s)
    heavy = base.activations_bytes > gpu.memory_bytes * HEAVY
    if base.total_bytes <= limit and not heavy:
        return None
    options = [(d, memory(spec, s, d)) for d in degrees(spec, s.seq_len, gpus_per_node)]
    fitting = [(d, b) for d, b in options if b.total_bytes <= limit]
    light = [(d, b) for d, b in fitting if b.activations_bytes <= gpu.memory_bytes * LIGHT]
    pick = (light or fitting or [None])[0]
    if pick is None:
        return None
    d, b = pick
    why = ("does not fit" if base.total_bytes > limit else
           f"its activations take {base.activations_bytes / GIB:.1f} GiB, more than {HEAVY:.0%} of the {gpu.memory_gib:g} GiB GPU")
    rule = (f"{s.seq_len} tokens per sequence (>= {LONG_CONTEXT}) and the plan without sequence parallelism {why}: Ulysses sequence "
            f"parallelism over {d} GPUs of a node (the smallest degree dividing the {gpus_per_node} GPUs per node, the heads and the "
            f"sequence{' that brings the activations under ' + format(LIGHT, '.0%') + ' of the GPU' if light else ' that fits'}): "
            f"{s.seq_len // d} tokens per GPU, activations {base.activations_bytes / GIB:.1f} -> {b.activations_bytes / GIB:.1f} GiB, "
            f"{b.total_bytes / GIB:.1f} GiB per GPU; data-parallel degree {s.num_gpus // d}")
    watch = ("the all-to-all around each attention moves q, k, v and the output every layer: keep the sequence group inside a node (NVLink); "
             "tokens/s per GPU should stay within ~15 % of the unsplit run's at the same length")
    return Decision("sequence_parallel", d, rule, watch), b


def asked(spec: ModelSpec, s: Setup, gpu: GPU, gpus_per_node: int, d: int, attention: str) -> tuple[Decision, Breakdown]:
    """`distributed.sequence_parallel: d` as set: checked (one paragraph naming what does not divide, or the kernel), sized."""
    heads = spec.arch.get("heads") or 0
    kv = spec.arch.get("kv_heads") or heads
    broken = [why for bad, why in (
        (s.seq_len % d != 0, f"`data.max_length` {s.seq_len} (each GPU holds an equal share of every sequence)"),
        (bool(heads) and heads % d != 0, f"the {heads} attention heads of `{spec.id}` (each GPU attends on whole heads)"),
        (bool(kv) and kv % d != 0, f"the {kv} key/value heads of `{spec.id}`"),
        (gpus_per_node % d != 0, f"the {gpus_per_node} GPUs per node (a sequence group stays inside a node)"),
    ) if bad]
    if broken:
        ok = degrees(spec, s.seq_len, gpus_per_node)
        raise D.PlanError(f"`distributed.sequence_parallel: {d}` does not divide {'; nor '.join(broken)}. Set it to a degree that divides "
                          f"them all ({', '.join(map(str, ok)) if ok else 'none here: change data.max_length or the GPUs per node'}), "
                          "or `auto` for the planner's rule.")
    if attention == "eager":
        raise D.PlanError(f"`distributed.sequence_parallel: {d}` with `model.attn_implementation: eager`: the sequence-parallel path "
                          "(torchtitan's context parallelism) shards SDPA and flex attention only, and eager attention would materialize "
                          "the whole sequence's scores on every GPU. Set `model.attn_implementation: sdpa` (or `auto`).")
    b = memory(spec, s, d)
    rule = (f"as set (`distributed.sequence_parallel: {d}`): {s.seq_len // d} tokens per GPU, activations "
            f"{b.activations_bytes / GIB:.1f} GiB, {b.total_bytes / GIB:.1f} GiB per GPU; data-parallel degree {s.num_gpus // d}")
    return Decision("sequence_parallel", d, rule, "keep the sequence group inside a node (NVLink): the all-to-all runs every layer"), b


def check_in_loop(plan) -> None:
    """`distributed.sequence_parallel` above 1 in trainpipe's own loop: DDP, FSDP2 or ZeRO-3 (the sequence groups inside the
    data-parallel world: distributed/ulysses.py) and token cross-entropy objectives (sft, pretrain), padded, packed or
    padding-free rows; packed rows need a kernel that keeps attention inside each example (distributed/ulysses.py
    PACKED_KERNELS). Anything else: one paragraph."""
    cfg, sp = plan.config, plan.specs.distributed.dims.cp
    if sp == 1:
        return
    packing = cfg.first_data().packing
    attention = cfg.model.attn_implementation
    broken = [why for bad, why in (
        (plan.strategy.value not in IN_LOOP, f"`distributed.strategy` one of {', '.join(IN_LOOP)} (the plan has `{plan.strategy.value}`)"),
        (cfg.method.name not in ("sft", "pretrain"), f"`method.name: sft` or `pretrain` (got `{cfg.method.name}`)"),
        (packing != "none" and attention not in ("auto", *ulysses.PACKED_KERNELS),
         f"`model.attn_implementation` one of {', '.join(ulysses.PACKED_KERNELS)} for `data.packing: {packing}` (got `{attention}`: its "
         "gathered attention would cross the examples of a packed row)"),
    ) if bad]
    if broken:
        raise ConfigError(
            f"`distributed.sequence_parallel: {sp}` in trainpipe's own loop needs {'; '.join(broken)}. Set those, or run the plan through "
            "torchtitan's context parallelism with `trainpipe launch CONFIG --emit torchtitan -o DIR`.", ["distributed.sequence_parallel"])


IN_LOOP = ("ddp", "fsdp", "zero3")  # the strategies a sequence degree above 1 runs under in trainpipe's loop (tested on gloo)


__all__ = ["HEAVY", "LIGHT", "LONG_CONTEXT", "asked", "check_in_loop", "decide", "degrees", "memory"]
