"""The data step on LLaVA-NeXT, mllama and Idefics3 (tiny ones built in the test: tests/vlm_tiny_families.py), images
drawn at three sizes: only the answers carry loss (every image token masked, Idefics3's tile markers too), the image
tokens are counted per image as the processor expands them (LLaVA-NeXT's anyres: more for a larger image) in the
report and in the `max_length` check, and a collated batch of rows with different tile counts runs the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vlm_tiny import write_jsonl  # noqa: E402
from vlm_tiny_families import build_tiny_idefics3, build_tiny_llava_next, build_tiny_mllama, shape_records_sized  # noqa: E402

from trainpipe.config import DataConfig, ModelConfig  # noqa: E402
from trainpipe.data.collate import IGNORE_INDEX, PadCollator  # noqa: E402
from trainpipe.data.prepare import prepare  # noqa: E402
from trainpipe.data.vision_chat import image_token_ids, processor_of  # noqa: E402
from trainpipe.model.loading import load_tokenizer  # noqa: E402

BUILDERS = {"llava_next": build_tiny_llava_next, "mllama": build_tiny_mllama, "idefics3": build_tiny_idefics3}
ANSWERS = ("red<|im_end|>", "green<|im_end|>", "blue<|im_end|>", "yellow<|im_end|>")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    folder = BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "m")
    return request.param, folder, load_tokenizer(ModelConfig(name_or_path=str(folder)))


def _prep(tmp_path, tok, n=10, max_length=128):
    path = write_jsonl(tmp_path / "d.jsonl", shape_records_sized(tmp_path, n))
    cfg = DataConfig(sources=[{"path": str(path)}], eval_split=1, cache_dir=str(tmp_path / "cache"), max_length=max_length)
    data = prepare(cfg, tok, train_on="assistant", seed=0, rejected_path=tmp_path / "rejected.jsonl")
    return data, data.train.to_list()


def test_answers_alone_carry_loss_and_the_image_tokens_are_counted(tmp_path, family):
    name, folder, tok = family
    data, rows = _prep(tmp_path, tok)
    ids = image_token_ids(processor_of(tok))
    train = data.report["splits"]["train"]
    counts = [sum(1 for t in r["input_ids"] if t in ids) for r in rows]
    assert train["images"] == len(rows) == 9 and train["image_tokens"] == sum(counts)
    for r in rows:
        assert all(lab == IGNORE_INDEX for t, lab in zip(r["input_ids"], r["labels"]) if t in ids)
        assert tok.decode([lab for lab in r["labels"] if lab != IGNORE_INDEX]) in ANSWERS
    if name == "mllama":  # cross-attention: one `<|image|>` in the text a picture, its tiles reach the decoder beside it
        assert counts == [1] * 9
    else:  # tiles by the image's size: the 28x28 images take fewer tokens than the 56x28 / 28x56 ones
        assert len(set(counts)) > 1 and min(counts) >= 4

    import torch
    from transformers import AutoModelForImageTextToText

    batch = PadCollator(tok.pad_token_id)(rows[:3])  # one image of each size: tiles per image differ within the batch
    if name == "mllama":
        assert batch["cross_attention_mask"].shape[:2] == batch["input_ids"].shape
        assert int(batch["cross_attention_mask"][batch["attention_mask"] == 0].sum()) == 0  # padding attends to no tile
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert torch.isfinite(model(**batch).loss)


def test_an_example_over_max_length_is_dropped_with_its_images_never_cut(tmp_path, family):
    name, _, tok = family
    data, rows = _prep(tmp_path / "all", tok)
    lengths = sorted(len(r["input_ids"]) for r in rows + list(data.eval))  # every record: the drops count the eval split's too
    if lengths[0] == lengths[-1]:
        pytest.skip(f"{name}: every example has the same length here")
    cut = (lengths[0] + lengths[-1]) // 2
    data, kept = _prep(tmp_path / "cut", tok, max_length=cut)
    assert data.report["dropped"].get("too_long_with_images", 0) == sum(1 for n in lengths if n > cut) > 0
    assert all(len(r["input_ids"]) <= cut for r in kept + list(data.eval))
    assert len(kept) + len(data.eval) == sum(1 for n in lengths if n <= cut)
