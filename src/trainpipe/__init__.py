"""trainpipe: plan, prepare, train, evaluate and export a model from one config."""

__version__ = "0.1.0"

from trainpipe import _quiet  # noqa: E402  (two third-party lines that say nothing to a user, filtered precisely)

_quiet.install()
