"""Loading the base model and tokenizer, and wrapping it with PEFT.

Local folders and hub ids both work; a missing folder, an unknown or unreachable hub id
and a tokenizer without a pad token are one-paragraph errors with the fix.

`build_model` reads in order: `check_peft` (every PEFT error the config alone can tell, on
the architecture built on the meta device, before any weights load) -> `load_base` (4-bit
or 8-bit through bitsandbytes for qlora/qlora8) -> `apply_peft` (`method.peft`).

`apply_peft` (its steps `freeze_layers`, `prepare_kbit`, `lora_config`/`apply_lora`) and
`enable_gradient_checkpointing` (called by the loop) are the one place that says how trainpipe
applies a method: the memory tracer (plan/trace.py) calls them on its meta-built model too, with
emulated 4-bit layers where bitsandbytes would have quantized (tests/unit/plan/test_trace_method.py).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from trainpipe import ui
from trainpipe.config import LoraConfig, ModelConfig
from trainpipe.errors import ConfigError, ModelLoadError
from trainpipe.model import vision
from trainpipe.model.attention import for_this_machine

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def check_model_source(cfg: ModelConfig) -> None:
    if cfg.init_from_config:
        src = Path(cfg.init_from_config).expanduser()
        if not (src / "config.json" if src.is_dir() else src).is_file():
            raise ModelLoadError(
                f"`model.init_from_config` is `{cfg.init_from_config}`, which is neither a config.json nor a folder with one. "
                "Point it at the config of the architecture to build with random weights (`model.name_or_path` then only supplies the tokenizer)."
            )
    name = cfg.name_or_path
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"`model.name_or_path` is `{name}`, a file; it must be a folder with config.json, the weights and the tokenizer.")
        if cfg.init_from_config and (p / "tokenizer_config.json").is_file():  # from scratch: the folder only supplies the tokenizer
            pass
        elif not (p / "config.json").is_file():
            found = ", ".join(sorted(x.name for x in p.iterdir())[:10]) or "nothing"
            raise ModelLoadError(
                f"Model folder `{name}` has no config.json (it holds: {found}). Point `model.name_or_path` at the folder "
                "written by `save_pretrained` (config.json, *.safetensors, tokenizer files)."
            )
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(
            f"Model folder `{name}` does not exist. Check `model.name_or_path` (relative paths are resolved against the "
            "config file's folder), or give a hub id such as `Qwen/Qwen2.5-0.5B`."
        )


def _hub_error(name: str, exc: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
    return ModelLoadError(
        f"Cannot load `{name}`: it is not a local folder, and as a hub id it could not be fetched "
        f"({'HF_HUB_OFFLINE is set' if offline else type(exc).__name__ + ': ' + str(exc).splitlines()[0][:160]}). "
        f"Check the id's spelling; on a machine without hub access download it elsewhere with "
        f"`hf download {name} --local-dir ./models/{name.split('/')[-1]}`, copy the folder here and set "
        "`model.name_or_path` to it."
    )


def load_tokenizer(cfg: ModelConfig, pad_token: str | None = None):
    from transformers import AutoTokenizer

    check_model_source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except (OSError, ValueError) as exc:
        if Path(cfg.name_or_path).exists():
            raise ModelLoadError(f"The tokenizer in `{cfg.name_or_path}` cannot be loaded: {str(exc).splitlines()[0][:200]}. Save it there with `tokenizer.save_pretrained`.") from None
        raise _hub_error(cfg.name_or_path, exc) from None
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"The tokenizer of `{cfg.name_or_path}` is a slow (Python) tokenizer; trainpipe needs a fast one (tokenizer.json) for exact label masks.")
    if tok.pad_token is None:
        if pad_token is None:
            eos = tok.eos_token
            raise ModelLoadError(
                f"The tokenizer of `{cfg.name_or_path}` has no pad token, so batches cannot be padded. Set "
                f"`model.pad_token: {eos!r}` in the config (padding is masked out of the loss, so the EOS token is a safe choice)"
                + ("" if eos else " or add a pad token to the tokenizer")
                + "."
            )
        if pad_token not in tok.get_vocab():
            raise ModelLoadError(f"`model.pad_token` is {pad_token!r}, which is not in the vocabulary of `{cfg.name_or_path}`; use an existing token such as {tok.eos_token!r}.")
        tok.pad_token = pad_token
    return vision.attach_processor(tok, cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)  # a vision-language model's


def load_model(cfg: ModelConfig, dtype: str, *, quantization=None, on_accelerator: bool = True):
    """The pretrained weights of `model.name_or_path` in ``dtype``, on this process's GPU when there is one (the CPU
    otherwise, or with ``on_accelerator=False``). ``quantization``: a BitsAndBytesConfig (QLoRA) or None."""
    import torch

    check_model_source(cfg)
    device_map = {"": int(os.environ.get("LOCAL_RANK", 0))} if on_accelerator and torch.cuda.is_available() else None
    try:
        model = vision.auto_class(vision.is_vision_folder(cfg.name_or_path)).from_pretrained(
            cfg.name_or_path,
            dtype=getattr(torch, DTYPES[dtype]),
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            use_safetensors=True,
            quantization_config=quantization,
            device_map=device_map,
            attn_implementation=for_this_machine(cfg.attn_implementation, cfg.name_or_path),
        )
    except ValueError as exc:  # transformers refuses a kernel this architecture does not implement (the config did not say)
        if "does not support an attention implementation" not in str(exc):
            raise
        raise ConfigError(f"`model.attn_implementation: {cfg.attn_implementation}`: {str(exc).split('. Please')[0]}. Use `eager` "
                          "(every architecture implements it), or `auto`, which checks what the model's config declares.") from None
    except OSError as exc:
        if Path(cfg.name_or_path).exists():
            raise ModelLoadError(
                f"The weights in `{cfg.name_or_path}` cannot be loaded: {str(exc).splitlines()[0][:200]}. trainpipe reads "
                "safetensors only; convert .bin weights with `model.save_pretrained(path, safe_serialization=True)`."
            ) from None
        raise _hub_error(cfg.name_or_path, exc) from None
    except Exception as exc:  # safetensors' own refusal: a header or offsets past any real file (a hostile or broken file)
        if type(exc).__name__ != "SafetensorError":
            raise
        raise ModelLoadError(f"The weights in `{cfg.name_or_path}` cannot be read safely ({' '.join(str(exc).split())[:200]}): the safetensors "
                             "header claims sizes or offsets no real file has, so the file is damaged or was crafted. Nothing was loaded. "
                             "Re-save the model from a copy you trust (`save_pretrained(path, safe_serialization=True)`).") from None
    return model


# ------------------------------------------------------------------------------ PEFT: checks before any weights load

LORA_FAMILY = ("lora", "rslora", "dora", "qlora", "qlora8")
QUANTIZED = ("qlora", "qlora8")
PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning")


def check_peft(model_cfg: ModelConfig, method) -> None:
    """Every `method.peft` error the config alone can tell, raised before any weights load: QLoRA without
    bitsandbytes, target modules this architecture does not have, more frozen-block layers than it has, prefix
    tuning on an architecture without a key/value cache. The architecture is built on the meta device (module
    names and shapes, no memory, no weights)."""
    peft = method.peft
    if peft in QUANTIZED:
        _require_bitsandbytes(peft)
        if model_cfg.init_from_config:
            raise ModelLoadError(
                f"`method.peft: {peft}` quantizes pretrained weights, but `model.init_from_config` builds the model from "
                "scratch with random weights: there is nothing worth quantizing. Use `method.peft: none` (or `lora`) to train from scratch."
            )
    if peft == "none":
        return
    skeleton = model_skeleton(model_cfg)
    if peft in LORA_FAMILY:
        resolve_lora_targets(skeleton, method.lora.target_modules)
    elif peft == "ia3":
        resolve_ia3_targets(skeleton, method.ia3)
    elif peft == "freeze":
        freeze_plan(skeleton, method.freeze.trainable_layers)
    elif peft == "prefix_tuning":
        check_prefix_tuning(skeleton)


def _require_bitsandbytes(peft: str) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelLoadError(
            f"`method.peft: {peft}` loads the base in {'4' if peft == 'qlora' else '8'}-bit with bitsandbytes, which is not "
            "installed. Install it with `pip install 'trainpipe[qlora]'`, or use `method.peft: lora` (same adapters, "
            "unquantized base)."
        ) from None


def model_skeleton(model_cfg: ModelConfig):
    """The architecture of the model to train, built on the meta device from its config.json (no weights read)."""
    import torch
    from transformers import AutoConfig

    src = model_cfg.init_from_config or model_cfg.name_or_path
    try:
        mcfg = AutoConfig.from_pretrained(src, trust_remote_code=model_cfg.trust_remote_code, revision=None if model_cfg.init_from_config else model_cfg.revision)
    except (OSError, ValueError) as exc:
        if Path(src).exists():
            raise ModelLoadError(f"The config of `{src}` cannot be read: {str(exc).splitlines()[0][:200]}.") from None
        raise _hub_error(src, exc) from None
    with torch.device("meta"):
        return vision.auto_class(vision.is_vision_config(mcfg)).from_config(mcfg, trust_remote_code=model_cfg.trust_remote_code)


def _module_names_hint(model) -> str:
    return ", ".join(sorted(_linear_suffixes(model)))


def _matches(module_name: str, target: str) -> bool:
    """PEFT's rule for a list entry: the full module name, or its trailing dotted part."""
    return module_name == target or module_name.endswith("." + target)


