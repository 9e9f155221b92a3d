"""Model architectures without weights: the built-in catalog, a local `config.json`, or a hub config.

`find_model(name_or_path)` returns a :class:`ModelSpec`: the architecture figures the memory and
compute models need, and the exact parameter shapes. Shapes come from building the model on the
meta device (no weights, no memory): for catalog entries that build is done once by
`scripts/make_model_shapes.py` and shipped in `plan/data/model_shapes.json` (so `trainpipe plan`
needs no torch for them and a 70B plan is instant); a local folder or a hub config is built on
the meta device when asked. Trainable counts under LoRA/DoRA are PEFT's rule applied to those
shapes (`r * (in + out)` per adapted module, plus `out` for DoRA's magnitude); the tests check
that rule against `peft.get_peft_model` on meta-built models.

No torch or transformers import at module load.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from trainpipe.errors import TrainpipeError
from trainpipe.model.loading import decoder_blocks, freeze_plan
from trainpipe.plan import vision


class ModelNotFoundError(TrainpipeError):
    """The model is not in the catalog, not a local folder with config.json, and not reachable on the hub."""

    title = "unknown model"


class LoraTargetError(TrainpipeError):
    title = "invalid LoRA targets"


# Generic module names (`method.lora.target_modules: [q, k, v, o, gate, up, down]`) -> leaf names by architecture.
GENERIC_TARGETS: dict[str, dict[str, list[str]]] = {
    "llama": {"q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"], "o": ["o_proj"], "gate": ["gate_proj"], "up": ["up_proj"], "down": ["down_proj"]},
    "phi": {"q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"], "o": ["dense"], "up": ["fc1"], "down": ["fc2"]},
    "phi3": {"q": ["qkv_proj"], "k": ["qkv_proj"], "v": ["qkv_proj"], "o": ["o_proj"], "gate": ["gate_up_proj"], "up": ["gate_up_proj"], "down": ["down_proj"]},
    "falcon": {"q": ["query_key_value"], "k": ["query_key_value"], "v": ["query_key_value"], "o": ["self_attention.dense"], "up": ["dense_h_to_4h"], "down": ["dense_4h_to_h"]},
    "gpt_neox": {"q": ["query_key_value"], "k": ["query_key_value"], "v": ["query_key_value"], "o": ["attention.dense"], "up": ["dense_h_to_4h"], "down": ["dense_4h_to_h"]},
    "gpt2": {"q": ["c_attn"], "k": ["c_attn"], "v": ["c_attn"], "o": ["attn.c_proj"], "up": ["c_fc"], "down": ["mlp.c_proj"]},
    "bert": {"q": ["query"], "k": ["key"], "v": ["value"], "o": ["output.dense"], "up": ["intermediate.dense"], "down": ["output.dense"]},
    "t5": {"q": ["q"], "k": ["k"], "v": ["v"], "o": ["o"], "gate": ["wi_0"], "up": ["wi", "wi_1"], "down": ["wo"]},
}
_TARGET_FAMILY = {"mistral": "llama", "mixtral": "llama", "qwen2": "llama", "qwen2_moe": "llama", "qwen3": "llama", "qwen3_moe": "llama",
                  "gemma": "llama", "gemma2": "llama", "gemma3_text": "llama", "stablelm": "llama", "smollm3": "llama", "roberta": "bert"}
GATED_MLP = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "stablelm", "smollm3"}


@dataclass
class Linear:
    name: str  # `parent.leaf` suffix, as trainpipe's LoRA target resolution sees it
    fan_in: int
    fan_out: int
    count: int  # how many modules of this name and shape
    in_layers: bool = True
    bias: bool = False
    path: str = ""  # module path inside its block (after the layer index), e.g. `self_attn.q_proj`

    @property
    def leaf(self) -> str:
        return self.name.split(".")[-1]


@dataclass
class ModelSpec:
    """Architecture figures of one model (no weights)."""

    id: str
    model_type: str
    task: str  # causal-lm | masked-lm | seq2seq-lm
    config: dict
    source: str  # catalog | local | hub
    total_params: int
    embedding_params: int
    lm_head_params: int  # separate output matrix (0 when tied)
    linears: list[Linear]
    other_layer_params: int = 0  # norms etc. inside the repeated blocks
    note: str | None = None
    # what `peft: freeze` trains beside the blocks (train/model.py freeze_plan/freeze_layers, recorded by shapes_from_model):
    final_norm_params: int | None = None  # the final norm(s) freeze_plan names (None: not recorded; plan/memory.py assumes one RMSNorm)
    lm_head_bias_params: int = 0  # the output module's parameters beyond its weight (a bias, e.g. phi-2's lm_head)
    arch: dict = field(default_factory=dict)
    vision: dict | None = None  # a vision-language model's tower (plan/vision.py `figures`; the catalog's `vision` block)

    # ---- architecture shorthands used by the memory and compute models
    @property
    def hidden(self) -> int:
        return self.arch["hidden"]

    @property
    def layers(self) -> int:
        return self.arch["layers"]

    @property
    def vocab(self) -> int:
        return self.arch["vocab"]

    @property
    def linear_params(self) -> int:
        """Parameters in Linear weights (what 4-bit/8-bit quantization converts); lm_head excluded."""
        return sum(li.fan_in * li.fan_out * li.count for li in self.linears)

    @property
    def layer_params(self) -> int:
        """Parameters of one repeated block (the unit FSDP/ZeRO-3 gathers)."""
        inside = sum((li.fan_in * li.fan_out + (li.fan_out if li.bias else 0)) * li.count for li in self.linears if li.in_layers)
        return (inside + self.other_layer_params) // max(1, self.layers)

    @property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: only the top-k experts)."""
        e, k = self.arch.get("experts", 0), self.arch.get("experts_per_token", 0)
        if not e:
            return self.total_params
        expert = self.arch.get("expert_params", 0)
        return self.total_params - expert + expert * k // e

    def resolve_targets(self, targets: str | list[str]) -> list[Linear]:
        """The Linear modules LoRA adapts for `attention`, `all-linear`, generic names or module names."""
        lins = [li for li in self.linears if li.in_layers] if self.task != "masked-lm" else list(self.linears)
        if targets == "all-linear":
            return [li for li in self.linears]
        if targets == "attention":
            found = [li for li in lins if any(k in part.lower() for part in (li.path or li.name).split(".")[:-1] for k in ("attn", "attention"))]
            if not found:
                raise LoraTargetError(f"`{self.id}` has no attention projections trainpipe recognises; name the modules in `method.lora.target_modules`, e.g. `--set method.lora.target_modules={','.join(sorted({li.leaf for li in lins})[:4])}`.")
            return found
        names = [t.strip() for t in (targets if isinstance(targets, list) else str(targets).split(",")) if t.strip()]
        fam = GENERIC_TARGETS.get(_TARGET_FAMILY.get(self.model_type, self.model_type), {})
        chosen: list[Linear] = []
        for n in names:
            wanted = fam.get(n, [n])
            hit = [li for li in lins if any(li.leaf == w or (li.path or li.name) == w or (li.path or li.name).endswith("." + w) for w in wanted)]
            if not hit:
                have = sorted({li.leaf for li in lins})
                generic = sorted(k for k, v in fam.items() if any(any(li.leaf == w or li.name.endswith(w) for li in lins) for w in v))
                why = " (this model's MoE experts are fused parameters, not Linear modules, so LoRA cannot adapt them)" if self.arch.get("experts") and n in ("gate", "up", "down") else ""
                raise LoraTargetError(
                    f"LoRA target `{n}` matches no Linear module of `{self.id}`{why}. Use `attention`, `all-linear`, "
                    f"generic names ({', '.join(generic) or 'none known'}) or module names ({', '.join(have)})."
                )
            chosen += [li for li in hit if li not in chosen]
        return chosen

    def lora_params(self, r: int, targets: str | list[str], dora: bool = False) -> int:
        """Exact trainable parameters PEFT adds: r*(in+out) per adapted module (+ out for DoRA)."""
        return sum((r * (li.fan_in + li.fan_out) + (li.fan_out if dora else 0)) * li.count for li in self.resolve_targets(targets))


