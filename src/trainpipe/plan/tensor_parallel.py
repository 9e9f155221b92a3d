"""Tensor parallelism in the plan: the degree a run trains with, what trainpipe's loop accepts with it, and the planner's
tensor rule with its memory.

Tensor parallelism (Megatron-LM's, applied by torch's DTensor: distributed/tensor_parallel.py) splits each weight matrix of
the decoder layers over `t` GPUs of one node by the attention heads and the MLP's hidden units: every rank keeps `1 / t` of
those weights, their gradients and their optimizer state, and `1 / t` of the activations inside attention and the MLP,
while the activations between the layers (the residual stream, replicated without torchtitan's sequence-parallel
norms) and the embeddings, norms and output head stay whole. Combined with FSDP2 over the `N / t` data-parallel ranks
(2-D parallelism) the weight-sized state of one GPU is `16 B/param x P / N`, as FSDP over all `N` GPUs gives, but each
rank's all-gathers and reduce-scatters carry `1 / t` of the bytes and its activations shrink; the tensor all-reduces
(two per layer, forward and backward) need NVLink, so `t` never leaves a node.

The rule (:func:`decide`): for full fine-tuning on several nodes, when the plan's ZeRO-3 / FSDP estimate does not fit one
GPU without offloading (the offload decision was the planner's last resort), tensor parallelism with FSDP is tried at
every degree `t` > 1 that divides the GPUs of one node and the attention and key/value heads, smallest first; the first
whose estimate fits without offload is chosen, and the accumulation grows to keep the effective batch over `N / t`
data-parallel ranks. Above 100B the 3-D rule of plan/parallel3d.py (and the hand-off) applies instead.
"""

from __future__ import annotations

from dataclasses import replace

from trainpipe.errors import ConfigError
from trainpipe.plan import decisions as D
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.decisions import Decision
from trainpipe.plan.gpus import GIB, GPU
from trainpipe.plan.memory import Breakdown, Setup, estimate, overhead_bytes

MICRO_BATCHES = (8, 4, 2, 1)


def degree(dist) -> int:
    """The tensor degree of a run: `distributed.tensor_parallel` when set, else 1 (`auto` sizes TP for `trainpipe plan` only)."""
    return dist.tensor_parallel if isinstance(dist.tensor_parallel, int) else 1


def check_in_loop(plan) -> None:
    """`distributed.tensor_parallel` above 1 in trainpipe's own loop: a full fine-tune (`method.peft: none`) of sft or
    pretrain, alone (one data-parallel rank) or 2-D with FSDP2 (`distributed.strategy: fsdp`), without a sequence degree.
    ZeRO cannot combine (DeepSpeed's engine owns the partitions of plain tensors, not DTensor slices), DDP only with one
    data-parallel rank (it replicates whole weights). Anything else: one paragraph naming every setting to change."""
    cfg, dims = plan.config, plan.specs.distributed.dims
    tp, strategy = dims.tp, plan.strategy.value
    if tp == 1:
        return
    broken = [why for bad, why in (
        (strategy in ("zero2", "zero3"),
         f"a strategy that combines with it (`distributed.strategy: fsdp`; the plan has `{strategy}`, and DeepSpeed's ZeRO engine "
         "partitions whole tensors, not the DTensor slices of a tensor-parallel model)"),
        (strategy == "ddp" and dims.dp > 1,
         f"`distributed.strategy: fsdp` for its {dims.dp} data-parallel ranks (DDP replicates whole weights; FSDP2 shards the "
         "tensor-parallel slices as 2-D parallelism)"),
        (cfg.method.peft != "none", f"`method.peft: none` (a full fine-tune; the plan has `{cfg.method.peft}`: an adapter wraps the linear layers the plan splits)"),
        (cfg.method.name not in ("sft", "pretrain"), f"`method.name: sft` or `pretrain` (got `{cfg.method.name}`)"),
        (dims.cp > 1, f"`distributed.sequence_parallel: 1` (the plan has {dims.cp}; sequence and tensor degrees do not combine in trainpipe's loop)"),
    ) if bad]
    if broken:
        raise ConfigError(
            f"`distributed.tensor_parallel: {tp}` in trainpipe's own loop needs {'; '.join(broken)}. Set those, or set "
            "`distributed.tensor_parallel: 1`, or hand the plan to torchtitan with `trainpipe launch CONFIG --emit torchtitan -o DIR`.",
            ["distributed.tensor_parallel"])