def _check_targets(model, targets: list[str], key: str) -> None:
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        raise ModelLoadError(
            f"`{key}` names {missing}, which this model ({type(model).__name__}) does not have. Its linear modules are: "
            f"{_module_names_hint(model)}. Name some of those (a leaf such as `q_proj` or a dotted tail such as "
            f"`self_attn.q_proj`), or use {'`attention` or `all-linear`' if key.startswith('method.lora') else '`auto`'}."
        )


def resolve_lora_targets(model, target: list[str] | str) -> list[str] | str:
    """`attention` -> the attention projections of this architecture (as `parent.leaf` suffixes)."""
    if isinstance(target, list):
        _check_targets(model, target, "method.lora.target_modules")
        return target
    if target == "all-linear":
        return "all-linear"
    found = sorted(s for s in _linear_suffixes(model) if any(k in s.split(".")[0].lower() for k in ("attn", "attention")))
    if not found:
        raise ModelLoadError(
            f"Found no attention projections to put LoRA on in {type(model).__name__} (its linear modules: {_module_names_hint(model)}); "
            "set `method.lora.target_modules` to a list of those names, or `all-linear`."
        )
    return found


def _linear_suffixes(model) -> set[str]:
    import torch

    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D":
            parts = name.split(".")
            if parts[-1] in ("lm_head", "score"):
                continue
            out.add(".".join(parts[-2:]) if len(parts) >= 2 else parts[-1])
    return out


