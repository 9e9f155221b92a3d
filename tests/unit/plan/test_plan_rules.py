"""The planner's decision rules, rule by rule; FLOPs, cost, Young/Daly; GPU names; bad input; the --json contract."""

import json
import math

import pytest

from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan.catalog import ModelNotFoundError, find_model
from trainpipe.plan.request import WhatIf, whatif_config
from trainpipe.plan.whatif import make_plan
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.gpus import UnknownGPUError, find_gpu, normalise


# ------------------------------------------------------------------ GPU names
@pytest.mark.parametrize("name,expected", [("A100-80GB", "A100-80GB"), ("a100 80gb", "A100-80GB"), ("A100-40GB", "A100-40GB"), ("h100", "H100-80GB"),
                                           ("H200", "H200"), ("v100-16gb", "V100-16GB"), ("A10G", "A10G"), ("l4", "L4"), ("T4", "T4"),
                                           ("rtx-3090", "RTX-3090"), ("RTX4090", "RTX-4090"), ("mi300x", "MI300X"), ("NVIDIA A100-SXM4-80GB", "A100-80GB")])
def test_gpu_names_normalise(name, expected):
    assert find_gpu(name).name == expected


def test_normalise_ignores_case_hyphens_vendor():
    assert normalise("NVIDIA GeForce RTX-4090") == normalise("rtx4090")


def test_unknown_gpu_lists_close_names():
    with pytest.raises(UnknownGPUError, match="A100-80GB") as e:
        find_gpu("A100-8GB")
    assert "--gpu-file" in e.value.message


def test_gpu_rows_have_sources_and_dates():
    from trainpipe.plan.gpus import builtin

    for g in builtin():
        assert g.source and g.price_source and g.date and g.on_demand_usd > 0 and g.spot_usd > 0 and g.memory_gib > 0


def test_user_gpu_file_overrides(tmp_path):
    f = tmp_path / "g.json"
    f.write_text(json.dumps({"gpus": [{"name": "T4", "memory_gib": 15, "bf16": False, "bf16_tflops": 0, "fp16_tflops": 65, "on_demand_usd": 0.1, "spot_usd": 0.05}]}))
    assert find_gpu("t4", f).on_demand_usd == 0.1


# ------------------------------------------------------------------ precision
def test_precision_bf16_on_ampere_fp16_before_fp32_on_cpu():
    assert D.decide_precision(find_gpu("A100-80GB")).value == "bf16"
    assert D.decide_precision(find_gpu("L4")).value == "bf16"
    assert D.decide_precision(find_gpu("V100-16GB")).value == "fp16"
    assert D.decide_precision(find_gpu("T4")).value == "fp16"
    assert D.decide_precision(None).value == "fp32"


def test_bf16_on_gpu_without_it_is_an_error():
    with pytest.raises(PlanError, match="fp16"):
        D.decide_precision(find_gpu("T4"), "bf16")


def test_every_decision_has_rule_and_watch():
    p = make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(gpu="A100-80GB"))
    for d in p["decision"]:
        assert d["rule"] and d["watch"], d


# ------------------------------------------------------------------ method
def _method(**kw):
    base = dict(requested="auto", gpu_memory_gib=80, total_memory_gib=80, model_16bit_gib=14, fits=lambda m: True, max_quality=False, examples=None)
    base.update(kw)
    return D.decide_method(**base).value


def test_method_lora_is_default_on_24_to_80_gb():
    assert _method() == "lora"
    assert _method(gpu_memory_gib=24, total_memory_gib=24) == "lora"


def test_method_full_needs_4x_memory_and_quality_or_big_data():
    assert _method(total_memory_gib=640, max_quality=True) == "full"
    assert _method(total_memory_gib=640, examples=200_000) == "full"
    assert _method(total_memory_gib=640, examples=50_000) == "lora"  # room but no reason
    assert _method(total_memory_gib=40, max_quality=True) == "lora"  # reason but < 4x


def test_method_qlora_on_small_gpus_or_when_lora_does_not_fit():
    assert _method(gpu_memory_gib=16, total_memory_gib=16) == "qlora"
    assert _method(fits=lambda m: m == "qlora") == "qlora"


def test_explicit_method_wins():
    assert _method(requested="dora") == "dora"


