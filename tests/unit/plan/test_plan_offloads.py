"""Offload choices only among those the chosen strategy has, and plans that name only strategies trainpipe trains.

What each strategy has (the issue's table, spelled out here rather than read from the module): FSDP2's CPUOffloadPolicy
moves parameters, gradients and optimizer states together (`optimizer+params`, no optimizer-only mode); DeepSpeed
ZeRO-2 offloads optimizer states; ZeRO-3 optimizer states, or those and the parameters; single and DDP nothing. The
config refuses any other pair when the strategy is set, the planner's check refuses it after `auto`, and no plan or
suggestion `trainpipe plan --model` prints names another pair (a grid of model sizes x GPU types x counts). Full-size
catalogue shapes, no weights: the planner is arithmetic.
"""

import contextlib
import io
import json
import re
from dataclasses import replace

import pytest

from trainpipe.config import build_config
from trainpipe.errors import ConfigError
from trainpipe.plan import decisions as D
from trainpipe.plan import memory as M
from trainpipe.plan.catalog import find_model
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.run_plan import plan_run

HAS = {"single": {"none"}, "ddp": {"none"}, "fsdp": {"none", "optimizer+params"}, "zero2": {"none", "optimizer"},
       "zero3": {"none", "optimizer", "optimizer+params"}}
OFFLOADS = ("none", "optimizer", "optimizer+params")
MEMORY_NAME = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params", "optimizer+params": "optimizer+params"}
H100x8 = Hardware("cuda", 8, ("NVIDIA H100 80GB HBM3",) * 8, True, 64, "fake")
BASE = {"model": {"name_or_path": "Qwen/Qwen2.5-7B"}, "data": {"sources": [{"path": "x.jsonl"}]}}


@pytest.mark.parametrize("strategy", sorted(HAS))
def test_config_and_plan_check_agree_with_the_table(strategy):
    for offload in OFFLOADS:
        raw = BASE | {"distributed": {"strategy": strategy, "offload": offload}}
        if offload in HAS[strategy]:
            build_config(raw)
            D.check_strategy(strategy=strategy, offload=offload, peft="lora", world=1 if strategy == "single" else 8)
            continue
        with pytest.raises(ConfigError) as e:
            build_config(raw)
        assert f"`distributed.offload: {offload}`" in e.value.message and f"`distributed.strategy: {strategy}`" in e.value.message
        with pytest.raises(PlanError) as e:  # the same after `auto` resolved to this strategy
            D.check_strategy(strategy=strategy, offload=offload, peft="lora", world=1 if strategy == "single" else 8)
        assert "`distributed.offload" in e.value.message and all(f"`distributed.strategy: {s}`" in e.value.message
                                                                  for s in HAS if offload in HAS[s] and s != strategy)


def _plan(*args: str) -> dict:
    from trainpipe.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *args, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_70b_full_fine_tune_on_8_h100s_is_zero3_with_an_offload_zero3_has():
    """It was `fsdp + offload optimizer` (FSDP2 has no optimizer-only offload), with zero3 suggested, which did not train."""
    p = _plan("--model", "meta-llama/Llama-3.1-70B", "--gpu", "H100", "--num-gpus", "8", "--set", "method.peft=none")
    r = p["recommendation"]
    assert r["strategy"] == "zero3" and MEMORY_NAME[r["offload"]] == "optimizer" and r["gradient_checkpointing"] is True
    assert MEMORY_NAME[r["offload"]] in HAS[r["strategy"]]


def _pairs(p: dict) -> list[tuple[str, str, str]]:
    """Every (strategy, offload) a plan recommends, ranks or suggests (`--set distributed.strategy=X` in a suggestion, with
    its `--set distributed.offload=Y` or none), and every strategy a rule tells the user to set."""
    out = []
    r = p["recommendation"]
    if not str(r["strategy"]).startswith("tensor+pipeline"):
        out.append((r["strategy"], MEMORY_NAME[r["offload"]], "recommendation"))
    out += [(row["strategy"], "none", "ranking") for row in p.get("ranking", [])]  # ranked with the request's offload (none)
    text = json.dumps(p)
    for label in re.findall(r"`([^`]*--set distributed\.strategy=[^`]*)`", text):
        st = re.search(r"distributed\.strategy=(\S+)", label).group(1)
        off = re.search(r"distributed\.offload=(\S+)", label)
        out.append((st, off.group(1) if off else "none", label))
    out += [(s, "none", "a rule") for s in re.findall(r"`distributed\.strategy: (\w+)`", text) if s != "auto"]
    return out


GRID = [(m, g, n, peft) for m in ("Qwen/Qwen2.5-1.5B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B")
        for g in ("A100-40GB", "H100") for n in ("1", "2", "8") for peft in ("none", "auto")]


