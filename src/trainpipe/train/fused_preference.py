"""Liger's chunked preference losses for `training.use_liger_kernel`: dpo (`sigmoid`, `hinge`, `simpo`), orpo and kto
computed from the last hidden state and the LM head's weight one pair (one example for kto) at a time, so the
batch x sequence x vocabulary logits of the policy and of the reference are never made in one piece.

Liger's chunked losses (`liger_kernel.chunked_loss`) are plain PyTorch (torch.compile'd on request), not Triton, so they
run on the CPU as on a GPU: trainpipe compiles them on CUDA only (on the CPU the compile would cost more than it saves).
Each is checked equal to trainpipe's own loss, value and gradients, on the same batch
(``tests/unit/test_fused_preference.py``); where Liger has no equal loss the run says so once and uses trainpipe's:

- dpo ``ipo`` (Liger's DPO has none: it needs the per-pair reply lengths), dpo ``sigmoid`` with `label_smoothing` > 0
  (Liger's ``robust`` is a different, unbiased loss), kto with `desirable_weight` != `undesirable_weight` (Liger's KTO
  weighs both sides alike; equal weights scale its loss);
- a model whose logits are not the LM head applied to the last hidden state (soft-capped or scaled logits, an adapter on
  the LM head), checked once on a probe; FSDP and ZeRO-3 (the LM head is sharded outside the forward; caught at the
  first step).

The NLL term of orpo and of `sft_weight` stays the token mean over the whole optimizer window (the loop's contract):
Liger divides each micro-batch's NLL sum by that micro-batch's chosen tokens, so its NLL weight ``alpha`` is set per
micro-batch to undo that. The in-training and final evaluations keep trainpipe's own losses (they need every per-pair
figure; without gradients the logits are freed batch by batch).
"""

from __future__ import annotations

import functools
from pathlib import Path

from trainpipe.distributed.ddp import unwrap
from trainpipe.track.manifest import update_manifest

IGNORE_INDEX = -100
RULE = ("Liger's chunked preference losses are plain PyTorch: they run on the CPU and on a GPU (torch.compile'd on CUDA "
        "only), from the last hidden state and the LM head, so the full logits are never materialised.")


def unsupported(method: str, pref) -> str | None:
    """Why Liger has no chunked loss equal to trainpipe's for this objective; None when it has one."""
    if method == "kto":
        if pref.desirable_weight != pref.undesirable_weight:
            return ("Liger's KTO weighs desirable and undesirable examples alike, and `method.preference.desirable_weight` != "
                    "`undesirable_weight`")
        return None
    if method == "orpo":
        return None
    if pref.loss_type == "ipo":
        return "Liger's DPO has no `ipo` loss (it needs each pair's reply lengths)"
    if pref.loss_type == "sigmoid" and pref.label_smoothing:
        return ("Liger's DPO `sigmoid` has no `label_smoothing` (its `robust` loss is a different, unbiased one), and "
                "`method.preference.label_smoothing` is set")
    return None  # sigmoid, hinge, simpo


def implementation(method: str, pref) -> str:
    """The name of Liger's loss used for this objective (the run manifest's `loss.implementation`)."""
    if method in ("orpo", "kto"):
        return f"liger_chunked_{method}"
    return "liger_chunked_simpo" if pref.loss_type == "simpo" else f"liger_chunked_dpo_{pref.loss_type}"


def lm_head(model):
    """(weight, bias) of the LM head the last hidden state goes through (the base model's under PEFT and DDP)."""
    from peft import PeftModel

    model = unwrap(model)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    head = base.get_output_embeddings()
    return head.weight, head.bias