# IA3 (Liu et al. 2022) rescales the keys, the values and the input of the MLP's down projection.
_KEY_VALUE = ("k_proj", "v_proj", "key", "value", "k", "v")
_FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv")
_DOWN = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2", "fc_out")


def resolve_ia3_targets(model, ia3) -> tuple[list[str], list[str]]:
    """(target_modules, feedforward_modules) for IA3: `auto` -> this architecture's key and value projections (or
    its fused QKV projection) and the MLP down projection, which is the feed-forward one."""
    if ia3.target_modules != "auto":
        _check_targets(model, ia3.target_modules, "method.ia3.target_modules")
        ff = ia3.feedforward_modules if ia3.feedforward_modules != "auto" else [t for t in ia3.target_modules if t.split(".")[-1] in _DOWN]
        stray = [f for f in ff if f not in ia3.target_modules]
        if stray:
            raise ModelLoadError(f"`method.ia3.feedforward_modules` names {stray}, which are not in `method.ia3.target_modules` {ia3.target_modules}; every feed-forward module must also be a target.")
        return list(ia3.target_modules), list(ff)
    suffixes = _linear_suffixes(model)
    attn = lambda s: any(k in s.split(".")[0].lower() for k in ("attn", "attention"))  # noqa: E731
    mlp = lambda s: any(k in s.split(".")[0].lower() for k in ("mlp", "feed_forward", "ffn", "ff"))  # noqa: E731
    kv = sorted(s for s in suffixes if attn(s) and s.split(".")[-1] in _KEY_VALUE) or sorted(s for s in suffixes if attn(s) and s.split(".")[-1] in _FUSED_QKV)
    down = sorted(s for s in suffixes if mlp(s) and s.split(".")[-1] in _DOWN)
    if not kv or not down:
        raise ModelLoadError(
            f"`method.ia3.target_modules: auto` found no {'key/value projections' if not kv else 'MLP down projection'} in "
            f"{type(model).__name__} (its linear modules: {_module_names_hint(model)}). Set `method.ia3.target_modules` and "
            "`method.ia3.feedforward_modules` to lists of those names."
        )
    ff = down if ia3.feedforward_modules == "auto" else ia3.feedforward_modules
    return kv + down, list(ff)


