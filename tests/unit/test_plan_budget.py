"""The budget headline (issue 15 item 2) and the > 100B and offload plans (issue 15 item 3).

- with `--budget-usd` the headline is row 1 of the ranking under the stated objective (`--objective cost`: the cheapest;
  `time`: the fastest within the budget), and it says which;
- a > 100B plan's value matches its rule: tensor + pipeline parallel, Megatron-LM / torchtitan named, TP x PP x DP sized
  so that it fits and uses the GPUs given (or says how many it needs);
- an offload plan checks the host RAM it needs (64-128 GB per GPU in the seed) and says `fits: false` when the host lacks it.
"""

import json

import pytest

from trainpipe.plan.request import WhatIf, whatif_config
from trainpipe.plan.whatif import make_plan

GIB = 1024**3


def _same_setup(p):
    r, top = p["recommendation"], p["ranking"][0]
    return (r["gpu"], r["num_gpus"], r["method"]) == (top["gpu"], top["num_gpus"], top["method"])


def test_budget_headline_is_the_cheapest_ranked_row():
    p = make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(tokens=1e9, budget_usd=500))
    assert p["ranking"] and _same_setup(p)
    assert p["cost"]["on_demand_usd"] == pytest.approx(p["ranking"][0]["on_demand_usd"], rel=1e-9)
    assert p["cost"]["on_demand_usd"] == min(r["on_demand_usd"] for r in p["ranking"])
    assert p["headline"]["objective"] == "cost" and "cheapest" in p["headline"]["rule"] and "$500.00" in p["headline"]["rule"]
    assert p["recommendation"]["objective"] == "cost"


def test_objective_time_is_the_fastest_within_the_budget():
    p = make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(tokens=1e9, budget_usd=500, objective="time"))
    hours = [r["hours"] for r in p["ranking"]]
    assert hours == sorted(hours) and all(r["on_demand_usd"] <= 500 for r in p["ranking"])
    assert _same_setup(p) and p["compute"]["hours"] == pytest.approx(hours[0], rel=1e-9)
    assert p["headline"]["objective"] == "time" and "fastest" in p["headline"]["rule"]
    cheap = make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(tokens=1e9, budget_usd=500))
    assert p["compute"]["hours"] <= cheap["compute"]["hours"] and p["cost"]["on_demand_usd"] >= cheap["cost"]["on_demand_usd"]