def last_hidden(model, input_ids, attention_mask):
    """The final (normed) hidden states of the real positions, with logits for the last position only: what the LM head
    reads. Through the model's own forward, so DDP and PEFT wrappers stay in the path (prompt tuning's virtual tokens
    are cut off, as the logits are in `sequence_logps`)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    h = out.hidden_states[-1]
    return h[:, h.size(1) - input_ids.size(1):]


def targets(input_ids, loss_mask):
    """Next-token targets aligned with ``hidden[:, :-1]``: the reply tokens, IGNORE_INDEX elsewhere."""
    import torch

    return torch.where(loss_mask[:, 1:].bool(), input_ids[:, 1:], IGNORE_INDEX)


def model_fits(model) -> str | None:
    """Why the LM head applied to the last hidden state is not this model's logits (None: it is), checked on a probe of
    a few tokens without gradients. (FSDP, which shards the model after this, is caught at the first step.)"""
    import torch
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"the model's LM head is a {type(head).__name__}, not a plain linear layer (an adapter or wrapper on it)"
    device = head.weight.device
    ids = torch.arange(1, 5, device=device).unsqueeze(0) % head.weight.size(0)
    att = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, -1].float()
            h = last_hidden(model, ids, att)[:, -1]
            mine = torch.nn.functional.linear(h, head.weight, head.bias).float()
    except (TypeError, ValueError, AttributeError) as e:  # a model class without `logits_to_keep` or hidden states
        return f"the model's forward cannot return its last hidden state with `logits_to_keep` ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    if not torch.allclose(full, mine, rtol=1e-3, atol=1e-3 * float(full.abs().max().clamp(min=1.0))):
        return "the model's logits are not its LM head applied to the last hidden state (soft-capped or scaled logits)"
    return None


@functools.lru_cache(maxsize=1)
def _orpo_function():
    """Liger's ORPO with its NLL weight (``alpha``) settable: its public class fixes it at 1, and trainpipe's NLL is a
    token mean over the whole window, not over one micro-batch (see the module docstring)."""
    from liger_kernel.chunked_loss.fused_linear_preference import LigerFusedLinearPreferenceBase
    from liger_kernel.chunked_loss.orpo_loss import LigerFusedLinearORPOFunction

    class WeightedORPO(LigerFusedLinearORPOFunction):
        @staticmethod
        def forward(ctx, _input, weight, target, bias, beta, alpha, compiled):
            return LigerFusedLinearPreferenceBase.forward(
                cls=LigerFusedLinearORPOFunction, ctx=ctx, _input=_input, weight=weight, target=target, bias=bias,
                ignore_index=IGNORE_INDEX, beta=beta, alpha=alpha, compute_nll_loss=True, compiled=compiled,
            )

        @staticmethod
        def backward(ctx, *grad_output):
            grads = LigerFusedLinearPreferenceBase.backward(ctx, grad_output)[:4]
            return *grads, None, None, None

    return WeightedORPO


def no_grad_logps(hidden, weight, bias, target):
    """Summed reply log-probs per row without gradients, one row's logits at a time (kto's reference point and rewards)."""
    import torch

    out = []
    with torch.no_grad():
        for h, t in zip(hidden, target):
            logp = torch.nn.functional.linear(h, weight, bias).float().log_softmax(-1)
            keep = t != IGNORE_INDEX
            out.append((logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum())
    return torch.stack(out)


class FusedPreference:
    """The loss of a PairObjective or KTOObjective (train/preference.py) through Liger's chunked losses; ``reference``
    gives the reference's (hidden states, weight, bias) without gradients."""

    def __init__(self, method: str, pref, compiled: bool, say=print):
        self.method, self.pref, self.compiled, self.say = method, pref, compiled, say

    def sharded(self, objective, weight) -> bool:
        """FSDP (a DTensor) and DeepSpeed ZeRO-3 (a partitioned parameter, `ds_id`) hold the LM head's weight sharded
        outside the forward: Liger cannot read it, so the objective falls back to trainpipe's loss from here on, said
        once and recorded."""
        if type(weight).__name__ != "DTensor" and not hasattr(weight, "ds_id"):
            return False
        why = "under FSDP or ZeRO-3 the LM head's weight is sharded outside the forward"
        self.say(f"`training.use_liger_kernel: true`: {why}, so this run trains with trainpipe's own preference loss.")
        objective.fused, objective.loss_record = None, {"implementation": "trainpipe", "use_liger_kernel": True, "why": why}
        return True

    def pair_loss_sum(self, objective, model, batch: dict):
        """(sum of per-pair losses, figures) as PairObjective.loss_sum returns them."""
        ids, att, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        n, p = ids.size(0) // 2, self.pref
        weight, bias = lm_head(model)
        if self.sharded(objective, weight):
            return objective.loss_sum(model, batch)
        h = last_hidden(model, ids, att)[:, :-1]
        target = targets(ids, lm)
        alpha = 1.0
        if objective.nll_weight:  # Liger's NLL: sum / this micro-batch's chosen tokens; trainpipe's: sum x nll_scale / pairs
            tokens = int((target[:n] != IGNORE_INDEX).sum())
            alpha = objective.nll_weight * float(batch["nll_scale"]) * max(tokens, 1) / n
        if self.method == "orpo":
            loss, aux = _orpo_function().apply(h, weight, target, bias, p.beta, alpha, self.compiled)
        elif p.loss_type == "simpo":
            from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

            fn = LigerFusedLinearSimPOLoss(ignore_index=IGNORE_INDEX, beta=p.beta, alpha=alpha, label_smoothing=p.label_smoothing,
                                           compute_nll_loss=bool(objective.nll_weight), compiled=self.compiled, gamma=p.simpo_gamma)
            loss, aux = fn(weight, h, target, bias)
        else:
            from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

            ref_h, ref_w, ref_b = objective.reference.hidden(model, ids, att)
            fn = LigerFusedLinearDPOLoss(ignore_index=IGNORE_INDEX, beta=p.beta, alpha=alpha, compute_nll_loss=bool(objective.nll_weight),
                                         compiled=self.compiled, use_ref_model=True, average_log_prob=False, loss_type=p.loss_type)
            loss, aux = fn(weight, h, target, bias, ref_input=ref_h[:, :-1], ref_weight=ref_w, ref_bias=ref_b)
        rew_c, rew_r = aux[5], aux[6]
        margin = rew_c - rew_r
        figures = {"rewards/chosen": float(rew_c.sum()), "rewards/rejected": float(rew_r.sum()),
                   "rewards/margin": float(margin.sum()), "rewards/accuracy": float((margin > 0).float().sum())}
        return loss * n, figures

    def kto_loss_sum(self, objective, model, batch: dict):
        """(sum of per-example losses, figures) as KTOObjective.loss_sum returns them."""
        import torch

        from liger_kernel.chunked_loss import LigerFusedLinearKTOLoss

        ids, att, lm, labels = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["label"]
        p, ref = self.pref, objective.reference
        weight, bias = lm_head(model)
        if self.sharded(objective, weight):
            return objective.loss_sum(model, batch)
        h = last_hidden(model, ids, att)[:, :-1]
        target = targets(ids, lm)
        ref_h, ref_w, ref_b = ref.hidden(model, ids, att)
        with torch.no_grad():  # the reference point z from mismatched pairs, one row's logits at a time
            kl_ids, kl_att, kl_lm = batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_loss_mask"]
            kl_target = targets(kl_ids, kl_lm)
            kl_h = last_hidden(model, kl_ids, kl_att)[:, :-1]
            kl_ref_h, _, _ = ref.hidden(model, kl_ids, kl_att)
            kl = (no_grad_logps(kl_h, weight, bias, kl_target) - no_grad_logps(kl_ref_h[:, :-1], ref_w, ref_b, kl_target)).mean().clamp(min=0)
            rewards = p.beta * (no_grad_logps(h, weight, bias, target) - no_grad_logps(ref_h[:, :-1], ref_w, ref_b, target))
        fn = LigerFusedLinearKTOLoss(ignore_index=IGNORE_INDEX, beta=p.beta, compiled=self.compiled, use_ref_model=True, average_log_prob=False)
        loss, _ = fn(_input=h, lin_weight=weight, target=target, bias=bias, preference_labels=labels,
                     ref_input=ref_h[:, :-1], ref_weight=ref_w, ref_bias=ref_b, kl=kl)
        right = ((rewards > 0) & labels) | ((rewards < 0) & ~labels)
        return loss * (len(labels) * p.desirable_weight), {"kl": float(kl) * len(labels), "rewards/accuracy": float(right.sum())}


