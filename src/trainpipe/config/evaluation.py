"""`eval:` and `gates:`: what is measured before, during and after training, and the quality gates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, model_validator

from trainpipe.config.base import _Section


class ForgettingSetConfig(_Section):
    """A forgetting set: general-domain text or another task the model must not lose (evaluate/forgetting.py)."""

    path: str
    """A JSONL file (any data format: text, alpaca, chat); relative paths are relative to the config file."""
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    """Name in events, the summary and the report (default: the file's stem)."""
    format: Literal["auto", "alpaca", "chat", "sharegpt", "text"] = "auto"
    """Record format, as `data.sources[].format`."""
    max_samples: int | None = Field(default=500, ge=1)
    """Use at most the first this many records (a few hundred keep each in-training eval cheap)."""


class BenchmarkConfig(_Section):
    """An lm-evaluation-harness task run on the base model and on the trained one (evaluate/benchmarks.py)."""

    task: str
    """Task name: a local task defined by a YAML under `include_path`, or a harness task (needs the hub online)."""
    include_path: str | None = None
    """Folder of task YAML files (and their data) for local tasks; relative to the config file."""
    num_fewshot: int | None = Field(default=None, ge=0)
    """Few-shot examples (the task's own default when null)."""
    limit: int | None = Field(default=None, ge=1)
    """Score at most this many documents (all when null)."""
    metric: str | None = None
    """The figure compared between base and trained (default: `acc`, else the task's first metric)."""

    _allow_code: bool = PrivateAttr(default=False)  # `eval.allow_task_code`, handed over by EvalConfig (evaluate/benchmarks.py reads it)


class EvalConfig(_Section):
    metrics: list[Literal["loss", "perplexity", "exact_match", "accuracy", "rouge_l", "bleu"]] = Field(default_factory=lambda: ["loss", "perplexity"])
    """Metrics measured on the eval split before and after training. `exact_match` generates greedily and compares with the reference response; `accuracy` compares the normalised answer (case, punctuation, surrounding space ignored: classification-style labels); `rouge_l` (rouge-score) and `bleu` (sacrebleu, 0-100) score free text."""
    test_split: bool = True
    """Measure the held-out test split (`data.test_split`, or sources with `role: test`) once at the end on the chosen checkpoint; it is never used for selection."""
    forgetting: list[ForgettingSetConfig] = Field(default_factory=list)
    """Forgetting sets, each measured (loss, perplexity) at baseline, at every in-training eval and at the end."""
    forgetting_threshold: float = Field(default=0.05, gt=0, lt=10)
    """A forgetting set whose loss rises by more than this share of its baseline (relative; 0.05 = 5 %) emits `forgetting_detected`."""
    benchmarks: list[BenchmarkConfig] = Field(default_factory=list)
    """lm-evaluation-harness tasks run on the base model and on the trained one (baseline/final pairs in summary.json)."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Longest generation for generated metrics (`exact_match`)."""
    max_samples: int | None = Field(default=None, ge=1)
    """Evaluate generated metrics on at most this many eval records (all when null)."""
    allow_task_code: bool = False
    """Let the local lm-eval tasks of `benchmarks` run their `!function` code: this runs Python from the task folder (`include_path`), with your permissions. Off: a task file that names a `!function` is refused before anything runs, and task templates render in Jinja's sandbox."""
    generate_in_training: bool = False
    """sft/pretrain: measure the generated metrics of `metrics` (`exact_match`, `accuracy`, `rouge_l`, `bleu`) at every in-training eval too, not only before and after training (each eval then generates `max_samples` replies: slower). `trainpipe tune` needs it to prune on a generated metric."""

    @model_validator(mode="after")
    def _hand_code_permission(self) -> "EvalConfig":
        for b in self.benchmarks:
            b._allow_code = self.allow_task_code
        return self


class GateConfig(_Section):
    """One quality gate: on or off, and its threshold (evaluate/gates.py)."""

    enabled: bool = True
    """Check this gate at the end of the run."""
    threshold: float | None = None
    """The gate's threshold (each gate's default when null; see `gates`)."""


class GatesConfig(_Section):
    """Quality gates checked at the end of a run, each passing, failing or not applicable with its evidence (evaluate/gates.py)."""

    on_fail: Literal["warn", "fail"] = "warn"
    """`warn`: a failed gate emits `gate_failed` and the run ends normally; `fail`: the run ends with exit code 6 after everything is written, and the exported model is marked as not passing."""
    val_loss_decreasing: GateConfig = Field(default_factory=GateConfig)
    """No rise of the eval loss over the last `window` evals after the first (warmup) one; `threshold`: tolerated relative rise per eval (default 0.0)."""
    window: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """How many of the last evals `val_loss_decreasing` looks at; `auto`: half of the in-training evals after the warmup one (3 at least), so the window grows with the run."""
    beats_baseline: GateConfig = Field(default_factory=GateConfig)
    """The final primary metric (eval loss) beats the baseline by at least `threshold` (relative, default 0.01)."""
    beats_trivial: GateConfig = Field(default_factory=GateConfig)
    """The final eval loss is below both trivial language models' (uniform over the vocabulary, the training tokens' unigram frequencies), or a classifier's accuracy above the majority class's; `threshold`: relative margin (default 0.0). A collapsed model fails it."""
    no_forgetting: GateConfig = Field(default_factory=GateConfig)
    """No forgetting set's final loss is more than `eval.forgetting_threshold` above its baseline."""
    dedup_ran: GateConfig = Field(default_factory=GateConfig)
    """Exact or near deduplication ran in the data step."""
    samples_reviewed: GateConfig = Field(default_factory=lambda: GateConfig(enabled=False))
    """A person recorded with `trainpipe data review RUN_DIR` that they saw the formatted samples (`threshold`: how many, default 50). Off unless asked (`gates.samples_reviewed: {enabled: true}`, or any setting of it): then it passes or fails; off it reads n/a with a hint."""
    effective_batch: GateConfig = Field(default_factory=GateConfig)
    """Effective batch (micro-batch x accumulation x world size) at least `threshold` (default 32)."""
    best_checkpoint_by_val_loss: GateConfig = Field(default_factory=GateConfig)
    """The exported model is the checkpoint with the lowest eval loss."""
    gpu_utilization: GateConfig = Field(default_factory=GateConfig)
    """On a GPU: mean utilisation during training at least `threshold` percent (default 85); not applicable on the CPU."""
