"""Generated-text metrics beyond exact match: accuracy for classification-style answers, ROUGE-L and BLEU
for free text. Each takes predictions and references (same order) and returns one figure.

- `accuracy`: the share of predictions whose normalised answer (lower case, punctuation and surrounding
  space removed) equals the reference's: "Positive." counts for "positive".
- `rouge_l`: the mean ROUGE-L F1 (rouge-score's `RougeScorer`, with stemming), in [0, 1].
- `bleu`: corpus BLEU (sacrebleu), 0-100.
"""

from __future__ import annotations

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
