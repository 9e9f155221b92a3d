"""Plan meets reality on CPU: predicted parameter, gradient and optimizer bytes equal the live objects' exactly."""

import warnings

import pytest

torch = pytest.importorskip("torch")

from trainpipe.plan.measure import measure_state_bytes, predict_state_bytes  # noqa: E402

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)


def _model(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **{k: v for k, v in CFG.items() if k != "model_type"})
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _step(model, opt_name="adamw"):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3) if opt_name == "adamw" else torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    x = torch.randint(0, 256, (2, 16))
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return opt


def assert_same_bytes(measured, predicted):
    for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
        assert measured[k] == predicted[k], (k, measured[k], predicted[k])


@pytest.mark.parametrize("dtype,opt", [("float32", "adamw"), ("bfloat16", "adamw"), ("float32", "sgd")])
def test_full_fine_tune(dtype, opt):
    m = _model(getattr(torch, dtype))
    o = _step(m, opt)
    assert_same_bytes(measure_state_bytes(m, o), predict_state_bytes(CFG, method="full", dtype=dtype, optimizer=opt))


@pytest.mark.parametrize("dtype,targets,method", [("float32", "attention", "lora"), ("bfloat16", "all-linear", "lora"), ("bfloat16", "attention", "dora")])
def test_lora(dtype, targets, method):
    from peft import LoraConfig, get_peft_model

    from trainpipe.model.loading import resolve_lora_targets

    m = _model(getattr(torch, dtype))
    pm = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=resolve_lora_targets(m, targets), task_type="CAUSAL_LM", use_dora=method == "dora"))
    o = _step(pm)
    assert_same_bytes(measure_state_bytes(pm, o), predict_state_bytes(CFG, method=method, dtype=dtype, lora_r=8, lora_alpha=16, lora_targets=targets))


def test_trainpipe_apply_lora_matches():
    from trainpipe.config import LoraConfig
    from trainpipe.model.loading import apply_lora

    m = apply_lora(_model(torch.float32), LoraConfig(r=4, alpha=8))
    o = _step(m)
    assert_same_bytes(measure_state_bytes(m, o), predict_state_bytes(CFG, method="lora", dtype="float32", lora_r=4, lora_alpha=8))


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_bitsandbytes(tmp_path, double_quant):
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"bitsandbytes not importable ({type(exc).__name__}): pip install 'trainpipe[qlora]'")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trainpipe.model.loading import resolve_lora_targets

    _model(torch.float32).save_pretrained(tmp_path)
    warnings.filterwarnings("ignore")
    q = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16))
    pm = get_peft_model(q, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=resolve_lora_targets(q, "attention"), task_type="CAUSAL_LM"))
    pm.train()  # in eval mode bitsandbytes repacks 4-bit weights into a CPU inference layout at the first forward
    o = _step(pm)
    measured = measure_state_bytes(pm, o)
    assert measured["quant_state_bytes"] > 0
    assert_same_bytes(measured, predict_state_bytes(CFG, method="qlora", dtype="bfloat16", lora_r=8, lora_alpha=16, double_quant=double_quant))


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_after_an_eval_forward_on_cpu(tmp_path, double_quant):
    """bitsandbytes repacks 4-bit weights for its CPU kernel at the first eval-mode forward (trainpipe's baseline
    eval does one): the prediction with `cpu_repacked` matches that layout to the byte."""
    from bitsandbytes.functional import has_avx512bf16
    from peft import LoraConfig, get_peft_model

    if not has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights for its CPU kernel only on CPUs with AVX512-BF16; this CPU has none")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trainpipe.model.loading import resolve_lora_targets

    _model(torch.float32).save_pretrained(tmp_path)
    warnings.filterwarnings("ignore")
    q = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32))
    pm = get_peft_model(q, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=resolve_lora_targets(q, "attention"), task_type="CAUSAL_LM"))
    before = measure_state_bytes(pm)["parameters_bytes"]
    pm.eval()
    with torch.no_grad():
        pm(input_ids=torch.tensor([[1, 2, 3]]))
    pm.train()
    o = _step(pm)
    measured = measure_state_bytes(pm, o)
    assert measured["parameters_bytes"] < before  # the repack really happened
    assert_same_bytes(measured, predict_state_bytes(CFG, method="qlora", dtype="float32", lora_r=8, lora_alpha=16, lora_dropout=0.0,
                                                    double_quant=double_quant, cpu_repacked=True))
