"""Mechanisms behind the published held-out rows (issue 14 item 5), each checked against the installed libraries on
the CPU where it can be, and against the memory model (each fails on the model before it knew the mechanism).

- a custom loop's loss (`nn.CrossEntropyLoss` on the 16-bit logits a model returns when called without labels) keeps its
  log-softmax output in 16 bits: 2 B per token and vocabulary entry saved, where transformers' own loss (labels passed)
  upcasts to fp32 and saves 4 B; the planner's `hf-bf16-loss` framework counts 3 x 2 B at the backward's peak, not 14 B;
- QLoRA on a model loaded without torch_dtype (float32): bitsandbytes' Linear4bit casts its output back to its input's
  dtype, so the residual stream, every saved activation and the logits stay fp32 and the unquantized embeddings,
  norms and lm_head are fp32 (4 B): the planner's `base_dtype="fp32"` for QLoRA.
"""

import torch

from trainpipe.plan import memory as M
from trainpipe.plan.catalog import find_model


def _saved_bytes(fn) -> dict:
    """Bytes autograd saves for backward while `fn` runs, by dtype (a real count, saved_tensors_hooks)."""
    by_dtype: dict = {}
    seen: set = set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and t.numel() > 1:
            seen.add(key)
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return by_dtype, out


def test_bf16_cross_entropy_on_returned_logits_saves_16_bit_log_softmax():
    torch.manual_seed(0)
    tokens, vocab = 64, 512
    logits = torch.randn(1, tokens + 1, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens + 1))

    def custom():  # the custom-loop pattern: criterion(output.logits[:, :-1, :].reshape(-1, V), label[:, 1:].reshape(-1))
        return torch.nn.CrossEntropyLoss()(logits[:, :-1, :].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    def hf():  # transformers' ForCausalLMLoss: logits.float() then cross_entropy
        from transformers.loss.loss_utils import ForCausalLMLoss
        return ForCausalLMLoss(logits, labels, vocab_size=vocab)

    saved_custom, loss_c = _saved_bytes(custom)
    saved_hf, loss_h = _saved_bytes(hf)
    n = tokens * vocab
    assert saved_custom.get(torch.float32, 0) == 0 and saved_custom[torch.bfloat16] == 2 * n  # the bf16 log-softmax output
    assert saved_hf.get(torch.float32, 0) >= 4 * n  # transformers' loss keeps an fp32 log-softmax
    loss_c.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16

    spec = find_model("meta-llama/Llama-3.1-8B")
    t = 2 * 8192
    ours = M.logits_bytes(spec, M.Setup(precision="bf16-true", micro_batch=2, seq_len=8192, framework="hf-bf16-loss"), t)
    upcast = M.logits_bytes(spec, M.Setup(precision="bf16-true", micro_batch=2, seq_len=8192, framework="transformers"), t)
    assert ours == 3 * 2 * t * spec.vocab and upcast == 14 * t * spec.vocab


def test_qlora_on_an_fp32_loaded_model_keeps_fp32_activations():
    import bitsandbytes as bnb

    lin = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.load_state_dict({"weight": torch.randn(32, 64)})
    lin = lin.to("cpu")
    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.float32  # the output is cast back to the input's dtype: the residual stream stays fp32
    y.sum().backward()
    assert x.grad is not None

    spec = find_model("meta-llama/Llama-3.1-8B")
    t = 2 * 8192
    common = dict(method="qlora", precision="bf16-true", micro_batch=2, seq_len=8192, grad_ckpt=True, lora_r=8, lora_targets="q,k,v",
                  framework="hf-bf16-loss", bnb_saves_input=False)
    b16 = M.Setup(**common)
    b32 = M.Setup(**common, base_dtype="fp32")
    assert M.layer_activation_bytes(spec, b32, t) > 1.4 * M.layer_activation_bytes(spec, b16, t)  # fp32 everywhere but the fixed fp32 norm upcasts
    assert M.logits_bytes(spec, b32, t) == 2 * M.logits_bytes(spec, b16, t)
    w16, d16 = M.weights_bytes(spec, b16, M.trainable_params(spec, b16))
    w32, d32 = M.weights_bytes(spec, b32, M.trainable_params(spec, b32))
    assert d32["unquantized"] == 2 * d16["unquantized"] and d32["nf4"] == d16["nf4"]
    assert M.estimate(spec, b32).total_bytes > M.estimate(spec, b16).total_bytes * 1.3


def _saved_per_layer(method: str, batch: int, seq: int) -> tuple[list[int], dict]:
    """Bytes autograd saves inside each decoder layer of a real tiny Llama (transformers, bf16 weights, SDPA; PEFT LoRA
    on q/v for method="lora"), parameters excluded: what the activation model predicts per layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                      vocab_size=512, max_position_embeddings=1024, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        # dropout 0: on the CPU dropout keeps a mask in the input's dtype (CUDA's fused kernel keeps a bool mask)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
        model.enable_input_require_grads()
    model.train()
    layers = [m for n, m in model.named_modules() if n.endswith(("layers.0", "layers.1"))]
    current: list = [None]
    per = [0] * len(layers)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in seen:  # saved tensors stay alive through the forward: pointers are unique
            seen.add(ptr)
            per[current[0]] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=torch.randint(0, 512, (batch, seq)))
    out.logits.float().sum().backward()  # the graph is real: it runs backward
    d = cfg.to_dict() | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    return per, d


def test_activation_model_matches_saved_tensors_of_a_real_llama_layer():
    """The per-layer activation model against a real count (not a fake): the bytes autograd saves in each decoder layer of a
    tiny transformers Llama, full fine-tune and LoRA. The attention output projection reads the SDPA kernel's saved output
    through a view (transpose+reshape of a (batch, seq, heads, dim) layout), so o_proj's input is not a second tensor: the
    model used to count it twice (+4 % per full-fine-tune layer here, one hidden-size tensor per layer)."""
    from trainpipe.plan.catalog import spec_from_config_dict

    batch, seq = 2, 96  # tokens (192) != hidden (256): no shape coincidences
    for method, targets in (("full", "attention"), ("lora", "q,v")):
        per, cfg = _saved_per_layer(method, batch, seq)
        spec = spec_from_config_dict("tiny-llama", cfg, "test")
        s = M.Setup(method=method, precision="bf16-true", micro_batch=batch, seq_len=seq, lora_r=8, lora_targets=targets, lora_dropout=0.0,
                    attention="sdpa", framework="transformers")
        predicted = M.layer_activation_bytes(spec, s, batch * seq)
        for measured in per:
            assert abs(predicted / measured - 1) < 0.02, (method, predicted, measured)


# --- litgpt's QLoRA rows (config_hub/finetune/README.md): what the Lightning/bitsandbytes 0.42 stack keeps ---------------

class _MatMul4BitV042(torch.autograd.Function):
    """bitsandbytes 0.42.0 `MatMul4Bit` (bitsandbytes/autograd/_functions.py; litgpt warns on any other release: "LitGPT only
    supports bitsandbytes v0.42.0"), line for line, running the installed bitsandbytes' real NF4 (de)quantization on the CPU.
    The input is kept as a plain ctx attribute (`ctx.tensors = (A, B)`), not through `save_for_backward`."""

    @staticmethod
    def forward(ctx, A, B, out=None, bias=None, quant_state=None):
        import bitsandbytes.functional as F

        output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        import bitsandbytes.functional as F

        A, B = ctx.tensors
        grad_A = torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t()) if ctx.needs_input_grad[0] else None
        return grad_A, None, None, None, None


class _Linear4bitV042(torch.nn.Module):
    """Lightning's `_Linear4bit` as litgpt builds it: the weight quantized from `weight.half()` (QuantState.dtype fp16), the
    matmul through 0.42's MatMul4Bit (`bnb.matmul_4bit(x, self.weight.t(), quant_state=...)`); `saves_input=False` runs the
    installed bitsandbytes' own `matmul_4bit` instead (>= 0.43.2: ctx.tensors = (None, B))."""

    def __init__(self, fan_in: int, fan_out: int, saves_input: bool):
        import bitsandbytes.functional as F

        super().__init__()
        w = torch.randn(fan_out, fan_in) / fan_in ** 0.5
        self.q, self.state = F.quantize_4bit(w.half(), quant_type="nf4")
        self.saves_input = saves_input

    def forward(self, x):
        import bitsandbytes as bnb

        if self.saves_input:
            return _MatMul4BitV042.apply(x, self.q.t(), None, None, self.state)
        return bnb.matmul_4bit(x, self.q.t(), quant_state=self.state)


class _TinyLitGPTQLoRA(torch.nn.Module):
    """A two-layer litgpt-shaped decoder on 4-bit linears: norm -> fused qkv (+ a LoRA adapter, the only trainable weights) ->
    attention -> proj; norm -> fc_1, fc_2 (one input) -> silu(fc_1) * fc_2 -> proj; final norm -> lm_head in chunks of 128
    tokens (litgpt's `lm_head_chunk_size=128`), every linear, the lm_head included, 4-bit."""

    def __init__(self, h: int, i: int, vocab: int, saves_input: bool):
        super().__init__()
        torch.manual_seed(0)
        L = lambda a, b: _Linear4bitV042(a, b, saves_input)  # noqa: E731
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            m = torch.nn.Module()
            m.qkv, m.proj, m.fc_1, m.fc_2, m.mproj = L(h, 3 * h), L(h, h), L(h, i), L(h, i), L(i, h)
            m.lora_A = torch.nn.Parameter(torch.randn(4, h, dtype=torch.bfloat16) * 0.01)
            m.lora_B = torch.nn.Parameter(torch.zeros(3 * h, 4, dtype=torch.bfloat16))
            self.layers.append(m)
        self.head = L(h, vocab)
        self.h = h

    def forward(self, x):
        norm = lambda t: t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(t.dtype)  # noqa: E731
        for m in self.layers:
            n = norm(x)
            qkv = m.qkv(n) + (n @ m.lora_A.t()) @ m.lora_B.t()
            q, k, v = qkv.split(self.h, dim=-1)
            att = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
            x = x + m.proj(att)
            n2 = norm(x)
            x = x + m.mproj(torch.nn.functional.silu(m.fc_1(n2)) * m.fc_2(n2))
        return [self.head(c) for c in norm(x).split(128, dim=1)]


def _matmul4bit_inputs_alive(saves_input: bool, batch: int, seq: int, h: int, i: int, vocab: int) -> tuple[int, int, int]:
    """litgpt's loop (litgpt/finetune/lora.py `fit`): `logits = model(input_ids, lm_head_chunk_size=128)`, the chunked loss,
    backward, next iteration. Every 4-bit matmul's input is watched (weakref); returns (bytes of the first micro-batch's
    inputs, how many of those bytes are still alive at the end of the second forward, alive after that forward's assignment)."""
    import weakref

    model = _TinyLitGPTQLoRA(h, i, vocab, saves_input)
    watched: list = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args: watched.append((weakref.ref(args[0]), args[0].untyped_storage().nbytes(), args[0].untyped_storage().data_ptr())))
             for mod in model.modules() if isinstance(mod, _Linear4bitV042)]
    logits = loss = None
    first = []
    for it in range(2):
        x = torch.randn(batch, seq, h, dtype=torch.bfloat16)
        if it == 1:
            first = list(watched)
            watched.clear()
            out = model(x)  # the previous `logits` and `loss` are still referenced while this runs
            storages = {p: n for ref, n, p in first if ref() is not None}
            alive_at_forward_end = sum(storages.values())
            logits = out
            del out
            alive_after = sum({p: n for ref, n, p in first if ref() is not None}.values())
        else:
            logits = model(x)
        loss = sum(c.float().pow(2).mean() for c in logits)
        loss.backward()
        loss = loss.item()  # litgpt's log block (log_interval 1): `loss = running_loss.compute().item()`; `logits` stays
    for hk in hooks:
        hk.remove()
    total = sum({p: n for _, n, p in first}.values())
    return total, alive_at_forward_end, alive_after


