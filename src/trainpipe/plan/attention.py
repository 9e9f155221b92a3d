"""`model.attn_implementation: auto` and `data.packing: auto` as the planner's decisions (printed at run start with their
rule, recorded in the manifest's plan).

The kernel rule is model/attention.py's `choose_attention` (the GPU's compute capability and what is installed).

Packed and padding-free rows keep examples apart by position ids that restart at 0 for each example. transformers 5
turns them into a variable-length attention: the flash-attention paths read the sequence boundaries from the position
ids (varlen), and `create_causal_mask` (masking_utils.py, `find_packed_sequence_indices`) builds a block-diagonal mask for
`sdpa`, `eager` and `flex_attention` whenever the batch has position ids, no attention mask and no cache (the collator,
data/collate.py, gives exactly that). So every built-in implementation is exact; a hub kernel only when it is a
flash-attention kernel (the same varlen path). The padding-free rule (`decide_packing`):

- objectives that batch pairs, prompts or labels of their own (dpo/orpo/kto, reward, classification, rl) never pack:
  `none`;
- prompt and prefix tuning put virtual tokens before the whole row (PEFT drops the position ids): `none`;
- an attention path that would let examples see each other (a hub kernel that is not flash-attention): `none` for
  `auto`, refused (`ConfigError`) for `pack`/`padding_free`;
- `flex_attention` on the CPU has no backward in torch 2.13: refused for training, whatever the packing;
- a vision-language model (a `vision_config` in its config.json) of a family whose forward flattens exactly
  (data/vision_chat.py `FLATTENS`: LLaVA, measured equal to padded rows): `padding_free` like text; any other family:
  `none` for `auto` *and* for `padding_free`, printed as "padded (vision-language rows)" (its rows carry pixel tensors
  beside the tokens; Gemma 3 builds its own mask over the image tokens), so the plan and the data report say padded
  rather than padding-free; `pack` is refused by the data step (it would cut through an image's tokens);
- else (sft, pretrain): `padding_free`.
"""

from __future__ import annotations

from trainpipe.errors import ConfigError
from trainpipe.model.attention import PACKING_METHODS, PROMPT_LEARNING, choose_attention, is_flash, keeps_examples_apart, model_config
from trainpipe.data.vision_chat import FLATTENS
from trainpipe.model.vision import is_vision_config
from trainpipe.plan.decisions import Decision
from trainpipe.plan.gpus import find_gpu, gpu_from_device_name

EAGER_WATCH = "eager holds the whole attention matrix in memory: if memory runs out or steps are slow, use sdpa or flash_attention_2"


def decide_attention(requested: str, accelerator: str, capability: float = 0.0, **kw) -> Decision:
    """`model.attn_implementation` as a Decision (model/attention.choose_attention's value and rule)."""
    value, rule = choose_attention(requested, accelerator, capability, **kw)
    return Decision("model.attn_implementation", value, rule, EAGER_WATCH if value == "eager" else "")


def memory_attention(impl: str) -> str:
    """The memory model's attention kernel (plan/setup.py ATTENTION) for `model.attn_implementation`: `eager` holds the
    attention matrix; flash kernels (built in or from the hub) and `flex_attention` save q, k/v, the output and a logsumexp;
    `sdpa` and `auto` (which never picks eager) as SDPA."""
    if impl == "eager":
        return "eager"
    return "flash" if is_flash(impl) or impl == "flex_attention" else "sdpa"


VISION_PADDED = ("padded (vision-language rows): each row carries its images' pixel tensors beside the tokens, so rows are "
                 "padded to the longest in the batch, never flattened or packed (that would join examples through their images)")


