"""RunConfig: the whole file, with `tracking:`, `pipeline:` and `stages:`."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainpipe.config.base import RUN_NAME, _Section
from trainpipe.config.data import DataConfig
from trainpipe.config.evaluation import EvalConfig, GatesConfig
from trainpipe.config.family import resolve_family
from trainpipe.config.method import MethodConfig, ModelConfig
from trainpipe.config.steps import CustomStepConfig
from trainpipe.config.training import DistributedConfig, TrainingConfig
from trainpipe.config.tune import AutomlConfig, TuneConfig


class TrackingConfig(_Section):
    """Experiment tracking (issue 13): the resolved config as params, every metric as it is written, events as tags, artefacts, the model registered."""

    backend: Literal["auto", "mlflow", "wandb", "tensorboard", "none"] = "auto"
    """`auto`: `$TRAINPIPE_TRACKING` when set, else `mlflow` (a local store in the run's parent folder, no server needed). W&B and TensorBoard go through their own libraries."""
    uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `sqlite:///path.db`; default `$MLFLOW_TRACKING_URI`, else `sqlite:///<parent of output_dir>/mlflow.db`); W&B base URL; TensorBoard log folder (default `<output_dir>/tensorboard`)."""
    experiment: str | None = None
    """MLflow experiment / W&B project (default: the run name)."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """W&B: `offline` writes the run under `<output_dir>/wandb` for `trainpipe track sync`; `auto` is online only when `WANDB_API_KEY` is set."""
    register_model: bool = True
    """Register the exported model in the MLflow model registry with its lineage as tags."""
    model_name: str | None = None
    """Registered model name (default: the run name)."""


class PipelineConfig(_Section):
    """`trainpipe pipeline run`: the step DAG prepare -> train -> evaluate -> export -> register -> report with a content-addressed cache."""

    store: str | None = None
    """Artefact store: a folder or any fsspec URL (`file:///...`, `s3://bucket/prefix`, `memory://x`); default `<parent of output_dir>/.trainpipe-store`
    for `trainpipe pipeline run`, `output_dir/.trainpipe-store` for `trainpipe run` of `stages:` / `method.adapters`."""
    cache: bool = True
    """Reuse a step whose key (its inputs' content, its config section, its code) was built before; `--no-cache` re-runs every step."""
    image: str = "trainpipe:latest"
    """Container image of every step in `trainpipe pipeline compile` (Kubeflow), pinned with the trainpipe version."""
    steps: list[CustomStepConfig] = Field(default_factory=list)
    """Steps of your own (a Python function or a command) beside the built-in ones: config/steps.py, pipeline/custom.py."""
    builtin: bool = True
    """Run the built-in chain (prepare -> train -> evaluate -> export -> register -> report); `false`: only `steps:`."""
    data_from: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_-]*\.[A-Za-z0-9_-]+$")
    """`step.output` of `steps:` (a folder): the built-in chain's `data.sources` are read inside it (each `path` relative to the
    config file becomes the same path inside the folder the step wrote), e.g. `featurize.features`."""
    automl: bool = False
    """Add the `automl` step: `trainpipe automl --task tabular` of the config's `automl:` section (AutoGluon beside trainpipe's model), cached by content like any other step (pipeline/automl_step.py)."""
    schedule: str | None = None
    """Five-field cron expression of the compiled pipeline's schedule (Airflow, Prefect, Vertex); none: run on demand."""


class StageConfig(_Section):
    """One stage of a multi-stage run: its method and, optionally, its own data and training settings."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    """Stage name (its run directory under `output_dir`: a plain folder name, no `/`, `\\` or leading `.`); default: the method name."""
    method: dict[str, Any] = Field(default_factory=dict)
    """Keys of `method` for this stage, over the run's `method` (e.g. `{name: reward}`)."""
    data: DataConfig | None = None
    """This stage's data (default: the run's `data`)."""
    training: dict[str, Any] = Field(default_factory=dict)
    """Keys of `training` for this stage, over the run's `training`."""
    eval: dict[str, Any] = Field(default_factory=dict)
    """Keys of `eval` for this stage, over the run's `eval`."""

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, v: str | None) -> str | None:
        if v is not None and ".." in v:
            raise ValueError(f"a stage name is a folder under `output_dir`; `..` would lead outside it (got {v!r})")
        return v


class RunConfig(_Section):
    """One training run: what to train, on what, how, and where to write it."""

    name: str | None = None
    """Run name (default: the config file's name): 1-128 letters, digits, `.`, `_` or `-`, starting with a letter or digit (it names the run folder, the tracking run and the cluster job, and reaches the launch scripts)."""
    model: ModelConfig
    """The base model."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """What is trained and how (objective, PEFT)."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation settings; names as in transformers `TrainingArguments`."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation before and after training."""
    gates: GatesConfig = Field(default_factory=GatesConfig)
    """Quality gates checked at the end of the run (`on_fail: warn | fail`)."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Processes, sharding strategy, offload and gradient compression (`strategy: auto` by the planner's rules)."""
    output_dir: str | None = None
    """Run directory (default: `runs/<name>`), relative to the working directory."""
    stages: list[StageConfig] | None = None
    """Several stages in one run, e.g. RLHF `[{method: {name: sft}}, {method: {name: reward}, data: ...}, {method: {name: rl}}]`: each stage's model is the next one's input; one run directory per stage under `output_dir`, one summary. A stage may be written as just its method name (`[sft, reward, rl]`)."""

    data: DataConfig | None = None
    """The training data (required, except when every adapter of `method.adapters` or every stage brings its own)."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking: MLflow (default), W&B, TensorBoard or none (track/tracking.py)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """The step DAG, its cache and artefact store (`trainpipe pipeline ...`, pipeline/dag.py)."""
    tune: TuneConfig | None = None
    """Hyperparameter search for `trainpipe tune` (ignored by `trainpipe run`)."""
    automl: AutomlConfig | None = None
    """Search over base models and hyperparameters for `trainpipe automl` (ignored by `trainpipe run`)."""

    @field_validator("data", mode="after")
    @classmethod
    def _data_given(cls, v: Any, info: Any) -> Any:
        if v is not None:
            return v
        method, stages = info.data.get("method"), info.data.get("stages")
        if method is not None and method.adapters:
            return v
        if stages and all(st.data is not None for st in stages):
            return v
        raise ValueError("required key is missing" + (" (give a `data` for the run or for every stage)" if stages else ""))

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        if v is not None and not RUN_NAME.fullmatch(v):
            raise ValueError(
                "a run name reaches file names and the shell lines of `trainpipe launch`'s scripts, so it is 1-128 letters, digits, "
                "`.`, `_` or `-`, starting with a letter or digit; rename it (e.g. `my-run-1`)"
            )
        return v

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_names(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"method": {"name": x}} if isinstance(x, str) else x for x in v]
        return v

    def first_data(self) -> "DataConfig":
        """The run's data, else the first adapter's or stage's (for sizing a plan)."""
        if self.data is not None:
            return self.data
        if self.method.adapters:
            return self.method.adapters[0].data
        return next(st.data for st in self.stages or [] if st.data is not None)

    @model_validator(mode="after")
    def _model_named(self) -> "RunConfig":
        family, rule = resolve_family(self.model, self.data)
        if family == "text" and self.model.name_or_path is None:
            raise ValueError(
                "`model.name_or_path` is required for a text model (family `text`: " + rule + "); for a table set `data.label` "
                "(classification) or `data.target` (regression), for your own module `model.factory: file.py:function`"
            )
        return self

    def hash(self) -> str:
        """SHA-256 of the canonical JSON of this config (the cache and manifest key)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()
