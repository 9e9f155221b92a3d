"""The steps of the pipeline DAG (pipeline/dag.py), each calling trainpipe's own functions: `data.prepare.prepare`,
`trainpipe.run.run` (one run of the branch's config), `evaluate.evaluator.eval_loss`, the tracker's registry,
`report.html.write_report`. Each takes its step, the entries of the steps it reads, the store and a work folder, and
returns its outputs (name -> path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpipe import ownership, ui
from trainpipe import run as one_run
from trainpipe.config import RunConfig
from trainpipe.config.family import resolve_family
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import ConfigError, DataError, RunDirError, TrainpipeError
from trainpipe.evaluate.evaluator import eval_loss
from trainpipe.model.loading import load_tokenizer
from trainpipe.pipeline.stages import stage_lineage
from trainpipe.plan.attention import resolve_attention
from trainpipe.plan.hardware import detect
from trainpipe.redact import redact_obj
from trainpipe.report.html import write_report
from trainpipe.track import tracking
from trainpipe.track.manifest import write_json
from trainpipe.train.family import family

if TYPE_CHECKING:
    from trainpipe.pipeline.dag import Step


class PipelineError(TrainpipeError):
    title = "pipeline"


def _tokenizer_and_template(cfg: RunConfig, model_path: str | None = None):
    mcfg = cfg.model if model_path is None else cfg.model.model_copy(update={"name_or_path": model_path, "init_from_config": None})
    tok = load_tokenizer(mcfg, cfg.model.pad_token)
    if cfg.method.name == "pretrain" and cfg.method.pretrain.new_tokens and model_path is None:
        tok.add_tokens(cfg.method.pretrain.new_tokens)
    return tok, setup_chat_template(tok, cfg.data.chat_template, mcfg.name_or_path)


def _prepared(cfg: RunConfig, model_path: str | None = None, report_path: Path | None = None):
    if cfg.data.packing == "auto":  # the batching the branch's run will use, so its data cache entry is this one
        cfg = cfg.model_copy(deep=True)
        resolve_attention(cfg, detect(), [])
    tok, template = _tokenizer_and_template(cfg, model_path)
    data = prepare(cfg.data, tok, train_on=cfg.method.train_on, seed=cfg.training.seed, report_path=report_path, template_name=template,
                   batch_size_hint=cfg.training.per_device_train_batch_size if isinstance(cfg.training.per_device_train_batch_size, int) else 8,
                   for_method=cfg.method.name)
    return tok, data


def _step_prepare(step: Step, entries, st, work: Path, **_) -> dict:
    """Read, clean, dedup, split and tokenize the data (trainpipe's data step; the data cache keeps the tokens). A table or
    `data.factory` (tabular, custom families): that family's data step (train/family.py), its report as the artefact."""
    name = resolve_family(step.cfg.model, step.cfg.data)[0]
    if name != "text":
        write_json(work / "data_report.json", family(name).prepare(step.cfg).report)
        return {"data": work / "data_report.json"}
    _, data = _prepared(step.cfg, report_path=work / "data_report.json")
    if not (work / "data_report.json").exists():
        write_json(work / "data_report.json", data.report)
    return {"data": work / "data_report.json"}


def _step_train(step: Step, entries, st, work: Path, *, config_path: str | None, key: str, **_) -> dict:
    """One run (`trainpipe.run.run`) of the branch's config into its run folder (baseline eval, training, final eval, export inside it)."""
    run_dir = step.run_dir
    mark = run_dir / ".pipeline-step.json"
    try:
        if (run_dir / "summary.json").exists() and json.loads(mark.read_text())["key"] == key:
            return {"run": run_dir}  # trained with this very key; only saving its entry was interrupted: not trained twice
    except (OSError, ValueError, KeyError):
        pass
    lineage = None
    if "stage" in step.meta:  # a stage of `stages:`: the model it starts from (and rl's reward model) in its manifest
        m = step.meta
        lineage = stage_lineage(m["stage"], m["index"], m["count"], m["root"]) | {"pipeline_step": step.id, "step_key": key}
        ui.console().print(f"[bold]stage {m['stage']['name']}[/] ({m['index'] + 1}/{m['count']}): {step.cfg.method.name} from "
                           f"{step.cfg.model.name_or_path}", markup=True, soft_wrap=True)
    elif "adapter" in step.meta:
        ui.console().print(f"[bold]adapter {step.meta['adapter']}[/]: {step.cfg.method.peft} on {step.cfg.model.name_or_path}", markup=True, soft_wrap=True)
    # one run of the branch's config (trainpipe/run.py); the pipeline's own `register` step registers the model
    unfinished = (run_dir / "checkpoints").is_dir() and not (run_dir / "summary.json").exists()
    resumed = False
    if unfinished:  # a train step stopped part way (preempted, killed): continue from its newest valid checkpoint
        try:
            one_run.run(step.cfg, config_path=config_path, resume=True, lineage=lineage, register=False)
            resumed = True
        except (ConfigError, DataError, RunDirError) as exc:  # another config or other data: start over
            ui.console().print(f"  {step.id}: not resuming the unfinished run ({str(getattr(exc, 'message', exc))[:200]}); starting over",
                               markup=False, soft_wrap=True)
    if not resumed:
        one_run.run(step.cfg, config_path=config_path, overwrite=True, lineage=lineage, register=False)
    ownership.write_text(run_dir / ".pipeline-step.json", json.dumps({"step": step.id, "key": key}) + "\n", what="the pipeline step's mark")
    return {"run": run_dir}


def _step_evaluate(step: Step, entries, st, work: Path, **_) -> dict:
    """The run's baseline and final metrics, and the exported model measured again on the same eval split: the eval loss
    of what was exported must be the final eval loss of the best checkpoint."""
    run_dir = step.run_dir  # the train step left it there, or a reused one was restored (never the store's copy: that stays as hashed)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    out: dict[str, Any] = {"baseline": summary.get("baseline"), "final": summary.get("final"), "method": summary.get("method")}
    if summary.get("method") in ("sft", "pretrain") and (run_dir / "model").is_dir():
        import torch
        from transformers import AutoModelForCausalLM

        base_here = Path(step.cfg.model.name_or_path).exists()  # else (a pod without the upstream stage's folder): the export's tokenizer
        tok, data = _prepared(step.cfg, None if base_here else str(run_dir / "model"))
        model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
        model.eval()
        loss = eval_loss(model, data.eval, batch_size=step.cfg.training.per_device_eval_batch_size, pad_id=tok.pad_token_id)["loss"]
        final = (summary.get("final") or {}).get("loss")
        out["exported_model"] = {"loss": loss, "final_loss": final, "abs_diff": abs(loss - final) if final is not None else None}
    else:
        out["exported_model"] = {"skipped": f"re-measuring the export is done for sft and pretrain; this run is {summary.get('method')}"}
    (work / "eval.json").write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return {"metrics": work / "eval.json"}


def _step_export(step: Step, entries, st, work: Path, **_) -> dict:
    """The exported model (the run's `model/`) as a content-addressed artefact, with its lineage inside."""
    run_dir = step.run_dir  # the train step left it there, or a reused one was restored (never the store's copy: that stays as hashed)
    if not (run_dir / "model").is_dir():
        raise PipelineError(f"`{run_dir}` holds no exported model (`model/`); the train step did not finish its export.")
    dest = work / "model"
    shutil.copytree(run_dir / "model", dest)
    return {"model": dest}


def _step_register(step: Step, entries, st, work: Path, **_) -> dict:
    """The model in MLflow's model registry (tracking.backend mlflow) with its lineage as tags."""
    run_dir = step.run_dir  # the train step left it there, or a reused one was restored (never the store's copy: that stays as hashed)
    model = entries[step.inputs["model"][0]]["outputs"]["model"]
    rec: dict[str, Any] = {"model_uri": model["uri"], "model_digest": model["digest"]}
    if not step.cfg.tracking.register_model:
        rec |= {"registered": False, "reason": "tracking.register_model is false"}
    else:
        name = step.cfg.tracking.model_name or step.cfg.name
        try:
            reg = tracking.register_model(run_dir, name=name, tags={"trainpipe.pipeline.model_uri": model["uri"], "trainpipe.pipeline.model_digest": model["digest"]})
        except Exception as exc:  # noqa: BLE001 - an unreachable registry: the model stays in the store, recorded as not registered
            reg = None
            rec["error"] = str(exc)[:300]
        rec |= {"registered": True, **reg} if reg else {"registered": False, "reason": rec.pop("error", None) or
                                                        "the run has no MLflow run with a logged model (tracking.backend is not mlflow, or the tracker was unreachable)"}
    (work / "registration.json").write_text(json.dumps(redact_obj(rec), indent=2, default=str) + "\n", encoding="utf-8")
    return {"registration": work / "registration.json"}


def _step_report(step: Step, entries, st, work: Path, **_) -> dict:
    """The run's HTML report page (report/html.py), or a record of why there is none."""
    run_dir = step.run_dir  # the train step left it there, or a reused one was restored (never the store's copy: that stays as hashed)
    page = Path(write_report(run_dir))
    shutil.copyfile(page, work / page.name)
    tracking.log_artifact(run_dir, page)  # the page beside the run's other artefacts in MLflow
    return {"page": work / page.name}


# the function that runs each kind of step
STEPS = {"prepare": _step_prepare, "train": _step_train, "evaluate": _step_evaluate, "export": _step_export, "register": _step_register,
         "report": _step_report}