def test_objective_rules():
    assert D.decide_objective()[-1].value == "sft"
    assert D.decide_objective(preference_data=True)[-1].value == "sft+dpo"
    assert D.decide_objective(preference_data=True, kl_matters=True, budget_allows_rl=True)[-1].value == "sft+rm+rl"
    assert D.decide_objective(preference_data=True, kl_matters=True, budget_allows_rl=False)[-1].value == "sft+dpo"
    keys = [d.key for d in D.decide_objective(new_domain=True, tasks=3)]
    assert keys[:2] == ["stages.pretrain", "stages.adapters"]


# ------------------------------------------------------------------ strategy
def _strategy(**kw):
    base = dict(requested="auto", num_gpus=8, params=7e9, fits_replicated=False, fits_zero2=False, fits_zero3=True)
    base.update(kw)
    return D.decide_strategy(**base)


def test_strategy_rules():
    assert _strategy(num_gpus=1)[0].value == "single"
    assert _strategy(fits_replicated=True)[0].value == "ddp"
    assert _strategy(fits_zero2=True)[0].value == "zero2"
    assert _strategy()[0].value == "fsdp"
    assert _strategy(params=70e9)[0].value == "zero3"
    d, off = _strategy(params=70e9, fits_zero3=False)
    assert d.value == "zero3" and off == "optimizer"
    d, _ = _strategy(params=0.5e9)
    assert d.value == "ddp" and "< 1B" in d.rule  # < 1B: DDP by size, whatever else fits
    # > 100B with `auto` is a stop naming the tools built for it (was: sized as ZeRO-3; issue 10's matrix stops)
    with pytest.raises(PlanError) as e:
        _strategy(params=405e9)
    assert "Megatron-LM" in e.value.message and "torchtitan" in e.value.message and "distributed.strategy" in e.value.message
    d, _ = _strategy(params=405e9, requested="zero3")  # asked for explicitly: honoured
    assert d.value == "zero3"


def test_one_lr_table_for_the_planner_and_the_run():
    # the planner's method names and the run's `method.peft` read the same table (full fine-tune 5e-5 in both)
    assert D.decide_learning_rate("full").value == D.default_learning_rate("sft", "none")[0] == 5e-5
    assert D.decide_learning_rate("lora").value == D.default_learning_rate("sft", "lora")[0] == 2e-4
    assert D.decide_learning_rate("qlora").value == D.default_learning_rate("sft", "qlora")[0]


def test_accumulation_rule_is_exact():
    assert D.accumulation(4, 8, 32)[:2] == (1, 32)
    acc, eff, rule = D.accumulation(4, 3, 32)
    assert (acc, eff) == (3, 36) and "36" in rule
    acc, eff, rule = D.accumulation(8, 8, 32)
    assert (acc, eff) == (1, 64) and "exceeds" in rule


def test_single_strategy_with_many_gpus_is_an_error():
    with pytest.raises(PlanError):
        _strategy(requested="single")


# ------------------------------------------------------------------ batch and checkpointing
def test_batch_largest_micro_batch_that_fits_without_checkpointing():
    mb, ck, acc = D.decide_batch(requested_micro_batch=None, requested_ckpt=None, world=1, fits=lambda mb, ck: mb <= 4 and not ck)
    assert (mb.value, ck.value, acc.value) == (4, False, 8)


def test_batch_checkpointing_when_memory_bound():
    mb, ck, acc = D.decide_batch(requested_micro_batch=None, requested_ckpt=None, world=2, fits=lambda mb, ck: ck and mb <= 2)
    assert (mb.value, ck.value, acc.value) == (2, True, 8)


def test_micro_batch_zero_is_an_error():
    # `--set` refuses 0 when the config is validated; a config changed past validation (a caller's model_copy) is the planner's error
    cfg = whatif_config("Qwen/Qwen2.5-0.5B")
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"per_device_train_batch_size": 0})})
    with pytest.raises(PlanError, match="micro-batch"):
        make_plan(cfg, WhatIf(gpu="A100-80GB"))


# ------------------------------------------------------------------ FLOPs, time, cost, Young/Daly
def test_flops_full_is_6N_plus_attention_lora_is_two_thirds():
    spec = find_model("meta-llama/Llama-2-7b-hf")
    A = spec.arch
    n = spec.total_params - spec.embedding_params
    attn = 2 * A["layers"] * 2048 * A["heads"] * A["head_dim"]
    assert C.flops_per_token(spec, "full", 2048, False) == 3 * (2 * n + attn)
    assert C.flops_per_token(spec, "lora", 2048, False, lora_params=0) == 2 * (2 * n + attn)
    assert C.flops_per_token(spec, "full", 2048, True) == 4 * (2 * n + attn)  # + one recomputed forward


