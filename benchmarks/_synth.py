"""Synthetic data for the data benchmarks: deterministic, offline, with realistic lengths.

Alpaca-style records whose field lengths follow the Stanford Alpaca release (instruction
~12 words, input empty 60 % of the time else ~15 words, output ~45 words with a long
tail to ~300), over a Zipf-distributed vocabulary of pronounceable pseudo-words plus
common English function words, with sentence punctuation and some numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FUNCTION = "the of and to a in is that for it as with was on be by this are or from at an which have not".split()
SYL = "ka lo mi ne ru sa ti vo ze pa ri do fu ga he ji ko lu ma no pe qu ro si ta ve wa xi yo zu".split()


def vocabulary(n: int = 6000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYL) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))))
    return FUNCTION + sorted(words)


class Writer:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab = vocabulary()
        n = len(self.vocab)
        import itertools

        self.cum = list(itertools.accumulate(1.0 / (r + 1) ** 1.05 for r in range(n)))

    def words(self, k: int) -> list[str]:
        return self.rng.choices(self.vocab, cum_weights=self.cum, k=k)

    def text(self, n_words: int) -> str:
        out, sent = [], []
        for w in self.words(n_words):
            if self.rng.random() < 0.03:
                w = str(self.rng.randint(2, 9999))
            sent.append(w)
            if len(sent) >= self.rng.randint(6, 18):
                out.append(" ".join(sent).capitalize() + self.rng.choice(".,.;.?!."[:6]))
                sent = []
        if sent:
            out.append(" ".join(sent).capitalize() + ".")
        return " ".join(out)

    def length(self, mean: float, cap: int) -> int:
        return max(2, min(cap, int(self.rng.lognormvariate(0, 0.6) * mean)))

    def alpaca(self) -> dict:
        rec = {"instruction": self.text(self.length(11, 60)), "input": "", "output": self.text(self.length(40, 300))}
        if self.rng.random() < 0.4:
            rec["input"] = self.text(self.length(14, 120))
        return rec


def write_alpaca(path: Path, n: int, seed: int = 0) -> Path:
    w = Writer(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            rec = w.alpaca()
            rec["instruction"] = f"Task {i}: " + rec["instruction"]  # distinct records: dedup drops only what is planted
            fh.write(json.dumps(rec) + "\n")
    return path


def tokenizer(tmp: Path, vocab_size: int = 8000, seed: int = 0):
    """A byte-level BPE tokenizer trained on the synthetic text, with the ChatML tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    w = Writer(seed + 99)
    corpus = [w.text(80) for _ in range(8000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", additional_special_tokens=special[2:])
    fast.save_pretrained(tmp / "tok")
    return PreTrainedTokenizerFast.from_pretrained(tmp / "tok")
