"""Preference optimisation, top to bottom: check the data kind -> model (+ PEFT) -> reference
policy -> baseline eval -> train the objective in trainpipe's resilient loop -> final eval
with the best checkpoint -> export.

`method.name` picks the objective (each equal to TRL's maintained implementation on the
same batch; tests/unit/test_preference_losses.py runs both):

- ``dpo`` with `method.preference.loss_type`
  (Δ = [log π(y_c|x) − log π_ref(y_c|x)] − [log π(y_r|x) − log π_ref(y_r|x)], log-probs summed
  over the reply tokens):
  ``sigmoid`` (DPO): −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ), ε = `label_smoothing` (conservative
  DPO; ε = 0 is TRL's ``sigmoid``); ``hinge`` (SLiC): max(0, 1 − βΔ); ``ipo``: (Δ̄ − 1/(2β))²
  with Δ̄ the per-token (length-normalised) Δ, as TRL and the IPO authors use it; ``simpo``:
  −log σ(β·(mean log π(y_c) − mean log π(y_r)) − γ), no reference model (TRL's CPOTrainer
  with loss_type simpo). `sft_weight` > 0 adds that times the NLL of the chosen replies
  (RPO; TRL's ``["sigmoid", "sft"]`` with `loss_weights`).
- ``orpo``: NLL of the chosen replies − β·log σ(log odds(ȳ_c) − log odds(ȳ_r)), with ȳ the
  per-token mean log-prob; no reference model. One deliberate difference from TRL's
  experimental ORPOTrainer: its NLL also counts the *prompt* tokens (huggingface/trl#1676);
  here it is the reply tokens only, as in the ORPO paper and trainpipe's SFT loss.
- ``kto`` (unpaired labels): desirable w_d·(1 − σ(β(r − z))), undesirable w_u·(1 − σ(β(z − r))),
  r = log π(y|x) − log π_ref(y|x); the reference point z = max(0, mean over the micro-batch
  of the same ratio on mismatched pairs (x_i, y_{i−1})), detached -- as TRL does (it rotates
  the completions within each device batch). Preference pairs are unpaired for it (chosen ->
  desirable, rejected -> undesirable, as TRL's `unpair_preference_dataset`).

The NLL terms (ORPO, `sft_weight`) are token means over the whole optimizer window, so any
micro-batch x accumulation split gives the same step (the loop's contract). KTO's reference
point z is estimated per micro-batch, like TRL's per device batch, so a KTO step depends on
the micro-batch size (an OOM-halving changes it slightly); with a micro-batch of 1 the
"mismatched" pair is the example itself, so keep `per_device_train_batch_size` >= 2.

Reference model: with PEFT, the base itself with the adapter switched off (`disable_adapter`,
as TRL does, no second copy); with a full fine-tune (`peft: none` or `freeze`), a frozen deep
copy of the base made once before training (simple and exact; it costs one more copy of the
weights in memory -- precomputed reference log-probs would save it for large models).

Eval metrics (summary `baseline` and `final`, on the same held-out split):
`loss` (the objective; it picks the best checkpoint), `accuracy` (share of pairs where the
model itself gives the chosen reply the higher score: summed log-prob for dpo sigmoid/ipo/
hinge, per-token mean for simpo/orpo), `margin` (mean score(chosen) − score(rejected)),
`margin_per_token` / `accuracy_per_token` (the same on the mean log-prob per reply token, for
every loss type: a summed margin scales with the reply length, this one reads in nats per token),
`reply_tokens_chosen` / `reply_tokens_rejected` (mean reply lengths the margins are over),
`reward_accuracy` / `reward_margin` (TRL's rewards/accuracies and rewards/margins: the implicit
reward β·log π/π_ref, for simpo/orpo β·mean log π; 0 for the base by construction), and
`reward_ties`, the share of pairs (kto: examples) whose implicit reward margin is 0 (|x| <= 1e-6): every pair at the
baseline, where the policy is the reference; a tie is neither right nor wrong, chance is 50 %, and the run's table says
when a baseline of ties makes `reward_accuracy`'s change not comparable (evaluate/metrics.reading).
For kto: `accuracy` and `margin` compare the desirable and the undesirable completion of each
eval prompt that has both (all desirable x undesirable combinations, per-token mean log-prob,
when none has both), and `reward_accuracy` is the share of examples whose implicit reward has
the sign of its label (ties apart, in `reward_ties`).
"""

