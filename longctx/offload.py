"""The host tier: sealed pages in pinned host memory, read every step through a bounded GPU
staging area and merged with the device pages' attention by LSE.

A `PagedKVCache` with `KVConfig.host_blocks > 0` owns one `HostTier`. The tables put the
oldest sealed columns of every row in the host tier (`BlockTables.spill`); this module holds
their bytes and reads them:

- `store(moves)` copies spilled pages from the device pools into the host pools (every layer,
  on a side stream on CUDA; the compute stream waits for it before the freed device slots are
  written again).
- `parts(layer, q, start, scale, backend)` attends q over the layer's host pages: the host
  columns fall in slices of at most `stage_blocks` distinct pages; each slice's pages are
  copied into one of `RING` staging pools on a copy stream while the compute stream runs the
  attention kernel over the previous slice. Each slice gives (out, lse); the cache merges them
  with its device part. The copies run ahead across layers, so the link stays busy: a decode
  step costs about the host bytes over the pinned host-to-device bandwidth.

On a CPU device the host pools are plain CPU tensors and the copies synchronous: the same
planning and staging, which the CPU tests exercise.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch

from .ops.paged_attention import paged_attention
from .ops.pages import Pages, PagedView
from .quant import page_bytes

RING = 2  # staging pools: one being filled while the kernel reads the other
ALIGN = 4096  # bytes: each host pool starts on a page of the one pinned buffer
# default staging slice: pages of at most this many bytes (one layer's format), so that a slice
# is long enough for the link and the kernel (hundreds of pages) and two stay small beside the
# device pools
STAGE_BYTES = 128 * 2**20


def stage_blocks_for(per_layer: int, batch: int = 1) -> int:
    """Pages a staging slice holds by default: STAGE_BYTES of the largest layer's pages, and at
    least a page a row (a column of distinct pages must fit one slice)."""
    return max(batch, STAGE_BYTES // per_layer, 1)


def host_memory_available() -> int:
    """Bytes of host memory the machine can give now (MemAvailable, else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pinned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory as uint8, page-locked for the GPU's copies when `pin`: registered
    with CUDA at its exact size (torch's pinned allocator rounds a request up to a power of two:
    21 GiB would pin 32), unregistered when the tensor's memory is freed."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise MemoryError(f"cudaHostRegister of {nbytes / 2**30:,.2f} GiB returned {err}")
        weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, buf.data_ptr())
    return buf


def check_host_budget(host_bytes: int, what: str = "host tier") -> None:
    """Refuse, before any work, a host tier larger than the machine can pin."""
    have = host_memory_available()
    if host_bytes > have:
        raise ValueError(f"{what}: {host_bytes / 2**30:,.2f} GiB of pinned host memory asked, but this machine has "
                         f"{have / 2**30:,.2f} GiB available; ask for less")


