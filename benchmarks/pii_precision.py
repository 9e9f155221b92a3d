"""PII scrubbing precision and recall on a labelled sample made like public data.

Reads tests/assets/pii_labelled.jsonl (GSM8K-style math with long numbers, The Stack-style code with
identifiers such as ACCESS_TOKEN, chat turns, forms with real-looking PII; each text with the spans that
ARE PII; see tests/assets/README.md), runs ``trainpipe.data.clean.Scrubber.find`` over every text and
prints, overall and per category:

- precision: the share of replaced spans that overlap a labelled PII span;
- recall: the share of labelled PII spans that a replaced span overlaps;
- the same with exact boundaries (``exact``), and every miss and false replacement (``--show``).

Targets: precision >= 0.95 at recall >= 0.95 (overlap). Exit status 1 when a target is missed.

    python benchmarks/pii_precision.py [--file tests/assets/pii_labelled.jsonl] [--show]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ALL = ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]
DEFAULT = Path(__file__).resolve().parent.parent / "tests" / "assets" / "pii_labelled.jsonl"


def measure(items: list[dict]) -> dict:
    """Counts per category and overall: predicted, gold, tp_pred (predicted overlapping gold), tp_gold, exact; and the errors."""
    from trainpipe.data.clean import Scrubber

    scrub = Scrubber(ALL)
    stats: dict = defaultdict(lambda: {"pred": 0, "gold": 0, "tp_pred": 0, "tp_gold": 0, "exact": 0})
    errors = []
    for it in items:
        text = it["text"]
        pred = [(s, e, k) for s, e, k in scrub.find(text)]
        gold = [(g["start"], g["end"], g["type"]) for g in it["pii"]]
        over = lambda a, b: a[0] < b[1] and b[0] < a[1]  # noqa: E731
        for key in (it["category"], "all"):
            st = stats[key]
            st["pred"] += len(pred)
            st["gold"] += len(gold)
            st["tp_pred"] += sum(any(over(p, g) for g in gold) for p in pred)
            st["tp_gold"] += sum(any(over(p, g) for p in pred) for g in gold)
            st["exact"] += sum(1 for p in pred if (p[0], p[1]) in {(g[0], g[1]) for g in gold})
        for p in pred:
            if not any(over(p, g) for g in gold):
                errors.append(("false replacement", it["id"], p[2], text[max(0, p[0] - 30) : p[1] + 30]))
        for g in gold:
            if not any(over(p, g) for p in pred):
                errors.append(("missed", it["id"], g[2], text[max(0, g[0] - 30) : g[1] + 30]))
    out = {}
    for key, st in stats.items():
        out[key] = {**st, "precision": st["tp_pred"] / st["pred"] if st["pred"] else 1.0,
                    "recall": st["tp_gold"] / st["gold"] if st["gold"] else 1.0,
                    "exact_precision": st["exact"] / st["pred"] if st["pred"] else 1.0}
    return {"by": out, "errors": errors}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--show", action="store_true", help="print every miss and false replacement")
    args = ap.parse_args()
    items = load(args.file)
    res = measure(items)
    print(f"{len(items)} labelled texts from {args.file}")
    print(f"{'category':<8} {'texts':>5} {'pii':>5} {'replaced':>8} {'precision':>9} {'recall':>7} {'exact':>6}")
    counts = defaultdict(int)
    for it in items:
        counts[it["category"]] += 1
    counts["all"] = len(items)
    for key in sorted(res["by"], key=lambda k: (k == "all", k)):
        st = res["by"][key]
        print(f"{key:<8} {counts[key]:>5} {st['gold']:>5} {st['pred']:>8} {st['precision']:>9.3f} {st['recall']:>7.3f} {st['exact_precision']:>6.3f}")
    if args.show:
        for kind, i, t, ctx in res["errors"]:
            print(f"  {kind} #{i} ({t}): {ctx!r}")
    a = res["by"]["all"]
    ok = a["precision"] >= 0.95 and a["recall"] >= 0.95
    print(f"target precision >= 0.95 at recall >= 0.95: {'PASS' if ok else 'FAIL'} "
          f"(precision {a['precision']:.3f}, recall {a['recall']:.3f}; {len(res['errors'])} errors, --show lists them)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
