"""Training FLOPs, time, cost, and checkpointing on spot instances.

FLOPs per token (Kaplan et al. 2020, "Scaling Laws", sec. 2.1; Narayanan et al. 2021, Megatron-LM, eq. 3):
  forward  = 2 * N_matmul + 2 * L * s * d_attn          (d_attn = heads * head_dim; causal: half of the 4*L*s*d_attn of full attention)
  full fine-tune: forward + backward (2x forward) = 3 x forward  -> the familiar 6 * N per token plus the attention term
  LoRA/QLoRA: the frozen weights need no weight gradients: forward + input-gradient backward = 2 x forward (+ the adapters' own 6 * N_lora)
  gradient checkpointing: + 1 forward (the recomputation)
N_matmul counts parameters that take part in matrix products: everything but the input embedding (the lm_head is a
matmul even when tied). MoE: the active parameters of the top-k experts.

Time = FLOPs / (GPUs * peak * MFU). The default MFU comes from published fine-tuning/training figures (cited in
MFU_DEFAULTS) and can be overridden.

Young/Daly: with a checkpoint that takes C hours to write and a mean time between preemptions M hours, the interval
that minimises expected lost time is tau = sqrt(2 * C * M) (Young 1974), refined to sqrt(2 C M) - C (Daly 2006) for C << M.
The expected waste fraction is C / tau (writing) + (tau / 2 + R) / M (rework after each preemption, R = restart time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.gpus import GPU

# Expected model-FLOPs utilisation for fine-tuning, by method (HF/PyTorch stack, no custom kernels). Sources:
#  - Megatron-LM (Narayanan et al. 2021): 44-52 % of A100 peak for 1B-1T GPT pre-training with tuned kernels (upper bound).
#  - PaLM (Chowdhery et al. 2022, table 3): 46.2 % MFU; reports GPT-3 at 21.3 %, Gopher 32.5 %, MT-NLG 30.2 %.
#  - MosaicML LLM Foundry benchmark tables (2023): ~40-50 % MFU for 7B-70B on A100/H100 with FlashAttention.
#  - torchtune README (2024): Llama 3.1 8B LoRA at 3083 tokens/s on one RTX 4090 ~ 4*8e9*3083/165e12 ~ 60 % of the fp32-accumulate
#    dense peak with torch.compile, QLoRA 2413 tok/s (~ 45 %): LoRA's 2x-forward count makes these look high.
# Defaults are deliberately below the pre-training figures: fine-tuning runs short, padded, variable-length batches.
MFU_DEFAULTS = {"full": 0.40, "freeze": 0.35, "lora": 0.35, "dora": 0.25, "qlora": 0.25}
MFU_SMALL_MODEL = 0.6  # factor for models < 1B params (kernels too small to fill the GPU)
MFU_CONSUMER = 0.9  # factor for GeForce/older GPUs (PCIe, smaller caches)
# Data-parallel scaling efficiency (rules of thumb, the seeds' figures): the share of N x one GPU's speed that N GPUs
# reach once the gradient all-reduce is paid. Within a node by the GPUs' link; across nodes by the network between them
# (InfiniBand 80-90 %, 25 Gb Ethernet 30-40 %). An adapter (LoRA, QLoRA, ...) all-reduces a fraction of a percent of
# the weights, so only a fifth of the loss applies to it.
SCALING_IN_NODE = {"nvlink": 0.95, "infinity fabric": 0.95, "pcie": 0.80}
SCALING_ACROSS_NODES = {"infiniband": 0.85, "ethernet-100g": 0.70, "ethernet-25g": 0.35}
ADAPTER_COMM_SHARE = 0.2


def matmul_params(spec: ModelSpec) -> int:
    n = spec.active_params - spec.embedding_params
    if spec.lm_head_params == 0 and spec.task == "causal-lm":
        n += spec.embedding_params  # tied lm_head still multiplies
    return max(n, 1)


def flops_per_token(spec: ModelSpec, method: str, seq_len: int, grad_ckpt: bool, lora_params: int = 0) -> float:
    A = spec.arch
    d_attn = A["heads"] * A["head_dim"]
    fwd = 2 * matmul_params(spec) + 2 * A["layers"] * seq_len * d_attn
    if method in ("full",):
        total = 3 * fwd
    elif method == "freeze":
        total = 2 * fwd + 2 * 2 * spec.layer_params  # weight gradients only for the trained layers (about 2 layers)
    else:
        total = 2 * fwd + 6 * lora_params
    if grad_ckpt:
        total += fwd
    return float(total)


def default_mfu(method: str, spec: ModelSpec, gpu: GPU, nodes: int = 1) -> float:
    m = MFU_DEFAULTS.get(method, 0.35)
    if spec.total_params < 1e9:
        m *= MFU_SMALL_MODEL
    if gpu.arch in ("turing", "volta") or gpu.name.startswith("RTX"):
        m *= MFU_CONSUMER
    return round(m, 3)


def scaling_efficiency(gpu: GPU, gpus: int, nodes: int = 1, method: str = "full", network: str = "infiniband") -> float:
    """The share of perfect scaling ``gpus`` GPUs on ``nodes`` nodes reach (1.0 for one GPU): see SCALING_IN_NODE."""
    if gpus <= 1:
        return 1.0
    if nodes > 1:
        e = SCALING_ACROSS_NODES.get(network, SCALING_ACROSS_NODES["infiniband"])
    else:
        link = gpu.interconnect.lower()  # "NVLink 4, 900 GB/s"; "PCIe 4.0, 64 GB/s (NVLink bridge pairs)": the all-reduce crosses PCIe
        e = next((v for k, v in SCALING_IN_NODE.items() if link.startswith(k)), SCALING_IN_NODE["pcie"])
    if method not in ("full", "freeze"):
        e = 1 - (1 - e) * ADAPTER_COMM_SHARE
    return round(e, 3)


@dataclass
class Compute:
    flops: float
    tokens: float
    mfu_assumed: float
    hours: float
    gpus: int
    scaling_efficiency: float = 1.0
    interconnect: str = ""

    def to_dict(self) -> dict:
        return {"flops": self.flops, "tokens": self.tokens, "mfu_assumed": self.mfu_assumed, "scaling_efficiency": self.scaling_efficiency,
                "hours": self.hours, "gpu_hours": self.hours * self.gpus, "interconnect": self.interconnect}


def interconnect_rule(gpu: GPU, gpus: int, nodes: int, method: str, eff: float, network: str = "infiniband") -> str:
    """What the scaling efficiency assumes about the links, said so a reader can check it against their cluster."""
    if gpus <= 1:
        return "one GPU: no gradient all-reduce"
    within = gpu.interconnect or "an unknown link (PCIe assumed)"
    adapter = "; an adapter all-reduces a fraction of the weights, so a fifth of the loss applies" if method not in ("full", "freeze") else ""
    if nodes > 1:
        names = ", ".join(f"{k} {int(v * 100)} %" for k, v in SCALING_ACROSS_NODES.items())
        return (f"{nodes} nodes: ASSUMED {network} between the nodes ({names} of perfect scaling; within a node {within}){adapter}: "
                f"{eff:.0%}. The network between your nodes decides this: on Ethernet the run is slower than planned")
    return f"one node: {within}{adapter}: {eff:.0%} of perfect scaling"


def compute(spec: ModelSpec, method: str, tokens: float, seq_len: int, grad_ckpt: bool, gpu: GPU, gpus: int, precision: str,
            mfu: float | None = None, lora_params: int = 0, nodes: int = 1) -> Compute:
    flops = flops_per_token(spec, method, seq_len, grad_ckpt, lora_params) * tokens
    m = mfu if mfu is not None else default_mfu(method, spec, gpu, nodes)
    eff = scaling_efficiency(gpu, gpus, nodes, method)
    peak = gpu.peak_tflops(precision) * 1e12
    hours = flops / (max(1, gpus) * peak * m * eff) / 3600 if peak > 0 else float("inf")
    return Compute(flops, tokens, m, hours, gpus, eff, interconnect_rule(gpu, gpus, nodes, method, eff))


def young_daly_interval(checkpoint_hours: float, mtbf_hours: float) -> float:
    """Optimal hours between checkpoints: Daly's sqrt(2 C M) - C when C < 2M, else M."""
    if checkpoint_hours <= 0:
        return 0.0
    if checkpoint_hours >= 2 * mtbf_hours:
        return mtbf_hours
    return math.sqrt(2 * checkpoint_hours * mtbf_hours) - checkpoint_hours


