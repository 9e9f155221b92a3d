"""One way to describe a run: the what-if plan (`trainpipe plan --model`) is a RunConfig plus `WhatIf`, the inputs a run
config has no key for. No second description of a run (the old 35-field `PlanRequest`) may come back in src/, and no
WhatIf field may stand for a key of the sections the planner reads."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from pydantic import BaseModel

from trainpipe.config import RunConfig
from trainpipe.plan.request import WhatIf, whatif_config
from trainpipe.plan.whatif import make_plan

SRC = Path(__file__).resolve().parents[3] / "src" / "trainpipe"
PLANNED_SECTIONS = ("model", "data", "method", "training", "distributed")


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        out.add(prefix + name)
        args = [f.annotation, *typing.get_args(f.annotation)]
        args += [a for x in typing.get_args(f.annotation) for a in typing.get_args(x)]
        for t in args:
            if isinstance(t, type) and issubclass(t, BaseModel):
                out |= _keys(t, f"{prefix}{name}.")
    return out


def test_no_class_named_plan_request_in_src():
    found = [f"{p.relative_to(SRC)}:{n.lineno}" for p in SRC.rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef) and n.name == "PlanRequest"]
    assert found == []


def test_whatif_fields_are_disjoint_from_run_config_keys():
    keys = _keys(RunConfig)
    fields = {f.name for f in dataclasses.fields(WhatIf)}
    top = {k for k in keys if "." not in k}
    planned = {k.rsplit(".", 1)[-1] for k in keys if k.split(".", 1)[0] in PLANNED_SECTIONS and "." in k}
    assert {"model", "data", "method", "training", "distributed"} <= top and "max_length" in planned  # the walk reaches the keys
    assert fields & (top | planned) == set()


def test_the_plan_reads_the_method_from_the_run_config():
    """The run config decides the method (no copy of it beside the config): `method.peft: none` is planned as a full fine-tune."""
    full = make_plan(whatif_config("Qwen/Qwen2.5-0.5B", ["method.peft=none"]), WhatIf(gpu="A100-80GB"))
    lora = make_plan(whatif_config("Qwen/Qwen2.5-0.5B", ["method.peft=lora"]), WhatIf(gpu="A100-80GB"))
    assert (full["recommendation"]["method"], lora["recommendation"]["method"]) == ("full", "lora")
    assert full["model"]["trainable_params"] > 10 * lora["model"]["trainable_params"]
