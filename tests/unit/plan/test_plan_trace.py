"""`plan/trace.py`: the real training step traced on fake tensors (issue 14 item 5).

- the fake trace's peak equals the same tracker's peak on real CPU tensors to the byte (LoRA, DoRA, full, QLoRA with the
  emulated bitsandbytes kernel; trainpipe's and transformers' losses; bf16-true, fp32 and bf16 autocast);
- dropout is routed through `torch.native_dropout` (a 1-byte bool mask, as CUDA keeps), where the CPU's own dropout keeps a
  float noise tensor;
- the planner (`memory.estimate(...).allocated_bytes`) is within +/-10 % of the trace on real-width shapes (few layers);
- `trainpipe plan --trace` end to end.
"""

import json

import pytest
import torch

from trainpipe.plan import memory as M
from trainpipe.plan.catalog import catalog, find_model
from trainpipe.plan.trace import TraceError, cuda_like_dropout, live_bytes_tracker, trace_step

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def _setup(**kw):
    base = dict(method="lora", precision="bf16-true", micro_batch=2, seq_len=32, framework="trainpipe", lora_targets="q,k,v,o")
    return M.Setup(**(base | kw))


@pytest.mark.parametrize("kw", [
    dict(method="lora"),
    dict(method="lora", framework="transformers", precision="fp32"),
    dict(method="dora", precision="bf16"),
    dict(method="full"),
    dict(method="full", framework="hf-bf16-loss", grad_ckpt=True),
    dict(method="qlora", precision="bf16"),
    dict(method="qlora", precision="bf16", qlora_upcast_rest=True),
], ids=["lora", "lora-transformers-fp32", "dora-autocast", "full", "full-ckpt-hfloss", "qlora-emulated-bitsandbytes-kernel", "qlora-upcast-rest"])
def test_fake_trace_equals_real_tensors_to_the_byte(tiny, kw):
    s = _setup(**kw)
    fake = trace_step(tiny, s, steps=2)
    real = trace_step(tiny, s, steps=2, fake=False)
    assert fake.peak_bytes == real.peak_bytes and fake.step_peaks == real.step_peaks
    assert fake.phase == real.phase and fake.weights_bytes == real.weights_bytes
    assert fake.peak_bytes > fake.weights_bytes  # activations and states on top of the weights
    # the event stream replays to the same peak (what an allocator simulator is fed)
    cur = best = 0
    for _, n, sign in fake.events:
        cur += sign * n
        best = max(best, cur)
    assert best == fake.peak_bytes
    assert sum(fake.split.values()) == fake.peak_bytes and fake.split["params"] <= fake.weights_bytes


def test_qlora_emulated_kernel_stores_nf4_and_keeps_no_input(tiny):
    """Emulated bitsandbytes kernel: the 4-bit base is stored as bnb 0.50 stores NF4 with double quantization (packed
    n/2 bytes + uint8 absmax + nested fp32 absmax + code; the planner's nf4_bytes also counts the 64-byte quant-state
    scalars per tensor), the rest of the model in its load dtype (train/model.py prepare_kbit; fp32 with upcast_rest), and the matmul saves nothing of
    its input (bnb 0.50's MatMul4Bit: ctx.tensors = (None, B))."""
    from trainpipe.plan.trace import _emulated_4bit_classes

    s = _setup(method="qlora")
    spec = find_model(tiny)
    q = trace_step(spec, s, steps=1)
    planned, _ = M.weights_bytes(spec, s, M.trainable_params(spec, s))
    n_linear = sum(li.count for li in spec.linears)
    rotary = 2 * 4 * (TINY["hidden_size"] // TINY["num_attention_heads"] // 2)  # inv_freq + original_inv_freq buffers (fp32), not weights
    assert q.weights_bytes == planned - 64 * n_linear + rotary
    E4 = _emulated_4bit_classes()
    lin = E4(64, 96, False, torch.bfloat16, True, torch.bfloat16)
    lin.packed = torch.randint(0, 256, lin.packed.shape, dtype=torch.uint8)
    lin.absmax = torch.randint(0, 256, lin.absmax.shape, dtype=torch.uint8)
    lin.nested_absmax, lin.code, lin.offset = torch.full(lin.nested_absmax.shape, 0.01), torch.linspace(-1, 1, 256), torch.zeros(())
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    saved: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = lin(x)
    y.float().sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad.float()).all()
    assert tuple(x.shape) not in [tuple(t) for t in saved]


