"""Generated-text metrics beyond exact match: accuracy for classification-style answers, ROUGE-L and BLEU
for free text. Each takes predictions and references (same order) and returns one figure.

- `accuracy`: the share of predictions whose normalised answer (lower case, punctuation and surrounding
  space removed) equals the reference's: "Positive." counts for "positive".
- `rouge_l`: the mean ROUGE-L F1 (rouge-score's `RougeScorer`, with stemming), in [0, 1].
- `bleu`: corpus BLEU (sacrebleu), 0-100.
"""

from __future__ import annotations

import math
import re
import string

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize_label(text: str) -> str:
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def accuracy(predictions: list[str], references: list[str]) -> float:
    hits = sum(normalize_label(p) == normalize_label(r) for p, r in zip(predictions, references))
    return hits / max(len(references), 1)


def rouge_l(predictions: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)]
    return sum(scores) / max(len(scores), 1)


def bleu(predictions: list[str], references: list[str]) -> float:
    import sacrebleu

    if not references:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


GENERATED = {"accuracy": accuracy, "rouge_l": rouge_l, "bleu": bleu}  # names: trainpipe.metrics.GENERATED_METRICS
"""Metrics computed from greedy generations (with `exact_match`, which lives in evaluator.py)."""

HIGHER_IS_BETTER = {"loss": False, "perplexity": False, "exact_match": True, "accuracy": True, "rouge_l": True, "bleu": True}


# ------------------------------------------------------------------ trivial predictors (the `beats_trivial` gate)
UNIGRAM_TOKEN_CAP = 5_000_000  # training label tokens counted for the unigram predictor (enough for a stable frequency table)


def _label_tokens(rows, cap: int | None = None) -> list[int]:
    """The tokens that carry loss in ``rows`` (each row's `labels` after the one-token shift; every token of `input_ids`
    when a row has no labels), up to ``cap``."""
    out: list[int] = []
    for r in rows:
        labels = r.get("labels") if isinstance(r, dict) else None
        seq = list(labels)[1:] if labels is not None else list(r.get("input_ids") or [])[1:]
        out.extend(int(t) for t in seq if int(t) >= 0)
        if cap is not None and len(out) >= cap:
            return out[:cap]
    return out


def trivial_lm(train_rows, eval_rows, vocab_size: int) -> dict:
    """The eval loss (nats per loss-carrying token, as `eval_loss` measures it) of the two trivial language models: the
    uniform one over the vocabulary (ln V) and the unigram one (the training tokens' frequencies, add-one smoothed over
    the vocabulary). A model that does not beat both has learned nothing a frequency table does not know; a collapsed
    model (uniform output) scores exactly ln V."""
    train = _label_tokens(train_rows, UNIGRAM_TOKEN_CAP)
    held = _label_tokens(eval_rows)
    v = max(int(vocab_size), max(train + held, default=0) + 1)
    counts: dict[int, int] = {}
    for t in train:
        counts[t] = counts.get(t, 0) + 1
    total = len(train) + v
    unigram = sum(-math.log((counts.get(t, 0) + 1) / total) for t in held) / max(len(held), 1)
    return {"kind": "lm", "vocab_size": v, "uniform_loss": math.log(v), "unigram_loss": unigram,
            "train_tokens_counted": len(train), "eval_tokens": len(held)}


def trivial_classes(train_labels: list[str], eval_labels: list[str]) -> dict:
    """The majority-class predictor: always the training split's most frequent class; its accuracy on the eval split."""
    counts: dict[str, int] = {}
    for c in train_labels:
        counts[str(c)] = counts.get(str(c), 0) + 1
    major = max(sorted(counts), key=lambda c: counts[c]) if counts else None
    acc = sum(1 for c in eval_labels if str(c) == major) / max(len(eval_labels), 1)
    return {"kind": "classes", "majority_class": major, "majority_accuracy": acc, "classes": len(counts), "eval_examples": len(eval_labels)}


# ------------------------------------------------------------------ how to read a baseline -> final figure
CHANCE = {"reward_accuracy": 0.5}  # preference runs: the implicit reward's sign is a coin flip for a model that knows nothing


def reading(key: str, baseline: dict, final: dict) -> dict:
    """What a reader must know beside `key`'s baseline -> final change: {"comparable": bool, "note": str} (empty note
    when there is nothing to say). `reward_accuracy` counts a tie as not right; at the baseline every pair ties (the
    policy is the reference), so its 0 % is "no preference yet", not "always wrong", and a change from it is not
    progress unless the final figure is above chance (50 %)."""
    if key not in CHANCE or "reward_ties" not in final:
        return {"comparable": True, "note": ""}
    chance, f = CHANCE[key], float(final[key])
    bt, ft = baseline.get("reward_ties"), float(final["reward_ties"])
    ft_note = f"ties {100 * ft:.1f} % (neither right nor wrong)"
    wrong = max(0.0, 1.0 - f - ft)
    parts = [f"final: {100 * f:.1f} % right, {100 * wrong:.1f} % wrong, {ft_note}; chance {100 * chance:.0f} %"]
    parts.append("below chance" if f + ft / 2 < chance else "above chance" if f + ft / 2 > chance else "at chance")
    comparable = not (isinstance(bt, (int, float)) and bt >= 0.5)
    if not comparable:
        parts.append(f"not comparable to the baseline: {100 * bt:.0f} % of the baseline's pairs tie (the untrained policy is the reference)")
    return {"comparable": comparable, "note": f"{key}: " + "; ".join(parts)}
