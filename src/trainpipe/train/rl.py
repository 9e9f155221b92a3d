"""Online RL against a reward, with KL control to the reference, top to bottom: reward (a
reward model folder or a Python function) -> policy (+ PEFT) and reference -> baseline mean
reward and KL on held-out prompts -> train (sample, score, policy-gradient step) -> final
mean reward and KL with the best checkpoint -> export.

Algorithms (`method.rl.algorithm`), both on-policy with one update per batch of samples, as
TRL's GRPOTrainer / RLOOTrainer do by default:
- `grpo`: advantage of completion i of a prompt = (r_i - mean(r)) / (std(r) + 1e-4) over the
  `num_generations` completions of that prompt (group-normalised, DeepSeekMath).
- `rloo`: advantage = r_i - mean of the other completions' rewards (leave-one-out baseline).

Per completion token t: loss_t = -A * ratio_t + kl_coef * KL_t, with ratio_t = exp(logp_t -
sg(logp_t)) (value 1, gradient of logp_t) and KL_t the k3 estimator exp(ref_t - logp_t) -
(ref_t - logp_t) - 1 of KL(policy || reference) (TRL GRPO). A completion's loss is the mean
over its tokens, a prompt's the mean over its completions, and a step's the mean over its
prompts (`Objective.weight` = prompts), so any micro-batch split of a window is exact.

TRL 1.x removed PPOTrainer (and trainpipe offers no PPO: there is no maintained implementation
to build on); GRPO and RLOO need no value model and are TRL's maintained online methods.

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
- Sampling draws from the torch RNG, which the loop checkpoints: a resumed run samples exactly
  what the uninterrupted one would have. Evaluation samples with fixed seeds of its own
  (`training.seed` + the batch's index) and leaves the training RNG untouched.
- The loop's loss-spike rollback is off here: an RL loss (about kl_coef x KL, its policy part
  zero in value) is no divergence signal. NaN/Inf detection stays on.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from trainpipe import ui
from trainpipe.config import RLConfig
from trainpipe.distributed.ddp import unwrap
from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.errors import ConfigError, DataError, TrainpipeError
from trainpipe.train import sft
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.evaluate import suite
from trainpipe.export import export_model
from trainpipe.model.loading import build_model, parameter_counts
from trainpipe.evaluate import shard as sharding
from trainpipe.data.collate import right_pad
from trainpipe.train.reward import load_reward_model
from trainpipe.data.tokenize import _encode, end_of_turn_ids, Template
from trainpipe.distributed.fsdp import is_sharded

RewardFn = Callable[[list[str], list[str]], list[float]]  # a user's reward function: (prompts, completions) -> rewards
# what the objective calls: (prompts, completions, prompt token ids, completion token ids) -> rewards
Reward = Callable[[list[str], list[str], list[list[int]], list[list[int]]], list[float]]


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
    if cfg.data.packing == "pack":
        raise ConfigError("`method.name: rl` samples completions of single prompts, but `data.packing: pack` joins several examples into one row. Set `data.packing: none`.")
    ev_prompts = [prompt_ids(r) for r in data.eval][: cfg.eval.max_samples or None]

    # 1. reward (checked before any weights load), policy (+ PEFT) and reference
    reward, reward_source = load_reward(rl)
    model = build_model(cfg.model, cfg.method, tokenizer=tok, seed=cfg.training.seed)
    reference = None if isinstance(model, PeftModel) else frozen_copy(model)  # PEFT: the base with the adapter off
    reward = reward(next(model.parameters()).device, tok)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")
    objective = PolicyGradient(tok, reward, rl, stop_ids=ctx.stop_ids, reference=reference)

    # 2. baseline: mean reward and KL to the reference on held-out prompts
    bs = ctx.specs.batch.eval_micro_batch
    measure = lambda m: evaluate_policy(m, objective, ev_prompts, batch_size=bs, seed=cfg.training.seed)  # noqa: E731
    baseline, base_samples = ctx.baseline_once(lambda: measure(model))
    extra = suite.before_training(ctx, model)  # the policy is a causal LM: forgetting sets and benchmarks on it too (evaluate/suite.py)

    # 3. train: sample num_generations completions per prompt, score, one policy-gradient step per window
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

    # 5. export the policy
    model_dir = export_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, stop_ids=ctx.stop_ids,
                             card=ctx.card(baseline, final, reward=reward_source, algorithm=rl.algorithm))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": cfg.method.name, "peft": cfg.method.peft, "algorithm": rl.algorithm, "reward": reward_source,
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


# ------------------------------------------------------------------------------ prompts


def prompt_ids(row: dict) -> list[int]:
    """The prompt of a data row: `prompt_input_ids` (preference, KTO), or the tokens of an SFT row before its first labelled token."""
    if row.get("prompt_input_ids") is not None:
        return list(row["prompt_input_ids"])
    labels = row["labels"]
    k = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
    if k == 0:
        raise DataError(
            "`method.name: rl` needs prompts, but a data row carries loss on its very first token (raw text, or "
            "`method.train_on: all`): there is no prompt to complete. Give chat, alpaca, ShareGPT, preference or KTO data "
            "and keep `method.train_on: assistant`."
        )
    return list(row["input_ids"][:k])


def left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, n - len(p):] = 1
    return ids, mask


# ------------------------------------------------------------------------------ the objective


class PolicyGradient(Objective):
    """GRPO / RLOO as a loop objective: a unit is a prompt; `loss_sum` samples, scores and returns the summed per-prompt losses."""

    shards_eval = True  # in-training evals under several processes: each rank samples and scores its prompts (evaluate/shard.py)

    def __init__(self, tokenizer, reward: Reward, rl: RLConfig, *, stop_ids: list[int], reference=None):
        self.tok, self.reward, self.rl = tokenizer, reward, rl
        self.stop_ids = list(stop_ids) or [tokenizer.eos_token_id]
        self.reference = reference
        self.pad_id = tokenizer.pad_token_id

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def tokens(self, examples: list[dict]) -> int:
        return sum(len(prompt_ids(ex)) for ex in examples)

    def collate(self, examples: list[dict]) -> dict:
        ids, mask = left_pad([prompt_ids(ex) for ex in examples], self.pad_id)
        return {"input_ids": ids, "attention_mask": mask}

    def loss_sum(self, model, batch: dict):
        import torch

        G, rl = self.rl.num_generations, self.rl
        B = batch["input_ids"].shape[0]
        # 1. sample G completions per prompt (no grad, the torch RNG)
        p_ids = batch["input_ids"].repeat_interleave(G, 0)
        p_mask = batch["attention_mask"].repeat_interleave(G, 0)
        comp = self.sample(model, p_ids, p_mask, do_sample=True)
        c_mask = completion_mask(comp, self.stop_ids)
        # 2. score, advantages within each prompt's group
        rewards = torch.tensor(self.score(p_ids, p_mask, comp, c_mask), dtype=torch.float32, device=comp.device).view(B, G)
        adv = advantages(rewards, rl.algorithm).view(-1, 1)
        # 3. per-token log-probs under the policy (grad) and the reference, k3 KL, per-token loss
        logp = self.logprobs(model, p_ids, p_mask, comp, c_mask)
        with torch.no_grad():
            ref = self.reference_logprobs(model, p_ids, p_mask, comp, c_mask)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = -torch.exp(logp - logp.detach()) * adv + rl.kl_coef * kl
        m = c_mask.float()
        lengths = m.sum(1).clamp(min=1)
        per_prompt = ((per_token * m).sum(1) / lengths).view(B, G).mean(1)
        seq_kl = ((kl.detach() * m).sum(1) / lengths).view(B, G).mean(1)
        return per_prompt.sum(), {
            "reward": float(rewards.mean(1).sum()), "reward_std": float(rewards.std(1).sum()), "kl": float(seq_kl.sum()),
            "completion_length": float(m.sum(1).view(B, G).mean(1).sum()),
        }

    # ---------------------------------------------------------------- pieces
    def sample(self, model, p_ids, p_mask, *, do_sample: bool):
        """Completions (right-padded after their stop token) for left-padded prompts; eval mode, no grad."""
        import torch
        from transformers import GenerationConfig

        rl = self.rl
        gen = GenerationConfig(
            do_sample=do_sample, temperature=rl.temperature if do_sample else None, top_k=0 if do_sample else None, top_p=1.0 if do_sample else None,
            max_new_tokens=rl.max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
        )
        model = unwrap(model)  # DDP has no generate; sampling needs no gradient sync

        # FSDP: every forward gathers each layer from all ranks, so every rank keeps stepping until all ranks' completions end
        synced = {"synced_gpus": True} if is_sharded(model) else {}
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=gen, **synced)
        finally:
            model.train(was)
        return out[:, p_ids.shape[1]:]

    def score(self, p_ids, p_mask, comp, c_mask) -> list[float]:
        """Rewards of the completions: the reward sees the prompt and completion as text and as the token ids the policy
        read and wrote (prompt without padding + completion through its stop token)."""
        prompt_tokens = [ids[m.bool()].tolist() for ids, m in zip(p_ids, p_mask)]
        completion_tokens = [ids[m.bool()].tolist() for ids, m in zip(comp, c_mask)]
        prompts = [self.tok.decode(t, skip_special_tokens=False) for t in prompt_tokens]
        completions = [self.tok.decode(t, skip_special_tokens=True) for t in completion_tokens]
        return self.reward(prompts, completions, prompt_tokens, completion_tokens)

    def logprobs(self, model, p_ids, p_mask, comp, c_mask):
        """log p(completion token | prefix) per completion position (temperature-scaled logits, as sampled)."""
        import torch

        ids = torch.cat([p_ids, comp], dim=1)
        attn = torch.cat([p_mask, c_mask.long()], dim=1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # as generate() numbered the left-padded positions
        T = comp.shape[1]  # the last T+1 positions predict the completion (soft-prompt methods prepend virtual tokens in front)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1 : -1].float() / self.rl.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)

    def reference_logprobs(self, model, p_ids, p_mask, comp, c_mask):
        if self.reference is not None:
            return self.logprobs(self.reference, p_ids, p_mask, comp, c_mask)
        model = unwrap(model)  # the adapter switch lives on the PEFT model inside DDP
        with model.disable_adapter():
            return self.logprobs(model, p_ids, p_mask, comp, c_mask)


def completion_mask(comp, stop_ids: list[int]):
    """1 for the tokens of each completion up to and including its first stop token, 0 after."""
    import torch

    is_stop = torch.zeros_like(comp, dtype=torch.bool)
    for s in stop_ids:
        is_stop |= comp == s
    after = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # positions after the first stop
    return (~after).long()


def advantages(rewards, algorithm: str):
    """[prompts, G] rewards -> advantages: GRPO (r - mean) / (std + 1e-4) within the group; RLOO r - mean of the others."""
    G = rewards.shape[1]
    if algorithm == "grpo":
        return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return rewards - (rewards.sum(1, keepdim=True) - rewards) / (G - 1)


def frozen_copy(model):
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


# ------------------------------------------------------------------------------ evaluation


def evaluate_policy(model, obj: PolicyGradient, prompts: list[list[int]], *, batch_size: int, seed: int) -> tuple[dict, list[dict]]:
    """On held-out prompts: mean reward of `num_generations` completions each sampled with a fixed seed (`reward`), the KL
    of the policy to the reference on them (mean over completions of the summed log-ratio, nats: `kl`; the mean k3
    per token: `kl_per_token`), the reward of the greedy completion (`reward_greedy`), and the completion length.
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
            done[b] = {
                "rewards": rewards, "greedy": g_rewards, "kl": ((logp - ref) * m).sum(1).tolist(),
                "k3": (((torch.exp(ref - logp) - (ref - logp) - 1) * m).sum(1) / m.sum(1).clamp(min=1)).tolist(), "lengths": m.sum(1).tolist(),
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
    return list(_encode(tokenizer, [rest])[0].ids) if rest else []


def import_reward_function(spec: str) -> RewardFn:
    """`package.module:function` (importable) or `path/to/file.py:function`."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"`method.rl.reward_function` must be `package.module:function` or `path/to/file.py:function`, got {spec!r}.")
    try:
        if target.endswith(".py"):
            p = Path(target).expanduser()
            if not p.is_file():
                raise ConfigError(f"`method.rl.reward_function` names the file `{target}`, which does not exist. Check the path (in a config file, relative paths are read from the config file's folder).")
            s = importlib.util.spec_from_file_location(f"trainpipe_reward_{abs(hash(str(p.resolve())))}", p)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module: say which and why
        raise ConfigError(
            f"`method.rl.reward_function: {spec}`: importing `{target}` failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}). "
            "Make it importable (installed, or on PYTHONPATH), or give the file path: `path/to/file.py:function`."
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = ", ".join(sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:10]) or "none"
        raise ConfigError(f"`method.rl.reward_function: {spec}`: `{target}` has no function `{name}` (its functions: {found}).")
    return fn


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
