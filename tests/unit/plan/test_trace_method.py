"""The memory tracer (`plan/trace.py`) applies a method through trainpipe's own code (`train/model.py`), so it cannot
drift from what `trainpipe train` trains:

- the traced model (built on meta, emulated 4-bit layers for QLoRA) has the same parameters as a real tiny model loaded
  and wrapped by `train/model.py`'s `build_model`: every name, shape, dtype and requires_grad (trainable and frozen), for
  lora, dora, qlora, full and freeze, with a tied and an untied LM head; for QLoRA the emulated 4-bit layers sit exactly
  where bitsandbytes quantized, with bitsandbytes' compute dtype, and PEFT wraps them in its bitsandbytes LoRA layer;
- gradient checkpointing is switched on the way the training loop switches it on (the same function);
- a change to train/model.py's LoRA config or freezing reaches the traced model (the trace has no copy of either).

Real parts: real tiny Llamas saved as safetensors, loaded by transformers (4-bit by bitsandbytes on the CPU), wrapped by PEFT.
"""

import json

import pytest
import torch

from trainpipe.config import FreezeConfig, LoraConfig, MethodConfig, ModelConfig, QuantizationConfig
from trainpipe.plan import memory as M
from trainpipe.plan import trace as T
from trainpipe.plan.catalog import find_model
from trainpipe.model import loading as TM

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_dir(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=request.param == "tied")
    d = tmp_path_factory.mktemp(f"llama-{request.param}")
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return str(d)


# (trainpipe `method:`, the planner's Setup of that run). alpha = 2 r is the planner's convention.
CASES = {
    "lora": (dict(peft="lora", lora=LoraConfig(r=4, alpha=8, dropout=0.1)), dict(method="lora", precision="bf16-true", lora_r=4, lora_dropout=0.1)),
    "lora-all-linear": (dict(peft="lora", lora=LoraConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear")),
                        dict(method="lora", precision="bf16-true", lora_r=8, lora_dropout=0.0, lora_targets="all-linear")),
    "dora": (dict(peft="dora", lora=LoraConfig(r=4, alpha=8, dropout=0.05)), dict(method="dora", precision="bf16-true", lora_r=4, lora_dropout=0.05)),
    "qlora": (dict(peft="qlora", lora=LoraConfig(r=4, alpha=8, dropout=0.05), quantization=QuantizationConfig(compute_dtype="bfloat16")),
              dict(method="qlora", precision="bf16", lora_r=4, lora_dropout=0.05)),
    "full": (dict(peft="none"), dict(method="full", precision="bf16-true")),
    "freeze": (dict(peft="freeze", freeze=FreezeConfig(trainable_layers=2)), dict(method="freeze", precision="bf16-true", freeze_layers=2)),
}


def _real(model_dir, method_kw):
    return TM.build_model(ModelConfig(name_or_path=model_dir, dtype="bfloat16"), MethodConfig(**method_kw))


def _traced(model_dir, setup_kw, **extra):
    s = M.Setup(**(dict(micro_batch=1, seq_len=16, framework="trainpipe") | setup_kw | extra))
    model, _, _ = T._build(find_model(model_dir), s, [])
    return model


def _params(model):
    """name -> (shape, dtype, requires_grad) of every parameter, bitsandbytes' packed 4-bit weights left out."""
    return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters() if type(p).__name__ != "Params4bit"}


@pytest.mark.parametrize("case", list(CASES))
def test_traced_model_has_the_parameters_trainpipe_trains(model_dir, case):
    method_kw, setup_kw = CASES[case]
    real, traced = _real(model_dir, method_kw), _traced(model_dir, setup_kw)
    rp, tp = _params(real), _params(traced)
    trainable = {n for n, v in rp.items() if v[2]}
    assert trainable, "the real model trains something"
    assert {n for n, v in tp.items() if v[2]} == trainable
    assert tp == rp  # frozen ones too: dtype casts (QLoRA's fp32 rest), shapes, the tied head
    assert type(traced).__name__ == type(real).__name__
    if case == "freeze":  # trainpipe's freeze: last blocks, final norm, and the LM head unless it is the tied embedding
        tied = "tied" in model_dir.rsplit("/", 1)[-1] and "untied" not in model_dir.rsplit("/", 1)[-1]
        assert any(n.startswith("model.norm") for n in trainable)
        assert ("lm_head.weight" in trainable) is (not tied)
        assert not any(".layers.0." in n for n in trainable)
    if case in ("lora", "dora", "qlora"):
        assert all("lora_" in n for n in trainable) and len(trainable) == 3 * 4 * (3 if case == "dora" else 2)


