"""Tensor parallelism (distributed/tensor_parallel.py: transformers' `tp_plan="auto"` on a DTensor mesh) on 2 gloo
processes equals one process: a tiny Llama's loss, and its weights after an SGD step (every shard gathered), within 1e-5."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.e2e

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256)
LR = 0.5


def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor

    from trainpipe.distributed.tensor_parallel import load

    model = load(path, world)
    assert any(isinstance(p, DTensor) for p in model.parameters())  # the weights are split, not replicated
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss.detach(), "weights": full}, os.path.join(path, "tp.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_tensor_parallel_2_equals_one_process(tmp_path):
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    tp = torch.load(tmp_path / "tp.pt", weights_only=True)

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    assert abs(float(loss) - float(tp["loss"])) < 1e-5
    diff = max(float((p - tp["weights"][n]).abs().max()) for n, p in model.named_parameters())
    assert diff < 1e-5, diff


def test_a_degree_that_does_not_divide_the_heads_is_one_paragraph():
    from transformers import LlamaConfig

    from trainpipe.distributed.tensor_parallel import check
    from trainpipe.errors import TrainpipeError

    with pytest.raises(TrainpipeError, match=r"4 attention and 2 key/value heads, which 4 does not divide.*\(1, 2\)") as exc:
        check(LlamaConfig(**CONFIG), 4)
    assert exc.value.exit_code == 2
    check(LlamaConfig(**CONFIG), 2)
