"""RL's loop objective (:class:`PolicyGradient`): a window's rollouts, then GRPO / RLOO / PPO updates on them.

A unit is a prompt. When the stepper asks for a window's weight, the objective rolls the whole window out once
(`num_generations` completions per prompt, each prompt under its own seed: train/rollout.py), scores it, and
computes everything that belongs to the window as a whole: the old and reference log-probs, the advantages (GRPO's
group normalisation, RLOO's leave-one-out, PPO's GAE on the value head's values, whitened over the window's tokens)
and the loss's denominator (train/rl_losses.py). Each micro-batch then only runs the policy's forward on its rows, so
any micro-batch split of a window gives the same update, whatever the loss normalisation.

`num_iterations` > 1: the rollouts of step k * num_iterations serve that step and the next num_iterations - 1 (the
windows between bring no new prompts: their positions map onto the rollouts' rows); the log-probs of the rollout are
the old policy's, and the ratio of the current policy to them is clipped to [1 - epsilon, 1 + epsilon_high].
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

from trainpipe import ui
from trainpipe.config import RLConfig
from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.distributed.ddp import unwrap
from trainpipe.distributed.fsdp import is_sharded
from trainpipe.errors import DataError
from trainpipe.train import rl_losses as L
from trainpipe.train.objectives import Objective
from trainpipe.train.rollout import generate_rollout, prompt_seeds

# what the objective calls: (prompts, completions, prompt token ids, completion token ids) -> rewards
Reward = Callable[[list[str], list[str], list[list[int]], list[list[int]]], list[float]]


def prompt_ids(row: dict, *, max_length: int | None = None, truncation: str = "auto") -> list[int]:
    """The prompt of a data row: `prompt_input_ids` (preference, KTO), or the tokens of an SFT row before its first labelled
    token. A row with none is a DataError that blames what removed it: truncation when the row is `max_length` long
    (a truncated conversation keeps its end), else the data (raw text, or `train_on: all`)."""
    if row.get("prompt_input_ids") is not None:
        return list(row["prompt_input_ids"])
    labels = row["labels"]
    k = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
    if k == 0 and max_length and len(labels) >= max_length and truncation != "drop":
        raise DataError(
            f"`method.name: rl` needs a prompt in every row, but `data.truncation: {truncation}` cut a conversation to its last "
            f"{max_length} tokens (`data.max_length`), which left only the reply: there is no prompt to complete. The data format "
            "is fine. Raise `data.max_length`, or set `data.truncation: drop` so that such records are dropped and counted."
        )
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


def cut_at_stop(tokens: list[int], stop_ids: list[int], pad_id: int) -> list[int]:
    """A sampled completion through its first stop token, padding dropped."""
    out = []
    for t in tokens:
        out.append(t)
        if t in stop_ids:
            break
    while out and out[-1] == pad_id and pad_id not in stop_ids:
        out.pop()
    return out


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


def attach_value_head(model):
    """PPO's value head: a linear map of the policy's last hidden state to a value, zero at the start, registered on the
    model (``model.v_head``) so that the optimizer and the checkpoints hold it. The recipe removes it before export."""
    import torch

    hidden = unwrap(model).get_input_embeddings().weight.shape[1]
    head = torch.nn.Linear(hidden, 1, device=next(model.parameters()).device, dtype=torch.float32)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.v_head = head
    return head


@dataclass
class Rollouts:
    """One window's (or group's) rollouts, on the device; row r = prompt r // G, completion r % G."""

    generation: int
    key: tuple
    prompts: int
    p_ids: object
    p_mask: object
    comp: object
    c_mask: object  # float 0/1
    rewards: object  # [N]
    ref: object  # [N, T]
    old: object | None  # [N, T] the rollout policy's log-probs; None when each rollout serves one step (ratio 1)
    adv: object  # [N] or, PPO, [N, T]
    denom: float  # PPO: the window's completion tokens (grpo/rloo: L.denominator of `loss_type`)
    values: object | None = None  # PPO
    returns: object | None = None
    value_tokens: float = 1.0
    kl: object | None = None  # PPO: the per-token KL paid in the reward


