"""Next-token cross-entropy that never upcasts the full-vocabulary logits to float32 in one piece.

A causal LM's logits are batch x sequence x vocabulary: at a 128k vocabulary, 4k tokens and batch 4 they are 4 GiB in
bf16, and ``cross_entropy(logits.float(), ...)`` adds an 8 GiB float32 copy plus an 8 GiB float32 log-softmax kept for
the backward pass. :func:`chunked_cross_entropy_sum` instead

- forward: walks the sequence in chunks of about ``chunk_elements`` logits, upcasts one chunk at a time, and keeps only
  the per-token log-sum-exp (float32, batch x sequence) for the backward pass;
- backward: recomputes each chunk's softmax from the logits and that log-sum-exp, subtracts the one-hot target, scales by
  the incoming gradient and writes the result over the logits it came from when they are a model's output (needed by
  nothing else after the loss; an op that still needed them would make autograd raise, never compute a wrong gradient);
  a leaf tensor a caller passed in is left as it is and gets a fresh gradient tensor.

So beyond the logits themselves the loss needs one float32 chunk (``benchmarks/loss_memory.py`` measures the ratio). It
returns the *sum* over labelled tokens, as the loop's objectives do, so a window's loss is sum / its loss tokens and any
micro-batch x accumulation split gives the same gradient; value and gradient equal ``cross_entropy(reduction="sum")``
to float32 rounding (``tests/unit/test_chunked_loss.py``).

``training.use_liger_kernel: true`` goes further on a CUDA GPU: Liger's fused linear cross-entropy (Triton) computes the
loss from the last hidden states and the LM head chunk by chunk, so the logits are never materialised at all
(:func:`setup_liger`). Off a GPU, or without ``liger-kernel``, the chunked loss is used and the run says so once. The
preference objectives use Liger's chunked preference losses instead, which are plain PyTorch and run on the CPU too
(train/fused_preference.py).
"""

from __future__ import annotations

import functools

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 26  # logits per float32 chunk: 256 MiB (512 tokens at a 128k vocabulary)


def _chunk_rows(batch: int, vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, batch * vocab))


@functools.lru_cache(maxsize=1)
def _make_function():
    """The autograd Function, made once on first use (torch is imported lazily)."""
    import torch

    class ChunkedCrossEntropySum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels, step: int):
            total = torch.zeros((), dtype=torch.float32, device=logits.device)
            lse = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
            for s in range(0, logits.size(1), step):
                chunk = logits[:, s : s + step].float()
                lab = labels[:, s : s + step]
                keep = lab != IGNORE_INDEX
                part = torch.logsumexp(chunk, dim=-1)
                lse[:, s : s + step] = part
                target = chunk.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                total += torch.where(keep, part - target, 0.0).sum()
                del chunk, part, target
            ctx.save_for_backward(logits, labels, lse)
            ctx.step = step
            ctx.inplace = not logits.is_leaf  # a model's output: its storage takes the gradient; a leaf (a caller's tensor) is left alone
            return total

        @staticmethod
        def backward(ctx, grad_out):
            logits, labels, lse = ctx.saved_tensors
            step = ctx.step
            g = grad_out.float()
            grad = logits if ctx.inplace else torch.empty_like(logits)
            for s in range(0, logits.size(1), step):
                chunk = logits[:, s : s + step].to(torch.float32, copy=True)  # a copy even for float32 logits (worked on in place below)
                lab = labels[:, s : s + step]
                keep = (lab != IGNORE_INDEX).unsqueeze(-1)
                chunk.sub_(lse[:, s : s + step].unsqueeze(-1)).exp_()  # softmax
                chunk.scatter_add_(-1, lab.clamp(min=0).unsqueeze(-1), torch.full(lab.shape + (1,), -1.0, device=chunk.device))
                chunk.mul_(g).masked_fill_(~keep, 0.0)
                grad[:, s : s + step] = chunk.to(logits.dtype)  # in place: the gradient takes the place of the logits (needed by nothing else)
                del chunk
            return grad, None, None

    return ChunkedCrossEntropySum


def chunked_cross_entropy_sum(logits, labels, chunk_elements: int | None = None):
    """Sum of next-token cross-entropy over the labelled positions. ``logits``: batch x T x vocabulary (any float dtype, a
    view is fine); ``labels``: batch x T, already aligned with ``logits`` (position t predicts ``labels[:, t]``),
    ``IGNORE_INDEX`` where there is no loss. Computed in float32 one chunk of about ``chunk_elements`` logits at a time."""
    step = _chunk_rows(logits.size(0), logits.size(-1), chunk_elements or CHUNK_ELEMENTS)
    return _make_function().apply(logits, labels, step)


def shift_labels(labels):
    """Labels aligned with the logits of the same positions: position t predicts token t+1; the last predicts nothing."""
    import torch

    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


# ----------------------------------------------------------------------------------------------- Liger on a GPU


def setup_liger(model, device_type: str, enabled: bool, *, say=print) -> bool:
    """Patch ``model`` (its base under PEFT) with Liger's kernels when `training.use_liger_kernel` is on, the device is a CUDA GPU and
    `liger-kernel` is installed; True when the fused linear cross-entropy is then in use. Otherwise ``say`` one message on why
    not and what is used instead (the chunked loss), and return False."""
    if not enabled:
        return False
    if device_type != "cuda":
        say(
            f"`training.use_liger_kernel: true`: Liger's fused linear cross-entropy is a Triton kernel for CUDA GPUs, and this run is on "
            f"{device_type}. trainpipe's chunked cross-entropy is used instead (the float32 logits are never made in one piece, so the "
            "loss's memory stays one chunk); on a GPU the fused kernel also avoids the logits themselves."
        )
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        say(
            "`training.use_liger_kernel: true` needs the `liger-kernel` package, which is not installed: install it with "
            "`pip install 'trainpipe[gpu]'` (or `pip install liger-kernel`). This run uses trainpipe's chunked cross-entropy instead."
        )
        return False
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    _apply_liger_kernel_to_instance(model=base)
    return True