def test_time_and_cost():
    spec = find_model("meta-llama/Llama-2-7b-hf")
    g = find_gpu("A100-80GB")
    c = C.compute(spec, "full", 1e9, 2048, False, g, 8, "bf16", mfu=0.5)
    assert c.scaling_efficiency == 0.95  # NVLink 3 within the node
    assert math.isclose(c.hours, c.flops / (8 * 312e12 * 0.5 * 0.95) / 3600)
    cost = C.cost(c.hours, 8, g, checkpoint_bytes=0, preemptions_per_hour=0)
    assert math.isclose(cost.on_demand_usd, c.hours * 8 * g.on_demand_usd)
    assert math.isclose(cost.spot_usd, c.hours * 8 * g.spot_usd)


def test_young_daly():
    # C = 0.1 h, M = 10 h: sqrt(2 * 0.1 * 10) - 0.1 = 1.3142 h
    assert math.isclose(C.young_daly_interval(0.1, 10), math.sqrt(2) - 0.1)
    assert C.young_daly_interval(30, 10) == 10
    w = C.waste_fraction(1.0, 0.1, 10, 0.0)
    assert math.isclose(w, 0.1 + 0.05)


def test_spot_cost_includes_rework():
    g = find_gpu("H100")
    cst = C.cost(10, 8, g, checkpoint_bytes=100e9, preemptions_per_hour=0.2)
    assert cst.spot_hours > 10 and cst.spot_usd > 10 * 8 * g.spot_usd
    assert cst.checkpoint_interval_hours > 0


# ------------------------------------------------------------------ bad input
def test_unknown_model_offline_names_close_catalog_entries(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as e:
        find_model("meta-llama/Llama-3-8B")
    msg = e.value.message
    assert "Meta-Llama-3-8B" in msg and "config.json" in msg and "offline" in msg


def test_qlora_with_param_offload_is_impossible():
    with pytest.raises(PlanError, match="QLoRA"):
        make_plan(whatif_config("Qwen/Qwen2.5-7B", ["method.peft=qlora", "distributed.strategy=zero3", "distributed.offload=optimizer+params"]),
                  WhatIf(gpu="A100-80GB", num_gpus=4))


def test_more_gpus_per_node_than_machines_have():
    with pytest.raises(PlanError, match="per node"):
        make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(gpu="H100", num_gpus=16))


def test_fits_nowhere_says_what_would_fit():
    # "does not fit" is an answer, not a usage error (issue 14 item 5): the plan comes back with fits false and the reason
    p = make_plan(whatif_config("meta-llama/Llama-3.1-70B", ["method.peft=none", "training.per_device_train_batch_size=8", "data.max_length=4096"]),
                  WhatIf(gpu="A100-80GB"))
    assert p["fits"] is False and p["memory"]["fits"] == {"A100-80GB": False}
    assert "What would fit" in p["why_not"] and "--num-gpus" in p["why_not"]
    assert p["memory"]["per_device"]["total_bytes"] > 80 * 1024**3


