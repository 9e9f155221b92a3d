"""`model.attn_implementation: auto` and `data.packing: auto`: the rules, the refusals, the planner's memory and `diagnose`.

The GPUs here are FAKE: compute capabilities passed to the rule, or `Hardware` described by name (this machine has no
GPU), and FAKE package sets standing for what is installed (`have`).
"""

import json

import pytest
import yaml

from trainpipe.config import ModelConfig, build_config
from trainpipe.errors import ConfigError
from trainpipe.model.attention import choose_attention
from trainpipe.plan import resolve
from trainpipe.plan.attention import capability_of, decide_packing, memory_attention
from trainpipe.plan.hardware import Hardware
from trainpipe.report.diagnose import diagnose

CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
FAKE_H100_BY_NAME = Hardware("cuda", 1, ("NVIDIA H100 80GB HBM3",), True, 8, "fake")
FAKE_T4_BY_NAME = Hardware("cuda", 1, ("Tesla T4",), False, 8, "fake")
ONLINE, OFFLINE = {}, {"HF_HUB_OFFLINE": "1"}


def fake_installed(*mods):
    return lambda m: m in mods


@pytest.mark.parametrize("accel, cap, mods, env, expect", [
    ("cpu", 0.0, ("flash_attn", "flash_attn_interface", "kernels"), ONLINE, "sdpa"),
    ("cuda", 9.0, ("flash_attn_interface", "flash_attn"), ONLINE, "flash_attention_3"),
    ("cuda", 9.0, ("flash_attn",), ONLINE, "flash_attention_2"),
    ("cuda", 8.0, ("flash_attn",), ONLINE, "flash_attention_2"),
    ("cuda", 8.0, ("flash_attn_interface",), ONLINE, "sdpa"),  # flash-attn 3 is Hopper-only
    ("cuda", 7.5, ("flash_attn", "kernels"), ONLINE, "sdpa"),  # Turing: no flash-attention kernel
    ("cuda", 8.6, ("kernels",), ONLINE, "sdpa"),  # issue 36: auto never fetches a Hub kernel, `kernels` installed or not
    ("cuda", 9.0, ("kernels",), ONLINE, "sdpa"),
    ("cuda", 8.6, ("kernels",), OFFLINE, "sdpa"),
    ("cuda", 10.0, (), ONLINE, "sdpa"),
])
def test_auto_rule_from_fake_capability_and_packages(accel, cap, mods, env, expect):
    impl, rule = choose_attention("auto", accel, cap, have=fake_installed(*mods), env=env)
    assert impl == expect and rule


def test_requested_kept_flash_refused_without_cuda_and_names_validated():
    assert choose_attention("eager", "cpu") == ("eager", "as requested")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        choose_attention("flash_attention_2", "cpu")
    assert ModelConfig(name_or_path="m", attn_implementation="kernels-community/flash-attn2").attn_implementation.startswith("kernels")
    with pytest.raises(ValueError, match="unknown attention implementation"):
        ModelConfig(name_or_path="m", attn_implementation="flash")


GEMMA2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0}
PIN = "kernels-community/flash-attn2@" + "0" * 40


def test_auto_respects_soft_capping_and_names_the_rule():
    impl, rule = choose_attention("auto", "cpu", config=GEMMA2)
    assert impl == "eager" and "attn_logit_softcapping" in rule and "Gemma 2" in rule
    assert choose_attention("auto", "cuda", 8.0, have=fake_installed(), config=GEMMA2)[0] == "eager"
    assert choose_attention("auto", "cuda", 8.0, have=fake_installed("flash_attn"), config=GEMMA2)[0] == "flash_attention_2"  # FA2 caps
    assert choose_attention("auto", "cpu", config={"model_type": "gemma3_text", "attn_logit_softcapping": None})[0] == "sdpa"
    for impl in ("sdpa", "flex_attention"):
        with pytest.raises(ConfigError, match="soft-caps its attention scores"):
            choose_attention(impl, "cpu", config=GEMMA2)


def test_a_hub_kernel_runs_only_named_pinned_installed_and_online():
    with pytest.raises(ConfigError, match="pinned revision"):
        choose_attention("kernels-community/flash-attn2", "cuda", 9.0, have=fake_installed("kernels"), env=ONLINE)
    with pytest.raises(ConfigError, match="pinned revision"):
        choose_attention("kernels-community/flash-attn2@main", "cuda", 9.0, have=fake_installed("kernels"), env=ONLINE)
    with pytest.raises(ConfigError, match="`kernels` package"):
        choose_attention(PIN, "cuda", 9.0, have=fake_installed(), env=ONLINE)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        choose_attention(PIN, "cuda", 9.0, have=fake_installed("kernels"), env=OFFLINE)
    assert choose_attention(PIN, "cuda", 9.0, have=fake_installed("kernels"), env=ONLINE) == (PIN, "as requested")


def test_capability_of_described_gpus():
    assert capability_of(FAKE_H100_BY_NAME) == 9.0 and capability_of(FAKE_T4_BY_NAME) == 7.5 and capability_of(CPU) == 0.0
    assert capability_of(Hardware("cuda", 1, ("X",), True, 8, "", 8.9)) == 8.9  # detected wins


