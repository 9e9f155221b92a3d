"""Tiny vision-language models, processors and image conversations built in code for the tests (no hub, no blobs).

`build_tiny_llava(path)` trains a byte-level BPE tokenizer on the conversations' words, builds a LLaVA with a 1-layer
CLIP vision tower (28x28 images, 14-pixel patches: 4 image tokens) and a 2-layer, 64-wide Llama, and saves both with a
slow (PIL) image processor and a ChatML chat template, so `AutoProcessor` / `AutoModelForImageTextToText` load the
folder. `build_tiny_gemma3(path)` does the same for Gemma 3 (a SigLIP tower, 4 image tokens after pooling).
`shape_records(folder, n)` draws coloured shapes with PIL into `folder/images/` and writes conversations whose answers
are checked exactly: "What colour is the shape?" -> "red".
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("square", "circle")
QUESTION = "What colour is the shape?"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
          "{% for c in m.content %}{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}"
          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def draw(colour: str, shape: str, seed: int, size: int = 28):
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(img)
    r = rng.randint(6, 10)
    cx, cy = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
    box = (cx - r, cy - r, cx + r, cy + r)
    (d.rectangle if shape == "square" else d.ellipse)(box, fill=COLOURS[colour])
    return img


def shape_records(folder: str | Path, n: int, seed: int = 0, layout: str = "llamafactory") -> list[dict]:
    """``n`` conversations about drawn shapes, images saved under ``folder/images``; ``layout``: `llamafactory`
    (`messages` with `<image>` + `images`) or `openai` (an `image_url` content part with a relative path)."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        name = f"images/{seed}_{i:04d}_{colour}_{shape}.png"
        draw(colour, shape, seed * 100_000 + i).save(folder / name)
        if layout == "openai":
            user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": name}}, {"type": "text", "text": QUESTION}]}
            out.append({"messages": [user, {"role": "assistant", "content": colour}]})
        else:
            out.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": colour}],
                        "images": [name]})
    return out


