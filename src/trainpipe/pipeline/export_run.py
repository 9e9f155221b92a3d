"""`trainpipe export RUN_DIR`: the export step on its own.

- A run directory: rebuild the model of its resolved config, load the best checkpoint (by eval
  loss; the newest valid one when none was evaluated), or the one `--checkpoint step-N` names (one
  of the run's own, checksums verified), and export it as `run` does (merged full-precision
  weights, adapter, tokenizer, generation config, model card) to `RUN_DIR/model` or `--out`.
- A multi-adapter run directory (`method.adapters`, it holds `adapters.json`): `--adapter NAME`
  merges that adapter into the base; `--combine a=0.7,b=0.3` merges the weighted combination
  (PEFT `add_weighted_adapter`; `cat` by default, which makes the merged update exactly
  0.7·ΔW_a + 0.3·ΔW_b); `load_adapters(RUN_DIR)` loads every adapter on one base in memory so a
  program can switch with `model.set_adapter(name)`.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path


from trainpipe.config import build_config, read_yaml, RunConfig
from trainpipe.config.family import resolve_family
from trainpipe.data.tokenize import end_of_turn_ids, setup_chat_template
from trainpipe.errors import RunDirError, TrainpipeError
from trainpipe.evaluate.gates import mark_model
from trainpipe.export import base_model_dir, check_destination, export_model, recorded, stop_token_ids
from trainpipe.model.checkpoints import CheckpointManager, verify
from trainpipe.model.loading import build_model, load_model, load_tokenizer
from trainpipe.report.diagnose import read_mapping

COMBINATIONS = ("cat", "linear", "svd")
EXPORTABLE = ("sft", "pretrain", "dpo", "orpo", "kto")


def _resolved_config(run_dir: Path) -> RunConfig:
    path = run_dir / "config.resolved.yaml"
    if not path.is_file():
        raise RunDirError(f"`{run_dir}` is not a trainpipe run directory (no config.resolved.yaml). Give the `output_dir` of a run.")
    return build_config(read_yaml(path), source=f"`{path}`")  # bounded YAML; a damaged file is one paragraph (issue 22)


def _gates_block(run_dir: Path) -> dict | None:
    """The run's gates.json (None when the run has none); RunDirError when it is damaged: an export must not lose the
    mark of a failed gate."""
    gates = run_dir / "gates.json"
    if not gates.exists():
        return None
    block = read_mapping(gates)
    if block is None or not isinstance(block.get("passed"), bool) or not isinstance(block.get("failed", []), list):
        raise RunDirError(f"`{gates}` is damaged (not the JSON object the gates write: `passed`, `failed`, `results`), so the export could not "
                          f"carry the run's quality gates. Nothing was written. Delete it and check the gates again with `trainpipe report {run_dir}` "
                          "(which writes it anew), then export.")
    return block


def _generation_stop_ids(model_dir: Path) -> list[int]:
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen.get("eos_token_id")
    return eos if isinstance(eos, list) else [eos]


def protected_paths(run_dir: Path, cfg: RunConfig) -> list[tuple[str, Path]]:
    """What an export destination must neither be, hold nor lie inside: the config file, the base model, the data."""
    out = base_model_dir(cfg.model)
    manifest = run_dir / "manifest.json"
    try:
        config_path = json.loads(manifest.read_text(encoding="utf-8")).get("config_path") if manifest.is_file() else None
    except (OSError, ValueError, AttributeError):  # damaged, or not a mapping
        config_path = None
    if config_path:
        out.append(("the run's config", Path(config_path)))
    datas = [cfg.data, *(a.data for a in cfg.method.adapters or []), *(st.data for st in cfg.stages or [])]
    for src in (src for d in datas if d is not None for src in d.sources):
        if src.path:
            path = Path(src.path).expanduser()
            while any(ch in path.name for ch in "*?[") and path != path.parent:  # a glob: the folder it reads
                path = path.parent
            out.append(("the data", path))
    return out


def export_run(run_dir: str | Path, *, adapter: str | None = None, combine: dict[str, float] | None = None, combination: str = "cat",
               out: str | Path | None = None, checkpoint: str | None = None) -> Path:
    run_dir = Path(run_dir).resolve()
    if out is not None:  # before any weights load: a destination that is not ours to replace is refused
        check_destination(Path(out), run_dir=run_dir, protect=protected_paths(run_dir, _resolved_config(run_dir)))
    if (run_dir / "adapters.json").is_file():
        if checkpoint:
            raise RunDirError(f"`--checkpoint` picks a checkpoint of a single run; `{run_dir}` is a multi-adapter run (adapters.json): export "
                              f"one adapter with `--adapter NAME`, or a checkpoint of one adapter's run with `trainpipe export {run_dir}/adapters/NAME --checkpoint step-N`.")
        return export_adapters(run_dir, adapter=adapter, combine=combine, combination=combination, out=out)
    if adapter or combine:
        raise RunDirError(f"`--adapter`/`--combine` need a multi-adapter run (one with `method.adapters`); `{run_dir}` has no adapters.json.")
    return export_single(run_dir, out=out, checkpoint=checkpoint)


def pick_checkpoint(run_dir: Path, name: str):
    """The run's own checkpoint called ``name`` (`step-N`), verified; a RunDirError naming the run's checkpoints otherwise."""
    ck_dir = run_dir / "checkpoints"
    own = CheckpointManager(ck_dir).all() if ck_dir.is_dir() else []
    names = [c.path.name for c in own]
    match = [c for c in own if c.path.name == str(name).strip().rstrip("/")]
    if not match:
        have = ", ".join(names) if names else "none"
        raise RunDirError(f"`--checkpoint {name}` is not one of this run's checkpoints (`{ck_dir}` holds: {have}). Give one of those names, "
                          f"e.g. `trainpipe export {run_dir} --checkpoint {names[-1] if names else 'step-N'}`, or leave `--checkpoint` out to export the best.")
    reason = verify(match[0].path)
    if reason:
        raise RunDirError(f"Checkpoint `{match[0].path}` fails its check ({reason}), so it is not exported. Export another: {', '.join(names)}.")
    return match[0]


def export_single(run_dir: Path, *, out: str | Path | None = None, checkpoint: str | None = None) -> Path:
    cfg = _resolved_config(run_dir)
    gates_block = _gates_block(run_dir) if not checkpoint else None  # a damaged gates.json stops before anything is written
    family = resolve_family(cfg.model, cfg.data)[0]
    if family != "text":
        raise TrainpipeError(f"`trainpipe export` re-exports causal-LM runs; `{run_dir}` is a `{family}` run, whose `model/` `trainpipe run` "
                             "wrote at its end (an image run: a transformers folder with its image processor; tabular and custom runs: "
                             f"add ONNX with `trainpipe export {run_dir} --onnx`). Use that folder, or train again with `--overwrite`.")
    if cfg.method.name not in EXPORTABLE or cfg.method.pretrain.new_tokens:
        raise TrainpipeError(f"`trainpipe export` re-exports causal-LM runs ({', '.join(EXPORTABLE)}, without new tokens); this run is `{cfg.method.name}`. "
                             "Its `model/` was written by `trainpipe run`; rerun with `--resume` to write it again.")
    ck = CheckpointManager(run_dir / "checkpoints")
    if checkpoint:
        info = pick_checkpoint(run_dir, checkpoint)
    else:
        info = ck.best() if (run_dir / "checkpoints").is_dir() else None
    if info is None and (run_dir / "checkpoints").is_dir():
        info = ck.latest_valid()
    if info is None:
        raise RunDirError(f"`{run_dir}/checkpoints` holds no valid checkpoint to export. Train first (`trainpipe run CONFIG`).")
    tok = load_tokenizer(cfg.model, cfg.model.pad_token)
    template = setup_chat_template(tok, cfg.first_data().chat_template, cfg.model.name_or_path)
    stop_ids = list(dict.fromkeys(stop_token_ids(tok, template) + end_of_turn_ids(tok)))
    model = build_model(cfg.model, cfg.method, tokenizer=tok)
    weights, _ = CheckpointManager.load(info.path)
    model.load_state_dict(weights, strict=False)
    summary = read_mapping(run_dir / "summary.json") or {}  # damaged: the card has no figures (issue 22)
    card = {"name": cfg.name, "base_model": cfg.model.name_or_path, "method": f"{cfg.method.name} / {cfg.method.peft}", "config_hash": cfg.hash(),
            "baseline": summary.get("baseline", {}), "final": summary.get("final", {}), "config": cfg.model_dump(mode="json"),
            "checkpoint": str(info.path), "trainpipe_version": __import__("trainpipe").__version__}
    path = export_model(run_dir=run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, stop_ids=stop_ids, card=card,
                        dest=Path(out) if out else None, protect=protected_paths(run_dir, cfg))
    if gates_block is not None:  # the run's model again: it carries the run's quality gates (a failed gate marks it as not passing)
        mark_model(path, gates_block)
        recorded(path, run_dir, names=("quality_gates.json", "README.md"))  # its manifest proves the marked export trainpipe's
    return path


# --------------------------------------------------------------------------- several adapters on one base


def load_adapters(run_dir: str | Path):
    """(PeftModel with every adapter of the run loaded under its name, tokenizer, names); switch with `model.set_adapter(name)`."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    run_dir = Path(run_dir).resolve()
    index = json.loads((run_dir / "adapters.json").read_text())
    cfg = _resolved_config(run_dir)
    names = list(index["adapters"])
    base = load_model(cfg.model, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(base, index["adapters"][names[0]]["adapter"], adapter_name=names[0])
        for n in names[1:]:
            model.load_adapter(index["adapters"][n]["adapter"], adapter_name=n)
    tok = AutoTokenizer.from_pretrained(index["adapters"][names[0]]["model"])
    model.eval()
    return model, tok, names


def parse_combine(text: str) -> dict[str, float]:
    """`a=0.7,b=0.3` -> {"a": 0.7, "b": 0.3}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, w = part.partition("=")
        try:
            out[name.strip()] = float(w) if sep else 1.0
        except ValueError:
            raise TrainpipeError(f"`--combine {text}`: `{part}` is not NAME=WEIGHT (e.g. `--combine sql=0.5,summarise=0.5`).") from None
    return out


def export_adapters(run_dir: Path, *, adapter: str | None, combine: dict[str, float] | None, combination: str, out: str | Path | None) -> Path:
    if (adapter is None) == (combine is None):
        raise TrainpipeError(f"`{run_dir}` holds several adapters: give `--adapter NAME` to export one, or `--combine a=0.5,b=0.5` to merge a weighted combination.")
    if combination not in COMBINATIONS:
        raise TrainpipeError(f"`--combination` must be one of {', '.join(COMBINATIONS)}, got `{combination}`.")
    model, tok, names = load_adapters(run_dir)
    wanted = [adapter] if adapter else list(combine)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise TrainpipeError(f"Adapter(s) {unknown} are not in `{run_dir}`; it has {', '.join(names)}.")
    if combine:
        name = "combined"
        model.add_weighted_adapter(adapters=list(combine), weights=list(combine.values()), adapter_name=name, combination_type=combination)
    else:
        name = adapter
    model.set_adapter(name)
    cfg = _resolved_config(run_dir)
    index = json.loads((run_dir / "adapters.json").read_text())
    stop_ids = _generation_stop_ids(Path(index["adapters"][names[0]]["model"]))
    with tempfile.TemporaryDirectory() as tmpdir:
        model.save_pretrained(tmpdir, selected_adapters=[name], safe_serialization=True)  # PEFT puts a non-default adapter in tmpdir/<name>
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            merged = model.merge_and_unload(adapter_names=[name])
        dest = Path(out) if out else run_dir / "export" / name
        card = {"name": f"{cfg.name}-{name}", "base_model": cfg.model.name_or_path, "method": f"{cfg.method.name} / {cfg.method.peft}, adapter `{name}`"
                + (f" = {combination} of " + ", ".join(f"{w:g} x {n}" for n, w in combine.items()) if combine else ""),
                "config_hash": cfg.hash(), "baseline": index["adapters"][wanted[0]]["baseline"] if adapter else {},
                "final": index["adapters"][wanted[0]]["final"] if adapter else {}, "config": cfg.model_dump(mode="json"),
                "trainpipe_version": __import__("trainpipe").__version__}
        src = Path(tmpdir) / name if (Path(tmpdir) / name).is_dir() else Path(tmpdir)
        final = export_model(run_dir=run_dir, model=merged, tokenizer=tok, base=cfg.model, peft="none", stop_ids=stop_ids, card=card, dest=dest,
                             protect=protected_paths(run_dir, cfg), adapter_from=src)
    return final
