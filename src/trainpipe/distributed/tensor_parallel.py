"""Tensor parallelism for Hugging Face models: transformers' own tensor-parallel plan (`tp_plan="auto"`).

transformers 5 ships a tensor-parallel plan for its dense decoder models (the `base_model_tp_plan` of each config:
q, k, v, gate and up projections split by output columns, o and down projections by input rows, the attention split by
heads) and applies it with torch's DTensor when a model is loaded with `tp_plan="auto"` on a device mesh; it runs on
gloo (CPU) as on NCCL. :func:`load` loads a model that way for a tensor group of ``degree`` ranks after
:func:`check` (the attention and key/value heads must divide, each rank keeping whole heads). The training loop does not
use this yet (the tensor degree of a run is 1; above what FSDP and ZeRO hold the plan hands the run to torchtitan); a
2-process gloo test holds it to one process: the same loss and gradients on a tiny Llama.
"""

from __future__ import annotations

from trainpipe.errors import TrainpipeError


def check(config, degree: int) -> None:
    """Whole heads on every rank: one paragraph naming the heads and the degrees that would divide them otherwise."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 0
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads and (heads % degree or kv % degree):
        ok = [d for d in range(1, heads + 1) if heads % d == 0 and kv % d == 0]
        raise TrainpipeError(
            f"A tensor-parallel degree of {degree} splits the attention by heads, and the model has {heads} attention and {kv} "
            f"key/value heads, which {degree} does not divide. Use a degree that divides both ({', '.join(map(str, ok))}).")


def load(path: str, degree: int, **kwargs):
    """The model at ``path`` split over a tensor group of ``degree`` ranks (every rank of the process group calls it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    check(AutoConfig.from_pretrained(path), degree)
    import torch

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (degree,))
    return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh, **kwargs)


__all__ = ["check", "load"]