def build_tokenizer(extra: tuple[str, ...] = ("<image>",)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", *extra)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [QUESTION, "user assistant system", *COLOURS, *SHAPES, "What shape is it? How many?"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra])


def _text_config(vocab: int, tok, model_type: str = "llama") -> dict:
    return dict(model_type=model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def build_tiny_llava(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    path = Path(path)
    tok = build_tokenizer()
    proc = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
                          tokenizer=tok, chat_template=CHATML, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1)
    cfg = LlavaConfig(
        text_config=_text_config(len(tok), tok),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, projection_dim=32),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1, vision_feature_select_strategy="default",
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return p


def build_tiny_gemma3(path: str | Path, seed: int = 0) -> Path:
    """A tiny Gemma 3: a 1-layer SigLIP tower on 28x28 images (7-pixel patches, pooled to 4 soft tokens per image), a
    2-layer, 64-wide Gemma 3 text model, Gemma 3's slow (PIL) image processor, its begin/end-of-image tokens."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = Path(path)
    base = build_tokenizer(extra=("<start_of_image>", "<end_of_image>", "<image_soft_token>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>",
                                  extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tok,
                           chat_template=CHATML.replace("<image>", "<start_of_image>"), image_seq_length=4)
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config={**_text_config(len(tok), tok, "gemma3_text"), "head_dim": 16, "sliding_window": 64},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"), pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def shape_pairs(folder: str | Path, n: int, seed: int = 0) -> list[dict]:
    """LLaMA-Factory's DPO layout with images: `conversations` (the question with `<image>`), `chosen` (the colour),
    `rejected` (another colour), `images`."""
    rng = random.Random(seed + 1)
    out = []
    for rec in shape_records(folder, n, seed):
        right = rec["messages"][1]["content"]
        wrong = rng.choice([c for c in sorted(COLOURS) if c != right])
        out.append({"conversations": [{"from": "human", "value": rec["messages"][0]["content"]}], "chosen": {"from": "gpt", "value": right},
                    "rejected": {"from": "gpt", "value": wrong}, "images": rec["images"]})
    return out


# ------------------------------------------------------------------------------ families whose processors need torchvision
# (Qwen2-VL / Qwen2.5-VL, SmolVLM: their processors build a video processor; built and trained in the vision environment,
# scripts/vision_venv.sh, by tests/e2e/test_vision_language_torchvision.py)

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def build_tiny_qwen2vl(path: str | Path, seed: int = 0, version: str = "2") -> Path:
    """A tiny Qwen2-VL (``version`` "2") or Qwen2.5-VL ("2.5"): a 1-layer vision tower (14-pixel patches, 2x2 merged: a
    28x28 image is 1 image token, 56x56 is 4), a 2-layer, 64-wide Qwen2 text model with M-RoPE, Qwen2-VL's slow (PIL) image
    processor with min/max pixels 28*28 .. 56*56 (so the image tokens vary with the image's size), its video processor."""
    import torch
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    if version == "2.5":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model, Qwen2_5_VLProcessor as Processor
    else:
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model, Qwen2VLProcessor as Processor
    path = Path(path)
    base = build_tokenizer(extra=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                                                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    pixels = {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    proc = Processor(image_processor=Qwen2VLImageProcessorPil(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2),
                     video_processor=Qwen2VLVideoProcessor(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2),
                     tokenizer=tok, chat_template=CHATML.replace("<image>", QWEN_IMAGE))
    ids = tok.convert_tokens_to_ids
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if version == "2.5":
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])
    text = {**_text_config(len(tok), tok, "qwen2_vl_text" if version == "2" else "qwen2_5_vl_text"),
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    cfg = Config(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                 vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"), pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Model(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def build_tiny_smolvlm(path: str | Path, seed: int = 0) -> Path:
    """A tiny SmolVLM (Idefics3's architecture): a 1-layer SigLIP-style tower on 28x28 images (7-pixel patches: 16,
    pixel-shuffled by 2 to 4 image tokens), a 2-layer, 64-wide Llama, SmolVLM's slow (PIL) image processor without image
    splitting, its video processor, and its `<fake_token_around_image>` / `<global-img>` / `<end_of_utterance>` tokens."""
    import torch
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    path = Path(path)
    extra = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<video>")
    base = build_tokenizer(extra=extra)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra])
    size = {"longest_edge": 28}
    proc = SmolVLMProcessor(image_processor=SmolVLMImageProcessorPil(size=size, max_image_size=size, do_image_splitting=False),
                            video_processor=SmolVLMVideoProcessor(size=size, max_image_size=size), tokenizer=tok,
                            image_seq_len=4, chat_template=CHATML)
    cfg = SmolVLMConfig(
        text_config=_text_config(len(tok), tok),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    SmolVLMForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def shape_kto(folder: str | Path, n: int, seed: int = 0) -> list[dict]:
    """LLaMA-Factory's KTO layout with images: `messages` (the question with `<image>`, then a colour), a true/false
    `label`, `images`; ``n`` records, two per drawn image: its own colour (true) and another colour (false), as TRL's
    `unpair_preference_dataset` lays out pairs."""
    rng = random.Random(seed + 2)
    out = []
    for rec in shape_records(folder, n // 2, seed):
        right = rec["messages"][1]["content"]
        wrong = rng.choice([c for c in sorted(COLOURS) if c != right])
        for said, good in ((right, True), (wrong, False)):
            out.append({"messages": [dict(rec["messages"][0]), {"role": "assistant", "content": said}], "label": good, "images": list(rec["images"])})
    return out


def mixed_records(folder: str | Path, n: int, seed: int = 0) -> list[dict]:
    """Conversations showing one image, or two (every third record: "<image><image>..." about the first shape), so the
    images, and the image tokens, per micro-batch vary."""
    out = shape_records(folder, n, seed)
    extra = shape_records(Path(folder) / "second", n, seed + 1)
    for i, rec in enumerate(out):
        if i % 3 == 0:
            rec["messages"][0]["content"] = "<image><image>" + QUESTION
            rec["images"] = [*rec["images"], "second/" + extra[i]["images"][0]]
    return out
