"""Preference-loss memory: the peak extra memory of one DPO micro-batch's loss (forward + backward, policy and frozen
reference) with `training.use_liger_kernel: true` (Liger's chunked loss from the last hidden state and the LM head,
train/fused_preference.py) against trainpipe's own loss (the whole batch x sequence x vocabulary logits, upcast to float32
for the log-softmax), measured in the same run on the CPU.

Each variant runs in a fresh process on the same tiny-bodied, large-vocabulary Llama (2 layers, 64 wide, so the logits
dominate as they do at a 128k vocabulary); the figure is the growth of the process's peak resident memory (``ru_maxrss``)
across `PairObjective.loss_sum` and its backward. Prints both peaks, the float32 logits' size, the ratio (the anchor from
Liger's own figures: about -80 % for preference losses, a ratio near 0.2) and that the losses agree.

    python benchmarks/liger_preference_memory.py [--pairs 4] [--seq 512] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from trainpipe.plan.preference_loss import preference_loss_bytes

CHILD = r"""
import json, resource, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trainpipe.config import MethodConfig
from trainpipe.train import fused_preference
from trainpipe.train.preference import Reference, make_objective
variant, P, T, V = sys.argv[1], *map(int, sys.argv[2:5])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=T + 8, tie_word_embeddings=True, pad_token_id=0))
pref = MethodConfig(name="dpo", peft="none", preference={"beta": 0.1}).preference
objective = make_objective("dpo", pref, Reference(model), pad_id=0)
if variant == "liger":
    assert fused_preference.setup(objective, model, "cpu", say=lambda s: None)
g = torch.Generator().manual_seed(1)
ids = lambda n: torch.randint(1, V, (n,), generator=g).tolist()
rows = [{"prompt_input_ids": ids(T // 4), "chosen_input_ids": ids(T - T // 4), "rejected_input_ids": ids(T - T // 4)} for _ in range(P)]
objective.weight(rows)
batch = objective.collate(rows)
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.no_grad():  # warm both paths' allocations of the model itself (weights, a forward) before measuring
    model(input_ids=batch["input_ids"][:1, :8])
before = rss()
loss, _ = objective.loss_sum(model, batch)
loss.backward()
print(json.dumps({"peak_extra_bytes": rss() - before, "loss": loss.item()}))
"""


def measure(variant: str, a) -> dict:
    # every allocation of 64 KiB or more straight from mmap and back on free: glibc's dynamic threshold would otherwise serve
    # tensors under 32 MiB from its heap, whose high-water mark (ru_maxrss) then counts freed chunks
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(a.pairs), str(a.seq), str(a.vocab)], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    base = measure("trainpipe", a)
    new = measure("liger", a)
    logits_mb = 2 * a.pairs * a.seq * a.vocab * 4 / 2**20
    ratio = new["peak_extra_bytes"] / max(1, base["peak_extra_bytes"])
    print(f"policy logits: {2 * a.pairs} x {a.seq} x {a.vocab} float32 = {logits_mb:.0f} MiB")
    kw = {"rows": 2 * a.pairs, "tokens": a.seq, "vocab": a.vocab, "hidden": 64, "logit_bytes": 4, "head_trains": True}
    plan = {v: preference_loss_bytes(liger=v, **kw) / 2**20 for v in (False, True)}  # the planner's figure (plan/preference_loss.py)
    print(f"trainpipe's DPO loss (baseline): peak +{base['peak_extra_bytes'] / 2**20:.0f} MiB (planner: {plan[False]:.0f} MiB)")
    print(f"Liger's chunked DPO loss:        peak +{new['peak_extra_bytes'] / 2**20:.0f} MiB (planner: {plan[True]:.0f} MiB)")
    print(f"same loss: {abs(new['loss'] - base['loss']) <= 1e-5 * max(1.0, abs(base['loss']))} ({new['loss']:.6g} vs {base['loss']:.6g})")
    print(f"ratio liger / trainpipe: {ratio:.3f} (anchor: about 0.2, Liger's -80 % for preference losses)")


if __name__ == "__main__":
    main()
