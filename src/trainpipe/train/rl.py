"""Online RL against a reward, with KL control to the reference, top to bottom: reward (a
reward model folder or a Python function) -> policy (+ PEFT; + a value head for PPO) and reference ->
the rollout engine -> baseline mean reward and KL on held-out prompts -> train (roll out, score, update)
-> final mean reward and KL with the best checkpoint -> export.

Algorithms (`method.rl.algorithm`; the objective is train/rl_policy.py, the losses train/rl_losses.py):
- `grpo`: advantage of completion i of a prompt = (r_i - mean(r)) / (std(r) + 1e-4) over the
  `num_generations` completions of that prompt (group-normalised, DeepSeekMath).
- `rloo`: advantage = r_i - mean of the other completions' rewards (leave-one-out baseline).
- `ppo`: a value head on the policy's last hidden state (zero at the start, trained with the policy,
  removed before export), the KL to the reference paid per token in the reward (k1, `kl_coef`), the
  score at the end, GAE (`gamma`, `lam`) advantages whitened over the step, the clipped policy loss
  and `vf_coef` x the clipped value loss - TRL's experimental PPOTrainer's step.

grpo/rloo per completion token t: loss_t = -min(ratio_t A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high)
A) + kl_coef * ratio_t * KL_t, ratio_t = exp(logp_t - old_t) to the rollout's policy (value 1 when each
rollout serves one step) and KL_t the k3 estimator exp(ref_t - logp_t) - (ref_t - logp_t) - 1 of
KL(policy || reference), as TRL 1.16's GRPOTrainer computes it; normalised over the whole step by
`loss_type` (grpo, dapo, dr_grpo, bnpo). `num_iterations` > 1 reuses a step's rollouts for that many
optimizer steps, their log-probs the old policy's. Any micro-batch split of a step is exact.

- Rollouts (`method.rl.rollout`, train/rollout.py): the model's `generate`, or a vLLM engine colocated
  on the GPU (asleep during the update, the weights synced before each rollout); every prompt samples
  under its own seed (training.seed, the rollout's index, the prompt), so a resumed run samples exactly
  what the uninterrupted one would have. Evaluation samples with fixed seeds of its own
  (`training.seed` + the batch's index) and leaves the training RNG untouched.
- Reference: with PEFT the base with the adapter switched off (`model.disable_adapter()`, no
  second copy); under a full fine-tune a frozen copy of the starting model.
- Reward: `method.rl.reward_function` (`package.module:function` or `path/to/file.py:function`),
  called as f(prompts, completions) -> list of floats, prompts being the text the policy saw
  (chat template included) and completions plain text cut at the first end-of-turn/EOS token;
  or `method.rl.reward_model` (the `model/` folder of a `method.name: reward` run, loaded with
  train/reward.py's `load_reward_model`), which scores the exact tokens the policy read and wrote
  (prompt ids + completion ids through the stop token + the template's turn suffix), so it must
  share the policy's vocabulary (it does when trained from the same base, as in stages).
- Prompts: SFT rows give the tokens before the first labelled token (the conversation up to the
  first reply); preference and KTO rows their `prompt_input_ids`.
- The loop's loss-spike rollback is off here: an RL loss (about kl_coef x KL, its policy part
  zero in value) is no divergence signal. NaN/Inf detection stays on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from trainpipe import ui
from trainpipe.config import RLConfig
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.train import sft
from trainpipe.train.context import RunContext
from trainpipe.evaluate import suite
from trainpipe.export import export_model
from trainpipe.model.custom import import_object
from trainpipe.model.loading import build_model, parameter_counts
from trainpipe.evaluate import shard as sharding
from trainpipe.data.collate import right_pad
from trainpipe.train.reward import load_reward_model
from trainpipe.train.rl_policy import (PolicyGradient, Reward, advantages, attach_value_head, completion_mask, frozen_copy,  # noqa: F401
                                       left_pad, prompt_ids)
from trainpipe.train.rollout import VLLMRollout, choose_rollout, vllm_installed
from trainpipe.data.tokenize import encode_texts, end_of_turn_ids, Template

RewardFn = Callable[[list[str], list[str]], list[float]]  # a user's reward function: (prompts, completions) -> rewards

def run(ctx: RunContext) -> dict:
    from peft import PeftModel

    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    rl = cfg.method.rl
    if cfg.method.peft in ("prompt_tuning", "prefix_tuning"):
        raise ConfigError(
            f"`method.name: rl` with `peft: {cfg.method.peft}` is not supported: sampling left-padded batches from a soft-prompt "
            "model shifts positions after the virtual tokens (and PEFT 0.21's generate drops a prefix under transformers 5), so the "
            "samples would not come from the policy being trained. Use `peft: lora` (or another LoRA-family method, ia3, freeze, none)."
        )
    if rl.algorithm == "ppo" and ctx.dist is not None and ctx.dist.caps.shards_parameters:
        raise ConfigError(f"`method.rl.algorithm: ppo` under `distributed.strategy: {ctx.dist.strategy}` is not supported: the value head reads "
                          "the policy's hidden states outside the sharded forward (FSDP and ZeRO-3 shard the parameters). "
                          "Use `distributed.strategy: ddp` (or one process), or `algorithm: grpo`.")
    if cfg.data.packing == "pack":
        raise ConfigError("`method.name: rl` samples completions of single prompts, but `data.packing: pack` joins several examples into one row. Set `data.packing: none`.")
    for r in [*data.train, *data.eval]:  # every row has a prompt, or one paragraph says what removed it
        prompt_ids(r, max_length=cfg.data.max_length, truncation=cfg.data.truncation)
    ev_prompts = [prompt_ids(r) for r in data.eval][: cfg.eval.max_samples or None]

    # 1. reward (checked before any weights load), policy (+ PEFT) and reference
    reward, reward_source = load_reward(rl)
    model = build_model(cfg.model, cfg.method, tokenizer=tok, seed=cfg.training.seed)
    reference = None if isinstance(model, PeftModel) else frozen_copy(model)  # PEFT: the base with the adapter off
    device = next(model.parameters()).device
    reward = reward(device, tok)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")
    if rl.algorithm == "ppo":
        attach_value_head(model)  # trained with the policy (the optimizer and checkpoints hold it), removed before export
    rollout, rollout_reason = choose_rollout(rl.rollout, device_type=device.type, installed=vllm_installed(),
                                             sharded=ctx.dist is not None and ctx.dist.caps.shards_parameters)
    ui.console().print(f"  rollouts: {rollout} ({rollout_reason})")
    engine = None
    if rollout == "vllm":
        engine = VLLMRollout(model_path=str(cfg.model.name_or_path), rl=rl, stop_ids=ctx.stop_ids, seed=cfg.training.seed,
                             max_model_len=ctx.specs.batch.max_length + rl.max_new_tokens, trust_remote_code=cfg.model.trust_remote_code,
                             distributed=ctx.dist is not None)
    objective = PolicyGradient(tok, reward, rl, stop_ids=ctx.stop_ids, reference=reference, seed=cfg.training.seed,
                               step=lambda: loop.state.step, rollout=engine)
    objective.policy = model

    # 2. baseline: mean reward and KL to the reference on held-out prompts
    bs = ctx.specs.batch.eval_micro_batch
    measure = lambda m: evaluate_policy(m, objective, ev_prompts, batch_size=bs, seed=cfg.training.seed)  # noqa: E731
    baseline, base_samples = ctx.baseline_once(lambda: measure(model))
    extra = suite.before_training(ctx, model)  # the policy is a causal LM: forgetting sets and benchmarks on it too (evaluate/suite.py)

    # 3. train: roll out num_generations completions per prompt, score, num_iterations updates on each window's rollouts
    specs = dataclasses.replace(ctx.specs, resilience=dataclasses.replace(ctx.specs.resilience, loss_spike_factor=0.0))
    loop = sft.build_loop(
        model, tok, data.train, specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=suite.in_training(ctx, extra, lambda m: rl_in_training(measure(m)[0], rl.kl_coef), lambda: loop.state.step),
        objective=objective, dist=ctx.dist, callbacks=ctx.callbacks,
    )
    outcome = sft.train(loop, ctx.resume_from)
    if not ctx.is_main:  # rank 0 evaluates, exports and reports for the run
        return sft.worker_summary(cfg, outcome)

    # 4. final mean reward and KL on the same prompts, best checkpoint loaded
    final, final_samples = measure(model)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    test_prompts = [prompt_ids(r) for r in (data.test or [])]
    more = suite.after_training(ctx, model, extra, step=outcome.global_step,  # test prompts (reward, KL), forgetting sets, benchmarks
                                measure_test=lambda m: evaluate_policy(m, objective, test_prompts, batch_size=bs, seed=cfg.training.seed)[0])

    # 5. export the policy (without PPO's value head)
    if hasattr(model, "v_head"):
        del model.v_head
    model_dir = export_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, stop_ids=ctx.stop_ids,
                             card=ctx.card(baseline, final, reward=reward_source, algorithm=rl.algorithm))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": cfg.method.name, "peft": cfg.method.peft, "algorithm": rl.algorithm, "rollout": rollout, "reward": reward_source,
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(),
        "samples": [{**f, "baseline_completion": b["completion"], "baseline_reward": b["reward"]} for f, b in zip(final_samples[:20], base_samples[:20])],
        "artifacts": sft.artifacts(ctx.run_dir, model_dir, cfg.method.peft), **more,
    }


def rl_in_training(metrics: dict, kl_coef: float) -> dict:
    """The loop's eval figures: loss = minus the regularised reward (the best checkpoint's criterion), and the reward, KL,
    greedy reward and completion length for the eval hooks (tune's pruner)."""
    return {**{k: v for k, v in metrics.items() if k != "prompts"}, "loss": -regularised_reward(metrics, kl_coef)}


def regularised_reward(metrics: dict, kl_coef: float) -> float:
    """What the policy maximises: mean reward minus kl_coef x KL (the eval figure the best checkpoint is chosen by)."""
    return metrics["reward"] - kl_coef * metrics["kl"]


# ------------------------------------------------------------------------------ evaluation


def evaluate_policy(model, obj: PolicyGradient, prompts: list[list[int]], *, batch_size: int, seed: int) -> tuple[dict, list[dict]]:
    """On held-out prompts: mean reward of `num_generations` completions each sampled with a fixed seed (`reward`), the KL
    of the policy to the reference on them, one estimator for both figures (Schulman's k3, exp(r) - r - 1 with r the
    reference-to-policy log-ratio, never negative): summed over each completion and averaged over completions, nats:
    `kl`; averaged per token: `kl_per_token`), the reward of the greedy completion (`reward_greedy`), and the completion length.
    Batch k samples from the seed ``seed + k``, so the figures do not depend on which process evaluates which batch
    (in-training evals under several processes are sharded: evaluate/shard.py)."""
    import torch

    G = obj.rl.num_generations
    device = next(model.parameters()).device
    todo, shard = sharding.batches(len(prompts), batch_size)
    done: dict[int, dict] = {}
    was = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for b, i, counted in todo:
            torch.manual_seed(seed + b)
            ids, mask = left_pad(prompts[i : i + batch_size], obj.pad_id)
            ids, mask = ids.to(device), mask.to(device)
            p_ids, p_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
            comp = obj.sample(model, p_ids, p_mask, do_sample=True)
            c_mask = completion_mask(comp, obj.stop_ids)
            rewards = obj.score(p_ids, p_mask, comp, c_mask)
            with torch.no_grad():
                logp = obj.logprobs(model, p_ids, p_mask, comp, c_mask)
                ref = obj.reference_logprobs(model, p_ids, p_mask, comp, c_mask)
            m = c_mask.float()
            g = obj.sample(model, ids, mask, do_sample=False)
            g_mask = completion_mask(g, obj.stop_ids)
            g_rewards = obj.score(ids, mask, g, g_mask)
            if not counted:  # FSDP: run only to keep the ranks' collectives in step
                continue
            k3 = torch.exp(ref - logp) - (ref - logp) - 1  # per token, >= 0: the one KL estimate both figures use
            done[b] = {
                "rewards": rewards, "greedy": g_rewards, "kl": (k3 * m).sum(1).tolist(),
                "k3": ((k3 * m).sum(1) / m.sum(1).clamp(min=1)).tolist(), "lengths": m.sum(1).tolist(),
                "samples": [{
                    "prompt": obj.tok.decode(ids[k][mask[k].bool()].tolist(), skip_special_tokens=False),
                    "completion": obj.tok.decode(g[k][g_mask[k].bool()].tolist(), skip_special_tokens=True), "reward": g_rewards[k],
                } for k in range(len(ids))],
            }
    model.train(was)
    parts = sharding.in_order(done, shard, units=lambda r: len(r["greedy"]))  # every batch, in order, on every rank
    flat = lambda key: [x for r in parts for x in r[key]]  # noqa: E731
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "reward": mean(flat("rewards")), "reward_greedy": mean(flat("greedy")), "kl": mean(flat("kl")), "kl_per_token": mean(flat("k3")),
        "completion_length": mean(flat("lengths")), "prompts": len(prompts),
    }, flat("samples")