def decide_packing(requested: str, attn: str, *, method: str, peft: str, accelerator: str = "cpu", vision: str | None = None) -> Decision:
    """`data.packing` for the objective and the chosen attention (``attn``, already resolved): `auto` by the rule of the
    module docstring; `pack`/`padding_free` refused (ConfigError) where examples would attend to each other; a
    vision-language model (``vision``: `padded`, or `flattens` for a family of `FLATTENS`) padded for `auto` and
    `padding_free` alike (said so) unless its family flattens."""
    if vision == "padded" and requested in ("auto", "padding_free"):
        asked = "`data.packing: padding_free` asked; " if requested == "padding_free" else ""
        return Decision("data.packing", "none", asked + VISION_PADDED)
    if attn == "flex_attention" and accelerator == "cpu":
        raise ConfigError("`model.attn_implementation: flex_attention` cannot train on the CPU: PyTorch's FlexAttention has no "
                          "backward pass there. Use `sdpa` (exact for padded, packed and padding-free batches alike) or `auto`.")
    packs = requested in ("pack", "padding_free")
    if packs and not keeps_examples_apart(attn):
        raise ConfigError(
            f"`data.packing: {requested}` with `model.attn_implementation: {attn}`: this kernel does not read the per-example "
            "position ids of a packed row as sequence boundaries, so the examples joined in a row would attend to each other. "
            "Set `model.attn_implementation` to `sdpa`, `flash_attention_2`, `flash_attention_3` or a `kernels-community/flash-attn` "
            "kernel, or `data.packing: none`.")
    if requested != "auto":
        return Decision("data.packing", requested, "as requested")
    if method not in PACKING_METHODS:
        return Decision("data.packing", "none", f"`method.name: {method}` batches its own pairs, prompts or labels: dynamic padding")
    if peft in PROMPT_LEARNING:
        return Decision("data.packing", "none", f"`method.peft: {peft}` puts virtual tokens before the whole row, so packed examples would see each other: dynamic padding")
    if not keeps_examples_apart(attn):
        return Decision("data.packing", "none", f"`model.attn_implementation: {attn}` does not keep packed examples apart: dynamic padding")
    path = "flash-attention varlen" if is_flash(attn) else f"{attn} with a block-diagonal mask from the position ids"
    if vision == "flattens":
        path += "; vision-language rows too: the image features are scattered at their placeholders in order"
    return Decision("data.packing", "padding_free", f"{method}: batches concatenated without padding, position ids restarting per example; "
                    f"{path} keeps every example to itself (exact: the same loss as padded batches)")


ARCH_CAPABILITY = {"volta": 7.0, "turing": 7.5, "ampere": 8.0, "ada": 8.9, "hopper": 9.0, "blackwell": 10.0}  # plan/data/gpus.json `arch`


def capability_of(hw) -> float:
    """``hw``'s compute capability: as detected, else from the catalog entry of its first device (a GPU described by name)."""
    if hw.accelerator != "cuda" or getattr(hw, "compute_capability", 0.0):
        return getattr(hw, "compute_capability", 0.0)
    name = gpu_from_device_name(hw.device_names[0]) if hw.device_names else None
    return ARCH_CAPABILITY.get(find_gpu(name).arch, 0.0) if name else 0.0


def resolve_attention(cfg, hw, decisions: list[Decision]) -> None:
    """Fill `model.attn_implementation` and every `data.packing` of ``cfg`` (in place), each `auto` with its Decision."""
    d = decide_attention(cfg.model.attn_implementation, hw.accelerator, capability_of(hw), config=model_config(cfg.model.name_or_path))
    decisions.append(d)  # always: the kernel shapes speed and memory, so the run's start and its manifest name it
    cfg.model.attn_implementation = d.value
    sections = [cfg.data] + [a.data for a in (cfg.method.adapters or []) if getattr(a, "data", None) is not None]
    config = model_config(cfg.model.name_or_path)
    vision = ("flattens" if config.get("model_type") in FLATTENS else "padded") if is_vision_config(config) else None
    for data in (s for s in sections if s is not None):
        p = decide_packing(data.packing, d.value, method=cfg.method.name, peft=cfg.method.peft, accelerator=hw.accelerator, vision=vision)
        if data.packing == "auto" or p.value != data.packing:  # a choice, or a request the rule changed (said so)
            decisions.append(p)
        data.packing = p.value
