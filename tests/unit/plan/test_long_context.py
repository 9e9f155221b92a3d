"""The sequence-parallel rule for long contexts (plan/long_context.py), through `trainpipe plan --model`: it splits one
sequence's activations by the sequence degree, keeps the effective batch over the smaller data-parallel degree, and stays
out of short-context plans."""

import json

import pytest

from trainpipe.cli import main
from trainpipe.plan import long_context
from trainpipe.plan.catalog import find_model
from trainpipe.plan.memory import Setup, estimate

GIB = 1024**3


def _plan(capsys, length: int, *extra: str) -> dict:
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--set", f"data.max_length={length}", "--gpu", "H100", "--num-gpus", "8",
                 *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_8b_at_64k_on_8_h100_chooses_sequence_parallelism_with_its_rule_and_fits(capsys):
    p = _plan(capsys, 65536)
    sp = next(d for d in p["decision"] if d["key"] == "sequence_parallel")
    assert sp["value"] == 2 and "65536 tokens" in sp["rule"] and "32768 tokens per GPU" in sp["rule"]
    assert p["fits"] is True and p["parallel"] == {"sequence": 2, "tensor": 1, "data": 4, "gpus": 8}
    acc = next(d["value"] for d in p["decision"] if d["key"] == "gradient_accumulation")
    assert p["recommendation"]["effective_batch"] == 32 == p["recommendation"]["micro_batch"] * acc * 4  # over dp 4, not the 8 GPUs
    # the memory is the split sequence's: activations halve against the unsplit estimate of the same setup
    s = Setup(**{k: v for k, v in p["setup"].items() if k in Setup.__dataclass_fields__})
    whole = estimate(find_model("meta-llama/Llama-3.1-8B"), s)
    got = p["memory"]["per_device"]["activations_bytes"]
    assert got < 0.55 * whole.activations_bytes and p["memory"]["detail"]["tokens_per_rank"] == 32768
    assert whole.activations_bytes > GIB * 80 * long_context.HEAVY  # why the rule applied: the unsplit activations were heavy


def test_short_contexts_keep_one_sequence_per_gpu(capsys):
    p = _plan(capsys, 4096)
    assert "sequence_parallel" not in {d["key"] for d in p["decision"]} and "parallel" not in p


@pytest.mark.parametrize("seq,heads_ok", [(65536, [2, 4, 8]), (65538, [2])])
def test_the_degree_divides_the_node_the_heads_and_the_sequence(seq, heads_ok):
    spec = find_model("meta-llama/Llama-3.1-8B")  # 32 attention heads, 8 key/value heads
    assert long_context.degrees(spec, seq, 8) == heads_ok
    assert long_context.degrees(spec, 65536, 6) == [2]  # 3 and 6 divide neither 32 heads nor 8 kv heads


@pytest.mark.parametrize("length,extra,needle", [
    (65540, ["--set", "distributed.sequence_parallel=8"], "does not divide `data.max_length` 65540"),
    (65536, ["--set", "distributed.sequence_parallel=3"], "cannot hold a sequence degree of 3"),
    (65536, ["--set", "distributed.sequence_parallel=2", "--set", "model.attn_implementation=eager"], "model.attn_implementation: sdpa"),
])
def test_a_sequence_degree_that_cannot_shard_is_one_paragraph_exit_2(capsys, length, extra, needle):
    rc = main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--set", f"data.max_length={length}", *extra, "--gpu", "H100", "--num-gpus", "8"])
    out = " ".join(capsys.readouterr())
    assert rc == 2 and needle in out and "Traceback" not in out and "distributed.sequence_parallel" in out


def test_a_sequence_degree_as_set_is_planned_and_run_refuses_it_naming_the_hand_off(capsys):
    p = _plan(capsys, 65536, "--set", "distributed.sequence_parallel=4")
    sp = next(d for d in p["decision"] if d["key"] == "sequence_parallel")
    assert sp["value"] == 4 and sp["rule"].startswith("as set") and p["parallel"]["data"] == 2
    assert p["memory"]["detail"]["tokens_per_rank"] == 16384
    from trainpipe.config import build_config
    from trainpipe.errors import ConfigError
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import plan_run

    cfg = build_config({"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}, "data": {"sources": [{"path": "x.jsonl"}]},
                        "method": {"name": "dpo"}, "distributed": {"sequence_parallel": 2, "strategy": "ddp"}})
    with pytest.raises(ConfigError, match="--emit torchtitan") as exc:  # `trainpipe run` plans through plan_run: exit 2
        plan_run(cfg, Hardware("cpu", 0, (), False, 1, "test"), 2, sizing=False)
    assert exc.value.exit_code == 2 and "`method.name: sft` or `pretrain` (got `dpo`)" in str(exc.value)


@pytest.mark.parametrize("strategy,packing,attention,refused", [
    ("fsdp", "pack", "sdpa", None), ("zero3", "padding_free", "auto", None), ("ddp", "none", "flex_attention", None),
    ("ddp", "padding_free", "sdpa", None),
    ("zero2", "none", "sdpa", "`distributed.strategy` one of ddp, fsdp, zero3 (the plan has `zero2`)"),
    ("fsdp", "pack", "flex_attention", "for `data.packing: pack` (got `flex_attention`"),
])
def test_run_takes_a_sequence_degree_under_fsdp_zero3_and_packing_and_refuses_the_rest(strategy, packing, attention, refused):
    from trainpipe.config import build_config
    from trainpipe.errors import ConfigError
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import plan_run

    cfg = build_config({"model": {"name_or_path": "meta-llama/Llama-3.1-8B", "attn_implementation": attention},
                        "data": {"sources": [{"path": "x.jsonl"}], "packing": packing},
                        "distributed": {"sequence_parallel": 2, "strategy": strategy}})
    hw = Hardware("cuda", 4, ("NVIDIA H100 80GB HBM3",) * 4, True, 16, "test", 9.0)  # flex attention trains on GPUs only
    if refused is None:
        assert plan_run(cfg, hw, 4, sizing=False).specs.distributed.dims.cp == 2
        return
    with pytest.raises(ConfigError, match="--emit torchtitan") as exc:
        plan_run(cfg, hw, 4, sizing=False)
    assert exc.value.exit_code == 2 and refused in str(exc.value)