def offload_config(cfg, model, host_bytes: int, chunk: int):
    """`cfg` with a host tier of `host_bytes` of pinned memory for `model` (on a CUDA device):
    the device pool takes the GPU memory free now, less two staging slices and a reserve for
    one chunk's activations (a tenth of it, at least 1 GiB); `max_blocks` already set (e.g. by
    a context limit) is kept where smaller. Refuses a host budget the machine cannot pin."""
    from .integrations.transformers import decoder_shape

    if model.device.type != "cuda":
        raise ValueError(f"a host tier holds pages off a CUDA GPU's memory; this model runs on {model.device.type}")
    layers, kv_heads, head_dim = decoder_shape(model.config)
    cfg = cfg.resolve(layers, head_dim)
    per_block, per_layer = page_bytes(cfg, layers, kv_heads, head_dim, torch.float16)
    staging = RING * stage_blocks_for(per_layer) * per_layer
    free = torch.cuda.mem_get_info(model.device)[0]
    device_blocks = (free - staging - max(2**30, free // 10)) // per_block
    if device_blocks < -(-chunk // cfg.block_size):
        raise ValueError(f"a host tier needs the GPU to hold a chunk's pages and {staging / 2**20:,.0f} MiB of staging; "
                         f"{free / 2**30:,.2f} GiB is free")
    if cfg.max_blocks is not None:
        device_blocks = min(device_blocks, cfg.max_blocks)
    check_host_budget(host_bytes, "--host-mem")
    return dataclasses.replace(cfg, max_blocks=int(device_blocks), host_blocks=max(1, host_bytes // per_block))


@dataclasses.dataclass
class Slice:
    """Host columns [c0, c1) of every row, staged together: `table` [B, c1 - c0] int32 on the
    device maps them to staging slots; `runs` [(first host id, count, first slot)] are the
    copies that fill those slots (consecutive host ids go in one copy)."""

    c0: int
    c1: int
    table: torch.Tensor
    runs: list[tuple[int, int, int]]


def plan_slices(rows: list[list[int]], lo: int, hi: int, stage_blocks: int) -> list[tuple[int, int, list[list[int]], list[tuple[int, int, int]]]]:
    """Cut columns [lo, hi) of `rows` into slices of at most `stage_blocks` distinct ids:
    [(c0, c1, staged table rows, runs)]. Within a slice the ids are staged in ascending order,
    so runs of consecutive ids are one copy each. Pure Python (tests/test_offload.py)."""
    out = []
    c0 = lo
    while c0 < hi:
        ids: set[int] = set()
        c1 = c0
        while c1 < hi:
            col = {row[c1] for row in rows}
            if ids and len(ids | col) > stage_blocks:
                break
            if len(col) > stage_blocks:
                raise ValueError(f"a column holds {len(col)} distinct host pages, more than the {stage_blocks} a staging slice holds")
            ids |= col
            c1 += 1
        order = sorted(ids)
        slot = {bid: i for i, bid in enumerate(order)}
        out.append((c0, c1, [[slot[row[j]] for j in range(c0, c1)] for row in rows], _runs(order)))
        c0 = c1
    return out


class HostTier:
    """Pinned host pools of one cache's layers, their staging and the copies between them."""

    def __init__(self, cache, host_blocks: int, stage_blocks: int | None):
        self.cache = cache
        self.host_blocks = host_blocks
        self.stage_blocks_asked = stage_blocks
        self.pages: list[Pages] = []  # per layer, allocated at host_blocks on the first spill
        self._slices: list[Slice] | None = None  # the staging plan; None: rebuild at the next read
        self._stage: dict = {}  # (ring slot, format) -> Pages of stage_blocks slots on the device
        self._cuda = False
        self._copy = self._spill = None  # CUDA streams
        self._ready: list = []  # per ring slot: the event its last fill recorded (copy stream)
        self._free: list = []  # per ring slot: the event its last read recorded (compute stream)
        self._next = 0  # the next item of the step to fill ((layer, slice), layer-major)
        self._filled: dict[int, int] = {}  # item -> ring slot holding it, filled and not read yet
        self._turn = 0  # fills so far: the ring slot of the next one is _turn % RING
        self._spilled = None  # event: the last spill's copies are done (device slots free to write)
        self._buffer: torch.Tensor | None = None  # the one host buffer every host pool is a view of

    # ---------------------------------------------------------------- sizes
    @property
    def stage_blocks(self) -> int:
        if self.stage_blocks_asked is not None:
            return self.stage_blocks_asked
        return stage_blocks_for(max(sum(f.block_bytes().values()) for f in self.cache.formats), self.cache.batch_size)

    def reserved_bytes(self) -> tuple[int, int]:
        """(host bytes the pools hold, device bytes the staging pools hold)."""
        host = self._buffer.numel() if self._buffer is not None else 0
        stage = sum(t.numel() * t.element_size() for p in self._stage.values() for t in p.tensors().values())
        return host, stage

    # ---------------------------------------------------------------- storage
    def prepare(self) -> None:
        """The host pools at full size, all layers, in one buffer pinned (on CUDA) at its exact
        size, allocated before the tables change: all or nothing (a failed allocation or
        pinning leaves no pool behind)."""
        if self.pages:
            return
        cache = self.cache
        self._cuda = cache.device.type == "cuda"
        fields, total = [], 0
        for layer, fmt in enumerate(cache.formats):
            for name, shape, dtype in cache.pool_fields(fmt, self.host_blocks):
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                fields.append((layer, name, shape, dtype, total, n))
                total += -(-n // ALIGN) * ALIGN
        try:
            buf = pinned_buffer(total, self._cuda)
        except (RuntimeError, MemoryError) as e:
            raise MemoryError(f"host tier: pinning {total / 2**30:,.2f} GiB failed ({e}); nothing was moved") from None
        pages = [Pages(fmt) for fmt in cache.formats]
        for layer, name, shape, dtype, at, n in fields:
            setattr(pages[layer], name, buf[at : at + n].view(dtype).view(shape))
        self._buffer = buf
        self.pages = pages
        if self._cuda:
            self._copy, self._spill = torch.cuda.Stream(cache.device), torch.cuda.Stream(cache.device)
            self._ready = [None] * RING
            self._free = [None] * RING

    def store(self, moves: list[tuple[int, int]]) -> None:
        """Copy device slots -> host slots for `moves` [(device id, host id)], every layer."""
        if not moves:
            return
        self.invalidate()
        dev = torch.tensor([d for d, _ in moves], dtype=torch.int64)
        runs = _runs([h for _, h in moves])
        cache = self.cache
        if self._cuda:
            self._spill.wait_stream(torch.cuda.current_stream(cache.device))  # (the pages were written there)
        with torch.cuda.stream(self._spill) if self._cuda else _nothing():
            dev = dev.to(cache.device)
            for src, dst in zip(cache.pages, self.pages):
                for name, t in src.tensors().items():
                    picked = t.index_select(0, dev)  # [n, ...] in the moves' order
                    host = getattr(dst, name)
                    for h0, n, i0 in runs:
                        host[h0 : h0 + n].copy_(picked[i0 : i0 + n], non_blocking=self._cuda)
            if self._cuda:
                self._spilled = torch.cuda.Event()
                self._spilled.record(self._spill)
        if self._cuda:  # the freed device slots are written next (a seal): after the copies read them
            torch.cuda.current_stream(cache.device).wait_event(self._spilled)

    # ---------------------------------------------------------------- reading
    def invalidate(self) -> None:
        """The host columns or rows changed: plan the slices again at the next read."""
        self._slices = None
        self._filled.clear()
        self._next = 0

    def slices(self) -> list[Slice]:
        if self._slices is None:
            cache = self.cache
            t = cache.tables
            device = cache.device
            self._slices = [
                Slice(c0, c1, torch.tensor(tab, dtype=torch.int32).reshape(len(tab), c1 - c0).to(device), runs)
                for c0, c1, tab, runs in plan_slices(t.rows, t.sink_blocks, t.host_upto, self.stage_blocks)
            ]
            self._filled.clear()
            self._next = 0
        return self._slices

    def _stage_pages(self, slot: int, fmt) -> Pages:
        key = (slot, fmt)
        if key not in self._stage:
            p = Pages(fmt)
            with torch.inference_mode(False):
                for name, shape, dtype in self.cache.pool_fields(fmt, self.stage_blocks):
                    setattr(p, name, torch.empty(shape, dtype=dtype, device=self.cache.device))
            self._stage[key] = p
        return self._stage[key]

    def _fill(self, g: int) -> None:
        """Start copying item g of the step ((layer, slice) in layer-major order; g past the
        step's last item: the next step's) into the next ring slot."""
        slices = self.slices()
        n = len(slices)
        layer, s = divmod(g % (n * self.cache.num_layers), n)
        slot = self._turn % RING
        self._turn += 1
        dst = self._stage_pages(slot, self.cache.formats[layer])
        src = self.pages[layer]
        with torch.cuda.stream(self._copy) if self._cuda else _nothing():
            if self._cuda and self._free[slot] is not None:
                self._copy.wait_event(self._free[slot])  # (the kernel that read the slot before is done)
            if self._cuda and self._spilled is not None:
                self._copy.wait_event(self._spilled)  # (the pages the last spill is still writing)
            for name, t in src.tensors().items():
                d = getattr(dst, name)
                for h0, cnt, i0 in slices[s].runs:
                    d[i0 : i0 + cnt].copy_(t[h0 : h0 + cnt], non_blocking=self._cuda)
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record(self._copy)
                self._ready[slot] = ev
        self._filled[g] = slot

    def parts(self, layer: int, q: torch.Tensor, start: torch.Tensor | None, scale: float | None, backend: str):
        """Attention of q over `layer`'s host pages: [(out, lse)], one a slice.

        Items are read in order (the layers of a step, then the next step's); each read first
        fills the items up to RING - 1 ahead of it (one on a CPU device, where copies are
        synchronous), so that the copy stream works on the next slices, the next layer's or the
        next step's first ones included, while the kernel reads this one."""
        slices = self.slices()
        if not slices:
            return []
        cache = self.cache
        n, L, P = len(slices), cache.num_layers, cache.block_size
        B, H, D = q.shape[0], cache.num_kv_heads, cache.head_dim
        empty = cache.tail_k.new_empty(B, H, 0, D)
        ahead = RING if self._cuda else 1
        out = []
        for s, sl in enumerate(slices):
            g = layer * n + s
            if g not in self._filled:  # (a read out of the expected order: start over from it)
                self._filled.clear()
                self._next = g
            while self._next < g + ahead:
                self._fill(self._next)
                self._next += 1
            slot = self._filled.pop(g)
            if self._cuda:
                torch.cuda.current_stream(cache.device).wait_event(self._ready[slot])
            view = PagedView(pages=self._stage_pages(slot, cache.formats[layer]), sink_k=cache.sink_k[layer],
                             sink_v=cache.sink_v[layer], block_table=sl.table, n_sink=0, tail_k=empty, tail_v=empty)
            local = None if start is None else (start - sl.c0 * P).clamp(min=0).to(start.dtype)
            out.append(paged_attention(q, view, start=local, scale=scale, backend=backend))
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(cache.device))
                self._free[slot] = ev
        if layer == L - 1:  # the step's last read: what was filled ahead is the next step's
            self._filled = {g - n * L: slot for g, slot in self._filled.items() if g >= n * L}
            self._next = max(0, self._next - n * L)
        return out

    def columns(self, layer: int, c0: int, c1: int) -> PagedView:
        """A view of host columns [c0, c1) of `layer` (every row) on the device, staged in a
        pool of its own: for reads off the step's path (crop, dense)."""
        cache = self.cache
        if self._spilled is not None:
            self._spilled.synchronize()  # (read on the host: the last spill's copies must have landed)
        rows = [row[c0:c1] for row in cache.tables.rows]
        ids = sorted({bid for row in rows for bid in row})
        slot = {bid: i for i, bid in enumerate(ids)}
        fmt = cache.formats[layer]
        pages = Pages(fmt)
        index = torch.tensor(ids, dtype=torch.int64)
        for name, t in self.pages[layer].tensors().items():
            setattr(pages, name, t.index_select(0, index).to(cache.device))
        table = torch.tensor([[slot[b] for b in row] for row in rows], dtype=torch.int32).reshape(len(rows), c1 - c0).to(cache.device)
        empty = cache.tail_k.new_empty(len(rows), cache.num_kv_heads, 0, cache.head_dim)
        return PagedView(pages=pages, sink_k=cache.sink_k[layer], sink_v=cache.sink_v[layer], block_table=table, n_sink=0,
                         tail_k=empty, tail_v=empty)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """[(first id, count, first index)] of the consecutive runs in `ids`, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, bid in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][1] == bid and runs[-1][2] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((bid, 1, i))
    return runs


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
