"""What a run records of itself beside the events (rank 0 writes): `measured_memory.json` (the plan meets reality) and
the topology in the run manifest (world size, strategy, a resume under another world size)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainpipe.distributed import strategy as strategies
from trainpipe.plan.measure import measure_state_bytes
from trainpipe.track.manifest import update_manifest, write_json


def measure_memory(run_dir: Path, model, optimizer, device, state, *, final: bool = False, seconds: float | None = None,
                   tokens: int | None = None) -> None:
    """Write `measured_memory.json`: after the first optimizer step the exact bytes of parameters, gradients and
    optimizer state (plan/measure.py); at the end the CUDA peak and the throughput of this process."""
    path = Path(run_dir) / "measured_memory.json"
    rec = json.loads(path.read_text()) if path.exists() else {}
    if not final:
        rec["state_bytes"] = measure_state_bytes(model, optimizer) | {"after_step": state.step + 1}
    else:
        if device.type == "cuda":
            import torch

            rec["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
            rec["cuda_max_memory_reserved"] = int(torch.cuda.max_memory_reserved(device))
        if seconds and tokens:
            rec["tokens_per_second"] = round(tokens / seconds, 2)
        rec["micro_batch"] = state.micro_batch
        rec["gradient_checkpointing"] = state.gradient_checkpointing
    write_json(path, rec, what="the measured memory `measured_memory.json`")


def record_world(run_dir: Path, strategy, state, effective: int, resumed_world: int | None, powersgd_note: str | None) -> None:
    """State the world size, and a resume under another one, in the run manifest."""
    def change(man: dict) -> None:
        d = man.setdefault("distributed", {})
        d.update({"world_size": strategy.dims.world, "strategy": strategy.name, "effective_batch": effective, "micro_batch": state.micro_batch,
                  "accumulation": math.ceil(effective / (state.micro_batch * strategy.dims.dp)), **strategies.describe(strategy)})
        if powersgd_note:
            d.setdefault("powersgd_resumes", []).append({"step": state.step, "powersgd": powersgd_note})
        if resumed_world is not None:
            d.setdefault("resumes", []).append({
                "step": state.step, "window": state.window, "from_world_size": resumed_world, "to_world_size": strategy.dims.dp,
                "effective_batch": effective, "note": "the effective batch of the checkpoint is kept; the accumulation follows the world size",
                **({"powersgd": powersgd_note} if powersgd_note else {}),
            })

    update_manifest(run_dir, change)
