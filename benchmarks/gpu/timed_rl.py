"""`trainpipe run CONFIG` with every generation call of the RL objective timed: the GPU check's rollout share.

    python benchmarks/gpu/timed_rl.py RUN_CONFIG.yaml TIMING.json

Wraps `PolicyGradient.sample` (train/rl_policy.py: the only place the policy generates under `method.rl.rollout: generate`) with a clock, synchronising the GPU
before and after, and writes one row per call ({start, seconds, sampling}); `sampling` is true for the training-time
rollouts (evaluation generates greedily). Nothing else of the run changes.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from trainpipe.cli import main as trainpipe
    from trainpipe.train import rl

    cfg_path, out = (argv if argv is not None else sys.argv[1:])[:2]
    calls: list[dict] = []
    original = rl.PolicyGradient.sample

    @functools.wraps(original)
    def timed(self, model, p_ids, p_mask, *, do_sample: bool, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.time()
        try:
            return original(self, model, p_ids, p_mask, do_sample=do_sample, **kw)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            calls.append({"start": t, "seconds": time.time() - t, "sampling": bool(do_sample)})

    rl.PolicyGradient.sample = timed
    try:
        rc = trainpipe(["run", cfg_path, "--overwrite"])
    finally:
        rl.PolicyGradient.sample = original
        Path(out).write_text(json.dumps(calls) + "\n", encoding="utf-8")
    return rc


if __name__ == "__main__":
    sys.exit(main())
