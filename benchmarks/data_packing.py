"""Packing: share of non-pad tokens with packing against padding every example to max_length.

Tokenizes synthetic alpaca records (benchmarks/_synth.py) through `prepare` with
`packing: pack` and prints the non-pad share (target >= 0.95), the baseline in the same run
(padding to `max_length`), dynamic padding in batches of 8, and the ratio.

    python benchmarks/data_packing.py [--n 5000] [--max-length 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from _synth import tokenizer, write_alpaca

    from trainpipe.config import DataConfig
    from trainpipe.data.packing import non_pad_share
    from trainpipe.data.prepare import prepare
    from trainpipe.data.tokenize import setup_chat_template

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--max-length", type=int, default=1024)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tp-pack-"))
    tok = tokenizer(tmp)
    name = setup_chat_template(tok, "chatml", "bench")
    src = write_alpaca(tmp / "a.jsonl", args.n)
    cfg = DataConfig(sources=[{"path": str(src)}], eval_split=0.02, max_length=args.max_length, packing="pack", cache_dir=str(tmp / "c"))
    data = prepare(cfg, tok, train_on="assistant", seed=0, template_name=name)
    b = data.report["batching"]
    rows = len(data.train)
    assert all(len(r) <= args.max_length for r in data.train["input_ids"])
    share = b["non_pad_share"]
    base = b["padded_to_max_length_share"]
    lengths = []
    for r in data.train["position_ids"]:
        starts = [i for i, p in enumerate(r) if p == 0] + [len(r)]
        lengths += [starts[k + 1] - starts[k] for k in range(len(starts) - 1)]
    dyn = non_pad_share(lengths, mode="dynamic", max_length=args.max_length, batch_size=8)
    print(f"{data.report['splits']['train']['records']} examples -> {rows} packed rows of {args.max_length}")
    print(f"non-pad share: packing {share:.4f} (target >= 0.95); baseline padding to max_length {base:.4f}; dynamic padding (batches of 8) {dyn:.4f}")
    print(f"ratio packing/baseline: {share / base:.1f}x;  target {'PASS' if share >= 0.95 else 'FAIL'}")


if __name__ == "__main__":
    main()
