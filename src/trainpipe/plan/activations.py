"""Activation bytes of one training step: what autograd saves per decoder layer, the logits and the loss, for each
framework whose training code is sized (plan/memory.py `estimate` adds them to the weights, gradients and optimizer)."""

from __future__ import annotations

from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.setup import HF_MODULES, LOSS_CHUNK_ELEMENTS, Setup, _act, _fp32_base_under_autocast, kbit_prepared_fp32


def _linear_lookup(spec: ModelSpec, s: Setup) -> tuple[set[str], set[str]]:
    """(paths whose base weights train, paths with LoRA adapters)."""
    paths = {li.path or li.name for li in spec.linears if li.in_layers}
    if s.method == "full":
        return paths, set()
    if s.method == "freeze":
        return paths, set()  # handled per layer
    adapted = {li.path or li.name for li in spec.resolve_targets(s.lora_targets) if li.in_layers}
    return set(), adapted


def bnb_saves_input(s: Setup) -> bool:
    """Whether the 4-bit matmul keeps its input for the backward pass. The bitsandbytes trainpipe installs (>= 0.45; 0.50 in
    the venv) keeps only the packed weight (`MatMul4Bit.forward`: ctx.tensors = (None, B); the input gradient needs B alone,
    tests/unit/plan/test_accuracy.py checks the installed one), so a trainpipe QLoRA run saves what LoRA on a 16-bit base
    saves. The published measurements (litgpt 2023-24, the PEFT docs) ran older releases whose MatMul4Bit kept
    ctx.tensors = (A, B): every quantized linear's input stayed alive until its backward."""
    if s.bnb_saves_input is not None:
        return s.bnb_saves_input
    return s.framework != "trainpipe"


def _litgpt_head_params(spec: ModelSpec, s: Setup) -> int:
    """Elements of litgpt's lm_head: litgpt's GPT always builds its own `nn.Linear(n_embd, padded_vocab_size)` (litgpt/model.py)
    and its checkpoint converter copies the embedding into `lm_head.weight` where the Hugging Face model ties them (Gemma), so
    the head is a separate matrix even where `spec.lm_head_params` is 0; other frameworks: 0."""
    if s.framework != "litgpt" or not s.lm_head:
        return 0
    return spec.lm_head_params or spec.vocab * spec.hidden


def _dequant_bytes(s: Setup) -> int:
    """Bytes per weight element while a 4-bit weight is dequantized for a matmul. litgpt quantizes through Lightning's
    BitsandbytesPrecision, which quantizes `weight.half()` (QuantState.dtype = float16), so bitsandbytes' MatMul4Bit
    dequantizes to fp16 and then casts to the bf16 input (`F.dequantize_4bit(B, quant_state).to(A.dtype)`): both copies are
    alive at the cast (2 + 2 B). transformers quantizes the weight in its load dtype (bf16): the cast is a no-op (2 B)."""
    return 4 if (s.framework == "litgpt" and s.precision in ("bf16", "bf16-true")) else 2


def keeps_previous_graph(s: Setup) -> bool:
    """Whether the previous micro-batch's 4-bit matmul inputs are still allocated at the end of this forward pass.

    bitsandbytes <= 0.43.1 (litgpt pinned 0.42.0) stores MatMul4Bit's input as a plain ctx attribute (`ctx.tensors = (A, B)`),
    not with `ctx.save_for_backward`, so the backward pass does not release it: A lives as long as the graph node. litgpt's
    loop (litgpt/finetune/lora.py `fit`) keeps the previous graph referenced through `logits` (and `loss`) until the next
    `logits = model(...)` returns, so at the end of each forward pass the previous micro-batch's inputs of every quantized
    linear are still allocated (the Hugging Face Trainer drops its outputs after each step). Under activation checkpointing
    the matmul nodes live only inside the recomputation."""
    return s.framework == "litgpt" and s.method == "qlora" and bnb_saves_input(s) and not s.grad_ckpt


def lingering_matmul4bit_inputs(spec: ModelSpec, s: Setup, tokens: int) -> int:
    """Bytes of the inputs of all 4-bit matmuls of one forward pass over `tokens` tokens, one storage per distinct input:
    the attention input (shared by q/k/v or the fused qkv), the attention output (o_proj's input: after the attention
    node's backward released its saved output, this view keeps the storage alive), the MLP input and the down projection's
    input, per layer, plus the final norm output (litgpt's chunked lm_head is a Linear4bit too)."""
    a = _act(s)
    per_layer = max(1, spec.layers)
    k_act = spec.arch.get("experts_per_token") or 1
    seen: set[tuple] = set()
    elems = 0.0
    for li in spec.linears:
        if not li.in_layers:
            continue
        path = li.path or li.name
        shared = li.leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "q", "k", "v", "wi_0", "wi_1")
        group = ("attn_out",) if _attention_output_proj(li) else (li.fan_in, path.split(".")[0], shared)
        if group in seen:
            continue
        seen.add(group)
        elems += li.fan_in * (k_act if ".experts." in path else 1) * (1 if shared else li.count / per_layer)
    head = spec.hidden if _litgpt_head_params(spec, s) else 0
    # the first layer's attention input is the frozen embedding's output, which needs no gradient: that matmul keeps
    # nothing (`ctx.tensors = (None, None)` when no input needs a gradient)
    first = spec.hidden if elems else 0
    return int(a * tokens * (elems * spec.layers - first + head))