def test_bnb_042_matmul4bit_inputs_outlive_backward_in_litgpts_loop():
    """bitsandbytes <= 0.43.1 kept MatMul4Bit's input as a ctx attribute, which backward does not release, and litgpt's loop
    keeps the previous graph referenced (`logits`) until the next forward returns: at the end of every forward pass the
    previous micro-batch's inputs of all 4-bit linears are still allocated, one storage per distinct input (per layer: the
    norm output for qkv, the attention output for proj, the second norm output for fc_1/fc_2, the MLP product for proj;
    plus the final norm output the chunked head reads). With today's bitsandbytes (ctx.tensors = (None, B)) nothing stays.
    Checked on the CPU against the memory model's count (`lingering_matmul4bit_inputs`) for the same shapes."""
    batch, seq, h, i, vocab = 2, 256, 64, 176, 96
    total, alive, after = _matmul4bit_inputs_alive(True, batch, seq, h, i, vocab)
    per_layer = 2 * batch * seq * (3 * h + i)  # bf16
    assert total == 2 * per_layer + 2 * batch * seq * h  # two layers + the final norm output (the head's chunks are views)
    first_input = 2 * batch * seq * h  # layer 0's qkv input (the frozen embedding's output) needs no grad: ctx.tensors = (None, None)
    assert alive == total - first_input and after == 0  # the rest is alive at the end of the next forward; freed once `logits` is reassigned

    _, alive_new, _ = _matmul4bit_inputs_alive(False, batch, seq, h, i, vocab)
    assert alive_new == 0  # installed bitsandbytes: MatMul4Bit keeps only the packed weight

    from trainpipe.plan.catalog import spec_from_config_dict

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": i, "num_attention_heads": 4,
           "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": vocab, "max_position_embeddings": 1024, "tie_word_embeddings": False}
    spec = spec_from_config_dict("tiny-llama-litgpt", cfg, "test")
    s = M.Setup(method="qlora", precision="bf16-true", micro_batch=batch, seq_len=seq, lora_r=4, lora_targets="q,v", framework="litgpt")
    assert M.keeps_previous_graph(s)
    assert M.lingering_matmul4bit_inputs(spec, s, batch * seq) == alive
    assert not M.keeps_previous_graph(M.Setup(method="qlora", framework="litgpt", bnb_saves_input=False))
    assert not M.keeps_previous_graph(M.Setup(method="qlora", framework="transformers"))  # the HF Trainer drops its outputs


