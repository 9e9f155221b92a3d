"""PyTorch's CUDA caching allocator, simulated: reserved memory from a stream of allocations and frees.

`torch.cuda.max_memory_allocated` counts the blocks handed to live tensors; `max_memory_reserved` (and nvidia-smi, less
the CUDA context) counts the segments the allocator obtained with cudaMalloc and keeps cached. The gap between them is
fragmentation, and it depends on the *order* and the *sizes* of the allocations, which a fake-tensor trace of a
training step gives exactly (see benchmarks/allocator_gap.py). This module replays such a stream under the allocator's
rules with its default settings (no `expandable_segments`, no `max_split_size_mb`, no `roundup_power2_divisions`,
no garbage-collection threshold, one stream, no CUDA graphs).

The rules, from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator; read at commit
001074d25084fdb87a799823e395a50f5ec044d3) and the "Memory management" section of the CUDA semantics notes:

- `round_size`: every request is rounded up to a multiple of kMinBlockSize = 512 B (at least 512 B).
- `get_pool`: a rounded size <= kSmallSize (1 MiB) uses the small pool, anything larger the large pool.
- `get_allocation_size`: a new segment (cudaMalloc) is kSmallBuffer = 2 MiB for the small pool, kLargeBuffer = 20 MiB
  for a request under kMinLargeAlloc (10 MiB), otherwise the request rounded up to kRoundLarge = 2 MiB.
- `get_free_block`: best fit: `pool.blocks.lower_bound(search_key)` in a set ordered by `BlockComparatorSize`
  (stream, size, address), i.e. the smallest cached free block of the pool that is >= the request, the lowest
  address among equal sizes. (The oversize checks are no-ops while max_split_size is unlimited.)
- `malloc`: no cached block fits -> `alloc_block` (cudaMalloc a new segment); if that fails,
  `release_available_cached_blocks` (does nothing without max_split_size) and then `release_cached_blocks` (cudaFree
  every cached block that is a whole segment, i.e. not split: `release_blocks`) and one retry; if that fails too:
  "CUDA out of memory".
- `should_split`: the found block is split when the remainder is >= 512 B (small pool) or > kSmallSize = 1 MiB
  (large pool); otherwise the whole block is handed out and `allocated_bytes` counts the whole block
  (`alloc_found_block`: increase_stat(allocated_bytes, block->size)).
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours of the same segment (prev and next)
  and goes back to its pool's free set; segments are never returned to CUDA except by `release_cached_blocks`
  (an OOM retry or `torch.cuda.empty_cache()`).
- a request of 0 bytes allocates nothing (the allocator returns a null pointer).

What it does not model: other streams and their events (`recordStream`), CUDA graphs' private pools, memory taken
outside the allocator (CUDA context, NCCL, cuBLAS workspaces made before the first allocation), and a capacity that
is shared with other processes. `capacity` is the bytes cudaMalloc may hand out in all (the GPU's memory less the
context and whatever else lives outside the allocator).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Hashable, Iterable

K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20 << 20  # "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10 << 20  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 << 20  # round up large allocations to 2 MiB
_SEGMENT_GAP = 1 << 21  # address gap between simulated segments (segments are never adjacent: no cross-segment merge)


def round_size(nbytes: int) -> int:
    """CUDACachingAllocator round_size with the default config (no power-of-2 divisions)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment cudaMalloc'ed for a rounded request that no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class SimulatedOOM(Exception):
    """cudaMalloc failed after releasing the cached blocks: the step does not fit `capacity`."""


