"""Reward model from preference pairs, top to bottom: sequence-classification model (one
output, a new `score` head on the causal LM base; LoRA with task type SEQ_CLS keeps the head
trainable) -> baseline pairwise accuracy -> train the Bradley-Terry loss
−log σ(r(x, y_c) − r(x, y_r)) (TRL RewardTrainer's loss) in trainpipe's resilient loop ->
final accuracy with the best checkpoint -> export.

The contract other recipes (rl) rely on -- :func:`load_reward_model` and :func:`score`:

- `RUN_DIR/model/` loads with `AutoModelForSequenceClassification.from_pretrained(dir)`
  (LoRA merged into a float32 copy of the base; `config.pad_token_id` set) and holds the
  tokenizer with the chat template used in training;
- the reward of (prompt, completion) is ``logits[:, 0]`` at the last non-pad token (HF's
  pooling for *ForSequenceClassification with `pad_token_id` set) of the prompt as a user
  turn plus the completion as the assistant reply, rendered by the chat template and
  tokenized exactly as the data step does (prompt with the generation prompt, then the
  reply's suffix, each tokenized on its own, no extra special tokens).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path

from trainpipe import ui
from trainpipe.errors import ConfigError
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.train.sft import artifacts, build_loop, train, worker_summary
from trainpipe.model.loading import DTYPES, check_model_source, parameter_counts, resolve_lora_targets
from trainpipe.data.collate import right_pad
from trainpipe.evaluate import shard as sharding
from trainpipe.export import base_model_dir, export_folder, model_card
from trainpipe.data.tokenize import encode_texts, Template

PEFT_KINDS = ("none", "lora", "rslora", "dora")


def run(ctx: RunContext) -> dict:
    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    bs = ctx.specs.batch.eval_micro_batch

    # 1. settings (the data step already checked the data are preference pairs)
    if cfg.method.peft not in PEFT_KINDS:
        raise ConfigError(f"`method.name: reward` trains with `method.peft` one of {', '.join(PEFT_KINDS)}, got `{cfg.method.peft}`. Use `lora` (the default) or `none`.")

    # 2. model: the base with a new one-output score head (+ LoRA that keeps the head trainable)
    model = build_reward_model(cfg.model, cfg.method, tok.pad_token_id)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")
    objective = BradleyTerry(tok.pad_token_id)

    # 3. baseline pairwise accuracy on the eval split (the untrained head: about chance)
    baseline, _ = ctx.baseline_once(lambda: (evaluate(model, objective, data.eval, batch_size=bs), []))

    # 4. train: the best checkpoint by `training.metric_for_best` (HF's metric_for_best_model; the eval loss by default)
    loop = build_loop(
        model, tok, data.train, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=lambda m: evaluate(m, objective, data.eval, batch_size=bs), objective=objective, dist=ctx.dist, callbacks=ctx.callbacks,  # loss, accuracy, margin, rewards
    )
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:  # rank 0 evaluates, exports and reports for the run
        return worker_summary(cfg, outcome)

    # 5. final accuracy on the same split, with the best checkpoint loaded
    final = evaluate(model, objective, data.eval, batch_size=bs)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    more = {}
    if cfg.eval.test_split and ctx.data.test:  # the held-out test pairs, once, on the chosen checkpoint (never for selection)
        more["test"] = {**evaluate(model, objective, ctx.data.test, batch_size=bs), "examples": len(ctx.data.test)}
        ctx.events.emit("eval_done", step=outcome.global_step, phase="test", **more["test"])

    # 6. export: a plain AutoModelForSequenceClassification folder
    model_dir = export_reward_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, card=ctx.card(baseline, final))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": "reward", "peft": cfg.method.peft,
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(),
        "artifacts": artifacts(ctx.run_dir, model_dir, cfg.method.peft), **more,
    }


# ------------------------------------------------------------------------------ model


def load_sequence_classifier(model_cfg, dtype: str, pad_token_id: int):
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    check_model_source(model_cfg)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "score.weight newly initialized" is the point here, not a warning
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_cfg.name_or_path, num_labels=1, dtype=getattr(torch, DTYPES[dtype]), trust_remote_code=model_cfg.trust_remote_code,
            revision=model_cfg.revision, use_safetensors=True,
        )
    finally:
        logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id
    return model


def build_reward_model(model_cfg, method, pad_token_id: int):
    model = load_sequence_classifier(model_cfg, model_cfg.dtype, pad_token_id)
    if method.peft == "none":
        return model
    from peft import LoraConfig, get_peft_model

    lora = method.lora
    peft_cfg = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=resolve_lora_targets(model, lora.target_modules),
        bias="none", task_type="SEQ_CLS", modules_to_save=["score"], use_rslora=method.peft == "rslora", use_dora=method.peft == "dora",
    )
    return get_peft_model(model, peft_cfg)


# ------------------------------------------------------------------------------ the objective


def collate_pairs(examples: list[dict], pad_id: int) -> dict:
    """[prompt + chosen for each pair; prompt + rejected for each pair], right-padded."""

    seqs = [list(ex["prompt_input_ids"]) + list(ex[k]) for k in ("chosen_input_ids", "rejected_input_ids") for ex in examples]
    return right_pad(seqs, pad_id)


class BradleyTerry(Objective):
    """−log σ(r_chosen − r_rejected) summed over the pairs; weight = pairs (TRL RewardTrainer's mean loss)."""

    shards_eval = True  # in-training evals under several processes: each rank scores its batches (evaluate/shard.py)

    spike_floor = 0.6931471805599453  # ln 2: −log σ(0), the loss of a reward model that cannot tell the pair apart yet

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def collate(self, examples: list[dict]) -> dict:
        return collate_pairs(examples, self.pad_id)

    def rewards(self, model, batch: dict):
        r = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits[:, 0].float()
        return r.chunk(2)

    def loss_sum(self, model, batch: dict):
        import torch.nn.functional as F

        rc, rr = self.rewards(model, batch)
        m = (rc - rr).detach()
        return -F.logsigmoid(rc - rr).sum(), {"margin": float(m.sum()), "accuracy": float((m > 0).float().sum())}


def evaluate(model, objective: BradleyTerry, rows: list[dict], *, batch_size: int) -> dict:
    """Pairwise accuracy (share of pairs with r_chosen > r_rejected), mean margin and the loss on ``rows``."""
    import torch
    import torch.nn.functional as F

    if not rows:
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device

    todo, shard = sharding.batches(len(rows), batch_size)  # several processes in training: this rank's batches (evaluate/shard.py)
    done: dict[int, tuple] = {}
    with torch.no_grad():
        for b, i, counted in todo:
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in objective.collate(rows[i : i + batch_size]).items()}
            rc, rr = objective.rewards(model, batch)
            if counted:
                done[b] = (rc.cpu(), rr.cpu())
    model.train(was_training)
    scored = sharding.in_order(done, shard, units=lambda r: len(r[0]))  # every batch, in order, on every rank
    rc, rr = torch.cat([c for c, _ in scored]), torch.cat([r for _, r in scored])
    m = rc - rr
    return {
        "loss": float(-F.logsigmoid(m).mean()), "accuracy": float((m > 0).float().mean()), "margin": float(m.mean()),
        "reward_chosen": float(rc.mean()), "reward_rejected": float(rr.mean()),
    }