def test_lightning_quantized_weight_dequantizes_to_fp16_then_a_bf16_copy():
    """Lightning's BitsandbytesPrecision quantizes `weight.half()`, so the QuantState is fp16: MatMul4Bit's
    `F.dequantize_4bit(B, state).to(A.dtype)` makes an fp16 tensor and then a bf16 copy of every weight it uses (4 B per
    element at the cast); a weight quantized in bf16 (transformers loading in bf16) dequantizes straight to bf16 (2 B)."""
    import bitsandbytes.functional as F

    w = torch.randn(128, 256)
    q, state = F.quantize_4bit(w.half(), quant_type="nf4")
    deq = F.dequantize_4bit(q, state)
    cast = deq.to(torch.bfloat16)
    assert state.dtype == torch.float16 and deq.dtype == torch.float16 and cast.data_ptr() != deq.data_ptr()
    q16, state16 = F.quantize_4bit(w.bfloat16(), quant_type="nf4")
    deq16 = F.dequantize_4bit(q16, state16)
    assert deq16.to(torch.bfloat16).data_ptr() == deq16.data_ptr()  # no second copy

    spec = find_model("meta-llama/Meta-Llama-3-8B")
    lit = M.Setup(method="qlora", precision="bf16-true", micro_batch=2, seq_len=512, lora_r=32, lora_targets="q,v", framework="litgpt", double_quant=False)
    hf = M.Setup(method="qlora", precision="bf16-true", micro_batch=2, seq_len=512, lora_r=32, lora_targets="q,v", framework="transformers", double_quant=False)
    assert M._dequant_bytes(lit) == 4 and M._dequant_bytes(hf) == 2
    # litgpt's lm_head is a Linear4bit as well (Lightning replaces every torch.nn.Linear): NF4, not 16-bit, in the weights
    w_lit = M.weights_bytes(spec, lit, M.trainable_params(spec, lit))[1]
    w_hf = M.weights_bytes(spec, hf, M.trainable_params(spec, hf))[1]
    head = spec.vocab * spec.hidden
    assert w_lit["nf4_lm_head"] == int(M.nf4_bytes(head, False)) and w_hf["unquantized"] - w_lit["unquantized"] == 2 * head
    # and its dequantized copy (fp16 + bf16) is what is in flight at the end of the forward pass and in its backward
    ad = M.activation_bytes(spec, lit)[1]
    assert ad["forward_end_peak"] >= 4 * head + ad["previous_graph_matmul4bit_inputs"]


def test_litgpt_keeps_its_own_lm_head_where_the_checkpoint_ties_it():
    """litgpt's GPT always builds `lm_head = nn.Linear(n_embd, padded_vocab_size)` and its converter copies the embedding into
    `lm_head.weight` for tied checkpoints (Gemma): a second vocabulary matrix the transformers model does not have."""
    spec = find_model("google/gemma-2b")
    assert spec.lm_head_params == 0  # tied in the Hugging Face model
    lit = M.Setup(method="lora", precision="bf16-true", micro_batch=2, seq_len=512, lora_r=8, lora_targets="all-linear", framework="litgpt")
    hf = M.Setup(**{**lit.__dict__, "framework": "transformers"})
    w_lit = M.weights_bytes(spec, lit, M.trainable_params(spec, lit))[0]
    w_hf = M.weights_bytes(spec, hf, M.trainable_params(spec, hf))[0]
    head = spec.vocab * spec.hidden
    adapters_gap = 2 * M.trainable_params(spec, hf)  # PEFT's fp32 adapters vs litgpt's bf16 ones
    assert w_lit - (w_hf - adapters_gap) == 2 * head