# --------------------------------------------------------------------------- the catalog


def _data(name: str) -> dict:
    return json.loads(resources.files("trainpipe.plan").joinpath("data", name).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def catalog() -> dict[str, dict]:
    """Catalog entries keyed by lower-cased hub id and alias."""
    out: dict[str, dict] = {}
    for e in _data("models.json")["models"]:
        for key in [e["id"], *e.get("aliases", [])]:
            out[key.lower()] = e
    return out


@lru_cache(maxsize=1)
def _shapes() -> dict[str, dict]:
    try:
        return _data("model_shapes.json")["models"]
    except FileNotFoundError:  # pragma: no cover - the file ships with the package
        return {}


def catalog_ids() -> list[str]:
    return [e["id"] for e in _data("models.json")["models"]]


def arch_from_config(model_type: str, c: dict) -> dict:
    """Normalised architecture figures from a transformers config dict."""
    g = lambda *keys, default=None: next((c[k] for k in keys if c.get(k) is not None), default)  # noqa: E731
    h = g("hidden_size", "n_embd", "d_model")
    heads = g("num_attention_heads", "n_head", "num_heads")
    kv = g("num_key_value_heads", "num_kv_heads", default=None)
    if kv is None:
        kv = 1 if c.get("multi_query") and not c.get("new_decoder_architecture") else heads
    layers = g("num_hidden_layers", "n_layer", "num_layers")
    if model_type == "t5":
        layers = (c.get("num_layers") or 0) + (c.get("num_decoder_layers") or c.get("num_layers") or 0)
    hd = g("head_dim", "d_kv", default=None) or h // heads
    experts = g("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    inter = g("moe_intermediate_size", default=None) if experts else None
    inter = inter or g("intermediate_size", "n_inner", "ffn_hidden_size", "d_ff", default=None) or 4 * h
    gated = model_type in GATED_MLP or (model_type == "t5" and str(c.get("feed_forward_proj", "")).startswith("gated"))
    return {
        "hidden": h, "layers": layers, "heads": heads, "kv_heads": kv, "head_dim": hd, "intermediate": inter,
        "vocab": g("vocab_size"), "experts": experts, "experts_per_token": g("num_experts_per_tok", "top_k", default=0) or 0,
        "gated_mlp": gated, "max_positions": g("max_position_embeddings", "n_positions", default=None),
        "tied": bool(c.get("tie_word_embeddings", model_type in ("gpt2", "t5"))),
        "dropout": model_type in ("bert", "roberta", "gpt2", "t5") and float(c.get("hidden_dropout_prob", c.get("resid_pdrop", c.get("dropout_rate", 0.1))) or 0) > 0,
    }


def shapes_from_model(model, num_layers: int) -> dict:
    """Parameter shapes of a (meta-device) transformers model: totals and every Linear, grouped."""
    import torch

    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() de-duplicates tied weights
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    groups: dict[tuple, dict] = {}
    layer_other = 0
    layer_prefixes: set[str] = set()
    for name, mod in model.named_modules():
        parts = name.split(".")
        digits = [i for i, x in enumerate(parts) if x.isdigit()]
        in_layers = bool(digits) and mod is not out_emb
        if in_layers:
            layer_prefixes.add(".".join(parts[: digits[0] + 1]))
        if mod is out_emb or mod is in_emb:
            continue
        is_conv1d = type(mod).__name__ == "Conv1D"
        if isinstance(mod, torch.nn.Linear) or is_conv1d:
            w = mod.weight
            fan_in, fan_out = (w.shape[0], w.shape[1]) if is_conv1d else (w.shape[1], w.shape[0])
            path = ".".join(parts[digits[0] + 1 :]) if digits else name
            path = re.sub(r"^(layer\.\d+\.)", "", path)
            key = (".".join(parts[-2:]) if len(parts) >= 2 else parts[-1], fan_in, fan_out, mod.bias is not None, in_layers, path)
            groups.setdefault(key, {"name": key[0], "path": path, "in": fan_in, "out": fan_out, "bias": key[3], "in_layers": in_layers, "count": 0})["count"] += 1
    linear_in_layers = sum((g["in"] * g["out"] + (g["out"] if g["bias"] else 0)) * g["count"] for g in groups.values() if g["in_layers"])
    for prefix in layer_prefixes:
        blk = model.get_submodule(prefix)
        layer_other += sum(p.numel() for p in blk.parameters())
    layer_other -= linear_in_layers
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj"))
    return {
        "total_params": total,
        **_freeze_extra_shapes(model, out_emb),
        "embedding_params": in_emb.weight.numel() if in_emb is not None else 0,
        "lm_head_params": 0 if (tied or out_emb is None) else out_emb.weight.numel(),
        "other_layer_params": max(0, layer_other),
        "expert_params": expert_params,
        "linears": sorted(groups.values(), key=lambda g: (not g["in_layers"], g["name"])),
    }


def _freeze_extra_shapes(model, out_emb) -> dict:
    """What `peft: freeze` trains beside the blocks and the head's weight, by train/model.py's own rule: the parameters of
    the non-block modules `freeze_plan` names (the final norm) and of the output module beyond its weight (a bias).
    final_norm_params is None where freeze cannot find the blocks (freeze_plan's error: the planner cannot plan freeze)."""
    head_extra = sum(p.numel() for n, p in out_emb.named_parameters() if n != "weight") if out_emb is not None else 0
    try:
        blocks, _ = decoder_blocks(model)
        names = [n for n in freeze_plan(model, 1) if n != blocks and not n.startswith(blocks + ".")]
    except (TrainpipeError, AttributeError, ValueError):
        return {"final_norm_params": None, "lm_head_bias_params": head_extra}
    return {"final_norm_params": sum(p.numel() for n in names for p in model.get_submodule(n).parameters()), "lm_head_bias_params": head_extra}


def build_meta_model(model_type: str, config: dict, task: str = "causal-lm", trust_remote_code: bool = False):
    """Build the transformers model for `config` on the meta device (no memory, no weights)."""
    import torch
    import transformers
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **config) if model_type else config
    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM}[task]
    with torch.device("meta"):
        return auto.from_config(cfg, trust_remote_code=trust_remote_code)