def test_no_plan_or_suggestion_names_an_untrainable_combination():
    seen = set()
    for model, gpu, n, peft in GRID:
        p = _plan("--model", model, "--gpu", gpu, "--num-gpus", n, "--set", f"method.peft={peft}")
        for st, off, where in _pairs(p):
            assert st in HAS and off in HAS[st], f"{model} on {n} x {gpu} ({peft}): {where} names `{st}` with offload `{off}`"
            seen.add((st, off))
    for model, extra in [("meta-llama/Llama-3.1-8B", []), ("meta-llama/Llama-3.1-70B", ["--set", "method.peft=none"])]:
        p = _plan("--model", model, "--tokens", "1e8", "--budget-usd", "100000", *extra)  # the ranking over GPU types and counts
        for st, off, where in _pairs(p):
            assert st in HAS and off in HAS[st], f"{model} ranking: {where} names `{st}`"
    assert {("zero3", "optimizer"), ("zero2", "none"), ("zero3", "none")} <= seen  # the grid reaches the ZeRO rows
    for n, nodes in [("8", "1"), ("8", "4")]:  # > 100B: Megatron-LM / torchtitan only as tools outside trainpipe
        p = _plan("--model", "meta-llama/Llama-3.1-405B", "--gpu", "H100", "--num-gpus", n, "--nodes", nodes)
        for d in p["decision"]:
            if "Megatron" in d["rule"]:
                assert "outside trainpipe" in d["rule"] or "trainpipe does not run" in d["rule"] + d["watch"], d["rule"]


@pytest.mark.parametrize("model,offload,expected", [
    ("Qwen/Qwen2.5-7B", "optimizer+params", "zero3"),  # the matrix's zero2 has no parameter offload
    ("Qwen/Qwen2.5-7B", "optimizer", "zero2"),
])
def test_auto_with_an_offload_set_picks_a_strategy_that_has_it(model, offload, expected):
    c = build_config(BASE | {"model": {"name_or_path": model}, "method": {"peft": "none"}, "distributed": {"offload": offload}})
    p = plan_run(c, H100x8, 8)
    assert p.strategy.value == expected and p.config.distributed.offload == offload and offload in HAS[p.strategy.value]


def test_auto_10_to_100b_runs_zero3_and_soft_prompts_fall_back_to_zero2():
    lora = build_config(BASE | {"model": {"name_or_path": "meta-llama/Llama-3.1-70B"}, "method": {"peft": "none"}})
    p = plan_run(lora, H100x8, 8)
    assert p.strategy.value == "zero3" and "fsdp" not in p.strategy.rule.lower()
    prompt = build_config(BASE | {"model": {"name_or_path": "meta-llama/Llama-3.1-70B"}, "method": {"peft": "prompt_tuning"}})
    p = plan_run(prompt, H100x8, 8)
    assert p.strategy.value in ("zero2", "ddp") and p.offload.value in HAS[p.strategy.value]


def test_fsdp_parameter_offload_moves_the_gradients_to_the_host_too():
    spec = find_model("meta-llama/Llama-3.1-8B")
    s = M.Setup(method="full", precision="bf16", optimizer="adamw", micro_batch=1, seq_len=2048, grad_ckpt=True, strategy="fsdp", num_gpus=8)
    on, off = M.estimate(spec, s), M.estimate(spec, replace(s, offload="params"))
    assert off.gradients_bytes == 4 * spec.total_params // spec.layers  # one layer's unsharded fp32 gradients in flight
    assert off.cpu_bytes == (on.optimizer_bytes + on.gradients_bytes - off.gradients_bytes
                             + on.weights_bytes - on.detail["gathered_bytes"])


def test_host_ram_advice_names_only_an_offload_the_strategy_has():
    """Too little host RAM: the advice names a smaller offload only where the strategy has one (ZeRO-3: optimizer
    instead of optimizer+params); the plan's JSON names the offload by its config value."""
    from trainpipe.plan.memory import Breakdown
    from trainpipe.plan.request import host_ram_check

    b = Breakdown(1, 1, 1, 1, 1, 10, 10, 200 * 2**30)
    ok, rule = host_ram_check(b, 64, strategy="zero3", offload="params")
    assert not ok and "`distributed.offload: optimizer` instead of `optimizer+params`" in rule
    for strategy, offload in (("zero3", "optimizer"), ("zero2", "optimizer"), ("fsdp", "params")):
        ok, rule = host_ram_check(b, 64, strategy=strategy, offload=offload)
        assert not ok and "instead of `optimizer+params`" not in rule and "`distributed.offload: none`" in rule
    p = _plan("--model", "meta-llama/Llama-3.1-70B", "--gpu", "H100", "--num-gpus", "8", "--set", "method.peft=none")
    assert p["recommendation"]["offload"] in HAS[p["recommendation"]["strategy"]]
