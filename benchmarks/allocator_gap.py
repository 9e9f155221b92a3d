"""Reserved vs allocated of a real training step at full size, from the caching-allocator simulator (issue 14 item 5).

For a measurements.json row, the step today's stack runs for that setup (transformers + PEFT, the row's LoRA, gradient
checkpointing, loss, batch and length) is traced at full size under FakeTensorMode: the model is built on the meta
device from the catalog's config, every parameter and buffer becomes a fake CPU tensor, and a TorchDispatchMode records
each new output storage as an allocation and its `weakref.finalize` as the free (the live bytes of a fake run equal a
real run's to the byte). Dropout goes through `torch.native_dropout` (the fused kernel CUDA runs, 1-byte bool mask)
instead of the CPU path (`input * float_noise`, a 4-byte mask), AdamW runs `foreach` as it does on CUDA. The stream of
`--steps` steps is then replayed through trainpipe.plan.allocator (PyTorch's CUDACachingAllocator rules) to give
max_memory_allocated and max_memory_reserved; the planner's predicted allocated/reserved and the measured figure are
printed beside them.

    python benchmarks/allocator_gap.py ult-h100-llama3.1-8b-lora-b2-s8192 [--steps 2] [--layers N] [--json out.json]

`--layers N` traces an N-layer model of the same shape (quick checks; the gap changes with depth).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from trainpipe.plan import accuracy, allocator, memory
from trainpipe.plan.catalog import build_meta_model, find_model

MIB = 1 << 20


class AllocationRecorder(TorchDispatchMode):
    """Each new output storage is an allocation (nbytes, +1, key); its finalizer the free (nbytes, -1, key)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int, int]] = []
        self._seen = WeakIdKeyDictionary()
        self._ids = itertools.count()
        self.cur = self.peak = 0

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        key = next(self._ids)
        self._seen[st] = key
        self.events.append((n, 1, key))
        self.cur += n
        self.peak = max(self.peak, self.cur)
        weakref.finalize(st, self._free, n, key)

    def _free(self, n: int, key: int) -> None:
        self.events.append((n, -1, key))
        self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it: the fused native_dropout (bool mask saved), not the CPU's input * float noise."""
    if not training or p == 0.0:
        return input
    return torch.native_dropout(input, p, True)[0]


class _MatMul4Bit045(torch.autograd.Function):
    """bitsandbytes 0.45's MatMul4Bit, as the published QLoRA rows ran it: dequantize_4bit makes the full weight in the
    compute dtype (a transient), `.to(A.dtype)`, linear; only the packed weight is kept for backward (ctx.tensors =
    (None, B)), and the backward dequantizes again for grad_A. (The installed bitsandbytes 0.50 runs a gemm_4bit op
    without the transient on CUDA; it cannot run on fake CPU tensors either way.)"""

    @staticmethod
    def forward(ctx, A, packed, shape, compute_dtype):
        W = torch.empty(shape, dtype=compute_dtype).to(A.dtype)  # dequantize_4bit(B, state).to(A.dtype)
        out = F.linear(A, W)
        del W
        ctx.save_for_backward(packed)
        ctx.shape, ctx.compute_dtype = shape, compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (packed,) = ctx.saved_tensors
        W = torch.empty(ctx.shape, dtype=ctx.compute_dtype).to(grad_output.dtype)
        return torch.matmul(grad_output, W), None, None, None


class FakeLinear4bit(torch.nn.Linear):
    """bnb.nn.Linear4bit's memory on fake tensors: an NF4 packed uint8 weight ((out*in+1)//2 bytes) plus absmax (fp32 per
    64, or with double quantization uint8 per 64 + fp32 per 64*256), input cast to the compute dtype and the output cast
    back to the input's dtype (Linear4bit.forward)."""

    compute_dtype = torch.bfloat16
    double_quant = True

    def forward(self, x):
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        out = _MatMul4Bit045.apply(x, self.weight, self._w_shape, self.compute_dtype)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(inp_dtype)


def _quantize(model) -> None:
    """Swap every Linear in the decoder layers (not lm_head) for FakeLinear4bit: meta shapes stay for PEFT."""
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear and any(p.isdigit() for p in name.split(".")):
            mod.__class__ = FakeLinear4bit
            mod._w_shape = tuple(mod.weight.shape)


