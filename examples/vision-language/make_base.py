"""Build the example's base model, `base/`: a tiny LLaVA (a 1-layer CLIP vision tower on 28x28 images with 14-pixel
patches, so 4 image tokens per image; a 2-layer projector; a 2-layer, 64-wide Llama), randomly initialised from a
config with a fixed seed (nothing is downloaded), with a byte-level BPE tokenizer trained here on the example's words,
LLaVA's slow (PIL) image processor and a ChatML chat template. `AutoModelForImageTextToText` and `AutoProcessor` load
the folder. Before training it answers nothing useful (exact match 0 %).

    python examples/vision-language/make_base.py     # rewrites examples/vision-language/base/
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from make_data import COLOURS, QUESTION, SHAPES

HERE = Path(__file__).resolve().parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
          "{% for c in m.content %}{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}"
          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    special = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<image>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [QUESTION, "user assistant system", *COLOURS, *SHAPES, "What shape is it? How many?"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>",
                                   additional_special_tokens=special[2:])


def build(out: Path = HERE / "base") -> Path:
    tok = tokenizer()
    proc = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
                          tokenizer=tok, chat_template=CHATML, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    proc.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build())
