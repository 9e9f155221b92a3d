"""Which model family a config trains, by explicit rules on the config alone (no file read, no user code imported).

A model family is the set of parts that differ between a text LM, a table and your own module: the data format and its
reader, the model build, the objective, the task metrics with their trivial predictor, and the export with its predict
loader (docs/architecture.md, "Model families: where a new one plugs in"). This module only names the family; the parts
live beside the layers that own them and `trainpipe.train.family` maps a name to them.
"""

from __future__ import annotations

from trainpipe.config.method import ModelConfig, MethodConfig

FAMILIES = ("text", "tabular", "custom", "image")
NON_TEXT = ("tabular", "custom", "image")


def resolve_family(model: ModelConfig, data=None) -> tuple[str, str]:
    """(family, the rule that chose it) for `model.family` (`auto` decided from `model.factory`, `data.label`/`target` and
    `model.name_or_path`)."""
    if model.family != "auto":
        return model.family, "model.family as set"
    if model.factory is not None:
        return "custom", "model.factory is set: your own nn.Module"
    labelled = data is not None and (data.label is not None or data.target is not None)
    if labelled and model.name_or_path is None:
        col = f"data.label `{data.label}`" if data.label is not None else f"data.target `{data.target}`"
        return "tabular", f"{col} and no model.name_or_path: trainpipe's MLP on the table's columns"
    return "text", "no model.factory and no data.label/target: a language model from model.name_or_path"


def resolve_task(method: MethodConfig, data=None) -> tuple[str, str]:
    """(classification | regression, the rule) for the non-text families."""
    if method.task != "auto":
        return method.task, "method.task as set"
    if data is not None and data.target is not None:
        return "regression", f"data.target `{data.target}` is a number to predict"
    if data is not None and data.label is not None:
        return "classification", f"data.label `{data.label}` names classes"
    if method.loss == "mse":
        return "regression", "method.loss: mse"
    return "classification", "no data.target and method.loss is not mse"
