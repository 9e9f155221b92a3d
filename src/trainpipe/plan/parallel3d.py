"""Tensor + pipeline + data parallelism above 100B parameters: the TP x PP x DP shape and each GPU's share of it.

trainpipe does not run tensor or pipeline parallelism; this sizes the plan to hand to Megatron-LM (or Megatron-DeepSpeed)
or torchtitan. From the single-device estimate (`memory.estimate` of the setup on one GPU, micro-batch 1, checkpointed):

- TP: the largest count of one node's GPUs that divides the node's GPUs and the attention and key/value heads (Megatron
  splits heads over TP and keeps TP inside a node, on NVLink).
- PP: the fewest pipeline stages, at most one per decoder layer, that divide the GPUs left after TP and whose largest
  stage fits. A stage holds ceil(layers / PP) decoder layers; the first also the input embeddings, the last the output
  head (or, tied, its copy of the embeddings) and the final norm. The larger of the two is the one sized.
- DP: the GPUs left, so TP x PP x DP is exactly the GPUs given.

Every weight-sized term of the single-device estimate (the weights with autocast's 16-bit copies, the gradients, the
optimizer states and the optimizer step's temporaries) is that stage's share of the parameters split over TP: the term x
stage parameters / all parameters / TP. The activations are the checkpointed layer inputs the 1F1B schedule keeps on the
stage (PP micro-batches in flight on the first stage, one on the last, each of the stage's layers) plus the recomputed
layer's working set and the loss (the single-device figure's non-checkpointed part), split over TP by sequence
parallelism. The peak of those (activation phase or optimizer step) is `memory.activation_peak`, and the reserve is
`memory.overhead_bytes` on the GPU's share, so TP = PP = 1 on one GPU is `estimate()` to the byte. Not counted: the
distributed optimizer's sharding of optimizer states over DP (Megatron's `--use-distributed-optimizer`), a further saving.
"""

from __future__ import annotations

import math
from dataclasses import replace

from trainpipe.plan import decisions as D
from trainpipe.plan import memory as M
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.decisions import Decision
from trainpipe.plan.gpus import GIB, GPU
from trainpipe.plan.memory import Breakdown, Setup

FRAMEWORKS_3D = ["Megatron-LM", "torchtitan"]


def tensor_parallel(spec: ModelSpec, gpus_per_node: int, most: int | None = None) -> int:
    """The largest TP (at most `most`) that divides the node's GPUs and the attention (and key/value) heads."""
    heads = spec.arch.get("heads") or 0
    kv = spec.arch.get("kv_heads") or heads
    top = min(max(1, gpus_per_node), most or gpus_per_node)
    return max(d for d in range(1, top + 1) if gpus_per_node % d == 0 and (not heads or heads % d == 0) and (not kv or kv % d == 0))


def stage_params(spec: ModelSpec, pp: int) -> dict[str, int]:
    """Parameters of the first and the last pipeline stage (ceil(layers / PP) decoder layers each); PP 1: the whole model."""
    if pp <= 1:
        return {"first": spec.total_params, "last": spec.total_params, "layers": spec.layers}
    per = math.ceil(spec.layers / pp)
    body = per * spec.layer_params
    head = (spec.lm_head_params + spec.lm_head_bias_params) or spec.embedding_params  # tied: the last stage's copy of the embeddings
    norm = spec.hidden if spec.final_norm_params is None else spec.final_norm_params
    return {"first": min(spec.total_params, body + spec.embedding_params), "last": min(spec.total_params, body + head + norm), "layers": per}