from __future__ import annotations

import math

import copy
from dataclasses import asdict

from trainpipe import ui
from trainpipe.errors import ConfigError
from trainpipe.distributed.ddp import unwrap
from trainpipe.train import fused_preference as fused
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.data import vision_chat
from trainpipe.train.sft import artifacts, build_loop, train, worker_summary
from trainpipe.evaluate import suite
from trainpipe.export import export_model
from trainpipe.model.loading import build_model, parameter_counts
from trainpipe.evaluate import shard as sharding


def run(ctx: RunContext) -> dict:
    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    method, pref = cfg.method.name, cfg.method.preference
    bs = ctx.specs.batch.eval_micro_batch

    # 1. settings and data kind (the data step already checked that the kind fits the method)
    check_settings(method, pref, ctx.specs.batch.micro_batch)
    train_rows, eval_rows = data.train, data.eval
    if method == "kto" and len(train_rows) and "chosen_input_ids" in train_rows[0]:  # pairs: unpair them, as TRL does
        train_rows, eval_rows = Unpaired(train_rows), list(Unpaired(eval_rows))

    # 2. model (+ PEFT)
    model = build_model(cfg.model, cfg.method, tokenizer=tok)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")

    # 3. reference policy: the base with the adapter off (PEFT) or a frozen copy (full fine-tune); none for simpo/orpo
    reference = Reference(model) if needs_reference(method, pref) else None
    objective = make_objective(method, pref, reference, tok.pad_token_id)

    # 4. baseline on the eval split (measured once; a resumed run reads it back)
    baseline, _ = ctx.baseline_once(lambda: (evaluate(model, objective, eval_rows, batch_size=bs), []))
    # the policy is a causal LM: forgetting sets (LM loss on general text) and benchmarks on it too (evaluate/suite.py)
    extra = suite.before_training(ctx, model)

    # 5. train: the best checkpoint by the objective's eval loss (every in-training eval measures the forgetting sets too)
    loop = build_loop(
        model, tok, train_rows, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=suite.in_training(ctx, extra, lambda m: evaluate(m, objective, eval_rows, batch_size=bs), lambda: loop.state.step),  # loss and every preference metric
        objective=objective, dist=ctx.dist, callbacks=ctx.callbacks,
    )
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:  # rank 0 evaluates, exports and reports for the run
        return worker_summary(cfg, outcome)
    fused.record(ctx.run_dir, objective)  # again after training (build_loop recorded it first): a fall-back under FSDP is recorded too

    # 6. final eval on the same split, with the best checkpoint loaded
    final = evaluate(model, objective, eval_rows, batch_size=bs)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    test_rows = list(Unpaired(ctx.data.test)) if method == "kto" and ctx.data.test and "chosen_input_ids" in ctx.data.test[0] else ctx.data.test
    more = suite.after_training(ctx, model, extra, step=outcome.global_step,  # test split (preference metrics), forgetting sets, benchmarks
                                measure_test=lambda m: evaluate(m, objective, test_rows, batch_size=bs))

    # 7. export the best policy (LoRA merged into a float32 copy of the base)
    model_dir = export_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, stop_ids=ctx.stop_ids, card=ctx.card(baseline, final))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": method, "peft": cfg.method.peft, "loss_type": pref.loss_type if method == "dpo" else method,
        "reference": None if reference is None else reference.kind,
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(),
        "artifacts": artifacts(ctx.run_dir, model_dir, cfg.method.peft), **more,
    }


