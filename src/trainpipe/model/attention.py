"""`model.attn_implementation`: the kernel rule of `auto` and which kernels keep packed examples apart.

Torch-free: the GPU is described by its compute capability, what is installed by `importlib.util.find_spec`. The
planner (plan/attention.py) turns these into its decisions; `load_model` asks `choose_attention` itself when it is
handed a config no plan resolved.

The rule of `auto`, first match wins. It chooses only kernels installed on this machine: never a Hub kernel (compiled
code fetched at load time), which runs only when named, with a pinned revision (`org/repo@<40-hex commit>`).

- Hopper (compute capability 9.x) with flash-attn 3 installed (`flash_attn_interface`): `flash_attention_3`;
- Ampere or newer (>= 8.0) with `flash_attn` installed: `flash_attention_2`;
- a model that soft-caps its attention scores (`attn_logit_softcapping` in its config, Gemma 2): `eager` (transformers'
  SDPA path cannot apply the cap, and refuses such models);
- not a CUDA GPU: `sdpa` (the flash-attention kernels are CUDA-only; SDPA is PyTorch's fused attention on the CPU);
- else `sdpa` (Turing and older GPUs, or no flash-attn installed).

An explicit choice the model or the machine cannot run (`sdpa` for Gemma 2, a flash kernel off CUDA, an unpinned or
unreachable Hub kernel) is refused before anything loads, with one paragraph (ConfigError, exit 2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Callable

from trainpipe.errors import ConfigError

PACKING_METHODS = ("sft", "pretrain")  # the objectives whose collator packs (train/objectives.TokenCrossEntropy)
PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning", "p_tuning")
BUILT_IN = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
FLASH = ("flash_attention_2", "flash_attention_3")
# the attention matrix (batch x heads x seq x seq) is held in memory for the backward: eager only
MATERIALISES_SCORES = ("eager",)
PINNED = re.compile(r"^[^/:@]+/[^/:@]+@[0-9a-f]{40}(?::[^/:@]+)?$")  # a Hub kernel at one commit (transformers' `repo@rev:fn`)


def model_config(name_or_path: str | None) -> dict:
    """The model's `config.json` when it is a local folder ({} otherwise): what `auto` reads of what the model supports."""
    try:
        data = json.loads((Path(name_or_path).expanduser() / "config.json").read_text(encoding="utf-8")) if name_or_path else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def softcaps(config: dict) -> bool:
    """Whether the model soft-caps its attention scores (Gemma 2's `attn_logit_softcapping`; in `text_config` too)."""
    sub = config.get("text_config")
    return config.get("attn_logit_softcapping") is not None or (isinstance(sub, dict) and sub.get("attn_logit_softcapping") is not None)


def _offline(env) -> bool:
    return str(env.get("HF_HUB_OFFLINE", "")).lower() in ("1", "true", "yes", "on")