def _python_tanh_gelu(spec: ModelSpec, s: Setup) -> bool:
    """transformers' `gelu_new` is written in Python (0.5*x*(1+tanh(...))): autograd keeps four tensors of the
    MLP width; litgpt/torchtune call the fused F.gelu(approximate="tanh"), which keeps only its input."""
    # the catalog keeps no activation name; phi (1.5/2) and gpt2 configs ship `gelu_new`
    act = spec.config.get("hidden_act") or spec.config.get("activation_function") or {"phi": "gelu_new", "gpt2": "gelu_new"}.get(spec.model_type, "")
    return s.framework in HF_MODULES and act in ("gelu_new", "gelu_fast")


_ATTN_MODULES = ("self_attn", "attn", "attention", "self_attention")
_ATTN_OUT_LEAVES = ("o_proj", "dense", "out_proj", "c_proj", "wo", "o")


def _attention_output_proj(li) -> bool:
    """The attention block's output projection (o_proj, GPT-2's attn.c_proj, Falcon's self_attention.dense, T5's o)."""
    path = li.path or li.name
    parts = path.split(".")
    return parts[0] in _ATTN_MODULES and li.leaf in _ATTN_OUT_LEAVES and len(parts) == 2


def _linear_inputs_saved(saved: float, spec: ModelSpec, s: Setup, tokens: int, *, full_layer: bool, adapter_in: int, fp32_adapters: bool) -> float:
    """``saved`` plus what one layer's linears keep for backward: the inputs of trained weights (shared inputs once), the
    LoRA dropout masks and outputs, and the adapters' own inputs and outputs (added in the layer's order, as before)."""
    a = _act(s)
    _, adapted = _linear_lookup(spec, s)
    linears = [li for li in spec.linears if li.in_layers]
    per_layer = max(1, spec.layers)
    k_act = spec.arch.get("experts_per_token") or 1
    inputs_seen: set[tuple] = set()
    dropout_seen: set[tuple] = set()
    for li in linears:
        path = li.path or li.name
        count = li.count / per_layer
        shared = li.leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "q", "k", "v", "wi_0", "wi_1")
        group = (li.fan_in, path.split(".")[0], shared)
        is_expert = ".experts." in path
        mult = k_act if is_expert else 1
        keeps_input = full_layer or (s.method == "qlora" and bnb_saves_input(s))  # trained weight, or an older bitsandbytes' 4-bit matmul
        if keeps_input and s.attention != "eager" and _attention_output_proj(li):
            # its input is the fused attention kernel's output seen through transpose+reshape (a view: SDPA/flash lay the
            # output out as (batch, seq, heads, dim)), which the kernel saves anyway and is counted with it below
            keeps_input = False
        if keeps_input and group not in inputs_seen:
            saved += a * tokens * li.fan_in * mult * (1 if group[2] else count)
            inputs_seen.add(group)
        if path in adapted:
            if s.lora_dropout > 0:
                # dropout keeps its bool mask and its output (lora_A's input); litgpt's fused qkv has one dropout for q/k/v
                dgroup = group if (s.framework == "litgpt" and shared and path.split(".")[0] in ("self_attn", "attn", "attention")) else (path,)
                if dgroup not in dropout_seen:
                    saved += (1 + adapter_in) * tokens * li.fan_in * count
                    dropout_seen.add(dgroup)
            elif adapter_in != a:
                saved += adapter_in * tokens * li.fan_in * count  # the fp32 cast lora_A saves
            elif group not in inputs_seen:
                saved += a * tokens * li.fan_in * count  # lora_A keeps the (shared) input itself
                inputs_seen.add(group)
            saved += (4 if fp32_adapters else a) * tokens * s.lora_r * count  # lora_A output, lora_B's input
    return saved