def check_settings(method: str, pref, micro_batch: int) -> None:
    if method != "dpo" and pref.loss_type != "sigmoid":
        raise ConfigError(
            f"`method.preference.loss_type: {pref.loss_type}` is a `dpo` loss, but `method.name` is `{method}`. "
            f"Set `method.name: dpo` to train with {pref.loss_type}, or remove `loss_type` for {method}."
        )
    if method == "kto" and micro_batch < 2:
        ui.console().print(
            "[yellow]warning:[/] kto estimates its reference point from mismatched prompt/completion pairs within a "
            "micro-batch; with `training.per_device_train_batch_size: 1` there are none. Use 2 or more.", markup=True, soft_wrap=True,
        )


def needs_reference(method: str, pref) -> bool:
    return method == "kto" or (method == "dpo" and pref.loss_type != "simpo")


def make_objective(method: str, pref, reference: "Reference | None", pad_id: int) -> Objective:
    if method == "kto":
        return KTOObjective(pref, reference, pad_id)
    return PairObjective(method, pref, reference, pad_id)


# ------------------------------------------------------------------------------ data


class Unpaired:
    """Preference pairs seen as KTO rows: row 2i is pair i's chosen reply (desirable), row 2i+1 its rejected one."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        p = self.pairs[i // 2]
        key = "chosen_input_ids" if i % 2 == 0 else "rejected_input_ids"
        row = {"prompt_input_ids": p["prompt_input_ids"], "completion_input_ids": p[key], "label": i % 2 == 0}
        return {**row, "mm": p["mm"]} if "mm" in p else row  # a vision-language pair: both rows show the prompt's images

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _pad(seqs: list[list[int]], masks: list[list[int]], pad_id: int) -> dict:
    import torch

    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), n), dtype=torch.long)
    loss = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        att[i, : len(s)] = 1
        loss[i, : len(s)] = torch.tensor(m, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": loss}


PAIR_KEYS = ("input_ids", "attention_mask", "loss_mask", "nll_scale")
KTO_KEYS = ("input_ids", "attention_mask", "loss_mask", "label")


def collate_pairs(examples: list[dict], pad_id: int) -> dict:
    """[prompt + chosen for each pair; prompt + rejected for each pair], right-padded, loss mask on the replies."""
    seqs, masks = [], []
    for key in ("chosen_input_ids", "rejected_input_ids"):
        for ex in examples:
            p, r = list(ex["prompt_input_ids"]), list(ex[key])
            seqs.append(p + r)
            masks.append([0] * len(p) + [1] * len(r))
    out = _pad(seqs, masks, pad_id)
    if "mm" in examples[0]:  # a vision-language model's pairs: each prompt's images, for the chosen and the rejected row
        out.update(vision_chat.pair_tensors(examples, out["input_ids"].shape[1]))
    return out


# ------------------------------------------------------------------------------ log-probs and the reference


def sequence_logps(model, input_ids, attention_mask, loss_mask, **images):
    """(sum of the log-probs of the reply tokens, number of reply tokens) per row, in float32; ``images``: a vision-language
    model's pixel tensors (data/vision_chat.py)."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images).logits
    logits = logits[:, -input_ids.size(1):-1].float()  # prompt tuning prepends virtual tokens: keep the real positions
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(logits.dtype)
    logp = torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1), mask.sum(-1)