def setup(objective, model, device_type: str, *, say) -> bool:
    """`training.use_liger_kernel: true` for a preference objective: Liger's chunked loss when it has one equal to
    trainpipe's and the model fits it (``objective.fused``); otherwise ``say`` once why not and keep trainpipe's loss.
    ``objective.loss_record`` says which ran (the run manifest's `loss`). True when Liger's loss is used."""
    method, pref = objective.method, objective.pref
    why = unsupported(method, pref)
    if why is None:
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except ImportError:
            why = ("the `liger-kernel` package is not installed (`pip install 'trainpipe[gpu]'` or `pip install liger-kernel`)")
    if why is None:
        why = model_fits(model)
    if why is not None:
        name = method if method != "dpo" else f"dpo `{pref.loss_type}`"
        say(f"`training.use_liger_kernel: true`: {why}, so {name} trains with trainpipe's own loss (the same value; the "
            "logits are made per micro-batch).")
        objective.loss_record = {"implementation": "trainpipe", "use_liger_kernel": True, "why": why}
        return False
    objective.fused = FusedPreference(method, pref, compiled=device_type == "cuda", say=say)
    say(f"`training.use_liger_kernel: true`: {method if method != 'dpo' else 'dpo ' + pref.loss_type} trains with "
        f"{implementation(method, pref)}. {RULE}")
    objective.loss_record = {"implementation": implementation(method, pref), "use_liger_kernel": True,
                             "compiled": device_type == "cuda", "device": device_type}
    return True


def record(run_dir: Path, objective) -> None:
    """State which loss implementation ran in the run manifest (`loss`: its implementation, and why not Liger's when
    `training.use_liger_kernel` asked for it), for every objective (train/sft.py `build_loop`; "trainpipe": its own)."""
    loss = getattr(objective, "loss_record", None) or {"implementation": "trainpipe", "use_liger_kernel": False}
    update_manifest(run_dir, lambda man: man.__setitem__("loss", loss))
