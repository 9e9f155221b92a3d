"""RL's losses against TRL, and the window-exactness of every loss under micro-batching.

- GRPO (`loss_type` grpo, dapo, dr_grpo, bnpo; clipped ratios to old log-probs; KL to the reference): TRL 1.16's own
  `GRPOTrainer._compute_loss`, on a real GRPOTrainer around the tiny Llama, computes the loss (its model forward
  included) on the same prompt and completion ids, masks, advantages, old and reference log-probs; trainpipe's
  objective forward plus train/rl_losses.py must give the same loss (1e-6) and the same gradient.
- PPO: TRL 1.13 removed `trl.experimental.ppo` (1.16 has no PPO to call). The reference below is the PPO step of
  TRL 1.12's `trl/experimental/ppo/ppo_trainer.py` (`PPOTrainer.train`, the blocks "4. compute rewards" to "6. compute
  advantages and returns" and the minibatch loss), transcribed line for line with its padding conventions
  (INVALID_LOGPROB, `padding_mask_p1`); trainpipe's functions must equal it.
- A window split into micro-batches of 1, 2 or all of its prompts gives the same gradient, for every loss type and PPO.
"""

import copy
import types
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")

from trainpipe.config import RLConfig  # noqa: E402
from trainpipe.train import rl_losses as L  # noqa: E402
from trainpipe.train.rl_policy import PolicyGradient, attach_value_head  # noqa: E402

LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "bnpo"]


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return tok, model


def batch(tok, n=6, prompt_len=5, T=7, seed=0):
    """Equal-length prompts (no padding: TRL numbers positions without the attention mask), completions of different
    lengths right-padded, a few ending in a stop token."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    p_ids = torch.randint(5, vocab, (n, prompt_len), generator=g)
    comp = torch.randint(5, vocab, (n, T), generator=g)
    lengths = torch.tensor([T, 3, 5, 1, T, 4][:n])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    comp = torch.where(mask.bool(), comp, torch.full_like(comp, tok.pad_token_id))
    return p_ids, torch.ones_like(p_ids), comp, mask


def grpo_trainer(tok, model, tmp_path, *, loss_type, beta, eps, eps_high, T):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=6, num_generations=2,
                      max_completion_length=T, loss_type=loss_type, beta=beta, epsilon=eps, epsilon_high=eps_high, temperature=0.7,
                      logging_steps=1)
    trainer = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Say one."}] * 6), processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_losses_equal_trl_grpo_trainer(parts, tmp_path, loss_type):
    tok, model = parts
    T, beta, eps, eps_high = 7, 0.04, 0.2, 0.28
    trainer = grpo_trainer(tok, model, tmp_path, loss_type=loss_type, beta=beta, eps=eps, eps_high=eps_high, T=T)
    p_ids, p_mask, comp, mask = batch(tok, T=T)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(6, generator=g)
    rl = RLConfig(reward_function="x:y", loss_type=loss_type, kl_coef=beta, epsilon=eps, epsilon_high=eps_high, temperature=0.7,
                  max_new_tokens=T, num_generations=2, num_iterations=2)
    obj = PolicyGradient(tok, None, rl, stop_ids=[tok.eos_token_id])
    ours_model = copy.deepcopy(model).train()
    with torch.no_grad():  # old and reference log-probs a little away from the policy's, so ratios clip on both sides
        base, _ = obj.forward(ours_model, p_ids, p_mask, comp, mask.float())
        old = base + 0.3 * torch.randn(base.shape, generator=g)
        ref = base + 0.5 * torch.randn(base.shape, generator=g)
    inputs = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": comp, "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()

    logp, _ = obj.forward(ours_model, p_ids, p_mask, comp, mask.float())
    ours = L.grpo_loss(logp, old, ref, adv, mask.float(), loss_type=loss_type, eps_low=eps, eps_high=eps_high, beta=beta, max_new_tokens=T)
    ours.backward()
    assert abs(float(ours) - float(theirs)) < 1e-6, (float(ours), float(theirs))
    clipped = (torch.exp(logp - old) > 1 + eps_high) | (torch.exp(logp - old) < 1 - eps)
    assert (clipped & mask.bool()).any()  # the clipping really acts in this batch
    for (name, a), (_, b) in zip(ours_model.named_parameters(), trainer.model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name


INVALID_LOGPROB = 1.0


def trl_112_ppo_step(logprobs, ref_logprobs, values, scores, responses, pad_id, new_logprobs, vpred, *, kl_coef, gamma, lam, cliprange,
                     cliprange_value, vf_coef):
    """TRL 1.12 `PPOTrainer.train`'s PPO step, transcribed (its helpers `masked_mean`, `masked_var`, `masked_whiten` and
    `first_true_indices` inlined below as TRL defines them)."""
    def masked_mean(v, m):
        return (v * m).sum() / m.sum()

    def masked_whiten(v, m, shift_mean=True):
        mean = masked_mean(v, m)
        var = masked_mean((v - mean) ** 2, m) * (m.sum() / (m.sum() - 1))
        w = (v - mean) * torch.rsqrt(var + 1e-8)
        return w if shift_mean else w + mean

    def first_true_indices(bools):
        row_len = bools.size(-1)
        zero_or_index = row_len * (~bools).type(torch.long) + torch.arange(row_len)
        return torch.min(zero_or_index, dim=-1).values

    sequence_lengths = first_true_indices(responses == pad_id) - 1
    response_idxs = torch.arange(responses.shape[1]).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr  # kl_estimator "k1" (the default)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0))
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    # the minibatch loss (the whole batch as one minibatch)
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, INVALID_LOGPROB)
    vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), ~padding_mask_p1)
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), ~padding_mask)
    return pg_loss + vf_coef * vf_loss, advantages, returns


def test_ppo_equals_trl_ppo_step(parts):
    tok, _ = parts
    g = torch.Generator().manual_seed(7)
    N, T, pad = 6, 7, tok.pad_token_id
    lengths = torch.tensor([T, 3, 5, 1, T - 1, 4])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    responses = torch.where(mask.bool(), torch.randint(5, 300, (N, T), generator=g), torch.full((N, T), pad))
    logp, ref, new = (-torch.rand(N, T, generator=g) * 3 for _ in range(3))
    new = logp + 0.3 * torch.randn(N, T, generator=g)
    values, vpred = torch.randn(N, T, generator=g), torch.randn(N, T, generator=g)
    scores = torch.randn(N, generator=g)
    kw = dict(kl_coef=0.05, gamma=0.99, lam=0.95)
    theirs, adv_t, ret_t = trl_112_ppo_step(logp, ref, values, scores, responses, pad, new, vpred, cliprange=0.2, cliprange_value=0.2,
                                            vf_coef=0.1, **kw)
    token_rewards, _ = L.ppo_rewards(scores, logp, ref, mask, kl_coef=kw["kl_coef"])
    adv, returns = L.gae(token_rewards, values, mask, gamma=kw["gamma"], lam=kw["lam"])
    vmask = L.value_mask(mask)
    assert torch.allclose(adv, adv_t, atol=1e-6) and torch.allclose(returns * vmask, ret_t * vmask, atol=1e-6)
    ours = L.ppo_loss(new, logp, adv, vpred, values * vmask, returns, mask, clip=0.2, value_clip=0.2, vf_coef=0.1)
    assert abs(float(ours) - float(theirs)) < 1e-6, (float(ours), float(theirs))


def rollout_objective(tok, model, rl: RLConfig):
    """The objective around the tiny Llama with a letter-share reward; its reference a perturbed copy (KL not zero)."""
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    reward = lambda p, c, pt, ct: [sum(ch.isalpha() for ch in x) / max(len(x), 1) + 0.1 * len(ct[i]) for i, x in enumerate(c)]  # noqa: E731
    stops = [tok.eos_token_id, *range(5, 160)]  # many stop tokens: the random model's completions end at different lengths
    obj = PolicyGradient(tok, reward, rl, stop_ids=stops, reference=reference, seed=11)
    obj.policy = model
    return obj


def window_grads(obj, model, examples, micro: int):
    """What the stepper does with a window: weight once, then each micro-batch's loss_sum / weight, backward."""
    model.zero_grad(set_to_none=True)
    w = obj.weight(examples)
    for i in range(0, len(examples), micro):
        loss, _ = obj.loss_sum(model, obj.collate(examples[i : i + micro]))
        (loss / w).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_split_invariant(obj, model, examples):
    whole = window_grads(obj, model, examples, len(examples))
    for micro in (1, 2):
        split = window_grads(obj, model, examples, micro)
        assert whole.keys() == split.keys() and len(whole) > 0
        for n in whole:
            assert torch.allclose(whole[n], split[n], atol=1e-6, rtol=1e-4), (obj.rl.loss_type, micro, n)
    return whole