def degrees(spec: ModelSpec, gpus_per_node: int) -> list[int]:
    """The tensor degrees > 1 that divide the GPUs of one node and the attention and key/value heads (whole heads per rank)."""
    heads = spec.arch.get("heads") or 0
    kv = spec.arch.get("kv_heads") or heads
    return [t for t in range(2, gpus_per_node + 1) if gpus_per_node % t == 0 and (not heads or heads % t == 0) and (not kv or kv % t == 0)]


def memory(spec: ModelSpec, s: Setup, t: int) -> Breakdown:
    """One GPU's memory under FSDP over every GPU x tensor degree ``t`` (the module docstring): the sharded state of
    ZeRO-3 / FSDP over all `s.num_gpus` (16 B/param: 16-bit parameters and gradients, fp32 master weights and AdamW states),
    the 16-bit layers gathered in flight and the activations split by ``t``, no offload."""
    base = estimate(spec, replace(s, strategy="zero3", offload="none"))
    gathered = base.detail.get("gathered_bytes", 0)
    w = base.weights_bytes - gathered + gathered // t
    a = base.activations_bytes // t
    per_layer = base.detail["activations"].get("per_layer", 0) // t
    allocated = w + base.gradients_bytes + base.optimizer_bytes + a
    overhead, frag = overhead_bytes(s, allocated, per_layer, max(1, s.num_gpus))
    detail = {**base.detail, "tensor_parallel": t, "gathered_bytes": gathered // t, "state_bytes_per_param": 16}
    return Breakdown(int(w), base.gradients_bytes, base.optimizer_bytes, int(a), int(overhead), base.total_params, base.trainable_params, 0,
                     detail, fragmentation_bytes=int(frag))


def decide(spec: ModelSpec, s: Setup, gpu: GPU, gpus_per_node: int) -> tuple[Decision, Setup, Breakdown] | None:
    """The tensor rule on the chosen setup ``s`` (the module docstring): None when it does not apply (not a full fine-tune,
    one GPU, above 100B, or ZeRO-3 alone fits without offload), else (the decision, the setup, its memory)."""
    if s.method != "full" or s.num_gpus < 2 or spec.total_params > D.BEYOND_SHARDING:
        return None
    limit = gpu.memory_bytes * (1 - D.HEADROOM)
    plain = estimate(spec, replace(s, strategy="zero3", offload="none", micro_batch=1, grad_ckpt=True))
    if plain.total_bytes <= limit:
        return None
    for t in degrees(spec, gpus_per_node):
        for mb in (m for m in MICRO_BATCHES if m <= max(1, s.micro_batch)):
            setup = replace(s, strategy="fsdp", offload="none", micro_batch=mb, grad_ckpt=True)
            b = memory(spec, setup, t)
            if b.total_bytes <= limit:
                n, state = s.num_gpus, (b.gradients_bytes + b.optimizer_bytes + b.weights_bytes - b.detail["gathered_bytes"])
                rule = (f"full fine-tuning of {spec.total_params / 1e9:.0f}B on {n} GPUs: ZeRO-3 over all {n} needs {plain.total_bytes / GIB:.1f} GiB "
                        f"per GPU without offload even at micro-batch 1 (more than the {limit / GIB:.0f} GiB the planner allows), so tensor "
                        f"parallelism {t} inside each node (the smallest degree dividing the node's {gpus_per_node} GPUs and the heads that "
                        f"fits) with FSDP over the {n // t} data-parallel ranks: 16 B/param / {n} = {state / GIB:.1f} GiB of state per GPU, "
                        f"the gathered layers and the activations / {t}: {b.total_bytes / GIB:.1f} GiB per GPU at micro-batch {mb}, no "
                        "offload (the host RAM an offload needs is not)")
                watch = (f"keep each tensor group of {t} inside one node (NVLink): two all-reduces per layer forward and backward; "
                         "`trainpipe launch --emit torchtitan` runs this 2-D plan (its FSDP2 keeps 16-bit parameters); trainpipe's own "
                         "loop runs it too (`distributed.tensor_parallel`), keeping fp32 parameters and gradients")
                return Decision("tensor_parallel", t, rule, watch), setup, b
    return None


def apply(spec: ModelSpec, cfg, num_gpus: int, nodes: int, gpu: GPU, out: dict) -> dict:
    """`plan --model`: the tensor rule (`distributed.tensor_parallel: auto`) or the degree as set on the chosen plan ``out``
    (plan/request.py `plan_on`); when it applies the strategy is FSDP x TP without offload, the memory its own, and the
    accumulation keeps the effective batch over the data-parallel degree."""
    asked, s, world = cfg.distributed.tensor_parallel, out["setup"], num_gpus * nodes
    if asked == 1 or "parallel" in out:  # one tensor rank, or the sequence rule split the sequence already
        return out
    if asked == "auto":
        if cfg.distributed.strategy != "auto" or "offload" in cfg.distributed.model_fields_set:
            return out  # a strategy or offload as set is the user's choice: the rule only replaces the planner's own
        got = decide(spec, s, gpu, num_gpus)
    else:
        if asked not in degrees(spec, num_gpus):
            raise D.PlanError(f"`distributed.tensor_parallel: {asked}` must divide the {num_gpus} GPUs of a node and the model's "
                              f"{spec.arch.get('heads')} attention and {spec.arch.get('kv_heads')} key/value heads; degrees that do: "
                              f"{', '.join(map(str, degrees(spec, num_gpus))) or 'none'}. Set `distributed.tensor_parallel` to one of them.")
        setup = replace(s, strategy="fsdp", offload="none")
        b = memory(spec, setup, asked)
        got = Decision("tensor_parallel", asked, f"as set (`distributed.tensor_parallel: {asked}`): FSDP over {world // asked} data-parallel ranks x "
                       f"TP {asked}, {b.total_bytes / GIB:.1f} GiB per GPU", "keep each tensor group inside one node (NVLink)"), setup, b
    if got is None:
        return out
    d, setup, b = got
    dp = world // d.value
    keep = [x for x in out["decisions"] if x.key != "offload"]
    new = {"strategy": Decision("strategy", "fsdp", f"FSDP over the {dp} data-parallel ranks x tensor parallelism {d.value} (2-D, the tensor rule below)",
                                "every layer is all-gathered over the data-parallel ranks and all-reduced over the tensor group each step"),
           "micro_batch": Decision("micro_batch", setup.micro_batch, f"the largest of {'/'.join(map(str, MICRO_BATCHES))} that fits with "
                                   f"{int(D.HEADROOM * 100)} % headroom under FSDP x TP {d.value}", "")}
    if cfg.training.gradient_accumulation_steps is None:
        acc, _, acc_rule = D.accumulation(setup.micro_batch, dp, cfg.training.target_effective_batch_size)
        new["gradient_accumulation"] = Decision("gradient_accumulation", acc, acc_rule + f" (data-parallel degree {dp} = {world} GPUs / tensor degree {d.value})",
                                                "the lr is tuned for this effective batch")
    decisions = [new.get(x.key, x) for x in keep]
    decisions.insert(next(i for i, x in enumerate(decisions) if x.key == "strategy") + 1, d)
    return {**out, "decisions": decisions, "setup": setup, "memory": b, "fits": b.total_bytes <= gpu.memory_bytes,
            "within_headroom": b.total_bytes <= gpu.memory_bytes * (1 - D.HEADROOM), "parallel": {"sequence": 1, "tensor": d.value, "data": dp, "gpus": world}}


__all__ = ["MICRO_BATCHES", "apply", "check_in_loop", "decide", "degree", "degrees", "memory"]