def layer_activation_bytes(spec: ModelSpec, s: Setup, tokens: int, *, trained: bool | None = None) -> int:
    """Bytes autograd saves in one decoder layer for `tokens` = micro_batch * seq_len tokens.

    A Linear saves its input only when its weight trains (a frozen weight's backward needs the weight,
    not the input), except an older bitsandbytes' 4-bit matmul (QLoRA), whose autograd function kept the input
    for every call (`MatMul4Bit.forward`: ctx.tensors = (A, B)); see `bnb_saves_input`. Modules reading the same tensor share
    one saved copy (q/k/v read the norm output, gate/up read the second norm output).
    """
    a = _act(s)
    A = spec.arch
    h, heads, kv, hd, i = A["hidden"], A["heads"], A["kv_heads"], A["head_dim"], A["intermediate"]
    q_dim, kv_dim = heads * hd, kv * hd
    k_act = A.get("experts_per_token") or 1
    full_layer = s.method == "full" or (s.method == "freeze" and trained)
    autocast = s.precision in ("bf16", "fp16")
    # PEFT upcasts adapters to fp32 and casts the adapter's input to fp32 before its dropout; litgpt and
    # torchtune keep adapters in the model dtype. Under autocast the adapter input is the 16-bit cast.
    fp32_adapters = s.framework in HF_MODULES and not autocast and a != 4
    adapter_in = 4 if fp32_adapters else a

    saved = 0.0
    # two norms: the fp32 upcast of the input (HF RMSNorm/LayerNorm in 16-bit) + normalised output when the norm weight trains
    saved += 2 * tokens * h * (4 + (a if full_layer else 0))
    saved = _linear_inputs_saved(saved, spec, s, tokens, full_layer=full_layer, adapter_in=adapter_in, fp32_adapters=fp32_adapters)
    # attention kernel: q, k, v (repeated to all heads except flash), output
    # transformers 5 (trainpipe's stack) calls SDPA with enable_gqa when no mask is needed (no padding: what the planner sizes),
    # so k/v are not repeated (integrations/sdpa_attention.py use_gqa_in_sdpa; traced in tests/unit/plan/test_plan_trace.py);
    # the published rows ran transformers 4.4x/litgpt/torchtune, which repeat k/v before SDPA
    kv_saved = 2 * (kv_dim if (s.attention == "flash" or (s.attention == "sdpa" and s.framework == "trainpipe")) else q_dim)
    saved += a * tokens * (q_dim + kv_saved + q_dim)
    if s.attention == "eager":
        b = max(1, s.micro_batch)
        seq = tokens // b
        saved += (4 + (a if a != 4 else 0)) * b * heads * seq * seq  # fp32 softmax output (+ its 16-bit cast)
    # MLP: gated: act(gate)'s input, its output and up (the product feeds down: saved above when down keeps its
    # input); plain: the activation's input (four tensors for transformers' Python tanh-GELU)
    # trainpipe's QLoRA with upcast_rest (kbit_prepared_fp32): the residual stream is fp32 (fp32 embeddings and norms) and Linear4bit returns its
    # input's dtype, so gate/up outputs and the activation are fp32 even under autocast (traced: plan/trace.py)
    a_mlp = 4 if kbit_prepared_fp32(s) else a
    if A.get("gated_mlp"):
        saved += 3 * a_mlp * tokens * i * k_act
    else:
        saved += (4 if _python_tanh_gelu(spec, s) else 1) * a_mlp * tokens * i * k_act
    if A.get("experts"):
        saved += a * tokens * h * k_act + 4 * tokens * A["experts"]  # dispatched copies, router logits
    if A.get("dropout"):  # BERT/GPT-2/T5-style dropout: a bool mask and the output after attention and after the MLP
        saved += 2 * tokens * h * (1 + a)
        if s.attention == "eager":
            b = max(1, s.micro_batch)
            seq = tokens // b
            saved += (1 + a) * b * heads * seq * seq
    return int(saved)


def logits_bytes(spec: ModelSpec, s: Setup, tokens: int) -> int:
    """Per token and vocabulary entry, what the loss keeps at the start of the backward pass.

    transformers/torchtitan: the 16-bit lm_head output, its fp32 upcast, the fp32 log-softmax and its
    gradient (a + 4 + 4 + 4). trainpipe: the logits (a) plus one fp32 chunk (train/losses.py). litgpt: a 16-bit cross-entropy on the 16-bit logits (output, log-softmax
    and their gradients, 4 x a). torchtune: the 16-bit logits, their gradient and one of 8 chunks upcast
    to fp32 at a time (2 a + 12 / 8).
    """
    if not s.lm_head:
        return 0
    a = _act(s)
    if s.framework == "trainpipe":
        # the 16-bit logits (their gradient is written over them), one fp32 chunk and its exp/scatter temporary, the
        # per-token fp32 log-sum-exp (train/losses.py)
        n = tokens * spec.vocab
        return int(a * n + 2 * 4 * min(n, LOSS_CHUNK_ELEMENTS) + 4 * tokens)
    # hf-bf16-loss: the copy of the shifted logits and the log-softmax output in the forward (the returned logits are
    # dropped); in the backward the log-softmax output, nll's dense gradient and the log-softmax input gradient (3 x a)
    per = {"litgpt": 4 * a, "torchtune": 2 * a + 12 / 8, "hf-bf16-loss": 3 * a}.get(s.framework, a + 4 + 4 + 4)
    return int(tokens * spec.vocab * per)


