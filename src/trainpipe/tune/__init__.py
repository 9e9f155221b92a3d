"""Search and sizing: `trainpipe tune` (Optuna study over `tune.space`), `lr-find`, `batch-find`, `automl`."""
