"""`tune:`: the hyperparameter search over a config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainpipe.config.base import _Section


class TuneObjective(_Section):
    metric: str = "loss"
    """The final eval metric a trial is scored by (a key of `summary.json` `final`: loss, perplexity, exact_match, accuracy, ...)."""
    direction: Literal["auto", "minimize", "maximize"] = "auto"
    """`auto`: minimize loss, perplexity and KL, maximize accuracies, exact match, margins and rewards; a metric without a known direction (rl `completion_length`, a `function`'s unnamed value) is refused until this is set."""
    function: str | None = None
    """Instead of a training run, a Python function `module:fn` or `path/file.py:fn` called as fn(config_dict, trial) -> float (surrogate objectives, benchmarks)."""


class TuneFidelity(_Section):
    steps: int | None = Field(default=None, ge=1)
    """Every trial trains this many optimizer steps (`training.max_steps`); the pruner sees the eval loss every `training.eval_steps`."""
    data_fraction: float | None = Field(default=None, gt=0, le=1)
    """Every trial trains on this share of each source's records (`data.sources[].max_records`, a seeded sample taken before the eval split: the same records, and the same eval split, for every trial with the same `training.seed`); the best config is written for all the data."""


class TuneConfig(_Section):
    """`trainpipe tune CONFIG`: a hyperparameter search over this config (trainpipe/tune/)."""

    space: dict[str, Any] = Field(default_factory=dict)
    """Dotted config key -> distribution: `{log_uniform: [lo, hi]}`, `{uniform: [lo, hi]}`, `{int: [lo, hi]}` (`step`, `log` optional), `{choice: [a, b]}`; `when: {key: value}` samples it only under that condition."""
    objective: TuneObjective = Field(default_factory=TuneObjective)
    """What a trial is scored by and in which direction."""
    n_trials: int | None = Field(default=20, ge=1)
    """Finished (complete or pruned) trials of the study, over all workers."""
    timeout_hours: float | None = Field(default=None, gt=0)
    """Stop starting trials after this long (this worker)."""
    budget_usd: float | None = Field(default=None, gt=0)
    """Stop when the next trial would exceed this spend, each trial priced by the planner on `tune.gpu`."""
    gpu: str | None = None
    """The GPU type trials are priced on (default: this machine's GPU)."""
    max_memory_gib: float | None = Field(default=None, gt=0)
    """Memory a trial may plan to use per device (default: the GPU's memory less headroom, or the CPU share of the RAM); trials whose plan needs more are never started."""
    sampler: Literal["tpe", "gp", "cmaes", "random", "grid", "qmc"] = "tpe"
    """Optuna sampler."""
    pruner: Literal["median", "asha", "hyperband", "none"] = "median"
    """Early stopping of bad trials on the intermediate eval loss."""
    fidelity: TuneFidelity = Field(default_factory=TuneFidelity)
    """How cheap each trial is: a number of steps, or a share of the data."""
    storage: str | None = None
    """Optuna storage URL: default SQLite in the study folder; `postgresql://...` shares one study between workers on several machines; `memory`: in this process only (nothing kept)."""
    study_name: str | None = None
    """Default: the run name."""
    seed: int | None = Field(default=42, ge=0, le=2**31)
    """Sampler seed (each worker adds its own offset)."""
    max_retries: int = Field(default=1, ge=0)
    """A trial whose worker died (no heartbeat) is failed and retried this many times."""
    heartbeat_seconds: int = Field(default=10, ge=1)
    """Workers beat this often; a trial silent for 3x this is failed (its worker died)."""
    export_best: bool = True
    """Copy the best trial's exported model to `OUTPUT/best/model`."""
