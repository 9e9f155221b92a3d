"""Build the example's base model, `base/`: a tiny ResNet (two basic-block stages of 16 and 32 channels, 22k parameters)
for 16x16 RGB images, randomly initialised from a config with a fixed seed (nothing is downloaded), and its image
processor (resize to 16x16, scale to [0, 1], normalise with mean 0.5 and std 0.5). Its 10-way head is replaced by a
new one sized to the classes trainpipe finds in the data, so before training it scores about chance (10 %).

    python examples/image-classification/make_base.py   # rewrites examples/image-classification/base/
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import ResNetConfig, ResNetForImageClassification, ViTImageProcessor

HERE = Path(__file__).resolve().parent


def build(out: Path = HERE / "base") -> Path:
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                          downsample_in_first_stage=False, num_labels=10)
    ResNetForImageClassification(config).save_pretrained(out, safe_serialization=True)
    ViTImageProcessor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build())
