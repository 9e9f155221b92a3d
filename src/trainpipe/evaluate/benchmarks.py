"""`eval.benchmarks`: lm-evaluation-harness tasks on the base model and on the trained one.

The harness scores the in-memory model (`HFLM` wrapped around the very model and tokenizer the run trains;
nothing is reloaded). Local tasks are YAML files (with their JSON/JSONL data beside them) under a task's
`include_path`; a relative `dataset_kwargs.data_files` entry is read relative to its YAML file, so a task folder
works from any working directory. Named harness tasks (hellaswag, arc_easy, ...) need the hub to be reachable.
When the tokenizer has a chat template the prompts are rendered with it, as training saw them.

No code from a task folder runs unless the config asks for it (issue 22). A local task is loaded from its own file
only: `include_path` itself when it names a YAML file, else `<include_path>/<task>.yaml`, else the one YAML of the
folder whose `task:` is the name (the others are read as plain data, never loaded). That file and its `include:`s are
parsed with a safe YAML loader that records `!function` tags instead of importing them; a task that uses one (Python
beside the YAML: `process_docs`, `process_results`, a metric, a `class`) is refused unless `eval.allow_task_code: true`,
and then only that file's functions are resolved (by lm-eval's own loader). The harness is given the loaded config,
not the folder, so it scans nothing. Without `allow_task_code` the task's Jinja templates (`doc_to_text`, ...) are
rendered in Jinja's sandbox: lm-eval's own environment is not sandboxed, and a template could reach `os.system`.

What the harness prints that says nothing to a trainpipe user is silenced at its source while it runs (see
:func:`_quiet_harness`): its two warnings that a model object was passed (trainpipe does so on purpose), its tqdm bars
when stderr is not a terminal, and git's "fatal: not a git repository" from the version lookup it records in its
results (trainpipe keeps none of that record). Its other warnings and errors still show.

Results: ``{task: {"metric": name, "value": x, "metrics": {...}, "samples": n}}``; the recipe stores baseline and
final side by side in summary.json (`benchmarks`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

from trainpipe.errors import TrainpipeError


class BenchmarkError(TrainpipeError):
    title = "benchmark"


_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}


class _FunctionRef(str):
    """A `!function` reference kept as text (never imported)."""


class _TaskYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader plus lm-eval's `!function` tag, recorded in ``self.functions`` instead of imported."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.functions: list[str] = []


def _function_tag(loader: _TaskYamlLoader, node) -> _FunctionRef:
    ref = _FunctionRef(loader.construct_scalar(node))
    loader.functions.append(str(ref))
    return ref


_TaskYamlLoader.add_constructor("!function", _function_tag)


def _read_task_yaml(path: Path, seen: set[Path] | None = None) -> tuple[dict, list[tuple[Path, str]]]:
    """The task config of ``path`` with its `include:`s merged as lm-eval merges them (included first, local keys win),
    read as data only; and every `!function` it or an included file names, as (file, reference)."""
    path = path.expanduser().resolve()
    seen = set() if seen is None else seen
    if path in seen:
        raise BenchmarkError(f"The task YAML `{path}` includes itself (an `include:` cycle). Fix its `include:` key.")
    seen.add(path)
    try:
        loader = _TaskYamlLoader(path.read_text(encoding="utf-8"))
        try:
            cfg = loader.get_single_data()
        finally:
            loader.dispose()
    except OSError as exc:
        raise BenchmarkError(f"Cannot read the task YAML `{path}` (`eval.benchmarks`): {exc.strerror or exc}. Fix the path in `include_path` or its `include:`.") from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise BenchmarkError(f"The task YAML `{path}` (`eval.benchmarks`) is not readable YAML text ({type(exc).__name__}). Point `include_path` at a task file.") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise BenchmarkError(
            f"The task YAML `{path}`{line} (`eval.benchmarks`) is not plain YAML: {getattr(exc, 'problem', None) or exc}. trainpipe reads task "
            "files with a safe loader that knows only lm-eval's `!function` tag besides standard YAML; remove other tags (`!!python/...`)."
        ) from None
    if not isinstance(cfg, dict):
        raise BenchmarkError(f"The task YAML `{path}` (`eval.benchmarks`) holds {type(cfg).__name__}, not a mapping of task keys. Point `include_path` at a task file.")
    functions = [(path, f) for f in loader.functions]
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg, functions
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_path = Path(inc) if Path(str(inc)).is_absolute() else path.parent / str(inc)
        inc_cfg, inc_funcs = _read_task_yaml(inc_path, seen)
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
        functions += inc_funcs
    merged.update(cfg)
    return merged, functions


def _task_file(task: str, include_path: str) -> tuple[Path, dict, list[tuple[Path, str]]] | None:
    """The one YAML defining ``task`` (see the module docstring), its config read as data and its `!function`s; None when
    no file defines it."""
    root = Path(include_path)
    if root.is_file() and root.suffix in (".yaml", ".yml"):
        cfg, funcs = _read_task_yaml(root)
        return (root.resolve(), cfg, funcs) if cfg.get("task") == task else None
    if not root.is_dir():
        raise BenchmarkError(f"`eval.benchmarks[].include_path` `{root}` is neither a folder nor a task YAML file. Point it at the task's YAML file or the folder holding it and its data.")
    for named in (root / f"{task}.yaml", root / f"{task}.yml"):
        if named.is_file():
            cfg, funcs = _read_task_yaml(named)
            if cfg.get("task") == task:
                return named.resolve(), cfg, funcs
    for path in sorted(root.rglob("*.y*ml"), key=lambda p: p.as_posix()):
        if path.suffix not in (".yaml", ".yml") or any(part in _IGNORE_DIRS for part in path.relative_to(root).parts):
            continue
        try:
            cfg, funcs = _read_task_yaml(path)
        except BenchmarkError:  # not a task file (the harness skips these too)
            continue
        if cfg.get("task") == task:
            return path.resolve(), cfg, funcs
    return None


def _local_task_config(task: str, include_path: str, *, allow_code: bool = False) -> dict | None:
    """The config defining ``task`` from its own YAML under ``include_path`` (relative data files resolved against that
    YAML); a task using `!function` is refused unless ``allow_code`` (`eval.allow_task_code`)."""
    found = _task_file(task, include_path)
    if found is None:
        return None
    path, cfg, functions = found
    if functions:
        refs = ", ".join(f"`!function {f}`" + (f" (in `{p}`)" if p != path else "") for p, f in functions[:3])
        if not allow_code:
            raise BenchmarkError(
                f"The benchmark task `{task}` in `{path}` uses {refs}: Python code from the task folder, which trainpipe does not "
                "run unless the config asks for it. If you wrote or checked that code, set `eval.allow_task_code: true`; otherwise "
                "use a task without `!function` (templates and built-in metrics only)."
            )
        from lm_eval.tasks._yaml_loader import load_yaml

        cfg = dict(load_yaml(path, resolve_func=True))  # asked for: this file's functions (and its includes') only
    kw = dict(cfg.get("dataset_kwargs") or {})
    files = kw.get("data_files")
    if isinstance(files, dict):
        kw["data_files"] = {k: str((path.parent / v).resolve()) if not Path(v).is_absolute() else v for k, v in files.items()}
    elif isinstance(files, str) and not Path(files).is_absolute():
        kw["data_files"] = str((path.parent / files).resolve())
    if kw:
        cfg["dataset_kwargs"] = kw
    return cfg


HARNESS_MODEL_LOGGER = "lm_eval.models.huggingface"
# lm-eval warns these whenever it is handed a model object rather than a name: trainpipe always hands it the model it trains
HARNESS_MODEL_OBJECT_WARNINGS = ("`pretrained` model kwarg is not of type `str`.", "Passed an already-initialized model through `pretrained`")
HARNESS_TQDM_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


class _ModelObjectWarning:
    """Drops lm-eval's two records about receiving a model object (nothing else of its model module)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(HARNESS_MODEL_OBJECT_WARNINGS)