def activation_bytes(spec: ModelSpec, s: Setup) -> tuple[int, dict]:
    tokens = s.micro_batch * s.seq_len
    a = _act(s)
    L = spec.layers
    if s.method == "freeze":
        trained_layers = min(s.freeze_layers, L)
        per_t = layer_activation_bytes(spec, s, tokens, trained=True)
        layers_total = trained_layers * per_t
        per_layer = per_t
        n_layers_saving = trained_layers
        if s.train_embeddings and L > trained_layers:
            # trained input embeddings: the gradient flows back through the frozen blocks too, which then save what a
            # frozen layer with a grad-requiring input saves (the norms, attention and MLP tensors; no Linear inputs)
            layers_total += (L - trained_layers) * layer_activation_bytes(spec, s, tokens, trained=False)
            n_layers_saving = L
    else:
        per_layer = layer_activation_bytes(spec, s, tokens)
        layers_total = L * per_layer
        n_layers_saving = L
    logits = logits_bytes(spec, s, tokens)
    if spec.task == "masked-lm" or spec.task == "seq2seq-lm":
        logits = int(logits * (1.0 if spec.task == "seq2seq-lm" else 1.0))
    d = {"per_layer": per_layer, "logits": logits, "tokens_per_micro_batch": tokens}
    # the backward of one layer holds the gradients of its widest tensors next to what it saved: the
    # MLP's (gate, up and their product for a gated MLP; the activation's input and output for a plain one)
    i_w = spec.arch["intermediate"] * (spec.arch.get("experts_per_token") or 1)
    layer_bwd = (3 if spec.arch.get("gated_mlp") else 2) * a * tokens * i_w
    # autocast's 16-bit cast of a frozen fp32 weight is saved by the matmul for the input gradient: every
    # layer's casts are alive at the start of backward (one layer's with checkpointing)
    frozen_casts = 0
    if _fp32_base_under_autocast(s):
        frozen_casts = 2 * sum(li.fan_in * li.fan_out * li.count for li in spec.linears if li.in_layers) // max(1, L)
        d["autocast_weight_casts_per_layer"] = frozen_casts
    a_res = 4 if kbit_prepared_fp32(s) else a  # trainpipe's QLoRA with upcast_rest: the residual stream (each layer's input) is fp32
    if s.grad_ckpt:
        kept = n_layers_saving * a_res * tokens * spec.hidden
        total = kept + max(logits, per_layer + frozen_casts + layer_bwd + 2 * a_res * tokens * spec.hidden)
        d["checkpointed_inputs"] = kept
    else:
        total = layers_total + L * frozen_casts + max(logits, layer_bwd) + a * tokens * spec.hidden * 2
    if kbit_prepared_fp32(s) and s.lm_head and s.precision in ("bf16", "fp16"):
        total += 2 * (spec.lm_head_params or spec.embedding_params)  # autocast's 16-bit cast of the fp32 lm_head, saved by its matmul
        d["lm_head_autocast_cast"] = 2 * (spec.lm_head_params or spec.embedding_params)
    if s.method == "qlora":  # one dequantized weight in flight (litgpt: its lm_head is 4-bit too, fp16 then bf16)
        biggest = max(max((li.fan_in * li.fan_out for li in spec.linears), default=0), _litgpt_head_params(spec, s))
        dequant = _dequant_bytes(s) * biggest
        total += dequant
        if keeps_previous_graph(s) and not s.grad_ckpt:
            # the end of the forward pass (the last lm_head chunk): this micro-batch's saved tensors, its logits, the previous
            # micro-batch's logits and 4-bit matmul inputs (still referenced: keeps_previous_graph), the dequantized lm_head
            prev = tokens if s.prev_graph_tokens is None else s.prev_graph_tokens
            lingering = lingering_matmul4bit_inputs(spec, s, prev)
            logits16 = a * spec.vocab * (tokens + prev) if s.lm_head else 0
            fwd_end = layers_total + lingering + logits16 + _dequant_bytes(s) * _litgpt_head_params(spec, s) + a * tokens * spec.hidden
            d["previous_graph_matmul4bit_inputs"] = lingering
            d["forward_end_peak"] = int(fwd_end)
            total = max(total, fwd_end)
    return int(total), d