# ------------------------------------------------------------------------------ the reward


def load_reward(rl: RLConfig):
    """(factory(device, policy tokenizer) -> Reward, description). The function import and the reward model folder are
    checked here, before any weights load; the reward model loads when the factory is called."""
    if rl.reward_function:
        fn = checked(import_reward_function(rl.reward_function), rl.reward_function)
        return (lambda device, tokenizer: lambda p, c, pt, ct: fn(p, c)), {"kind": "function", "source": rl.reward_function}
    if rl.reward_model:
        path = Path(rl.reward_model)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"`method.rl.reward_model` is `{rl.reward_model}`, which is not a model folder (no config.json). Point it at the "
                "`model/` folder of a run with `method.name: reward`, or use `method.rl.reward_function: package.module:function`."
            )
        return (lambda device, tokenizer: reward_model_scorer(path, device, tokenizer)), {"kind": "model", "source": str(path)}
    raise ConfigError(
        "`method.name: rl` needs a reward: set `method.rl.reward_model` to the `model/` folder of a run with `method.name: reward`, "
        "or `method.rl.reward_function` to a Python function (`package.module:function` or `path/to/file.py:function`) "
        "called as f(prompts, completions) -> list of floats. In `stages: [sft, reward, rl]` the reward stage's model is used."
    )


