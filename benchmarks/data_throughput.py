"""Whole data step throughput: read, PII, exact + near dedup, template, tokenize, split, write.

Prints the seconds for 100k and 200k synthetic alpaca records (benchmarks/_synth.py) and
the cached re-run of the 100k set, with the ratios the issue sets:
    100k <= 60 s on 2 cores;  200k <= 2.3 x the 100k time;  cached re-run <= 2 s.
Baseline in the same run: the 100k build (for the 200k and cached ratios).

    python benchmarks/data_throughput.py [--n 100000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def main() -> None:
    from _synth import tokenizer, write_alpaca

    from trainpipe.config import DataConfig
    from trainpipe.data.prepare import prepare
    from trainpipe.data.tokenize import setup_chat_template

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    tok = tokenizer(tmp)
    name = setup_chat_template(tok, "chatml", "bench")
    times = {}
    for n in (args.n, 2 * args.n):
        src = write_alpaca(tmp / f"a{n}.jsonl", n, seed=n)
        cfg = DataConfig(sources=[{"path": str(src)}], eval_split=0.01, max_length=1024, cache_dir=str(tmp / "cache"))
        t = time.perf_counter()
        data = prepare(cfg, tok, train_on="assistant", seed=0, template_name=name)
        times[n] = time.perf_counter() - t
        r = data.report
        print(f"{n:>7} records: {times[n]:6.1f} s  ({n / times[n]:,.0f} records/s)  kept {r['records_kept']}, dropped {r['dropped']}, "
              f"train tokens {r['splits']['train']['tokens']:,}, p50/p95/max {r['length']['p50']}/{r['length']['p95']}/{r['length']['max']}")
        if n == args.n:
            t = time.perf_counter()
            again = prepare(cfg, tok, train_on="assistant", seed=0, template_name=name)
            times["cached"] = time.perf_counter() - t
            assert again.report["cache"]["hit"]
    print(f"cached re-run of {args.n}: {times['cached']:.2f} s  (ratio to the build {times['cached'] / times[args.n]:.3f})")
    ratio = times[2 * args.n] / times[args.n]
    print(f"ratio 200k/100k time: {ratio:.2f}  (target <= 2.3)")
    print(f"targets: 100k <= 60 s: {'PASS' if times[args.n] <= 60 else 'FAIL'};  200k <= 2.3x: {'PASS' if ratio <= 2.3 else 'FAIL'};  "
          f"cached <= 2 s: {'PASS' if times['cached'] <= 2 else 'FAIL'}  (cores: {os.cpu_count()}, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
