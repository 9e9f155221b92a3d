"""PEFT and precision pieces that need no training run: virtual-token loss alignment, per-architecture
target resolution on meta-device skeletons, the bf16/fp16 fallback rule, optimizer and compile set-up."""

import pytest

from trainpipe.config import MethodConfig, ModelConfig, RunConfig
from trainpipe.errors import ConfigError, ModelLoadError
from trainpipe.plan import resolve
from trainpipe.plan.hardware import CPU, Hardware


def _examples(tok, n=6):
    from tiny import alpaca_records

    out = []
    for r in alpaca_records(n, seed=3):
        prompt = tok(f"{r['instruction']} {r['input']} =", add_special_tokens=False)["input_ids"]
        reply = tok(f" {r['output']}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": prompt + reply, "labels": [-100] * len(prompt) + reply})
    return out


@pytest.mark.parametrize("peft", ["prompt_tuning", "prefix_tuning", "lora"])
def test_loss_aligns_with_peft_own_loss_despite_virtual_tokens(peft, tiny_model_dir, tiny_tokenizer):
    """Prompt tuning returns logits for its virtual tokens too; trainpipe's eval loss and training loss must still
    score token t+1 from position t of the real input -- exactly PEFT's own loss (which pads the labels)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainpipe.evaluate.evaluator import eval_loss
    from trainpipe.train.objectives import TokenCrossEntropy
    from trainpipe.model.loading import apply_peft

    torch.manual_seed(0)
    method = MethodConfig(peft=peft, prompt_tuning={"num_virtual_tokens": 5})
    model = apply_peft(AutoModelForCausalLM.from_pretrained(tiny_model_dir), method, tokenizer=tiny_tokenizer)
    model.eval()
    examples = _examples(tiny_tokenizer)
    pad = tiny_tokenizer.pad_token_id
    ours = eval_loss(model, examples, batch_size=3, pad_id=pad)
    obj = TokenCrossEntropy(pad)
    with torch.no_grad():
        train_loss = sum(float(obj.loss_sum(model, obj.collate(examples[i : i + 3]))[0]) for i in (0, 3)) / obj.weight(examples)
        # PEFT's own loss, one example at a time (no padding), token-weighted
        total = 0.0
        for ex in examples:
            ids, labels = torch.tensor([ex["input_ids"]]), torch.tensor([ex["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss) * n
    reference = total / obj.weight(examples)
    assert ours["loss"] == pytest.approx(reference, abs=1e-5)
    assert train_loss == pytest.approx(reference, abs=1e-5)


def _skeleton(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_ia3_auto_targets_per_architecture():
    from transformers import GPT2Config, LlamaConfig

    from trainpipe.config import IA3Config
    from trainpipe.model.loading import resolve_ia3_targets

    llama = _skeleton(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100))
    assert resolve_ia3_targets(llama, IA3Config()) == (["self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"], ["mlp.down_proj"])
    gpt2 = _skeleton(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100))
    assert resolve_ia3_targets(gpt2, IA3Config()) == (["attn.c_attn", "mlp.c_proj"], ["mlp.c_proj"])


def test_freeze_plan_and_tied_head(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainpipe.model.loading import apply_peft

    model = apply_peft(AutoModelForCausalLM.from_pretrained(tiny_model_dir), MethodConfig(peft="freeze", freeze={"trainable_layers": 1}))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trainable)
    # the tiny model ties the head to the embeddings: both train only with train_embeddings
    model = apply_peft(AutoModelForCausalLM.from_pretrained(tiny_model_dir), MethodConfig(peft="freeze", freeze={"trainable_layers": 1, "train_embeddings": True}))
    assert model.get_input_embeddings().weight.requires_grad and model.get_output_embeddings().weight.requires_grad
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.layers.0."))


def test_qlora_from_scratch_is_refused_before_anything_loads(tiny_model_dir):
    from trainpipe.model.loading import check_peft

    with pytest.raises(ModelLoadError, match="nothing worth quantizing"):
        check_peft(ModelConfig(name_or_path=str(tiny_model_dir), init_from_config=str(tiny_model_dir)), MethodConfig(peft="qlora"))


# ------------------------------------------------------------------------------ precision


def _cfg(**training) -> RunConfig:
    return RunConfig.model_validate({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "training": training})


T4 = Hardware("cuda", 1, ("Tesla T4",), False, 8, "")
A100 = Hardware("cuda", 1, ("NVIDIA A100",), True, 8, "")


@pytest.mark.parametrize("asked", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_falls_back_to_fp32_with_one_warning(asked, capsys):
    plan = resolve(_cfg(**{asked: True}), CPU)
    assert getattr(plan.config.training, asked) is False
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("warning:") == 1 and f"`training.{asked}: true`" in out and "fp32" in out
    assert any(d.key == f"training.{asked}" and d.value is False for d in plan.decisions)


def test_bf16_on_a_gpu_without_it_suggests_fp16(capsys):
    plan = resolve(_cfg(bf16=True), T4)
    assert plan.config.training.bf16 is False
    assert "`training.fp16: true`" in " ".join(capsys.readouterr().out.split())
    assert resolve(_cfg(fp16=True), T4).config.training.fp16 is True  # fp16 is fine there
    assert resolve(_cfg(bf16=True), A100).config.training.bf16 is True


def test_precision_fallback_error_stops(capsys):
    with pytest.raises(ConfigError) as err:
        resolve(_cfg(bf16=True, precision_fallback="error"), CPU)
    assert "`training.bf16: true`" in err.value.message and "precision_fallback" in err.value.message
    assert resolve(_cfg(), CPU).config.training.bf16 is False and "warning" not in capsys.readouterr().out  # unset: silent


# ------------------------------------------------------------------------------ optimizer, compile


def _loop(tmp_path, model, **training):
    from trainpipe.config import build_config
    from trainpipe.events import EventLog
    from types import SimpleNamespace

    from trainpipe.plan import resolve
    from trainpipe.train.sft import build_loop

    t = dict(learning_rate=1e-3, gradient_accumulation_steps=1, per_device_train_batch_size=4, save_steps=50, max_steps=2, **training)
    specs = resolve(build_config({"model": {"name_or_path": "tiny"}, "data": {"sources": [{"path": "t.jsonl"}]}, "training": t}), CPU, sizing=False).specs
    return build_loop(model, SimpleNamespace(pad_token_id=0), [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], specs, run_dir=tmp_path,
                      events=EventLog(tmp_path / "events.jsonl"), config_yaml="", evaluate=lambda m: 0.0)


@pytest.mark.parametrize("optim,cls", [("adamw_8bit", "AdamW8bit"), ("paged_adamw_8bit", "AdamW8bit"), ("adafactor", "Adafactor"), ("sgd", "SGD"), ("adamw_torch", "AdamW")])
def test_optimizer_choice(optim, cls, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    loop = _loop(tmp_path, AutoModelForCausalLM.from_pretrained(tiny_model_dir), optim=optim)
    assert type(loop.optimizer).__name__ == cls  # on the CPU paged falls back to the unpaged 8-bit AdamW


def test_torch_compile_compiles_the_model_in_place(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = [n for n, _ in model.named_parameters()]
    loop = _loop(tmp_path, model, torch_compile=True)
    assert loop.model is model and model._compiled_call_impl is not None  # compiled lazily on the first forward
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    assert _loop(tmp_path / "b", AutoModelForCausalLM.from_pretrained(tiny_model_dir)).model._compiled_call_impl is None


def _greedy_by_forward(model, tok, prompt: str, n: int) -> list[int]:
    """Greedy decoding with the full forward and no cache: slow, but exactly what the trained model computes. Stops
    before a near-tie (top-2 logits within 1e-3), where cached and uncached float32 arithmetic may pick differently."""
    import torch

    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
            top = logits.topk(2).values
            if float(top[0] - top[1]) < 1e-3:
                break
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out


@pytest.mark.parametrize("peft", ["prompt_tuning", "prefix_tuning"])
def test_generate_uses_the_virtual_tokens(peft, tiny_model_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from trainpipe.evaluate.evaluator import generate
    from trainpipe.model.loading import apply_peft

    def attentive():  # the untrained tiny model barely reads its context; louder attention makes the virtual tokens count
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.o_proj.weight.mul_(30)
        return m

    torch.manual_seed(0)
    base = attentive()
    model = apply_peft(attentive(), MethodConfig(peft=peft, prompt_tuning={"num_virtual_tokens": 5}))
    with torch.no_grad():
        model.prompt_encoder.default.embedding.weight.normal_(0, 2.0)
    tok = tiny_tokenizer
    prompts = ["Reverse the order of the words. apple river stone", "Say blue then", "You repeat words. Say tiger then lamp."]
    got = generate(model, tok, prompts, max_new_tokens=6, batch_size=3, stop_ids=[-1])  # batched as evaluate_lm asks
    want = [_greedy_by_forward(model, tok, p, 6) for p in prompts]
    plain = [_greedy_by_forward(base, tok, p, 6) for p in prompts]
    assert [w[:2] for w in want] != [w[:2] for w in plain]  # the virtual tokens change these replies, so the check below can tell
    for g, w in zip(got, want):
        assert len(w) >= 2 and g.startswith(tok.decode(w, skip_special_tokens=True)), (g, tok.decode(w))


@pytest.mark.parametrize("peft,dtype", [("none", "float32"), ("freeze", "float32"), ("lora", "bfloat16"), ("qlora", "bfloat16")])
def test_base_dtype_keeps_fp32_master_weights_where_whole_blocks_train(peft, dtype):
    cfg = RunConfig.model_validate({"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}, "method": {"peft": peft}})
    assert resolve(cfg, A100).config.model.dtype == dtype
