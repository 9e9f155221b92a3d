"""The base of every config section: unknown keys refused, field docstrings kept as the documentation."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # `name`: what reaches a shell (launch.py) stays a plain word

SECTIONS = ("model", "data", "method", "training", "eval", "output_dir", "name", "stages", "tracking", "pipeline")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False)  # `.inf`/`.nan` are no setting