class Reference:
    """The reference policy π_ref: the PEFT model with its adapter disabled, or a frozen copy of a fully trained model."""

    def __init__(self, model):
        from peft import PeftModel

        if isinstance(model, PeftModel):
            self.kind, self.frozen = "base model with the adapter disabled", None
        else:
            self.kind = "frozen copy of the base"
            self.frozen = copy.deepcopy(model).eval()
            for p in self.frozen.parameters():
                p.requires_grad_(False)

    def logps(self, model, input_ids, attention_mask, loss_mask, **images):
        import torch

        with torch.no_grad():
            if self.frozen is None:
                model = unwrap(model)  # the adapter switch lives on the PEFT model inside DDP; no gradient, no sync
                with model.disable_adapter():
                    return sequence_logps(model, input_ids, attention_mask, loss_mask, **images)[0]
            return sequence_logps(self.frozen, input_ids, attention_mask, loss_mask, **images)[0]

    def hidden(self, model, input_ids, attention_mask):
        """(last hidden states, LM head weight, bias) of π_ref without gradients: what Liger's chunked losses read
        (`training.use_liger_kernel`, train/fused_preference.py)."""
        import torch

        with torch.no_grad():
            if self.frozen is None:
                model = unwrap(model)
                with model.disable_adapter():
                    return (fused.last_hidden(model, input_ids, attention_mask), *fused.lm_head(model))
            return (fused.last_hidden(self.frozen, input_ids, attention_mask), *fused.lm_head(self.frozen))


# ------------------------------------------------------------------------------ the losses (per unit, as in TRL)


