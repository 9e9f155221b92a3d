"""`eval.benchmarks`: lm-evaluation-harness tasks on the base model and on the trained one.

The harness scores the in-memory model (`HFLM` wrapped around the very model and tokenizer the run trains;
nothing is reloaded). Local tasks are YAML files (with their JSON/JSONL data beside them) under a task's
`include_path`; a relative `dataset_kwargs.data_files` entry is read relative to its YAML file, so a task folder
works from any working directory. Named harness tasks (hellaswag, arc_easy, ...) need the hub to be reachable.
When the tokenizer has a chat template the prompts are rendered with it, as training saw them.

Results: ``{task: {"metric": name, "value": x, "metrics": {...}, "samples": n}}``; the recipe stores baseline and
final side by side in summary.json (`benchmarks`).
"""

from __future__ import annotations

from pathlib import Path

from trainpipe.errors import TrainpipeError


class BenchmarkError(TrainpipeError):
    title = "benchmark"


def _local_task_config(task: str, include_path: str) -> dict | None:
    """The YAML config defining ``task`` in ``include_path``, with relative data files resolved against the YAML."""
    from lm_eval.tasks._yaml_loader import load_yaml

    root = Path(include_path)
    if not root.is_dir():
        raise BenchmarkError(f"`eval.benchmarks[].include_path` `{root}` is not a folder. Point it at the folder holding the task's YAML file and data.")
    for path in sorted(root.rglob("*.yaml")):
        try:
            cfg = dict(load_yaml(path, resolve_func=True))
        except Exception:  # noqa: BLE001 - not a task file (the harness skips these too)
            continue
        if cfg.get("task") != task:
            continue
        kw = dict(cfg.get("dataset_kwargs") or {})
        files = kw.get("data_files")
        if isinstance(files, dict):
            kw["data_files"] = {k: str((path.parent / v).resolve()) if not Path(v).is_absolute() else v for k, v in files.items()}
        elif isinstance(files, str) and not Path(files).is_absolute():
            kw["data_files"] = str((path.parent / files).resolve())
        if kw:
            cfg["dataset_kwargs"] = kw
        return cfg
    return None


def run_benchmarks(model, tokenizer, specs, *, batch_size: int = 8, phase: str = "") -> dict:
    """Run every task of ``specs`` (BenchmarkConfig list) on ``model``; returns {task: result}."""
    if not specs:
        return {}
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise BenchmarkError("`eval.benchmarks` needs lm-evaluation-harness: `pip install 'trainpipe[eval]'`.") from None
    import logging

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    was_training = model.training
    model.eval()
    device = str(next(model.parameters()).device)
    side = tokenizer.padding_side
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, trust_remote_code=False)
    out: dict = {}
    try:
        for spec in specs:
            includes = [spec.include_path] if spec.include_path else None
            task: str | dict = spec.task
            if spec.include_path:
                local = _local_task_config(spec.task, spec.include_path)
                if local is None:
                    raise BenchmarkError(f"No task `{spec.task}` in `{spec.include_path}` (`eval.benchmarks`): no YAML there has `task: {spec.task}`. Fix the name or the folder.")
                task = local
            tm = TaskManager(include_path=includes, include_defaults=not includes)  # a local task: no scan of the harness's thousands of YAMLs
            try:
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], num_fewshot=spec.num_fewshot, limit=spec.limit, task_manager=tm, log_samples=False,
                    apply_chat_template=bool(getattr(tokenizer, "chat_template", None)), bootstrap_iters=0, random_seed=0,
                    numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, verbosity="ERROR",
                )
            except TrainpipeError:
                raise
            except Exception as exc:  # noqa: BLE001 - the harness's own errors (unknown task offline, bad YAML) become one paragraph
                raise BenchmarkError(f"lm-evaluation-harness could not run task `{spec.task}`: {type(exc).__name__}: {exc}. "
                                     "Check the task name (hub tasks need the network) or its YAML under `include_path`.") from None
            figures = (res or {}).get("results", {}).get(spec.task, {})
            metrics = {k.split(",")[0]: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"}
            metric = spec.metric or ("acc" if "acc" in metrics else next(iter(metrics), None))
            if metric not in metrics:
                raise BenchmarkError(f"Task `{spec.task}` reported no `{metric}` (it reported: {', '.join(metrics) or 'nothing'}). Set `eval.benchmarks[].metric` to one of these.")
            n = (res.get("n-samples") or {}).get(spec.task, {})
            out[spec.task] = {"metric": metric, "value": metrics[metric], "metrics": metrics, "samples": n.get("effective", n.get("original"))}
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def pairs(baseline: dict, final: dict) -> dict:
    """{task: {"metric", "baseline", "final", "change"}} for summary.json."""
    out = {}
    for task, f in final.items():
        b = baseline.get(task, {})
        out[task] = {"metric": f["metric"], "baseline": b.get("value"), "final": f["value"], "change": f["value"] - b["value"] if "value" in b else None,
                     "samples": f.get("samples")}
    return out