class _Block:
    __slots__ = ("ptr", "size", "small", "prev", "next", "allocated", "requested")

    def __init__(self, ptr: int, size: int, small: bool):
        self.ptr, self.size, self.small = ptr, size, small
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass
class AllocatorStats:
    """What torch.cuda.memory_stats() would report for the replayed stream (bytes)."""

    allocated: int = 0  # allocated_bytes.all.current (block sizes, after rounding and unsplit remainders)
    reserved: int = 0  # reserved_bytes.all.current (cudaMalloc'ed segments)
    peak_allocated: int = 0  # max_memory_allocated
    peak_reserved: int = 0  # max_memory_reserved
    requested: int = 0  # requested_bytes.all.current (what the tensors asked for)
    peak_requested: int = 0
    segments: int = 0
    peak_segments: int = 0
    num_device_alloc: int = 0  # cudaMalloc calls
    num_device_free: int = 0  # cudaFree calls (cache releases on an OOM retry)
    num_alloc_retries: int = 0
    oom: bool = False  # the stream did not fit `capacity`
    oom_request: int = 0  # the request that failed (rounded bytes)
    events: int = 0  # events replayed (up to the OOM)

    @property
    def fragmentation(self) -> float:
        """peak reserved / peak allocated - 1."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0


class CachingAllocator:
    """One device's DeviceCachingAllocator (default settings, one stream). `malloc(nbytes, key)` / `free(key)`."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.stats = AllocatorStats()
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # pool (small?) -> sorted (size, ptr, block)
        self._live: dict[Hashable, _Block] = {}
        self._next_ptr = 1 << 32

    # ------------------------------------------------------------------ pools
    def _insert(self, b: _Block) -> None:
        insort(self._free[b.small], (b.size, b.ptr, b))

    def _erase(self, b: _Block) -> None:
        lst = self._free[b.small]
        i = bisect_left(lst, (b.size, b.ptr))
        assert lst[i][2] is b, "free block not in its pool"
        del lst[i]

    def _get_free_block(self, size: int, small: bool) -> _Block | None:
        lst = self._free[small]
        i = bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        return lst.pop(i)[2]

    # ------------------------------------------------------------------ segments
    def _alloc_block(self, size: int, small: bool, is_retry: bool) -> _Block | None:
        alloc = allocation_size(size)
        if is_retry:
            self.stats.num_alloc_retries += 1
        if self.capacity is not None and self.stats.reserved + alloc > self.capacity:
            return None  # cudaErrorMemoryAllocation
        b = _Block(self._next_ptr, alloc, small)
        self._next_ptr += alloc + _SEGMENT_GAP
        s = self.stats
        s.reserved += alloc
        s.segments += 1
        s.num_device_alloc += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        s.peak_segments = max(s.peak_segments, s.segments)
        return b

    def release_cached_blocks(self) -> None:
        """release_cached_blocks / release_blocks: cudaFree every cached block that is a whole segment (empty_cache)."""
        for small in (False, True):
            keep = []
            for entry in self._free[small]:
                b = entry[2]
                if b.is_split():
                    keep.append(entry)
                else:
                    self.stats.reserved -= b.size
                    self.stats.segments -= 1
                    self.stats.num_device_free += 1
            self._free[small] = keep

    # ------------------------------------------------------------------ the API
    def malloc(self, nbytes: int, key: Hashable) -> None:
        if nbytes <= 0:
            return
        if key in self._live:
            raise ValueError(f"allocation key {key!r} is already live")
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._get_free_block(size, small)
        if block is None:
            block = self._alloc_block(size, small, False)
            if block is None:  # release_available_cached_blocks is a no-op without max_split_size
                self.release_cached_blocks()
                block = self._alloc_block(size, small, True)
            if block is None:
                self.stats.oom = True
                self.stats.oom_request = size
                raise SimulatedOOM(f"simulated CUDA out of memory: tried to allocate {size} B with {self.stats.reserved} B reserved "
                                   f"and {self.stats.allocated} B allocated of {self.capacity} B")
        remaining = block.size - size
        if (remaining >= K_MIN_BLOCK_SIZE) if small else (remaining > K_SMALL_SIZE):  # should_split
            rest = block
            block = _Block(rest.ptr, size, small)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.ptr += size
            rest.size -= size
            self._insert(rest)
        block.allocated = True
        block.requested = nbytes
        self._live[key] = block
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = max(s.peak_requested, s.requested)

    def free(self, key: Hashable) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return  # a zero-byte allocation, or a key never allocated
        block.allocated = False
        self.stats.allocated -= block.size
        self.stats.requested -= block.requested
        for src in (block.prev, block.next):  # free_block -> try_merge_blocks(block, prev/next)
            if src is None or src.allocated:
                continue
            self._erase(src)
            if block.prev is src:  # [src block]
                block.ptr = src.ptr
                block.prev = src.prev
                if block.prev is not None:
                    block.prev.next = block
            else:  # [block src]
                block.next = src.next
                if block.next is not None:
                    block.next.prev = block
            block.size += src.size
        self._insert(block)

    def empty_cache(self) -> None:
        self.release_cached_blocks()

    def cached_free_bytes(self) -> int:
        return sum(e[0] for lst in self._free.values() for e in lst)


def replay(events: Iterable[tuple[int, int, Hashable]], capacity: int | None = None) -> AllocatorStats:
    """Replay ordered (nbytes, +1 allocate / -1 free, key) events (sign 0: a marker, ignored); stops at a simulated OOM
    (stats.oom)."""
    a = CachingAllocator(capacity)
    n = 0
    try:
        for nbytes, sign, key in events:
            n += 1
            if sign > 0:
                a.malloc(nbytes, key)
            elif sign < 0:
                a.free(key)
    except SimulatedOOM:
        pass
    a.stats.events = n
    return a.stats


def replay_trace(trace_result, capacity: int | None = None) -> AllocatorStats:
    """Replay a plan/trace.py TraceResult (its events are (storage key, nbytes, +1/-1))."""
    return replay(((n, sign, key) for key, n, sign in trace_result.events), capacity)


def fits(events: Iterable[tuple[int, int, Hashable]], capacity: int) -> bool:
    """Does the stream run without a CUDA OOM when cudaMalloc can hand out `capacity` bytes in all?"""
    return not replay(events, capacity).oom
