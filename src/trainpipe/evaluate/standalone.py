"""`trainpipe eval MODEL_OR_RUN_DIR --config CONFIG`: the run's evaluator on any model folder or finished run.

The config's data is prepared exactly as `trainpipe run` prepares it (same cache, same split, same seed) with the
evaluated model's own tokenizer, and the same evaluator measures `eval.metrics` on the eval split, the test split,
each forgetting set and each benchmark, so a model trained elsewhere is compared on the very examples a run used.
`--out` is checked before anything is evaluated and written through the ownership rule (:func:`check_out`).
"""

from __future__ import annotations

import time
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.data.prepare import prepare
from trainpipe.data.templates import end_of_turn_ids, setup_chat_template
from trainpipe.errors import ModelLoadError
from trainpipe.evaluate.benchmarks import run_benchmarks
from trainpipe.evaluate.evaluator import evaluate_lm, evaluate_test
from trainpipe.evaluate.forgetting import ForgettingMonitor, load_sets
from trainpipe.export import stop_token_ids
from trainpipe.model.loading import load_tokenizer
from trainpipe.rundir import protected_paths


def model_folder(path: str | Path) -> Path:
    """A model folder (config.json), or a run directory's exported `model/`."""
    p = Path(path).resolve()
    if (p / "config.json").exists():
        return p
    if (p / "model" / "config.json").exists():
        return p / "model"
    if (p / "summary.json").exists() or (p / "events.jsonl").exists():
        raise ModelLoadError(f"`{p}` is a run directory without an exported model (`model/`): the run did not finish. Export its best checkpoint first with `trainpipe export {p}`.")
    raise ModelLoadError(f"`{p}` is neither a model folder (no config.json) nor a run directory with `model/`. Pass a folder saved with `save_pretrained`, or a finished run's `output_dir`.")


def inputs(path: str | Path, cfg, config_path: str | Path | None) -> list[tuple[Path, str]]:
    """What `trainpipe eval` reads, as (path, what it is): the config, its data sources, the evaluated model (and the run
    folder around it), the base model, forgetting sets and local benchmark folders. `--out` is never written onto any."""
    out = list(protected_paths(cfg, str(config_path) if config_path else None))
    p = Path(path).expanduser().resolve()
    out.append((p, f"the evaluated model `{path}`"))
    for fs in cfg.eval.forgetting:
        out.append((Path(fs.path).expanduser().resolve(), f"the forgetting set `{fs.path}`"))
    for bm in cfg.eval.benchmarks:
        if bm.include_path:
            out.append((Path(bm.include_path).expanduser().resolve(), f"the benchmark folder `{bm.include_path}`"))
    return out


def check_out(out: str | Path, path: str | Path, cfg, config_path: str | Path | None) -> list[tuple[Path, str]]:
    """Refuse `eval --out` before anything is evaluated (ownership rule: a new path or the figures trainpipe wrote there
    last time, never an input of the command); returns the inputs for the write."""
    reads = inputs(path, cfg, config_path)
    ownership.check_writable(out, what="the eval figures (`--out`)", reads=reads)
    return reads


def write_out(out: str | Path, res: dict, reads: list[tuple[Path, str]]) -> Path:
    """Write the figures to `--out` through the ownership rule (redacted, atomic, recorded)."""
    return ownership.write_json(out, res, what="the eval figures (`--out`)", reads=reads)


def evaluate_model(path: str | Path, cfg) -> dict:
    """Measure the model at ``path`` with ``cfg``'s data and eval settings; returns the figures (summary-shaped)."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    folder = model_folder(path)
    mcfg = cfg.model.model_copy(update={"name_or_path": str(folder), "revision": None, "init_from_config": None})
    tok = load_tokenizer(mcfg, cfg.model.pad_token)
    template = setup_chat_template(tok, cfg.data.chat_template, str(folder))
    stop_ids = list(dict.fromkeys(stop_token_ids(tok, template) + end_of_turn_ids(tok)))
    with ui.progress() as bar:
        task = bar.add_task("tokenize", total=None)
        data = prepare(cfg.data, tok, train_on=cfg.method.train_on, seed=cfg.training.seed, progress=lambda n: bar.advance(task, n),
                       on_total=lambda n: bar.update(task, total=n), template_name=template, for_method=cfg.method.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code, use_safetensors=True)
    except OSError as exc:
        raise ModelLoadError(f"Cannot load the model in `{folder}`: {exc}. It must hold safetensors weights saved with `save_pretrained`.") from None
    if torch.cuda.is_available():
        model = model.cuda()
    model.eval()
    bs = cfg.training.per_device_eval_batch_size
    metrics, samples = evaluate_lm(model, tok, data, cfg.eval, batch_size=bs, stop_ids=stop_ids, phase="eval")
    out: dict = {"model": str(folder), "metrics": metrics, "eval_examples": len(data.eval), "samples": samples[:20]}
    if cfg.eval.test_split and data.test:
        out["test"] = evaluate_test(model, tok, data, batch_size=bs)
    if cfg.eval.forgetting:
        sets = load_sets(cfg.eval.forgetting, tok, template, max_length=cfg.data.max_length)
        mon = ForgettingMonitor(sets, cfg.eval.forgetting_threshold, Path("forgetting.json"), None, batch_size=bs, pad_id=tok.pad_token_id)  # measure only: writes nothing
        out["forgetting"] = mon.measure(model)
    if cfg.eval.benchmarks:
        out["benchmarks"] = run_benchmarks(model, tok, cfg.eval.benchmarks, batch_size=bs, phase="eval")
    out["seconds"] = round(time.time() - t0, 2)
    return out
