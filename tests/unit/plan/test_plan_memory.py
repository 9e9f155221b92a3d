"""The memory model piece by piece, exact parameter counts from meta-device builds, and the accuracy share."""

import pytest

from trainpipe.plan import memory as M
from trainpipe.plan.catalog import build_meta_model, find_model, shapes_from_model

GIB = 1024**3


@pytest.fixture(scope="module")
def llama7b():
    return find_model("meta-llama/Llama-2-7b-hf")


def test_catalog_counts_match_published_sizes():
    assert find_model("meta-llama/Llama-2-7b-hf").total_params == 6_738_415_616
    assert find_model("meta-llama/Meta-Llama-3-70B").total_params == 70_553_706_496
    assert find_model("Qwen/Qwen2.5-7B").total_params == 7_615_616_512
    assert find_model("gpt2").total_params == 124_439_808  # alias, tied embeddings counted once


@pytest.mark.parametrize("model_id", ["Qwen/Qwen2.5-0.5B", "microsoft/phi-2", "openai-community/gpt2", "mistralai/Mixtral-8x7B-v0.1"])
def test_shipped_shapes_match_a_fresh_meta_build(model_id):
    from trainpipe.plan.catalog import _data

    e = next(x for x in _data("models.json")["models"] if x["id"] == model_id)
    fresh = shapes_from_model(build_meta_model(e["model_type"], e["config"], e["task"]), 0)
    assert fresh["total_params"] == find_model(model_id).total_params


@pytest.mark.parametrize("model_id,targets", [("Qwen/Qwen2.5-0.5B", "attention"), ("Qwen/Qwen2.5-0.5B", "all-linear"), ("microsoft/Phi-3-mini-4k-instruct", "q,v"),
                                              ("openai-community/gpt2", "attention"), ("EleutherAI/pythia-160m", "all-linear")])
def test_lora_counts_equal_the_peft_wrapper(model_id, targets):
    from peft import LoraConfig, get_peft_model

    from trainpipe.plan.catalog import _data

    spec = find_model(model_id)
    e = next(x for x in _data("models.json")["models"] if x["id"] == spec.id)
    model = build_meta_model(e["model_type"], e["config"], e["task"])
    names = sorted({li.path for li in spec.resolve_targets(targets)})
    pm = get_peft_model(model, LoraConfig(r=8, target_modules=names if targets != "all-linear" else "all-linear", task_type="CAUSAL_LM"))
    assert sum(p.numel() for p in pm.parameters() if p.requires_grad) == spec.lora_params(8, targets)


def test_weights_by_dtype_and_quantization(llama7b):
    N = llama7b.total_params
    assert M.weights_bytes(llama7b, M.Setup(method="full", precision="fp32"), N)[0] == 4 * N
    assert M.weights_bytes(llama7b, M.Setup(method="full", precision="bf16-true"), N)[0] == 2 * N
    assert M.weights_bytes(llama7b, M.Setup(method="full", precision="bf16"), N)[0] == 6 * N  # fp32 master + autocast copy
    lora = M.weights_bytes(llama7b, M.Setup(method="lora", precision="bf16"), 1000)[0]
    assert lora == 2 * N + 4 * 1000
    q = M.weights_bytes(llama7b, M.Setup(method="qlora", double_quant=True, framework="transformers"), 0)[0]
    q_nodq = M.weights_bytes(llama7b, M.Setup(method="qlora", double_quant=False, framework="transformers"), 0)[0]
    lin = llama7b.linear_params
    assert q < q_nodq
    assert abs(q - (2 * (N - lin) + lin * (0.5 + 1 / 64))) / q < 0.01
    assert abs(q_nodq - (2 * (N - lin) + lin * (0.5 + 4 / 64))) / q_nodq < 0.01
    # trainpipe's QLoRA keeps the unquantized rest in the 16-bit load dtype; with `method.quantization.upcast_rest: true` it
    # calls prepare_model_for_kbit_training: the rest is fp32 (tests/unit/plan/test_plan_trace.py, test_plan_qlora_rest.py)
    assert M.weights_bytes(llama7b, M.Setup(method="qlora", double_quant=True), 0)[0] == q
    q_tp = M.weights_bytes(llama7b, M.Setup(method="qlora", double_quant=True, qlora_upcast_rest=True), 0)[0]
    assert q_tp - q == 2 * (N - lin)


