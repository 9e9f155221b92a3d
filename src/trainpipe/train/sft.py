"""Supervised fine-tuning: loss only on the tokens the data step labelled (responses and their
end-of-turn token), run by trainpipe's resilient loop (train/loop.py): evaluation every
`eval_steps`, atomic checksummed checkpoints, the best by eval loss kept and loaded at the
end, early stopping with patience, resume to the bit, OOM and divergence recovery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from trainpipe.config import TrainingConfig
from trainpipe.events import EventLog
from trainpipe.train.checkpoints import CheckpointInfo
from trainpipe.train.loop import FitResult, TrainLoop
from trainpipe.train.progress import TrainProgress


def build_loop(model, tokenizer, train_data, t: TrainingConfig, *, run_dir: Path, events: EventLog, config_yaml: str, evaluate: Callable[[object], float]) -> TrainLoop:
    return TrainLoop(
        model=model, train_data=train_data, pad_id=tokenizer.pad_token_id, t=t, checkpoint_dir=run_dir / "checkpoints", run_dir=run_dir,
        events=events, config_yaml=config_yaml, evaluate=evaluate, metrics_path=run_dir / "metrics.jsonl", progress=TrainProgress(),
    )


def train(loop: TrainLoop, resume_from: CheckpointInfo | None = None) -> FitResult:
    """Fit, then load the best checkpoint's weights (by eval loss) into the model."""
    result = loop.fit(resume_from)
    loop.load_best_weights()
    return result
