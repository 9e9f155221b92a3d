"""The plan: every `auto`/unset choice of a RunConfig resolved for a given machine and world size.

One function, `resolve(cfg, hw, world_size)` (plan/resolve.py), serves `trainpipe plan CONFIG` and `trainpipe run`;
one rules table (plan/decisions.py) holds the learning-rate, precision, accumulation and strategy rules. It imports
no torch and touches no weights. The result, `Plan`, is frozen: each setting with its value, source and rule.
"""

from __future__ import annotations

from trainpipe.plan.decisions import Decision, PlanError, default_learning_rate
from trainpipe.plan.resolve import Plan, Setting, resolve

__all__ = ["Decision", "Plan", "PlanError", "Setting", "default_learning_rate", "resolve"]
