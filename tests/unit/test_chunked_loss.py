"""The chunked cross-entropy (train/losses.py) equals the one-piece float32 loss, in value and gradient, on a tiny model and
under every micro-batch x accumulation split of a window (issue 14.4)."""

import pytest
import torch

from tiny import alpaca_records
from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.model import losses
from trainpipe.model.losses import chunked_cross_entropy_sum, setup_liger, shift_labels


def one_piece(logits, labels):
    """The loss as it was computed before: the full logits upcast to float32 at once."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 10**9])  # a row per chunk, uneven chunks, one chunk
def test_value_and_gradient_equal_the_one_piece_loss(chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 50, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[2, 7:] = IGNORE_INDEX  # padding
    ref = one_piece(logits, labels)
    (ref_grad,) = torch.autograd.grad(ref / 17, logits)
    before = logits.detach().clone()
    got = chunked_cross_entropy_sum(logits, shift_labels(labels), chunk_elements=chunk_elements)
    (got_grad,) = torch.autograd.grad(got / 17, logits)
    assert torch.equal(logits.detach(), before)  # a caller's leaf tensor is not overwritten by the gradient
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert (got_grad - ref_grad).abs().max().item() <= 1e-6
    assert got_grad[0, :3].abs().max() == 0 and got_grad[2, 6:].abs().max() == 0  # positions without a label get no gradient



@pytest.fixture(scope="module")
def window(tiny_tokenizer):
    """Eight examples of different lengths, loss on the answers only (as the data step labels them)."""
    out = []
    for r in alpaca_records(8, seed=11):
        prompt = tiny_tokenizer(f"{r['instruction']} {r['input']}\n")["input_ids"]
        answer = tiny_tokenizer(r["output"])["input_ids"] + [tiny_tokenizer.eos_token_id]
        ids = prompt + answer
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [IGNORE_INDEX] * len(prompt) + answer})
    return out


def window_gradients(model, obj, examples, micro: int):
    """The loop's step: sum of per-micro-batch loss sums / the window's loss tokens, gradients accumulated."""
    model.zero_grad(set_to_none=True)
    denom = obj.weight(examples)
    total = 0.0
    for i in range(0, len(examples), micro):
        loss_sum, _ = obj.loss_sum(model, obj.collate(examples[i : i + micro]))
        (loss_sum / denom).backward()
        total += loss_sum.item() / denom
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_tiny_model_chunked_equals_one_piece_across_accumulation(tiny_model_dir, tiny_tokenizer, window, monkeypatch):
    from transformers import AutoModelForCausalLM

    from trainpipe.train.objectives import TokenCrossEntropy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train()
    model.config.attention_dropout = 0.0
    obj = TokenCrossEntropy(tiny_tokenizer.pad_token_id)

    class OnePiece(TokenCrossEntropy):
        def loss_sum(self, model, batch):
            labels = batch.pop("labels")
            return one_piece(model(**batch).logits, labels), {}

    ref_loss, ref = window_gradients(model, OnePiece(tiny_tokenizer.pad_token_id), window, micro=8)
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 3 * model.config.vocab_size)  # a few tokens per chunk: many chunks
    for micro in (8, 4, 2, 1):  # one micro-batch, then accumulation over 2, 4 and 8
        loss, got = window_gradients(model, obj, window, micro=micro)
        assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (micro, loss, ref_loss)  # float32 summation order: relative 1e-6
        assert got.keys() == ref.keys() and len(got) > 10
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert worst <= 1e-6, (micro, worst)
    assert ref_loss > 1.0  # a real loss of an untrained model, not a degenerate zero


def test_bf16_logits_get_the_one_piece_gradient_in_bf16():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 9, 64, generator=g) * 3
    labels = torch.randint(0, 64, (2, 9), generator=g)
    a = base.to(torch.bfloat16).requires_grad_()
    b = base.to(torch.bfloat16).requires_grad_()
    ref = one_piece(a, labels)
    ref.backward()
    got = chunked_cross_entropy_sum(b, shift_labels(labels), chunk_elements=64)
    got.backward()
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert b.grad.dtype == torch.bfloat16
    assert torch.allclose(b.grad.float(), a.grad.float(), atol=1e-2, rtol=1e-2)  # bf16 rounding of the same float32 gradient


def test_liger_on_the_cpu_falls_back_with_one_message(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    said = []
    assert setup_liger(model, "cpu", True, say=said.append) is False
    assert len(said) == 1 and "CUDA" in said[0] and "chunked cross-entropy is used instead" in said[0]
    said.clear()
    assert setup_liger(model, "cpu", False, say=said.append) is False and said == []