def decoder_blocks(model):
    """(name, ModuleList) of the transformer blocks: the ModuleList with one entry per hidden layer."""
    import torch

    n = model.config.get_text_config().num_hidden_layers
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if not lists:
        raise ModelLoadError(f"Cannot find the {n} transformer blocks of {type(model).__name__}; `method.peft: freeze` needs them. Use `lora` instead.")
    return lists[0]


def freeze_plan(model, trainable_layers: int) -> list[str]:
    """Names of the modules `peft: freeze` trains: the last ``trainable_layers`` blocks and the final norm."""
    name, blocks = decoder_blocks(model)
    if trainable_layers > len(blocks):
        raise ModelLoadError(
            f"`method.freeze.trainable_layers` is {trainable_layers}, but {type(model).__name__} has {len(blocks)} blocks. "
            f"Use at most {len(blocks)}, or `method.peft: none` to train everything."
        )
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    owner = model.get_submodule(parent)
    norms = [f"{parent}.{child}".lstrip(".") for child, mod in owner.named_children() if "norm" in child.lower() or child in ("ln_f",)]
    return [f"{name}.{i}" for i in range(len(blocks) - trainable_layers, len(blocks))] + norms


def freeze_layers(model, fz, *, quiet: bool = False):
    """`peft: freeze`: everything frozen but the last `trainable_layers` blocks, the final norm and the LM head (and
    the input embeddings with `train_embeddings`). A head tied to the input embeddings is one tensor: it trains only
    with `train_embeddings`, so that `train_embeddings: false` always keeps the embeddings as they were."""

    model.requires_grad_(False)
    for name in freeze_plan(model, fz.trainable_layers):
        model.get_submodule(name).requires_grad_(True)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    if fz.train_embeddings:
        emb.requires_grad_(True)
    if head is not None and (not tied or fz.train_embeddings):
        head.requires_grad_(True)
    if tied and not fz.train_embeddings and not quiet:
        ui.console().print("  [dim]freeze: the LM head is tied to the input embeddings, so it stays frozen with them (`method.freeze.train_embeddings: true` trains both)[/]")
    return model


def check_prefix_tuning(model) -> None:
    """Prefix tuning hands every attention layer learned keys and values through the key/value cache: the
    architecture needs such a cache in every layer (no state-space, convolution or linear-attention layers, as
    `layer_types` lists them) and the config fields PEFT sizes the prefix by."""
    cfg = model.config.get_text_config()
    kinds = set(getattr(cfg, "layer_types", None) or [])
    no_cache = sorted(kinds - {"full_attention", "sliding_attention", "chunked_attention", "attention"})
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if getattr(cfg, k, None) is None]
    if no_cache or missing:
        why = f"its layers include {no_cache}, which keep no key/value cache" if no_cache else f"its config has no {missing}"
        raise ModelLoadError(
            f"`method.peft: prefix_tuning` does not work with `{cfg.model_type}` ({type(model).__name__}): prefix tuning "
            f"feeds learned keys and values to every attention layer through the key/value cache, and {why}. "
            "Use `method.peft: prompt_tuning` (soft prompt on the input embeddings) or `lora`."
        )


# ------------------------------------------------------------------------------ the model to train


