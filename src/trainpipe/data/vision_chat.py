"""Images in conversations (vision-language fine-tuning): reading image references, decoding them once at prepare time,
rendering with the model's processor, label masks and batches.

Record layouts read (told apart by :mod:`trainpipe.data.formats`' detection, no `format:` needed):

- LLaMA-Factory's multimodal demo: `messages` (or ShareGPT `conversations`) whose texts hold `<image>` placeholders,
  plus an `images` list (paths relative to the data file, `data:` URLs, or `{"bytes", "path"}` structs as a Parquet
  image column holds them); the placeholders are matched to the images in order;
- OpenAI / HF content parts: `{"type": "image_url", "image_url": {"url": ...}}`, `{"type": "image", "path"|"url"|
  "base64"|"image": ...}`, lifted into `<image>` placeholders in the order they appear.

Every image is decoded in full when the data is prepared (:func:`attach`), never mid-epoch: a missing or unreadable one
drops its record, counted as ``bad_image`` with the file and record number in rejected.jsonl; a path that leaves the
data file's folder (``..``, an absolute path, a symlink out) is refused (``image_outside_data``); a decompression bomb
is refused from its header. The example keeps each image re-encoded as a PNG of its first frame (bounded) and the
SHA-256 of the original bytes, which dedup and decontamination hash with the text (``formats.strings``).

At tokenize time (:func:`encode`) the processor's own chat template and image processor make the tokens (the image
tokens expanded as the model expects them) and the pixel tensors; labels are kept only on the assistant turns
(``train_on``), image tokens never carry loss, and an example longer than ``max_length`` is dropped
(``too_long_with_images``), never cut through an image's tokens. The tensors travel in the row as one safetensors blob
(``mm``), so one Arrow schema holds every model family; :func:`collate` pads the tokens and concatenates the images.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

from trainpipe.data.formats import FormatError
from trainpipe.data.images import MAX_IMAGE_BYTES, check_image
from trainpipe.data.packing import IGNORE_INDEX, pack_rows
from trainpipe.errors import DataError

IMAGE = "<image>"
IMAGE_PART_TYPES = ("image", "image_url", "input_image")
PROCESSOR_ATTR = "_trainpipe_processor"  # where model/vision.py attaches a model's processor to its tokenizer
PER_TOKEN = "tok:"  # a processor output with one value per token (Gemma 3's token_type_ids, mllama's cross_attention_mask)
PER_EXAMPLE = "ex:"  # a processor output with a row per example (mllama's and Idefics3's images): stacked, not concatenated
# the processors whose image tensors have a row per example (images, then tiles, inside it) rather than one per image
PER_EXAMPLE_PROCESSORS = ("MllamaProcessor", "Idefics3Processor", "Idefics2Processor", "SmolVLMProcessor")
# The families whose rows may be flattened padding-free (`data.packing: padding_free`), by `model_type` -> processor class:
# the forward scatters the image features at their placeholders in order and the language model reads position ids
# restarting per example as sequence boundaries. Measured equal to padded rows (tests/e2e/test_vision_language_dist.py);
# a family not listed is padded (Gemma 3 builds its own bidirectional mask over the image tokens from token_type_ids).
FLATTENS = {"llava": "LlavaProcessor"}


class ImageError(FormatError):
    """An image that cannot be used: the record is dropped and counted (``bad_image``)."""

    def __init__(self, message: str):
        super().__init__(message, kind="bad_image")


def processor_of(tokenizer):
    """The processor model/vision.py attached to ``tokenizer`` (a vision-language model's), or None."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def fingerprint(tokenizer) -> str | None:
    """What of the processor decides the rows (image settings, chat template), for the cache key; None without one."""
    proc = processor_of(tokenizer)
    if proc is None:
        return None
    ip = getattr(proc, "image_processor", None)
    text = (ip.to_json_string() if ip is not None else "") + (getattr(proc, "chat_template", None) or "") + type(proc).__name__
    return hashlib.sha256(text.encode()).hexdigest()


IMAGE_SETTINGS = ("size", "crop_size", "min_pixels", "max_pixels", "patch_size", "merge_size", "image_mean", "image_std", "do_pan_and_scan")


def image_settings(proc) -> dict:
    """What the model card says of a processor's image handling: its classes and resolution settings, image tokens."""
    ip = getattr(proc, "image_processor", None)
    out = {"processor": type(proc).__name__, "image_processor": type(ip).__name__ if ip is not None else None}
    for k in IMAGE_SETTINGS:
        v = getattr(ip, k, None)
        if hasattr(v, "__dataclass_fields__") or isinstance(v, dict):  # transformers' SizeDict: the fields set
            v = {f: x for f, x in (v.items() if isinstance(v, dict) else vars(v).items()) if x is not None}
        if v is not None:
            out[k] = list(v) if isinstance(v, tuple) else v
    for k in ("image_token", "image_seq_length", "num_additional_image_tokens", "vision_feature_select_strategy"):
        if getattr(proc, k, None) is not None:
            out[k] = getattr(proc, k)
    return out


# ------------------------------------------------------------------------------ reading: records -> examples with images


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _part_ref(part: dict):
    for key in ("image_url", "image", "path", "url", "base64", "bytes"):
        if part.get(key) is not None:
            ref = part[key]
            return ref.get("url", ref) if isinstance(ref, dict) and key == "image_url" else ref
    raise FormatError(f"an `{part.get('type')}` content part without `image_url`, `image`, `path`, `url` or `base64`")


def lift(record: dict) -> tuple[dict, list]:
    """(the record with every image content part replaced by an `<image>` text part, the image references in order:
    the parts' own, else the record's `images` list)."""
    refs: list = []
    out = dict(record)
    for field in ("messages", "conversations"):
        turns = record.get(field)
        if not isinstance(turns, list):
            continue
        new_turns = []
        for t in turns:
            key = "content" if isinstance(t, dict) and "content" in t else "value"
            parts = t.get(key) if isinstance(t, dict) else None
            if isinstance(parts, list) and any(_is_image_part(p) for p in parts):
                new = []
                for p in parts:
                    if _is_image_part(p):
                        refs.append(_part_ref(p))
                        new.append({"type": "text", "text": IMAGE})
                    else:
                        new.append(p)
                t = {**t, key: new}
            new_turns.append(t)
        out[field] = new_turns
    images = record.get("images", record.get("image"))
    if images is not None and not isinstance(images, list):
        images = [images]
    if refs and images:
        raise FormatError("has both image content parts and an `images` list; give the images one way (content parts, or "
                          "`<image>` placeholders with an `images` list)")
    return out, refs or list(images or [])


def has_images(record: dict) -> bool:
    if record.get("images") or (record.get("image") is not None and ("messages" in record or "conversations" in record)):
        return True
    for field in ("messages", "conversations"):
        for t in record.get(field) or []:
            parts = t.get("content", t.get("value")) if isinstance(t, dict) else None
            if isinstance(parts, list) and any(_is_image_part(p) for p in parts):
                return True
    return False


def placeholders(ex: dict) -> int:
    return sum(m["content"].count(IMAGE) for k in ("messages", "prompt", "chosen", "rejected", "completion") for m in ex.get(k) or [])


def _raw(ref, base: Path | None) -> bytes:
    """The bytes of one image reference; FormatError when it points outside the data folder, ImageError when unreadable."""
    if isinstance(ref, dict):  # a Parquet/`datasets` image struct {"bytes", "path"}, or {"path"|"url"|"base64": ...}
        if ref.get("bytes") is not None:
            return _raw(ref["bytes"], base)
        for key in ("base64", "path", "url"):
            if ref.get(key) is not None:
                return _raw(("data:;base64," + ref[key]) if key == "base64" and not str(ref[key]).startswith("data:") else ref[key], base)
        raise ImageError(f"an image entry with none of `bytes`, `path`, `url`, `base64` (keys: {sorted(ref)})")
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"an image reference must be a path, a data: URL or bytes, got {type(ref).__name__}")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        try:
            return base64.b64decode(payload, validate=True) if head.endswith(";base64") else payload.encode()
        except (binascii.Error, ValueError):
            raise ImageError(f"the data: URL `{ref[:40]}...` is not valid base64") from None
    if ref.startswith(("http://", "https://")):
        raise ImageError(f"`{ref[:80]}` is a web address; trainpipe does not download images while preparing data: "
                         "download them next to the data file and give relative paths")
    if base is None:
        raise ImageError(f"the image path `{ref[:80]}` comes from a source that is not a local file, so it has no folder to be "
                         "relative to; give the image bytes (a Parquet image column) or data: URLs")
    root = base.resolve()
    p = (root / ref).resolve()
    if p != root and root not in p.parents:
        raise FormatError(
            f"names the image `{ref[:120]}`, which resolves to `{p}`, outside the data file's folder `{root}`; images are read only "
            "from the data file's folder and below (no `..`, no absolute paths elsewhere, no symlinks out): move the images there",
            kind="image_outside_data",
        )
    try:
        size = p.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageError(f"the image `{ref[:120]}` is {size:,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit for one image")
        return p.read_bytes()
    except OSError as exc:
        raise ImageError(f"the image `{ref[:120]}` cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None


def _png(data: bytes) -> bytes:
    """The first frame of checked image bytes as an RGB PNG (what the processor will decode)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.seek(0)
        buf = io.BytesIO()
        im.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def attach(ex: dict, refs: list, source: str | None) -> dict:
    """``ex`` with its images: each reference read (relative to the folder of the data file ``source``), checked in full
    and kept as a PNG (base64) with the SHA-256 of the original bytes. The `<image>` placeholders must match in number."""
    n = placeholders(ex)
    if n != len(refs):
        raise FormatError(
            f"has {n} `{IMAGE}` placeholder(s) in its turns but {len(refs)} image(s); each image is shown where one `{IMAGE}` stands, "
            f"in order (LLaMA-Factory's rule): add or remove placeholders or images so that the counts agree"
        )
    base = Path(source).parent if source and Path(source).is_file() else None
    pngs, shas = [], []
    for k, ref in enumerate(refs):
        data = _raw(ref, base)
        size, _kind, reason = check_image(data)
        if size is None:
            raise ImageError(f"image {k + 1} of {len(refs)} is unusable: {reason}")
        pngs.append(base64.b64encode(_png(data)).decode())
        shas.append(hashlib.sha256(data).hexdigest())
    return {**ex, "images": pngs, "image_sha256": shas}


def decode(ex: dict) -> list:
    from PIL import Image

    out = []
    for b in ex.get("images") or []:
        with Image.open(io.BytesIO(base64.b64decode(b))) as im:
            out.append(im.convert("RGB"))
    return out


THUMB_SIDE, THUMB_QUALITY, THUMBS_PER_SAMPLE = 96, 70, 2  # the report's thumbnails: at most 96 px a side, JPEG, 2 a sample


def thumbnails(images: list[str], side: int = THUMB_SIDE, limit: int = THUMBS_PER_SAMPLE) -> list[str]:
    """Small JPEG `data:` URIs of the first ``limit`` images (base64 PNGs, as :func:`attach` keeps them), at most ``side``
    pixels a side (a few KB each): what the run's report shows beside a sample's answers. Nothing of the image's
    origin (path, name, metadata) is kept: the pixels are re-encoded from the decoded frame."""
    from PIL import Image

    out = []
    for b in list(images or [])[:limit]:
        with Image.open(io.BytesIO(base64.b64decode(b))) as im:
            small = im.convert("RGB")
            small.thumbnail((side, side))
            buf = io.BytesIO()
            small.save(buf, format="JPEG", quality=THUMB_QUALITY)
        out.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


# ------------------------------------------------------------------------------ tokenizing with the processor


def _parts(messages: list[dict]) -> list[dict]:
    """Messages with `<image>` placeholders as processor content parts (`{"type": "image"}` where each stood)."""
    out = []
    for m in messages:
        pieces = m["content"].split(IMAGE)
        parts: list[dict] = []
        for j, text in enumerate(pieces):
            if j:
                parts.append({"type": "image"})
            if text.strip():
                parts.append({"type": "text", "text": text.strip("\n") if j or len(pieces) > 1 else text})
        out.append({"role": m["role"], "content": parts or [{"type": "text", "text": ""}]})
    return out


def _render(proc, messages: list[dict], gen: bool) -> str:
    if not getattr(proc, "chat_template", None):
        raise DataError(f"The processor ({type(proc).__name__}) has no chat template, so conversations with images cannot be "
                        "rendered; save one with the processor (`processor.chat_template = ...; processor.save_pretrained(folder)`).")
    return proc.apply_chat_template(_parts(messages), tokenize=False, add_generation_prompt=gen)


def _call(proc, text: str, images: list) -> dict:
    return proc(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)


def image_token_ids(proc) -> set[int]:
    """The ids of the tokens that stand for images: the processor's image token, and the tokenizer's image, begin- and
    end-of-image tokens where it names them (Gemma 3: `<start_of_image>`, the soft tokens, `<end_of_image>`), and the
    tile markers Idefics3-style processors wrap the image tokens in (`<fake_token_around_image>`, `<global-img>`,
    `<row_r_col_c>`). mllama's one `<|image|>` a picture is its image token (the pixels reach the decoder through
    cross-attention, not through tokens)."""
    tok = proc.tokenizer
    ids = {getattr(proc, "image_token_id", None), getattr(proc, "fake_image_token_id", None), getattr(proc, "global_image_token_id", None),
           *(getattr(proc, "row_col_ids", None) or [])}
    for owner, attr in ((proc, "image_token"), (tok, "image_token"), (tok, "boi_token"), (tok, "eoi_token")):
        name = getattr(owner, attr, None)
        if isinstance(name, str) and name:
            ids.add(tok.convert_tokens_to_ids(name))
    return {i for i in ids if isinstance(i, int) and i != getattr(tok, "unk_token_id", None)}


def generation(proc, ex: dict) -> dict:
    """The eval split's generation prompt of a conversation (its last assistant turn's): the processor's rendering up to
    the generation prompt, the reference reply, and the images shown before it (base64 PNGs)."""
    msgs = ex["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    shown = sum(m["content"].count(IMAGE) for m in msgs[:last])
    return {"prompt": _render(proc, msgs[:last], True), "reference": msgs[last]["content"], "images": list(ex.get("images") or [])[:shown]}


def prompt_batch(proc, prompts: list[str], images: list[list[str]]):
    """A left-padded generation batch of rendered prompts with their images (base64 PNGs, in order), for `generate`."""
    nested = [decode({"images": ims}) for ims in images]  # one list per prompt (Gemma 3 counts them per sample)
    return proc(text=prompts, images=nested if any(nested) else None, return_tensors="pt", padding=True, add_special_tokens=False)


def encode(proc, ex: dict, *, train_on: str, max_length: int, min_tokens: int) -> tuple[dict | None, str | None]:
    """(the row of one conversation with images, or None and the drop reason)."""
    import torch
    msgs, images = ex["messages"], decode(ex)
    out = _call(proc, _render(proc, msgs, False), images)
    ids = out["input_ids"][0].tolist()
    if len(ids) > max_length:
        return None, "too_long_with_images" if images else "too_long"
    labels = [IGNORE_INDEX] * len(ids)
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        turns = turns[-1:]
    spans = [(0, len(ids))] if train_on == "all" else []
    for k in turns if train_on != "all" else []:
        before = sum(m["content"].count(IMAGE) for m in msgs[:k])
        upto = before + msgs[k]["content"].count(IMAGE)
        start = len(_call(proc, _render(proc, msgs[:k], True), images[:before])["input_ids"][0])
        # the reply through its end-of-turn token; the whitespace a template writes after it carries no loss (as for text)
        end = len(_call(proc, _render(proc, msgs[: k + 1], False).rstrip(), images[:upto])["input_ids"][0])
        spans.append((start, min(end, len(ids))))
    for a, b in spans:
        labels[a:b] = ids[a:b]
    image_ids = image_token_ids(proc)
    n_image_tokens = sum(1 for t in ids if t in image_ids)
    labels = [IGNORE_INDEX if t in image_ids else x for t, x in zip(ids, labels)]  # an image token never carries loss
    if sum(1 for x in labels if x != IGNORE_INDEX) < max(1, min_tokens):
        return None, "no_loss_tokens"
    return {"input_ids": ids, "labels": labels, "mm": _extras(out, proc), "n_images": len(images), "image_tokens": n_image_tokens}, None


def _extras(out: dict, proc) -> bytes:
    """The processor's tensors besides the tokens, as one safetensors blob: per-token ones (their first two dimensions
    the tokens') marked with ``PER_TOKEN``, per-example ones (``PER_EXAMPLE_PROCESSORS``) with ``PER_EXAMPLE``, both
    without their batch dimension of one; per-image ones as they are."""
    import torch
    from safetensors.torch import save

    per_example = type(proc).__name__ in PER_EXAMPLE_PROCESSORS
    tensors = {}
    for k, v in out.items():
        if k in ("input_ids", "attention_mask") or not isinstance(v, torch.Tensor):
            continue
        if v.dim() >= 2 and v.shape[:2] == out["input_ids"].shape:
            tensors[PER_TOKEN + k] = v[0].contiguous()
        elif per_example and v.dim() >= 2 and v.shape[0] == 1:
            tensors[PER_EXAMPLE + k] = v[0].contiguous()
        else:
            tensors[k] = v.contiguous()
    return save(tensors)


def encode_pair(proc, ex: dict, *, max_length: int, min_tokens: int) -> tuple[dict | None, str | None]:
    """(the row of one preference pair (or KTO example) whose prompt shows images, or None and the drop reason): the prompt
    rendered with its generation prompt and images, each reply the tokens its full conversation adds after the prompt."""
    keys = ("chosen", "rejected") if ex["kind"] == "preference" else ("completion",)
    if any(IMAGE in m["content"] for k in keys for m in ex[k]):
        where = "a chosen or rejected reply" if ex["kind"] == "preference" else "the judged completion (the last assistant turn)"
        layout = ("LLaMA-Factory's DPO layout: `conversations` + `chosen` + `rejected` + `images`" if ex["kind"] == "preference" else
                  "LLaMA-Factory's KTO layout: `messages` with `<image>` in a user turn + `label` + `images`")
        raise DataError(f"An image placeholder stands in {where}; images belong to the prompt, which the replies are judged against "
                        f"({layout}).")
    images = decode(ex)
    out = _call(proc, _render(proc, ex["prompt"], True), images)
    prompt = out["input_ids"][0].tolist()
    replies = []
    for key in keys:
        full = _call(proc, _render(proc, ex["prompt"] + ex[key], False).rstrip(), images)["input_ids"][0].tolist()
        if full[: len(prompt)] != prompt:
            return None, "template_not_prefix"
        replies.append(full[len(prompt):])
    if len(prompt) + max(len(r) for r in replies) > max_length:
        return None, "too_long_with_images" if images else "too_long"
    if min(len(r) for r in replies) < max(1, min_tokens):
        return None, "too_short"
    image_ids = image_token_ids(proc)
    row = ({"prompt_input_ids": prompt, "chosen_input_ids": replies[0], "rejected_input_ids": replies[1]} if ex["kind"] == "preference"
           else {"prompt_input_ids": prompt, "completion_input_ids": replies[0], "label": ex["label"]})
    return {**row, "mm": _extras(out, proc), "n_images": len(images), "image_tokens": sum(1 for t in prompt if t in image_ids)}, None


# ------------------------------------------------------------------------------ batches


def _grow(t, trail: list[int]):
    """``t`` zero-padded in every dimension but the first to ``trail``."""
    import torch

    if list(t.shape[1:]) == trail:
        return t
    out = torch.zeros((t.shape[0], *trail), dtype=t.dtype)
    out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
    return out


def _pad_stack(tensors: list, lead: int | None = None):
    """``tensors`` (None for a row without the key) stacked, every dimension zero-padded to the largest (the first to
    ``lead`` when given): per-token extras to the batch width, per-example images to the most images (or tiles) in a
    row. A zero image is what the families pad with (mllama masks it out of cross-attention, Idefics3 drops all-zero
    images, LLaVA-NeXT cuts each image's tiles by `image_sizes`)."""
    import torch

    have = [t for t in tensors if t is not None]
    shape = [max(t.shape[d] for t in have) for d in range(have[0].dim())]
    if lead is not None:
        shape[0] = lead
    out = torch.zeros((len(tensors), *shape), dtype=have[0].dtype)
    for i, t in enumerate(tensors):
        if t is not None:
            out[(i, *(slice(0, n) for n in t.shape))] = t
    return out


def _lay_out(rows: list[dict], width: int) -> dict:
    """The image tensors of ``rows`` (each a loaded ``mm`` blob) as one batch of ``len(rows)`` rows of ``width`` tokens:
    per-token extras (``tok:``) padded to the width, per-example ones (``ex:``: mllama, Idefics3) stacked with the
    images padded to the most in a row, per-image ones concatenated over the batch's images in order with their
    trailing dimensions padded (LLaVA-NeXT's tiles per image vary with the image's size)."""
    import torch

    keys = list(dict.fromkeys(k for r in rows for k in r))
    out: dict = {}
    for k in keys:
        if k.startswith(PER_TOKEN):
            out[k[len(PER_TOKEN):]] = _pad_stack([r.get(k) for r in rows], lead=width)
        elif k.startswith(PER_EXAMPLE):
            out[k[len(PER_EXAMPLE):]] = _pad_stack([r.get(k) for r in rows])
        else:
            parts = [r[k] for r in rows if k in r]
            trail = [max(t.shape[d] for t in parts) for d in range(1, parts[0].dim())]
            out[k] = torch.cat([_grow(t, trail) for t in parts], dim=0)  # LLaVA-NeXT: tiles per image vary with its size
    return out


def pair_tensors(examples: list[dict], width: int, copies: int = 2) -> dict:
    """The image tensors of a pair batch laid out as train/preference.py's `collate_pairs` lays out the rows (every
    prompt + chosen, then every prompt + rejected): each pair's images twice, per-token extras padded to ``width``.
    ``copies=1``: a KTO batch (one row per example; its mismatched KL rows keep each prompt, so the same images)."""
    from safetensors.torch import load

    return _lay_out([load(ex["mm"]) for ex in examples] * copies, width)


def flattens(proc) -> bool:
    """Whether rows of this processor's family may be flattened padding-free (:data:`FLATTENS`)."""
    return proc is not None and type(proc).__name__ in FLATTENS.values()


def _flat(batch: list[dict]) -> dict:
    """Padding-free: the batch's rows concatenated into one (position ids restarting per example, the first label of
    each masked, no attention mask, no cache), the image tensors concatenated in the same order."""
    import torch
    from safetensors.torch import load

    row = pack_rows(batch)
    out: dict = {k: torch.tensor([v], dtype=torch.long) for k, v in row.items()}
    extras: dict[str, list] = {}
    per_token: dict[str, list] = {}
    for x in batch:
        for k, v in load(x["mm"]).items():
            if k.startswith(PER_TOKEN):
                per_token.setdefault(k[len(PER_TOKEN):], []).append(v)
            else:
                extras.setdefault(k, []).append(v)
    out.update({k: torch.cat(v, dim=0)[None] for k, v in per_token.items()})
    out.update({k: torch.cat(v, dim=0) for k, v in extras.items()})
    return {**out, "use_cache": False}


def collate(batch: list[dict], pad_id: int) -> dict:
    """Tokens right-padded (labels with -100, an attention mask), per-token extras padded with 0, every other tensor
    (pixel values, image grids) laid out by :func:`_lay_out`; rows marked ``padding_free`` (a family
    of :data:`FLATTENS`) concatenated into one row instead."""
    import torch
    from safetensors.torch import load

    if batch[0].get("padding_free"):
        return _flat(batch)

    n = max(len(x["input_ids"]) for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        m = len(x["input_ids"])
        ids[i, :m] = torch.tensor(x["input_ids"], dtype=torch.long)
        labels[i, :m] = torch.tensor(x["labels"], dtype=torch.long)
        mask[i, :m] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **_lay_out([load(x["mm"]) for x in batch], n)}
