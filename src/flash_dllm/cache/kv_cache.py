"""The flat KV cache: one pre-allocated buffer per layer for every request, and its allocator.

A request owns a contiguous range of cache rows, one row per position of its sequence (prompt and
generated region): row = base + position. K is stored after RoPE. Nothing is allocated per step. Ranges start
at multiples of ALIGN rows, so that a request's chunks of routed prompt keys (cache/routing.py) are the
cache's own chunks, whose summaries are kept beside it. Ranges come and go with requests of any length, so the
free rows can end up in holes that no waiting request fits: then the held ranges slide to the cache's start
(`CacheAllocator.compact`, `KVCache.move_rows`), which copies rows instead of leaving a request waiting.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig
from ..kernels.fp8 import quantize_rows_ref

ALIGN = 32  # rows; routing.CHUNK divides it
STAGING_BYTES = 64 << 20  # KVCache.move_rows' buffer for a range that overlaps its new place


class KVCache:
    """k[layer], v[layer]: [num_rows + 1, kv_heads, head_dim]: the requests' rows, then `scratch_row`, which no
    request owns and no pass reads: a query row whose K/V must not reach the cache writes there (the left
    neighbour of a cached pass's block on a shifted architecture, see ModelRunner.prepare).

    `hidden_states()`: per layer [num_rows + 1, hidden_size], the layer's input hidden state of each row, and
    the scratch row (Elastic-Cache recomputes deep layers over a whole sequence from them), allocated at first
    use: hidden_size values per token and layer, half the K/V bytes with MHA.

    kv_dtype=torch.float8_e4m3fn (kernels/kv_fp8.py): K and V in E4M3, with k_scale[layer], v_scale[layer]
    [num_rows + 1, kv_heads] fp32 beside them (else None), one per row and KV head: (head_dim + 4) / (2 head_dim)
    of a 16-bit cache's bytes (0.52 at head_dim 128). `dtype` stays the model's: the hidden states, chunk
    summaries and k-means regions are kept in it (a row of hidden states in fp8 would share one scale with the
    residual stream's outliers).
    """

    def __init__(self, cfg: ModelConfig, num_rows: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None):
        if num_rows <= 0:
            raise ValueError(f"KV cache needs at least one row, got {num_rows}")
        if kv_dtype not in (None, dtype, torch.float8_e4m3fn):
            raise ValueError(f"K and V are stored in the model's dtype or float8_e4m3fn, not {kv_dtype}")
        shape = (num_rows + 1, cfg.num_kv_heads, cfg.head_dim)
        self.num_rows, self.scratch_row = num_rows, num_rows
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.k = [torch.zeros(shape, dtype=self.kv_dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.kv_dtype, device=device) for _ in range(cfg.num_layers)]
        self.k_scale = self.v_scale = None
        if self.kv_dtype == torch.float8_e4m3fn:
            self.k_scale, self.v_scale = ([torch.zeros(shape[:2], device=device) for _ in range(cfg.num_layers)]
                                          for _ in range(2))
        self._hidden_shape = (num_rows + 1, cfg.hidden_size)
        self._hidden: list[torch.Tensor] | None = None
        self._summaries: list[torch.Tensor] | None = None
        self._kmeans: tuple[list[torch.Tensor], ...] | None = None
        self._chunk: int | None = None  # the rows per entry of the summaries and k-means regions, once allocated
        self._staging: torch.Tensor | None = None  # move_rows' buffer, at its first overlapping move

    def chunk_summaries(self, chunk: int) -> list[torch.Tensor]:
        """Per layer [rows / chunk (rounded up), 3, kv_heads, head_dim]: the lower bounds, upper bounds and mean of
        the prompt keys of each chunk of `chunk` cache rows (written by kernels/chunk_summaries.py with the
        prompt's keys), allocated at first use: 3 / chunk of the K bytes."""
        if self._summaries is None:
            self._chunk = chunk
            k = self.k[0]
            shape = (-(-k.shape[0] // chunk), 3, *k.shape[1:])
            self._summaries = [torch.zeros(shape, dtype=self.dtype, device=k.device) for _ in self.k]
        return self._summaries

    def kmeans_regions(self, chunk: int) -> tuple[list[torch.Tensor], ...]:
        """The k-means regions of routed prompts (cache/routing.py's `kmeans` policy), allocated at first use:
        per layer [rows / chunk (rounded up) + 1, 3, kv_heads, head_dim]: the lower bounds, upper bounds and mean
        of each region's keys, region r of the request whose range starts at row s kept at s / chunk + r (the last
        entry: scratch that no region owns); [num_rows + 1, kv_heads] int32: the region of the key each cache
        row holds (-1: none; the rows of a prompt's routable keys hold them region after region);
        [rows / chunk (rounded up) + 1, kv_heads] int32: each region's number of keys, kept as the summaries; and
        [num_rows + 1, kv_heads] int32: the region of each position's key (at row start + position; -1: none)."""
        if self._kmeans is None:
            self._chunk = chunk
            k = self.k[0]
            regions = -(-k.shape[0] // chunk) + 1
            self._kmeans = ([torch.zeros(regions, 3, *k.shape[1:], dtype=self.dtype, device=k.device) for _ in self.k],
                            [torch.full(k.shape[:2], -1, dtype=torch.int32, device=k.device) for _ in self.k],
                            [torch.zeros(regions, k.shape[1], dtype=torch.int32, device=k.device) for _ in self.k],
                            [torch.full(k.shape[:2], -1, dtype=torch.int32, device=k.device) for _ in self.k])
        return self._kmeans

    def hidden_states(self) -> list[torch.Tensor]:
        if self._hidden is None:
            k = self.k[0]
            self._hidden = [torch.zeros(self._hidden_shape, dtype=self.dtype, device=k.device) for _ in self.k]
        return self._hidden

    def move_rows(self, moves: list[tuple[int, int, int]]):
        """Copy each (old start, new start, rows) range of rows, in order, with everything kept per row beside K
        and V (fp8 scales, hidden states, each row's k-means region) and per chunk of rows (chunk summaries,
        k-means regions and sizes; starts are multiples of ALIGN, which the chunk divides). A range may overlap
        its own new place: `CacheAllocator.compact` slides ranges towards the start, and such a range is copied
        in ascending blocks through a staging buffer of at most STAGING_BYTES (a whole range's copy would need
        as much memory again as its rows)."""
        per_row = [*self.k, *self.v, *(self.k_scale or []), *(self.v_scale or []), *(self._hidden or [])]
        per_chunk = []
        if self._kmeans is not None:
            per_row += [*self._kmeans[1], *self._kmeans[3]]
            per_chunk += [*self._kmeans[0], *self._kmeans[2]]
        per_chunk += self._summaries or []
        chunk = self._chunk or 1  # per_chunk is empty until a chunk size is set
        for old, new, rows in moves:
            assert new <= old, "ranges move towards the cache's start"
            for tensors, source, target, count in ((per_row, old, new, rows),
                                                   (per_chunk, old // chunk, new // chunk, -(-rows // chunk))):
                for t in tensors:
                    self._copy_rows(t, source, target, count)

    def _copy_rows(self, t: torch.Tensor, source: int, target: int, count: int):
        if source - target >= count:  # apart
            t[target:target + count] = t[source:source + count]
            return
        flat = t.view(t.shape[0], -1).view(torch.uint8)  # [rows, bytes of a row]
        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=t.device)
        block = max(1, STAGING_BYTES // flat.shape[1])
        for start in range(0, count, block):  # a block's target ends before any later block's source starts
            n = min(block, count - start)
            staged = self._staging[:n * flat.shape[1]].view(n, flat.shape[1])
            staged.copy_(flat[source + start:source + start + n])
            flat[target + start:target + start + n] = staged

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [N, kv_heads, head_dim] (rotated K, in the model's dtype) at the layer's rows slot_mapping [N]:
        quantised, with their scales, in an fp8 cache (the PyTorch path's write; the kernels write in their
        epilogues)."""
        store_kv(self.k[layer], self.v[layer], slot_mapping, k, v, **self.scales(layer))

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's k_scale and v_scale as keyword arguments of the kernels and their references ({}: K and V
        are in the model's dtype)."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])

    @property
    def nbytes(self) -> int:
        """Bytes allocated: K, V (and their scales), and the hidden states, chunk summaries and k-means regions if
        allocated."""
        extra = [*(self.k_scale or []), *(self.v_scale or []), *(self._hidden or []), *(self._summaries or []),
                 *(t for part in self._kmeans or () for t in part)]
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *extra))

    @staticmethod
    def bytes_per_row(cfg: ModelConfig, dtype: torch.dtype, with_hidden: bool = False,
                      kv_dtype: torch.dtype | None = None) -> int:
        kv_dtype = kv_dtype or dtype
        scale_bytes = 4 if kv_dtype == torch.float8_e4m3fn else 0
        kv = 2 * cfg.num_kv_heads * (cfg.head_dim * torch.finfo(kv_dtype).bits // 8 + scale_bytes)
        hidden = cfg.hidden_size * torch.finfo(dtype).bits // 8 if with_hidden else 0
        return cfg.num_layers * (kv + hidden)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, dtype: torch.dtype, device,
                    with_hidden: bool = False, kv_dtype: torch.dtype | None = None) -> KVCache:
        """As many rows as `budget_bytes` holds (leaving room for the hidden states if `with_hidden`)."""
        per_row = cls.bytes_per_row(cfg, dtype, with_hidden, kv_dtype)
        num_rows = budget_bytes // per_row
        if num_rows < 1:
            raise ValueError(f"a KV cache budget of {budget_bytes} bytes holds no token ({per_row} bytes per token)")
        return cls(cfg, num_rows, dtype, device, kv_dtype)



def store_kv(k_out: torch.Tensor, v_out: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """Store k, v [N, kv_heads, head_dim] at rows `slots` of k_out, v_out: as they are, or quantised with their
    scales where k_scale, v_scale are given (an FP8 cache)."""
    if k_scale is None:
        k_out[slots], v_out[slots] = k, v
        return
    for values, scale, rows in ((k_out, k_scale, k), (v_out, v_scale, v)):
        values[slots], scale[slots] = quantize_rows_ref(rows)

@dataclass
class _Range:
    start: int
    length: int


class CacheAllocator:
    """First-fit allocation of contiguous row ranges, each rounded up to a multiple of `align` rows (so every
    range starts at such a multiple); freed ranges merge with their neighbours."""

    def __init__(self, num_rows: int, align: int = ALIGN):
        self.num_rows, self.align = num_rows, align
        self.free: list[_Range] = [_Range(0, num_rows)]  # sorted by start

    @property
    def num_free(self) -> int:
        return sum(r.length for r in self.free)

    def allocate(self, length: int) -> int | None:
        """Start row of a new range of `length` rows, or None while no free range is long enough."""
        if length > self.num_rows:
            raise ValueError(f"a sequence of {length} tokens can never fit in a KV cache of "
                             f"{self.num_rows} tokens; raise the cache budget or shorten the request")
        for i, r in enumerate(self.free):
            if r.length >= length:
                # Only the range that ends the cache can be shorter than a multiple of `align`: there the
                # rounded range ends with the cache (as `release` assumes).
                taken = min(self._rounded(length), r.length)
                start = r.start
                if r.length == taken:
                    del self.free[i]
                else:
                    self.free[i] = _Range(r.start + taken, r.length - taken)
                return start
        return None

    def _rounded(self, length: int) -> int:
        return -(-length // self.align) * self.align

    def held(self) -> list[_Range]:
        """The held rows as ranges between the free ones (adjacent requests' ranges make one)."""
        held, cursor = [], 0
        for r in [*self.free, _Range(self.num_rows, 0)]:
            if r.start > cursor:
                held.append(_Range(cursor, r.start - cursor))
            cursor = r.start + r.length
        return held

    def _compaction(self) -> tuple[list[tuple[int, int, int]], int]:
        """`compact`'s moves, and where its held rows would end."""
        moves, cursor = [], 0
        for r in self.held():
            if r.start != cursor:
                moves.append((r.start, cursor, r.length))
            cursor = min(cursor + self._rounded(r.length), self.num_rows)
        return moves, cursor

    def fits_compacted(self, length: int) -> bool:
        """Whether a range of `length` rows would fit once the held ranges are compacted (`compact`)."""
        return self.num_rows - self._compaction()[1] >= length

    def compact(self, move: Callable[[list[tuple[int, int, int]]], None] = lambda moves: None
                ) -> list[tuple[int, int, int]]:
        """Slide the held ranges to the start of the cache, in order, leaving one free range at the end. `move`
        gets the moves (old start, new start, rows) first, for the rows to follow (KVCache.move_rows) and the
        requests whose ranges they hold (a request at row s of a move's old range is at s + new - old); if it
        raises, the allocator stays as it was. Returns the moves. A range that ends the cache holds fewer rows
        than its rounded length; moved, it holds that length again where there is room, as `release` will free."""
        moves, cursor = self._compaction()
        if moves:
            move(moves)
        self.free = [_Range(cursor, self.num_rows - cursor)] if cursor < self.num_rows else []
        return moves

    def release(self, start: int, length: int):
        """Free the range `allocate(length)` returned at `start`."""
        length = min(self._rounded(length), self.num_rows - start)
        starts = [r.start for r in self.free]
        i = bisect.bisect_left(starts, start)
        self.free.insert(i, _Range(start, length))
        if i + 1 < len(self.free) and start + length == self.free[i + 1].start:  # merge right
            self.free[i].length += self.free.pop(i + 1).length
        if i > 0 and self.free[i - 1].start + self.free[i - 1].length == start:  # merge left
            self.free[i - 1].length += self.free.pop(i).length
