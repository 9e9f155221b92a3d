"""QLoRA's non-quantized rest (embeddings, norms, lm_head) stays in the load dtype by default, as TRL's SFTTrainer
prepares a quantized model; `method.quantization.upcast_rest: true` is PEFT's `prepare_model_for_kbit_training` (fp32).

Real bitsandbytes 4-bit layers on the CPU, a tiny untied Llama loaded in bfloat16 (`model.dtype`), so the difference
is visible: with the default the residual stream (each layer's hidden states) is bf16 too, with upcast_rest fp32.
"""

import pytest
import torch

from tiny import build_tokenizer
from trainpipe.config import MethodConfig, ModelConfig, QuantizationConfig, build_config
from trainpipe.model.loading import build_model

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("untied-llama")
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def _build(d, **quant):
    return build_model(ModelConfig(name_or_path=str(d), dtype="bfloat16"), MethodConfig(peft="qlora", quantization=QuantizationConfig(**quant)))


def _rest(model) -> dict[str, torch.dtype]:
    """The base's parameters that are neither 4-bit nor adapters: embeddings, norms, lm_head."""
    return {n: p.dtype for n, p in model.named_parameters() if "lora_" not in n and type(p).__name__ != "Params4bit"}


@pytest.mark.parametrize("upcast, want", [(None, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32)],
                         ids=["default", "upcast_rest-false", "upcast_rest-true"])
def test_rest_dtype_frozen_base_and_residual_stream(untied_dir, upcast, want):
    model = _build(untied_dir, **({} if upcast is None else {"upcast_rest": upcast}))
    rest = _rest(model)
    names = " ".join(rest)
    assert "embed_tokens" in names and "lm_head" in names and "norm" in names and len(rest) == 7  # embed, 2 x 2 norms, final norm, lm_head
    assert set(rest.values()) == {want}, rest
    # the base is frozen either way; only the LoRA adapters train, in fp32 (PEFT's autocast_adapter_dtype)
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and set(trainable.values()) == {torch.float32}
    assert sum(type(p).__name__ == "Params4bit" for p in model.parameters()) == 14  # 7 linears x 2 layers stay 4-bit
    # the residual stream follows the rest's dtype (Linear4bit returns its input's dtype): what the memory is about
    ids = torch.randint(3, 60, (2, 16))
    out = model(input_ids=ids, output_hidden_states=True)
    assert {h.dtype for h in out.hidden_states} == {want}
    out.logits.float().logsumexp(-1).mean().backward()
    # gradients reach every adapter (lora_B starts at zero, so lora_A's first gradient is zero: B's are checked)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_upcast_rest_is_a_config_key_with_the_default_false():
    base = {"model": {"name_or_path": "x"}, "data": {"sources": [{"path": "d.jsonl"}]}, "method": {"peft": "qlora"}}
    assert build_config(base).method.quantization.upcast_rest is False
    on = build_config(base | {"method": {"peft": "qlora", "quantization": {"upcast_rest": True}}})
    assert on.method.quantization.upcast_rest is True
