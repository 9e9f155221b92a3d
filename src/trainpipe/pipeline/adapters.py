"""Multi-task adapters on a shared base: one LoRA adapter per task, trained one after another.

`method.adapters: [{name: sql, data: {...}}, {name: summarise, data: {...}}]` is one chain of the pipeline DAG per
adapter (pipeline/dag.py: prepare -> train -> evaluate -> export -> register -> report, the same under `trainpipe run`
and `trainpipe pipeline run`, with its step cache); each train step is an ordinary `trainpipe run` (same base, same
method and training settings, the adapter's own data) into `OUTPUT_DIR/adapters/<name>/` (each a full run directory:
data report, checkpoints, baseline and final eval, `model/adapter/`). After the DAG, `adapters_summary` writes
`OUTPUT_DIR/adapters.json` (name -> adapter folder, data hashes, metrics) and one `OUTPUT_DIR/summary.json`.

No adapter trains before every adapter's config and data are checked: while the DAG is built, `check_adapters` puts
every adapter's config through the checks each stage of `stages:` gets (stages.py `check_branch`), and its data files and
the base must exist; the DAG then prepares every adapter's data (read, checked against the method, tokenized) before the
first adapter trains. A refusal names the adapter (its name, index of count, `method.adapters[i]`) and the key. What only
training shows (a loss that diverges, memory) still stops at that adapter, after the ones before it trained.

`trainpipe export OUTPUT_DIR --adapter NAME` merges one of them into the base; `--combine a=0.5,b=0.5`
merges their weighted sum (PEFT `add_weighted_adapter`); `trainpipe.pipeline.export_run.load_adapters`
loads all of them on one base to switch between them with `model.set_adapter(name)`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from trainpipe import rundir
from trainpipe.config import RunConfig
from trainpipe.errors import ModelLoadError, RunDirError
from trainpipe.model.loading import check_model_source, check_peft
from trainpipe.pipeline.stages import check_branch
from trainpipe.track.manifest import write_json


def adapter_config(cfg: RunConfig, name: str, root: Path) -> RunConfig:
    """The run config of one adapter: the run's config with the adapter's data and its own output directory."""
    a = next(x for x in cfg.method.adapters if x.name == name)
    sub = cfg.model_copy(deep=True)
    sub.data = a.data.model_copy(deep=True)
    sub.method.adapters = []
    sub.name = f"{cfg.name or 'run'}-{name}"
    sub.output_dir = str(rundir.inside(Path(root) / "adapters", name, "Adapter name"))  # a plain name, its folder inside the run's
    return sub


def check_adapters(cfg: RunConfig, root: Path, *, check_inputs: bool = False) -> list[RunConfig]:
    """Every adapter's run config (`adapter_config`), each checked before any adapter trains (pipeline/stages.py
    `check_branch`, the checks every stage gets): what the method cannot measure, `training.metric_for_best`, and with
    ``check_inputs`` (`trainpipe run`, `trainpipe pipeline run`) its data files, the shared base model's folder and the
    PEFT errors its architecture tells (`check_peft`, once: every adapter has the run's `method`). A
    refusal names the adapter (its name, index of count) and the key, and nothing has trained or been written."""
    check_adapter_names(cfg, root)
    if check_inputs:  # one base and one `method` for every adapter: checked once, named as the run's
        try:
            check_model_source(cfg.model)
            check_peft(cfg.model, cfg.method)  # target modules this architecture lacks, ...: the meta-device build
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc.message} This applies to every adapter of `method.adapters` (one base, one `method`); no adapter was trained.") from None
    subs = []
    count = len(cfg.method.adapters)
    for i, a in enumerate(cfg.method.adapters):
        sub = adapter_config(cfg, a.name, root)
        check_branch(
            sub, f"adapter `{a.name}` ({i + 1} of {count}, `method.adapters[{i}]`)",
            " Every adapter trains with the run's top-level `model`, `method`, `training` and `eval` (only its `data` is its own), "
            "so set the key there; it applies to every adapter.",
            "No adapter was trained.", label=f"adapter {a.name}", data_key=f"method.adapters[{i}].data" if check_inputs else None)
        subs.append(sub)
    return subs


def check_adapter_names(cfg: RunConfig, root: Path) -> None:
    names = [a.name for a in cfg.method.adapters]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise RunDirError(f"`method.adapters` names {dup} more than once; give every adapter its own name (it is its folder).")
    for name in names:
        rundir.inside(Path(root) / "adapters", name, "Adapter name")


def adapters_summary(cfg: RunConfig, names: list[str], root: Path, t0: float) -> Path:
    """OUTPUT_DIR/adapters.json (name -> adapter folder, data hashes, metrics) and OUTPUT_DIR/summary.json after the DAG ran
    (pipeline/dag.py), from each adapter's own run summary."""
    results = {n: json.loads((Path(adapter_config(cfg, n, root).output_dir) / "summary.json").read_text(encoding="utf-8")) for n in names}
    index = {
        "base_model": cfg.model.name_or_path,
        "peft": cfg.method.peft,
        "adapters": {
            n: {"adapter": s["artifacts"]["adapter"], "model": s["artifacts"]["model"], "run_dir": s["artifacts"]["run_dir"],
                "baseline": s["baseline"], "final": s["final"], "data_files": json.loads((Path(s["artifacts"]["run_dir"]) / "manifest.json").read_text()).get("data_files")}
            for n, s in results.items()
        },
    }
    write_json(root / "adapters.json", index)
    summary = {
        "name": cfg.name, "method": cfg.method.name, "peft": cfg.method.peft,
        "adapters": {n: {k: s.get(k) for k in ("baseline", "final", "train", "parameters", "artifacts")} for n, s in results.items()},
        "artifacts": {"run_dir": str(root), "adapters_index": str(root / "adapters.json"), "pipeline": str(root / "pipeline.json")},
        "wall_seconds": round(time.time() - t0, 2),
    }
    write_json(root / "summary.json", summary)
    return root / "summary.json"
