"""Ulysses sequence parallelism (distributed/ulysses.py: DeepSpeed's UlyssesSPAttentionHF) on 2 gloo processes equals one
process: a tiny Llama's two sequences split in halves over 2 ranks give the same summed loss over the exact loss-token
denominator, the same gradients, and after an SGD step the same weights (to 1e-5) as the whole sequences on one process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

from test_distributed import base  # noqa: E402,F401 - the tiny model fixture

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256, attn_implementation="sdpa")
LENGTH, LR = 32, 0.5


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _batch(packed: bool = False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, LENGTH), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that carries no loss
    labels[1, 27:] = -100  # padding at the end of the shorter sequence
    if not packed:
        return ids, labels, None
    # packed rows (data/packing.py): examples of 11 + 21 and 16 + 16 tokens (the second example's start in the other rank's
    # shard for row 0, at the shard boundary for row 1), position ids restarting at each, each example's first label masked
    pos = torch.cat([torch.cat([torch.arange(11), torch.arange(21)]).unsqueeze(0), torch.arange(16).repeat(2).unsqueeze(0)])
    labels[0, 11], labels[1, 16] = -100, -100
    return ids, labels, pos


def _loss_sum(logits, target):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum")


def _worker(rank: int, world: int, port: int, out: str, packed: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from trainpipe.distributed.ulysses import register, shard

    model = _model()
    # registered for micro-batches of 4 rows: these 2 rows run as they are (an OOM-halved micro-batch is not padded back)
    register(model, world, micro_batch=4, seq_len=LENGTH, attention="sdpa", packed=packed)
    ids, labels, pos = _batch(packed)
    part = shard(ids, labels, rank, world, pos)
    denom = int((torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1) != -100).sum())  # the window's loss tokens, all shards
    logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
    loss = _loss_sum(logits, part["shift_labels"]) / denom
    (loss * world).backward()  # gradients are averaged over the ranks below, as DDP does; the window's gradient is their sum
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    with torch.no_grad():
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
            p -= LR * p.grad
    if rank == 0:
        torch.save({"loss": total, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_parallel_2_equals_one_process(tmp_path, packed):
    """Padded rows, and packed rows whose examples must not attend to each other on the gathered sequence (one process:
    transformers' own packed-sequence mask from the position ids)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "sp.pt")
    mp.spawn(_worker, args=(2, port, out, packed), nprocs=2, join=True)
    sp = torch.load(out, weights_only=True)

    torch.set_num_threads(1)
    model = _model()
    ids, labels, pos = _batch(packed)
    target = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    loss = _loss_sum(model(input_ids=ids, position_ids=pos, use_cache=False).logits, target) / int((target != -100).sum())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    assert abs(float(loss) - float(sp["loss"])) < 1e-6
    diff = max(float((p - sp["weights"][n]).abs().max()) for n, p in model.named_parameters())
    moved = max(float((p - q).abs().max()) for (n, p), q in zip(model.named_parameters(), _model().parameters()))
    assert diff < 1e-5 and moved > 1e-3, (diff, moved)  # the step moved the weights, and both runs moved them alike
    if packed:  # the packing mattered: the same rows attended as one sequence each give another loss
        whole = _loss_sum(_model()(input_ids=ids, use_cache=False).logits, target) / int((target != -100).sum())
        assert abs(float(whole) - float(sp["loss"])) > 1e-4


def test_trainpipe_run_with_sequence_parallel_2_equals_one_process(tmp_path, base):  # noqa: F811 - `base` is a fixture
    """The loop itself: `trainpipe run --nproc-per-node 2` with `distributed.sequence_parallel: 2` (one data-parallel rank whose
    sequences are split over both processes) ends with the weights one process reaches on the same batches, and a preempted
    and resumed sequence-parallel run ends bit-identical to the uninterrupted one."""
    import yaml

    from test_distributed import events, finish, launch, max_diff, newest_weights, sft_config, sigterm_one_worker
    from trainpipe.cli import main

    common = {"data.packing": "none", "training.max_steps": 4, "training.save_steps": 2, "training.eval_steps": 2}
    one = sft_config(tmp_path / "one", base, **common)
    two = sft_config(tmp_path / "two", base, **common, **{"distributed.sequence_parallel": 2})
    assert main(["run", str(one)]) == 0
    rc, out = finish(launch(two))
    assert rc == 0, out[-3000:]
    run1, run2 = (Path(yaml.safe_load(c.read_text())["output_dir"]) for c in (one, two))
    diff = max_diff(newest_weights(run1), newest_weights(run2))
    steps = [[json.loads(x)["loss"] for x in (r / "metrics.jsonl").read_text().splitlines() if '"loss"' in x and "eval" not in x]
             for r in (run1, run2)]
    print(f"\nSP=2 vs one process: weights {diff:.2e}, losses {steps}")
    assert diff < 1e-5 and steps[0] and all(abs(a - b) < 1e-5 for a, b in zip(*steps, strict=True))
    started = next(e for e in events(run2) if e["event"] == "training_started")
    assert started["effective_batch"] == 8  # micro-batch 4 x accumulation 2 x data-parallel degree 1 (not the 2 processes)
    man = json.loads((run2 / "manifest.json").read_text())
    assert man["distributed"]["topology"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}
    # preempted after its step-2 checkpoint (SIGTERM to rank 1: every rank stops at one step, exit 75), then resumed: the
    # same weights, to the bit, as the uninterrupted sequence-parallel run
    three = sft_config(tmp_path / "three", base, **common, **{"training.resume": "auto", "distributed.sequence_parallel": 2})
    run3 = Path(yaml.safe_load(three.read_text())["output_dir"])
    sigterm_one_worker(three, run3, 0.4)
    rc, out = finish(launch(three))
    assert rc == 0, out[-3000:]
    assert any(e["event"] == "checkpoint_resumed" for e in events(run3))
    a, b = newest_weights(run3), newest_weights(run2)
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed sequence-parallel run differs from the uninterrupted one"