def test_gradients_only_for_trainable(llama7b):
    assert M.gradient_bytes(llama7b, M.Setup(method="full", precision="bf16"), 10) == 40
    assert M.gradient_bytes(llama7b, M.Setup(method="full", precision="bf16-true"), 10) == 20
    assert M.gradient_bytes(llama7b, M.Setup(method="lora"), 10) == 40


def test_optimizer_states(llama7b):
    t = 1_000_000
    assert M.optimizer_bytes(llama7b, M.Setup(method="full", optimizer="adamw", precision="bf16"), t) == 8 * t
    assert M.optimizer_bytes(llama7b, M.Setup(method="full", optimizer="adamw", precision="bf16", strategy="zero2"), t) == 12 * t  # + fp32 master
    assert M.optimizer_bytes(llama7b, M.Setup(method="full", optimizer="sgd", precision="bf16"), t) == 4 * t
    assert M.optimizer_bytes(llama7b, M.Setup(method="full", optimizer="adamw_8bit", precision="bf16"), t) < 2.1 * t
    assert M.optimizer_bytes(llama7b, M.Setup(method="full", optimizer="adafactor", precision="bf16"), llama7b.total_params) < 0.01 * 8 * llama7b.total_params


def test_activations_grow_with_tokens_and_shrink_with_checkpointing(llama7b):
    a1, _ = M.activation_bytes(llama7b, M.Setup(method="lora", micro_batch=1, seq_len=1024))
    a2, _ = M.activation_bytes(llama7b, M.Setup(method="lora", micro_batch=2, seq_len=1024))
    ck, _ = M.activation_bytes(llama7b, M.Setup(method="lora", micro_batch=2, seq_len=1024, grad_ckpt=True))
    assert a2 > 1.9 * a1 and ck < a2 / 4


def test_eager_attention_costs_s_squared_sdpa_does_not(llama7b):
    sdpa, _ = M.activation_bytes(llama7b, M.Setup(method="lora", seq_len=4096, attention="sdpa"))
    eager, _ = M.activation_bytes(llama7b, M.Setup(method="lora", seq_len=4096, attention="eager"))
    assert eager > 2 * sdpa


def test_frozen_weights_save_less_than_full(llama7b):
    full, _ = M.activation_bytes(llama7b, M.Setup(method="full", micro_batch=1, seq_len=1024))
    lora, _ = M.activation_bytes(llama7b, M.Setup(method="lora", micro_batch=1, seq_len=1024, lora_dropout=0.0))
    assert lora < full


def test_logits_are_fp32_sized_per_vocab():
    spec = find_model("meta-llama/Llama-3.1-8B")
    assert M.logits_bytes(spec, M.Setup(precision="bf16", framework="transformers"), 1000) == 1000 * 128256 * 14


def test_sharding(llama7b):
    base = M.Setup(method="full", precision="bf16", micro_batch=1, seq_len=512, num_gpus=8)
    z1 = M.estimate(llama7b, M.Setup(**{**base.__dict__, "strategy": "zero1"}))
    z2 = M.estimate(llama7b, M.Setup(**{**base.__dict__, "strategy": "zero2"}))
    z3 = M.estimate(llama7b, M.Setup(**{**base.__dict__, "strategy": "zero3"}))
    N = llama7b.total_params
    assert z1.optimizer_bytes == 12 * N // 8 and z1.gradients_bytes == 2 * N
    assert z2.gradients_bytes == 2 * N // 8
    assert z3.weights_bytes < 2 * N // 8 + 4 * llama7b.layer_params + 1
    off = M.estimate(llama7b, M.Setup(**{**base.__dict__, "strategy": "zero3", "offload": "optimizer"}))
    assert off.optimizer_bytes == 0 and off.cpu_bytes > 0


def test_ddp_adds_gradient_buckets(llama7b):
    one = M.estimate(llama7b, M.Setup(method="full", precision="bf16", num_gpus=1))
    ddp = M.estimate(llama7b, M.Setup(method="full", precision="bf16", strategy="ddp", num_gpus=2))
    assert ddp.gradients_bytes == 2 * one.gradients_bytes


def test_total_is_sum_of_pieces(llama7b):
    b = M.estimate(llama7b, M.Setup())
    assert b.total_bytes == b.weights_bytes + b.gradients_bytes + b.optimizer_bytes + b.activations_bytes + b.overhead_bytes


