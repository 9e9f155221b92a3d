"""One reserved-memory term in every planner path.

`memory.fragmentation_bytes` is what PyTorch's caching allocator reserves beyond the allocated peak: the flat 5 %, but
under gradient checkpointing at least one layer's activations (the recomputed layers' segments stay cached; its oracle
is plan/allocator.py). `estimate()` uses it; these tests hold every other path that reports a per-device total or
reserved figure to the same term for the same setup: the tensor + pipeline-parallel plan (`plan_3d`, whose per-GPU
share is computed in plan/command.py), `trainpipe plan --model --json` on one GPU and under a sharding strategy, and
`trainpipe plan CONFIG --json`. A short-context setup keeps the flat 5 %.

The setups are full-size catalogue shapes (Llama-3.1-8B, no weights): the planner is arithmetic, so nothing is faked.
"""

import json
from dataclasses import replace

import pytest

from trainpipe.plan import memory as M
from trainpipe.plan.catalog import find_model
from trainpipe.plan.request import WhatIf, plan_3d, whatif_config
from trainpipe.plan.whatif import make_plan
from trainpipe.plan.gpus import find_gpu
from trainpipe.plan.memory import Setup, estimate

MODEL = "meta-llama/Llama-3.1-8B"
LONG = ["method.peft=lora", "training.per_device_train_batch_size=1", "data.max_length=8192", "training.gradient_checkpointing=true"]  # checkpointed long context
SHORT = dict(method="lora", micro_batch=4, seq_len=512)


@pytest.fixture(scope="module")
def spec():
    return find_model(MODEL)


def _flat(allocated: int) -> int:
    return int(M.FRAGMENTATION * allocated)


def _setup_of(p: dict) -> Setup:
    return Setup(**p["setup"])


def _cli_json(capsys, args: list[str]) -> dict:
    from trainpipe.cli import main

    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _assert_per_device_is_estimate(per: dict, b) -> None:
    """A JSON plan's per-device figures are estimate()'s for its setup, the reserved term included."""
    for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes"):
        assert per[k] == getattr(b, k), k
    assert per["allocated_bytes"] == b.allocated_bytes
    assert per["fragmentation_bytes"] == b.fragmentation_bytes
    assert per["reserved_bytes"] == b.reserved_bytes == b.allocated_bytes + b.fragmentation_bytes


# ------------------------------------------------------------------ the tensor + pipeline-parallel path (plan/command.py)
def test_tp_pp_per_gpu_share_uses_the_checkpointed_layer_term(spec):
    """TP 8 on H100s: the per-GPU share's reserve is fragmentation_bytes of that share, with one layer's activations split
    over TP, which here is more than the flat 5 % the path used to take."""
    gpu = find_gpu("H100-80GB")
    p = plan_3d(spec, whatif_config(MODEL, LONG), WhatIf(gpu=gpu.name, num_gpus=8), gpu)
    b, tp = p["memory"], p["parallel"]["tensor"]
    s = p["setup"]
    assert tp == 8 and s.grad_ckpt and (s.micro_batch, s.seq_len) == (1, 8192)
    # one layer's activations from the memory model itself (not from the plan's detail), as one TP rank holds them
    _, ad = M.activation_bytes(spec, replace(s, num_gpus=1))
    layer = ad["per_layer"] // tp
    assert b.detail["recomputed_layer_activations"] == layer
    assert b.fragmentation_bytes == M.fragmentation_bytes(s, b.allocated_bytes, layer) == layer
    assert b.fragmentation_bytes > _flat(b.allocated_bytes) * 1.4  # 184 MiB vs 126 MiB
    assert b.overhead_bytes == M.CUDA_CONTEXT + b.fragmentation_bytes + M.NCCL_BUFFERS
    assert b.reserved_bytes == b.allocated_bytes + b.fragmentation_bytes
    assert b.total_bytes == b.allocated_bytes + b.overhead_bytes


def test_tp_pp_with_one_gpu_per_node_is_estimate_to_the_byte(spec):
    """With TP = PP = 1 (a GPU type with one GPU per node) the 3D path's share is the whole single-device setup: every
    figure, the reserve and the total included, is estimate()'s."""
    gpu = replace(find_gpu("H100-80GB"), max_per_node=1)
    p = plan_3d(spec, whatif_config(MODEL, LONG), WhatIf(gpu=gpu.name, num_gpus=1), gpu)
    assert (p["parallel"]["tensor"], p["parallel"]["pipeline"]) == (1, 1)
    b, e = p["memory"], estimate(spec, p["setup"])
    for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes", "fragmentation_bytes", "reserved_bytes"):
        assert getattr(b, k) == getattr(e, k), k
    assert e.fragmentation_bytes == e.detail["activations"]["per_layer"] > _flat(e.allocated_bytes)  # 1.44 GiB vs 0.98 GiB


