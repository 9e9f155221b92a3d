"""Loss memory: the peak extra memory of next-token cross-entropy (forward + backward), trainpipe's chunked loss
(train/losses.py) against the one-piece float32 upcast it replaced, measured in the same run.

Each variant runs in a fresh process on bf16 logits that are an op's output (as a model's are in training); the figure is
the growth of the process's peak resident memory (``ru_maxrss``) across the loss's forward and backward, the logits
themselves excluded. Both figures include the logits-sized bf16 gradient the loss hands back to the model (needed by any
loss); the line "beyond that gradient" takes it out. The one-piece loss upcasts the whole batch x sequence x vocabulary to
float32 and keeps the float32 log-softmax for the backward pass; the chunked one upcasts ``--chunk-elements`` logits
at a time and writes the gradient over the logits. Prints both peaks, the logits' own size, and the ratio
(target: chunked / one-piece <= 0.3, and <= 0.15 beyond the gradient).

    python benchmarks/loss_memory.py [--batch 2] [--seq 1024] [--vocab 32000] [--chunk-elements 4194304]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
import torch
from trainpipe.model.losses import chunked_cross_entropy_sum, shift_labels
variant, B, T, V, chunk = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
scores = (torch.randn(B, T, V, dtype=torch.bfloat16) * 3).requires_grad_()
labels = torch.randint(0, V, (B, T))
labels[:, : T // 4] = -100
logits = scores * 1.0  # a model's bf16 output (not a leaf), as the LM head returns it
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = rss()
if variant == "one_piece":
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
else:
    loss = chunked_cross_entropy_sum(logits, shift_labels(labels), chunk_elements=chunk)
loss.backward()
print(json.dumps({"peak_extra_bytes": rss() - before, "loss": loss.item(), "grad_sum": float(scores.grad.double().abs().sum())}))
"""


def measure(variant: str, a) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(a.batch), str(a.seq), str(a.vocab), str(a.chunk_elements)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk-elements", type=int, default=1 << 22)
    a = ap.parse_args()
    base = measure("one_piece", a)
    new = measure("chunked", a)
    logits_mb = a.batch * a.seq * a.vocab * 2 / 2**20
    ratio = new["peak_extra_bytes"] / max(1, base["peak_extra_bytes"])
    print(f"logits: {a.batch} x {a.seq} x {a.vocab} bf16 = {logits_mb:.0f} MiB; chunk: {a.chunk_elements:,} logits "
          f"({a.chunk_elements * 4 / 2**20:.0f} MiB float32)")
    print(f"one-piece float32 loss (baseline): peak +{base['peak_extra_bytes'] / 2**20:.0f} MiB")
    print(f"chunked loss:                      peak +{new['peak_extra_bytes'] / 2**20:.0f} MiB")
    print(f"same loss: {abs(new['loss'] - base['loss']) <= 1e-5 * abs(base['loss'])} ({new['loss']:.6g} vs {base['loss']:.6g}); "
          f"same input gradient (L1): {new['grad_sum']:.6g} vs {base['grad_sum']:.6g}")
    grad = a.batch * a.seq * a.vocab * 2
    beyond = max(0, new["peak_extra_bytes"] - grad) / max(1, base["peak_extra_bytes"] - grad)
    print(f"ratio chunked / one-piece: {ratio:.3f} (target <= 0.3); beyond the {grad / 2**20:.0f} MiB gradient both return: {beyond:.3f} (target <= 0.15)")


if __name__ == "__main__":
    main()
