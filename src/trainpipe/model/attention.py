"""`model.attn_implementation`: the kernel rule of `auto` and which kernels keep packed examples apart.

Torch-free: the GPU is described by its compute capability, what is installed by `importlib.util.find_spec`. The
planner (plan/attention.py) turns these into its decisions; `load_model` asks `choose_attention` itself when it is
handed a config no plan resolved.

The rule of `auto`, first match wins:

- not a CUDA GPU: `sdpa` (the flash-attention kernels are CUDA-only; SDPA is PyTorch's fused attention on the CPU);
- Hopper (compute capability 9.x) with flash-attn 3 installed (`flash_attn_interface`): `flash_attention_3`;
- Ampere or newer (>= 8.0) with `flash_attn` installed: `flash_attention_2`;
- Ampere or newer with the `kernels` package and the hub reachable (not `HF_HUB_OFFLINE`): the hub's flash-attention
  kernel (`kernels-community/vllm-flash-attn3` on Hopper, `kernels-community/flash-attn2` otherwise);
- else `sdpa` (Turing and older GPUs, or nothing installed).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

from trainpipe.errors import ConfigError

PACKING_METHODS = ("sft", "pretrain")  # the objectives whose collator packs (train/objectives.TokenCrossEntropy)
PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning", "p_tuning")
BUILT_IN = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
FLASH = ("flash_attention_2", "flash_attention_3")
# the attention matrix (batch x heads x seq x seq) is held in memory for the backward: eager only
MATERIALISES_SCORES = ("eager",)
HUB_FA2, HUB_FA3 = "kernels-community/flash-attn2", "kernels-community/vllm-flash-attn3"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_flash(impl: str) -> bool:
    """A flash-attention kernel: built in, or a hub kernel of that family (transformers' varlen path)."""
    return impl in FLASH or ("/" in impl and "flash-attn" in impl.split("/", 1)[1])


def keeps_examples_apart(impl: str) -> bool:
    """Whether packed rows (position ids restarting per example, no attention mask) stay separate examples under ``impl``."""
    return impl in BUILT_IN or is_flash(impl)


def choose_attention(requested: str, accelerator: str, capability: float = 0.0, *,
                     have: Callable[[str], bool] = installed, env: dict | None = None) -> tuple[str, str]:
    """(implementation, rule) for this machine: ``requested`` unless `auto`, else the rule of the module docstring.
    ``capability``: the first GPU's compute capability (8.0 for A100, 9.0 for H100); ``have``: whether a module is installed."""
    env = os.environ if env is None else env
    if requested != "auto":
        if requested in FLASH and accelerator != "cuda":
            raise ConfigError(f"`model.attn_implementation: {requested}` needs a CUDA GPU (this machine runs on the {accelerator}). "
                              "Use `sdpa` (or `auto`, which picks `sdpa` here).")
        return requested, "as requested"
    if accelerator != "cuda":
        return ("sdpa", f"on the {accelerator}: PyTorch SDPA (the flash-attention kernels are CUDA-only)")
    gpu = f"compute capability {capability:.1f}"
    if 9.0 <= capability < 10.0 and have("flash_attn_interface"):
        return ("flash_attention_3", f"Hopper GPU ({gpu}) and flash-attn 3 installed")
    if capability >= 8.0 and have("flash_attn"):
        return ("flash_attention_2", f"{gpu} >= 8.0 and flash-attn installed")
    if capability >= 8.0 and have("kernels") and str(env.get("HF_HUB_OFFLINE", "")).lower() not in ("1", "true", "yes", "on"):
        hub = HUB_FA3 if capability < 10.0 and capability >= 9.0 else HUB_FA2
        return (hub, f"{gpu} >= 8.0, no flash-attn package but `kernels` installed: the hub's flash-attention kernel")
    why = "below 8.0 (the flash-attention kernels need Ampere or newer)" if capability < 8.0 else ">= 8.0 but neither flash-attn nor `kernels` is installed (`pip install flash-attn` for flash_attention_2)"
    return ("sdpa", f"{gpu} {why}: PyTorch SDPA")


def for_this_machine(requested: str) -> str:
    """The implementation to load with: ``requested``, or `auto` decided for this process's device (a config no plan resolved)."""
    if requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return choose_attention("auto", "cuda", float(f"{major}.{minor}"))[0]
    return choose_attention("auto", "cpu")[0]
