"""The memory model against published measured peaks (plan/data/measurements.json; benchmarks/plan_accuracy.py prints the table).

- every well-specified published setup was measured *running*: `trainpipe plan` with that setup on that GPU must not say "does not fit"
  (issue 14 item 5: 13B LoRA on a 40 GB card and an 8B LoRA on a 24 GB card were refused; the 10 % headroom is for
  choosing, the verdict is the physical question, and a trainpipe run's chunked loss keeps one fp32 chunk, not 14 B per logit);
- the accuracy holds on the held-out part (every third well-specified row), not only on the rows the mechanisms were built on.
"""

import pytest

from trainpipe.plan.accuracy import evaluate, measurements, share_within
from trainpipe.plan.request import WhatIf, whatif_config
from trainpipe.plan.whatif import make_plan

_PEFT = {"full": "none", "lora": "lora", "qlora": "qlora", "dora": "dora", "freeze": "freeze"}
_OPTIM = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}
_PRECISION = {"bf16": ["training.bf16=true"], "bf16-true": ["training.bf16=true"], "fp16": ["training.bf16=false", "training.fp16=true"],
              "fp32": ["training.bf16=false"]}


def _overrides(m: dict) -> list[str]:
    """A measured row's setup as `--set` overrides of the default what-if run config."""
    targets = m.get("lora_targets", "attention")
    out = [f"method.peft={_PEFT[m['method']]}", f"training.per_device_train_batch_size={m['micro_batch']}", f"data.max_length={m['seq_len']}",
           f"method.lora.r={m.get('lora_r', 16)}", f"method.lora.dropout={m.get('lora_dropout', 0.05)}", f"training.optim={_OPTIM[m['optimizer']]}",
           f"method.lora.target_modules={targets if targets in ('attention', 'all-linear') else '[' + targets + ']'}",
           f"distributed.strategy={m.get('strategy', 'auto')}", *_PRECISION[m["precision"]]]
    if m["grad_ckpt"] is not None:
        out.append(f"training.gradient_checkpointing={str(m['grad_ckpt']).lower()}")
    return out


@pytest.mark.parametrize("row", [m for m in measurements() if m["well_specified"]], ids=lambda m: m["id"])
def test_measured_running_setups_are_planned_as_fitting(row):
    m = row
    cfg = whatif_config(m["model"], _overrides(m))
    w = WhatIf(gpu=m["gpu"], num_gpus=m["gpus"], attention=m.get("attention", "sdpa"), bf16_true=m["precision"] == "bf16-true",
               framework=m.get("framework", "transformers"))  # the code that ran (trainpipe's own QLoRA keeps fp32 activations: test_plan_trace.py)
    p = make_plan(cfg, w)
    assert p["fits"] is True, (m["id"], m["measured_mib"], p["why_not"])
    assert p["memory"]["per_device"]["total_bytes"] <= p["memory"]["gpu_memory_bytes"]


def test_accuracy_on_calibration_and_held_out_rows():
    rows, share, n = evaluate()
    counted = [r for r in rows if r["well_specified"] and not r["published_held_out"]]
    held = [r for r in counted if r["held_out"]]
    calib = [r for r in counted if not r["held_out"]]
    assert len(held) >= 10 and len(calib) >= 20
    assert share_within(counted)[0] >= 0.8 and share_within(held)[0] >= 0.75 and share_within(calib)[0] >= 0.8
    # no systematic bias left on the held-out part: the mean signed error is within +/-10 %
    assert abs(sum(r["error"] for r in held) / len(held)) < 0.10


