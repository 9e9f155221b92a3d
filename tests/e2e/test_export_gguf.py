"""GGUF export (`trainpipe export RUN_DIR --gguf f16|f32`): read back with the `gguf` package's own reader and
compared, tensor by tensor, with the exported safetensors; the query/key row order checked against transformers'
rotary embedding with llama.cpp's (pairs of neighbouring dimensions) written out here; other architectures refused."""

import json

import numpy as np
import pytest

from test_resilience import config
from tiny import build_tiny_model
from trainpipe import ownership
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    base = build_tiny_model(tmp / "base")
    cfg = config(tmp, base, **{"training.max_steps": 2, "training.eval_steps": 2, "training.save_steps": 2, "training.logging_steps": 1,
                               "training.learning_rate": 1e-2, "data.eval_split": 4, "training.gradient_accumulation_steps": 1})
    assert main(["run", str(cfg)]) == 0
    return tmp / "run"


def _hf_tensors(model_dir):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _read(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    tensors = {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in r.tensors}
    fields = {k: f.contents() for k, f in r.fields.items()}
    return tensors, fields


def _unpermute(w, n_head):
    """The inverse of llama.cpp's query/key row permutation (written independently of trainpipe's)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gguf_tensors_and_metadata_equal_the_export(run, tmp_path, dtype, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--gguf", dtype]) == 0
    path = out / f"model-{dtype}.gguf"
    assert path.is_file() and f"gguf: {path}" in capsys.readouterr().out
    assert not list(out.glob("*.tmp"))
    assert ownership.foreign(out) == []  # the GGUF file is fingerprinted with the export: a later export may replace the folder
    hf = _hf_tensors(out)
    cfg = json.loads((out / "config.json").read_text())
    n_head, n_kv, n_layer = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    tensors, fields = _read(path)

    # every weight is there under llama.cpp's name, with the value the export holds (f16: its float16 rounding)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(n_layer):
        for hf_part, g in [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                           ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                           ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]:
            names[f"model.layers.{i}.{hf_part}.weight"] = f"blk.{i}.{g}.weight"
    assert set(tensors) == set(names.values())  # tied embeddings: no separate output.weight
    for hf_name, g in names.items():
        kind, got = tensors[g]
        want = hf[hf_name].astype(np.float32)
        if ".q_proj." in hf_name:
            got = _unpermute(got, n_head)
        elif ".k_proj." in hf_name:
            got = _unpermute(got, n_kv)
        assert got.shape == want.shape, g
        if dtype == "f32" or want.ndim == 1:
            assert kind == "F32" and np.array_equal(got, want), g
        else:
            assert kind == "F16" and np.array_equal(got, want.astype(np.float16)), g

    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == n_layer and fields["llama.attention.head_count"] == n_head
    assert fields["llama.attention.head_count_kv"] == n_kv and fields["llama.embedding_length"] == cfg["hidden_size"]
    assert abs(fields["llama.attention.layer_norm_rms_epsilon"] - cfg["rms_norm_eps"]) < 1e-12

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    vocab = tok.get_vocab()
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == tensors["token_embd.weight"][1].shape[0]
    assert all(tokens[i] == t for t, i in vocab.items())
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eos_token_id and fields["tokenizer.ggml.padding_token_id"] == tok.pad_token_id
    assert len(fields["tokenizer.ggml.merges"]) > 0
    assert fields["tokenizer.chat_template"] == tok.chat_template and "<|im_start|>" in fields["tokenizer.chat_template"]


def test_query_key_order_matches_llama_cpp_rope(run, tmp_path):
    """Attention scores from the GGUF weights under llama.cpp's rotary embedding (neighbouring pairs, as ggml's
    rope 'normal' mode) equal transformers' (rotate_half) on the original weights."""
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from trainpipe.export_gguf import write_gguf

    model_dir = run / "model"
    path = write_gguf(model_dir, tmp_path / "m.gguf", dtype="f32")
    tensors, _ = _read(path)
    hf = _hf_tensors(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    n_head, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    torch.manual_seed(0)
    x = torch.randn(7, cfg.hidden_size)
    pos = torch.arange(7)

    def heads(w, n):
        return (x @ torch.as_tensor(np.array(w)).T).reshape(7, n, d).transpose(0, 1)  # (heads, seq, d)

    q, k = heads(hf["model.layers.0.self_attn.q_proj.weight"], n_head), heads(hf["model.layers.0.self_attn.k_proj.weight"], n_kv)
    cos, sin = LlamaRotaryEmbedding(cfg)(x[None], pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    scores_hf = torch.einsum("hsd,htd->hst", q_hf[0], k_hf[0].repeat_interleave(n_head // n_kv, 0))

    def ggml_rope(t):  # ggml_rope_ext, mode 0: rotate (x[2i], x[2i+1]) by pos * theta^(-2i/d)
        i = torch.arange(d // 2, dtype=torch.float64)
        ang = pos[:, None].double() * theta ** (-2 * i / d)
        a, b = t[..., 0::2].double(), t[..., 1::2].double()
        out = torch.empty_like(t, dtype=torch.float64)
        out[..., 0::2], out[..., 1::2] = a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()
        return out

    q_g, k_g = ggml_rope(heads(tensors["blk.0.attn_q.weight"][1], n_head)), ggml_rope(heads(tensors["blk.0.attn_k.weight"][1], n_kv))
    scores_g = torch.einsum("hsd,htd->hst", q_g, k_g.repeat_interleave(n_head // n_kv, 0))
    assert torch.allclose(scores_g.float(), scores_hf, atol=1e-4, rtol=1e-4)
    # and without the permutation the scores differ: the check can fail
    q_raw = ggml_rope(heads(hf["model.layers.0.self_attn.q_proj.weight"], n_head))
    k_raw = ggml_rope(heads(hf["model.layers.0.self_attn.k_proj.weight"], n_kv))
    assert not torch.allclose(torch.einsum("hsd,htd->hst", q_raw, k_raw.repeat_interleave(n_head // n_kv, 0)).float(), scores_hf, atol=1e-3)


def test_other_architectures_are_refused_in_one_paragraph(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainpipe.export_gguf import GGUFUnsupported, write_gguf

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(gpt2)
    with pytest.raises(GGUFUnsupported) as e:
        write_gguf(gpt2)
    msg = e.value.message
    assert "GPT2LMHeadModel" in msg and "convert_hf_to_gguf.py" in msg and str(gpt2) in msg and "\n" not in msg
    assert e.value.exit_code == 2
    assert not list(gpt2.glob("*.gguf*"))  # nothing written


def test_bad_gguf_type_is_a_usage_error(run, capsys):
    assert main(["export", str(run), "--gguf", "q4"]) == 2
    out = capsys.readouterr().out
    assert "q4" in out and "f16" in out and "Traceback" not in out


def test_fresh_tiny_model_folder_converts(tmp_path):
    """The converter on a plain transformers folder (no run): its tensors read back equal (f32)."""
    from trainpipe.export_gguf import expected_tensors, write_gguf

    base = build_tiny_model(tmp_path / "base")
    tensors, fields = _read(write_gguf(base, dtype="f32"))
    exp = expected_tensors(base, "f32")
    assert set(tensors) == set(exp) and all(np.array_equal(tensors[n][1], exp[n]) for n in exp)
    assert fields["general.file_type"] == 0  # ALL_F32


def test_bf16_folder_converts(tmp_path):
    """Weights saved in bfloat16 (a full fine-tune on a GPU) convert; f32 tensors equal the bf16 values exactly."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainpipe.export_gguf import write_gguf

    base = build_tiny_model(tmp_path / "base")
    bf = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(bf)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, bf / f)
    tensors, _ = _read(write_gguf(bf, dtype="f32"))
    w = load_file(str(bf / "model.safetensors"))
    assert w["model.layers.0.self_attn.v_proj.weight"].dtype == torch.bfloat16
    assert np.array_equal(tensors["blk.0.attn_v.weight"][1], w["model.layers.0.self_attn.v_proj.weight"].float().numpy())
    assert np.array_equal(tensors["blk.1.ffn_down.weight"][1], w["model.layers.1.mlp.down_proj.weight"].float().numpy())
