"""What every section of the GPU check shares: the profile (the real one on a GPU, a tiny one for `--cpu-smoke`), the
synthetic data, the tokenizer trained here, the Llama model written from a config (random init, no hub), the GPU's
name and peak bf16 FLOP/s, and the run config every trainpipe run of the check starts from."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/_synth.py: the synthetic text writer

# Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B config.json), written here: nothing is downloaded.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
# vocab_size above the tokenizer's (1024 rows for 400 tokens), as the 1B's 128256 rows are for the 8000-token tokenizer
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1024, "max_position_embeddings": 512, "tie_word_embeddings": True}


@dataclass
class Profile:
    """How big each section is. `gpu()` fits the whole check in under 8 minutes on one H100/H200-class GPU; `smoke()` is
    the same code path on a tiny model in seconds on the CPU."""

    name: str
    model: dict
    records: int
    tokenizer_texts: int
    vocab: int
    max_length: int
    batch: int
    steps: int
    warmup: int  # steps left out of tokens/s (allocator warm-up, first kernels, autotuning)
    eval_records: int
    median_words: int  # the response length distribution: lognormal around this many words
    planner_seq: tuple[int, int]
    planner_batch: int
    planner_steps: int
    grpo_steps: int
    grpo_new_tokens: int
    isolate: bool  # each run in its own process (a clean CUDA peak per run; a hung run is killed by its timeout)
    budget_s: float
    extra: dict = field(default_factory=dict)
    long_seq: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536)  # the long-context section's lengths (one sequence per GPU)

    @staticmethod
    def gpu() -> "Profile":
        return Profile("gpu", dict(LLAMA_1B), records=2400, tokenizer_texts=3000, vocab=8000, max_length=2048, batch=8, steps=30, warmup=6,
                       eval_records=16, median_words=220, planner_seq=(1024, 2048), planner_batch=8, planner_steps=4, grpo_steps=4,
                       grpo_new_tokens=64, isolate=True, budget_s=450.0)

    @staticmethod
    def smoke() -> "Profile":
        return Profile("cpu-smoke", dict(TINY), records=48, tokenizer_texts=300, vocab=400, max_length=96, batch=4, steps=3, warmup=1,
                       eval_records=4, median_words=20, planner_seq=(64, 128), planner_batch=2, planner_steps=2, grpo_steps=2,
                       grpo_new_tokens=6, isolate=False, budget_s=120.0, long_seq=(128, 256))


# --------------------------------------------------------------------------- data, tokenizer, model
def write_records(path: Path, p: Profile, seed: int = 0) -> dict:
    """Alpaca-style records with a long-tailed response length (lognormal around `median_words`, a few near the context),
    as chat SFT data has: the spread is what separates padded from padding-free batches. Returns the word statistics."""
    from _synth import Writer

    w, rng = Writer(seed), random.Random(seed + 1)
    cap = max(8, int(p.max_length * 0.55))  # words; ~1.3 tokens a word keeps nearly every record under max_length
    lengths = []
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(p.records):
            n = max(3, min(cap, int(rng.lognormvariate(0, 0.8) * p.median_words)))
            lengths.append(n)
            rec = {"instruction": f"Task {i}: " + w.text(w.length(11, 40)), "input": w.text(w.length(14, 60)) if rng.random() < 0.4 else "",
                   "output": w.text(n)}
            fh.write(json.dumps(rec) + "\n")
    lengths.sort()
    return {"records": p.records, "response_words_median": lengths[len(lengths) // 2], "response_words_p90": lengths[int(len(lengths) * 0.9)],
            "response_words_max": lengths[-1]}


def build_model(folder: Path, p: Profile, device: str) -> dict:
    """Train a byte-level BPE tokenizer on the synthetic text (`tokenizers`) and save it beside a randomly initialised
    Llama of the profile's shape (bf16 on a GPU, fp32 on the CPU), built on ``device`` and saved as safetensors."""
    import torch
    from _synth import Writer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    w = Writer(99)
    special = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([w.text(60) for _ in range(p.tokenizer_texts)],
                            trainers.BpeTrainer(vocab_size=p.vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=special[2:])
    dims = dict(p.model)
    dims["vocab_size"] = dims["vocab_size"] or len(fast)
    cfg = LlamaConfig(**dims, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    n = sum(t.numel() for t in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"shape": {k: dims[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")},
            "parameters": n, "dtype": str(dtype).replace("torch.", ""), "tokenizer_vocab": len(fast), "init": "random (LlamaConfig written in benchmarks/gpu/_setup.py)"}


# --------------------------------------------------------------------------- the GPU, the attention kernel, MFU
def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "liger-kernel", "flash-attn", "vllm", "nvidia-ml-py", "trainpipe"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def gpu_info() -> dict:
    """The device, its catalog entry and its dense bf16 peak (trainpipe's GPU catalog, plan/data/gpus.json)."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "name": None, "peak_bf16_tflops": None, "peak_reason": "no CUDA device: MFU needs a GPU"}
    from trainpipe.plan.gpus import find_gpu, gpu_from_device_name

    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    out = {"cuda": True, "name": name, "count": torch.cuda.device_count(), "memory_gib": round(props.total_memory / 1024**3, 1),
           "capability": f"{props.major}.{props.minor}", "cuda_version": torch.version.cuda}
    cat = gpu_from_device_name(name)
    if cat is None:
        return out | {"catalog": None, "peak_bf16_tflops": None, "peak_reason": f"`{name}` is not in trainpipe's GPU catalog: no peak to divide by"}
    g = find_gpu(cat)
    if not g.bf16_tflops:
        return out | {"catalog": cat, "peak_bf16_tflops": None, "peak_reason": f"{cat} has no bf16 tensor cores in the catalog"}
    return out | {"catalog": cat, "peak_bf16_tflops": g.bf16_tflops, "peak_source": g.source or "plan/data/gpus.json (dense, no sparsity)"}


def mfu(params: int, tokens_per_s: float | None, gpu: dict) -> dict:
    """Model FLOPs utilisation: 6 x parameters x tokens/s over the GPU's dense bf16 peak (attention FLOPs left out, as
    the usual 6N estimate does). Null with the reason when there is no peak."""
    if not tokens_per_s:
        return {"mfu": None, "mfu_why": "no tokens/s measured"}
    peak = gpu.get("peak_bf16_tflops")
    if not peak:
        return {"mfu": None, "mfu_why": gpu.get("peak_reason", "no peak FLOP/s known")}
    return {"mfu": round(6 * params * tokens_per_s / (peak * 1e12), 4), "formula": "6 * parameters * tokens_per_s / peak_bf16", "peak_bf16_tflops": peak}


def attention_choice(cuda: bool) -> dict:
    """flash_attention_2 when flash_attn is installed on a GPU, else sdpa; recorded with the rule."""
    if cuda and installed("flash_attn"):
        return {"implementation": "flash_attention_2", "why": "a CUDA GPU with flash_attn installed"}
    why = "no CUDA device" if not cuda else "flash_attn is not installed"
    return {"implementation": "sdpa", "why": why}


# --------------------------------------------------------------------------- the run config
def run_config(p: Profile, model_dir: Path, data: Path, cache: Path, out: Path, attn: str, **dotted) -> dict:
    """The config every trainpipe run of the check starts from: full fine-tune, bf16 on a GPU, one micro-batch per
    step, a log line per step (tokens/s between steps), one eval at the end, data cleaning that costs time off."""
    cfg = {
        "model": {"name_or_path": str(model_dir), "attn_implementation": attn},
        "data": {"sources": [{"path": str(data)}], "eval_split": p.eval_records, "max_length": p.max_length, "packing": "none",
                 "cache_dir": str(cache), "pii": {"enabled": False}, "dedup": {"near": False}, "chat_template": "chatml"},
        "method": {"name": "sft", "peft": "none"},
        "training": {"max_steps": p.steps, "eval_steps": 10_000, "logging_steps": 1, "per_device_train_batch_size": p.batch,
                     "gradient_accumulation_steps": 1, "learning_rate": 1e-5, "warmup_steps": 0, "early_stopping_patience": None,
                     "gradient_checkpointing": False, "seed": 0,
                     "per_device_eval_batch_size": 1,  # the evals' peak (full-vocabulary logits) stays below training's
                     "max_recoveries": 0},  # no step-0 rollback checkpoint: ~15 GB less to write per 1B full fine-tune (not timed either way)
        "eval": {"metrics": ["loss"], "test_split": False},
        "distributed": {"strategy": "single", "nproc_per_node": 1},  # one GPU even where the machine has several
        "gates": {"on_fail": "warn"},
        "tracking": {"backend": "none"},
        "output_dir": str(out),
    }
    for key, value in dotted.items():
        node, *path = key.split("__")
        d = cfg[node]
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value
    return cfg