def prompts(n=4):
    g = torch.Generator().manual_seed(5)
    return [{"prompt_input_ids": torch.randint(5, 300, (int(k),), generator=g).tolist()} for k in (3, 5, 4, 6)[:n]]


def test_micro_batch_split_gives_the_same_update_for_every_loss_type(parts):
    """One window's rollouts (sampled once, completions of different lengths), the four normalisations in turn."""
    tok, base = parts
    model = copy.deepcopy(base).train()
    rl = RLConfig(reward_function="x:y", num_generations=3, max_new_tokens=6, kl_coef=0.1)
    obj = rollout_objective(tok, model, rl)
    examples = prompts()
    grads = {}
    for loss_type in LOSS_TYPES:
        obj.rl = rl.model_copy(update={"loss_type": loss_type})
        grads[loss_type] = assert_split_invariant(obj, model, examples)
    lengths = obj._group.c_mask.sum(1)
    assert lengths.min() < lengths.max()  # completions of different lengths: the normalisations differ ...
    name = next(iter(grads["grpo"]))
    assert not torch.allclose(grads["grpo"][name], grads["dapo"][name])  # ... and so do their updates


def test_micro_batch_split_gives_the_same_ppo_update(parts):
    tok, base = parts
    model = copy.deepcopy(base).train()
    head = attach_value_head(model)
    with torch.no_grad():
        head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    obj = rollout_objective(tok, model, RLConfig(reward_function="x:y", algorithm="ppo", num_generations=2, max_new_tokens=6, kl_coef=0.1))
    grads = assert_split_invariant(obj, model, prompts())
    assert grads["v_head.weight"].abs().sum() > 0  # the value loss reaches the value head
