"""Tensor parallelism's bad input, each one paragraph with exit code 2 (distributed/tensor_parallel.py, plan/tensor_parallel.py):
a model without a transformers tensor-parallel plan, a degree that does not divide the heads, an adapter on the split layers,
a strategy that cannot combine (ZeRO), DDP over several data-parallel ranks; and the gradient norm of the tensor-parallel path
equals torch's on whole tensors."""

from __future__ import annotations

import pytest
import torch

from trainpipe.config import build_config
from trainpipe.distributed import tensor_parallel as tp
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.resolve import plan_run

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=256)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def test_the_plan_of_a_llama_maps_onto_torch_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = tp.styles(_llama(), 2)
    assert len(styles) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert isinstance(styles["model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.1.mlp.down_proj"], RowwiseParallel)


def test_a_model_without_a_tensor_parallel_plan_is_one_paragraph():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(TrainpipeError, match=r"ships none in transformers.*`distributed.tensor_parallel: 1`") as exc:
        tp.styles(model, 2)
    assert exc.value.exit_code == 2


def test_a_degree_that_does_not_divide_the_heads_is_one_paragraph():
    with pytest.raises(TrainpipeError, match=r"4 attention and 2 key/value heads, which 4 does not divide.*\(1, 2\)") as exc:
        tp.styles(_llama(), 4)
    assert exc.value.exit_code == 2


def test_an_adapter_on_the_split_layers_is_one_paragraph():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(TrainpipeError, match=r"q_proj.*not a plain linear layer.*`method.peft: none`"):
        tp.styles(model, 2)


def _cfg(**dist):
    return build_config({"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}, "data": {"sources": [{"path": "x.jsonl"}]},
                         "method": {"peft": dist.pop("peft", "none")}, "distributed": dist})


@pytest.mark.parametrize("world,dist,needle", [
    (2, {"tensor_parallel": 2, "strategy": "zero3"}, "DeepSpeed's ZeRO engine partitions whole tensors"),
    (4, {"tensor_parallel": 2, "strategy": "ddp"}, "`distributed.strategy: fsdp` for its 2 data-parallel ranks"),
    (2, {"tensor_parallel": 2, "strategy": "ddp", "peft": "lora"}, "`method.peft: none`"),
])
def test_what_the_loop_cannot_combine_with_tensor_parallelism_is_one_paragraph(world, dist, needle):
    with pytest.raises(ConfigError, match="--emit torchtitan") as exc:  # `trainpipe run` plans through plan_run: exit 2
        plan_run(_cfg(**dist), Hardware("cpu", 0, (), False, 1, "test"), world, sizing=False)
    assert exc.value.exit_code == 2 and needle in str(exc.value) and "distributed.tensor_parallel: 2" in str(exc.value)


def test_what_the_loop_runs_is_planned_with_the_tensor_degree():
    plan = plan_run(_cfg(tensor_parallel=2, strategy="fsdp"), Hardware("cpu", 0, (), False, 1, "test"), 4, sizing=False)
    assert plan.specs.distributed.dims.describe() == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    with pytest.raises(TrainpipeError, match="a tensor degree of 2.*`distributed.tensor_parallel`"):
        plan_run(_cfg(tensor_parallel=2), Hardware("cpu", 0, (), False, 1, "test"), 3, sizing=False)


def test_the_gradient_norm_of_whole_tensors_is_torchs():
    a, b = _llama(), _llama()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (a, b):
        m(input_ids=ids, labels=ids).loss.backward()
    mine = tp.clip_grad_norm(list(a.parameters()), 0.5)
    theirs = float(torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.5))
    assert abs(mine - theirs) < 1e-5 * theirs and mine > 0.5  # it clipped
    assert max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters())) < 1e-7
