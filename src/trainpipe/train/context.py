"""What every recipe (sft, pretrain, dpo/orpo/kto, reward, rl) receives from `trainpipe run`.

`run.py` (one run) checks the inputs, resolves the plan, lays out the run directory, loads the tokenizer, prepares
the data and writes the manifest; then it hands a RunContext to the recipe of
`method.name`, whose `run(ctx)` trains, evaluates, exports and returns the summary. The recipe builds the optimizer,
stepper and loop from `ctx.specs` (the plan's resolved specs), not from `ctx.cfg.training`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainpipe.config import RunConfig, dump_yaml
from trainpipe.distributed.env import DistEnv, detect
from trainpipe.distributed.topology import Capabilities, ParallelDims, capabilities
from trainpipe.events import EventLog
from trainpipe.plan.specs import DistributedSpec, RunSpecs
from trainpipe.track.manifest import write_json


@dataclass(frozen=True)
class DistRuntime:
    """What the loop needs to train on several processes: who this rank is, and the run's resolved distributed spec
    (`plan.specs.distributed`: the strategy, its settings and the topology), never the user's `distributed:` section."""

    env: DistEnv
    grad_compression: str = "none"
    timeout_seconds: float = 600.0
    strategy: str = "ddp"  # what distributed/strategy.py `make` builds: ddp, fsdp, zero2, zero3
    offload: str = "none"  # FSDP / ZeRO: CPU offload
    dims: ParallelDims | None = None  # the topology; None: every process a data-parallel rank of `strategy`

    @classmethod
    def of(cls, d: DistributedSpec) -> "DistRuntime | None":
        env = detect()
        return cls(env, d.grad_compression, d.timeout_seconds, d.strategy, d.offload, d.dims) if env.distributed else None

    @property
    def topology(self) -> ParallelDims:
        return self.dims if self.dims is not None else ParallelDims.of(self.strategy, self.env.world_size)

    @property
    def caps(self) -> Capabilities:
        return capabilities(self.strategy, self.env.world_size, self.topology.tp)


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    events: EventLog
    tokenizer: Any
    template: str
    stop_ids: list[int]
    data: Any  # trainpipe.data.prepare.PreparedData
    specs: RunSpecs  # the resolved plan's specs (`plan.specs`): what the recipe hands the optimizer, stepper and loop
    resume_from: Any = None  # trainpipe.model.checkpoints.CheckpointInfo | None
    hardware: Any = None
    extra: dict = field(default_factory=dict)  # e.g. the plan's predictions, filled by run.py
    callbacks: tuple = ()  # the loop's callbacks beside every run's (train/callbacks.py): e.g. `trainpipe tune`'s pruner

    @property
    def dist(self) -> DistRuntime | None:
        """None for one process; under torchrun / `--nproc-per-node` the rank and the resolved distributed spec."""
        return DistRuntime.of(self.specs.distributed)

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): it evaluates before and after training, exports and writes the summary."""
        return self.dist is None or self.dist.env.is_main

    @property
    def config_yaml(self) -> str:
        return dump_yaml(self.cfg)

    def baseline_once(self, measure: Callable[[], tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
        """Measure the baseline before training, or read it back when resuming (it was measured on the untrained model)."""
        path = self.run_dir / "baseline.json"
        if not self.is_main:  # rank 0 measures it
            return {}, []
        if self.resume_from is not None and path.exists():
            saved = json.loads(path.read_text())
            return saved["metrics"], saved["samples"]
        metrics, samples = measure()
        write_json(path, {"metrics": metrics, "samples": samples[:20]}, what="the baseline evaluation `baseline.json`")
        self.events.emit("eval_done", step=0, phase="baseline", **metrics)
        return metrics, samples

    def data_summary(self) -> dict:
        r = self.data.report
        return {k: r[k] for k in ("records_read", "records_kept", "dropped", "pii", "splits", "records", "rejected_total", "rejected", "train_examples", "eval_examples", "train_tokens") if k in r}

    def data_files(self) -> list[dict]:
        return [{"path": s.get("path") or s.get("source"), "sha256": s.get("sha256")} for s in self.data.report["sources"]]

    def card(self, baseline: dict, final: dict, **more) -> dict:
        cfg = self.cfg
        return {
            "name": cfg.name, "base_model": cfg.model.name_or_path, "method": f"{cfg.method.name} / {cfg.method.peft}", "config_hash": cfg.hash(),
            "data_files": self.data_files(), "baseline": baseline, "final": final, "config": cfg.model_dump(mode="json"),
            "trainpipe_version": __import__("trainpipe").__version__, **more,
        }
