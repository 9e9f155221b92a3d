"""The dispatch mode and patches the memory tracer (plan/trace.py) runs a training step under: `LiveBytes` counts the
bytes of every live tensor storage; `cuda_like_dropout` and `real_data_paths` make the CPU/fake-tensor step save what
the same step saves on a GPU with real data."""

from __future__ import annotations

import contextlib
import weakref


# ----------------------------------------------------------------------------------------------- the live-bytes tracker


def _tracker_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class LiveBytes(TorchDispatchMode):
        """Live tensor-storage bytes while ops run: what the caching allocator holds allocated."""

        def __init__(self, record_events: bool = True):
            super().__init__()
            self.cur = 0
            self.peak = 0
            self.peak_phase = None
            self.peak_event = 0
            self.phase = "setup"
            self.keys = WeakIdKeyDictionary()
            self.next_key = 0
            self.events: list = []
            self.record = record_events

        def key_of(self, t) -> int | None:
            return self.keys.get(t.untyped_storage())

        def add(self, t) -> None:
            st = t.untyped_storage()
            if st in self.keys:
                return
            n = st.nbytes()
            k = self.next_key
            self.next_key += 1
            self.keys[st] = k
            self.cur += n
            self.events.append((k, n, 1))
            weakref.finalize(st, self._free, k, n)
            if self.cur > self.peak:
                self.peak, self.peak_phase, self.peak_event = self.cur, self.phase, len(self.events)

        def _free(self, k: int, n: int) -> None:
            self.cur -= n
            self.events.append((k, n, -1))

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.add(t)
            return out

    return LiveBytes


def live_bytes_tracker(record_events: bool = True):
    """A fresh `LiveBytes` dispatch mode (enter it with `with`)."""
    return _tracker_class()(record_events)


# ----------------------------------------------------------------------------------------------- GPU fidelity


@contextlib.contextmanager
def cuda_like_dropout():
    """Route `F.dropout` through `torch.native_dropout` (a bool mask, as CUDA's fused kernel keeps) and SDPA's attention
    dropout to what CUDA's fused kernels keep (no mask) while tracing."""
    import torch
    import torch.nn.functional as F

    orig = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    orig_sdpa = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        # CUDA's fused SDPA kernels (flash, memory-efficient) draw attention dropout inside the kernel from a Philox seed and
        # save no mask; the CPU falls back to the math kernel for dropout_p > 0, which keeps the seq x seq probabilities and
        # their mask. Traced as the fused kernel saves (dropout_p = 0: the same q, k, v, output and logsumexp).
        return orig_sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    F.dropout = dropout
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.dropout = orig
        F.scaled_dot_product_attention = orig_sdpa


@contextlib.contextmanager
def real_data_paths():
    """transformers takes other code paths when it sees a FakeTensor (`is_tracing`): it builds an explicit causal mask,
    so SDPA gets `attn_mask` and k/v are repeated to all heads (no `enable_gqa`). With real data and no padding it skips
    the mask and passes `is_causal=True` + `enable_gqa`. During the trace the mask code takes the real-data path: fake
    tensors do not count as tracing there, and the packed-sequence check (data-dependent) answers what unpacked
    batches answer (no packed sequences)."""
    from transformers import masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensor

    orig_tracing, orig_packed = mu.is_tracing, getattr(mu, "find_packed_sequence_indices", None)

    def is_tracing(tensor=None):
        if isinstance(tensor, FakeTensor):
            return orig_tracing(None)
        return orig_tracing(tensor)

    mu.is_tracing = is_tracing
    if orig_packed is not None:
        mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.is_tracing = orig_tracing
        if orig_packed is not None:
            mu.find_packed_sequence_indices = orig_packed
