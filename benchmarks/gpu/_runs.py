"""Running one trainpipe run (`trainpipe run CONFIG`), one plain TRL SFTTrainer run, or a timed GRPO run, and reading
what each measured. On a GPU each run is its own process (a clean CUDA peak per run, a timeout that can kill a hung
run); in `--cpu-smoke` they run in this process (one import of torch instead of one per run).

Throughput is read the same way for both trainers: tokens (non-pad, as each counts them) between the log record after
the warm-up steps and the last step's, over the wall time between them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


class RunFailed(RuntimeError):
    """A run that exited non-zero, timed out or wrote no summary; the message says why (the log's tail)."""


def _env() -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])})
    return env


def _tail(path: Path, n: int = 1200) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


def call(argv: list[str], log: Path, timeout: float, isolate: bool, inprocess) -> None:
    """Run ``argv`` (a Python script and its arguments) as a process, or ``inprocess()`` here; RunFailed with the log's
    tail when it fails or runs past ``timeout``."""
    if timeout < 3:
        raise RunFailed("skipped: the check's time budget is spent")
    if not isolate:
        try:
            rc = inprocess()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON, the check goes on
            raise RunFailed(f"{type(exc).__name__}: {str(exc)[:600]}") from exc
        if rc not in (0, None):
            raise RunFailed(f"exit status {rc}")
        return
    with open(log, "w", encoding="utf-8") as fh:
        # its own process group: on a timeout the run and whatever it started (a vLLM engine's workers) are killed together
        proc = subprocess.Popen([sys.executable, *argv], stdout=fh, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            _kill_group(proc)
            raise RunFailed(f"timed out after {timeout:.0f} s (the check's time guard); log tail: {_tail(log, 600)}") from exc
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    if rc != 0:
        raise RunFailed(f"exit status {rc}; log tail: {_tail(log)}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (a trainpipe run checkpoints and stops on it), SIGKILL 10 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- trainpipe
def trainpipe_run(cfg: dict, work: Path, name: str, timeout: float, isolate: bool, warmup: int) -> dict:
    """`trainpipe run` on ``cfg`` through instrumented.py (rollout clocks, input-token counter); returns its figures. The
    run folder keeps only its small files afterwards (checkpoints and the exported model of a 1B full fine-tune are
    ~10 GB each)."""
    cfg = dict(cfg)
    run_dir = work / "runs" / name
    cfg["output_dir"] = str(run_dir)
    path, side = work / f"{name}.yaml", work / f"{name}.side.json"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    argv = [str(HERE / "instrumented.py"), str(path), str(side)]

    def here():
        import instrumented

        return instrumented.main(argv[1:])

    t = time.time()
    try:
        call(argv, work / f"{name}.log", timeout, isolate, here)
    finally:
        for sub in ("checkpoints", "model"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    return read_run(run_dir, warmup, side) | {"wall_s": round(time.time() - t, 1)}


def throughput(records: list[dict], warmup: int, tokens_key: str, extra: list[dict] | None = None) -> dict:
    """Tokens/s between the record of step ``warmup`` and the last step's (one record per step, each with `time` after
    its step): ``tokens_key`` counted by the records themselves, and the input tokens of ``extra`` (rows written at each
    step's start, with `time`) between the two records."""
    recs = [r for r in records if isinstance(r.get(tokens_key), (int, float)) and "step" in r]
    if not recs:
        return {"tokens_per_s": None, "why": "no per-step records"}
    start = next((r for r in recs if r["step"] >= warmup), recs[0]) if len(recs) > 1 else None
    last = recs[-1]
    if start is None or last["step"] <= start["step"] or last["time"] <= start["time"]:
        return {"tokens_per_s": None, "why": f"too few steps after the {warmup} warm-up steps"}
    dt, n = last["time"] - start["time"], last["step"] - start["step"]
    out = {"timed_steps": n, "timed_seconds": round(dt, 3), "step_seconds": round(dt / n, 4)}
    tok = last[tokens_key] - start[tokens_key]
    if extra is None:  # the records count input tokens themselves (TRL's counter)
        return {"tokens_per_s": round(tok / dt, 1), "tokens": tok} | out | _loss_tokens(records, start, last, dt)
    inside = [e for e in extra if start["time"] < e["time"] <= last["time"]]
    if len(inside) != n:
        return {"tokens_per_s": None, "loss_tokens_per_s": round(tok / dt, 1), "why": f"{len(inside)} token counts for {n} timed steps"} | out
    inp = sum(e["input_tokens"] for e in inside)
    return {"tokens_per_s": round(inp / dt, 1), "tokens": inp, "loss_tokens_per_s": round(tok / dt, 1)} | out


def _loss_tokens(records: list[dict], start: dict, last: dict, dt: float) -> dict:
    if "loss_tokens" not in last or "loss_tokens" not in start:
        return {}
    return {"loss_tokens_per_s": round((last["loss_tokens"] - start["loss_tokens"]) / dt, 1)}


def _side(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_run(run_dir: Path, warmup: int, side: Path | None = None) -> dict:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RunFailed(f"{run_dir.name}: no summary.json (the run did not finish)")
    summary = json.loads(summary_path.read_text())
    metrics = _lines(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "tokens_seen" in m]
    mm = json.loads((run_dir / "measured_memory.json").read_text()) if (run_dir / "measured_memory.json").exists() else {}
    counted = _side(side).get("steps") if side else None
    out = throughput(steps, warmup, "tokens_seen", counted or None) if counted else throughput(steps, warmup, "tokens_seen") | {
        "tokens_note": "no input-token counts (not an SFT objective): tokens are the objective's own count"}
    out.update({
        "run_dir": str(run_dir), "parameters": summary.get("parameters"), "final_loss": (steps[-1]["loss"] if steps else None),
        "cuda_max_memory_allocated": mm.get("cuda_max_memory_allocated"), "cuda_max_memory_reserved": mm.get("cuda_max_memory_reserved"),
        "plan": summary.get("plan") or {}, "gates": summary.get("gates") or {}, "gpu_util_samples": [m["gpu_util"] for m in metrics if "gpu_util" in m],
        "events": [e for e in _lines(run_dir / "events.jsonl") if e.get("event") not in ("checkpoint_saved", "eval_done")],
        "model_dtype": next((d.get("value") for d in (summary.get("plan") or {}).get("decisions", []) if d.get("key") == "model.dtype"), None),
    })
    return out


# --------------------------------------------------------------------------- plain TRL
def trl_run(cfg_path: Path, out_json: Path, timeout: float, isolate: bool, work: Path, warmup: int) -> dict:
    argv = [str(HERE / "trl_sft.py"), str(cfg_path), str(out_json), str(warmup)]

    def here():
        import trl_sft

        return trl_sft.main(argv[1:])

    t = time.time()
    call(argv, work / "trl.log", timeout, isolate, here)
    res = json.loads(out_json.read_text())
    return res | {"wall_s": round(time.time() - t, 1)}


# --------------------------------------------------------------------------- GRPO with the rollout timed
def grpo_run(cfg: dict, work: Path, name: str, timeout: float, isolate: bool, warmup: int) -> dict:
    """A GRPO run with its rollouts timed (instrumented.py). Rollout share = time generating inside the timed training
    steps / their wall time."""
    res = trainpipe_run(cfg, work, name, timeout, isolate, warmup)
    return res | rollout_share(_side(work / f"{name}.side.json").get("rollouts", []), work / "runs" / name, warmup)


def rollout_share(calls: list[dict], run_dir: Path, warmup: int) -> dict:
    steps = [m for m in _lines(run_dir / "metrics.jsonl") if "tokens_seen" in m]
    if len(steps) < 2:
        return {"rollout_share": None, "why": "fewer than two logged steps"}
    start = next((r for r in steps if r["step"] >= warmup), steps[0])
    if start is steps[-1]:
        start = steps[-2]
    t0, t1 = start["time"], steps[-1]["time"]
    inside = [c for c in calls if t0 < c["start"] < t1 and c.get("sampling", True)]
    gen = sum(c["seconds"] for c in inside)
    return {"rollout_share": round(gen / max(t1 - t0, 1e-9), 4), "generation_seconds": round(gen, 3), "step_seconds": round((t1 - t0) / max(1, steps[-1]["step"] - start["step"]), 4),
            "timed_steps": steps[-1]["step"] - start["step"], "generate_calls": len(inside), "paths": sorted({c.get("path", "?") for c in inside})}
