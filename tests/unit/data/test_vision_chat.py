"""Conversations with images (data/vision_chat.py) through the real data step, on a tiny LLaVA built in the test
(tests/vlm_tiny.py): the two layouts users bring, label masks, the placeholder count rule, bad images counted with
their record, paths kept inside the data folder, bounded decoding, and batches that carry the pixels."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vlm_tiny import QUESTION, build_tiny_llava, shape_records, write_jsonl  # noqa: E402

from trainpipe.config import DataConfig, ModelConfig  # noqa: E402
from trainpipe.data.collate import IGNORE_INDEX, PadCollator  # noqa: E402
from trainpipe.data.prepare import prepare  # noqa: E402
from trainpipe.data.report import inspect_examples, plain_example, summary_lines  # noqa: E402
from trainpipe.errors import DataError  # noqa: E402
from trainpipe.model.loading import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = build_tiny_llava(tmp_path_factory.mktemp("llava") / "m")
    return folder, load_tokenizer(ModelConfig(name_or_path=str(folder)))


def _prep(tmp_path, tok, records, name="d.jsonl", **kw):
    path = write_jsonl(tmp_path / name, records)
    cfg = DataConfig(sources=[{"path": str(path)}], eval_split=kw.pop("eval_split", 1), cache_dir=str(tmp_path / "cache"), max_length=kw.pop("max_length", 64), **kw)
    return prepare(cfg, tok, train_on="assistant", seed=0, rejected_path=tmp_path / "rejected.jsonl")


def _rows(data):
    return data.train.to_list() if hasattr(data.train, "to_list") else list(data.train)


def _png(size=(20, 20), colour=(200, 10, 10), fmt="PNG", **save) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt, **save)
    return buf.getvalue()


def test_llamafactory_layout_masks_all_but_the_answer_and_counts_images(tmp_path, llava):
    _, tok = llava
    data = _prep(tmp_path, tok, shape_records(tmp_path, 12))
    assert data.report["records_kept"] + sum(data.report["dropped"].values()) == 12
    train = data.report["splits"]["train"]
    image_id = tok.convert_tokens_to_ids("<image>")
    rows = _rows(data)
    assert train["images"] == len(rows) and train["image_tokens"] == 4 * len(rows)  # 28x28, 14-pixel patches: 4 tokens each
    for r in rows:
        assert sum(1 for t in r["input_ids"] if t == image_id) == 4
        assert all(lab == IGNORE_INDEX for t, lab in zip(r["input_ids"], r["labels"]) if t == image_id)
        trained = tok.decode([lab for lab in r["labels"] if lab != IGNORE_INDEX])
        assert trained in ("red<|im_end|>", "green<|im_end|>", "blue<|im_end|>", "yellow<|im_end|>")  # the answer and its end of turn
    line = next(x for x in summary_lines(data.report) if x.startswith("split train"))
    assert f"{len(rows)} images, {4 * len(rows)} image tokens" in line
    shown = plain_example(inspect_examples(data, tok, n=1)[0])  # `data inspect`: only the answer between « and »
    assert shown.count("«") == 1 and QUESTION in shown.split("«")[0] and "<image>" in shown.split("«")[0]


def test_openai_content_parts_give_the_same_rows_as_placeholders(tmp_path, llava):
    _, tok = llava
    a = _rows(_prep(tmp_path / "a", tok, shape_records(tmp_path / "a", 6, seed=3)))
    b = _rows(_prep(tmp_path / "b", tok, shape_records(tmp_path / "b", 6, seed=3, layout="openai")))
    assert [(r["input_ids"], r["labels"], r["mm"]) for r in a] == [(r["input_ids"], r["labels"], r["mm"]) for r in b]


def test_batches_carry_the_pixels_and_pad_the_tokens(tmp_path, llava):
    _, tok = llava
    rows = _rows(_prep(tmp_path, tok, shape_records(tmp_path, 6)))[:3]
    rows[1] = {**rows[1], "input_ids": rows[1]["input_ids"][:-2], "labels": rows[1]["labels"][:-2]}
    batch = PadCollator(tok.pad_token_id)(rows)
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert int(batch["attention_mask"][1].sum()) == len(rows[1]["input_ids"])


def test_placeholder_count_error_names_the_record(tmp_path, llava):
    _, tok = llava
    recs = shape_records(tmp_path, 4)
    recs[2]["images"] = recs[2]["images"] * 2  # two images, one `<image>`
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, recs)
    msg = str(e.value)
    assert "d.jsonl" in msg and "line 3" in msg and "1 `<image>` placeholder(s)" in msg and "2 image(s)" in msg and "\n" not in msg


def test_bad_images_are_dropped_and_counted_with_their_record(tmp_path, llava):
    _, tok = llava
    recs = shape_records(tmp_path, 8)
    (tmp_path / "images" / "broken.png").write_bytes(_png(size=(64, 64))[:-30])  # truncated inside its pixel data
    recs[1]["images"] = ["images/broken.png"]
    recs[3]["images"] = ["images/missing.png"]
    recs[5]["images"] = ["data:image/png;base64," + base64.b64encode(b"this is not an image").decode()]
    data = _prep(tmp_path, tok, recs)
    assert data.report["dropped"]["bad_image"] == 3 and data.report["records_read"] == 8
    rejected = {r["line"]: r["reason"] for r in map(json.loads, (tmp_path / "rejected.jsonl").read_text().splitlines())}
    assert set(rejected) == {2, 4, 6}
    assert "corrupt" in rejected[2] and "cannot be read" in rejected[4] and "not an image" in rejected[6]


def test_image_paths_stay_inside_the_data_folder(tmp_path, llava):
    _, tok = llava
    inner = tmp_path / "data"
    recs = shape_records(inner, 4)
    (tmp_path / "secret.png").write_bytes(_png())
    recs[0]["images"] = ["../secret.png"]
    with pytest.raises(DataError) as e:
        _prep(inner, tok, recs)
    msg = str(e.value)
    assert "line 1" in msg and "../secret.png" in msg and "outside the data file's folder" in msg and "\n" not in msg


def test_a_bomb_and_a_long_gif_are_bounded(tmp_path, llava):
    _, tok = llava
    from PIL import Image

    recs = shape_records(tmp_path, 6)
    big = Image.new("1", (30000, 30000))  # 1-bit: 110 MB in memory here, a few hundred kB as PNG; refused from its header
    big.save(tmp_path / "images" / "bomb.png", optimize=False)
    del big
    frames = [Image.new("P", (1, 1), i % 2) for i in range(10_000)]
    frames[0].save(tmp_path / "images" / "long.gif", save_all=True, append_images=frames[1:], optimize=False, disposal=0)
    recs[0]["images"] = ["images/bomb.png"]
    recs[1]["images"] = ["images/long.gif"]  # its first frame is the image, the rest never decoded
    data = _prep(tmp_path, tok, recs)
    assert data.report["dropped"] == {"bad_image": 1}
    reason = json.loads((tmp_path / "rejected.jsonl").read_text().splitlines()[0])["reason"]
    assert "30000x30000" in reason or "decompression bomb" in reason
    assert data.report["records_kept"] == 5


def test_the_same_text_about_another_image_is_no_duplicate_but_the_same_image_is(tmp_path, llava):
    _, tok = llava
    recs = shape_records(tmp_path, 6)
    recs.append(dict(recs[0]))  # the same image and text: an exact duplicate
    data = _prep(tmp_path, tok, recs)
    assert data.report["dropped"] == {"exact_duplicate": 1} and data.report["records_kept"] == 6


def test_images_for_a_text_model_are_refused_in_one_paragraph(tmp_path):
    from tiny import build_tiny_model

    tok = load_tokenizer(ModelConfig(name_or_path=str(build_tiny_model(tmp_path / "text"))))
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, shape_records(tmp_path, 3))
    assert "no image processor" in str(e.value) and "vision-language" in str(e.value) and "\n" not in str(e.value)


def test_a_processor_that_needs_torchvision_says_so(tmp_path):
    pytest.importorskip("PIL")
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - the environment this test is about: torchvision missing or broken beside torch
        pass
    else:
        pytest.skip("torchvision imports here")
    from vlm_tiny import build_tokenizer

    from trainpipe.errors import ModelLoadError
    from trainpipe.model.vision import attach_processor

    tok = build_tokenizer(extra=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    tok.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}))
    with pytest.raises(ModelLoadError) as e:
        attach_processor(tok, tmp_path)
    assert "video processor, which needs torchvision" in str(e.value) and "LLaVA" in str(e.value)


def test_parquet_image_bytes_and_several_images_over_several_turns(tmp_path, llava):
    _, tok = llava
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue = _png(size=(28, 28), colour=(220, 30, 30)), _png(size=(28, 28), colour=(30, 60, 220))
    rows = []
    for i in range(6):
        convo = [{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": "red"},
                 {"role": "user", "content": "And this one?<image>"}, {"role": "assistant", "content": "blue"}]
        rows.append({"messages": json.dumps(convo), "images": [{"bytes": red, "path": None}, {"bytes": blue, "path": f"{i}.png"}]})
    table = pa.table({"messages": [json.loads(r["messages"]) for r in rows], "images": [r["images"] for r in rows]})
    pq.write_table(table, tmp_path / "d.parquet")
    cfg = DataConfig(sources=[{"path": str(tmp_path / "d.parquet")}], eval_split=1, cache_dir=str(tmp_path / "cache"), max_length=96,
                     dedup={"exact": False, "near": False})
    data = prepare(cfg, tok, train_on="assistant", seed=0)
    assert data.report["records_kept"] == 6 and data.report["splits"]["train"]["images"] == 2 * 5
    image_id = tok.convert_tokens_to_ids("<image>")
    for r in _rows(data):
        assert sum(1 for t in r["input_ids"] if t == image_id) == 8  # two images, 4 tokens each
        trained = tok.decode([lab for lab in r["labels"] if lab != IGNORE_INDEX])
        assert trained == "red<|im_end|>blue<|im_end|>"  # both answers with their end of turn, nothing else
    batch = PadCollator(tok.pad_token_id)(_rows(data)[:2])
    assert tuple(batch["pixel_values"].shape) == (4, 3, 28, 28)


def test_kto_records_with_images_keep_them_in_the_prompt(tmp_path, llava):
    from vlm_tiny import shape_kto

    _, tok = llava
    data = _prep(tmp_path, tok, shape_kto(tmp_path, 8), eval_split=2)
    rows = _rows(data)
    assert data.report["records_kept"] == 8 and data.report["splits"]["train"]["images"] == len(rows) == 6
    image_id = tok.convert_tokens_to_ids("<image>")
    for r in rows:
        assert sum(1 for t in r["prompt_input_ids"] if t == image_id) == 4 and image_id not in r["completion_input_ids"]
        assert tok.decode(r["completion_input_ids"]).split("<|im_end|>")[0] in ("red", "green", "blue", "yellow")
    assert sorted({bool(r["label"]) for r in rows}) == [False, True]
    from trainpipe.config.method import PreferenceConfig
    from trainpipe.train.preference import KTOObjective

    batch = KTOObjective(PreferenceConfig(), None, tok.pad_token_id).collate(rows[:3])
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28) and batch["kl_input_ids"].shape[0] == 3


def test_kto_records_whose_placeholders_do_not_match_their_images_are_one_paragraph(tmp_path, llava):
    from vlm_tiny import shape_kto

    _, tok = llava
    recs = shape_kto(tmp_path, 4)
    recs[1]["messages"][0]["content"] = "<image><image>" + QUESTION  # two placeholders, one image
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, recs)
    msg = str(e.value)
    assert "d.jsonl" in msg and "line 2" in msg and "2 `<image>` placeholder(s)" in msg and "1 image(s)" in msg and "\n" not in msg
    recs = shape_kto(tmp_path, 4)
    recs[0]["messages"] = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<image>red"}]  # the image in the judged reply
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, recs)
    assert "judged completion" in str(e.value) and "\n" not in str(e.value)


def _packing(tmp_path, folder, asked):
    from trainpipe.config.load import build_config
    from trainpipe.plan.attention import resolve_attention
    from trainpipe.plan.hardware import Hardware

    cfg = build_config({"model": {"name_or_path": str(folder)}, "data": {"sources": [{"path": "d.jsonl"}], "packing": asked}}, base_dir=tmp_path)
    decisions: list = []
    resolve_attention(cfg, Hardware("cpu", 0, (), False, 0, ""), decisions)
    return cfg.data.packing, next((d for d in decisions if d.key == "data.packing"), None)


def test_llava_rows_flatten_padding_free_and_gemma3_rows_are_padded_and_said_so(tmp_path, llava):
    from vlm_tiny import build_tiny_gemma3

    folder, tok = llava
    data = _prep(tmp_path / "l", tok, shape_records(tmp_path / "l", 12), packing="padding_free")
    assert data.report["batching"]["mode"] == "padding_free" and data.report["batching"]["non_pad_share"] == 1.0
    rows = _rows(data)[:3]
    batch = PadCollator(tok.pad_token_id)(rows)  # one row, positions restarting per example, the images in order
    assert batch["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "attention_mask" not in batch
    assert batch["position_ids"][0].tolist() == [p for r in rows for p in range(len(r["input_ids"]))] and batch["use_cache"] is False
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28)
    assert _packing(tmp_path, folder, "auto")[0] == "padding_free"

    gemma = build_tiny_gemma3(tmp_path / "g")
    gtok = load_tokenizer(ModelConfig(name_or_path=str(gemma)))
    data = _prep(tmp_path / "g", gtok, shape_records(tmp_path / "g", 12), packing="padding_free")
    batching = data.report["batching"]
    assert batching["mode"] == "padded (vision-language rows)" and batching["basis"].startswith("dynamic padding")
    assert 0 < batching["non_pad_share"] <= 1 and all("padding_free" not in r for r in _rows(data))
    batch = PadCollator(gtok.pad_token_id)(_rows(data)[:2])
    assert batch["input_ids"].shape[0] == 2 and "position_ids" not in batch  # padded rows, one per example
    for asked in ("auto", "padding_free"):  # the plan: padded, with the rule, whether auto chose or padding_free was asked
        value, decision = _packing(tmp_path, gemma, asked)
        assert value == "none" and "padded (vision-language rows)" in decision.rule


def test_report_thumbnails_are_small_jpegs_without_the_images_metadata():
    from PIL import Image, PngImagePlugin

    from trainpipe.data.vision_chat import thumbnails

    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "path=/home/alice/secret-images token=s3cr3t-Tok3n")  # metadata a user's image may carry
    buf = io.BytesIO()
    Image.new("RGB", (640, 320), (10, 200, 30)).save(buf, format="PNG", pnginfo=info)
    assert b"s3cr3t-Tok3n" in buf.getvalue()
    b64 = base64.b64encode(buf.getvalue()).decode()
    out = thumbnails([b64, b64, b64])
    assert len(out) == 2 and all(u.startswith("data:image/jpeg;base64,") for u in out)  # at most two a sample
    raw = base64.b64decode(out[0].split(",", 1)[1])
    with Image.open(io.BytesIO(raw)) as im:
        assert im.format == "JPEG" and im.size == (96, 48)  # at most 96 px a side, the aspect kept
    assert len(raw) < 4_000 and b"s3cr3t" not in raw and b"alice" not in raw  # re-encoded pixels only