def test_budget_headline_in_the_table_and_bad_objective_is_usage(capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", "Qwen/Qwen2.5-1.5B", "--tokens", "1e8", "--budget-usd", "100", "--objective", "time"]) == 0
    out = capsys.readouterr().out
    assert "headline (time)" in out and "fastest setups that fit" in out
    assert main(["plan", "--model", "Qwen/Qwen2.5-1.5B", "--tokens", "1e8", "--budget-usd", "100", "--objective", "speed"]) == 2
    assert "--objective speed" in capsys.readouterr().out


# ------------------------------------------------------------------ > 100B: tensor + pipeline parallel
def test_405b_value_matches_its_rule_tp_pp_dp():
    p = make_plan(whatif_config("meta-llama/Llama-3.1-405B"), WhatIf(gpu="H100", num_gpus=8, nodes=4))
    st = next(d for d in p["decision"] if d["key"] == "strategy")
    par = p["parallel"]
    assert st["value"].startswith("tensor+pipeline parallel") and "tensor + pipeline" in st["rule"]
    assert "Megatron-LM" in st["rule"] and "torchtitan" in st["rule"]
    assert f"TP {par['tensor']} x PP {par['pipeline']} x DP {par['data']}" in st["value"]
    assert par["tensor"] * par["pipeline"] * par["data"] <= 32 and par["tensor"] == 8
    assert p["fits"] is True and p["memory"]["per_device"]["total_bytes"] <= 80 * GIB
    # the fewest pipeline stages that fit: with half as many, the per-GPU state alone exceeds the GPU (with headroom)
    one = p["memory"]["detail"]["single_device_breakdown"]
    state = one["weights_bytes"] + one["gradients_bytes"] + one["optimizer_bytes"]
    if par["pipeline"] > 1:
        assert state / (par["tensor"] * par["pipeline"] // 2) + one["activations_bytes"] / par["tensor"] > 80 * GIB * 0.9 * 0.95
    assert p["recommendation"]["strategy"] == st["value"]


def test_405b_on_too_few_gpus_is_fits_false_with_how_many():
    p = make_plan(whatif_config("meta-llama/Llama-3.1-405B", ["method.peft=none"]), WhatIf(gpu="H100", num_gpus=8))
    assert p["fits"] is False and "needs at least" in p["why_not"] and p["parallel"]["gpus_needed"] > 8


def test_405b_in_the_cli_is_a_plan_not_an_error(capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", "meta-llama/Llama-3.1-405B", "--gpu", "H100", "--num-gpus", "8", "--nodes", "4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["parallel"]["frameworks"] == ["Megatron-LM", "torchtitan"]


# ------------------------------------------------------------------ offload needs host RAM
def test_offload_plan_checks_host_ram():
    cfg = whatif_config("meta-llama/Llama-3.1-70B", ["method.peft=none", "distributed.strategy=zero3", "distributed.offload=optimizer+params",
                                                     "training.per_device_train_batch_size=1", "training.gradient_checkpointing=true"])
    req = dict(gpu="A100-80GB", num_gpus=8)
    small = make_plan(cfg, WhatIf(**req, host_ram_gib=64))
    cpu = small["memory"]["per_device"]["cpu_offload_bytes"]
    assert cpu > 64 * GIB  # 70B full fine-tune states offloaded over 8 GPUs: far above 64 GB per GPU
    assert small["fits"] is False and "host lacks the RAM" in small["why_not"] and "64" in small["why_not"]
    ram = next(d for d in small["decision"] if d["key"] == "host_ram")
    assert ram["value"] == "too little"
    big = make_plan(cfg, WhatIf(**req, host_ram_gib=cpu / GIB + 8))
    assert big["fits"] is True and next(d for d in big["decision"] if d["key"] == "host_ram")["value"] == "enough"


def test_no_offload_needs_no_host_ram_row():
    p = make_plan(whatif_config("Qwen/Qwen2.5-0.5B"), WhatIf(gpu="A100-80GB"))
    assert not any(d["key"] == "host_ram" for d in p["decision"]) and p["fits"] is True


def test_405b_with_zero3_asked_for_says_zero3_in_value_and_rule():
    cfg = whatif_config("meta-llama/Llama-3.1-405B", ["distributed.strategy=zero3", "distributed.offload=optimizer",
                                                      "training.per_device_train_batch_size=1", "training.gradient_checkpointing=true"])
    p = make_plan(cfg, WhatIf(gpu="H100", num_gpus=8, nodes=8))
    st = next(d for d in p["decision"] if d["key"] == "strategy")
    assert st["value"] == "zero3" and st["rule"].startswith("`zero3` as set") and "Megatron-LM" in st["rule"]


def test_objective_without_a_budget_is_usage():
    from trainpipe.plan.decisions import PlanError

    with pytest.raises(PlanError, match="--budget-usd"):
        make_plan(whatif_config("Qwen/Qwen2.5-1.5B"), WhatIf(objective="time"))


def test_405b_effective_batch_counts_data_parallel_replicas(capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", "meta-llama/Llama-3.1-405B", "--gpu", "H100", "--num-gpus", "8", "--nodes", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    p = make_plan(whatif_config("meta-llama/Llama-3.1-405B"), WhatIf(gpu="H100", num_gpus=8, nodes=4))
    r, dp = p["recommendation"], p["parallel"]["data"]
    assert r["effective_batch"] == r["micro_batch"] * r["gradient_accumulation"] * dp >= 32
    assert f"x {dp} data-parallel replica(s) = effective batch {r['effective_batch']}" in out


def test_plan_config_above_100b_is_the_tp_pp_plan_and_run_still_stops(tmp_path, capsys):
    import yaml

    from trainpipe.cli import main
    from trainpipe.config import build_config
    from trainpipe.plan.decisions import PlanError
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import resolve

    raw = {"model": {"name_or_path": "meta-llama/Llama-3.1-405B"}, "data": {"sources": [{"path": "train.jsonl"}]}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(cfg), "--gpu", "H100", "--num-gpus", "8", "--nodes", "4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    st = next(d for d in p["decision"] if d["key"] == "strategy")
    assert st["value"].startswith("tensor+pipeline parallel") and p["parallel"]["tensor"] * p["parallel"]["pipeline"] * p["parallel"]["data"] <= 32
    assert "trainpipe run` stops" in p["notes"][0] and "Megatron-LM" in p["notes"][0]
    with pytest.raises(PlanError, match="Megatron-LM"):  # the run itself: trainpipe does not execute tensor/pipeline parallelism
        resolve(build_config(raw), Hardware("cuda", 8, ("H100",) * 8, True, 8, ""), 32, nnodes=4)