def build_model(model_cfg: ModelConfig, method, *, tokenizer=None, seed: int = 0):
    """The model to train: the base (loaded, quantized for QLoRA, or built from `model.init_from_config`) wrapped by `method.peft`."""
    check_peft(model_cfg, method)  # every error the config alone can tell, before any weights load
    model = load_base(model_cfg, seed=seed, quantization=quantization_config(method))
    return apply_peft(model, method, tokenizer=tokenizer)


def load_base(model_cfg: ModelConfig, *, seed: int = 0, quantization=None):
    """The base model: its weights loaded, or (`model.init_from_config`) the architecture built with random weights."""
    if model_cfg.init_from_config:
        return init_model(model_cfg, seed)
    return load_model(model_cfg, model_cfg.dtype, quantization=quantization)


def quantization_config(method):
    """The bitsandbytes config of `peft: qlora` (4-bit: `method.quantization`'s type, double quantization and compute
    dtype) and `qlora8` (8-bit, LLM.int8()); None for every other method."""
    if method.peft not in QUANTIZED:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if method.peft == "qlora8":
        warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")  # said once per matmul on CPU: noise
        return BitsAndBytesConfig(load_in_8bit=True)
    q = method.quantization
    compute = q.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, compute),
    )


def init_model(cfg: ModelConfig, seed: int):
    """A model built from scratch from a config.json (or a folder with one), randomly initialised with ``seed``
    (the global RNG is left untouched, so the rest of the run draws the same numbers either way)."""
    import torch
    from transformers import AutoConfig

    check_model_source(cfg)
    src = Path(cfg.init_from_config).expanduser()
    mcfg = AutoConfig.from_pretrained(str(src), trust_remote_code=cfg.trust_remote_code)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = vision.auto_class(vision.is_vision_config(mcfg)).from_config(mcfg, dtype=getattr(torch, DTYPES[cfg.dtype if cfg.dtype in DTYPES else "float32"]), trust_remote_code=cfg.trust_remote_code,
                                                 attn_implementation=for_this_machine(cfg.attn_implementation, str(src)))
    if torch.cuda.is_available():  # where load_model puts pretrained weights: this process's GPU
        model = model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return model


def apply_peft(model, method, *, tokenizer=None, task_type: str | None = "CAUSAL_LM", quiet: bool = False):
    """Wrap ``model`` for `method.peft` (a MethodConfig). `none` trains everything; `freeze` the last blocks; the
    LoRA family adds low-rank adapters (on a quantized base for qlora/qlora8); `ia3` learned rescaling vectors;
    `prompt_tuning` / `prefix_tuning` learned virtual tokens (input embeddings / per-layer keys and values).
    ``task_type`` is PEFT's (trainpipe trains causal LMs; the memory tracer also wraps encoders and seq2seq models);
    ``quiet`` leaves out the console notes (the tracer's JSON output)."""
    peft = method.peft
    if peft == "none":  # a vision-language model's tower and projector (model/vision.py); LoRA's targets: lora_config
        vision.freeze_vision(model, method.freeze_vision)
    if peft == "none":
        return model
    if peft == "freeze":
        return freeze_layers(model, method.freeze, quiet=quiet)
    if peft in QUANTIZED:
        model = prepare_kbit(model, upcast_rest=method.quantization.upcast_rest)
    if peft in LORA_FAMILY:
        return apply_lora(model, method.lora, rslora=peft == "rslora", dora=peft == "dora", task_type=task_type, freeze_vision=method.freeze_vision)
    if peft == "ia3":
        return apply_ia3(model, method.ia3)
    if peft in PROMPT_LEARNING:
        return apply_prompt_learning(model, peft, method.prompt_tuning, tokenizer=tokenizer)
    raise ModelLoadError(f"`method.peft: {peft}` must be resolved before the model is built (e.g. `auto` by the plan).")