def test_dropout_routed_to_native_dropout_keeps_a_bool_mask():
    saved: list = []

    def run():
        x = torch.randn(64, 128, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
            torch.nn.Dropout(0.1).train()(x).sum().backward()

    run()
    cpu = list(saved)
    saved.clear()
    with cuda_like_dropout():
        run()
    assert (torch.bool, 64 * 128) in saved and not any(d.is_floating_point and n == 64 * 128 for d, n in saved)
    assert not any(d == torch.bool for d, _ in cpu)  # the CPU's own dropout keeps float noise: why the routing exists


def test_lora_dropout_mask_is_one_byte_per_element_as_on_cuda(tiny, monkeypatch):
    """The same LoRA step (p = 0.05) with and without the routing, live bytes when the backward starts: the CPU's own
    dropout keeps a 4-byte float noise tensor per element where the routed one (CUDA's fused kernel) keeps a 1-byte bool
    mask: 3 B per element of every adapted module's input less (q, k and v each have their own dropout on the normed
    input, o on the attention output)."""
    import contextlib

    import trainpipe.plan.trace as T

    routed = trace_step(tiny, _setup(lora_dropout=0.05), steps=1)
    monkeypatch.setattr(T, "cuda_like_dropout", contextlib.nullcontext)
    cpu = trace_step(tiny, _setup(lora_dropout=0.05), steps=1)
    h, L, tokens = TINY["hidden_size"], TINY["num_hidden_layers"], 2 * 32
    start = "backward (step 1)"
    # the first layer's q/k/v input (normed frozen embeddings) needs no gradient, so autograd keeps no mask for those three
    kept = L * 4 - 3
    assert cpu.phase_bytes[start] - routed.phase_bytes[start] == 3 * kept * tokens * h
    assert cpu.peak_bytes > routed.peak_bytes


REAL_WIDTH = [
    ("meta-llama/Llama-3.1-8B", dict(method="lora", precision="bf16-true", micro_batch=1, seq_len=2048)),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", precision="bf16", micro_batch=1, seq_len=2048)),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", precision="bf16-true", micro_batch=1, seq_len=2048, framework="transformers")),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", precision="bf16-true", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    ("meta-llama/Llama-3.1-8B", dict(method="full", precision="bf16-true", micro_batch=1, seq_len=2048)),
    ("meta-llama/Llama-3.2-1B", dict(method="full", precision="bf16", micro_batch=4, seq_len=512)),
    ("meta-llama/Llama-3.1-8B", dict(method="qlora", precision="bf16", micro_batch=1, seq_len=2048)),
    ("meta-llama/Llama-3.1-8B", dict(method="qlora", precision="bf16", micro_batch=1, seq_len=2048, grad_ckpt=True)),
    # at full depth (22 layers): with two layers the loss's chunk temporaries dominate this small-vocabulary model
    ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", dict(method="qlora", precision="bf16", micro_batch=4, seq_len=512, lora_targets="attention")),
]


def _few_layers(tmp_path, mid: str, layers: int = 2) -> str:
    e = catalog()[mid.lower()]
    c = dict(e["config"], model_type=e["model_type"])
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in c:
            c[k] = layers
    d = tmp_path / mid.replace("/", "_")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    return str(d)


