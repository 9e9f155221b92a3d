"""The losses of online RL as pure tensor functions (no model, no sampling): GRPO's clipped surrogate with its four
normalisations and PPO's generalised advantage estimation, clipped policy and value losses and KL-in-the-reward.

Every function takes per-token tensors [sequences, completion positions] and a 0/1 float mask of the completion
tokens. The formulas are TRL 1.16's GRPOTrainer._compute_loss (GRPO) and TRL's experimental PPOTrainer.train (PPO, as
it stood in TRL 1.0, the last release that ships it); tests/unit/test_rl_losses.py checks them against TRL.

Window-exact normalisation. A loss is written as (sum of per-sequence parts) / denominator, where the denominator is
a property of the whole optimizer step's window of rollouts, not of a micro-batch:
- `grpo`: the mean over a sequence's tokens, averaged over sequences (denominator: sequences);
- `dr_grpo`: a sequence's token sum / `max_new_tokens`, averaged over sequences (denominator: sequences);
- `dapo` and `bnpo`: every token of the window weighs the same (denominator: the window's completion tokens). TRL's
  `dapo` divides by the tokens of the generation batch (the same); its `bnpo` by the tokens of each micro-batch, which
  equals this when a step is one micro-batch and makes the step depend on the micro-batching otherwise.
So any split of a window into micro-batches gives the same update.
"""

from __future__ import annotations

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


def k3(logp, ref):
    """Per-token k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    import torch

    return torch.exp(ref - logp) - (ref - logp) - 1


def clipped_surrogate(logp, old, adv, eps_low: float, eps_high: float):
    """-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) per token, ratio = exp(logp - old) (PPO-clip as
    GRPO applies it; at the rollout's own policy ratio = 1 with the gradient of logp). ``adv`` is [N] or [N, T]."""
    import torch

    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return -torch.min(ratio * adv, clipped * adv)


def grpo_token_loss(logp, old, ref, adv, *, eps_low: float, eps_high: float, beta: float):
    """GRPO's per-token loss: the clipped surrogate plus beta x k3 KL to the reference, importance-weighted by the ratio
    to the rollout's policy (TRL's `use_bias_correction_kl`, its default: the samples come from the old policy, and at
    ratio 1 the weight adds the score-function part of the KL's gradient). At beta 0 the KL term is left out."""
    import torch

    loss = clipped_surrogate(logp, old, adv, eps_low, eps_high)
    return loss + beta * k3(logp, ref) * torch.exp(logp - old) if beta else loss


def sequence_parts(per_token, mask, loss_type: str, max_new_tokens: int):
    """Per-sequence numerators whose sum over a window, divided by :func:`denominator`, is the window's loss."""
    s = (per_token * mask).sum(1)
    if loss_type == "grpo":
        return s / mask.sum(1).clamp(min=1.0)
    if loss_type == "dr_grpo":
        return s / max_new_tokens
    if loss_type in ("dapo", "bnpo"):
        return s
    raise ValueError(f"unknown loss_type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")


def denominator(mask, loss_type: str) -> float:
    """The window's denominator for `loss_type`: its sequences (grpo, dr_grpo) or its completion tokens (dapo, bnpo)."""
    if loss_type in ("dapo", "bnpo"):
        return max(float(mask.sum()), 1.0)
    return float(mask.shape[0])


def grpo_loss(logp, old, ref, adv, mask, *, loss_type: str, eps_low: float, eps_high: float, beta: float, max_new_tokens: int):
    """The loss of one window of rollouts (all of it in one batch)."""
    per_token = grpo_token_loss(logp, old, ref, adv, eps_low=eps_low, eps_high=eps_high, beta=beta)
    return sequence_parts(per_token, mask, loss_type, max_new_tokens).sum() / denominator(mask, loss_type)


# ------------------------------------------------------------------------------ PPO


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def masked_whiten(values, mask, shift_mean: bool = True):
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var with Bessel's correction (TRL's masked_whiten)."""
    import torch

    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    if n <= 1:
        raise ValueError("whitening needs at least two completion tokens in a step: raise the batch size or `max_new_tokens`")
    var = var * n / (n - 1)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def value_mask(mask):
    """The positions whose value is learnt: every completion token and the one after the last (the state after the
    whole completion, where the score is paid when the completion ends before `max_new_tokens`) - TRL's `~padding_mask_p1`."""
    import torch

    lengths = mask.sum(1).long()  # completion tokens (through the stop token)
    idx = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    return (idx <= lengths.unsqueeze(1)).to(mask.dtype)


def ppo_rewards(scores, logp, ref, mask, *, kl_coef: float, kl_estimator: str = "k1"):
    """Per-token rewards: -kl_coef x KL(policy || reference) at each completion token (k1: logp - ref; k3), plus the
    sequence's score at the position after its last token (at the last token when the completion fills every position)."""
    import torch

    logr = (ref - logp) * mask
    kl = -logr if kl_estimator == "k1" else (logr.exp() - 1) - logr
    rewards = -kl_coef * kl
    lengths = mask.sum(1).long()
    T = mask.shape[1]
    end = torch.where(lengths < T, lengths, lengths - 1).clamp(min=0)
    rewards = rewards.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), end] += scores
    return rewards, kl


def gae(rewards, values, mask, *, gamma: float, lam: float):
    """Generalised advantage estimation over the completion positions (values beyond `value_mask` are zero): returns
    (advantages whitened over the completion tokens and zero elsewhere, returns = raw advantages + values)."""
    import torch

    vmask = value_mask(mask)
    values = values * vmask
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(T)):
        nxt = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    adv = masked_whiten(adv, mask) * mask
    return adv, returns


def ppo_policy_parts(logp, old, adv, mask, clip: float):
    """Per-token clipped PPO policy loss max(-A ratio, -A clip(ratio, 1 +- clip)) summed over the masked tokens, per
    sequence (the window's loss: their sum over the window's completion tokens)."""
    import torch

    ratio = torch.exp(logp - old)
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip))
    return (pg * mask).sum(1)


def ppo_value_parts(vpred, old_values, returns, vmask, clip: float):
    """Per-sequence sums of the clipped value loss 0.5 x max((v - R)^2, (clip(v, v_old +- clip) - R)^2) over `value_mask`."""
    import torch

    vclipped = torch.clamp(vpred, old_values - clip, old_values + clip)
    vf = torch.max((vpred - returns) ** 2, (vclipped - returns) ** 2)
    return 0.5 * (vf * vmask).sum(1)


def ppo_loss(logp, old, adv, vpred, old_values, returns, mask, *, clip: float, value_clip: float, vf_coef: float):
    """PPO's loss on one window in one batch: the token mean of the policy loss + vf_coef x the token mean of the value loss."""
    vmask = value_mask(mask)
    pg = ppo_policy_parts(logp, old, adv, mask, clip).sum() / mask.sum()
    vf = ppo_value_parts(vpred * vmask, old_values, returns, vmask, value_clip).sum() / vmask.sum()
    return pg + vf_coef * vf
