"""`trainpipe batch-find CONFIG`: the largest micro-batch that fits, then the accumulation for the target effective batch.

Each candidate micro-batch runs one real forward and backward of the run's model on that many of the training data's
longest examples, padded to `data.max_length` (the worst case a step can meet). Doubling from 1 until a step does not fit,
then a binary search between the last fit and the first failure.

What "does not fit" means:
- on a GPU: a real `torch.cuda.OutOfMemoryError`, caught, the cache emptied; `--max-memory-gib` caps the process with
  `torch.cuda.set_per_process_memory_fraction`, so the cap is a real allocator limit;
- on the CPU, where running out of memory kills the process instead of raising: a SIMULATED out-of-memory when the
  planner's peak estimate for that micro-batch (plan/memory.py: weights, gradients, optimizer, activations, overhead)
  exceeds `--max-memory-gib` (default: the CPU share of the RAM the planner uses). The step is still run for every
  micro-batch that passes, so the answer is one that trains.

The proposal keeps the effective batch: micro-batch x accumulation x world size = `training.target_effective_batch_size`
exactly. The proposed micro-batch is the largest one that both fits and divides the target per process (target / world
size); the accumulation is what makes up the rest. (A micro-batch of 85 that fits is no answer for a target of 32: it
would train with an effective batch of 85.) The largest micro-batch that merely fits is reported beside it.

The result is printed as `--set` lines (micro-batch and gradient accumulation) and written to `batch_find.json`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import RunConfig
from trainpipe.errors import ConfigError
from trainpipe.plan.memory import estimate
from trainpipe.plan.resolve import CPU_MEMORY_SHARE, PLAN_METHOD, _ram_bytes, memory_setup, model_spec
from trainpipe.tune.lrfind import input_paths, load_probe


class SimulatedOOM(Exception):
    """CPU only: the planner's estimate for this micro-batch exceeds the memory cap (see the module docstring)."""


def _planner_bytes(cfg: RunConfig, mb: int) -> int | None:

    try:
        spec = model_spec(cfg)
    except Exception:  # noqa: BLE001 - an unsizeable model: no estimate
        return None
    s = replace(memory_setup(cfg, PLAN_METHOD.get(cfg.method.peft, "lora"), "fp32" if not (cfg.training.bf16 or cfg.training.fp16) else "bf16", 1),
                micro_batch=mb)
    return int(estimate(spec, s).total_bytes)