def kernel_cache(requested: str, env) -> Path:
    """Where the `kernels` package keeps a pinned Hub kernel (``org/name@commit[:fn]``): its snapshot folder under
    `KERNELS_CACHE`, else the Hub cache (`HF_HUB_CACHE`, `HF_HOME`/hub, ~/.cache/huggingface/hub)."""
    repo, _, rest = requested.partition("@")
    root = env.get("KERNELS_CACHE") or env.get("HF_HUB_CACHE") or str(Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    return Path(root).expanduser() / f"models--{repo.replace('/', '--')}" / "snapshots" / rest.split(":")[0]


def hub_kernel_cached(requested: str, env) -> bool:
    """Whether that commit of the Hub kernel is in the local cache, where `kernels` loads it from offline."""
    folder = kernel_cache(requested, env)
    return folder.is_dir() and any(folder.iterdir())


def _check_requested(requested: str, accelerator: str, config: dict, have: Callable[[str], bool], env) -> None:
    """Refuse (ConfigError, one paragraph) an explicit kernel this model or machine cannot run."""
    if requested in FLASH and accelerator != "cuda":
        raise ConfigError(f"`model.attn_implementation: {requested}` needs a CUDA GPU (this machine runs on the {accelerator}). "
                          "Use `sdpa` (or `auto`, which picks `sdpa` here).")
    if requested in ("sdpa", "flex_attention") and softcaps(config):
        raise ConfigError(f"`model.attn_implementation: {requested}`: this model soft-caps its attention scores (`attn_logit_softcapping: "
                          f"{config.get('attn_logit_softcapping')}` in its config, as Gemma 2 does), which transformers' {requested} path cannot "
                          "apply, so it refuses to load it. Use `eager` (or `auto`, which picks `eager` for such models, or `flash_attention_2` "
                          "on a CUDA GPU with flash-attn installed).")
    if "/" in requested and requested not in BUILT_IN:
        if not PINNED.match(requested):
            raise ConfigError(f"`model.attn_implementation: {requested}` names a Hub kernel (compiled code downloaded and run at load time) "
                              "without a pinned revision, so what runs could change under you. Pin the commit you reviewed: "
                              f"`{requested.split('@')[0].split(':')[0]}@<40-hex commit>`, or use an installed kernel (`sdpa`, `flash_attention_2`).")
        if _offline(env) and not hub_kernel_cached(requested, env):
            raise ConfigError(f"`model.attn_implementation: {requested}` names a Hub kernel, which is downloaded at load time, and "
                              f"`HF_HUB_OFFLINE` is set: it cannot be fetched, and that commit is not in the local cache "
                              f"(`{kernel_cache(requested, env)}`). Unset `HF_HUB_OFFLINE` for this run (once: it is cached then), or use "
                              "an installed kernel (`sdpa`, `flash_attention_2`).")
        if not have("kernels"):
            raise ConfigError(f"`model.attn_implementation: {requested}` names a Hub kernel, which needs the `kernels` package "
                              "(`pip install kernels`), not installed here. Install it, or use an installed kernel (`sdpa`, `flash_attention_2`).")


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


def choose_attention(requested: str, accelerator: str, capability: float = 0.0, *, have: Callable[[str], bool] = installed,
                     env: dict | None = None, config: dict | None = None) -> tuple[str, str]:
    """(implementation, rule) for this machine and model: ``requested`` unless `auto` (checked), else the rule of the module
    docstring. ``capability``: the first GPU's compute capability (8.0 for A100, 9.0 for H100); ``have``: whether a module
    is installed; ``config``: the model's config.json ({} when unknown)."""
    env, config = os.environ if env is None else env, config or {}
    if requested != "auto":
        _check_requested(requested, accelerator, config, have, env)
        return requested, "as requested"
    gpu = f"compute capability {capability:.1f}"
    if accelerator == "cuda" and 9.0 <= capability < 10.0 and have("flash_attn_interface"):
        return ("flash_attention_3", f"Hopper GPU ({gpu}) and flash-attn 3 installed")
    if accelerator == "cuda" and capability >= 8.0 and have("flash_attn"):
        return ("flash_attention_2", f"{gpu} >= 8.0 and flash-attn installed")
    if softcaps(config):
        return ("eager", f"the model soft-caps its attention scores (`attn_logit_softcapping: {config.get('attn_logit_softcapping')}`, "
                         "Gemma 2), which transformers' SDPA path cannot apply: eager (auto never picks a Hub kernel)")
    if accelerator != "cuda":
        return ("sdpa", f"on the {accelerator}: PyTorch SDPA (the flash-attention kernels are CUDA-only)")
    why = "below 8.0 (the flash-attention kernels need Ampere or newer)" if capability < 8.0 else (
        ">= 8.0 but flash-attn is not installed (`pip install flash-attn` for flash_attention_2; auto never fetches a Hub kernel)")
    return ("sdpa", f"{gpu} {why}: PyTorch SDPA")


def for_this_machine(requested: str, name_or_path: str | None = None) -> str:
    """The implementation to load with: ``requested`` (checked), or `auto` decided for this process's device and the model
    at ``name_or_path`` (a config no plan resolved)."""
    import torch

    config = model_config(name_or_path)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return choose_attention(requested, "cuda", float(f"{major}.{minor}"), config=config)[0]
    return choose_attention(requested, "cpu", config=config)[0]
