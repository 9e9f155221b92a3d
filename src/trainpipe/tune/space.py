"""The search space of `tune.space`: dotted config keys -> distributions, checked against RunConfig before any trial.

    training.learning_rate: {log_uniform: [1e-5, 1e-3]}
    training.weight_decay:  {uniform: [0.0, 0.1]}
    training.warmup_steps:  {int: [0, 20], step: 5}
    method.peft:            {choice: [lora, none]}
    method.lora.r:          {choice: [8, 16, 32], when: {method.peft: lora}}   # conditional: sampled only under lora

Parameters are sampled in the order written; a `when` condition reads the values sampled before it, else the base
config's value. Every bound and choice is validated as a value of its key (so `learning_rate: {uniform: [0, 1e-3]}`
fails before a trial, naming `training.learning_rate`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from trainpipe.config import RunConfig, _model_in, build_config
from trainpipe.errors import ConfigError

KINDS = ("log_uniform", "uniform", "int", "choice")


@dataclass(frozen=True)
class Param:
    key: str
    kind: str
    low: Any = None
    high: Any = None
    choices: tuple = ()
    step: Any = None
    log: bool = False
    when: dict = field(default_factory=dict)

    def distribution(self):
        import optuna.distributions as d

        if self.kind == "choice":
            return d.CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return d.IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return d.FloatDistribution(float(self.low), float(self.high), log=self.kind == "log_uniform", step=self.step)

    def grid_values(self, points: int = 4) -> list:
        """The values a grid search tries: the choices, every int in range (by step), or `points` floats (log-spaced for log_uniform)."""
        import math

        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        if self.kind == "log_uniform":
            a, b = math.log(self.low), math.log(self.high)
            return [float(math.exp(a + (b - a) * i / (points - 1))) for i in range(points)]
        return [float(self.low + (self.high - self.low) * i / (points - 1)) for i in range(points)]


def _err(key: str, what: str) -> ConfigError:
    return ConfigError(f"`tune.space.{key}`: {what}", [f"tune.space.{key}: {what}"])


def parse_space(space: dict, base: dict) -> list[Param]:
    """Validate ``space`` against ``base`` (the run's config mapping) and return its parameters in order."""

    if not isinstance(space, dict) or not space:
        raise ConfigError("`tune.space` is empty: give at least one key to search, e.g. `tune: {space: {training.learning_rate: {log_uniform: [1e-5, 1e-3]}}}`.")
    params: list[Param] = []
    for key, spec in space.items():
        if not isinstance(spec, dict):
            raise _err(key, f"must be a mapping with one of {', '.join(KINDS)} (e.g. `{{choice: [8, 16]}}`), got {spec!r}.")
        kinds = [k for k in spec if k in KINDS]
        extra = [k for k in spec if k not in KINDS + ("step", "log", "when")]
        if len(kinds) != 1 or extra:
            raise _err(key, f"must name exactly one distribution of {', '.join(KINDS)} (plus optional `step`, `log`, `when`), got keys {list(spec)}.")
        kind = kinds[0]
        val = spec[kind]
        when = spec.get("when") or {}
        if not isinstance(when, dict):
            raise _err(key, f"`when` must map earlier keys to values, e.g. `when: {{method.peft: lora}}`, got {when!r}.")
        for wk in when:
            if wk not in space and _lookup(base, wk) is _MISSING and not _known_key(wk):
                raise _err(key, f"`when` reads `{wk}`, which is neither a searched key nor set in the config.")
        if kind == "choice":
            if not isinstance(val, list) or not val:
                raise _err(key, f"`choice` needs a non-empty list of values, e.g. `{{choice: [8, 16, 32]}}`, got {val!r}.")
            p = Param(key, kind, choices=tuple(val), when=when)
            probe = list(val)
        else:
            if not (isinstance(val, list) and len(val) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in val)):
                raise _err(key, f"`{kind}` needs [low, high] numbers, e.g. `{{{kind}: [1e-5, 1e-3]}}`, got {val!r}.")
            lo, hi = val
            if not lo < hi:
                raise _err(key, f"the range [{lo}, {hi}] is empty: low must be below high (a fixed value belongs in the config, not the space).")
            if kind == "int" and not (float(lo).is_integer() and float(hi).is_integer()):
                raise _err(key, f"`int` bounds must be whole numbers, got [{lo}, {hi}]; use `uniform` for floats.")
            log = bool(spec.get("log", False)) or kind == "log_uniform"
            if log and lo <= 0:
                raise _err(key, f"a log scale needs a low bound above 0, got {lo}; e.g. `{{log_uniform: [1e-6, {hi}]}}`.")
            step = spec.get("step")
            if step is not None and (not isinstance(step, (int, float)) or step <= 0 or (kind == "log_uniform")):
                raise _err(key, f"`step` must be a positive number on a linear scale, got {step!r}.")
            p = Param(key, kind, low=int(lo) if kind == "int" else float(lo), high=int(hi) if kind == "int" else float(hi), step=step,
                      log=log if kind == "int" else kind == "log_uniform", when=when)
            probe = [p.low, p.high]
        if _lookup(base, key) is _MISSING and not _known_key(key):
            raise _err(key, f"`{key}` is not a config key. {_suggest(key)}")
        for v in probe:  # every bound and choice must be a valid value of the key
            try:
                build_config(set_key(base, key, v), source=f"`tune.space.{key}` = {v!r}")
            except ConfigError as exc:
                raise _err(key, f"the value {v!r} is not valid for `{key}`: {'; '.join(exc.problems) or exc.message}. Narrow the range to valid values.") from None
        params.append(p)
    return params


_MISSING = object()


def _lookup(d: dict, key: str):
    node: Any = d
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def _known_key(key: str) -> bool:
    """Is ``key`` a field path of RunConfig (down through nested sections)?"""

    model: Any = RunConfig
    for part in key.split("."):
        if model is None or not hasattr(model, "model_fields") or part not in model.model_fields:
            return False
        model = _model_in(model.model_fields[part].annotation)
    return True


def _suggest(key: str) -> str:
    import difflib

    model: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = list(getattr(model, "model_fields", {}) or [])
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1, cutoff=0.5)
            where = ".".join(parts[:i]) or "the config"
            if close:
                return f"Did you mean `{'.'.join(parts[:i] + [close[0]])}`?"
            return f"Keys of {where}: {', '.join(fields)}." if fields else ""
        model = _model_in(model.model_fields[part].annotation)
    return ""


def set_key(base: dict, key: str, value: Any) -> dict:
    out = copy.deepcopy(base)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


def active(p: Param, values: dict, base: dict) -> bool:
    """Does ``p``'s `when` hold, given the values sampled so far (else the base config's)?"""
    for k, want in p.when.items():
        have = values[k] if k in values else _lookup(base, k)
        if isinstance(want, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def sample(trial, params: list[Param], base: dict) -> dict:
    """Sample the active parameters on an Optuna trial: {key: value}."""
    values: dict = {}
    for p in params:
        if not active(p, values, base):
            continue
        if p.kind == "choice":
            values[p.key] = trial.suggest_categorical(p.key, list(p.choices))
        elif p.kind == "int":
            values[p.key] = trial.suggest_int(p.key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            values[p.key] = trial.suggest_float(p.key, p.low, p.high, log=p.kind == "log_uniform", step=p.step)
    return values


def apply(base: dict, values: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in values.items():
        out = set_key(out, k, v)
    return out


def grid(params: list[Param]) -> dict:
    """The search space GridSampler takes: every parameter's grid values (conditionals are sampled like the others)."""
    return {p.key: p.grid_values() for p in params}