def _world_size(cfg: RunConfig) -> int:
    """The processes the run will train on (`distributed.nproc_per_node` x `distributed.nnodes`; `auto`: this launch's WORLD_SIZE, else 1)."""
    import os

    d = cfg.distributed
    if isinstance(d.nproc_per_node, int):
        return max(1, d.nproc_per_node * d.nnodes)
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def keep_effective_batch(largest: int, target: int, world: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation) with micro-batch x accumulation x world = target: the largest micro-batch <= ``largest``
    that divides the per-process target, and the accumulation that makes up the rest. ConfigError when the target is not a
    multiple of the world size (no micro-batch can keep it)."""
    if target % world:
        raise ConfigError(
            f"`training.target_effective_batch_size` {target} is not a multiple of the {world} processes the run trains on "
            f"(`distributed.nproc_per_node` x `distributed.nnodes`), so no micro-batch and accumulation keep it. Set it to a "
            f"multiple of {world} (e.g. {max(world, target - target % world)}), or change the number of processes."
        )
    per = target // world
    mb = max(d for d in range(1, min(largest, per) + 1) if per % d == 0)
    return mb, per // mb


def batch_find(cfg: RunConfig, *, max_memory_gib: float | None = None, max_batch: int = 256, out_dir: str | Path | None = None) -> dict:
    import torch

    if max_batch < 1:
        raise ConfigError(f"`--max-batch {max_batch}` must be at least 1.")
    keep_effective_batch(1, cfg.training.target_effective_batch_size, _world_size(cfg))  # a target no split can keep: refused before the model loads
    cfg, model, tok, data, objective, _ = load_probe(cfg)
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    cap = max_memory_gib * 1024**3 if max_memory_gib else (None if on_gpu else _ram_bytes() * CPU_MEMORY_SHARE)
    if on_gpu and max_memory_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    seq = cfg.data.max_length
    longest = sorted(data.train, key=lambda ex: -len(ex["input_ids"]))
    tries: list[dict] = []

    def fits(mb: int) -> bool:
        rec: dict = {"micro_batch": mb}
        tries.append(rec)
        if not on_gpu:
            need = _planner_bytes(cfg, mb)
            rec["planner_bytes"] = need
            if need is not None and cap is not None and need > cap:
                rec.update(fits=False, why=f"simulated OOM: the planner's peak {need / 1024**3:.3f} GiB > cap {cap / 1024**3:.3f} GiB")
                return False
        rows = [dict(longest[i % len(longest)]) for i in range(mb)]
        for r in rows:  # the worst case: every row as long as the data allows
            pad = seq - len(r["input_ids"])
            if pad > 0:
                r["input_ids"] = list(r["input_ids"]) + [tok.pad_token_id] * pad
                r["labels"] = list(r["labels"]) + [r["labels"][-1] if r["labels"] else -100] * pad
        try:
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(device)
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in objective.collate(rows).items()}
            loss, _ = objective.loss_sum(model, batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if on_gpu:
                rec["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
            rec["fits"] = True
            return True
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rec.update(fits=False, why="CUDA out of memory")
            return False

    model.train()
    good, bad = largest_fitting(fits, max_batch)
    if good == 0:
        raise ConfigError(
            f"not even a micro-batch of 1 at `data.max_length` {seq} fits ({tries[-1].get('why')}). Lower `data.max_length`, turn on "
            "`training.gradient_checkpointing`, use `method.peft: lora` or `qlora`, or raise `--max-memory-gib`."
        )
    largest = min(good, max_batch)
    target = cfg.training.target_effective_batch_size
    world = _world_size(cfg)
    mb, accum = keep_effective_batch(largest, target, world)
    result = {
        "micro_batch": mb, "gradient_accumulation_steps": accum, "world_size": world, "effective_batch": mb * accum * world,
        "target_effective_batch": target, "largest_fitting_micro_batch": largest,
        "seq_len": seq, "device": device.type, "cap_bytes": int(cap) if cap else None, "limited_by": "memory" if bad is not None else f"--max-batch {max_batch}",
        "simulated": not on_gpu, "tries": tries,
        "set": [f"--set training.per_device_train_batch_size={mb}", f"--set training.gradient_accumulation_steps={accum}"],
    }
    out = Path(out_dir or (Path(cfg.output_dir).parent / f"{Path(cfg.output_dir).name}-batch-find")).resolve()
    reads = input_paths(cfg)
    out = ownership.make_dir(out, what="batch-find's output folder", reads=reads)
    ownership.write_json(out / "batch_find.json", result, what="batch-find's `batch_find.json`", reads=reads)
    _print(result, on_gpu)
    return result | {"out_dir": str(out)}


def largest_fitting(fits, max_batch: int) -> tuple[int, int | None]:
    """(the largest micro-batch that fits, the smallest that does not, or None when `max_batch` fits): doubling from 1, then a
    binary search between the last that fit and the first that did not. 0 when not even 1 fits."""
    good, bad = 0, None
    mb = 1
    while mb <= max_batch:
        if fits(mb):
            good = mb
            mb *= 2
        else:
            bad = mb
            break
    if good and bad is not None:  # binary search in (good, bad)
        lo, hi = good, bad
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        good = lo
    return good, bad


def _print(result: dict, on_gpu: bool) -> None:
    mb, accum, world, target, largest = (result[k] for k in ("micro_batch", "gradient_accumulation_steps", "world_size", "target_effective_batch",
                                                             "largest_fitting_micro_batch"))
    con = ui.console()
    how = "CUDA OOM caught" if on_gpu else "CPU: simulated OOM from the planner's peak estimate against the cap"
    con.print(f"batch-find: the largest micro-batch that fits is {largest} at {result['seq_len']} tokens ({how}; {len(result['tries'])} tries)",
              markup=False, highlight=False)
    world_part = f" x {world} processes" if world > 1 else ""
    con.print(f"batch-find: keeping the effective batch {target}: micro-batch {mb} x accumulation {accum}{world_part} = {mb * accum * world}"
              + (f" (the largest that fits and divides {target // world}; {largest} fits but would change the effective batch)" if mb != largest else ""),
              markup=False, highlight=False)
    for line in result["set"]:
        con.print(line, markup=False, highlight=False)
