"""The planner's tensor rule (plan/tensor_parallel.py) through `trainpipe plan --model`: 70B full fine-tuning on 2 nodes of 8
H100 chooses FSDP x tensor parallelism without offload where ZeRO-3 alone needs offload; 8B keeps data-parallel sharding; the
state stays 16 B/param over all GPUs while the gathered layers and the activations split by the tensor degree."""

import json

import pytest

from trainpipe.cli import main
from trainpipe.plan import tensor_parallel as tensor
from trainpipe.plan.catalog import find_model
from trainpipe.plan.gpus import find_gpu
from trainpipe.plan.memory import Setup, estimate

GIB = 1024**3


def _plan(capsys, model: str, *extra: str) -> dict:
    assert main(["plan", "--model", model, "--set", "method.peft=none", "--gpu", "H100", *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_70b_full_on_2_nodes_of_8_h100_chooses_fsdp_by_tensor_parallelism_without_offload(capsys):
    p = _plan(capsys, "meta-llama/Llama-3.1-70B", "--num-gpus", "8", "--nodes", "2")
    rows = {d["key"]: d for d in p["decision"]}
    t = rows["tensor_parallel"]["value"]
    assert p["fits"] is True and p["why_not"] is None
    assert rows["strategy"]["value"] == "fsdp" and "offload" not in rows and p["recommendation"]["offload"] == "none"
    assert t in (2, 4, 8) and p["parallel"] == {"sequence": 1, "tensor": t, "data": 16 // t, "gpus": 16}
    assert "ZeRO-3 over all 16 needs" in rows["tensor_parallel"]["rule"] and "16 B/param / 16" in rows["tensor_parallel"]["rule"]
    acc = rows["gradient_accumulation"]["value"]
    assert p["recommendation"]["effective_batch"] == p["recommendation"]["micro_batch"] * acc * (16 // t)  # over dp, not the 16 GPUs
    # the memory: the 16 B/param state of ZeRO-3 over 16 GPUs, activations and gathered layers / t
    spec, gpu = find_model("meta-llama/Llama-3.1-70B"), find_gpu("H100")
    s = Setup(**{k: v for k, v in p["setup"].items() if k in Setup.__dataclass_fields__})
    z3 = estimate(spec, Setup(**{**p["setup"], "strategy": "zero3", "offload": "none"}))
    mem = p["memory"]["per_device"]
    assert mem["optimizer_bytes"] + mem["gradients_bytes"] == z3.optimizer_bytes + z3.gradients_bytes
    assert abs(mem["optimizer_bytes"] + mem["gradients_bytes"] + mem["weights_bytes"] - p["memory"]["detail"]["gathered_bytes"]
               - 16 * spec.total_params / 16) < 0.01 * 16 * spec.total_params / 16
    assert mem["activations_bytes"] == z3.activations_bytes // t and mem["cpu_offload_bytes"] == 0
    assert mem["total_bytes"] <= gpu.memory_bytes * 0.9
    # why: ZeRO-3 alone at micro-batch 1 does not fit without offload
    assert estimate(spec, Setup(**{**p["setup"], "strategy": "zero3", "offload": "none", "micro_batch": 1})).total_bytes > gpu.memory_bytes * 0.9
    assert s.offload == "none"


def test_a_tensor_degree_as_set_is_planned_and_one_that_divides_nothing_is_one_paragraph(capsys):
    p = _plan(capsys, "meta-llama/Llama-3.1-70B", "--num-gpus", "8", "--nodes", "2", "--set", "distributed.tensor_parallel=8")
    row = next(d for d in p["decision"] if d["key"] == "tensor_parallel")
    assert row["value"] == 8 and row["rule"].startswith("as set") and p["parallel"]["data"] == 2
    rc = main(["plan", "--model", "meta-llama/Llama-3.1-70B", "--set", "method.peft=none", "--set", "distributed.tensor_parallel=3", "--gpu", "H100",
               "--num-gpus", "8", "--nodes", "2"])
    out = " ".join(capsys.readouterr())
    assert rc == 2 and "a tensor degree of 3" in out and "`distributed.tensor_parallel`" in out and "Traceback" not in out


def test_a_strategy_as_set_is_kept(capsys):
    p = _plan(capsys, "meta-llama/Llama-3.1-70B", "--num-gpus", "8", "--nodes", "2", "--set", "distributed.strategy=zero3")
    assert "parallel" not in p and next(d for d in p["decision"] if d["key"] == "strategy")["value"] == "zero3"


@pytest.mark.parametrize("gpus,nodes", [("8", "1"), ("8", "2")])
def test_8b_full_keeps_data_parallel_sharding(capsys, gpus, nodes):
    p = _plan(capsys, "meta-llama/Llama-3.1-8B", "--num-gpus", gpus, "--nodes", nodes)
    assert p["fits"] is True and "parallel" not in p
    assert "tensor_parallel" not in {d["key"] for d in p["decision"]}


def test_the_degrees_divide_the_node_and_the_heads():
    spec = find_model("meta-llama/Llama-3.1-70B")  # 64 attention heads, 8 key/value heads
    assert tensor.degrees(spec, 8) == [2, 4, 8] and tensor.degrees(spec, 6) == [2]
    s = Setup(method="full", precision="bf16", optimizer="adamw", micro_batch=1, seq_len=1024, grad_ckpt=True, strategy="fsdp", num_gpus=16)
    one, eight = tensor.memory(spec, s, 1), tensor.memory(spec, s, 8)
    assert eight.total_bytes < one.total_bytes and eight.optimizer_bytes == one.optimizer_bytes  # the state does not shrink with t
