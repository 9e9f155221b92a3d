"""Reserved vs allocated of a real training step at full size, from the caching-allocator simulator (issue 14 item 5).

For a measurements.json row, the step today's stack runs for that setup (transformers + PEFT, the row's method, LoRA,
gradient checkpointing, loss, batch and length) is traced at full size on fake tensors by plan/trace.py (CUDA's
`native_dropout`, foreach AdamW, QLoRA through the emulated bitsandbytes kernel), and its ordered allocation/free stream
is replayed through plan/allocator.py (PyTorch's CUDACachingAllocator rules, default settings) for --steps steps:
max_memory_allocated and max_memory_reserved as the allocator would report them. Printed beside them: the planner's
allocated, its reserved term (memory.fragmentation_bytes) and the measured figure. With --capacity-mib the stream is
replayed again with that much for cudaMalloc (the GPU less the CUDA context): does the step fit?

    python benchmarks/allocator_gap.py ult-h100-llama3.1-8b-lora-b2-s8192 [more ids] [--steps 2] [--capacity-mib 81000]

Rows of other programs are mapped to the nearest traced one and say so: litgpt's bf16 cross-entropy -> `hf-bf16-loss`;
bitsandbytes' 8-bit AdamW (which fake tensors cannot run) -> AdamW. torchtune/torchtitan rows and multi-GPU rows are
refused (trace.py traces one process of transformers + PEFT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from trainpipe.plan import accuracy, allocator, memory, trace  # noqa: E402
from trainpipe.plan.catalog import find_model  # noqa: E402

MIB = 1 << 20


def published_setup(m: dict) -> memory.Setup:
    """The planner's Setup for a row, as accuracy.predict_mib builds it."""
    return memory.Setup(method=m["method"], precision=m["precision"], optimizer=m["optimizer"], micro_batch=m["micro_batch"], seq_len=m["seq_len"],
                     grad_ckpt=m["grad_ckpt"], strategy=m.get("strategy", "single" if m["gpus"] == 1 else "ddp"), num_gpus=m["gpus"],
                     offload=m.get("offload", "none"), lora_r=m.get("lora_r", 16), lora_targets=m.get("lora_targets", "attention"),
                     lora_dropout=m.get("lora_dropout", 0.05), attention=m.get("attention", "sdpa"), lm_head=m.get("head", "lm") != "classification",
                     fused_optimizer=m.get("fused_optimizer", True), double_quant=m.get("double_quant", True),
                     framework=m.get("framework", "transformers"), base_dtype=m.get("base_dtype", "auto"), bnb_saves_input=m.get("bnb_saves_input"))


def row_setup(m: dict) -> tuple[memory.Setup, list[str]]:
    """The row's setup mapped to what trace.py runs, with a note per change."""
    s = published_setup(m)
    notes = []
    if s.framework == "litgpt":
        s = replace(s, framework="hf-bf16-loss")
        notes.append("litgpt traced as transformers + PEFT with a bf16 cross-entropy (hf-bf16-loss)")
    if s.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        s = replace(s, optimizer="adamw", fused_optimizer=False)
        notes.append("8-bit AdamW traced as AdamW (fp32 states of the trainable parameters)")
    return s, notes


def simulate(row: dict, steps: int = 2, capacity_mib: float | None = None) -> dict:
    spec = find_model(row["model"])
    s, notes = row_setup(row)
    tr = trace.trace_step(spec, s, steps=steps)
    sim = allocator.replay_trace(tr)
    b = memory.estimate(spec, published_setup(row))
    out = {
        "id": row["id"], "steps": steps, "trace_s": round(tr.seconds, 1), "events": len(tr.events),
        "sim_allocated_mib": round(sim.peak_allocated / MIB), "sim_reserved_mib": round(sim.peak_reserved / MIB),
        "sim_reserved_over_allocated": round(sim.peak_reserved / sim.peak_allocated, 4), "sim_gap_mib": round((sim.peak_reserved - sim.peak_allocated) / MIB),
        "segments": sim.segments,
        "planner_allocated_mib": round(b.allocated_bytes / MIB), "planner_gap_mib": round(b.reserved_bytes / MIB - b.allocated_bytes / MIB),
        "flat_gap_mib": round(memory.FRAGMENTATION * b.allocated_bytes / MIB),
        "metric": row["metric"], "measured_mib": row["measured_mib"], "planner_mib": round(accuracy.predict_mib(row)), "notes": notes + tr.notes,
    }
    if row["metric"] == "reserved":
        out["sim_error_vs_measured"] = round(sim.peak_reserved / MIB / row["measured_mib"] - 1, 4)
    if capacity_mib:
        c = allocator.replay_trace(tr, int(capacity_mib * MIB))
        out.update(capacity_mib=capacity_mib, fits=not c.oom, capped_reserved_mib=round(c.peak_reserved / MIB), alloc_retries=c.num_alloc_retries)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="+", help="measurements.json row ids")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--capacity-mib", type=float, default=None, help="also replay with this much for cudaMalloc (does it fit?)")
    ap.add_argument("--json", default=None, help="append one JSON line per row to this file")
    a = ap.parse_args(argv)
    rows = {m["id"]: m for m in accuracy.measurements()}
    unknown = [i for i in a.ids if i not in rows]
    if unknown:
        print(f"unknown row id(s): {', '.join(unknown)} (ids are in src/trainpipe/plan/data/measurements.json)", file=sys.stderr)
        return 2
    for rid in a.ids:
        try:
            out = simulate(rows[rid], a.steps, a.capacity_mib)
        except trace.TraceError as e:
            out = {"id": rid, "not_traced": str(e)}
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
