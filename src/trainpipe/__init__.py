"""trainpipe: plan, prepare, train, evaluate and export a model from one config."""

__version__ = "0.1.0"