def test_qlora_emulated_layers_sit_where_bitsandbytes_quantizes(model_dir):
    import bitsandbytes as bnb
    from peft.tuners.lora import bnb as lora_bnb

    method_kw, setup_kw = CASES["qlora"]
    real, traced = _real(model_dir, method_kw), _traced(model_dir, setup_kw)
    E4 = T._emulated_4bit_classes()
    real4 = {n: m for n, m in real.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    fake4 = {n: m for n, m in traced.named_modules() if isinstance(m, E4)}
    assert real4 and set(fake4) == set(real4)  # every linear of the blocks, not the LM head
    for n, m in real4.items():
        e = fake4[n]
        assert (e.in_features, e.out_features, e.compute_dtype) == (m.in_features, m.out_features, m.compute_dtype)
        assert (e.weight.quant_type, e.weight.compress_statistics) == (m.weight.quant_type, m.weight.compress_statistics)
    wrapped = lambda model: {n for n, m in model.named_modules() if isinstance(m, lora_bnb.Linear4bit)}  # noqa: E731
    assert wrapped(traced) == wrapped(real) and wrapped(real)  # PEFT's bitsandbytes LoRA layer on both
    assert traced.is_loaded_in_4bit and real.is_loaded_in_4bit


def _checkpointing(model):
    """module name -> the keywords its checkpoint function is called with, for every module that checkpoints."""
    out = {}
    for n, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False):
            f = m._gradient_checkpointing_func
            out[n] = dict(getattr(f, "keywords", {}))
    return out


def test_gradient_checkpointing_is_the_loops(model_dir):
    """The loop turns checkpointing on with train/model.py's `enable_gradient_checkpointing`; the trace calls the same."""
    method_kw, setup_kw = CASES["lora"]
    real = _real(model_dir, method_kw)
    TM.enable_gradient_checkpointing(real)
    traced = _traced(model_dir, setup_kw, grad_ckpt=True)
    assert _checkpointing(traced) == _checkpointing(real) and _checkpointing(real)
    assert all(kw.get("use_reentrant") is False for kw in _checkpointing(real).values())
    assert traced.config.use_cache is False
    assert not _checkpointing(_traced(model_dir, setup_kw))


def test_a_change_in_train_model_reaches_the_trace(model_dir, monkeypatch):
    """The trace has no copy of the LoRA config or the freezing: changing train/model.py's changes the traced model
    (and its traced memory)."""
    _, setup_kw = CASES["lora"]
    before = {n for n, p in _traced(model_dir, setup_kw).named_parameters() if p.requires_grad}
    orig = TM.lora_config

    def only_q(model, lora, **kw):
        cfg = orig(model, lora, **kw)
        cfg.target_modules = {"q_proj"}
        return cfg

    monkeypatch.setattr(TM, "lora_config", only_q)
    after = {n for n, p in _traced(model_dir, setup_kw).named_parameters() if p.requires_grad}
    assert after and after < before and all("q_proj" in n for n in after)

    _, fz = CASES["freeze"]
    monkeypatch.setattr(TM, "freeze_plan", lambda model, n: ["model.layers.2"])
    frozen_more = {n for n, p in _traced(model_dir, fz).named_parameters() if p.requires_grad}
    assert frozen_more and not any(n.startswith(("model.norm", "model.layers.1.")) for n in frozen_more)


def test_trace_reports_a_method_it_does_not_run(model_dir):
    with pytest.raises(T.TraceError, match="ia3"):
        _traced(model_dir, dict(method="ia3", precision="bf16-true"))


def test_traced_optimizer_state_is_that_of_the_parameters_trainpipe_trains(model_dir):
    """The traced step's AdamW state is exactly that of the real model's trainable parameters (bf16-true: two 2-byte
    moments per element and a 4-byte step per tensor): for freeze that includes the final norm and, untied, the LM head,
    which an earlier trace (its own copy: the last blocks only) left out."""
    for case in ("freeze", "lora", "full"):
        method_kw, setup_kw = CASES[case]
        real = _real(model_dir, method_kw)
        trained = [p for p in real.parameters() if p.requires_grad]
        s = M.Setup(**(dict(micro_batch=1, seq_len=16, framework="trainpipe") | setup_kw))
        r = T.trace_step(model_dir, s, steps=2, record_events=False)
        per = 2 * (4 if case == "lora" else 2)  # LoRA adapters are fp32 (PEFT's autocast_adapter_dtype)
        assert r.split["optimizer"] == sum(per * p.numel() + 4 for p in trained), case