def waste_fraction(interval_hours: float, checkpoint_hours: float, mtbf_hours: float, restart_hours: float = 0.0) -> float:
    """Expected extra time per hour of useful work: writing checkpoints + rework after preemptions."""
    if interval_hours <= 0:
        return 0.0
    return checkpoint_hours / interval_hours + (interval_hours / 2 + restart_hours) / mtbf_hours


def checkpoint_write_hours(state_bytes: float, write_gb_per_s: float = 1.0) -> float:
    return state_bytes / (write_gb_per_s * 1e9) / 3600


@dataclass
class Cost:
    on_demand_usd: float
    spot_usd: float
    spot_hours: float
    checkpoint_interval_hours: float
    spot_waste_fraction: float
    preemptions_per_hour: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cost(hours: float, gpus: int, gpu: GPU, checkpoint_bytes: float, preemptions_per_hour: float = 0.1,
         restart_hours: float = 5 / 60, write_gb_per_s: float = 1.0) -> Cost:
    """On-demand cost, and spot cost including checkpoint writes and expected rework (Young/Daly interval)."""
    od = hours * gpus * gpu.on_demand_usd
    mtbf = 1 / preemptions_per_hour if preemptions_per_hour > 0 else float("inf")
    c = checkpoint_write_hours(checkpoint_bytes, write_gb_per_s)
    if math.isinf(mtbf):
        interval, waste = 0.0, 0.0
    else:
        interval = young_daly_interval(c, mtbf)
        waste = waste_fraction(interval, c, mtbf, restart_hours)
    spot_hours = hours * (1 + waste)
    return Cost(od, spot_hours * gpus * gpu.spot_usd, spot_hours, interval, waste, preemptions_per_hour)
