"""`trainpipe run CONFIG` with a clock on RL rollouts and a counter of input tokens: what the GPU check reads beside the
run's own metrics.

    python benchmarks/gpu/instrumented.py RUN_CONFIG.yaml SIDE.json

- Rollouts: wraps what generates a window's completions in trainpipe's RL objective, with a clock (the GPU synchronised
  before and after): `generate_rollout` (`method.rl.rollout: generate`, train/rollout.py, as train/rl_policy.py calls
  it) and `VLLMRollout.__call__` (`rollout: vllm`: weight sync, wake, generate, sleep: all of a colocated rollout's
  cost). One row per call ({start, seconds, path}); the caller keeps the calls inside the timed training steps
  (evaluation's sampling happens outside them). On an older trainpipe without those, the policy's `sample` is timed.
- Tokens: trainpipe's SFT objective counts the tokens that carry loss (`tokens_seen`); MFU and the comparison with TRL
  need the input tokens too. `TokenCrossEntropy.tokens` (called once per optimizer step with that step's rows) is
  wrapped to also record each step's input tokens (unpadded row lengths) and loss tokens; what it returns is unchanged.

Nothing else of the run changes. SIDE.json: {"rollouts": [...], "steps": [{"time", "input_tokens", "loss_tokens"}, ...]}
(a step's row is written when the step starts; the caller sums the rows between two of the run's step records).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path


def _clocked(fn, calls: list[dict], path: str):
    import torch

    @functools.wraps(fn)
    def timed(*a, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.time()
        try:
            return fn(*a, **kw)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            calls.append({"start": t, "seconds": time.time() - t, "path": path})

    return timed


def _counted(fn, steps: list[dict]):
    @functools.wraps(fn)
    def tokens(self, examples):
        n = fn(self, examples)
        steps.append({"time": time.time(), "input_tokens": sum(len(ex["input_ids"]) for ex in examples), "loss_tokens": int(n)})
        return n

    return tokens


def patch(calls: list[dict], steps: list[dict]) -> list[tuple[object, str, object]]:
    """Install the clocks and the counter; returns (owner, attribute, original) to put back."""
    import importlib

    done = []
    objectives = importlib.import_module("trainpipe.train.objectives")
    if hasattr(objectives, "TokenCrossEntropy"):
        cls = objectives.TokenCrossEntropy
        done.append((cls, "tokens", cls.tokens))
        cls.tokens = _counted(cls.tokens, steps)
    try:
        policy = importlib.import_module("trainpipe.train.rl_policy")
        rollout = importlib.import_module("trainpipe.train.rollout")
    except ImportError:
        policy = rollout = None
    if policy is not None and hasattr(policy, "generate_rollout"):
        done.append((policy, "generate_rollout", policy.generate_rollout))
        policy.generate_rollout = _clocked(policy.generate_rollout, calls, "generate")
        if hasattr(rollout, "VLLMRollout"):
            cls = rollout.VLLMRollout
            done.append((cls, "__call__", cls.__call__))
            cls.__call__ = _clocked(cls.__call__, calls, "vllm")
        return done
    rl = importlib.import_module("trainpipe.train.rl")  # an older layout: the objective's own sample()
    done.append((rl.PolicyGradient, "sample", rl.PolicyGradient.sample))
    rl.PolicyGradient.sample = _clocked(rl.PolicyGradient.sample, calls, "sample")
    return done


def main(argv: list[str] | None = None) -> int:
    from trainpipe.cli import main as trainpipe

    cfg_path, out = (argv if argv is not None else sys.argv[1:])[:2]
    calls: list[dict] = []
    steps: list[dict] = []
    undo = patch(calls, steps)
    try:
        rc = trainpipe(["run", cfg_path, "--overwrite"])
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
        Path(out).write_text(json.dumps({"rollouts": calls, "steps": steps}) + "\n", encoding="utf-8")
    return rc


if __name__ == "__main__":
    sys.exit(main())
