"""GGUF export: a llama-architecture model folder (an export's `model/`) as one `.gguf` file for llama.cpp and the
runtimes built on it (Ollama, LM Studio, llama-cpp-python).

llama.cpp's own converter (`convert_hf_to_gguf.py`) is not published on PyPI, so trainpipe writes the file itself
with the `gguf` package (llama.cpp's own Python writer), as that converter does for `LlamaForCausalLM` and
`MistralForCausalLM`: the same tensor names (`gguf.get_tensor_name_map`), the same row permutation of the query and
key projections (llama.cpp's rotary embedding pairs neighbouring dimensions where transformers pairs the two halves),
the same metadata keys, and the tokenizer (a GPT-2-style byte-level BPE, or a SentencePiece/Llama one) with its
merges, special tokens and chat template. Tensors are written as f32, or f16 for the matrices (norms and other 1-D
tensors stay f32, as llama.cpp writes them). Quantized types (Q8_0, Q4_K, ...) are left to llama.cpp's
`llama-quantize`, which reads this file.

Other architectures stop with :class:`GGUFUnsupported` (exit 2) before anything is written. The file is written
to a temporary name and renamed, so a failed write leaves no half file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainpipe.errors import TrainpipeError

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
DTYPES = ("f16", "f32")


class GGUFUnsupported(TrainpipeError):
    """The model cannot be written as GGUF by trainpipe (its architecture or a setting of it)."""

    exit_code = 2
    title = "GGUF export not supported"


def _unsupported(model_dir: Path, what: str) -> GGUFUnsupported:
    return GGUFUnsupported(
        f"{what} trainpipe writes GGUF for llama-architecture models ({', '.join(SUPPORTED)} with default or linear "
        f"RoPE). The merged safetensors export in `{model_dir}` is complete and is what llama.cpp's converter reads: from a "
        f"llama.cpp checkout run `python convert_hf_to_gguf.py {model_dir} --outtype f16` (it covers many more "
        "architectures); then `llama-quantize` for Q8_0/Q4_K_M."
    )


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise GGUFUnsupported(f"`{model_dir}` has no config.json, so it is not a transformers model folder. Pass the `model/` folder of a run "
                              "(`trainpipe export RUN_DIR --gguf f16` exports it first).")
    return json.loads(path.read_text(encoding="utf-8"))


def check_supported(model_dir: Path) -> dict:
    """The model's config.json when trainpipe can write it as GGUF; GGUFUnsupported (one paragraph) otherwise."""
    cfg = read_config(model_dir)
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED for a in archs):
        raise _unsupported(model_dir, f"The model in `{model_dir}` is {', '.join(archs) or cfg.get('model_type', 'of an unknown architecture')}.")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "linear"):
        raise _unsupported(model_dir, f"The model in `{model_dir}` uses `{kind}` RoPE scaling.")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise _unsupported(model_dir, f"The model in `{model_dir}` has attention or MLP biases.")
    return cfg


def permute_qk(w, n_head: int, n_head_kv: int | None = None):
    """llama.cpp's row order for a query/key projection (convert_hf_to_gguf.py's LlamaModel.permute): within each head,
    rows (0, d/2, 1, d/2+1, ...), so that its rotary embedding, which rotates neighbouring pairs, equals transformers'
    rotate_half. ``n_head_kv`` for the key projection under grouped-query attention."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(model_dir: Path, dtype: str = "f16") -> dict:
    """{GGUF tensor name: numpy array as written} from the folder's safetensors (used by write_gguf and by the tests)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file  # torch reads bf16 weights too (numpy has no bfloat16)

    cfg = check_supported(model_dir)
    n_layer, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GGUFUnsupported(f"`{model_dir}` holds no .safetensors weights; export the run first (`trainpipe export RUN_DIR`).")
    out: dict = {}
    for f in files:
        for hf_name, t in load_file(str(f)).items():
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            arr = t.float().numpy()
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise _unsupported(model_dir, f"The tensor `{hf_name}` in `{f.name}` has no GGUF name for the llama architecture.")
            arr = arr.astype(np.float32)
            if hf_name.endswith("q_proj.weight"):
                arr = permute_qk(arr, n_head, n_head)
            elif hf_name.endswith("k_proj.weight"):
                arr = permute_qk(arr, n_head, n_kv)
            if dtype == "f16" and arr.ndim > 1:
                arr = arr.astype(np.float16)
            out[name] = np.ascontiguousarray(arr)
    if cfg.get("tie_word_embeddings") and "output.weight" in out and np.array_equal(out["output.weight"], out["token_embd.weight"]):
        del out["output.weight"]  # tied: llama.cpp uses token_embd for the output when output.weight is absent
    return out


def _add_tokenizer(w, model_dir: Path, n_vocab: int) -> None:
    import gguf

    vocab = None
    for cls in (gguf.vocab.BpeVocab, gguf.vocab.LlamaHfVocab, gguf.vocab.SentencePieceVocab):
        try:
            vocab = cls(model_dir)
            break
        except Exception:  # noqa: BLE001 - not a tokenizer of this kind (each class raises its own error)
            continue
    if vocab is None:
        raise _unsupported(model_dir, f"The tokenizer in `{model_dir}` is neither a byte-level BPE nor a SentencePiece/Llama tokenizer.")
    tokens, scores, types = [], [], []
    for text, score, typ in vocab.all_tokens():
        tokens.append(text if isinstance(text, (bytes, bytearray)) else str(text).encode("utf-8"))
        scores.append(float(score))
        types.append(int(typ))
    for i in range(len(tokens), n_vocab):  # embedding rows beyond the tokenizer (padded vocabularies)
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    is_bpe = isinstance(vocab, gguf.vocab.BpeVocab)
    w.add_tokenizer_model("gpt2" if is_bpe else "llama")
    if is_bpe:
        w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=is_bpe, n_vocab=n_vocab)
    special.add_to_gguf(w, quiet=True)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise GGUFUnsupported(f"GGUF type `{dtype}` is not one trainpipe writes; use `--gguf f16` or `--gguf f32`, then quantize the f16 file "
                              "with llama.cpp's `llama-quantize` (Q8_0, Q4_K_M, ...).")


def write_gguf(model_dir: str | Path, out: str | Path | None = None, *, dtype: str = "f16") -> Path:
    """Write ``model_dir`` (a transformers folder of a llama-architecture model) as GGUF; returns the file's path
    (default ``model_dir/model-<dtype>.gguf``)."""
    import gguf

    model_dir = Path(model_dir)
    check_dtype(dtype)
    cfg = check_supported(model_dir)
    tensors = expected_tensors(model_dir, dtype)
    out = Path(out) if out else model_dir / f"model-{dtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")

    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    n_vocab = int(tensors["token_embd.weight"].shape[0])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(tmp), "llama")
    try:
        w.add_name(model_dir.name)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        w.add_vocab_size(n_vocab)
        w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
        w.add_embedding_length(hidden)
        w.add_block_count(int(cfg["num_hidden_layers"]))
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(cfg.get("num_key_value_heads") or n_head))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(theta))
        if (rope.get("rope_type") or rope.get("type")) == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        _add_tokenizer(w, model_dir, n_vocab)
        for name, arr in tensors.items():
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