def _git_hash_quietly():
    """lm-eval's ``get_git_commit_hash`` without git's own stderr ("fatal: not a git repository" outside a checkout):
    the same lookup, `git describe --always` in the working directory, then the `.git` folder read directly."""
    import os
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()  # noqa: S607
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def _no_bar(tqdm_cls):
    def tqdm(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm_cls(*args, **kwargs)

    return tqdm


@contextlib.contextmanager
def _quiet_harness():
    """While the harness runs: its git lookup without git's stderr, and no tqdm bars where stderr is not a terminal.
    The module attributes are put back afterwards."""
    import importlib
    import logging
    import sys

    import lm_eval.evaluator as lm_evaluator

    log = logging.getLogger(HARNESS_MODEL_LOGGER)
    if not any(isinstance(f, _ModelObjectWarning) for f in log.filters):
        log.addFilter(_ModelObjectWarning())
    saved = [(lm_evaluator, "get_git_commit_hash", lm_evaluator.get_git_commit_hash)]
    lm_evaluator.get_git_commit_hash = _git_hash_quietly
    try:
        terminal = sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if not terminal:
        for name in HARNESS_TQDM_MODULES:
            mod = importlib.import_module(name)
            if hasattr(mod, "tqdm"):
                saved.append((mod, "tqdm", mod.tqdm))
                mod.tqdm = _no_bar(mod.tqdm)
    try:
        yield
    finally:
        for mod, attr, old in reversed(saved):
            setattr(mod, attr, old)


@contextlib.contextmanager
def _sandboxed_templates(on: bool):
    """lm-eval renders every task template through ``lm_eval.utils.env``, a plain Jinja Environment; while ``on``, it is
    Jinja's SandboxedEnvironment with the same settings (no attribute starting with `_`, no unsafe callables)."""
    if not on:
        yield
        return
    import lm_eval.utils as lm_utils
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    old = lm_utils.env
    sandbox = SandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandbox.filters.update(old.filters)
    lm_utils.env = sandbox
    try:
        yield
    finally:
        lm_utils.env = old


def run_benchmarks(model, tokenizer, specs, *, batch_size: int = 8, phase: str = "", allow_code: bool | None = None) -> dict:
    """Run every task of ``specs`` (BenchmarkConfig list) on ``model``; returns {task: result}.

    ``allow_code``: run the `!function` code of local task files (default: each spec's `eval.allow_task_code`, which the
    config hands to its benchmarks; False for a spec built on its own)."""
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
    tasks: list[tuple[object, str | dict, bool]] = []  # every local task file is read (and refused) before the model is touched
    for spec in specs:
        allowed = bool(getattr(spec, "_allow_code", False)) if allow_code is None else allow_code
        if not spec.include_path:
            tasks.append((spec, spec.task, False))  # a harness task: lm-eval's own installed task files
            continue
        local = _local_task_config(spec.task, spec.include_path, allow_code=allowed)
        if local is None:
            raise BenchmarkError(f"No task `{spec.task}` in `{spec.include_path}` (`eval.benchmarks`): neither `{spec.task}.yaml` nor any YAML there has `task: {spec.task}`. Fix the name or the folder.")
        tasks.append((spec, local, not allowed))
    was_training = model.training
    model.eval()
    device = str(next(model.parameters()).device)
    side = tokenizer.padding_side
    out: dict = {}
    quiet = _quiet_harness()
    quiet.__enter__()
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, trust_remote_code=False)
        for spec, task, sandbox in tasks:
            # a local task is handed over loaded: the harness indexes no folder (include_path=None), nor its own thousands of YAMLs
            tm = TaskManager(include_path=None, include_defaults=isinstance(task, str))
            try:
                with _sandboxed_templates(sandbox):
                    res = lm_eval.simple_evaluate(
                        model=lm, tasks=[task], num_fewshot=spec.num_fewshot, limit=spec.limit, task_manager=tm, log_samples=False,
                        apply_chat_template=bool(getattr(tokenizer, "chat_template", None)), bootstrap_iters=0, random_seed=0,
                        numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, verbosity="ERROR",
                    )
            except TrainpipeError:
                raise
            except Exception as exc:  # noqa: BLE001 - the harness's own errors (unknown task offline, bad YAML) become one paragraph
                from jinja2.exceptions import SecurityError

                if isinstance(exc, SecurityError):
                    raise BenchmarkError(f"A template of the benchmark task `{spec.task}` (`{spec.include_path}`) reaches past its document's fields "
                                         f"({exc}): Jinja's sandbox stopped it. Fix the template, or set `eval.allow_task_code: true` if you trust that folder.") from None
                raise BenchmarkError(f"lm-evaluation-harness could not run task `{spec.task}`: {type(exc).__name__}: {' '.join(str(exc).split())}. "
                                     "Check the task name (hub tasks need the network) or its YAML under `include_path`.") from None
            figures = (res or {}).get("results", {}).get(spec.task, {})
            metrics = {k.split(",")[0]: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len"}
            metric = spec.metric or ("acc" if "acc" in metrics else next(iter(metrics), None))
            if metric not in metrics:
                raise BenchmarkError(f"Task `{spec.task}` reported no `{metric}` (it reported: {', '.join(metrics) or 'nothing'}). Set `eval.benchmarks[].metric` to one of these.")
            n = (res.get("n-samples") or {}).get(spec.task, {})
            out[spec.task] = {"metric": metric, "value": metrics[metric], "metrics": metrics, "samples": n.get("effective", n.get("original"))}
    finally:
        quiet.__exit__(None, None, None)
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