def test_packing_auto_per_objective_peft_and_kernel():
    assert decide_packing("auto", "sdpa", method="sft", peft="lora").value == "padding_free"
    assert decide_packing("auto", "flash_attention_2", method="pretrain", peft="none", accelerator="cuda").value == "padding_free"
    for method in ("dpo", "orpo", "kto", "reward", "classification", "rl"):
        d = decide_packing("auto", "sdpa", method=method, peft="lora")
        assert d.value == "none" and method in d.rule
    d = decide_packing("auto", "sdpa", method="sft", peft="prompt_tuning")
    assert d.value == "none" and "virtual tokens" in d.rule
    d = decide_packing("auto", "kernels-community/metal-flash-sdpa", method="sft", peft="lora", accelerator="cuda")
    assert d.value == "none" and "does not keep packed examples apart" in d.rule
    assert decide_packing("none", "sdpa", method="sft", peft="lora").value == "none"
    for asked in ("auto", "padding_free"):  # a vision-language family that does not flatten: padded, and the plan says so
        d = decide_packing(asked, "sdpa", method="sft", peft="lora", vision="padded")
        assert d.value == "none" and d.rule.startswith(("padded (vision-language rows)", "`data.packing: padding_free` asked; padded"))
    d = decide_packing("auto", "sdpa", method="sft", peft="lora", vision="flattens")  # LLaVA: flattened like text
    assert d.value == "padding_free" and "image features are scattered" in d.rule


@pytest.mark.parametrize("packing", ["pack", "padding_free"])
def test_packing_that_lets_examples_see_each_other_is_refused(packing):
    with pytest.raises(ConfigError) as e:
        decide_packing(packing, "kernels-community/metal-flash-sdpa", method="sft", peft="lora", accelerator="cuda")
    assert "`data.packing" in str(e.value) and "`model.attn_implementation" in str(e.value) and "attend to each other" in str(e.value)
    with pytest.raises(ConfigError, match="no backward"):
        decide_packing(packing, "flex_attention", method="sft", peft="lora")


BASE = {"model": {"name_or_path": "meta-llama/Llama-3.2-1B"}, "data": {"sources": [{"path": "t.jsonl"}], "packing": "auto"}}


def test_resolve_records_both_decisions_and_the_memory_model_knows_eager():
    p = resolve(build_config(BASE), CPU, sizing=False)
    keys = {d.key: d for d in p.decisions}
    assert keys["model.attn_implementation"].value == "sdpa" == p.config.model.attn_implementation
    assert keys["data.packing"].value == "padding_free" == p.config.data.packing
    assert [memory_attention(x) for x in ("eager", "sdpa", "auto", "flash_attention_2", "kernels-community/flash-attn2")] == ["eager", "sdpa", "sdpa", "flash", "flash"]
    a100 = Hardware("cuda", 1, ("NVIDIA A100-SXM4-80GB",), True, 8, "fake")
    over = ["training.per_device_train_batch_size=4", "training.gradient_checkpointing=false", "data.max_length=2048"]
    sdpa = resolve(build_config(BASE, overrides=over + ["model.attn_implementation=sdpa"]), a100).predicted["memory"]
    eager = resolve(build_config(BASE, overrides=over + ["model.attn_implementation=eager"]), a100).predicted["memory"]
    assert eager["activations_bytes"] > 1.5 * sdpa["activations_bytes"]


def test_diagnose_names_eager_on_an_oom_record(tmp_path):
    # FAKE: an OOM needs a GPU; the event log is hand-written, the config as a run writes it
    run = tmp_path / "run"
    run.mkdir()
    ev = [{"time": "t", "event": "training_started", "level": "info", "step": 0},
          {"time": "t", "event": "cuda_oom", "level": "warning", "step": 3, "action": "retry"},
          {"time": "t", "event": "oom_recovered", "level": "warning", "step": 3, "micro_batch": 2, "gradient_accumulation_steps": 16,
           "effective_batch": 32, "gradient_checkpointing": True},
          {"time": "t", "event": "run_finished", "level": "info", "step": 10}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    for impl, named in (("eager", True), ("sdpa", False)):
        (run / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": "m", "attn_implementation": impl}}))
        (f,) = [f for f in diagnose(run) if f.kind == "oom_recovered"]
        assert ("model.attn_implementation" in f.settings) is named and ("eager" in f.fix) is named


def test_a_pinned_hub_kernel_offline_is_allowed_when_that_commit_is_cached(tmp_path):
    """Offline, a named and pinned Hub kernel is refused only when that commit is not in the local cache, where `kernels`
    loads it from (issue 36, noticed: it was refused whenever HF_HUB_OFFLINE was set)."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    name = f"kernels-community/flash-attn2@{rev}"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    with pytest.raises(ConfigError, match="not in the local cache"):
        choose_attention(name, "cuda", 9.0, have=lambda m: True, env=env)
    snap = tmp_path / "hf" / "hub" / "models--kernels-community--flash-attn2" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "build").mkdir()
    assert choose_attention(name, "cuda", 9.0, have=lambda m: True, env=env) == (name, "as requested")
    other = {"HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(tmp_path / "elsewhere")}  # `kernels` reads KERNELS_CACHE first
    with pytest.raises(ConfigError, match="not in the local cache"):
        choose_attention(name, "cuda", 9.0, have=lambda m: True, env=other)