class PolicyGradient(Objective):
    """GRPO / RLOO / PPO as a loop objective (module docstring). ``policy`` is the model rolled out from (set by the
    recipe), ``step`` the loop's optimizer step, ``rollout`` the vLLM engine or None for `generate`."""

    shards_eval = True  # in-training evals under several processes: each rank samples and scores its prompts (evaluate/shard.py)

    def __init__(self, tokenizer, reward: Reward, rl: RLConfig, *, stop_ids: list[int], reference=None, seed: int = 0,
                 step: Callable[[], int] = lambda: 0, rollout=None):
        self.tok, self.reward, self.rl = tokenizer, reward, rl
        self.stop_ids = list(stop_ids) or [tokenizer.eos_token_id]
        self.reference = reference
        self.pad_id = tokenizer.pad_token_id
        self.seed, self.step, self.rollout = seed, step, rollout
        self.policy = None
        self.eps_low, self.eps_high = rl.epsilon, rl.epsilon_high if rl.epsilon_high is not None else rl.epsilon
        self._group: Rollouts | None = None
        self._rows: dict[int, list[int]] = {}  # id(example) of the current window -> its rows in the rollouts
        self._noted = False

    # ---------------------------------------------------------------- the window
    def weight(self, examples: list[dict]) -> int:
        self._prepare(examples)
        return len(examples)

    def tokens(self, examples: list[dict]) -> int:
        return sum(len(prompt_ids(ex)) for ex in examples)

    def collate(self, examples: list[dict]) -> dict:
        import torch

        rows = [r for ex in examples for r in self._rows[id(ex)]]
        return {"rows": torch.tensor(rows, dtype=torch.long)}

    def _prepare(self, examples: list[dict]) -> None:
        mu = self.rl.num_iterations
        generation, k = divmod(self.step(), mu)
        key = tuple(id(e) for e in examples)
        g = self._group
        fresh = g is None or g.generation != generation or (k == 0 and g.key != key)
        if fresh:
            if k and not self._noted:  # a checkpoint carries the group's rollouts (state_dict); one without them (older) cannot
                ui.console().print(f"  note: resumed inside a group of {mu} iterations without its rollouts: they are drawn again from the current policy")
                self._noted = True
            g = self._group = self.roll_out(examples, generation)
        G = self.rl.num_generations
        self._rows = {id(ex): [(j % g.prompts) * G + i for i in range(G)] for j, ex in enumerate(examples)}

    def roll_out(self, examples: list[dict], generation: int) -> Rollouts:
        """Sample, score and evaluate a window's rollouts (no gradient)."""
        import torch

        rl, G, model = self.rl, self.rl.num_generations, self.policy
        prompts = [prompt_ids(ex) for ex in examples]
        seeds = prompt_seeds(self.seed, generation, prompts)
        if self.rollout is not None:
            raw = self.rollout(unwrap(model), prompts, seeds, G, self.step())
        else:
            raw = generate_rollout(self.sample, unwrap(model), prompts, seeds, G, self.pad_id)
        device = next(model.parameters()).device
        comps = [cut_at_stop(c, self.stop_ids, self.pad_id) for c in raw]
        T = max(1, max(len(c) for c in comps))
        comp = torch.full((len(comps), T), self.pad_id, dtype=torch.long)
        for i, c in enumerate(comps):
            comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        lengths = torch.tensor([len(c) for c in comps])
        c_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
        p_ids, p_mask = left_pad([p for p in prompts for _ in range(G)], self.pad_id)
        p_ids, p_mask, comp, c_mask = p_ids.to(device), p_mask.to(device), comp.to(device), c_mask.to(device)
        rewards = torch.tensor(self.score(p_ids, p_mask, comp, c_mask), dtype=torch.float32, device=device)
        ppo = rl.algorithm == "ppo"
        with torch.no_grad():
            ref = self.reference_logprobs(model, p_ids, p_mask, comp, c_mask)
            old, values = (self.forward(model, p_ids, p_mask, comp, c_mask, values=ppo) if (ppo or rl.num_iterations > 1) else (None, None))
        r = Rollouts(generation=generation, key=tuple(id(e) for e in examples), prompts=len(prompts), p_ids=p_ids, p_mask=p_mask, comp=comp,
                     c_mask=c_mask, rewards=rewards, ref=ref, old=old, adv=None, denom=1.0)
        if ppo:
            token_rewards, r.kl = L.ppo_rewards(rewards, old, ref, c_mask, kl_coef=rl.kl_coef)
            r.adv, r.returns = L.gae(token_rewards, values, c_mask, gamma=rl.gamma, lam=rl.lam)
            r.values, r.denom = values * L.value_mask(c_mask), max(float(c_mask.sum()), 1.0)
            r.value_tokens = float(L.value_mask(c_mask).sum())
        else:
            r.adv = advantages(rewards.view(-1, G), rl.algorithm).reshape(-1)
        return r

    def state_dict(self) -> dict:
        """The rollouts that later steps of their group still train on (`num_iterations` > 1), for the checkpoint: a run
        resumed inside a group trains on the same rollouts as the uninterrupted one."""
        g = self._group
        if g is None or self.rl.num_iterations == 1:
            return {}
        return {f.name: (getattr(g, f.name).cpu() if hasattr(getattr(g, f.name), "cpu") else getattr(g, f.name))
                for f in dataclasses.fields(g) if f.name != "key"}

    def load_state_dict(self, st: dict) -> None:
        device = next(self.policy.parameters()).device
        self._group = Rollouts(key=(), **{k: (v.to(device) if hasattr(v, "to") else v) for k, v in st.items()})

    # ---------------------------------------------------------------- one micro-batch
    def loss_sum(self, model, batch: dict):
        import torch

        rl, R, rows = self.rl, self._group, batch["rows"]
        G, P = rl.num_generations, len(self._rows)
        p_ids, p_mask, comp, m = R.p_ids[rows], R.p_mask[rows], R.comp[rows], R.c_mask[rows]
        logp, vpred = self.forward(model, p_ids, p_mask, comp, m, values=rl.algorithm == "ppo")
        old = R.old[rows] if R.old is not None else logp.detach()
        ref = R.ref[rows]
        if rl.algorithm == "ppo":
            vmask = L.value_mask(m)
            pg = L.ppo_policy_parts(logp, old, R.adv[rows], m, self.eps_low).sum() / R.denom
            vf = L.ppo_value_parts(vpred * vmask, R.values[rows], R.returns[rows], vmask, rl.value_clip).sum() / R.value_tokens
            loss = pg + rl.vf_coef * vf
            kl = R.kl[rows]
        else:
            per_token = L.grpo_token_loss(logp, old, ref, R.adv[rows], eps_low=self.eps_low, eps_high=self.eps_high, beta=rl.kl_coef)
            loss = L.sequence_parts(per_token, m, rl.loss_type, rl.max_new_tokens).sum() / L.denominator(R.c_mask, rl.loss_type)
            kl = L.k3(logp.detach(), ref)
        lengths = m.sum(1).clamp(min=1)
        n = len(rows) // G  # the prompts of this micro-batch
        rewards = R.rewards[rows].view(n, G)
        seq_kl = ((kl * m).sum(1) / lengths).view(n, G).mean(1)
        ratio = torch.exp(logp.detach() - old)
        clipped = ((ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)).float()
        return loss * P, {  # the stepper divides by the window's prompts: the loss is the window's, the figures per prompt
            "reward": float(rewards.mean(1).sum()), "reward_std": float(rewards.std(1).sum()), "kl": float(seq_kl.sum()),
            "completion_length": float(m.sum(1).view(n, G).mean(1).sum()),
            "clip_ratio": float((((clipped * m).sum(1) / lengths).view(n, G).mean(1)).sum()),
        }

    # ---------------------------------------------------------------- pieces
    def sample(self, model, p_ids, p_mask, *, do_sample: bool, seed: int | None = None):
        """Completions (right-padded after their stop token) for left-padded prompts; eval mode, no grad. With ``seed``,
        sampled under that seed with the training RNG left as it was."""
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
        device = p_ids.device
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
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

    def forward(self, model, p_ids, p_mask, comp, c_mask, *, values: bool = False):
        """(log p(completion token | prefix) per completion position with temperature-scaled logits, as sampled; with
        ``values``, the value head's value of the state before each completion token, else None)."""
        import torch

        ids = torch.cat([p_ids, comp], dim=1)
        attn = torch.cat([p_mask, c_mask.long()], dim=1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # as generate() numbered the left-padded positions
        T = comp.shape[1]  # the last T+1 positions predict the completion (soft-prompt methods prepend virtual tokens in front)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=values)
        logits = out.logits[:, -T - 1 : -1].float() / self.rl.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        if not values:
            return logp, None
        head = unwrap(model).v_head
        return logp, head(out.hidden_states[-1][:, -T - 1 : -1].float()).squeeze(-1)

    def logprobs(self, model, p_ids, p_mask, comp, c_mask):
        return self.forward(model, p_ids, p_mask, comp, c_mask)[0]

    def reference_logprobs(self, model, p_ids, p_mask, comp, c_mask):
        if self.reference is not None:
            return self.logprobs(self.reference, p_ids, p_mask, comp, c_mask)
        model = unwrap(model)  # the adapter switch lives on the PEFT model inside DDP
        with model.disable_adapter():
            return self.logprobs(model, p_ids, p_mask, comp, c_mask)