class Shares:
    """One GPU's memory on the largest stage of a TP x PP plan of `s` (the single-device setup: strategy single, one GPU),
    from the single-device estimate computed once."""

    def __init__(self, spec: ModelSpec, s: Setup):
        self.spec, self.s = spec, s
        self.one = M.estimate(spec, s)
        self.acts, self.ad = M.activation_bytes(spec, s)
        self.raw_g = M.gradient_bytes(spec, s, self.one.trainable_params)
        self.raw_o = M.optimizer_bytes(spec, s, self.one.trainable_params)

    def __call__(self, tp: int, pp: int, processes: int) -> Breakdown:
        spec, s, one, A, ad = self.spec, self.s, self.one, self.acts, self.ad
        copies = one.detail.get("weights", {}).get("autocast_copies", 0)
        step = one.detail.get("optimizer_step_temporaries", 0)
        n = spec.total_params
        stages = stage_params(spec, pp)
        kept = ad.get("checkpointed_inputs")
        best = None
        for name, in_flight in (("first", pp), ("last", 1)):
            params = stages[name]

            def part(x: int) -> int:
                return x // tp if pp == 1 else x * params // (n * tp)

            W, G, O, st, cp = part(one.weights_bytes), part(self.raw_g), part(self.raw_o), part(step), part(copies)
            if pp == 1 or kept is None or s.method == "freeze":
                acts = A // tp  # one stage, no checkpointing or freeze's partial saving: the whole single-device figure
            else:  # 1F1B: `in_flight` micro-batches' checkpointed inputs of the stage's layers + the recompute and the loss
                acts = (in_flight * stages["layers"] * (kept // spec.layers) + (A - kept)) // tp
            A_peak = M.activation_peak(s, acts, G, st, cp)
            layer = ad.get("per_layer", 0) // tp
            overhead, frag = M.overhead_bytes(s, W + G + O + A_peak, layer, processes)
            b = Breakdown(W, G, O, A_peak, overhead, n, one.trainable_params, 0,
                          {"tensor_parallel": tp, "pipeline_parallel": pp, "stage": name, "stage_layers": stages["layers"], "stage_params": params,
                           "micro_batches_in_flight": in_flight if pp > 1 else 1, "activations_on_stage": acts,
                           "recomputed_layer_activations": layer, "single_device_breakdown": one.to_dict()}, fragmentation_bytes=frag)
            if best is None or b.total_bytes > best.total_bytes:
                best = b
        return best


def choose(spec: ModelSpec, s: Setup, gpu: GPU, gpus_per_node: int, nodes: int) -> dict:
    """TP x PP x DP for the GPUs given (TP x PP x DP = gpus_per_node x nodes) and, when it does not fit them, the fewest
    GPUs that would (TP of a full node), None when not even one layer per stage fits."""
    world = gpus_per_node * nodes
    limit = gpu.memory_bytes * (1 - D.HEADROOM)
    share = Shares(spec, s)
    tp = tensor_parallel(spec, gpus_per_node, gpu.max_per_node)
    shares = {}
    for p in (p for p in range(1, min(spec.layers, world // tp) + 1) if (world // tp) % p == 0):
        shares[p] = share(tp, p, world)
        if shares[p].total_bytes <= limit:
            break
    fitting = [p for p in shares if shares[p].total_bytes <= limit]
    pp = fitting[0] if fitting else min(shares, key=lambda p: shares[p].total_bytes)
    need = tp * pp if fitting else None
    if not fitting:  # the fewest GPUs that would fit: a full node's TP and the fewest stages
        full_tp = tensor_parallel(spec, gpu.max_per_node)
        need = next((full_tp * p for p in range(1, spec.layers + 1) if share(full_tp, p, full_tp * p).total_bytes <= limit), None)
    return {"tp": tp, "pp": pp, "dp": world // (tp * pp), "memory": shares[pp], "fits": bool(fitting), "world": world, "need": need}


def plan_3d(spec: ModelSpec, s: Setup, gpu: GPU, *, gpus_per_node: int, nodes: int, target_effective_batch: int = 32) -> dict:
    """The > 100B plan on `gpus_per_node` x `nodes` GPUs of type `gpu` for the single-device setup `s` (micro-batch 1 and
    checkpointing are set here). Returns the what-if plan's pieces: `decisions` (strategy, TP, PP, DP, micro-batch,
    checkpointing, accumulation: the caller adds precision, method and learning rate), `setup`, `memory` (one GPU's
    Breakdown), `fits`, `why_not` and `parallel`."""
    s = replace(s, micro_batch=1, grad_ckpt=True, strategy="single", num_gpus=1, offload="none")
    c = choose(spec, s, gpu, gpus_per_node, nodes)
    tp, pp, dp, b, world, need = c["tp"], c["pp"], c["dp"], c["memory"], c["world"], c["need"]
    value = f"tensor+pipeline parallel: TP {tp} x PP {pp} x DP {dp}"
    stage = b.detail
    fit = (f"PP {pp} = the fewest pipeline stages (<= {spec.layers} layers, dividing the {world // tp} GPU(s) left after TP) whose largest stage "
           f"({stage['stage_layers']} layers, the {stage['stage']}) fits: {b.total_bytes / GIB:.1f} of {gpu.memory_gib:g} GiB per GPU with "
           f"{int(D.HEADROOM * 100)} % headroom" if c["fits"] else
           f"PP {pp} = the most pipeline stages the {world} GPU(s) allow (<= {spec.layers} layers, dividing the {world // tp} left after TP), and its "
           f"largest stage ({stage['stage_layers']} layers, the {stage['stage']}) needs {b.total_bytes / GIB:.1f} of {gpu.memory_gib:g} GiB per GPU")
    rule = (f"{spec.total_params / 1e9:.0f}B params (> 100B): data-parallel sharding alone (FSDP, ZeRO-3) spends each step gathering weights "
            f"across nodes; the standard is tensor + pipeline parallelism with Megatron-LM (or Megatron-DeepSpeed) or torchtitan, outside trainpipe. "
            f"TP {tp} = the GPUs of one {gpu.name} node that divide the attention heads (NVLink), {fit}; DP {dp} = the remaining GPUs, "
            f"TP x PP x DP = {world}")
    if not c["fits"]:
        rule += (f"; it needs at least {need} GPUs ({math.ceil(need / gpu.max_per_node)} nodes of {gpu.max_per_node}), and {world} were given"
                 if need else f"; not even one layer per stage fits a {gpu.name} (a LoRA or QLoRA fine-tune, or a larger GPU)")
    watch = ("trainpipe does not run tensor/pipeline parallelism: export this plan to Megatron-LM or torchtitan; pipeline bubbles cost "
             "(PP-1)/(micro-batches+PP-1) of each step: use >= 4 x PP micro-batches per step")
    acc, _, acc_rule = D.accumulation(1, dp, target_effective_batch)
    decisions = [Decision("strategy", value, rule, watch),
                 Decision("tensor_parallel", tp, f"TP {tp}: the GPUs of one node that divide the heads", "TP across nodes is limited by the inter-node link"),
                 Decision("pipeline_parallel", pp, f"PP {pp}: the fewest stages (<= {spec.layers} layers, dividing the GPUs left after TP) that fit; "
                          f"{stage['stage_layers']} layers on the largest stage", ""),
                 Decision("data_parallel", dp, f"DP {dp}: the remaining GPUs (TP x PP x DP = {world})", ""),
                 Decision("micro_batch", 1, "1 per pipeline micro-batch (checkpointed)", ""),
                 Decision("gradient_checkpointing", True, "on: activations dominate at this scale", ""),
                 Decision("gradient_accumulation", acc, acc_rule + " (pipeline micro-batches)", "")]
    setup = replace(s, num_gpus=world)
    return {"decisions": decisions, "setup": setup, "memory": b, "fits": c["fits"], "why_not": None if c["fits"] else rule,
            "parallel": {"tensor": tp, "pipeline": pp, "data": dp, "gpus": world, "gpus_needed": need if need else None,
                         "stage_layers": stage["stage_layers"], "frameworks": list(FRAMEWORKS_3D)}}