@pytest.mark.parametrize("mid,kw", REAL_WIDTH, ids=[f"{m.split('/')[-1]}-{k['method']}-{k['precision']}-{k.get('framework', 'trainpipe')}{'-ckpt' if k.get('grad_ckpt') else ''}" for m, k in REAL_WIDTH])
def test_planner_within_ten_percent_of_the_trace_at_real_width(tmp_path, mid, kw):
    """Real hidden/intermediate/vocabulary sizes, two layers (fake tensors are free; TinyLlama at full depth). The QLoRA
    rows failed (-42 % at 8B x 2 layers, -22.6 % for the full 8B at 8192 tokens) before the planner knew that trainpipe's
    prepare_model_for_kbit_training stores the rest of the model in fp32 and so keeps the MLP's saved tensors in fp32
    (memory.kbit_prepared_fp32); the LoRA rows were 2-5 % higher before it counted unrepeated k/v (enable_gqa); the mixed-
    precision full row was +10 % (+15 % for Llama-3.2-3B at 4096 tokens) while the planner added every gradient to every
    activation (trainpipe's set_to_none: none exists at the backward's start)."""
    spec = find_model(mid) if mid.startswith(("TinyLlama/", "meta-llama/Llama-3.2-1B")) else find_model(_few_layers(tmp_path, mid))
    s = _setup(**kw)
    est = M.estimate(spec, s).allocated_bytes
    r = trace_step(spec, s, steps=2, record_events=False)
    err = (est - r.peak_bytes) / r.peak_bytes
    assert abs(err) <= 0.10, f"planner {est / 2**30:.3f} GiB vs trace {r.peak_bytes / 2**30:.3f} GiB ({100 * err:+.1f} %) at {r.phase}; split {r.split}"


def test_untraceable_setups_are_refused_with_the_reason(tiny):
    with pytest.raises(TraceError, match="8-bit optimizers"):
        trace_step(tiny, _setup(optimizer="adamw_8bit"), steps=1)
    with pytest.raises(TraceError, match="litgpt"):
        trace_step(tiny, _setup(framework="litgpt"), steps=1)


def test_tracker_counts_live_storage_bytes():
    with live_bytes_tracker() as tr:
        a = torch.empty(1000, dtype=torch.float32)
        b = a.view(10, 100)  # a view: no new storage
        c = torch.empty(500, dtype=torch.bfloat16)
        assert tr.cur == 4000 + 1000
        del a, b
        assert tr.cur == 1000 and tr.peak == 5000
        del c
    assert tr.cur == 0


def test_cli_plan_trace_end_to_end(tiny, capsys):
    from trainpipe.cli import main

    assert main(["plan", "--model", tiny, "--set", "method.peft=lora", "--gpu", "A100-80GB", "--set", "data.max_length=32", "--set", "training.per_device_train_batch_size=2", "--trace", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    t = p["trace"]
    assert t["traced"] and t["planner_allocated_bytes"] == sum(p["memory"]["per_device"][k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes"))
    s = M.Setup(**p["setup"])
    assert t["trace_peak_bytes"] == trace_step(tiny, s, steps=2, record_events=False).peak_bytes
    assert t["difference_pct"] == round(100 * (t["planner_allocated_bytes"] - t["trace_peak_bytes"]) / t["trace_peak_bytes"], 1)
    assert main(["plan", "--model", tiny, "--set", "method.peft=lora", "--gpu", "A100-80GB", "--set", "data.max_length=32", "--set", "training.per_device_train_batch_size=2", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "traced step (fake tensors" in out and "% off it" in out


def test_cli_plan_trace_unknown_model_offline_is_a_clear_error(capsys, monkeypatch):
    from trainpipe.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "some-org/not-a-model", "--gpu", "A100-80GB", "--trace"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "config.json" in out.out + out.err


def test_cli_plan_config_trace(tmp_path, tiny_model_dir, capsys):
    """`trainpipe plan run.yaml --trace`: the run config's own setup (the one `trainpipe run` executes) is traced."""
    from trainpipe.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": f"q{i}", "output": "a" * 40}) for i in range(20)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name_or_path: {tiny_model_dir}}}\ndata: {{sources: [{{path: train.jsonl}}], max_length: 64}}\n")
    assert main(["plan", str(cfg), "--gpu", "L4", "--trace", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    t = p["trace"]
    assert t["traced"], t
    assert p["setup"]["seq_len"] == 64 and t["trace_peak_bytes"] > 0
    assert t["trace_peak_bytes"] == trace_step(tiny_model_dir, M.Setup(**p["setup"]), steps=2, record_events=False).peak_bytes
