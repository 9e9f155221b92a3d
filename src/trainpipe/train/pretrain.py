"""Continued pretraining, top to bottom: base model (loaded, or built from scratch from
`model.init_from_config`) -> vocabulary extension (`method.pretrain.new_tokens`) -> PEFT ->
baseline held-out perplexity -> train with next-token cross-entropy on every token of the raw
text -> final held-out perplexity with the best checkpoint -> export.

- Data: `format: text` records; the data step labels every token (the text plus EOS) and, with
  `data.packing: pack`, packs several texts per row of `data.max_length` with position ids
  restarting per text (the model keeps attention inside each text; the first token of each is
  never a target).
- From scratch: `model.init_from_config` names a config.json (or a folder with one); the
  architecture is built with random weights seeded by `training.seed`, and `model.name_or_path`
  supplies only the tokenizer.
- New tokens: `run.py` adds them to the tokenizer right after loading it, so the data
  is tokenized with them (each is one id). Here the embeddings are resized and each new row
  starts at the mean of the existing rows (input and, when untied, output embeddings); the rows
  of the old tokens are left as they were. Under a full fine-tune (`peft: none`) every row
  trains; under LoRA-style PEFT only the new rows train (PEFT's `trainable_token_indices`), so
  the old token embeddings stay exactly the base's. The exported tokenizer holds the new tokens.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

from trainpipe import ownership, pending, ui
from trainpipe.config import ModelConfig, RunConfig
from trainpipe.errors import ConfigError
from trainpipe.train import sft
from trainpipe.train.context import RunContext
from trainpipe.evaluate import suite
from trainpipe.evaluate.evaluator import evaluate_lm
from trainpipe.export import export_model
from trainpipe.model.loading import apply_peft, check_peft, load_base, parameter_counts, quantization_config

# PEFT methods that keep the embeddings frozen and can train chosen token rows (PEFT's `trainable_token_indices`)
TOKEN_ROW_PEFT = ("lora", "rslora", "dora", "ia3")


def run(ctx: RunContext) -> dict:
    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    bs = ctx.specs.batch.eval_micro_batch
    check_method(cfg)
    ev = cfg.eval if data.eval_generation else cfg.eval.model_copy(update={"metrics": [m for m in cfg.eval.metrics if m != "exact_match"]})

    # 1. base model (pretrained, or random from a config), embeddings resized for new tokens, then PEFT
    check_peft(cfg.model, cfg.method)  # every PEFT error the config alone can tell, before any weights load
    base = load_base(cfg.model, seed=cfg.training.seed, quantization=quantization_config(cfg.method))
    new_ids = new_token_ids(tok, cfg)
    vocab = extend_embeddings(base, tok, new_ids)
    export_base = save_export_base(ctx.run_dir, base, tok, cfg) if ctx.is_main and needs_export_base(cfg, vocab) else cfg.model  # rank 0 exports
    model = apply_peft(base, cfg.method, tokenizer=tok)
    if new_ids and cfg.method.peft in TOKEN_ROW_PEFT:
        train_token_rows(model, new_ids)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")
    if new_ids:
        ui.console().print(f"  vocabulary: {vocab['size_before']} -> {vocab['size_after']} tokens ({len(new_ids)} new, rows at the mean embedding)")

    # 2. baseline: held-out loss and perplexity (measured once; a resumed run reads it back)
    baseline, _ = ctx.baseline_once(lambda: evaluate_lm(model, tok, data, ev, batch_size=bs, stop_ids=ctx.stop_ids, phase="baseline"))

    extra = suite.before_training(ctx, model)  # forgetting sets and benchmarks on the base model (evaluate/suite.py)

    # 3. train: next-token cross-entropy on every token (packed rows carry position ids; the loop's collator keeps them)
    loop = sft.build_loop(
        model, tok, data.train, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=suite.in_training(ctx, extra, lambda m: sft.lm_in_training(m, tok, data, ev, batch_size=bs, stop_ids=ctx.stop_ids), lambda: loop.state.step),
        dist=ctx.dist, callbacks=ctx.callbacks,
    )
    outcome = sft.train(loop, ctx.resume_from)
    if not ctx.is_main:  # rank 0 evaluates, exports and reports for the run
        return sft.worker_summary(cfg, outcome)

    # 4. final held-out perplexity, best checkpoint loaded
    final, _ = evaluate_lm(model, tok, data, ev, batch_size=bs, stop_ids=ctx.stop_ids, phase="final")
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    more = suite.after_training(ctx, model, extra, step=outcome.global_step)  # test split, forgetting sets, benchmarks

    # 5. export (LoRA merged into the extended base; the tokenizer with the new tokens)
    model_dir = export_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=export_base, peft=cfg.method.peft, stop_ids=ctx.stop_ids,
                             card=ctx.card(baseline, final, vocabulary=vocab))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": cfg.method.name, "peft": cfg.method.peft, "init": "from_config" if cfg.model.init_from_config else "pretrained",
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(), "vocabulary": vocab,
        "trivial": sft.trivial(model, tok, data),
        "artifacts": sft.artifacts(ctx.run_dir, model_dir, cfg.method.peft), **more,
    }


def check_method(cfg: RunConfig) -> None:
    """New tokens need trainable embedding rows: fail before any weights are loaded when the PEFT method has none."""
    if not cfg.method.pretrain.new_tokens:
        return
    peft = cfg.method.peft
    if peft == "freeze" and not cfg.method.freeze.train_embeddings:
        raise ConfigError(
            f"`method.pretrain.new_tokens` ({len(cfg.method.pretrain.new_tokens)} tokens) need trainable embeddings, but `peft: freeze` "
            "keeps them frozen. Set `method.freeze.train_embeddings: true`, or use `peft: lora` (only the new rows then train)."
        )
    if peft in ("qlora", "qlora8"):
        raise ConfigError(
            f"`method.pretrain.new_tokens` with `peft: {peft}`: the resized embeddings would have to be merged into a quantized "
            "base at export, which trainpipe does not do. Use `peft: lora` (the base in its full precision) or `peft: none`."
        )
    if peft in ("prompt_tuning", "prefix_tuning"):
        raise ConfigError(
            f"`method.pretrain.new_tokens` cannot be learned under `peft: {peft}` (soft prompts train no embedding rows). "
            "Use `peft: lora` (only the new rows of the embeddings train) or `peft: none`."
        )


def new_token_ids(tokenizer, cfg: RunConfig) -> list[int]:
    """Ids of `method.pretrain.new_tokens` that are new to the base tokenizer (run.py added them before
    tokenizing; tokens the base already had are not new and keep their trained rows)."""
    tokens = cfg.method.pretrain.new_tokens
    if not tokens:
        return []
    from transformers import AutoTokenizer

    m = cfg.model
    n_base = len(AutoTokenizer.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, revision=m.revision))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    return sorted({i for i in ids if i is not None and i >= n_base})


def extend_embeddings(model, tokenizer, new_ids: list[int]) -> dict:
    """Resize the embeddings to the tokenizer when it has more tokens than rows, and set the rows of ``new_ids`` to the
    mean of the rows before them (input embeddings, and output embeddings when they are not tied). Other rows are untouched."""
    import torch

    emb = model.get_input_embeddings()
    before = emb.weight.shape[0]
    if len(tokenizer) > before:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if new_ids:
        first = min(new_ids)
        idx = torch.tensor(new_ids, device=emb.weight.device)
        with torch.no_grad():
            for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}.values():
                w = layer.weight
                w[idx] = w[:first].float().mean(dim=0).to(w.dtype)
    return {
        "new_tokens": [tokenizer.convert_ids_to_tokens(i) for i in new_ids], "new_token_ids": new_ids,
        "size_before": before, "size_after": model.get_input_embeddings().weight.shape[0], "tokenizer_size": len(tokenizer),
    }


def train_token_rows(model, new_ids: list[int]) -> None:
    """Make only the rows of ``new_ids`` trainable in a PEFT model's embeddings (and the tied output layer): PEFT's
    `trainable_token_indices`, added to the adapter's config so the adapter saves, reloads and merges them."""
    from peft.utils.other import set_additional_trainable_modules

    name = model.active_adapter
    pc = model.peft_config[name]
    pc.trainable_token_indices = list(new_ids)
    inner = model.get_base_model()
    set_additional_trainable_modules(inner, pc, inner.config.to_dict(), name)


def needs_export_base(cfg: RunConfig, vocab: dict) -> bool:
    """Export merges an adapter into a fresh copy of the base; when that base is not the one on disk (random init, or
    resized embeddings), the extended base is written into the run directory for it."""
    return cfg.method.peft not in ("none", "freeze") and bool(cfg.model.init_from_config or vocab["size_after"] != vocab["size_before"] or vocab["new_token_ids"])


def save_export_base(run_dir: Path, model, tokenizer, cfg: RunConfig) -> ModelConfig:
    """Write the base as trained from (random init and/or resized embeddings) to RUN_DIR/base; the ModelConfig to merge into."""
    final, tmp = run_dir / "base", run_dir / "base.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    ownership.remove(final, what="the base written by an earlier attempt of this run")  # refused by name if a file in it is not ours
    ownership.expect(run_dir, pending.tree(tmp, "base"))  # only the files written here are the run's `base/` (issue 36)
    tmp.rename(final)
    return cfg.model.model_copy(update={"name_or_path": str(final), "init_from_config": None, "revision": None})