def _materialise_4bit(mod: FakeLinear4bit) -> None:
    n = mod._w_shape[0] * mod._w_shape[1]
    mod._parameters["weight"] = torch.nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8), requires_grad=False)
    if mod.double_quant:
        mod.register_buffer("absmax", torch.empty(n // 64, dtype=torch.uint8))
        mod.register_buffer("absmax2", torch.empty(max(1, n // (64 * 256)), dtype=torch.float32))
    else:
        mod.register_buffer("absmax", torch.empty(n // 64, dtype=torch.float32))


def _targets(spec, targets) -> list[str] | str:
    if targets in ("all-linear", "all"):
        return "all-linear"
    names = sorted({li.name.split(".")[-1] for li in spec.resolve_targets(targets)})
    return names


def trace_row(row: dict, steps: int = 2, layers: int | None = None) -> dict:
    from peft import LoraConfig, get_peft_model

    spec = find_model(row["model"])
    cfg = dict(spec.config)
    if layers:
        cfg["num_hidden_layers"] = layers
    classification = row.get("head") == "classification"
    if classification:  # BERT rows: a sequence-classification head
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForSequenceClassification.from_config(transformers.AutoConfig.for_model(spec.model_type, **cfg))
    else:
        model = build_meta_model(spec.model_type, cfg, spec.task)
    model.config._attn_implementation = row.get("attention", "sdpa") if row.get("attention") in ("eager", "sdpa") else "sdpa"
    # bf16-true: 16-bit weights; fp16/bf16: fp32 weights under autocast (AMP); fp32: fp32
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(row["precision"]) if row["method"] == "full" else None
    dtype = torch.float32 if row["precision"] == "fp32" or amp is not None else torch.bfloat16
    if row["method"] == "qlora":  # base in bf16 or, loaded without torch_dtype, fp32 (base_dtype) with bf16 compute
        dtype = torch.float32 if row.get("base_dtype") == "fp32" else torch.bfloat16
        FakeLinear4bit.double_quant = bool(row.get("double_quant", True))
    model = model.to(dtype)
    if row["method"] == "qlora":
        _quantize(model)
    if row["method"] in ("lora", "qlora"):
        model = get_peft_model(model, LoraConfig(r=row.get("lora_r", 16), lora_alpha=2 * row.get("lora_r", 16),
                                                 target_modules=_targets(spec, row.get("lora_targets", "attention")),
                                                 lora_dropout=row.get("lora_dropout", 0.05)))
    if row["method"] not in ("full", "lora", "qlora"):
        raise SystemExit(f"{row['id']}: method {row['method']} is not traced by this script (lora and full are)")
    if row.get("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    B, S = row["micro_batch"], row["seq_len"]
    vocab = cfg["vocab_size"]
    framework = row.get("framework", "transformers")
    # CUDA's default AdamW is foreach; the BERT rows ran the old Trainer's AdamW (a per-parameter loop, their assumptions)
    foreach = not classification

    F.dropout, orig_dropout = _cuda_dropout, F.dropout
    t0 = time.time()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            rec = AllocationRecorder()
            with rec:
                for mod in model.modules():
                    if isinstance(mod, FakeLinear4bit):
                        _materialise_4bit(mod)
                    for k, p in list(mod._parameters.items()):
                        if isinstance(mod, FakeLinear4bit) and k == "weight":
                            continue
                        if p is not None:
                            mod._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
                    for k, b in list(mod._buffers.items()):
                        if b is not None:
                            mod._buffers[k] = torch.ones(b.shape, dtype=b.dtype, device="cpu")
                weights = rec.cur
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=foreach)
                for _ in range(steps):
                    ids = torch.randint(0, vocab, (B, S))
                    ctx = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
                    if classification:
                        with ctx:
                            loss = model(input_ids=ids, labels=torch.randint(0, 2, (B,))).loss
                    elif framework in ("hf-bf16-loss", "litgpt"):  # no labels, nn.CrossEntropyLoss on the 16-bit logits (litgpt: bf16 CE)
                        out = model(input_ids=ids)
                        logits = out.logits
                        loss = torch.nn.CrossEntropyLoss()(logits[:, :-1, :].reshape(-1, vocab), ids[:, 1:].reshape(-1))
                        del out, logits
                    else:
                        loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    del ids
    finally:
        F.dropout = orig_dropout
    trace_s = time.time() - t0
    sim = allocator.replay(rec.events)
    return {"id": row["id"], "layers": cfg["num_hidden_layers"], "steps": steps, "events": len(rec.events), "trace_s": round(trace_s, 1),
            "weights_mib": weights / MIB, "live_peak_mib": rec.peak / MIB, "sim": sim, "events_list": rec.events}


def report(row: dict, r: dict) -> dict:
    sim = r["sim"]
    spec = find_model(row["model"])
    pred_total = accuracy.predict_mib(row)
    out = {
        "id": row["id"], "layers": r["layers"], "steps": r["steps"], "trace_s": r["trace_s"], "events": r["events"],
        "traced_allocated_mib": round(sim.peak_allocated / MIB), "traced_reserved_mib": round(sim.peak_reserved / MIB),
        "reserved_over_allocated": round(sim.peak_reserved / sim.peak_allocated, 4), "segments_at_end": sim.segments,
        "peak_segments": sim.peak_segments, "metric": row["metric"], "measured_mib": row["measured_mib"], "planner_mib": round(pred_total),
    }
    del spec
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="+", help="measurements.json row ids")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--json", default=None, help="append one JSON line per row to this file")
    ap.add_argument("--save-events", default=None, help="folder: write <id>.npz with the event stream (nbytes, sign, key)")
    ap.add_argument("--capacity-mib", type=float, default=None, help="also replay with this much for the allocator (does it fit?)")
    a = ap.parse_args(argv)
    rows = {m["id"]: m for m in accuracy.measurements()}
    for rid in a.ids:
        row = rows[rid]
        r = trace_row(row, a.steps, a.layers)
        out = report(row, r)
        if a.capacity_mib:
            c = allocator.replay(r["events_list"], int(a.capacity_mib * MIB))
            out.update(capacity_mib=a.capacity_mib, fits=not c.oom, capped_reserved_mib=round(c.peak_reserved / MIB), retries=c.num_alloc_retries)
        if a.save_events:
            import numpy as np

            ev = np.array(r["events_list"], dtype=np.int64)
            os.makedirs(a.save_events, exist_ok=True)
            np.savez_compressed(os.path.join(a.save_events, f"{rid}.npz"), events=ev)
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
