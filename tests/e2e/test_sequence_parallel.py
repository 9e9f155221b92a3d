"""Ulysses sequence parallelism (distributed/ulysses.py: DeepSpeed's UlyssesSPAttentionHF) on 2 gloo processes equals one
process: a tiny Llama's two sequences split in halves over 2 ranks give the same summed loss over the exact loss-token
denominator, the same gradients, and after an SGD step the same weights (to 1e-5) as the whole sequences on one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256, attn_implementation="sdpa")
LENGTH, LR = 32, 0.5


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, LENGTH), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that carries no loss
    labels[1, 27:] = -100  # padding at the end of the shorter sequence
    return ids, labels


def _loss_sum(logits, target):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from trainpipe.distributed.ulysses import register, shard

    model = _model()
    register(model, world, micro_batch=2, seq_len=LENGTH, attention="sdpa")
    ids, labels = _batch()
    part = shard(ids, labels, rank, world)
    denom = int((torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1) != -100).sum())  # the window's loss tokens, all shards
    logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
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


def test_sequence_parallel_2_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "sp.pt")
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    sp = torch.load(out, weights_only=True)

    torch.set_num_threads(1)
    model = _model()
    ids, labels = _batch()
    target = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    loss = _loss_sum(model(input_ids=ids).logits, target) / int((target != -100).sum())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    assert abs(float(loss) - float(sp["loss"])) < 1e-6
    diff = max(float((p - sp["weights"][n]).abs().max()) for n, p in model.named_parameters())
    moved = max(float((p - q).abs().max()) for (n, p), q in zip(model.named_parameters(), _model().parameters()))
    assert diff < 1e-5 and moved > 1e-3, (diff, moved)  # the step moved the weights, and both runs moved them alike