def test_accuracy_on_published_measurements():
    """Data-driven: >= 80 % of the well-specified published peaks within +/-15 % (the issue's target), over a set
    that is mostly LLM fine-tunes (full, LoRA, QLoRA; 1 to 8 GPUs; 1.1B to 70B), every row with its source."""
    from trainpipe.plan.accuracy import evaluate

    rows, share, n = evaluate()
    # the calibration sources; the published held-out sources (never calibrated on) are checked in test_accuracy.py
    counted = [r for r in rows if r["well_specified"] and not r["published_held_out"]]
    assert len(counted) >= 30 and sum(not r["id"].startswith("hf-") for r in counted) >= 25
    assert {r["method"] for r in counted} >= {"full", "lora", "qlora"} and max(r["gpus"] for r in counted) >= 8
    assert all(r["source"] and r["assumptions"] for r in rows)
    within = sum(abs(r["error"]) <= 0.15 for r in counted) / len(counted)
    assert within >= 0.8, [(r["id"], round(r["error"], 3)) for r in counted]


def test_bitsandbytes_4bit_matmul_keeps_inputs_a_frozen_16bit_linear_does_not(llama7b):
    # older bitsandbytes (the published rows' framework); the installed one keeps only the weight: test_accuracy.py
    lora = M.Setup(method="lora", precision="bf16-true", lora_targets="q,v", micro_batch=1, seq_len=1024, framework="transformers")
    qlora = M.Setup(**{**lora.__dict__, "method": "qlora"})
    t = 1024
    extra = M.layer_activation_bytes(llama7b, qlora, t) - M.layer_activation_bytes(llama7b, lora, t)
    h, i = llama7b.hidden, llama7b.arch["intermediate"]
    # q/k/v share the norm output, gate/up the second norm output, down reads its own input; o's input is the attention
    # kernel's output seen through a view, which the kernel keeps anyway (test_plan_mechanisms.py counts it on a real layer)
    assert extra == 2 * t * (h + h + i)


def test_loss_dtype_by_framework(llama7b):
    hf = M.logits_bytes(llama7b, M.Setup(precision="bf16-true", framework="transformers"), 1000)
    lit = M.logits_bytes(llama7b, M.Setup(precision="bf16-true", framework="litgpt"), 1000)
    tune = M.logits_bytes(llama7b, M.Setup(precision="bf16-true", framework="torchtune"), 1000)
    v = llama7b.vocab
    assert hf == 1000 * v * 14 and lit == 1000 * v * 8 and tune < lit


def test_trainpipe_chunked_loss_keeps_the_logits_and_one_fp32_chunk(llama7b):
    """trainpipe's loss (train/losses.py) upcasts one chunk at a time: the plan for a trainpipe run (the default framework)
    counts the 16-bit logits and one fp32 chunk, not transformers' 14 B per logit (issue 14 items 4 and 5)."""
    tokens = 4 * 4096
    ours = M.logits_bytes(llama7b, M.Setup(precision="bf16"), tokens)
    hf = M.logits_bytes(llama7b, M.Setup(precision="bf16", framework="transformers"), tokens)
    n = tokens * llama7b.vocab
    assert ours == 2 * n + 8 * M.LOSS_CHUNK_ELEMENTS + 4 * tokens and hf == 14 * n
    assert M.Setup().framework == "trainpipe" and hf / ours > 4
    from trainpipe.model.losses import CHUNK_ELEMENTS

    assert M.LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS  # the memory model follows the loss the loop runs


def test_fp32_loaded_lora_base_under_autocast(llama7b):
    auto = M.estimate(llama7b, M.Setup(method="lora", precision="bf16"))
    fp32 = M.estimate(llama7b, M.Setup(method="lora", precision="bf16", base_dtype="fp32"))
    assert fp32.weights_bytes - auto.weights_bytes == 2 * llama7b.total_params
    assert fp32.activations_bytes > auto.activations_bytes  # the saved 16-bit casts of the frozen weights


def test_local_folder_with_config_json(tiny_model_dir):
    spec = find_model(str(tiny_model_dir))
    import json

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert spec.source == "local" and spec.hidden == cfg["hidden_size"]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert spec.total_params == sum(p.numel() for p in m.parameters())


def test_plan_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, trainpipe.plan.command, trainpipe.plan.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
