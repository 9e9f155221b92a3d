"""User-facing errors.

Every error a user can cause (bad config, bad data, a missing model folder) is a
:class:`TrainpipeError`: one paragraph that states the rule, the value received and
the fix. The CLI prints it without a traceback and exits with ``exit_code``.
"""

from __future__ import annotations


class TrainpipeError(Exception):
    """An error caused by input the user controls; printed without a traceback."""

    exit_code = 2
    title = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(TrainpipeError):
    """The run configuration is invalid; ``problems`` lists every problem found."""

    title = "invalid config"

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class DataError(TrainpipeError):
    """A data file is missing or holds a record that cannot be used."""

    title = "invalid data"


class ModelLoadError(TrainpipeError):
    """The base model or its tokenizer cannot be loaded or used as configured."""

    title = "cannot load model"


class RunDirError(TrainpipeError):
    """The output directory cannot be used for this run."""

    title = "output directory"