def test_published_held_out_sources_are_cited_and_not_calibrated_on():
    """Issue 14 item 5: rows from sources added after the constants were set (`held_out: true`) name where each figure
    is printed, cover the categories the issue names, and are reported apart. The figures measured at the time of
    writing (benchmarks/plan_accuracy.py) are the regression floor: no row over-predicted beyond +15 % (the planner
    never refuses what ran), and the part's mean |error| stays below 20 %."""
    rows, _, _ = evaluate()
    pub = [r for r in rows if r["published_held_out"]]
    assert len(pub) >= 10 and all(r["held_out"] == r["well_specified"] for r in pub)
    for r in pub:
        assert r["source"] and "'" in r["source"] and r["assumptions"], r["id"]  # the quoted figure and what was assumed
    kinds = {(r["method"], r["micro_batch"] * r["seq_len"] >= 8192) for r in pub if r["well_specified"]}
    assert {("full", True), ("lora", True), ("qlora", True)} <= kinds
    counted = [r for r in pub if r["well_specified"]]
    assert all(r["error"] <= 0.15 for r in counted), [(r["id"], round(r["error"], 3)) for r in counted if r["error"] > 0.15]
    assert sum(abs(r["error"]) for r in counted) / len(counted) < 0.20


def test_installed_bitsandbytes_keeps_only_the_packed_weight():
    """The mechanism behind QLoRA's activation count: the installed bitsandbytes' 4-bit matmul keeps the packed weight
    for the input gradient, not the input itself (older releases kept both), so a trainpipe QLoRA layer saves what a
    LoRA layer on a 16-bit base saves; the published rows (older bitsandbytes) still count the inputs."""
    import torch
    import bitsandbytes as bnb
    import bitsandbytes.functional as BF

    from trainpipe.plan import memory as M
    from trainpipe.plan.catalog import find_model

    q, state = BF.quantize_4bit(torch.randn(128, 64), quant_type="nf4", blocksize=64)
    a = torch.randn(8, 64, requires_grad=True)
    out = bnb.matmul_4bit(a, q.t(), quant_state=state)
    kept = out.grad_fn.tensors
    assert kept[0] is None and kept[1] is not None and kept[1].data_ptr() == q.data_ptr()
    out.sum().backward()
    assert a.grad is not None and a.grad.shape == a.shape  # the input gradient without the input

    spec = find_model("meta-llama/Llama-2-7b-hf")
    t = 8192
    ours = M.Setup(method="qlora", precision="bf16", seq_len=t, micro_batch=1, qlora_upcast_rest=True)
    default = M.Setup(method="qlora", precision="bf16", seq_len=t, micro_batch=1)
    lora = M.Setup(method="lora", precision="bf16", seq_len=t, micro_batch=1)
    old = M.Setup(method="qlora", precision="bf16", seq_len=t, micro_batch=1, framework="transformers")
    h, i = spec.hidden, spec.arch["intermediate"]
    # no saved 4-bit inputs: trainpipe's default QLoRA (the rest in the 16-bit load dtype) saves what LoRA does; with
    # `upcast_rest: true`, prepare_model_for_kbit_training's fp32 residual stream makes the MLP's three saved tensors
    # fp32 (Linear4bit returns its input's dtype): 2 B more each than on a 16-bit base (traced: test_plan_trace.py)
    assert M.layer_activation_bytes(spec, default, t) == M.layer_activation_bytes(spec, lora, t)
    assert M.layer_activation_bytes(spec, ours, t) == M.layer_activation_bytes(spec, lora, t) + 3 * 2 * t * i
    old_lora = M.Setup(method="lora", precision="bf16", seq_len=t, micro_batch=1, framework="transformers")
    # q/k/v's and gate/up's shared inputs and down's; o_proj's input is the SDPA output the kernel already keeps
    assert M.layer_activation_bytes(spec, old, t) - M.layer_activation_bytes(spec, old_lora, t) == 2 * t * (2 * h + i)


def test_falcon_40b_qlora_on_a_40gb_card_is_planned_as_fitting():
    """Issue 14 item 5: 40B QLoRA on a 40 GB card was measured running and must not be "does not fit" (the plan of a
    one-sequence micro-batch of 512 tokens: NF4 weights ~21 GB + adapters + activations)."""
    p = make_plan(whatif_config("tiiuae/falcon-40b", ["method.peft=qlora", "training.per_device_train_batch_size=1", "data.max_length=512"]),
                  WhatIf(gpu="A100-40GB"))
    assert p["fits"] is True
    per = p["memory"]["per_device"]
    assert 22 * 2**30 < per["total_bytes"] <= p["memory"]["gpu_memory_bytes"]
