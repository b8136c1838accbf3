"""The host tier: sealed pages in pinned host memory, read every step through a bounded GPU
staging area and merged with the device pages' attention by LSE.

A `PagedKVCache` with `KVConfig.host_blocks > 0` owns one `HostTier`. The tables put the
oldest sealed columns of every row in the host tier (`BlockTables.spill`); this module holds
their bytes and reads them:

- `store(moves)` copies spilled pages from the device pools into the host pools (every layer,
  on a side stream of its device on CUDA; the compute stream waits for it before the freed
  device slots are written again).
- `parts(layer, q, start, scale, backend)` attends q over the layer's host pages: the host
  columns fall in slices of at most `stage_blocks` distinct pages; each slice's pages are
  copied into one of `RING` staging pools on a copy stream while the compute stream runs the
  attention kernel over the previous slice. Each slice gives (out, lse); the cache merges them
  with its device part. The copies run ahead across layers, so the link stays busy: a decode
  step costs about the host bytes over the pinned host-to-device bandwidth.

A model split over several GPUs shares the one host pool; each device stages its own layers'
slices, in a ring, copy stream and events of its own.

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
from .quant import layer_page_bytes

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
    """`cfg` with a host tier of `host_bytes` of pinned memory for `model` (on CUDA): the device
    pool takes the GPU memory free now, less two staging slices and a reserve for one chunk's
    activations (a tenth of it, at least 1 GiB); `max_blocks` already set (e.g. by a context
    limit) is kept where smaller. A model split over several GPUs: each card holds its layers'
    pages of every block id, so the card with the least room per block sets max_blocks.
    Refuses a host budget the machine cannot pin."""
    from .integrations.transformers import decoder_shape, layer_devices

    devices = layer_devices(model)
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"a host tier holds pages off a CUDA GPU's memory; this model runs on {', '.join(sorted({str(d) for d in devices}))}")
    layers, kv_heads, head_dim = decoder_shape(model.config)
    cfg = cfg.resolve(layers, head_dim)
    sizes = layer_page_bytes(cfg, layers, kv_heads, head_dim, torch.float16)
    device_blocks = None
    for device in dict.fromkeys(devices):
        mine = [n for n, d in zip(sizes, devices) if d == device]
        per_block, per_layer = sum(mine), max(mine)
        staging = RING * stage_blocks_for(max(sizes)) * per_layer
        free = torch.cuda.mem_get_info(device)[0]
        blocks = (free - staging - max(2**30, free // 10)) // per_block
        if blocks < -(-chunk // cfg.block_size):
            raise ValueError(f"a host tier needs {device} to hold a chunk's pages and {staging / 2**20:,.0f} MiB of staging; "
                             f"{free / 2**30:,.2f} GiB is free")
        device_blocks = blocks if device_blocks is None else min(device_blocks, blocks)
    if cfg.max_blocks is not None:
        device_blocks = min(device_blocks, cfg.max_blocks)
    check_host_budget(host_bytes, "--host-mem")
    return dataclasses.replace(cfg, max_blocks=int(device_blocks), host_blocks=max(1, host_bytes // sum(sizes)))


@dataclasses.dataclass
class Slice:
    """Host columns [c0, c1) of every row, staged together: `tables` {device: [B, c1 - c0]
    int32} map them to staging slots, on each device the layers live on; `runs` [(first host
    id, count, first slot)] are the copies that fill those slots (consecutive host ids go in
    one copy)."""

    c0: int
    c1: int
    tables: dict
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
        self._stage: dict = {}  # (device, ring slot, format) -> Pages of stage_blocks slots on that device
        self._copy: dict = {}  # CUDA device -> its copy stream (host -> staging)
        self._spill: dict = {}  # CUDA device -> its spill stream (pools -> host)
        self._ready: dict = {}  # (device, ring slot) -> the event its last fill recorded (copy stream)
        self._free: dict = {}  # (device, ring slot) -> the event its last read recorded (compute stream)
        self._next = 0  # the next item of the step to fill ((layer, slice), layer-major)
        self._filled: dict[int, int] = {}  # item -> ring slot holding it (on its layer's device), filled and not read yet
        self._turn: dict = {}  # device -> fills so far: the ring slot of its next one is _turn % RING
        self._spilled: dict = {}  # CUDA device -> event: its last spill's copies are done (device slots free to write)
        self._buffer: torch.Tensor | None = None  # the one host buffer every host pool is a view of

    # ---------------------------------------------------------------- sizes
    @property
    def stage_blocks(self) -> int:
        if self.stage_blocks_asked is not None:
            return self.stage_blocks_asked
        return stage_blocks_for(max(sum(f.block_bytes().values()) for f in self.cache.formats), self.cache.batch_size)

    def reserved_bytes(self) -> tuple[int, dict[str, int]]:
        """(host bytes the pools hold, {device: bytes its staging pools hold})."""
        host = self._buffer.numel() if self._buffer is not None else 0
        stage: dict[str, int] = {}
        for (device, _, _), p in self._stage.items():
            stage[str(device)] = stage.get(str(device), 0) + sum(t.numel() * t.element_size() for t in p.tensors().values())
        return host, stage

    # ---------------------------------------------------------------- storage
    def prepare(self) -> None:
        """The host pools at full size, all layers, in one buffer pinned (on CUDA) at its exact
        size, allocated before the tables change: all or nothing (a failed allocation or
        pinning leaves no pool behind)."""
        if self.pages:
            return
        cache = self.cache
        cuda = [d for d in cache.devices if d.type == "cuda"]
        fields, total = [], 0
        for layer, fmt in enumerate(cache.formats):
            for name, shape, dtype in cache.pool_fields(fmt, self.host_blocks):
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                fields.append((layer, name, shape, dtype, total, n))
                total += -(-n // ALIGN) * ALIGN
        try:
            buf = pinned_buffer(total, bool(cuda))
        except (RuntimeError, MemoryError) as e:
            raise MemoryError(f"host tier: pinning {total / 2**30:,.2f} GiB failed ({e}); nothing was moved") from None
        pages = [Pages(fmt) for fmt in cache.formats]
        for layer, name, shape, dtype, at, n in fields:
            setattr(pages[layer], name, buf[at : at + n].view(dtype).view(shape))
        self._buffer = buf
        self.pages = pages
        for d in cuda:
            self._copy[d], self._spill[d] = torch.cuda.Stream(d), torch.cuda.Stream(d)

    def store(self, moves: list[tuple[int, int]]) -> None:
        """Copy device slots -> host slots for `moves` [(device id, host id)], every layer
        (each device's layers on its spill stream)."""
        if not moves:
            return
        self.invalidate()
        ids = torch.tensor([d for d, _ in moves], dtype=torch.int64)
        runs = _runs([h for _, h in moves])
        cache = self.cache
        for device in cache.devices:
            cuda = device.type == "cuda"
            if cuda:
                self._spill[device].wait_stream(torch.cuda.current_stream(device))  # (the pages were written there)
            with torch.cuda.stream(self._spill[device]) if cuda else _nothing():
                dev = ids.to(device)
                for layer in range(cache.num_layers):
                    if cache.layer_device(layer) != device:
                        continue
                    for name, t in cache.pages[layer].tensors().items():
                        picked = t.index_select(0, dev)  # [n, ...] in the moves' order
                        host = getattr(self.pages[layer], name)
                        for h0, n, i0 in runs:
                            host[h0 : h0 + n].copy_(picked[i0 : i0 + n], non_blocking=cuda)
                if cuda:
                    self._spilled[device] = torch.cuda.Event()
                    self._spilled[device].record(self._spill[device])
            if cuda:  # the freed device slots are written next (a seal): after the copies read them
                torch.cuda.current_stream(device).wait_event(self._spilled[device])

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
            self._slices = []
            for c0, c1, tab, runs in plan_slices(t.rows, t.sink_blocks, t.host_upto, self.stage_blocks):
                table = torch.tensor(tab, dtype=torch.int32).reshape(len(tab), c1 - c0)
                self._slices.append(Slice(c0, c1, {d: table.to(d) for d in cache.devices}, runs))
            self._filled.clear()
            self._next = 0
        return self._slices

    def _stage_pages(self, device: torch.device, slot: int, fmt) -> Pages:
        key = (device, slot, fmt)
        if key not in self._stage:
            p = Pages(fmt)
            with torch.inference_mode(False):
                for name, shape, dtype in self.cache.pool_fields(fmt, self.stage_blocks):
                    setattr(p, name, torch.empty(shape, dtype=dtype, device=device))
            self._stage[key] = p
        return self._stage[key]

    def _fill(self, g: int) -> None:
        """Start copying item g of the step ((layer, slice) in layer-major order; g past the
        step's last item: the next step's) into the next ring slot."""
        slices = self.slices()
        n = len(slices)
        layer, s = divmod(g % (n * self.cache.num_layers), n)
        device = self.cache.layer_device(layer)
        cuda = device.type == "cuda"
        turn = self._turn.get(device, 0)
        slot = turn % RING
        self._turn[device] = turn + 1
        dst = self._stage_pages(device, slot, self.cache.formats[layer])
        src = self.pages[layer]
        with torch.cuda.stream(self._copy[device]) if cuda else _nothing():
            if cuda and self._free.get((device, slot)) is not None:
                self._copy[device].wait_event(self._free[device, slot])  # (the kernel that read the slot before is done)
            if cuda and device in self._spilled:
                self._copy[device].wait_event(self._spilled[device])  # (the pages the last spill is still writing)
            for name, t in src.tensors().items():
                d = getattr(dst, name)
                for h0, cnt, i0 in slices[s].runs:
                    d[i0 : i0 + cnt].copy_(t[h0 : h0 + cnt], non_blocking=cuda)
            if cuda:
                ev = torch.cuda.Event()
                ev.record(self._copy[device])
                self._ready[device, slot] = ev
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
        device = cache.layer_device(layer)
        cuda = device.type == "cuda"
        empty = torch.empty(B, H, 0, D, dtype=cache.dtype, device=device)
        sink_k, sink_v = cache.sinks(layer)
        ahead = RING if cuda else 1
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
            if cuda:
                torch.cuda.current_stream(device).wait_event(self._ready[device, slot])
            view = PagedView(pages=self._stage_pages(device, slot, cache.formats[layer]), sink_k=sink_k, sink_v=sink_v,
                             block_table=sl.tables[device], n_sink=0, tail_k=empty, tail_v=empty)
            local = None if start is None else (start - sl.c0 * P).clamp(min=0).to(start.dtype)
            out.append(paged_attention(q, view, start=local, scale=scale, backend=backend))
            if cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(device))
                self._free[device, slot] = ev
        if layer == L - 1:  # the step's last read: what was filled ahead is the next step's
            self._filled = {g - n * L: slot for g, slot in self._filled.items() if g >= n * L}
            self._next = max(0, self._next - n * L)
        return out

    def columns(self, layer: int, c0: int, c1: int) -> PagedView:
        """A view of host columns [c0, c1) of `layer` (every row) on the device, staged in a
        pool of its own: for reads off the step's path (crop, dense)."""
        cache = self.cache
        for ev in self._spilled.values():
            ev.synchronize()  # (read on the host: the last spills' copies must have landed)
        device = cache.layer_device(layer)
        rows = [row[c0:c1] for row in cache.tables.rows]
        ids = sorted({bid for row in rows for bid in row})
        slot = {bid: i for i, bid in enumerate(ids)}
        fmt = cache.formats[layer]
        pages = Pages(fmt)
        index = torch.tensor(ids, dtype=torch.int64)
        for name, t in self.pages[layer].tensors().items():
            setattr(pages, name, t.index_select(0, index).to(device))
        table = torch.tensor([[slot[b] for b in row] for row in rows], dtype=torch.int32).reshape(len(rows), c1 - c0).to(device)
        empty = torch.empty(len(rows), cache.num_kv_heads, 0, cache.head_dim, dtype=cache.dtype, device=device)
        sink_k, sink_v = cache.sinks(layer)
        return PagedView(pages=pages, sink_k=sink_k, sink_v=sink_v, block_table=table, n_sink=0, tail_k=empty, tail_v=empty)


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