def _spec(id: str, model_type: str, task: str, config: dict, source: str, shapes: dict, note: str | None = None, vision_figures: dict | None = None) -> ModelSpec:
    arch = arch_from_config(model_type, config)
    arch["expert_params"] = shapes.get("expert_params", 0)
    return ModelSpec(
        id=id, model_type=model_type, task=task, config=config, source=source, total_params=shapes["total_params"],
        embedding_params=shapes["embedding_params"], lm_head_params=shapes["lm_head_params"],
        linears=[Linear(g["name"], g["in"], g["out"], g["count"], g["in_layers"], g["bias"], g.get("path", "")) for g in shapes["linears"]],
        other_layer_params=shapes.get("other_layer_params", 0), note=note, arch=arch,
        final_norm_params=shapes.get("final_norm_params"), lm_head_bias_params=shapes.get("lm_head_bias_params", 0), vision=vision_figures,
    )


def _task_for(cfg_dict: dict) -> str:
    archs = " ".join(cfg_dict.get("architectures") or [])
    if cfg_dict.get("model_type") == "t5" or "ConditionalGeneration" in archs:
        return "seq2seq-lm"
    if "MaskedLM" in archs or cfg_dict.get("model_type") in ("bert", "roberta"):
        return "masked-lm"
    return "causal-lm"


