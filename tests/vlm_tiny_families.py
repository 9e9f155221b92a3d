"""More tiny vision-language families for the tests, built in code like tests/vlm_tiny.py (no hub, no blobs), each
with a slow (PIL) image processor, so none needs torchvision:

- `build_tiny_llava_next(path)`: LLaVA-NeXT: a 1-layer CLIP tower on 28-pixel tiles, anyres with the grid pinpoints
  28x28, 28x56, 56x28, 56x56: an image takes its base tile plus 1, 2 or 4 tiles, so the image tokens per image vary
  with its size (4 for the base tile, 2x2 per tile unpadded to the image's aspect ratio, plus one newline a row);
- `build_tiny_mllama(path)`: Llama 3.2 Vision: the image is one `<|image|>` token in the text and reaches the
  decoder through cross-attention layers; the tower tiles the image by its aspect ratio (up to 2 tiles of 28 pixels);
- `build_tiny_idefics3(path)`: Idefics3: an image is split into 28-pixel tiles plus a global one, each 1 token after
  the pixel shuffle, wrapped in `<fake_token_around_image>` / `<row_r_col_c>` / `<global-img>` tokens.

`shape_records_sized(folder, n)` draws the shapes of tests/vlm_tiny.py at three sizes (28x28, 56x28, 28x56), so
the families that tile by size see a different number of tiles per image within one batch.
"""

from __future__ import annotations

import random
from pathlib import Path

from vlm_tiny import CHATML, COLOURS, QUESTION, SHAPES, _text_config, build_tokenizer, draw

SIZES = ((28, 28), (56, 28), (28, 56))  # (width, height)


def draw_sized(colour: str, shape: str, seed: int, size: tuple[int, int]):
    """A shape of tests/vlm_tiny.py on a canvas of ``size`` (width, height): the square drawing pasted at a random offset."""
    from PIL import Image

    w, h = size
    img = Image.new("RGB", (w, h), (245, 245, 245))
    rng = random.Random(seed)
    img.paste(draw(colour, shape, seed), (rng.randint(0, w - 28), rng.randint(0, h - 28)))
    return img


def shape_records_sized(folder: str | Path, n: int, seed: int = 0) -> list[dict]:
    """LLaMA-Factory records like tests/vlm_tiny.py's `shape_records`, the images drawn at the sizes of ``SIZES`` in turn."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        name = f"images/{seed}_{i:04d}_{colour}_{shape}.png"
        draw_sized(colour, shape, seed * 100_000 + i, SIZES[i % len(SIZES)]).save(folder / name)
        out.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": colour}],
                    "images": [name]})
    return out


def _clip(hidden: int = 32) -> dict:
    return dict(model_type="clip_vision_model", hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14, projection_dim=32)


def build_tiny_llava_next(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    path = Path(path)
    tok = build_tokenizer()
    pins = [[28, 28], [28, 56], [56, 28], [56, 56]]
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=pins)
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, chat_template=CHATML, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)
    cfg = LlavaNextConfig(text_config=_text_config(len(tok), tok), vision_config=_clip(), image_grid_pinpoints=pins,
                          image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                          vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlavaNextForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def build_tiny_mllama(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    path = Path(path)
    tok = build_tokenizer(extra=("<|image|>", "<|python_tag|>"))
    ip = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    proc = MllamaProcessor(image_processor=ip, tokenizer=tok, chat_template=CHATML.replace("<image>", "<|image|>"))
    text = {**_text_config(len(tok), tok, "mllama_text_model"), "cross_attention_layers": [1]}
    text.pop("model_type")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2, image_size=28,
                  patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0], vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    cfg = MllamaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<|image|>"),
                       pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    MllamaForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path


def build_tiny_idefics3(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = Path(path)
    extra = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
             *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))
    tok = build_tokenizer(extra=extra)
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=1, chat_template=CHATML)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Idefics3Config(text_config=_text_config(len(tok), tok), vision_config=vision, scale_factor=2,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    proc.save_pretrained(path)
    return path
