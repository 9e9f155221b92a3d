"""The in-training evaluations of dpo/orpo/kto, reward and rl are sharded over the ranks of a distributed run (like the
token loss of sft/pretrain), and the sharded figures equal one process's on the whole set.

1. Two gloo processes (torchrun) evaluate the same tiny models on the same held-out rows once whole (each process
   alone) and once sharded (`distributed.env.sharded_eval`, as train/loop.py sets it around an in-training eval): every
   metric of dpo (with an SFT term), orpo, kto, the reward model and the rl policy agrees within 1e-5 on both ranks, and
   each rank evaluated only its share of the batches.
2. A real 2-process dpo run through `trainpipe run --nproc-per-node 2` with a forgetting set: its in-training evals are
   sharded (`eval_ranks` 2, the pairs per rank add up to the eval split) and the sharded eval loss of the chosen checkpoint
   equals rank 0's whole-set final eval of it; the forgetting set is measured at every in-training eval (rank 0, outside
   the shard) without a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_distributed import events, finish, launch
from tiny import build_tiny_model, chat_records, preference_records, write_jsonl

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parent.parent

WORKER = r'''
import copy, json, sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[3])
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tiny import preference_records
from trainpipe.config import PreferenceConfig, RLConfig
from trainpipe.distributed.env import sharded_eval
from trainpipe.train import preference as P, reward as R, rl as RL

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
base, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = AutoTokenizer.from_pretrained(base)
enc = lambda text: tok(text, add_special_tokens=False).input_ids
rows = [{"prompt_input_ids": enc(r["prompt"] + "\n"), "chosen_input_ids": enc(r["chosen"]) + [tok.eos_token_id],
         "rejected_input_ids": enc(r["rejected"]) + [tok.eos_token_id]} for r in preference_records(19, seed=11)]

def perturbed(model):
    """The policy a few steps away from its reference: seeded noise on every weight (the same on both ranks)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model

policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
reference = P.Reference(policy)  # full fine-tune: a frozen copy of the starting weights
perturbed(policy)
torch.manual_seed(0)
scorer = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
scorer.config.pad_token_id = tok.pad_token_id

def letters(prompts, completions):
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]

pg = RL.PolicyGradient(tok, lambda p, c, pt, ct: letters(p, c), RLConfig(reward_function="x:y", num_generations=2, max_new_tokens=5),
                       stop_ids=[tok.eos_token_id], reference=reference.frozen)
prompts = [r["prompt_input_ids"] for r in rows[:7]]
cases = {
    "dpo": lambda: P.evaluate(policy, P.PairObjective("dpo", PreferenceConfig(beta=0.5, sft_weight=0.3), reference, tok.pad_token_id), rows, batch_size=4),
    "orpo": lambda: P.evaluate(policy, P.PairObjective("orpo", PreferenceConfig(beta=2.0), None, tok.pad_token_id), rows, batch_size=4),
    "kto": lambda: P.evaluate(policy, P.KTOObjective(PreferenceConfig(beta=0.5), reference, tok.pad_token_id), list(P.Unpaired(rows)), batch_size=4),
    "reward": lambda: R.evaluate(scorer, R.BradleyTerry(tok.pad_token_id), rows, batch_size=4),
    "rl": lambda: RL.evaluate_policy(policy, pg, prompts, batch_size=2, seed=5)[0],
}
result = {}
for name, measure in cases.items():
    whole = measure()  # this process alone, every batch
    with sharded_eval(rank, world, lockstep=False) as shard:
        sharded = measure()
    result[name] = {"whole": whole, "sharded": sharded, "per_rank": shard.counts}
(out / f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
'''


def test_sharded_preference_reward_and_rl_evals_equal_one_process(tmp_path):
    base = build_tiny_model(tmp_path / "base")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(base), str(tmp_path), str(TESTS)]
    import os

    p = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    expected_units = {"dpo": [11, 8], "orpo": [11, 8], "kto": [20, 18], "reward": [11, 8], "rl": [4, 3]}  # rank 0: batches 0, 2, 4; rank 1: 1, 3
    worst = 0.0
    for name, units in expected_units.items():
        whole, sharded = r0[name]["whole"], r0[name]["sharded"]
        assert r0[name]["per_rank"] == r1[name]["per_rank"] == units, (name, r0[name]["per_rank"])
        assert set(whole) == set(sharded) and r1[name]["sharded"] == sharded, name  # both ranks hold the same all-gathered figures
        for k, v in whole.items():
            assert abs(v - sharded[k]) <= 1e-5 * max(1.0, abs(v)), (name, k, v, sharded[k])
            worst = max(worst, abs(v - sharded[k]))
    # the figures measure something: the policy is not its reference, the untrained head does not score pairs equally
    assert r0["dpo"]["whole"]["reward_margin"] != 0 and r0["reward"]["whole"]["margin"] != 0 and r0["rl"]["whole"]["kl"] != 0
    print(f"\nsharded vs whole eval, largest difference over dpo/orpo/kto/reward/rl metrics: {worst:.2e}")


def test_two_process_dpo_run_shards_its_evals_and_measures_forgetting(tmp_path):
    base = build_tiny_model(tmp_path / "base")
    write_jsonl(tmp_path / "data" / "pairs.jsonl", preference_records(80, seed=7))
    write_jsonl(tmp_path / "data" / "general.jsonl", [{"text": r["messages"][-1]["content"]} for r in chat_records(12, seed=2)])
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/pairs.jsonl"}], "eval_split": 18, "max_length": 64},
        "method": {"name": "dpo", "peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "preference": {"beta": 0.5}},
        "training": {"max_steps": 4, "eval_steps": 2, "save_steps": 2, "logging_steps": 2, "per_device_train_batch_size": 4,
                     "per_device_eval_batch_size": 4, "gradient_accumulation_steps": 1, "learning_rate": 3e-3, "early_stopping_patience": None},
        "eval": {"forgetting": [{"path": "data/general.jsonl", "name": "general"}]},
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out = finish(launch(path))
    assert rc == 0, out[-3000:]
    run = tmp_path / "run"
    ev = events(run)
    train = [e for e in ev if e["event"] == "eval_done" and e.get("phase") == "train" and "eval_loss" in e]
    assert [e["step"] for e in train] == [2, 4]
    assert all(e["eval_ranks"] == 2 and len(e["eval_loss_tokens_per_rank"]) == 2 and sum(e["eval_loss_tokens_per_rank"]) == 18
               and min(e["eval_loss_tokens_per_rank"]) > 0 for e in train), train
    best = min(train, key=lambda e: e["eval_loss"])
    final = next(e for e in ev if e["event"] == "eval_done" and e.get("phase") == "final" and "loss" in e)
    assert abs(final["loss"] - best["eval_loss"]) < 1e-6, (final["loss"], best)  # sharded over 2 ranks == rank 0 alone, same weights
    hist = json.loads((run / "forgetting.json").read_text())["sets"]["general"]["history"]
    assert [(h["step"], h["phase"]) for h in hist] == [(0, "baseline"), (2, "train"), (4, "train"), (4, "final")]
    s = json.loads((run / "summary.json").read_text())
    assert s["forgetting"]["sets"]["general"]["final"]["loss"] > 0
