"""The root folder of a multi-part run (`stages:`, `method.adapters`): laid out before the DAG runs, its sub-run folders
named, sealed however the DAG ends, and its `summary.json` written from the branches' own summaries after it."""

from __future__ import annotations

from pathlib import Path

from trainpipe import ownership, rundir, ui
from trainpipe.config import RunConfig, dump_yaml
from trainpipe.errors import RunDirError
from trainpipe.pipeline.adapters import adapters_summary
from trainpipe.pipeline.stages import stage_names, stages_summary
from trainpipe.run import inputs


def part_names(cfg: RunConfig) -> list[str]:
    """The sub-run folders a multi-part run writes at the top of OUTPUT_DIR: one per stage (adapters live under `adapters/`)."""
    if not cfg.stages:
        return []
    return list(stage_names(cfg))


def prepare_parent_dir(cfg: RunConfig, overwrite: bool, resume: bool, parts: str, config_path: str | None = None) -> Path:
    """The root of a multi-part run (stages, adapters), under its lock: cleared with `overwrite` (when its manifest proves
    it trainpipe's), kept with `resume` (finished parts are reused), refused otherwise; the run's config is written there
    and the root is sealed with its sub-run folders pending (`rundir.begin`)."""
    root = Path(cfg.output_dir or f"runs/{cfg.name or 'run'}").resolve()
    protected = rundir.protected_paths(cfg, config_path)
    kind, _ = rundir.ownership(root)
    if kind in ("ours", "foreign"):
        if overwrite or kind == "foreign":
            rundir.clear(root, overwrite=overwrite, protected=protected, why="`--overwrite`" if overwrite else "a new run")
        elif not (resume or cfg.training.resume == "auto"):
            raise RunDirError(
                f"`{root}` already holds files from an earlier run. Pass `--overwrite` to replace them, `--resume` to continue "
                f"(finished {parts} are kept), or choose another directory with `--set output_dir=runs/NEW_NAME`."
            )
    root.mkdir(parents=True, exist_ok=True)
    if rundir.read_marker(root) is None:
        rundir.write_marker(root)
    rundir.begin(root, part_names(cfg))
    ownership.write_text(root / "config.resolved.yaml", dump_yaml(cfg), what="the resolved config", reads=inputs(cfg, config_path))
    return root


def seal_root(root: Path, parts: list[str]) -> None:
    """Seal OUTPUT_DIR of a stages / adapters run (rundir.py `seal`); a failure warns, never hides the outcome."""
    try:
        rundir.seal(root, parts)
    except OSError as exc:
        ui.console().print(f"warning: {root / rundir.MANIFEST} not updated: {exc}", markup=False, soft_wrap=True)


def parts_summary(cfg: RunConfig, trains: list, status: dict[str, str], t0: float) -> Path:
    """OUTPUT_DIR/summary.json of a stages / adapters DAG (and adapters.json), from each branch's run summary; ``trains``
    are the DAG's train steps, ``status`` each step's `ran` / `reused`."""
    root = Path(cfg.output_dir).resolve()
    ownership.write_text(root / "config.resolved.yaml", dump_yaml(cfg), what="the resolved config")  # the whole config (also under `pipeline run`)
    if cfg.stages:
        return stages_summary(cfg, [(s.meta["stage"], status[s.id] == "reused") for s in trains], root, t0)
    return adapters_summary(cfg, [s.meta["adapter"] for s in trains], root, t0)
