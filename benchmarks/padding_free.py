"""Useful tokens per second of trainpipe's default batching against pad-to-max and dynamic padding, on the CPU.

The default batching is what `data.packing: auto` resolves to on this machine for SFT (plan/attention.py: padding-free,
with SDPA keeping the examples apart). The same examples (synthetic Alpaca-length records, benchmarks/_synth.py:
instruction ~12 words, output ~45 words with a long tail to ~300; 200 of them by default), the same tiny Llama, the same
micro-batch (8 examples) and the real training step (train/objectives.TokenCrossEntropy: collate, summed cross-entropy,
backward, AdamW step) are timed in three batchings:

- `pad_to_max`: every micro-batch right-padded to `data.max_length` (the baseline of the fixed-shape trainers);
- `dynamic`: right-padded to the longest example of the micro-batch (`data.packing: none`);
- `default`: the batching `data.packing: auto` picks (`padding_free`: the micro-batch concatenated into one row,
  position ids restarting per example, no padding at all).

Useful tokens are the non-pad tokens of the batches (the same count in every mode); useful tokens/s = that count over the
wall time of the steps. The modes take turns micro-batch by micro-batch in each of `--rounds` rounds (so a slower moment
of a shared machine falls on all three), after one warm-up round. The ratios default/pad_to_max (target >= 2.5) and
default/dynamic (target >= 1.3) are printed and written to benchmarks/results/padding_free.json.

    python benchmarks/padding_free.py [--n 200] [--max-length 512] [--rounds 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results" / "padding_free.json"
TARGETS = {"default_over_pad_to_max": 2.5, "default_over_dynamic": 1.3}


def build(tmp: Path, tok, width: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=width * 4, num_hidden_layers=layers,
                      num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 128), max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp / "model", safe_serialization=True)
    tok.save_pretrained(tmp / "model")
    return tmp / "model"


def default_batching(model_dir: Path, data: Path, max_length: int) -> tuple[str, str, str]:
    """(packing, attn_implementation, the rule) as `trainpipe run` resolves `auto` on this machine."""
    from trainpipe.config import build_config
    from trainpipe.plan import resolve
    from trainpipe.plan.hardware import detect

    cfg = build_config({"model": {"name_or_path": str(model_dir)}, "data": {"sources": [{"path": str(data)}], "max_length": max_length},
                        "method": {"peft": "none"}, "training": {"per_device_train_batch_size": 8}})
    plan = resolve(cfg, detect(), sizing=False)
    rule = next((d.rule for d in plan.decisions if d.key == "data.packing"), "as configured")
    return plan.config.data.packing, plan.config.model.attn_implementation, rule


def pad_to(batch: dict, n: int, pad_id: int) -> dict:
    import torch.nn.functional as F

    extra = n - batch["input_ids"].shape[1]
    return {"input_ids": F.pad(batch["input_ids"], (0, extra), value=pad_id), "attention_mask": F.pad(batch["attention_mask"], (0, extra), value=0),
            "labels": F.pad(batch["labels"], (0, extra), value=-100)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="records (a few are held out as the eval split)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the work itself is timed; threads oversubscribed on a shared machine add a per-op wait that hides it)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    import torch
    from _synth import tokenizer, write_alpaca
    from transformers import AutoModelForCausalLM

    from trainpipe.config import DataConfig
    from trainpipe.data.prepare import prepare
    from trainpipe.data.tokenize import row_tokens, setup_chat_template
    from trainpipe.train.objectives import TokenCrossEntropy

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="tp-padfree-"))
    tok = tokenizer(tmp)
    template = setup_chat_template(tok, "chatml", "bench")
    src = write_alpaca(tmp / "a.jsonl", args.n)
    model_dir = build(tmp, tok, args.width, args.layers)
    packing, attn, rule = default_batching(model_dir, src, args.max_length)
    rows = {}
    for mode in ("none", packing):
        cfg = DataConfig(sources=[{"path": str(src)}], eval_split=0.02, max_length=args.max_length, packing=mode, cache_dir=str(tmp / f"c-{mode}"))
        rows[mode] = list(prepare(cfg, tok, train_on="assistant", seed=0, template_name=template, for_method="sft").train)
    plain, default_rows = rows["none"], rows[packing]
    assert [r["input_ids"] for r in plain] == [r["input_ids"] for r in default_rows]
    k = len(plain) // args.batch * args.batch
    chunks = [list(range(i, i + args.batch)) for i in range(0, k, args.batch)]

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    obj = TokenCrossEntropy(tok.pad_token_id)
    batches = {
        "pad_to_max": [pad_to(obj.collate([plain[i] for i in c]), args.max_length, tok.pad_token_id) for c in chunks],
        "dynamic": [obj.collate([plain[i] for i in c]) for c in chunks],
        "default": [obj.collate([default_rows[i] for i in c]) for c in chunks],
    }
    useful = sum(row_tokens(plain[i]) for c in chunks for i in c)
    shapes = {m: sum(b["input_ids"].numel() for b in bs) for m, bs in batches.items()}

    def step(batch: dict) -> float:
        t0 = time.perf_counter()
        b = dict(batch)
        loss, _ = obj.loss_sum(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for m in batches:  # warm-up: one micro-batch of each (allocator, kernels)
        step(batches[m][0])
    seconds = {m: 0.0 for m in batches}
    for _ in range(args.rounds):
        for j in range(len(chunks)):
            for m in batches:
                seconds[m] += step(batches[m][j])
    tps = {m: args.rounds * useful / s for m, s in seconds.items()}
    ratios = {"default_over_pad_to_max": tps["default"] / tps["pad_to_max"], "default_over_dynamic": tps["default"] / tps["dynamic"]}
    result = {
        "what": "useful (non-pad) tokens/s of one SFT training step (forward, backward, AdamW) per batching, same examples and micro-batch",
        "default_batching": {"data.packing": packing, "model.attn_implementation": attn, "rule": rule},
        "model": {"arch": "llama", "hidden": args.width, "layers": args.layers, "vocab": len(tok),
                  "params": sum(p.numel() for p in model.parameters())},
        "data": {"source": "benchmarks/_synth.py alpaca-length records", "examples_timed": k, "micro_batch": args.batch,
                 "max_length": args.max_length, "useful_tokens_per_round": useful,
                 "mean_length": round(useful / k, 1), "max_example_length": max(row_tokens(plain[i]) for c in chunks for i in c)},
        "tokens_in_batches": shapes,
        "non_pad_share": {m: round(useful / n, 4) for m, n in shapes.items()},
        "useful_tokens_per_second": {m: round(v, 1) for m, v in tps.items()},
        "seconds": {m: round(v, 2) for m, v in seconds.items()},
        "ratios": {k2: round(v, 3) for k2, v in ratios.items()},
        "targets": TARGETS,
        "pass": {k2: ratios[k2] >= TARGETS[k2] for k2 in TARGETS},
        "rounds": args.rounds, "threads": args.threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"default batching: data.packing={packing} with {attn} ({rule})")
    for m in batches:
        print(f"  {m:11s} {tps[m]:9.1f} useful tokens/s   non-pad share {useful / shapes[m]:.3f}")
    for k2, v in ratios.items():
        print(f"  {k2}: {v:.2f}x (target >= {TARGETS[k2]}) {'PASS' if v >= TARGETS[k2] else 'FAIL'}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