# ------------------------------------------------------------------------------ export and the scoring contract


def export_reward_model(*, run_dir: Path, model, tokenizer, base, peft: str, card: dict) -> Path:
    """`RUN_DIR/model/`: the reward model as safetensors (LoRA and the trained head merged into a float32 base),
    the tokenizer, a model card and `adapter/`; written to `model.tmp/` and renamed at the end."""

    final = run_dir / "model"
    with export_folder(final, run_dir=run_dir, card=card, protect=base_model_dir(base)) as tmp:  # refuses what is not ours; a full disk leaves no model.tmp
        if peft != "none":
            from peft import PeftModel

            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            fresh = load_sequence_classifier(base, "float32", tokenizer.pad_token_id)
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


def load_reward_model(path: str | Path):
    """(model, tokenizer) of an exported reward model folder, the model in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), use_safetensors=True).eval()
    return model, tok


def encode(tokenizer, prompt: str, completion: str) -> list[int]:
    """Token ids of the user turn ``prompt`` + the assistant reply ``completion``, as the data step builds them."""

    tpl = Template(tokenizer)
    user = [{"role": "user", "content": prompt}]
    head = tpl.render(user, add_generation_prompt=True)
    full = tpl.render(user + [{"role": "assistant", "content": completion}])
    if not full.startswith(head):
        raise ValueError("the chat template does not render the prompt as a prefix of the prompt with its reply")
    a, b = encode_texts(tokenizer, [head, full[len(head):]])
    return list(a.ids) + list(b.ids)


def score(model, tokenizer, prompts: list[str], completions: list[str], batch_size: int = 16) -> list[float]:
    """The reward of each (prompt, completion): logits[:, 0] at the last non-pad token of the rendered pair."""
    import torch

    if len(prompts) != len(completions):
        raise ValueError(f"score() needs one completion per prompt, got {len(prompts)} prompts and {len(completions)} completions")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            seqs = [encode(tokenizer, p, c) for p, c in zip(prompts[i : i + batch_size], completions[i : i + batch_size])]
            n = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), n), pad, dtype=torch.long)
            att = torch.zeros((len(seqs), n), dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                att[j, : len(s)] = 1
            out += model(input_ids=ids.to(device), attention_mask=att.to(device)).logits[:, 0].float().tolist()
    return out
