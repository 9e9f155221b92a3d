"""`pipeline.steps:`: steps of one's own in the pipeline DAG, beside the built-in ones (pipeline/custom.py runs them).

    pipeline:
      builtin: false            # only these steps (the built-in prepare -> ... -> report chain left out)
      steps:
        - name: featurize
          function: steps.py:featurize                  # called as featurize(inputs=..., outputs=..., params=...)
          inputs: {raw: {path: data/raw.parquet}}
          outputs: {features: folder}
          params: {test_size: 0.25}
        - name: train
          command: python train.py --data {inputs.features} --out {outputs.model} --epochs {params.epochs}
          inputs: {features: {from: featurize.features}}
          outputs: {model: folder}
          params: {epochs: 20}
          resources: {cpu: 2, memory: 4Gi, gpus: 0}
          retries: 1
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from trainpipe.config.base import _Section

STEP_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
OUTPUT_TYPES = ("file", "folder")


class StepInput(_Section):
    """One declared input: a file or folder outside the DAG (`path`), or another step's output (`from: step.output`)."""

    model_config = ConfigDict(**_Section.model_config, populate_by_name=True)  # a dumped config (`from_`) reads back

    path: str | None = None
    """A file or folder (relative to the config file's folder); its content is part of the step's cache key."""
    from_: str | None = Field(default=None, alias="from")
    """`step.output`: an output of another step of the DAG (a step of yours, or a built-in one: `export.model`, `train.run`)."""
    type: Literal["file", "folder", "any"] = "any"
    """What the step expects; checked against the producing step's declared output type, or the path as it is."""

    @model_validator(mode="after")
    def _one_source(self) -> "StepInput":
        if (self.path is None) == (self.from_ is None):
            raise ValueError("an input is either `path: FILE_OR_FOLDER` or `from: step.output`, exactly one of them")
        if self.from_ is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+\.[A-Za-z0-9_-]+", self.from_):
            raise ValueError(f"`from: {self.from_}` names an output as `step.output` (e.g. `featurize.features`)")
        return self


class StepResources(_Section):
    """What the step's container asks for (Kubeflow, Airflow's KubernetesPodOperator, Vertex); a local run does not limit it."""

    cpu: float = Field(default=1, gt=0)
    """CPU cores (Kubernetes `cpu`)."""
    memory: str = Field(default="2Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")
    """Memory as Kubernetes writes it (`512Mi`, `4Gi`)."""
    gpus: int = Field(default=0, ge=0)
    """GPUs (`nvidia.com/gpu`); 0: a CPU step."""


class CustomStepConfig(_Section):
    """A step of one's own: a Python function or a command, its typed inputs and outputs, parameters, resources and retries."""

    name: str
    """The step's id in the DAG (lower-case letters, digits, `_`, `-`); not a built-in step's name when the built-in chain runs."""
    function: str | None = None
    """`file.py:function` (relative to the config file's folder), called as `function(inputs=..., outputs=..., params=...)`
    with paths as `pathlib.Path`; its source (and the helpers of its file it calls) is part of the cache key."""
    command: str | None = None
    """A command line with `{inputs.NAME}`, `{outputs.NAME}` and `{params.NAME}` placeholders, run as an argv list (no
    shell) in the config file's folder; the script it runs (its first `.py` argument) is part of the cache key."""
    inputs: dict[str, StepInput] = Field(default_factory=dict)
    """Input name -> `{path: FILE_OR_FOLDER}` or `{from: step.output}` (`{inputs.NAME}` in a command); their content is part of the cache key."""
    outputs: dict[str, Literal["file", "folder"]] = Field(default_factory=dict)
    """Output name -> `file` or `folder`. The step writes each into the path it is given, and nowhere else."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Parameters (JSON values); part of the cache key."""
    code: list[str] = Field(default_factory=list)
    """Further files or folders the step's code reads (modules it imports), relative to the config file; part of the cache key."""
    resources: StepResources = Field(default_factory=StepResources)
    """What the step's container asks for on an orchestrator (CPU, memory, GPUs)."""
    retries: int = Field(default=0, ge=0, le=10)
    """How many times a failed run of the step is tried again (here and on an orchestrator)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the step's process."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not STEP_NAME.fullmatch(v):
            raise ValueError("a step name is 1-63 lower-case letters, digits, `_` or `-`, starting with a letter (it becomes a task id and a folder name)")
        return v

    @model_validator(mode="after")
    def _function_or_command(self) -> "CustomStepConfig":
        if (self.function is None) == (self.command is None):
            raise ValueError(f"step `{self.name}` is either `function: file.py:function` or `command: ...`, exactly one of them")
        if self.function is not None and not re.fullmatch(r"[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*", self.function):
            raise ValueError(f"step `{self.name}`: `function: {self.function}` is written `file.py:function_name`")
        if not self.outputs:
            raise ValueError(f"step `{self.name}` declares no `outputs:`; a step's outputs are what the cache keeps and later steps read")
        return self
