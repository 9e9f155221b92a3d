"""`tune:` (the hyperparameter search over a config) and `automl:` (the search over base models and hyperparameters)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

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
    max_params: float | None = Field(default=None, gt=0)
    """Largest model a trial may build, in parameters (e.g. 5e4): a trial whose model (its `model.args`: the tabular MLP or `model.factory`'s module built on the CPU; a text model as the planner sizes it) has more is never started, pruned with its count."""
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


class AutomlConfig(_Section):
    """`trainpipe automl CONFIG`: task + data + constraints -> candidate models -> arms -> budgeted successive halving -> the
    winner (trainpipe/tune/automl.py). Only this section of CONFIG is read; `--set automl.KEY=VALUE` changes any key."""

    task: Literal["sft", "classification", "preference", "tabular", "image-classification", "text-classification", "custom"] = "sft"
    """What the candidates are trained for: sft (objective: eval loss), classification (accuracy), preference (preference accuracy); `tabular`: CONFIG is a run config of the tabular family (`model.family: tabular`, `data.label` or `data.target`, a `data.test_split`), searched by AutoGluon beside trainpipe's own tabular model and the trivial predictor; `image-classification`, `text-classification`, `custom`: CONFIG is a run config of that family (an image classifier, `method.name: classification` on text, `model.factory`), its `automl.candidates` and `automl.space` searched by successive halving (tune/automl_family.py)."""
    candidates: list[str] = Field(default_factory=list)
    """image-classification / text-classification: the backbones to choose from (transformers ids or local folders with config.json; `timm/NAME` for images through timm); default: CONFIG's `model.name_or_path` alone; a comma-separated string is split."""
    space: dict[str, Any] | None = None
    """image-classification / text-classification / custom: the search space of each candidate's arms, in `tune.space`'s form (e.g. `model.args.hidden_size: {choice: [16, 32]}`, `training.learning_rate: {log_uniform: [1e-4, 1e-2]}`); default: CONFIG's learning rate / and x `lr_spread`."""
    max_step_ms: float | None = Field(default=None, gt=0)
    """image-classification / text-classification / custom: an arm whose measured training step (one micro-batch forward and backward on this machine, before it trains) takes longer is not trained."""
    time_limit: float | None = Field(default=None, gt=0)
    """tabular: AutoGluon's fit budget in seconds (default: `budget_hours` x 3600, else 120)."""
    presets: str = "auto"
    """tabular: AutoGluon's presets; `auto`: `medium_quality` under 1 h of `time_limit`, `good_quality` up to 4 h, `best_quality` above (bagging and stacking pay off only with time to fit several folds of every model)."""
    memory_gib: float | None = Field(default=None, gt=0)
    """tabular: the memory AutoGluon may use, in GiB (its `memory_limit`: it skips or stops a model expected to exceed it); default: the memory this machine has free. image-classification / text-classification / custom: an arm whose traced training step needs more is not trained (default: the GPU less the planner's headroom, or the CPU share of the RAM)."""
    python: str | None = None
    """tabular: the Python interpreter that has AutoGluon (its own environment: AutoGluon pins pandas below 2.4, trainpipe pandas 3); default `$TRAINPIPE_AUTOML_PYTHON`, else the one `scripts/automl_venv.sh` makes (`~/.cache/trainpipe/automl-venv/bin/python`)."""
    data: str | None = None
    """Training data (JSONL); the eval split is cut from it once, the same for every candidate. Required."""
    models: list[str] = Field(default_factory=list)
    """Candidate base models: local folders, hub ids, or `ID=PATH` (a catalogue id trained from a local folder); a comma-separated string is split."""
    catalog: bool = False
    """Also every catalogue model of the task's kind within the constraints (listed with the reason when not trained)."""
    models_dir: str | None = None
    """Local weights for catalogue ids: subfolders named `org--name` or `org/name`."""
    output_dir: str = "runs/automl"
    """Output folder (runs, leaderboard.csv, automl.json, winner/); relative to the working directory."""
    gpu: str | None = None
    """GPU type that picks the methods and prices the rungs (default: this machine's)."""
    gpus: int = Field(default=1, ge=1)
    """GPUs of type `gpu` per arm (the method and the price)."""
    max_params: float | None = Field(default=None, gt=0)
    """Largest base model, in parameters (e.g. 8e9); image-classification / text-classification / custom: each arm's model as built (its new head included), counted before it trains."""
    budget_usd: float | None = Field(default=None, gt=0)
    """Stop before a rung the planner prices above what is left (needs a GPU to price on: `gpu`)."""
    budget_hours: float | None = Field(default=None, gt=0)
    """Start no rung after this much wall time."""
    arms_per_model: int = Field(default=2, ge=1)
    """Hyperparameter sets per candidate, sampled by Optuna TPE."""
    lr_spread: float = Field(default=3.0, gt=1)
    """Learning rates from the planner's default / spread to x spread (log-uniform)."""
    lr_range: str | None = None
    """`LOW:HIGH` learning rates to sample from instead of the planner's default / and x `lr_spread`."""
    seed: int = Field(default=0, ge=0, le=2**31)
    """Seed of the hyperparameter sampler."""
    proposer: str = "builtin"
    """`module:function` or `file.py:function` (runs Python code you name) proposing changes to surviving arms before each rung; `builtin` (sft): an arm whose eval loss moved < 1 % over the rung gets an LR range test on 1 % of the data and, if its suggestion is > 3x away, a new arm at it; `none`: no proposals."""
    min_steps: int = Field(default=4, ge=1)
    """Optimizer steps of the first rung; rung k trains `min_steps` x `eta`^k."""
    rungs: int = Field(default=3, ge=1)
    """Rungs of successive halving."""
    eta: int = Field(default=2, ge=2)
    """Keep 1/eta of the candidates per rung; survivors train eta x longer."""
    eval_split: int = Field(default=32, ge=1)
    """Held-out records (fixed for the search)."""
    max_length: int = Field(default=128, ge=1)
    """Longest example in tokens."""
    batch_size: int = Field(default=8, ge=1)
    """Effective batch per optimizer step; the micro-batch and accumulation for it are the planner's on `gpu`."""

    @field_validator("models", "candidates", mode="before")
    @classmethod
    def _split_models(cls, v):
        return [m.strip() for m in v.split(",") if m.strip()] if isinstance(v, str) else v
