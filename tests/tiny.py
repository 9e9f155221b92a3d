"""Tiny models, tokenizers and datasets built in code for the tests (no hub, no blobs).

`build_tiny_model(path)` trains a byte-level BPE tokenizer with `tokenizers` on the test
corpus, builds a 2-layer, 64-wide Llama from a config, and saves both with save_pretrained.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "apple river stone cloud green seven blue tiger lamp orange music window paper silver garden rocket".split()


def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """A learnable task: reverse a short list of words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        out.append({"instruction": "Reverse the order of the words.", "input": " ".join(words), "output": " ".join(reversed(words))})
    return out


def classification_records(n: int, seed: int, text: str = "text", label: str = "label") -> list[dict]:
    """A learnable 2-class task: "first-half" when the first of three words is one of WORDS[:8], else "second-half"."""
    rng, group = random.Random(seed), set(WORDS[:8])
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        out.append({text: " ".join(words), label: "first-half" if words[0] in group else "second-half"})
    return out


def chat_records(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You repeat words."},
                    {"role": "user", "content": f"Say {a} then {b}."},
                    {"role": "assistant", "content": f"{a} {b}"},
                ]
            }
        )
    return out


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return p


def corpus() -> list[str]:
    lines = [" ".join(r["messages"][1]["content"].split()) for r in chat_records(200)]
    lines += [f"{r['instruction']} {r['input']} {r['output']}" for r in alpaca_records(200)]
    return lines + ["You repeat words. Say then. Reverse the order of the words."]


def build_tokenizer(special=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"), pad: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    kwargs = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if pad:
        kwargs["pad_token"] = "<|pad|>"
    extra = [s for s in special if s.startswith("<|im_")]
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=extra, **kwargs)


def build_tiny_model(path: str | Path, *, pad: bool = True, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tok = build_tokenizer(pad=pad)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def preference_records(n: int, seed: int = 3) -> list[dict]:
    """A learnable preference: the chosen reply reverses the words, the rejected one repeats them in the given order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        out.append({
            "prompt": "Reverse the order of the words.\n\n" + " ".join(words),
            "chosen": " ".join(reversed(words)),
            "rejected": " ".join(words),
        })
    return out


def kto_records(n: int, seed: int = 4) -> list[dict]:
    """Unpaired KTO rows of the same task: each prompt once, with the reversal (label true) or the copy (label false)."""
    rng = random.Random(seed)
    out = []
    for r in preference_records(n, seed):
        good = rng.random() < 0.5
        out.append({"prompt": r["prompt"], "completion": r["chosen"] if good else r["rejected"], "label": good})
    return out