def _remote_code_equivalent(model_type: str, d: dict) -> tuple[str, dict, str] | None:
    """A config.json whose `model_type` transformers does not ship (remote code, e.g. Qwen 1's `qwen`) planned as the
    built-in layout with the same tensors: (model_type, config, note), or None."""
    if model_type == "qwen" and {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"} <= set(d):
        # Qwen 1 (remote code): c_attn is one fused qkv with bias, the MLP's intermediate_size is halved inside (w1, w2 of
        # intermediate_size // 2), untied embeddings: the qwen2 layout (q/k/v with bias, gated MLP) has the same tensors
        c = {"hidden_size": d["hidden_size"], "num_hidden_layers": d["num_hidden_layers"], "num_attention_heads": d["num_attention_heads"],
             "num_key_value_heads": d["num_attention_heads"], "intermediate_size": d["intermediate_size"] // 2, "vocab_size": d["vocab_size"],
             "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)), "max_position_embeddings": d.get("seq_length", d.get("max_position_embeddings", 8192))}
        return "qwen2", c, "Qwen 1 ships remote code (model_type qwen, intermediate_size halved inside); planned as the equivalent qwen2 layout"
    return None


def spec_from_config_dict(id: str, cfg_dict: dict, source: str) -> ModelSpec:
    """Build from a full config.json mapping (local folder or hub) on the meta device."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    d = {k: v for k, v in cfg_dict.items() if not k.startswith("_")}
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ModelNotFoundError(f"`{id}`: config.json has no `model_type`, so its architecture is unknown. Use a config.json written by transformers `save_pretrained`.")
    if model_type not in CONFIG_MAPPING_NAMES and (eq := _remote_code_equivalent(model_type, d)) is not None:
        mt, c, note = eq
        model = build_meta_model(mt, c, "causal-lm")
        return _spec(id, mt, "causal-lm", c, source, shapes_from_model(model, 0), note)
    d.pop("architectures", None)
    d.pop("quantization_config", None)
    text = vision.text_part(model_type, d)
    if text is not None:  # a vision-language model: plan its text decoder (the image side is in the plan's notes: plan/vision.py)
        model_type, d = text
    try:
        cfg = AutoConfig.for_model(model_type, **d)
        task = "causal-lm" if text is not None else _task_for(cfg_dict)
        model = build_meta_model("", cfg, task)
    except (ValueError, KeyError) as exc:
        raise ModelNotFoundError(
            f"`{id}`: transformers cannot build model_type `{model_type}` ({str(exc).splitlines()[0][:160]}). "
            "Upgrade transformers, or plan with a catalog model of the same shape."
        ) from None
    shapes = shapes_from_model(model, 0)
    full = cfg.to_dict()
    note = ("vision-language model: the text decoder is sized from its config, the vision tower and projector by their figures "
            "(plan/vision.py: weights, and activations when they train)") if text is not None else None
    return _spec(id, model_type, task, full, source, shapes, note)


def _close_names(name: str, n: int = 5) -> list[str]:
    ids = catalog_ids()
    low = {i.lower(): i for i in ids}
    tail = {i.split("/")[-1].lower(): i for i in ids}
    q = name.lower()
    hits = difflib.get_close_matches(q, list(low), n=n, cutoff=0.5)
    hits += [tail[t] .lower() for t in difflib.get_close_matches(q.split("/")[-1], list(tail), n=n, cutoff=0.5)]
    out: list[str] = []
    for h in hits:
        full = low.get(h, h)
        full = low.get(full.lower(), full)
        if full not in out:
            out.append(full)
    return out[:n]


_HUB_SPECS: dict[str, ModelSpec] = {}


def find_model(name_or_path: str, *, allow_hub: bool | None = None) -> ModelSpec:
    """A catalog id or alias (case-insensitive), a local folder (or file) with config.json, or a hub id when online."""
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.name.endswith(".json"):
        p = p.parent if p.name == "config.json" else p
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):
        f = p / "config.json" if p.is_dir() else p
        if not f.is_file():
            raise ModelNotFoundError(f"`{name_or_path}` is a folder without config.json; point at the folder written by `save_pretrained` (it holds config.json).")
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelNotFoundError(f"`{f}` is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file or re-save it with `save_pretrained`.") from None
        spec = spec_from_config_dict(str(p), d, "local")
        spec.vision = vision.figures(p if p.is_dir() else p.parent) if spec.note and "vision-language" in spec.note else None
        return spec
    e = catalog().get(name_or_path.lower())
    if e is not None:
        sh = _shapes().get(e["id"])
        if sh is None:  # not precomputed (catalog edited without regenerating): build on meta now
            model = build_meta_model(e["model_type"], e["config"], e["task"])
            sh = shapes_from_model(model, 0)
        return _spec(e["id"], e["model_type"], e["task"], e["config"], "catalog", sh, e.get("note"), e.get("vision"))
    if name_or_path in _HUB_SPECS:  # read from the hub earlier in this process (the resolver asks again, offline)
        return _HUB_SPECS[name_or_path]
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes")
    if allow_hub is None:
        allow_hub = not offline
    if allow_hub and name_or_path.count("/") == 1:
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name_or_path, "config.json")  # config.json alone: no weights, no remote code
        except Exception as exc:  # network, auth, missing repo: all end in the same advice
            why = f"the hub did not give its config.json ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        else:
            spec = spec_from_config_dict(name_or_path, json.loads(Path(path).read_text(encoding="utf-8")), "hub")
            _HUB_SPECS[name_or_path] = spec
            return spec
    elif offline and name_or_path.count("/") == 1:
        why = ("the hub is offline (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set), so its config.json cannot be read. Go online for this "
               "command (unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE: `trainpipe plan` then downloads only config.json, no weights), "
               "or put the model's config.json in a folder and pass that folder")
    else:
        why = "it is not a hub id (ORG/NAME)"
    close = _close_names(name_or_path)
    near = f" Close catalog names: {', '.join(close)}." if close else f" The catalog has {len(catalog_ids())} models (e.g. Qwen/Qwen2.5-7B, meta-llama/Llama-3.1-8B)."
    raise ModelNotFoundError(
        f"`{name_or_path}` is not in trainpipe's catalog, not a local folder, and {why}.{near} "
        "A local folder (or path) with the model's config.json works too: `trainpipe plan --model ./my-model` "
        "(only config.json is read; no weights are needed)."
    )
