"""Text classification, top to bottom: records of `format: classification` (`text` + `label`; other field names through
`data.sources[].columns`) -> the class list from the training split -> a sequence-classification model (the base with a new
`score` head of one output per class; LoRA with task type SEQ_CLS keeps the head trainable) -> baseline accuracy on the
eval split -> cross-entropy in trainpipe's resilient loop (best checkpoint by `training.metric_for_best`, eval loss by default) -> final accuracy and macro-F1 with
the best checkpoint -> export.

`RUN_DIR/model/` loads with `AutoModelForSequenceClassification.from_pretrained(dir)` and its `config.id2label` names the
classes; a text is classified at its last non-pad token (HF's pooling with `pad_token_id` set), tokenized as the data step
does (the text followed by the EOS token). :func:`predict` does exactly that.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path

from trainpipe import ui
from trainpipe.evaluate.metrics import trivial_classes
from trainpipe.errors import ConfigError, DataError
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.train.sft import artifacts, build_loop, train, worker_summary
from trainpipe.model.loading import DTYPES, check_model_source, parameter_counts, resolve_lora_targets
from trainpipe.export import base_model_dir, export_folder, model_card
from trainpipe.data.collate import right_pad

PEFT_KINDS = ("none", "lora", "rslora", "dora")


def run(ctx: RunContext) -> dict:
    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    bs = ctx.specs.batch.eval_micro_batch

    # 1. settings and classes
    if cfg.method.peft not in PEFT_KINDS:
        raise ConfigError(f"`method.name: classification` trains with `method.peft` one of {', '.join(PEFT_KINDS)}, got `{cfg.method.peft}`. Use `lora` or `none`.")
    labels = class_list(data.train)
    label2id = {c: i for i, c in enumerate(labels)}
    unseen = sorted({r["class_label"] for r in data.eval} - set(labels))
    if unseen:
        raise DataError(f"the eval split has labels the training split never shows ({', '.join(unseen[:5])}); add training records for them or drop them.")

    # 2. model: the base with a new K-way score head (+ LoRA that keeps the head trainable)
    model = build_classifier(cfg.model, cfg.method, tok.pad_token_id, labels)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %); classes: {', '.join(labels)}")
    objective = ClassCrossEntropy(tok.pad_token_id, label2id)

    # 3. baseline on the eval split (the untrained head: about chance)
    baseline, _ = ctx.baseline_once(lambda: (evaluate(model, objective, data.eval, batch_size=bs), []))

    # 4. train: the best checkpoint by `training.metric_for_best` (HF's metric_for_best_model; the eval loss by default)
    loop = build_loop(
        model, tok, data.train, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=lambda m: evaluate(m, objective, data.eval, batch_size=bs), objective=objective, dist=ctx.dist, callbacks=ctx.callbacks,  # loss, accuracy, macro_f1 (the hooks see all)
    )
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:
        return worker_summary(cfg, outcome)

    # 5. final accuracy on the same split, with the best checkpoint loaded
    final = evaluate(model, objective, data.eval, batch_size=bs)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)

    # 6. export: a plain AutoModelForSequenceClassification folder with id2label
    model_dir = export_classifier(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, labels=labels, card=ctx.card(baseline, final))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": "classification", "peft": cfg.method.peft, "classes": labels,
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(),
        "trivial": trivial_classes([str(r["class_label"]) for r in data.train], [str(r["class_label"]) for r in data.eval]),
        "artifacts": artifacts(ctx.run_dir, model_dir, cfg.method.peft),
    }


def class_list(rows) -> list[str]:
    if not len(rows) or "class_label" not in rows[0]:
        raise DataError(
            "`method.name: classification` needs records with a text and a class label: set `format: classification` on the sources "
            "(fields `text` and `label`; map other names with `columns: {text: FIELD, label: FIELD}`)."
        )
    labels = sorted({str(r["class_label"]) for r in rows})
    if len(labels) < 2:
        raise DataError(f"the training split has one class only ({labels[0]!r}); a classifier needs at least two.")
    return labels


# ------------------------------------------------------------------------------ model


def load_classifier_base(model_cfg, dtype: str, pad_token_id: int, labels: list[str]):
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    check_model_source(model_cfg)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "score.weight newly initialized" is the point here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_cfg.name_or_path, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={c: i for i, c in enumerate(labels)},
            dtype=getattr(torch, DTYPES[dtype]), trust_remote_code=model_cfg.trust_remote_code, revision=model_cfg.revision, use_safetensors=True,
        )
    finally:
        logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id
    return model


def build_classifier(model_cfg, method, pad_token_id: int, labels: list[str]):
    model = load_classifier_base(model_cfg, model_cfg.dtype, pad_token_id, labels)
    if method.peft == "none":
        return model
    from peft import LoraConfig, get_peft_model

    lora = method.lora
    head = "classifier" if hasattr(model, "classifier") and not hasattr(model, "score") else "score"
    peft_cfg = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=resolve_lora_targets(model, lora.target_modules),
        bias="none", task_type="SEQ_CLS", modules_to_save=[head], use_rslora=method.peft == "rslora", use_dora=method.peft == "dora",
    )
    return get_peft_model(model, peft_cfg)


# ------------------------------------------------------------------------------ the objective


class ClassCrossEntropy(Objective):
    """Cross-entropy of the class logits at the last non-pad token, summed over examples; weight = examples."""

    def __init__(self, pad_id: int, label2id: dict[str, int]):
        self.pad_id, self.label2id = pad_id, label2id

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def collate(self, examples: list[dict]) -> dict:
        import torch

        batch = right_pad([list(ex["input_ids"]) for ex in examples], self.pad_id)
        batch["class_ids"] = torch.tensor([self.label2id[str(ex["class_label"])] for ex in examples], dtype=torch.long)
        return batch

    def logits(self, model, batch: dict):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits.float()

    def loss_sum(self, model, batch: dict):
        import torch.nn.functional as F

        y = batch.pop("class_ids")
        logits = self.logits(model, batch)
        correct = float((logits.argmax(-1) == y).float().sum())
        return F.cross_entropy(logits, y, reduction="sum"), {"accuracy": correct}


def evaluate(model, objective: ClassCrossEntropy, rows, *, batch_size: int) -> dict:
    """Loss, accuracy and macro-F1 on ``rows``."""
    import torch
    import torch.nn.functional as F

    if not len(rows):
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logits, ys = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = [rows[j] for j in range(i, min(i + batch_size, len(rows)))]
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in objective.collate(chunk).items()}
            ys.append(batch.pop("class_ids").cpu())
            logits.append(objective.logits(model, batch).cpu())
    model.train(was_training)
    lg, y = torch.cat(logits), torch.cat(ys)
    pred = lg.argmax(-1)
    f1s = []
    for c in range(lg.shape[-1]):
        tp = int(((pred == c) & (y == c)).sum())
        fp = int(((pred == c) & (y != c)).sum())
        fn = int(((pred != c) & (y == c)).sum())
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"loss": float(F.cross_entropy(lg, y)), "accuracy": float((pred == y).float().mean()), "macro_f1": sum(f1s) / len(f1s) if f1s else 0.0}


# ------------------------------------------------------------------------------ export and prediction


def export_classifier(*, run_dir: Path, model, tokenizer, base, peft: str, labels: list[str], card: dict) -> Path:
    """`RUN_DIR/model/`: safetensors (LoRA and the trained head merged into a float32 base), id2label, the tokenizer, a card
    and `adapter/`; written to `model.tmp/` and renamed at the end."""

    final = run_dir / "model"
    with export_folder(final, run_dir=run_dir, card=card, protect=base_model_dir(base)) as tmp:
        if peft != "none":
            from peft import PeftModel

            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            fresh = load_classifier_base(base, "float32", tokenizer.pad_token_id, labels)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                merged = PeftModel.from_pretrained(fresh, tmp / "adapter").merge_and_unload()
        else:
            merged = model
        merged.config.pad_token_id = tokenizer.pad_token_id
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(card), encoding="utf-8")
    return final


def predict(path: str | Path, texts: list[str], batch_size: int = 16) -> list[str]:
    """The class of each text by an exported classifier folder (the text + EOS, as the data step tokenizes it)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), use_safetensors=True).eval()
    pad = model.config.pad_token_id
    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            seqs = [tok(t + (tok.eos_token or ""), add_special_tokens=False)["input_ids"] for t in texts[i : i + batch_size]]
            n = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), n), pad, dtype=torch.long)
            att = torch.zeros((len(seqs), n), dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                att[j, : len(s)] = 1
            pred = model(input_ids=ids, attention_mask=att).logits.argmax(-1).tolist()
            out += [model.config.id2label[p] for p in pred]
    return out