def dpo_losses(pc, pr, rc, rr, len_c, len_r, *, loss_type: str, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    """Per-pair losses and implicit rewards of the DPO family from summed reply log-probs (policy pc/pr, reference rc/rr)."""
    import torch.nn.functional as F

    if loss_type == "simpo":
        logits = beta * (pc / len_c.clamp(min=1) - pr / len_r.clamp(min=1)) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
        return losses, beta * (pc / len_c.clamp(min=1)).detach(), beta * (pr / len_r.clamp(min=1)).detach()
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = (1 - beta * delta).clamp(min=0)
    elif loss_type == "ipo":
        avg = chosen_ratio / len_c.clamp(min=1) - rejected_ratio / len_r.clamp(min=1)
        losses = (avg - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown dpo loss type {loss_type!r}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def log1mexp(x):
    """log(1 − exp(x)) for x < 0, stable on both sides of −ln 2."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(pc, pr, len_c, len_r, *, beta: float):
    """Per-pair odds-ratio term −β·log σ(log odds ratio) of the per-token mean log-probs, and the rewards β·mean log π."""
    import torch.nn.functional as F

    mc, mr = pc / len_c.clamp(min=1), pr / len_r.clamp(min=1)
    log_odds = (mc - mr) - (log1mexp(mc) - log1mexp(mr))
    return -beta * F.logsigmoid(log_odds), beta * mc.detach(), beta * mr.detach()


def kto_losses(logps, ref_logps, labels, kl, *, beta: float, desirable_weight: float, undesirable_weight: float):
    """Per-example KTO losses (Eq. 7 of the paper, as TRL) and the implicit rewards β·(log π − log π_ref)."""
    import torch

    ratio = logps - ref_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(labels, desirable, undesirable), beta * ratio.detach()


def pair_loss_at_zero_margin(method: str, pref) -> float:
    """The per-pair loss of a policy with no preference yet (zero margin): the scale a loss spike is judged against
    (`Objective.spike_floor`). sigmoid: ln 2; hinge: 1; ipo: (1 / 2β)²; simpo: softplus(γ); orpo: β·ln 2 (its NLL part is
    judged by the median)."""
    ln2 = math.log(2.0)
    if method == "orpo":
        return pref.beta * ln2
    if pref.loss_type == "hinge":
        return 1.0
    if pref.loss_type == "ipo":
        return (1.0 / (2.0 * pref.beta)) ** 2
    if pref.loss_type == "simpo":
        return math.log1p(math.exp(pref.simpo_gamma))
    return ln2


# ------------------------------------------------------------------------------ objectives


class PairObjective(Objective):
    """dpo (sigmoid / ipo / hinge / simpo, + optional `sft_weight`) and orpo on preference pairs; weight = pairs."""

    shards_eval = True  # in-training evals under several processes: each rank evaluates its batches (evaluate/shard.py)
    fused = None  # Liger's chunked loss for training (`training.use_liger_kernel`: fused_preference.setup); evaluation keeps `terms`

    def __init__(self, method: str, pref, reference: Reference | None, pad_id: int):
        self.method, self.pref, self.reference, self.pad_id = method, pref, reference, pad_id
        self.nll_weight = 1.0 if method == "orpo" else pref.sft_weight
        self.length_normalised = method == "orpo" or pref.loss_type == "simpo"
        self._nll_scale: float | None = None
        self.spike_floor = pair_loss_at_zero_margin(method, pref)

    def weight(self, examples: list[dict]) -> int:
        # the NLL term is a token mean over the whole window: each micro-batch's NLL sum is scaled by pairs / chosen tokens
        self._nll_scale = len(examples) / max(sum(len(ex["chosen_input_ids"]) for ex in examples), 1)
        return len(examples)

    def collate(self, examples: list[dict]) -> dict:
        import torch

        batch = collate_pairs(examples, self.pad_id)
        scale = self._nll_scale if self._nll_scale is not None else len(examples) / max(sum(len(ex["chosen_input_ids"]) for ex in examples), 1)
        batch["nll_scale"] = torch.tensor(scale, dtype=torch.float32)
        return batch

    def terms(self, model, batch: dict) -> dict:
        """Per-pair tensors: losses (incl. the NLL share), scores and implicit rewards of chosen and rejected."""
        ids, att, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        images = {k: v for k, v in batch.items() if k not in PAIR_KEYS}  # a vision-language model's pixel tensors
        logps, lens = sequence_logps(model, ids, att, lm, **images)
        pc, pr = logps.chunk(2)
        len_c, len_r = lens.chunk(2)
        p = self.pref
        if self.method == "orpo":
            losses, rew_c, rew_r = orpo_losses(pc, pr, len_c, len_r, beta=p.beta)
        else:
            rc = rr = None
            if self.reference is not None:
                rc, rr = self.reference.logps(model, ids, att, lm, **images).chunk(2)
            losses, rew_c, rew_r = dpo_losses(pc, pr, rc, rr, len_c, len_r, loss_type=p.loss_type, beta=p.beta, label_smoothing=p.label_smoothing, gamma=p.simpo_gamma)
        if self.nll_weight:
            losses = losses - self.nll_weight * batch["nll_scale"] * pc  # sums to weight x token-mean NLL of the chosen replies
        if self.length_normalised:
            sc, sr = pc / len_c.clamp(min=1), pr / len_r.clamp(min=1)
        else:
            sc, sr = pc, pr
        return {"losses": losses, "score_chosen": sc.detach(), "score_rejected": sr.detach(), "rewards_chosen": rew_c, "rewards_rejected": rew_r,
                "logp_chosen": pc.detach(), "logp_rejected": pr.detach(), "tokens_chosen": len_c, "tokens_rejected": len_r}

    def loss_sum(self, model, batch: dict):
        if self.fused is not None and all(k in PAIR_KEYS for k in batch):  # Liger's chunked loss reads no images: VLM pairs use `terms`
            return self.fused.pair_loss_sum(self, model, batch)
        t = self.terms(model, batch)
        margin = t["rewards_chosen"] - t["rewards_rejected"]
        figures = {
            "rewards/chosen": float(t["rewards_chosen"].sum()), "rewards/rejected": float(t["rewards_rejected"].sum()),
            "rewards/margin": float(margin.sum()), "rewards/accuracy": float((margin > 0).float().sum()),
        }
        return t["losses"].sum(), figures


class KTOObjective(Objective):
    """kto on unpaired rows {prompt, completion, label}; weight = examples."""

    shards_eval = True
    method = "kto"
    fused = None  # as PairObjective.fused

    def __init__(self, pref, reference: Reference, pad_id: int):
        self.pref, self.reference, self.pad_id = pref, reference, pad_id
        self.spike_floor = 0.5 * max(pref.desirable_weight, pref.undesirable_weight)  # 1 - sigmoid(0), weighted: KTO's start

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def collate(self, examples: list[dict]) -> dict:
        import torch

        def build(completions):
            seqs, masks = [], []
            for ex, c in zip(examples, completions):
                p, c = list(ex["prompt_input_ids"]), list(c)
                seqs.append(p + c)
                masks.append([0] * len(p) + [1] * len(c))
            return _pad(seqs, masks, self.pad_id)

        completions = [ex["completion_input_ids"] for ex in examples]
        batch = build(completions)
        kl = build(completions[-1:] + completions[:-1])  # mismatched pairs (x_i, y_{i-1}), as TRL rotates them
        if "mm" in examples[0]:  # images: each row's prompt keeps its images in the KL rows too (per-token extras at their width)
            batch.update(vision_chat.pair_tensors(examples, batch["input_ids"].shape[1], copies=1))
            kl.update({k: v for k, v in vision_chat.pair_tensors(examples, kl["input_ids"].shape[1], copies=1).items()
                       if v.dim() == 2 and v.shape == kl["input_ids"].shape})
        batch.update({f"kl_{k}": v for k, v in kl.items()})
        batch["label"] = torch.tensor([bool(ex["label"]) for ex in examples])
        return batch

    @staticmethod
    def images(batch: dict) -> tuple[dict, dict]:
        """(the pixel tensors of a vision-language batch's rows, those of its KL rows); both empty for text."""
        own = {k: v for k, v in batch.items() if k not in KTO_KEYS and not k.startswith("kl_")}
        kl = {k[3:]: v for k, v in batch.items() if k.startswith("kl_") and k[3:] not in PAIR_KEYS}
        return own, {**own, **kl}

    def terms(self, model, batch: dict) -> dict:
        import torch

        ids, att, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        images, kl_images = self.images(batch)  # a vision-language model's pixel tensors (data/vision_chat.py); none for text
        logps, lens = sequence_logps(model, ids, att, lm, **images)
        ref = self.reference.logps(model, ids, att, lm, **images)
        with torch.no_grad():
            kl_args = (batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_loss_mask"])
            kl = (sequence_logps(model, *kl_args, **kl_images)[0] - self.reference.logps(model, *kl_args, **kl_images)).mean().clamp(min=0)
        p = self.pref
        losses, rewards = kto_losses(logps, ref, batch["label"], kl, beta=p.beta, desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
        return {"losses": losses, "logps": logps.detach(), "lengths": lens, "rewards": rewards, "label": batch["label"], "kl": kl}

    def loss_sum(self, model, batch: dict):
        if self.fused is not None and all(k in KTO_KEYS or k.startswith("kl_") for k in batch):  # Liger reads no images: VLM rows use `terms`
            return self.fused.kto_loss_sum(self, model, batch)
        t = self.terms(model, batch)
        right = torch_where_sign(t["rewards"], t["label"])
        return t["losses"].sum(), {"kl": float(t["kl"]) * len(t["losses"]), "rewards/accuracy": float(right.sum())}


TIE = 1e-6  # |implicit reward (margin)| at or below this is a tie: the policy does not differ from the reference there


def torch_where_sign(rewards, labels):
    """1 where the implicit reward has the sign of the label (positive for desirable, negative for undesirable); a tie
    (|reward| <= TIE) is neither (reported apart as `reward_ties`)."""
    return ((rewards > TIE) & labels) | ((rewards < -TIE) & ~labels)


# ------------------------------------------------------------------------------ evaluation


def evaluate(model, objective: Objective, rows, *, batch_size: int) -> dict:
    """The objective's loss and the preference metrics (see the module docstring) on ``rows``."""
    import torch

    rows = list(rows)
    if not rows:
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, weight = 0.0, objective.weight(rows)  # the whole eval set is one window: NLL token means over all of it
    parts: dict[str, list] = {}

    todo, shard = sharding.batches(len(rows), batch_size)  # several processes in training: this rank's batches (evaluate/shard.py)
    done: dict[int, tuple] = {}
    with torch.no_grad():
        for b, i, counted in todo:
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in objective.collate(rows[i : i + batch_size]).items()}
            t = objective.terms(model, batch)
            if counted:
                done[b] = (float(t["losses"].sum()), {k: v.float().cpu() if v.dtype != torch.bool else v.cpu() for k, v in t.items() if k != "kl"})
    model.train(was_training)
    for loss_sum, terms in sharding.in_order(done, shard, units=lambda r: len(r[1]["losses"])):  # every batch, in order: one process's sums
        total += loss_sum
        for k, v in terms.items():
            parts.setdefault(k, []).append(v)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    out = {"loss": total / max(weight, 1)}
    if isinstance(objective, KTOObjective):
        out.update(_kto_metrics(rows, cat))
    else:
        m = cat["score_chosen"] - cat["score_rejected"]
        rm = cat["rewards_chosen"] - cat["rewards_rejected"]
        per_token = cat["logp_chosen"] / cat["tokens_chosen"].clamp(min=1) - cat["logp_rejected"] / cat["tokens_rejected"].clamp(min=1)
        out.update({
            "accuracy": float((m > 0).float().mean()), "margin": float(m.mean()),
            # the same comparison per reply token (mean log-prob of the chosen reply minus that of the rejected one): a
            # summed margin grows with reply length (~2000 nats on long answers says little); this one reads in nats/token
            "accuracy_per_token": float((per_token > 0).float().mean()), "margin_per_token": float(per_token.mean()),
            "reply_tokens_chosen": float(cat["tokens_chosen"].mean()), "reply_tokens_rejected": float(cat["tokens_rejected"].mean()),
            # TRL's rewards/accuracies counts a tie (policy = reference: every pair at the baseline) as wrong; ties are
            # reported apart so a 0 % baseline is read as "no preference yet", not as "always wrong" (chance: 50 %)
            "reward_accuracy": float((rm > TIE).float().mean()), "reward_ties": float((rm.abs() <= TIE).float().mean()),
            "reward_margin": float(rm.mean()),
            "rewards_chosen": float(cat["rewards_chosen"].mean()), "rewards_rejected": float(cat["rewards_rejected"].mean()),
        })
    return out


def _kto_metrics(rows: list[dict], t: dict) -> dict:
    import torch

    labels = t["label"].bool()
    by_prompt: dict[tuple, dict] = {}
    for i, r in enumerate(rows):
        by_prompt.setdefault((tuple(r["prompt_input_ids"]), r.get("mm")), {})  # the same question about another image is another prompt.setdefault(bool(r["label"]), []).append(i)
    matched = [(d[True][0], d[False][0]) for d in by_prompt.values() if True in d and False in d]
    if matched:
        diffs = torch.tensor([float(t["logps"][a] - t["logps"][b]) for a, b in matched])
    else:  # no prompt with both kinds: every desirable x undesirable combination, per-token mean log-prob
        mean = t["logps"] / t["lengths"].clamp(min=1)
        diffs = (mean[labels][:, None] - mean[~labels][None, :]).flatten()
    out = {
        "accuracy": float((diffs > 0).float().mean()) if len(diffs) else float("nan"),
        "margin": float(diffs.mean()) if len(diffs) else float("nan"),
        "pairs_compared": len(diffs), "reward_accuracy": float(torch_where_sign(t["rewards"], labels).float().mean()),
        "reward_ties": float((t["rewards"].abs() <= TIE).float().mean()),
    }
    if labels.any():
        out["rewards_desirable"] = float(t["rewards"][labels].mean())
    if (~labels).any():
        out["rewards_undesirable"] = float(t["rewards"][~labels].mean())
    return out
