"""One run: prepare -> baseline eval -> train -> final eval -> export, in one run directory.

`run` trains one config (one method, one model); it never dispatches to the pipeline DAG. `trainpipe run` enters through
`trainpipe.pipeline.run.run`, which sends a `stages:` / `method.adapters` config to the DAG (whose train step calls this
`run` once per stage or adapter) and any other config here. Reads top to bottom. The run directory contract:

    config.resolved.yaml   the config with every default and `auto` filled in
    manifest.json          config hash, data SHA-256s, code version and git state, package versions, seed, hardware
    events.jsonl           one JSON event a line (training_started, eval_done, checkpoint_saved, ...)
    metrics.jsonl          training and eval metrics as logged
    data_report.json       what happened to every input record
    rejected.jsonl         lines dropped under `data.on_error: skip`, with the reason
    checkpoints/           Trainer checkpoints (best by `training.metric_for_best` kept; eval loss by default)
    model/                 the exported best model (only once training finished)
    summary.json           `baseline` and `final` metric dicts, training figures, artefact paths
    .trainpipe-run         the run's identity marker (run id; checkpoints are labelled with it); it proves nothing
    .trainpipe-owned.json  the manifest (ownership.py): what trainpipe wrote here, fingerprinted; only a folder whose every
                           entry it proves is ever cleared (rundir.py)
    .trainpipe.lock        held while the run is running: one run per folder
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from trainpipe import faults, ownership, rundir, ui
from trainpipe.config import RunConfig, dump_yaml, load_yaml_text
from trainpipe.config.family import resolve_family
from trainpipe.data.images import check_image_sources, image_source_sha256
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import check_sources, fingerprint
from trainpipe.data.tokenize import end_of_turn_ids, setup_chat_template
from trainpipe.distributed import env as dist_env
from trainpipe.errors import ConfigError, DataError, RunDirError, TrainpipeError
from trainpipe.evaluate.gates import GatesFailed, apply_gates, write_review_samples
from trainpipe.events import EventLog
from trainpipe.export import stop_token_ids
from trainpipe.model.checkpoints import CheckpointManager
from trainpipe.model.loading import check_model_source, check_peft, load_tokenizer
from trainpipe.plan.hardware import detect
from trainpipe.plan.resolve import plan_run
from trainpipe.plan.run_plan import compare as compare_plan, what_would_fit
from trainpipe.redact import redact_obj
from trainpipe.report.html import write_length_histogram, write_report
from trainpipe.track import tracking
from trainpipe.track.manifest import build_manifest, write_json
from trainpipe.train import classify, preference, pretrain, reward, rl, sft
from trainpipe.train.context import RunContext
from trainpipe.train.family import family
from trainpipe.train.errors import EXIT_PREEMPTED, OutOfMemoryPlan, Preempted, StopTrial


def prepare_run_dir(output_dir: str, overwrite: bool, allow_unfinished: bool = False, protected: list | None = None) -> Path:
    """Lay out a fresh run in ``output_dir`` (the caller holds its lock): an empty folder (or one holding only what
    `trainpipe data prepare` wrote) is used, an earlier run its manifest proves trainpipe's is cleared with `overwrite`
    (or, with `allow_unfinished`, when it never finished), anything else is refused with nothing deleted
    (rundir.py has the rules). The folder gets a new run marker and is sealed (`rundir.begin`)."""
    run_dir = Path(output_dir).resolve()
    kind, _ = rundir.ownership(run_dir)
    if kind in ("ours", "foreign"):
        unfinished = allow_unfinished and not (run_dir / "summary.json").exists() and not (run_dir / "model").exists()
        if kind == "ours" and not (overwrite or unfinished):
            raise RunDirError(
                f"`{run_dir}` already holds files from an earlier run. Pass `--overwrite` to replace them, or choose "
                "another directory with `--set output_dir=runs/NEW_NAME`."
            )
        why = "`--overwrite`" if overwrite else ("a fresh start" if not unfinished else "`--resume` found no checkpoint to continue")
        rundir.clear(run_dir, overwrite=overwrite, protected=protected or [], why=why)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_marker(run_dir)
    rundir.begin(run_dir)
    return run_dir


def inputs(cfg: RunConfig, config_path: str | None) -> list[tuple[Path, str]]:
    """What a run reads and never writes over (`ownership.write_text`'s `reads`): its data, model and reward model. The
    config file is left out: a run started from an earlier run's `config.resolved.yaml` writes that file again."""
    return [(p, what) for p, what in rundir.protected_paths(cfg, config_path) if what != "the config file"]


def damaged_checkpoints(run_dir: Path, skipped: list[str]) -> RunDirError:
    """`training.resume: auto` found checkpoints, every one failing its check: the folder is not cleared (issue 22)."""
    return RunDirError(
        f"`{run_dir / 'checkpoints'}` holds checkpoints of this run, but every one fails its check ({'; '.join(skipped)}), so "
        f"there is nothing to resume from, and trainpipe does not clear the folder to start over: damaged checkpoints are no "
        f"longer what trainpipe wrote, so the folder is not provably its own. Nothing was deleted. Find the cause (a failing "
        f"disk, an incomplete copy), restore the checkpoints from a copy to resume, or start fresh in another folder with "
        f"`--set output_dir=runs/NEW_NAME` (or delete `{run_dir}` by hand first)."
    )


class Interrupted(TrainpipeError):
    exit_code = 130
    title = "interrupted"


class PreemptedExit(TrainpipeError):
    exit_code = EXIT_PREEMPTED
    title = "preempted"


# the recipes with forgetting sets and lm-eval benchmarks (evaluate/suite.py): every recipe whose trained model is a causal LM
MEASURES_FORGETTING = ("sft", "pretrain", "dpo", "orpo", "kto", "rl")


def preflight(cfg: RunConfig) -> None:
    """Fail before anything is written when an input is missing."""
    if resolve_family(cfg.model, cfg.data)[0] == "text":  # the other families build their model (train/family.py)
        check_model_source(cfg.model)
    if resolve_family(cfg.model, cfg.data)[0] == "image":
        check_image_sources(cfg.data.sources)  # image folders, image tables, datasets folders (data/images.py)
    else:
        check_sources(cfg.data.sources)  # files, globs and folders; hub and SQL sources are checked when read
    check_measured(cfg)


def check_measured(cfg: RunConfig, source: str | None = None) -> None:
    """The config-level part of `preflight` (no file, no model): what this run's method cannot measure is refused. A
    `stages:` run calls it for every stage and a `method.adapters` run for every adapter before any trains (pipeline/stages.py
    `check_branch`), ``source`` naming the stage or adapter."""
    asked = [key for key, value in (("eval.forgetting", cfg.eval.forgetting), ("eval.benchmarks", cfg.eval.benchmarks)) if value]
    if asked and cfg.method.name not in MEASURES_FORGETTING:  # not silently skipped: reward and classification models are no LMs
        raise ConfigError(
            (f"{source}: " if source else "")
            + f"`{'` and `'.join(asked)}` measure a causal language model (its loss on text, its answers to benchmark prompts), "
            f"and this run's `method.name` is `{cfg.method.name}`, which trains a scoring head, not a language model; they are "
            f"measured under `{'`, `'.join(MEASURES_FORGETTING)}`. Remove `{'` and `'.join(asked)}` from this config, or measure "
            f"the language model it starts from with `trainpipe eval {cfg.model.name_or_path} --config CONFIG` and an `sft`/`pretrain` "
            f"config that names them.",
            [f"{key}: not measured under method.name {cfg.method.name}" for key in asked],
        )


def run(cfg: RunConfig, *, config_path: str | None = None, overwrite: bool = False, resume: bool = False, lineage: dict | None = None,
        register: bool = True, parent_run: dict | None = None, callbacks: tuple = ()) -> dict:
    """One run of `cfg` into its `output_dir`; returns its summary. ``register``: the tracker registers the model at the end
    (the pipeline's own `register` step does it instead: False there); ``parent_run``: the MLflow run this run is a child of
    (`trainpipe tune`: the study's run, {"run_id", "uri", "tags"}); ``callbacks``: the training loop's, beside every run's
    (train/callbacks.py; `trainpipe tune`: its pruner)."""
    import transformers

    if cfg.stages or cfg.method.adapters or cfg.method.name == "auto":
        raise ConfigError(
            "One run trains one method: a config with `stages:`, `method.adapters` or `method.name: auto` goes through "
            "`trainpipe.pipeline.run.run` (the DAG of its parts, or the objective rule), not `trainpipe.run.run`.",
            ["stages / method.adapters / method.name: auto given to one run"],
        )
    t_start = time.time()
    transformers.utils.logging.disable_progress_bar()  # trainpipe draws its own bars
    # transformers 5 renamed the property; peft and the Trainer still read the old name (noise, not a problem)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    # 1. check the inputs exist, resolve the plan, lay out the run directory (or find the checkpoint to resume)
    preflight(cfg)
    hw = detect()
    plan = plan_run(cfg, hw)  # every `auto` resolved through the planner, with its predictions for this setup
    cfg = plan.config
    if resolve_family(cfg.model, cfg.data)[0] == "text":
        check_peft(cfg.model, cfg.method)  # PEFT errors the config alone can tell (meta-device build), before the data step
    run_dir = Path(cfg.output_dir).resolve()
    protected = rundir.protected_paths(cfg, config_path)
    rundir.check_not_data(run_dir, protected)
    if not dist_env.is_main():  # distributed: rank 0 locks and lays out the run directory, the others follow its resume point
        resume_from, notes = dist_env.follow_rank0()
        return _run_in(cfg, plan, hw, run_dir, config_path, t_start, resume_from, notes, lineage, register=register, parent_run=parent_run,
                       callbacks=callbacks)
    with rundir.RunLock(run_dir):  # one run per folder, from here until the run ends however it ends
        want = resume or cfg.training.resume == "auto"
        kind, _ = rundir.ownership(run_dir)
        if want and not overwrite and kind == "foreign" and not (run_dir / "checkpoints").is_dir():
            rundir.clear(run_dir, overwrite=False, protected=protected, why="`--resume`")  # refuses, naming the unproven entries
        resume_from, notes = find_resume_point(cfg, want, explicit=resume, overwrite=overwrite)
        if resume_from is None and want and not overwrite and notes and (run_dir / "checkpoints").is_dir():
            skipped = [n for n in notes if not n.startswith("changed (safe")]
            if skipped:  # every checkpoint of the run fails its checksum: refused, nothing deleted
                raise damaged_checkpoints(run_dir, skipped)
        if resume_from is None:
            prepare_run_dir(str(run_dir), overwrite, allow_unfinished=want, protected=protected)
        else:
            if rundir.read_marker(run_dir) is None:  # a run of a trainpipe without markers: adopted, its checkpoints accepted
                rundir.write_marker(run_dir, legacy=True)
            rundir.begin(run_dir)  # the resumed run writes on: its artefacts pending until it ends
        dist_env.broadcast_object((resume_from, notes))  # no-op for one process
        return _run_in(cfg, plan, hw, run_dir, config_path, t_start, resume_from, notes, lineage, register=register, parent_run=parent_run,
                       callbacks=callbacks)


def _run_in(cfg: RunConfig, plan, hw, run_dir: Path, config_path: str | None, t_start: float, resume_from, notes: list, lineage: dict | None,
            *, register: bool = True, parent_run: dict | None = None, callbacks: tuple = ()) -> dict:
    main = dist_env.is_main()  # only rank 0 writes into the run directory
    if main:
        ownership.write_text(run_dir / "config.resolved.yaml", dump_yaml(cfg), what="the resolved config", reads=inputs(cfg, config_path))
    events = EventLog(run_dir / "events.jsonl", echo=ui.echo_event) if main else dist_env.NullEventLog()
    events.emit("run_started", run_dir=str(run_dir), config_hash=cfg.hash(), resume_from=str(resume_from.path) if resume_from else None, resume_notes=notes)
    tracker = tracking.start(cfg, run_dir, events, parent=parent_run) if main else None  # MLflow / W&B / TensorBoard (track/tracking.py)
    status = "FAILED"
    try:
        summary = _steps(cfg, plan, hw, run_dir, events, config_path, t_start, resume_from, lineage=lineage, callbacks=callbacks)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:  # Ctrl-C outside training (the loop turns it into a checkpoint and exit 75)
        events.emit("run_failed", level="error", error="KeyboardInterrupt", message="interrupted by Ctrl-C")
        raise Interrupted(
            f"Stopped by Ctrl-C before training finished; `{run_dir}` holds no exported model, and the data cache holds only "
            "complete entries (an interrupted build leaves none). Start over with the same command and `--overwrite` "
            "(the folder is this run's own), or `--resume` to continue from the newest checkpoint when one was saved."
        ) from None
    except Preempted as exc:
        raise PreemptedExit(
            f"Stopped by {exc.signame} at step {exc.step}; the checkpoint {exc.checkpoint} holds the full training state. "
            f"Continue with `trainpipe run CONFIG --resume` (same config, same output_dir)."
        ) from None
    except OutOfMemoryPlan as exc:
        fits = what_would_fit(cfg, hw)  # the planner's nearest setups that fit this GPU
        if fits:
            exc.message += " The planner says these would fit: " + "; ".join(fits) + "."
        events.emit("run_failed", level="error", error=type(exc).__name__, message=exc.message[:500])
        raise
    except StopTrial:  # a search trial pruned at an eval (trainpipe/tune): its hook emitted `trial_pruned`; not a failure
        raise
    except TrainpipeError as exc:
        if exc.exit_code == 6:  # quality gates failed (evaluate/gates.py): the run itself finished, `gate_failed` says why
            raise
        events.emit("run_failed", level="error", error=type(exc).__name__, message=str(getattr(exc, "message", exc))[:500])
        raise
    except BaseException as exc:
        events.emit("run_failed", level="error", error=type(exc).__name__, message=str(getattr(exc, "message", exc))[:500])
        raise
    finally:
        if main:  # report.html after every run, also after a failure (with what exists); then the folder is sealed
            full = _disk_full(sys.exc_info()[1])  # the run ends on a full disk: its paragraph says it, once (cli/main.py)
            _write_report(run_dir, quiet=full)
            _seal(run_dir, quiet=full)
            _print_outcome(run_dir)  # the gates' verdicts and where report.html is, however the run ended (exit 6 included)
        if tracker is not None:
            tracker.finish(status, register=register)


def _print_outcome(run_dir: Path) -> None:
    """The end of the run on the console: one line per failed quality gate with its evidence, how many passed (from
    gates.json), and the path of report.html. Never hides the run's own outcome."""
    try:
        con = ui.console()
        block = tracking.read_gates(run_dir)
        if block is not None:
            results = [r for r in block["results"] if isinstance(r, dict)]
            n = {st: sum(1 for r in results if r.get("status") == st) for st in ("pass", "fail", "n/a")}
            con.print(f"quality gates: {'passed' if block.get('passed') else 'NOT PASSED'} ({n['pass']} passed, {n['fail']} failed, "
                      f"{n['n/a']} not applicable; gates.on_fail: {block.get('on_fail')})", markup=False, highlight=False, soft_wrap=True)
            for r in results:
                if r.get("status") == "fail":
                    con.print(f"  FAILED {r.get('name')}: {r.get('evidence')}", markup=False, highlight=False, soft_wrap=True)
        if (run_dir / "report.html").is_file():
            con.print(f"report: {run_dir / 'report.html'}", markup=False, highlight=False, soft_wrap=True)
    except Exception as exc:  # noqa: BLE001 - a summary that cannot be printed never hides the run's result
        ui.console().print(f"warning: the end-of-run summary could not be printed: {type(exc).__name__}: {exc}", markup=False, soft_wrap=True)


def _disk_full(exc: BaseException | None) -> bool:
    import errno

    return (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or getattr(exc, "exit_code", None) == 74


def _seal(run_dir: Path, quiet: bool = False) -> None:
    """Fingerprint the run's artefacts into its manifest (rundir.py `seal`), however the run ended; a seal that
    fails warns (not when ``quiet``: the run is failing on a full disk and says so) and never hides the run's own
    outcome (the entries stay pending: still provably the run's)."""
    faults.before_seal()  # TEST-ONLY: nothing unless TRAINPIPE_TEST_FAULTS asks for a pause here
    try:
        rundir.seal(run_dir)
    except OSError as exc:
        if quiet and _disk_full(exc):
            return
        ui.console().print(f"warning: {run_dir / rundir.MANIFEST} not updated: {exc}", markup=False, soft_wrap=True)


def _write_report(run_dir: Path, quiet: bool = False) -> None:
    """RUN_DIR/report.html (report/html.py); a report that cannot be drawn warns (not for a full disk when ``quiet``)
    and never hides the run's own outcome."""
    try:
        write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's result (or its error) matters more than its report
        if quiet and _disk_full(exc):
            return
        ui.console().print(f"warning: report.html not written: {type(exc).__name__}: {exc}", markup=False, soft_wrap=True)


# keys that may differ between a checkpoint's config and the resuming one
SAFE_TO_RESUME = (
    "name", "output_dir", "eval.", "training.num_train_epochs", "training.max_steps", "training.logging_steps", "training.eval_steps",
    "training.save_steps", "training.save_total_limit", "training.keep_best", "training.early_stopping_patience", "training.resume",
    "training.on_checkpoint_error", "training.preemption_grace_seconds", "training.hang_timeout_seconds", "training.per_device_eval_batch_size",
    "training.oom_recovery", "training.max_recoveries", "training.loss_spike_factor", "training.loss_spike_min_delta",
    # how many processes and how they talk, not what is trained: the loop keeps the checkpoint's effective batch (train/loop.py)
    "distributed.strategy", "distributed.nproc_per_node", "distributed.nnodes", "distributed.backend", "distributed.timeout_seconds",
    "distributed.nccl_socket_ifname", "distributed.nccl_ib_hca", "distributed.nccl_ib_timeout", "distributed.nccl_ib_retry_cnt",
    "tracking.", "pipeline.", "gates.",  # where the run is tracked and cached, not what is trained (issue 13)
)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(unsafe, safe) dotted keys whose values differ."""
    a, b = _flatten(old), _flatten(new)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    safe = [k for k in changed if any(k == s or (s.endswith(".") and k.startswith(s)) for s in SAFE_TO_RESUME)]
    return [k for k in changed if k not in safe], safe


def find_resume_point(cfg: RunConfig, want: bool, *, explicit: bool, overwrite: bool):
    """The newest valid checkpoint of this run's output_dir to resume from, or None to start fresh."""
    run_dir = Path(cfg.output_dir).resolve()
    if not want or overwrite:
        return None, []
    ckdir = run_dir / "checkpoints"
    if (run_dir / "summary.json").exists():
        raise RunDirError(f"The run in `{run_dir}` already finished (summary.json exists); there is nothing to resume. Pass `--overwrite` to train again from scratch.")
    skipped = []
    info = CheckpointManager(ckdir).latest_valid(on_skip=lambda c, why: skipped.append(f"{c.path.name}: {why}")) if ckdir.is_dir() else None
    for s in skipped:
        ui.console().print(f"[yellow]warning:[/] skipping corrupted checkpoint {s}", markup=True, soft_wrap=True)
    if info is None:
        if explicit:
            raise RunDirError(
                f"`--resume` but `{ckdir}` holds no valid checkpoint{' (' + '; '.join(skipped) + ')' if skipped else ''}. "
                "Run without `--resume` (add `--overwrite` to clear the directory) to start from scratch."
            )
        return None, skipped
    old = load_yaml_text(  # bounded: an alias bomb is refused (issue 22)
        (info.path / "config.resolved.yaml").read_text(), f"`{info.path / 'config.resolved.yaml'}`")
    new = redact_obj(cfg.model_dump(mode="json"))  # the checkpoint's copy is redacted (config.dump_yaml): compare like with like
    unsafe, safe = config_changes(old, new)
    if "training.gradient_accumulation_steps" in unsafe and dist_env.same_effective_batch(info.path, cfg.training):
        unsafe.remove("training.gradient_accumulation_steps")  # another world size, the same effective batch: the loop keeps it
        safe.append("training.gradient_accumulation_steps")
    if unsafe:
        lines = [f"  - `{k}`: {_flatten(old).get(k)!r} -> {_flatten(new).get(k)!r}" for k in unsafe]
        raise ConfigError(
            f"Cannot resume {info.path}: the config changed in keys that change what is trained:\n" + "\n".join(lines)
            + "\nRestore them, or start a new run (another `output_dir`, or `--overwrite`).",
            [f"`{k}` changed" for k in unsafe],
        )
    check_data_unchanged(cfg, run_dir, info.path)
    notes = skipped + [f"changed (safe to resume across): {k}" for k in safe]
    for n in notes:
        ui.console().print(f"  [dim]resume: {n}[/]", markup=True, soft_wrap=True)
    return info, notes


def source_sha256(src) -> str:
    """A data source's SHA-256 as `manifest.json` `data_files` records it (data/prepare.py): the file's own, a digest of
    the files' digests for a glob or folder, a digest of the id / query for hub and SQL sources."""
    fp = fingerprint(src)
    if fp["kind"] == "files":
        files = fp["files"]
        return files[0]["sha256"] if len(files) == 1 else hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()


def check_data_unchanged(cfg: RunConfig, run_dir: Path, checkpoint: Path) -> None:
    """Before resuming: every data source must hash as the run's manifest recorded it, or the resumed run would train on
    other data, compare the old baseline with a new eval split and overwrite the record of what it was trained on."""
    try:
        recorded = json.loads((run_dir / "manifest.json").read_text()).get("data_files") or []
    except (OSError, ValueError):
        return  # stopped before the data step wrote the manifest: nothing was trained on any data yet
    changed = []
    for i, src in enumerate(cfg.data.sources):
        old = recorded[i].get("sha256") if i < len(recorded) and isinstance(recorded[i], dict) else None
        if old is None:
            continue
        new = image_source_sha256(src) if resolve_family(cfg.model, cfg.data)[0] == "image" else source_sha256(src)
        if new != old:
            changed.append(f"  - `data.sources[{i}]` ({recorded[i].get('path')}): sha256 {old} at the start of the run, now {new}")
    if changed:
        raise DataError(
            f"Cannot resume {checkpoint}: the training data changed since the run started, so the rest of the run would train "
            f"on other data and compare the old baseline with a new eval split:\n" + "\n".join(changed)
            + f"\nRestore the data as it was, or start a new run on the new data (another `output_dir`, or `--overwrite`). "
            f"`{run_dir / 'manifest.json'}` is left as it was."
        )


def _steps(cfg: RunConfig, plan, hw, run_dir: Path, events: EventLog, config_path: str | None, t_start: float, resume_from, lineage: dict | None = None,
           callbacks: tuple = ()) -> dict:
    from transformers import set_seed

    con = ui.console()
    con.print(f"[bold]trainpipe run[/] {cfg.name}  ->  {run_dir}")
    for d in plan.decisions:
        con.print(f"  [dim]{d.key} = {d.value}  ({d.rule})[/]")
    set_seed(cfg.training.seed)
    fam = family(resolve_family(cfg.model, cfg.data)[0])  # the model family's parts (train/family.py); text: the rest of this function
    if fam.prepare is not None:
        return _family_steps(fam, cfg, plan, hw, run_dir, events, config_path, t_start, resume_from, lineage, callbacks)

    # 2. tokenizer, chat template, data
    tokenizer = load_tokenizer(cfg.model, cfg.model.pad_token)
    if cfg.method.name == "pretrain" and cfg.method.pretrain.new_tokens:  # vocabulary extension before the data is tokenized (train/pretrain.py resizes the embeddings)
        tokenizer.add_tokens(cfg.method.pretrain.new_tokens)
    template = setup_chat_template(tokenizer, cfg.data.chat_template, cfg.model.name_or_path)
    stop_ids = list(dict.fromkeys(stop_token_ids(tokenizer, template) + end_of_turn_ids(tokenizer)))
    main = dist_env.is_main()
    if not main:
        dist_env.barrier()  # rank 0 builds the data cache first; the other ranks read it
    with ui.progress() as bar:
        task = bar.add_task("tokenize", total=None)
        data = prepare(
            cfg.data, tokenizer, train_on=cfg.method.train_on, seed=cfg.training.seed, rejected_path=run_dir / "rejected.jsonl" if main else None,
            progress=lambda n: bar.advance(task, n), on_total=lambda n: bar.update(task, total=n),
            template_name=template, batch_size_hint=plan.specs.batch.micro_batch, for_method=cfg.method.name,
        )
    if main:
        dist_env.barrier()
    data.report["chat_template"] = template
    if main:
        _write_data_records(cfg, plan, hw, run_dir, data.report, config_path, lineage)
    r = data.report
    events.emit("data_prepared", train=r["train_examples"], eval=r["eval_examples"], rejected=r["rejected_total"], dropped=sum(r["dropped"].values()))
    if main:  # random formatted samples for a person to read (`trainpipe data review RUN_DIR`; the `samples_reviewed` gate)
        write_review_samples(run_dir, data.train, tokenizer, n=int(cfg.gates.samples_reviewed.threshold or 50), seed=cfg.training.seed)
        write_length_histogram(run_dir, data.train)  # lengths.json: the report's length histogram

    # 3. the recipe of `method.name` trains, evaluates, exports and returns the summary
    ctx = RunContext(cfg=cfg, run_dir=run_dir, events=events, tokenizer=tokenizer, template=template, stop_ids=stop_ids, data=data, specs=plan.specs,
                     resume_from=resume_from, hardware=hw, callbacks=tuple(callbacks))
    summary = recipe_for(cfg.method.name).run(ctx)
    return _finish(cfg, plan, run_dir, events, t_start, summary)


def _write_data_records(cfg: RunConfig, plan, hw, run_dir: Path, report: dict, config_path: str | None, lineage: dict | None) -> None:
    """`data_report.json` and `manifest.json` (rank 0), once the data step has run."""
    import torch

    write_json(run_dir / "data_report.json", report)
    write_json(
        run_dir / "manifest.json",
        build_manifest(
            config_hash=cfg.hash(), config_path=config_path, data_files=[{"path": s.get("path") or s.get("source"), "sha256": s.get("sha256")} for s in report["sources"]],
            seed=cfg.training.seed, hardware={**hw.to_dict(), "torch_threads": torch.get_num_threads()}, decisions=[asdict(d) for d in plan.decisions],
        ) | {"plan": plan.to_dict()}  # the resolved plan this run executes: world size, strategy, batch, precision, lr, each with its source
        | ({"lineage": lineage} if lineage else {}),  # a stage of `stages:`: the model it starts from (pipeline/stages.py)
    )


def _family_steps(fam, cfg: RunConfig, plan, hw, run_dir: Path, events: EventLog, config_path: str | None, t_start: float, resume_from,
                  lineage: dict | None, callbacks: tuple) -> dict:
    """A non-text family (train/family.py): its data step (every rank; deterministic), the records, then its recipe."""
    data = fam.prepare(cfg)
    if dist_env.is_main():
        _write_data_records(cfg, plan, hw, run_dir, data.report, config_path, lineage)
    r = data.report
    events.emit("data_prepared", train=r["train_examples"], eval=r["eval_examples"], rejected=r.get("rejected_total", 0), dropped=sum(r.get("dropped", {}).values()))
    ctx = RunContext(cfg=cfg, run_dir=run_dir, events=events, tokenizer=None, template="", stop_ids=[], data=data, specs=plan.specs,
                     resume_from=resume_from, hardware=hw, callbacks=tuple(callbacks))
    return _finish(cfg, plan, run_dir, events, t_start, fam.run(ctx))


def _finish(cfg: RunConfig, plan, run_dir: Path, events: EventLog, t_start: float, summary: dict) -> dict:
    """After the recipe: plan vs measured, the summary, the quality gates (rank 0)."""
    if not dist_env.is_main():  # rank 0 writes the summary
        return summary
    summary["plan"] = compare_plan(plan, run_dir)  # plan vs measured: state bytes, peak memory, throughput
    summary["wall_seconds"] = round(time.time() - t_start, 2)
    write_json(run_dir / "summary.json", summary)
    # quality gates with their evidence (`gate_failed` per failure)
    summary["gates"] = apply_gates(run_dir, cfg.gates, forgetting_threshold=cfg.eval.forgetting_threshold, events=events)
    write_json(run_dir / "summary.json", summary)
    events.emit("run_finished", step=summary.get("train", {}).get("global_step", 0), wall_seconds=summary["wall_seconds"])
    if not summary["gates"]["passed"] and cfg.gates.on_fail == "fail":  # exit 6; report.html is written on the way out (_run_in)
        failed = [g for g in summary["gates"]["results"] if g["status"] == "fail"]
        raise GatesFailed(
            f"The run finished but {len(failed)} quality gate(s) failed (`gates.on_fail: fail`): "
            + "; ".join(f"{g['name']}: {g['evidence']}" for g in failed)
            + f". Everything is written: {run_dir / 'report.html'} shows the evidence, and the exported model is marked as not passing "
            "(model/quality_gates.json). Fix the cause, or set `gates.on_fail: warn` (or turn the gate off) to accept it."
        )
    return summary


# the module that runs each `method.name` (each reads top to bottom: model, trainer, train, evaluate, export)
RECIPES = {"sft": sft, "pretrain": pretrain, "dpo": preference, "orpo": preference, "kto": preference, "reward": reward, "rl": rl,
           "classification": classify}


def recipe_for(method: str):
    """The module that runs `method.name`."""
    return RECIPES[method]
