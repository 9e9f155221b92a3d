"""Below the resolver, train/ and data/ read the resolved specs (`plan.specs`), never the user's `training:` section.

Structural (an ast pass over src/trainpipe/train and src/trainpipe/data): no module there names `TrainingConfig`, reads a
`training:` field that can be `auto` or unset (`learning_rate`, `per_device_train_batch_size`, `gradient_accumulation_steps`,
`gradient_checkpointing`, `bf16`, `tf32`, `save_steps`, ...) through `<config>.training`, hands the `training` section on
whole, or reads an attribute only a TrainingConfig has (`per_device_train_batch_size`, `gradient_accumulation_steps`: the
specs call them `micro_batch` and `grad_accum`). Behavioural: a config full of `auto` resolves to specs without one, and
the recipe's builders turn those specs into the optimizer and window plan the loop runs.
"""

import ast
import typing
from pathlib import Path

import pytest

from trainpipe.config import TrainingConfig, build_config
from trainpipe.plan import resolve
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.specs import RunSpecs, unresolved

SRC = Path(__file__).resolve().parents[2] / "src" / "trainpipe"
BELOW = [p for d in ("train", "data") for p in sorted((SRC / d).rglob("*.py"))]
SPEC_FIELDS = {f for cls in typing.get_type_hints(RunSpecs).values() for f in cls.__dataclass_fields__}


def _can_be_unresolved(annotation) -> bool:
    """A field whose type admits `auto` or None: what the resolver decides."""
    args = typing.get_args(annotation)
    if not args:
        return annotation is type(None)
    return any(a is type(None) or a == "auto" or _can_be_unresolved(a) for a in args)


HINTS = typing.get_type_hints(TrainingConfig, include_extras=True)
AUTO_FIELDS = {name for name, hint in HINTS.items() if name in TrainingConfig.model_fields and _can_be_unresolved(hint)}
SPEC_NAMES = SPEC_FIELDS | {n for cls in typing.get_type_hints(RunSpecs).values() for n in dir(cls) if not n.startswith("_")}
CONFIG_ONLY = AUTO_FIELDS - SPEC_NAMES  # an unresolved field whose name no spec has: any read of it is a config read


def _is_config(node: ast.AST) -> bool:
    """`cfg`, `ctx.cfg`, `self.cfg`, `run_config`...: an expression that is a RunConfig by name."""
    return (isinstance(node, ast.Name) and node.id in ("cfg", "config", "run_config")) or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def _findings(source: str, rel: str) -> list[str]:
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Name) and node.id == "TrainingConfig" or isinstance(node, ast.alias) and node.name == "TrainingConfig":
            out.append(f"{where}: names TrainingConfig")
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in CONFIG_ONLY and isinstance(node.ctx, ast.Load):
            out.append(f"{where}: reads `.{node.attr}`, a field only the user's config has")
        if node.attr == "training" and _is_config(node.value):
            up = parents.get(node)
            if not isinstance(up, ast.Attribute):
                out.append(f"{where}: hands the `training` section on whole")
            elif up.attr in AUTO_FIELDS or up.attr not in TrainingConfig.model_fields:
                out.append(f"{where}: reads `training.{up.attr}` from the config")
    return out


def test_the_walks_fields_are_among_those_checked():
    assert {"learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16", "tf32",
            "save_steps", "greater_is_better"} <= AUTO_FIELDS
    assert {"per_device_train_batch_size", "gradient_accumulation_steps"} <= CONFIG_ONLY and "learning_rate" not in CONFIG_ONLY


def test_the_check_finds_a_config_read():
    src = ("from trainpipe.config import TrainingConfig\n"
           "def f(cfg, ctx, model, specs):\n    a = cfg.training.learning_rate\n    b = ctx.cfg.training\n"
           "    c = t.per_device_train_batch_size\n    d = cfg.training.gradient_accumulation_steps\n"
           "    return model.training, cfg.training.per_device_eval_batch_size, specs.optimizer.learning_rate, specs.batch.micro_batch\n")
    found = _findings(src, "probe.py")
    assert sorted(f.split(":")[1] for f in found) == ["1", "3", "4", "5", "6", "6"], found  # the last line reads nothing unresolved


def test_train_and_data_read_specs_not_the_training_config():
    assert len(BELOW) > 20
    found = [f for p in BELOW for f in _findings(p.read_text(encoding="utf-8"), str(p.relative_to(SRC)))]
    assert not found, "\n".join(found)


CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
A100 = Hardware("cuda", 1, ("NVIDIA A100",), True, 8, "")
AUTO = {"model": {"name_or_path": "meta-llama/Llama-3.2-1B"}, "data": {"sources": [{"path": "t.jsonl"}]}, "method": {"name": "sft", "peft": "lora"},
        "training": {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto", "max_steps": 3}}


@pytest.mark.parametrize("hw", [CPU, A100], ids=["cpu", "a100"])
def test_no_auto_reaches_the_builders(hw, tmp_path):
    """A config of `auto`/unset values resolves to specs without one, and the recipe's builders take exactly those values."""
    import torch

    from trainpipe.train.optim import build_optimizer
    from trainpipe.train.window import WindowPlan

    specs = resolve(build_config(AUTO), hw, sizing=False).specs
    assert unresolved(specs) == []
    flat = {f"{k}.{n}": v for k, d in specs.to_dict().items() for n, v in d.items()}
    assert "auto" not in flat.values()
    assert all(v is not None for k, v in flat.items() if k.split(".")[1] not in
               {n for s in typing.get_type_hints(RunSpecs).values() for n in s.UNSET_MEANS})
    b, o = specs.batch, specs.optimizer
    assert isinstance(b.micro_batch, int) and isinstance(b.grad_accum, int) and isinstance(o.learning_rate, float)
    assert b.micro_batch * b.grad_accum * b.dp_degree == b.effective_batch
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(list(model.named_parameters()), o, "cpu")
    assert [g["lr"] for g in opt.param_groups] == [o.learning_rate] * len(opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [o.weight_decay, 0.0]  # the matrix decays, the bias does not
    plan = WindowPlan.of(b, examples=1000, dp=1)
    assert plan.effective == b.effective_batch and plan.total_windows == 3
    assert o.warmup_for(plan.total_windows) == 1  # ceil(warmup_ratio 0.03 x 3 steps): what build_scheduler warms up for