def test_does_not_fit_is_exit_0_with_fits_false_in_json_and_table(capsys):
    from trainpipe.cli import main

    args = ["plan", "--model", "meta-llama/Llama-3.1-70B", "--gpu", "A100-80GB", "--set", "method.peft=none", "--set", "training.per_device_train_batch_size=8",
            "--set", "data.max_length=4096"]
    assert main(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fits"] is False and p["why_not"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "What would fit" in out and "Traceback" not in out


def test_bad_lora_target_names_module_choices():
    from trainpipe.plan.catalog import LoraTargetError

    with pytest.raises(LoraTargetError, match="q_proj"):
        find_model("Qwen/Qwen2.5-0.5B").lora_params(16, "nonsense")


# ------------------------------------------------------------------ the --json contract
def test_json_contract_fields(capsys):
    from trainpipe.cli import main

    rc = main(["plan", "--model", "Qwen/Qwen2.5-7B", "--gpu", "A100-80GB", "--num-gpus", "2", "--tokens", "1e8", "--json"])
    assert rc == 0
    p = json.loads(capsys.readouterr().out)
    assert isinstance(p["decision"], list) and all({"key", "value", "rule"} <= set(d) for d in p["decision"])
    per = p["memory"]["per_device"]
    assert set(per) >= {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes"}
    assert per["total_bytes"] == sum(per[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes"))
    assert p["memory"]["fits"] == {"A100-80GB": True}
    assert set(p["compute"]) >= {"flops", "tokens", "mfu_assumed", "hours"} and p["compute"]["tokens"] == 1e8
    assert set(p["cost"]) >= {"on_demand_usd", "spot_usd"}
    r = p["recommendation"]
    assert set(r) >= {"micro_batch", "gradient_accumulation", "effective_batch", "precision", "gradient_checkpointing", "strategy", "gpu", "num_gpus"}
    assert r["effective_batch"] >= 32 and r["effective_batch"] == r["micro_batch"] * r["gradient_accumulation"] * r["num_gpus"]


def test_cli_errors_exit_2_without_traceback(capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", "Qwen/Qwen2.5-7B", "--gpu", "A100-8GB"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "A100-80GB" in out.out


def test_budget_ranks_top_five():
    p = make_plan(whatif_config("Qwen/Qwen2.5-7B"), WhatIf(tokens=5e7, budget_usd=500))
    rows = p["ranking"]
    assert 1 <= len(rows) <= 5 and all(r["on_demand_usd"] <= 500 for r in rows)
    assert [r["on_demand_usd"] for r in rows] == sorted(r["on_demand_usd"] for r in rows)
    assert all("budget_margin_usd" in r and r["memory_margin_gib"] >= 0 for r in rows)


def test_deadline_ranks_by_time():
    p = make_plan(whatif_config("Qwen/Qwen2.5-1.5B"), WhatIf(tokens=5e7, deadline_hours=10))
    hours = [r["hours"] for r in p["ranking"]]
    assert hours == sorted(hours) and all(h <= 10 for h in hours)


def test_plan_from_run_config(tmp_path, tiny_model_dir, capsys):
    from trainpipe.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": f"q{i}", "output": "a" * 40}) for i in range(50)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name_or_path: {tiny_model_dir}}}\ndata: {{sources: [{{path: train.jsonl}}]}}\n")
    assert main(["plan", str(cfg), "--gpu", "L4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["model"]["source"] == "local" and p["recommendation"]["gpu"] == "L4" and p["compute"]["tokens_known"]


# ------------------------------------------------------------------ `trainpipe plan CONFIG` is the plan `run` executes
def _run_config(tmp_path, tiny_model_dir, **training):
    import yaml

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": f"q{i}", "output": "a" * 40}) for i in range(50)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model_dir)}, "data": {"sources": [{"path": str(data)}]}, "training": training}))
    return cfg


def test_plan_config_json_equals_what_run_resolves(tmp_path, tiny_model_dir, capsys):
    from trainpipe.cli import main
    from trainpipe.config import load_config
    from trainpipe.plan.command import config_hardware
    from trainpipe.plan.run_plan import plan_run

    cfg = _run_config(tmp_path, tiny_model_dir, per_device_train_batch_size=4)
    assert main(["plan", str(cfg), "--gpu", "H100", "--num-gpus", "8", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["plan"]
    c = load_config(cfg, [])
    hw, world, nodes = config_hardware(c, gpu="H100", num_gpus=8, nodes=None)
    ran = json.loads(json.dumps(plan_run(c, hw, world, nnodes=nodes).to_dict(), default=str))
    assert shown == ran
    assert shown["effective_batch_formula"] == "4 x 1 x 8 = 32" and shown["world_size"]["value"] == 8
    # this machine, no flags: the same as `run` here (one process, the config's world)
    assert main(["plan", str(cfg), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)["plan"]
    from trainpipe.plan.hardware import detect

    assert here == json.loads(json.dumps(plan_run(c, detect()).to_dict(), default=str))


def test_plan_config_honours_an_explicit_learning_rate(tmp_path, tiny_model_dir, capsys):
    from trainpipe.cli import main

    cfg = _run_config(tmp_path, tiny_model_dir, learning_rate=3e-3)
    assert main(["plan", str(cfg), "--gpu", "L4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["recommendation"]["learning_rate"] == 3e-3 and p["plan"]["learning_rate"] == {"value": 3e-3, "source": "config", "rule": "as set", "watch": ""}
    assert main(["plan", str(cfg), "--gpu", "L4", "--num-gpus", "4", "--set", "training.lr_scaling=linear", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["recommendation"]["learning_rate"] == pytest.approx(1.2e-2) and p["plan"]["lr_scaling"]["value"] == "linear"


def test_plan_config_nproc_above_the_machine_is_an_error(tmp_path, tiny_model_dir, capsys):
    from trainpipe.cli import main

    cfg = _run_config(tmp_path, tiny_model_dir)
    assert main(["plan", str(cfg), "--gpu", "L4", "--num-gpus", "64"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "--nodes" in out.out


# ------------------------------------------------------------------ issue 10: `plan --model` resolves through the same resolver
@pytest.mark.parametrize("model, gpu, n", [("Qwen/Qwen2.5-7B", "A100-80GB", 1), ("Qwen/Qwen2.5-7B", "L4", 1), ("Qwen/Qwen2.5-7B", "A100-40GB", 4),
                                           ("Qwen/Qwen2.5-0.5B", "H100", 2), ("meta-llama/Llama-3.1-70B", "A100-80GB", 8), ("Qwen/Qwen2.5-14B", "RTX-4090", 2)])
def test_plan_model_equals_plan_config(tmp_path, capsys, model, gpu, n):
    """`plan --model X --gpu Y` and `plan CONFIG --gpu Y` for the config it stands for give the same micro-batch,
    accumulation, precision, lr, strategy and method: both go through `plan.resolve.resolve` (as `run` does)."""
    import yaml

    from trainpipe.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name_or_path": model}, "data": {"sources": [{"path": "train.jsonl"}]},
                                   "method": {"peft": "auto"}, "training": {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto"}}))
    assert main(["plan", str(cfg), "--gpu", gpu, "--num-gpus", str(n), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)["recommendation"]
    assert main(["plan", "--model", model, "--gpu", gpu, "--num-gpus", str(n), "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["recommendation"]
    keys = ("method", "micro_batch", "gradient_accumulation", "effective_batch", "precision", "learning_rate", "strategy", "offload", "gradient_checkpointing")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}



def test_more_gpus_cost_more_than_perfect_scaling_by_the_interconnect():
    """Eight GPUs do not finish in an eighth of the time: the gradient all-reduce costs by the link (NVLink 95 %, PCIe
    80 %; across nodes InfiniBand 85 %, 25 Gb Ethernet 35 %), and an adapter all-reduces a tiny share of the weights."""
    spec = find_model("meta-llama/Llama-2-7b-hf")
    one = C.compute(spec, "full", 1e9, 2048, False, find_gpu("RTX-4090"), 1, "bf16", mfu=0.4)
    eight = C.compute(spec, "full", 1e9, 2048, False, find_gpu("RTX-4090"), 8, "bf16", mfu=0.4)
    assert one.scaling_efficiency == 1.0 and eight.scaling_efficiency == 0.8  # PCIe, no NVLink
    assert math.isclose(eight.hours * 8, one.hours / 0.8) and eight.hours * 8 > one.hours  # GPU-hours (and dollars) grow
    lora = C.compute(spec, "lora", 1e9, 2048, False, find_gpu("RTX-4090"), 8, "bf16", mfu=0.4, lora_params=10**7)
    assert lora.scaling_efficiency == 0.96
    g = find_gpu("H100")
    assert C.scaling_efficiency(g, 16, 2, "full", "infiniband") == 0.85 and C.scaling_efficiency(g, 16, 2, "full", "ethernet-25g") == 0.35


def test_consumer_gpus_are_in_the_catalogue():
    """The QLoRA rules are about 8-16 GB cards: the catalogue has them, with bf16 (Ampere and newer)."""
    for name, gib in (("RTX-3060", 12), ("RTX-4060-Ti-8GB", 8), ("RTX-4060-Ti-16GB", 16), ("RTX-3090", 24), ("RTX-4090", 24), ("RTX-5090", 32)):
        g = find_gpu(name)
        assert g.memory_gib == gib and g.bf16 and g.bf16_tflops > 0 and g.on_demand_usd > 0, name
    assert find_gpu("NVIDIA GeForce RTX 3060").name == "RTX-3060" and find_gpu("4060 Ti 16GB").name == "RTX-4060-Ti-16GB"


def test_an_amd_gpu_is_not_described_as_nvidia():
    """torch drives an MI300X through ROCm under the `cuda` device name; the precision rule names the vendor's family."""
    from trainpipe.plan import decisions as D

    p, rule = D.auto_precision(True, True, "ROCm GPU (MI300X)")
    assert p == "bf16" and "AMD" in rule and "Ampere" not in rule
    p, rule = D.auto_precision(True, True, "cuda (H100-80GB)")
    assert p == "bf16" and "NVIDIA Ampere or newer" in rule
    assert D.is_amd("AMD Instinct MI250X") and D.is_amd("MI300X") and not D.is_amd("NVIDIA A100-SXM4-80GB")
    assert "Ampere" not in D.decide_precision(find_gpu("MI300X")).rule and "AMD" in D.decide_precision(find_gpu("MI300X")).rule