def prepare_kbit(model, *, upcast_rest: bool = False):
    """A model loaded in 4/8-bit, made ready for adapters: every Linear4bit on the one training kernel and every base
    parameter frozen. The parameters that are not quantized (embeddings, norms, lm_head, biases) stay in the dtype the
    model was loaded in (`model.dtype`: bfloat16 on a bf16 GPU), as TRL's SFTTrainer prepares a quantized model: since
    bitsandbytes' Linear4bit returns its input's dtype, the residual stream and the saved activations stay 16-bit too.
    ``upcast_rest`` (`method.quantization.upcast_rest`): PEFT's `prepare_model_for_kbit_training` instead, which casts
    them to fp32 (and with them the residual stream and activations). Checkpointing is the loop's
    (`enable_gradient_checkpointing`, non-reentrant: no input-requires-grad hook needed), so not here. The adapters
    PEFT adds later are fp32 either way (`autocast_adapter_dtype`), as for LoRA on a 16-bit base."""
    one_4bit_kernel(model)
    if upcast_rest:
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def enable_gradient_checkpointing(model) -> None:
    """Gradient checkpointing as trainpipe trains with it (the loop turns it on from the config or on OOM):
    non-reentrant (so frozen embeddings need no input-requires-grad hook), without the key/value cache."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "config"):
        model.config.use_cache = False


def one_4bit_kernel(model) -> None:
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place at its first eval-mode forward and
    computes differently from then on; whether an evaluation ran first would change training (and break resume to
    the bit). Keep every Linear4bit on the one kernel training uses."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def apply_lora(model, lora: LoraConfig, *, rslora: bool = False, dora: bool = False, task_type: str | None = "CAUSAL_LM",
               freeze_vision: bool = True):
    """LoRA; `rslora` scales by alpha/sqrt(r) instead of alpha/r (Kalajdzievski 2023); `dora` splits each weight into
    magnitude and direction and adapts the direction (Liu et al. 2024)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, lora, rslora=rslora, dora=dora, task_type=task_type, freeze_vision=freeze_vision))


def lora_config(model, lora: LoraConfig, *, rslora: bool = False, dora: bool = False, task_type: str | None = "CAUSAL_LM",
                freeze_vision: bool = True):
    """PEFT's LoraConfig for `method.lora` on ``model``: its targets resolved on this architecture (on a vision-language
    model, inside the language model only under ``freeze_vision``: model/vision.py), r, alpha, dropout, no bias, rsLoRA or DoRA."""
    from peft import LoraConfig as PeftLoraConfig

    targets = vision.restrict_targets(model, resolve_lora_targets(model, lora.target_modules), freeze_vision, _matches)
    return PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none", task_type=task_type,
        use_rslora=rslora, use_dora=dora,
    )


def apply_ia3(model, ia3):
    from peft import IA3Config, get_peft_model

    targets, feedforward = resolve_ia3_targets(model, ia3)
    return get_peft_model(model, IA3Config(task_type="CAUSAL_LM", target_modules=targets, feedforward_modules=feedforward))


def apply_prompt_learning(model, peft: str, pt, *, tokenizer=None):
    """`prompt_tuning`: `num_virtual_tokens` learned input embeddings before every input (initialised from the
    embeddings of `init_text` when given); `prefix_tuning`: learned keys and values for every layer."""
    from peft import PrefixTuningConfig, PromptTuningConfig, PromptTuningInit, get_peft_model

    if peft == "prefix_tuning":
        check_prefix_tuning(model)
        return get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=pt.num_virtual_tokens))
    if pt.init_text:
        source = getattr(tokenizer, "name_or_path", None) or model.name_or_path
        cfg = PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=pt.num_virtual_tokens, prompt_tuning_init=PromptTuningInit.TEXT,
            prompt_tuning_init_text=pt.init_text, tokenizer_name_or_path=source,
        )
    else:
        cfg = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=pt.num_virtual_tokens, prompt_tuning_init=PromptTuningInit.RANDOM)
    return get_peft_model(model, cfg)


def parameter_counts(model) -> dict:
    """Trainable and total parameters as PEFT's `print_trainable_parameters` counts them (4-bit weights counted
    unpacked, soft prompts included)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        trainable, total = model.get_nb_trainable_parameters()
    else:
        total = sum(p.numel() * (2 if type(p).__name__ == "Params4bit" else 1) for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "trainable_pct": round(100.0 * trainable / max(total, 1), 4)}