def reward_model_scorer(path: Path, device, tokenizer) -> Reward:
    """A reward model (train/reward.py's export) scoring the exact tokens the policy read and wrote: prompt ids +
    completion ids (+ what the chat template writes after an end-of-turn token, as in the reward model's training pairs),
    the reward `logits[:, 0]` at the last non-pad token (train/reward.py's pooling). Needs the policy's vocabulary."""
    import torch

    rm, rtok = load_reward_model(str(path))
    if rtok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"The reward model `{path}` has another vocabulary than the policy ({len(rtok)} vs {len(tokenizer)} tokens), so it cannot "
            "score the policy's tokens. Train the reward model from the policy's base (as `stages: [sft, reward, rl]` does)."
        )
    rm = rm.to(device).eval()
    pad = rm.config.pad_token_id if rm.config.pad_token_id is not None else tokenizer.pad_token_id
    suffix = turn_suffix_ids(tokenizer)

    def score(prompts, completions, prompt_tokens, completion_tokens) -> list[float]:
        seqs = [pt + ct + (suffix if ct and ct[-1] in stops else []) for pt, ct in zip(prompt_tokens, completion_tokens)]
        batch = right_pad(seqs, pad)
        with torch.no_grad():
            return rm(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits[:, 0].float().tolist()

    stops = set(end_of_turn_ids(tokenizer)) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    return checked(score, str(path))


def turn_suffix_ids(tokenizer) -> list[int]:
    """Token ids the chat template writes after an assistant turn's end-of-turn token (ChatML: a newline), which the
    preference pairs the reward model learned from end with."""

    tpl = Template(tokenizer)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    text = tpl.render(msgs)
    pos = text.rfind("b") + 1
    m = tpl._special_re.search(text, pos) if tpl._special_re else None
    rest = text[m.end():] if m else ""
    return list(encode_texts(tokenizer, [rest])[0].ids) if rest else []


def import_reward_function(spec: str) -> RewardFn:
    """`package.module:function` (importable) or `path/to/file.py:function`: the one importer of user code (`model/custom.py`)."""
    return import_object(spec, "method.rl.reward_function")


def checked(fn, source: str):
    """The reward, with its answer checked: one finite number per completion (the completions are the 2nd argument)."""

    def call(prompts: list[str], completions: list[str], *more) -> list[float]:
        out = fn(prompts, completions, *more)
        try:
            values = [float(x) for x in out]
        except (TypeError, ValueError):
            raise TrainpipeError(f"The reward `{source}` returned {type(out).__name__} {str(out)[:80]}; it must return a list of floats, one per completion.") from None
        if len(values) != len(completions):
            raise TrainpipeError(f"The reward `{source}` returned {len(values)} values for {len(completions)} completions; it must return one float per completion.")
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise TrainpipeError(f"The reward `{source}` returned non-finite values ({bad[:3]}); every reward must be a finite float.")
        return values

    return call