def test_tp_pp_plan_short_context_keeps_the_flat_5_percent(spec):
    """Above 100B at the default 1024 tokens: one layer's share is far below 5 % of a GPU's share (Llama-3.1-405B)."""
    p = make_plan(whatif_config("meta-llama/Llama-3.1-405B", ["method.peft=lora"]), WhatIf(gpu="H100", num_gpus=8, nodes=4))
    assert p["parallel"]["tensor"] == 8
    per = p["memory"]["per_device"]
    assert 0 < p["memory"]["detail"]["recomputed_layer_activations"] < _flat(per["allocated_bytes"])
    assert per["fragmentation_bytes"] == _flat(per["allocated_bytes"])
    assert per["overhead_bytes"] == M.CUDA_CONTEXT + per["fragmentation_bytes"] + M.NCCL_BUFFERS


# ------------------------------------------------------------------ `trainpipe plan --model ... --json`
def test_cli_single_gpu_long_context_agrees_with_estimate(spec, capsys):
    p = _cli_json(capsys, ["--model", MODEL, "--set", "method.peft=lora", "--set", "training.per_device_train_batch_size=1", "--set", "data.max_length=8192",
                           "--set", "training.gradient_checkpointing=true", "--gpu", "H100-80GB"])
    s = _setup_of(p)
    assert (s.strategy, s.micro_batch, s.seq_len, s.grad_ckpt) == ("single", 1, 8192, True)
    b = estimate(spec, s)
    per = p["memory"]["per_device"]
    _assert_per_device_is_estimate(per, b)
    layer = M.activation_bytes(spec, s)[1]["per_layer"]
    assert per["fragmentation_bytes"] == M.fragmentation_bytes(s, per["allocated_bytes"], layer) == layer > _flat(per["allocated_bytes"])
    assert per["overhead_bytes"] == M.CUDA_CONTEXT + per["fragmentation_bytes"]  # one process: no NCCL buffers


def test_cli_sharded_long_context_reserve_is_one_layer_per_device(spec, capsys):
    """FSDP over 2 GPUs: each rank runs its own micro-batch, so the layer its allocator caches is the whole layer's
    activations of that micro-batch; the reserve is not divided by the sharding."""
    p = _cli_json(capsys, ["--model", MODEL, "--set", "method.peft=lora", "--set", "training.per_device_train_batch_size=1", "--set", "data.max_length=8192",
                           "--set", "training.gradient_checkpointing=true", "--gpu", "H100-80GB", "--num-gpus", "2", "--set", "distributed.strategy=fsdp"])
    s = _setup_of(p)
    assert (s.strategy, s.num_gpus, s.grad_ckpt) == ("fsdp", 2, True)
    b = estimate(spec, s)
    per = p["memory"]["per_device"]
    _assert_per_device_is_estimate(per, b)
    assert per["fragmentation_bytes"] == M.activation_bytes(spec, s)[1]["per_layer"] > _flat(per["allocated_bytes"])
    assert per["overhead_bytes"] == M.CUDA_CONTEXT + per["fragmentation_bytes"] + M.NCCL_BUFFERS


def test_cli_short_context_keeps_the_flat_5_percent(spec, capsys):
    for ckpt in (False, True):
        p = _cli_json(capsys, ["--model", MODEL, "--set", "method.peft=lora", "--set", "training.per_device_train_batch_size=4", "--set", "data.max_length=512",
                               "--set", f"training.gradient_checkpointing={str(ckpt).lower()}", "--gpu", "H100-80GB"])
        s = _setup_of(p)
        assert s.grad_ckpt is ckpt
        per = p["memory"]["per_device"]
        _assert_per_device_is_estimate(per, estimate(spec, s))
        assert per["fragmentation_bytes"] == _flat(per["allocated_bytes"])
        if s.grad_ckpt:  # checkpointed, but one layer at 4 x 512 tokens is below 5 % of the allocated peak
            assert M.activation_bytes(spec, s)[1]["per_layer"] < per["fragmentation_bytes"]


# ------------------------------------------------------------------ `trainpipe plan CONFIG --json`
def test_cli_config_long_context_agrees_with_estimate(spec, tmp_path, capsys):
    import yaml

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": f"q{i}", "output": "a" * 40}) for i in range(20)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": MODEL}, "data": {"sources": [{"path": str(data)}], "max_length": 8192},
                                   "method": {"peft": "lora"},
                                   "training": {"per_device_train_batch_size": 1, "gradient_checkpointing": True}}))
    p = _cli_json(capsys, [str(cfg), "--gpu", "H100-80GB", "--num-gpus", "1"])
    s = _setup_of(p)
    assert (s.method, s.micro_batch, s.seq_len, s.grad_ckpt, s.strategy) == ("lora", 1, 8192, True, "single")
    b = estimate(spec, s)
    per = p["memory"]["per_device"]
    _assert_per_device_is_estimate(per, b)
    assert per["fragmentation_bytes"] == M.activation_bytes(spec, s)[1]["per_layer"] > _flat(per["allocated_bytes"])
