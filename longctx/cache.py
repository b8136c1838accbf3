"""PagedKVCache: owns every KV tensor (page pools, sink pools, tails) of all layers.

Block ids and tables come from allocator.py; this class moves the bytes. One block table
serves all layers (a block id names the same token range in every layer's pool).

Lifecycle of a token: `append` writes it into its layer's tail (unquantized). When the
first layer appends the next step's tokens, every tail block that filled up during the
previous step is sealed, for all layers at once: rows whose new block has identical bytes
in every layer and the same prefix share one physical block (beams prefilled from one
prompt are stored once). So a prefill chunk always attends to itself at full precision,
and is sealed after its attention, never read back quantized by itself.

Rows of one batch share a length (Hugging Face's batch model); per-row lengths are left
padding, which attention skips. Thread-unsafe by design, like the models it serves.

Devices: each layer's pools, tails and sinks live on the device its attention runs on. A model
split over several GPUs by accelerate's device_map gives the cache one device per layer
(`devices`); consecutive layers on one device form a `Segment`, which stacks their tails and
sinks, and each device holds its own copy of the block table. Nothing crosses devices but the
hidden states the model moves itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

import torch

from .allocator import BlockAllocator, BlockTables
from .config import KVConfig
from .errors import CacheFullError
from .memory import MemoryReport, memory_report
from .offload import HostTier, check_host_budget
from .ops.gather_dequant import gather_dequant
from .ops.paged_attention import paged_attention
from .ops.paged_attention.reference import merge_partials
from .ops.pages import Pages, PagedView
from .ops.quantize_blocks import quantize_blocks_into
from .quant import BlockFormat, page_bytes

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# room a graph table (`graph_table`) leaves for later seals: max(GRAPH_ROOM[0], blocks //
# GRAPH_ROOM[1]) columns; a decode graph is recorded anew when it fills (every 1,024 tokens of
# 64-token blocks at short contexts, every 1/16 of the context at long ones), and its plan is
# made for the full width
GRAPH_ROOM = (16, 16)


@dataclasses.dataclass
class DeviceStep:
    """The state CUDA-graph decode steps read on the device: one object, owned by the cache
    (`PagedKVCache.device_step`), handed to attention through `view` (tail_len, n_blocks) and
    read by the graph decoder. It lives from the first recording until something the graphs
    cannot follow (the table is full, the row count changes, a crop or reset) drops it."""
    # table: [batch, logical_block] -> physical block id, block_table()'s columns then room
    # that seals fill in place (GRAPH_ROOM); count: the columns in use, int32 [1]
    table: torch.Tensor
    count: torch.Tensor
    # while a step is recorded (`static_step`): the tail slot its tokens go to (int64 [1]),
    # the tail's length after them (int32 [1]) and each row's first attended position
    # (int32 [B] or None); whoever replays advances slot and length
    slot: torch.Tensor | None = None
    length: torch.Tensor | None = None
    start: torch.Tensor | None = None

    @property
    def recording(self) -> bool:
        return self.slot is not None


@dataclasses.dataclass
class Segment:
    """Consecutive decoder layers on one device and what they keep there beside their pools:
    their tails [n, B, H_kv, capacity, D] and sink pools [n, N_sink, H_kv, P, D], stacked over
    the segment's n layers so that a seal or a reorder is a few ops a segment. A model on one
    device is one segment; one split over two cards, two."""
    device: torch.device
    layers: range
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor


def _device(d) -> torch.device:
    """`d` as a torch.device with its index ("cuda" is the current CUDA device's)."""
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether tensor `t` lives on `device` (a CPU device's index names a placement, not memory)."""
    return t.device.type == device.type and (device.type == "cpu" or t.device.index == device.index)


def _index(values, device, dtype=torch.int64) -> torch.Tensor:
    """Indices on `device` without a host sync: built on the host, copied from pinned memory
    asynchronously (a plain torch.tensor(..., device=cuda) waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _storage_op(fn):
    """Run a method that creates or writes cache tensors outside inference mode and autograd:
    tensors born inside `torch.inference_mode()` could not be written to after it ends."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


class PagedKVCache:
    """Paged KV storage for `num_layers` decoder layers of `num_kv_heads` x `head_dim`.

    Public tensors per layer are exposed through `view(layer)` (a `PagedView`); the pools
    are allocated lazily from the first `append` (its dtype; its device, unless `devices`
    names one a layer), then grow by doubling up to `config.max_blocks`.

    devices: the device of each layer, for a model split over several (accelerate's
    device_map); None: every layer on the device of the first append.
    """

    def __init__(self, config: KVConfig, num_layers: int, num_kv_heads: int, head_dim: int, devices=None):
        if devices is not None:
            devices = [_device(d) for d in devices]
            if len(devices) != num_layers:
                raise ValueError(f"devices: one device a layer, {num_layers}, got {len(devices)}")
        self.layer_devices: list[torch.device] | None = devices
        self.config = config.resolve(num_layers, head_dim)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = self.config.block_size
        self.sink_alloc = BlockAllocator(None, "sink blocks")
        self.block_alloc = BlockAllocator(self.config.max_blocks, "blocks")
        hb = self.config.host_blocks
        self.host_alloc = BlockAllocator(hb, "host blocks") if hb else None
        self.tables = BlockTables(self.sink_alloc, self.block_alloc, self.config.sink_blocks, self.host_alloc)
        self.host: HostTier | None = None  # the host tier's pools and staging (host_blocks > 0)
        if hb:
            dtype = torch.float32 if self.config.dtype == "float32" else torch.float16  # ("auto": a 16-bit model's scales)
            per_block, _ = page_bytes(self.config, num_layers, num_kv_heads, head_dim, dtype)
            check_host_budget(hb * per_block, f"KVConfig.host_blocks={hb}")
            self.host = HostTier(self, hb, self.config.stage_blocks)
        self.tail_len = [0] * num_layers  # tail_len[layer] -> tokens in that layer's tail
        self.dtype: torch.dtype | None = None
        self.formats: list[BlockFormat] = []
        self.pages: list[Pages] = []
        self.segments: list[Segment] = []  # the layers' tails and sinks, by device
        self._where: list[tuple[Segment, int]] = []  # layer -> (its segment, its index there)
        self._tables: dict[torch.device, torch.Tensor] = {}  # block_table() on each device, rebuilt on change
        self.seals = 0  # blocks sealed so far (physical, all rows)
        self.device_step: DeviceStep | None = None  # what recorded decode steps read on the device

    # ------------------------------------------------------------------ state
    @property
    def initialized(self) -> bool:
        return self.dtype is not None

    @property
    def device(self) -> torch.device | None:
        """The first layer's device (where a model's inputs go), None before the first append."""
        return self.segments[0].device if self.segments else None

    @property
    def devices(self) -> list[torch.device]:
        """The devices the layers live on, in layer order (one unless the model is split)."""
        return list(dict.fromkeys(seg.device for seg in self.segments))

    def layer_device(self, layer: int) -> torch.device:
        return self._where[layer][0].device

    def segment(self, layer: int) -> tuple[Segment, int]:
        """(the segment holding `layer`, the layer's index within it)."""
        return self._where[layer]

    @property
    def batch_size(self) -> int:
        return self.tables.num_rows

    @property
    def num_blocks(self) -> int:
        """Sealed logical blocks per row."""
        return self.tables.num_blocks

    def seq_len(self, layer: int | None = None) -> int:
        """Tokens per row: in `layer` (which may be mid-step), or committed by all layers."""
        tail = min(self.tail_len) if layer is None else self.tail_len[layer]
        return self.num_blocks * self.block_size + tail

    @_storage_op
    def _init_storage(self, like: torch.Tensor, batch: int) -> None:
        cfg = self.config
        dtype = like.dtype if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        if dtype not in DTYPES.values():
            raise ValueError(f"keys/values of dtype {like.dtype} cannot be cached; cast the model to bf16/fp16/fp32")
        self.dtype = dtype
        L, H, P, D = self.num_layers, self.num_kv_heads, self.block_size, self.head_dim
        devices = self.layer_devices or [_device(like.device)] * L
        self.formats = [
            cfg.block_format(l, D, H, self.dtype) for l in range(L)
        ]
        self.pages = [Pages(fmt) for fmt in self.formats]
        for pages, device in zip(self.pages, devices):
            for name, shape, dtype in self.pool_fields(pages.fmt, 0):
                setattr(pages, name, torch.empty(shape, dtype=dtype, device=device))
        self.segments, self._where = [], []
        for device, run in itertools.groupby(range(L), key=devices.__getitem__):
            layers = list(run)
            n = len(layers)
            sink = torch.empty(n, 0, H, P, D, dtype=self.dtype, device=device)
            tail = torch.zeros(n, batch, H, P, D, dtype=self.dtype, device=device)
            seg = Segment(device, range(layers[0], layers[-1] + 1), tail, torch.zeros_like(tail), sink, torch.empty_like(sink))
            self.segments.append(seg)
            self._where += [(seg, i) for i in range(n)]
        self.tables.ensure_rows(batch)

    @staticmethod
    def pool_fields(fmt: BlockFormat, n: int):
        H, P, D, dt = fmt.num_kv_heads, fmt.block_size, fmt.head_dim, fmt.dtype
        if fmt.k_bits == 16:
            yield "k", (n, H, P, D), dt
        else:
            yield "k_codes", (n, H, P, D * fmt.k_bits // 8), torch.uint8
            yield "k_scale", (n, H, fmt.k_groups, D), dt
            yield "k_zero", (n, H, fmt.k_groups, D), dt
        if fmt.v_bits == 16:
            yield "v", (n, H, P, D), dt
        else:
            yield "v_codes", (n, H, P, D * fmt.v_bits // 8), torch.uint8
            yield "v_scale", (n, H, P, D // fmt.group_size), dt
            yield "v_zero", (n, H, P, D // fmt.group_size), dt

    def grow_pools(self) -> None:
        """Make every pool at least as large as its allocator's capacity: by doubling, or,
        with `max_blocks`, straight to max_blocks at the first need (one allocation, no
        copy later: memory is what `longctx plan` predicts, with no transient 1.5x)."""
        need = self.block_alloc.capacity
        for pages in self.pages:
            for name, shape, dtype in self.pool_fields(pages.fmt, 0):
                t = getattr(pages, name)
                if t.shape[0] < need:
                    cap = max(need, 2 * t.shape[0], 4)
                    if self.config.max_blocks is not None:
                        cap = max(need, self.config.max_blocks)
                    grown = torch.zeros((cap, *shape[1:]), dtype=dtype, device=t.device)
                    grown[: t.shape[0]] = t
                    setattr(pages, name, grown)
        need = self.sink_alloc.capacity
        for seg in self.segments:
            if seg.sink_k.shape[1] < need:
                cap = max(need, 2 * seg.sink_k.shape[1])
                for name in ("sink_k", "sink_v"):
                    t = getattr(seg, name)
                    grown = t.new_zeros(t.shape[0], cap, *t.shape[2:])
                    grown[:, : t.shape[1]] = t
                    setattr(seg, name, grown)

    def start(self, dtype: torch.dtype, device, rows: int) -> None:
        """Empty storage for `rows` rows of `dtype` on `device` (or the layers' `devices`), as
        the first append makes it (`longctx.persist` fills it from a file)."""
        self._init_storage(torch.empty(0, dtype=dtype, device=device), rows)

    def set_tails(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's tail, [L, B, H_kv, n, D] (n under a block, between forwards)."""
        n = k.shape[3]
        self._ensure_tail_capacity(n)
        for seg in self.segments:
            seg.tail_k[:, :, :, :n] = k[seg.layers.start : seg.layers.stop].to(seg.device)
            seg.tail_v[:, :, :, :n] = v[seg.layers.start : seg.layers.stop].to(seg.device)
        self.tail_len = [n] * self.num_layers

    def tails(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s tail tensors [B, H_kv, capacity, D] (its first tail_len[layer] tokens count)."""
        seg, i = self._where[layer]
        return seg.tail_k[i], seg.tail_v[i]

    def sinks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s sink pools [N_sink, H_kv, P, D]."""
        seg, i = self._where[layer]
        return seg.sink_k[i], seg.sink_v[i]

    def tables_changed(self) -> None:
        """The block tables were rebuilt outside seal/select (a load): drop what was derived from them."""
        self._tables = {}
        self.device_step = None
        if self.host is not None:
            self.host.invalidate()

    def _ensure_tail_capacity(self, n: int) -> None:
        P = self.block_size
        for seg in self.segments:
            cap = seg.tail_k.shape[3]
            if n <= cap:
                continue
            new_cap = max(-(-n // P) * P, 2 * cap)
            for name in ("tail_k", "tail_v"):
                t = getattr(seg, name)
                grown = t.new_zeros(*t.shape[:3], new_cap, t.shape[4])
                grown[:, :, :, :cap] = t
                setattr(seg, name, grown)

    # ------------------------------------------------------------------ append / seal
    @_storage_op
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens k, v [B, H_kv, C, D] for `layer` into its tail.

        The first layer's append starts a step: full blocks left by the previous step are
        sealed (all layers), and the room for C more tokens is checked before anything
        changes, so a CacheFullError loses nothing.
        """
        B, H, C, D = k.shape
        if k.dim() != 4 or k.shape != v.shape or H != self.num_kv_heads or D != self.head_dim:
            raise ValueError(
                f"append: k/v must be [B, {self.num_kv_heads}, C, {self.head_dim}], got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"append: layer {layer} out of range for {self.num_layers} layers")
        if not self.initialized:
            self._init_storage(k, B)
        elif self.batch_size == 0:
            self.tables.ensure_rows(B)
            for seg in self.segments:
                seg.tail_k = seg.tail_k.new_zeros(seg.tail_k.shape[0], B, *seg.tail_k.shape[2:])
                seg.tail_v = torch.zeros_like(seg.tail_k)
        if B != self.batch_size:
            raise ValueError(f"append: batch of {B} rows, but the cache holds {self.batch_size}; reorder/select rows first")
        seg, i = self._where[layer]
        if not _on(k, seg.device):
            raise ValueError(f"append: layer {layer}'s keys are on {k.device}, but its pages live on {seg.device}")
        if layer == 0:
            self._begin_step(C)
        t0 = self.tail_len[layer]
        if layer != 0 and t0 + C > seg.tail_k.shape[3]:
            raise RuntimeError(f"append: layer {layer} got tokens before layer 0 started the step")
        step = self.device_step
        if step is not None and step.recording:  # a recorded step: the slot comes from the device
            if C != 1:
                raise ValueError(f"append: a step recorded for CUDA graphs takes one token a row, got {C}")
            seg.tail_k[i].index_copy_(2, step.slot, k.to(self.dtype))
            seg.tail_v[i].index_copy_(2, step.slot, v.to(self.dtype))
        else:
            seg.tail_k[i, :, :, t0 : t0 + C] = k.to(self.dtype)
            seg.tail_v[i, :, :, t0 : t0 + C] = v.to(self.dtype)
        self.tail_len[layer] = t0 + C

    def _begin_step(self, new_tokens: int) -> None:
        # A forward interrupted mid-way (Ctrl-C) leaves some layers ahead: drop its tokens.
        committed = min(self.tail_len)
        self.tail_len = [committed] * self.num_layers
        self.check_room(new_tokens)
        self.seal()
        self._ensure_tail_capacity(self.tail_len[0] + new_tokens)

    def _blocks_possible(self) -> int:
        """Most logical blocks a row can reach, if every new block were shared by all rows
        (with a host tier: the device's free blocks and the host's)."""
        avail = self.block_alloc.num_available()
        if avail is None:
            return 1 << 62
        if self.host_alloc is not None:
            avail += self.host_alloc.num_available()
        return max(self.num_blocks, self.config.sink_blocks) + avail

    def tokens_that_fit(self) -> int:
        """More tokens each row can take before the pools are full (assuming rows share
        new blocks; without sharing, divide the spare blocks among rows)."""
        possible = self._blocks_possible()
        return max(0, possible * self.block_size + self.block_size - 1 - self.seq_len())

    def check_room(self, new_tokens: int) -> None:
        """Raises CacheFullError, saying how many tokens still fit, where `new_tokens` more a row
        would need more blocks than the pools may hold."""
        needed = (self.seq_len() + new_tokens) // self.block_size
        if needed > self._blocks_possible():
            host = f" and host_blocks={self.config.host_blocks}" if self.host_alloc is not None else ""
            raise CacheFullError(
                f"cache full: {new_tokens} new tokens need {needed} blocks per row, but max_blocks="
                f"{self.config.max_blocks}{host} allow {self._blocks_possible()}; {self.tokens_that_fit()} more "
                f"tokens fit (now {self.seq_len()} per row). Nothing was lost.",
                self.tokens_that_fit(),
            )

    def _share_groups(self, groups: list[list[int]], start: int) -> list[list[int]]:
        """Split row groups so that rows stay together only if the block at tail offset
        `start` has identical K and V bytes in every layer. A per-row checksum (one
        reduction, one sync) keeps byte comparisons to rows that may be equal."""
        if all(len(g) == 1 for g in groups):  # nothing left to share (batch 1, or split rows)
            return groups
        P = self.block_size
        blocks = [(seg.tail_k[:, :, :, start : start + P], seg.tail_v[:, :, :, start : start + P]) for seg in self.segments]
        sigs = [(kb.float().sum(dim=(0, 2, 3, 4)) + 3.0 * vb.float().sum(dim=(0, 2, 3, 4))).tolist() for kb, vb in blocks]
        sig = [tuple(s[r] for s in sigs) for r in range(self.batch_size)]

        def equal(a: int, r: int) -> bool:
            return all(torch.equal(kb[:, r], kb[:, a]) and torch.equal(vb[:, r], vb[:, a]) for kb, vb in blocks)

        out = []
        for group in groups:
            reps: list[list[int]] = []
            for r in group:
                for rep in reps:
                    a = rep[0]
                    if sig[a] == sig[r] and equal(a, r):
                        rep.append(r)
                        break
                else:
                    reps.append([r])
            out.extend(reps)
        return out

    @_storage_op
    def seal(self) -> int:
        """Quantize every full tail block (all layers must hold the same tokens). Returns
        the number of logical blocks sealed per row."""
        if not self.initialized or self.batch_size == 0:
            return 0
        if len(set(self.tail_len)) != 1:
            raise RuntimeError(f"seal: layers hold different tail lengths {sorted(set(self.tail_len))}; finish the step first")
        P, T0 = self.block_size, self.tail_len[0]
        n = T0 // P
        if n == 0:
            return 0
        nb0 = self.num_blocks
        # 1. Decide sharing: rows with equal prefixes (same ids) and equal block bytes.
        by_prefix: dict[tuple, list[int]] = {}
        for r, row in enumerate(self.tables.rows):
            by_prefix.setdefault(tuple(row), []).append(r)
        groups = list(by_prefix.values())
        plan = []  # per new block: list of row groups
        for i in range(n):
            groups = self._share_groups(groups, i * P)
            plan.append(groups)
        n_sink_new = sum(len(g) for j, g in enumerate(plan) if nb0 + j < self.config.sink_blocks)
        n_quant_new = sum(len(g) for j, g in enumerate(plan) if nb0 + j >= self.config.sink_blocks)
        avail = self.block_alloc.num_available()
        if avail is not None and n_quant_new > avail and self.host is not None:
            if n_quant_new > self.config.max_blocks:
                raise ValueError(
                    f"sealing needs {n_quant_new} device blocks at once, more than max_blocks={self.config.max_blocks} "
                    f"hold; append fewer tokens a step (chunks of at most {self.config.max_blocks // self.batch_size * P} "
                    "tokens a row). Nothing was lost.")
            avail += self._spill(n_quant_new - avail)
        if avail is not None and n_quant_new > avail:
            fit = max(0, (avail + (self.host_alloc.num_available() if self.host is not None else 0)) // max(1, self.batch_size)) * P
            where = f"max_blocks={self.config.max_blocks}" + (f" and host_blocks={self.config.host_blocks}" if self.host is not None else "")
            moved = " (the host tier could take no more of the device's)" if self.host is not None else ""
            raise CacheFullError(
                f"cache full: sealing needs {n_quant_new} blocks, {avail} of {where} are free on the device{moved}; "
                f"{fit} more tokens per row fit. Nothing was lost.", fit)
        # 2. Check every layer's new blocks before changing any state (a NaN raises here: one
        # check of all layers' new blocks, one host sync per seal).
        rep_rows = [[g[0] for g in groups] for groups in plan]
        sink_sel = [(j, r) for j, reps in enumerate(rep_rows) if nb0 + j < self.config.sink_blocks for r in reps]
        quant_sel = [(j, r) for j, reps in enumerate(rep_rows) if nb0 + j >= self.config.sink_blocks for r in reps]
        blocks = {id(seg): (seg.tail_k[:, :, :, : n * P].unflatten(3, (n, P)), seg.tail_v[:, :, :, : n * P].unflatten(3, (n, P)))
                  for seg in self.segments}  # each [layers, B, H, n, P, D]
        if not all(bool(torch.isfinite(k).all() & torch.isfinite(v).all()) for k, v in blocks.values()):
            raise ValueError("cannot seal keys/values: some are NaN or Inf; the model produced non-finite values, nothing was sealed")
        # 3. Quantize every layer's new blocks straight into the pools at newly allocated
        # slots; the tables do not reference them yet, so a failure here frees the slots and
        # leaves the cache as it was.
        sink_ids = self.sink_alloc.allocate(n_sink_new)
        quant_ids = self.block_alloc.allocate(n_quant_new)
        try:
            self.grow_pools()
            if quant_sel:
                self._quantize_into(quant_sel, quant_ids, blocks)
        except BaseException:
            for alloc, new_ids in ((self.sink_alloc, sink_ids), (self.block_alloc, quant_ids)):
                for bid in new_ids:
                    alloc.decref(bid)
            raise
        # 4. Commit: tables, sinks, tails.
        si = qi = 0
        for j, groups in enumerate(plan):
            if nb0 + j < self.config.sink_blocks:
                ids = sink_ids[si : si + len(groups)]
                si += len(groups)
            else:
                ids = quant_ids[qi : qi + len(groups)]
                qi += len(groups)
            self.tables.push(groups, ids)
        rest = T0 - n * P
        for seg in self.segments:
            if sink_sel:
                js = _index([j for j, _ in sink_sel], seg.device)
                rs = _index([r for _, r in sink_sel], seg.device)
                ids = _index(sink_ids, seg.device)
                blocks_k, blocks_v = blocks[id(seg)]
                # [l, B, H, n, P, D] -> [B, n, l, H, P, D] -> picked [M, l, H, P, D] -> [l, M, H, P, D]
                seg.sink_k[:, ids] = blocks_k.permute(1, 3, 0, 2, 4, 5)[rs, js].transpose(0, 1)
                seg.sink_v[:, ids] = blocks_v.permute(1, 3, 0, 2, 4, 5)[rs, js].transpose(0, 1)
            if rest:
                seg.tail_k[:, :, :, :rest] = seg.tail_k[:, :, :, n * P : T0].clone()
                seg.tail_v[:, :, :, :rest] = seg.tail_v[:, :, :, n * P : T0].clone()
            if seg.tail_k.shape[3] > P:  # a long append's room goes back: between forwards the tails hold under a block
                seg.tail_k = seg.tail_k[:, :, :, :P].clone()
                seg.tail_v = seg.tail_v[:, :, :, :P].clone()
        self.tail_len = [rest] * self.num_layers
        self.seals += n_sink_new + n_quant_new
        old, self._tables = self._tables, {}
        hc = self.tables.host_columns  # (device tables skip the host columns)
        for device, table in old.items():
            if tuple(table.shape) == (len(self.tables.rows), nb0 - hc):  # append the n new columns
                new = _index([row[nb0:] for row in self.tables.rows], device, torch.int32).reshape(len(self.tables.rows), n)
                self._tables[device] = torch.cat([table, new], 1)
        if self.device_step is not None:  # the recorded steps' table: the new columns in place, or dropped when full
            step, nb = self.device_step, self.num_blocks - hc
            if nb <= step.table.shape[1]:
                step.table[:, nb0 - hc : nb] = self.block_table()[:, nb0 - hc : nb]
                step.count.fill_(nb)
            else:
                self.device_step = None
        return n

    def _spill(self, need: int) -> int:
        """Move the oldest device columns to the host tier until `need` device blocks are free,
        and a spill's worth more (1/16 of max_blocks) so that spills, and the graph
        recordings they end, stay rare. Returns the device blocks freed: fewer than `need`
        when the device holds too few sealed columns or the host tier is full (nothing moved
        then)."""
        t = self.tables
        want = need + max(1, self.config.max_blocks // 16)
        cols = freed = 0
        for j in range(t.host_upto, t.num_blocks):
            if freed >= want:
                break
            freed += len({row[j] for row in t.rows})
            cols += 1
        host_free = self.host_alloc.num_available()
        while cols and freed > host_free:  # (spill less, if that much does not fit the host)
            cols -= 1
            freed -= len({row[t.host_upto + cols] for row in t.rows})
        if freed < need:
            return 0
        self.host.prepare()  # (a failed pinned allocation raises here: nothing moved)
        self.host.store(t.spill(cols))
        self._tables = {}
        self.device_step = None
        return freed

    def _quantize_into(self, sel: list[tuple[int, int]], ids: list[int], blocks: dict) -> None:
        """Quantize the tail blocks sel = [(logical block j, row r)] of every layer (blocks:
        each segment's [layers, B, H, n, P, D]) into the pools at slots ids (one launch per
        layer on the triton backend)."""
        for seg in self.segments:
            slots = _index(ids, seg.device)
            if len(sel) == 1:  # the decode step's case: one block, read in place from the tail (a view)
                (j, r), = sel
                rs, js = slice(r, r + 1), j
            else:
                js = _index([j for j, _ in sel], seg.device)
                rs = _index([r for _, r in sel], seg.device)
            blocks_k, blocks_v = blocks[id(seg)]
            for i, layer in enumerate(seg.layers):  # blocks [B, H, n, P, D] -> [M, H, P, D]
                quantize_blocks_into(self.pages[layer], slots, blocks_k[i][rs, :, js], blocks_v[i][rs, :, js],
                                     backend=self.config.backend, checked=True)

    # ------------------------------------------------------------------ read
    def block_table(self, device: torch.device | None = None) -> torch.Tensor:
        """int32 [B, n] on `device` (default: the first layer's): the device-resident blocks of
        each row: the sinks' ids (sink_blocks columns, or fewer while the rows are shorter),
        then the device pages' ids; with a host tier the host columns between them are left
        out (n = num_blocks - host columns). One copy a device, kept until the tables change."""
        device = self.device if device is None else device
        table = self._tables.get(device)
        if table is None:
            t = self.tables
            rows = [row[: t.sink_blocks] + row[t.host_upto :] for row in t.rows] if t.host_columns else t.rows
            table = self._tables[device] = _index(rows, device, torch.int32).reshape(len(rows), self.num_blocks - t.host_columns)
        return table

    @contextlib.contextmanager
    def static_step(self, slot: torch.Tensor, length: torch.Tensor, start: torch.Tensor | None = None):
        """Within: a decode step (one token a row) is recorded for CUDA-graph replays. append
        writes each layer's token at tail slot `slot` (int64 [1] on the device) and view gives
        the tail's first block_size slots with `length` (int32 [1], the tail's length after
        the step's append) as its device-side tail_len. Whoever replays keeps both at the
        step's values (the host's tail lengths at entry) and advances them, and the host's
        tail lengths, by one a replay. The host's tail lengths are restored on exit: the
        recorded step has not run. Needs a tail shorter than a block (seal first), so
        that the step neither seals nor outgrows the slots the view gives.

        start (int32 [B] on the device, or None): each row's first attended position (left
        padding), which `attend` takes where it is given none: a recorded step has no
        attention mask to read it from (reading one waits on the host)."""
        if not self.initialized or self.batch_size == 0:
            raise RuntimeError("static_step: the cache holds no rows yet; prefill first")
        self._one_device("static_step")
        if len(set(self.tail_len)) != 1 or self.tail_len[0] >= self.block_size:
            raise RuntimeError(f"static_step: tails of {sorted(set(self.tail_len))} tokens; a step records on equal tails shorter than a block (seal first)")
        if slot.dtype != torch.int64 or length.dtype != torch.int32 or slot.numel() != 1 or length.numel() != 1:
            raise ValueError(f"static_step: slot must be int64 [1] and length int32 [1], got {slot.dtype} {tuple(slot.shape)}, {length.dtype} {tuple(length.shape)}")
        if start is not None and (start.dtype != torch.int32 or tuple(start.shape) != (self.batch_size,) or start.device != self.device):
            raise ValueError(f"static_step: start must be int32 [{self.batch_size}] on {self.device}, got {start.dtype} {tuple(start.shape)} on {start.device}")
        saved = list(self.tail_len)
        self.graph_table()  # built now: built inside a capture, its host copy would be replayed
        step = self.device_step
        step.slot, step.length, step.start = slot, length, start
        try:
            yield
        finally:
            step.slot = step.length = step.start = None
            self.tail_len = saved

    def graph_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table recorded steps read (`static_step`): int32 [B, width] on the device,
        its first num_blocks columns block_table()'s and the rest room (GRAPH_ROOM), and the
        block count, int32 [1] on the device. Seals write their columns into it in place and
        advance the count, so that a CUDA graph's step outlives them; a reorder of as many
        rows moves its rows in place. When it is full, when the row count changes, and on a
        crop or reset, it is dropped and the next call makes a new one (so does a graph
        decoder: a new table is a new recording)."""
        self._one_device("graph_table")
        nb = self.num_blocks - self.tables.host_columns
        if self.device_step is None:
            width = max(1, nb + max(GRAPH_ROOM[0], nb // GRAPH_ROOM[1]))
            with torch.inference_mode(False):  # (plain tensors: seals write them in or out of inference mode)
                table = torch.zeros(self.batch_size, width, dtype=torch.int32, device=self.device)
                count = torch.zeros(1, dtype=torch.int32, device=self.device)
            table[:, :nb] = self.block_table()
            count.fill_(nb)
            self.device_step = DeviceStep(table, count)
        return self.device_step.table, self.device_step.count

    def _one_device(self, what: str) -> None:
        if len(self.devices) > 1:
            raise RuntimeError(f"{what}: the cache's layers live on {', '.join(map(str, self.devices))}; a recorded step "
                               "runs on one device")

    def view(self, layer: int) -> PagedView:
        """The device-resident part of `layer`: sinks, device pages (`block_table`) and tail.
        Without host columns that is the whole sequence at its positions; with them, the view
        skips them (`attend` shifts `start` to match and merges the host part)."""
        # (a recorded step: the graph table and its count, the tail's block of slots and its
        # length, all on the device; the kernel clamps the sinks to the count)
        step = self.device_step
        static = step is not None and step.recording
        seg, i = self._where[layer]
        t = self.block_size if static else self.tail_len[layer]
        table, count = (step.table, step.count) if static else (self.block_table(seg.device), None)
        S, hc = self.config.sink_blocks, self.tables.host_columns
        shared = self.tables.shared_runs[1]
        return PagedView(
            pages=self.pages[layer],
            sink_k=seg.sink_k[i],
            sink_v=seg.sink_v[i],
            block_table=table,
            n_sink=S if static else min(S, self.num_blocks),
            tail_k=seg.tail_k[i, :, :, :t],
            tail_v=seg.tail_v[i, :, :, :t],
            tail_len=step.length if static else None,
            n_blocks=count,
            shared=shared if shared <= S or not hc else S + max(0, shared - S - hc),
            shared_run=self.tables.shared_runs[0],
        )

    def attend(self, layer: int, q: torch.Tensor, start: torch.Tensor | None = None, scale: float | None = None, return_lse: bool = True):
        """Attention of q [B, H_q, C, D] (the last C tokens of `layer`) over this layer's
        pages and tail: (out [B, H_q, C, D], lse [B, H_q, C]). start: each row's first
        attended position (None: 0, or within `static_step` the start it was given). With host
        columns: the device part (its view skips them, so `start` moves with the positions)
        and the host tier's slices, merged by LSE (exact up to fp32 rounding)."""
        if start is None and self.device_step is not None and self.device_step.recording:
            start = self.device_step.start
        hc = self.tables.host_columns
        if not hc:
            return paged_attention(q, self.view(layer), start=start, scale=scale, backend=self.config.backend, return_lse=return_lse)
        P, S = self.block_size, self.config.sink_blocks
        moved = None if start is None else torch.where(start < S * P, start, (start - hc * P).clamp(min=S * P)).to(start.dtype)
        parts = [paged_attention(q, self.view(layer), start=moved, scale=scale, backend=self.config.backend)]
        backend = "auto" if self.config.backend in ("flex", "flash") else self.config.backend  # (host slices have no tail)
        parts += self.host.parts(layer, q, start, scale, backend)
        out, lse = merge_partials(parts)
        return out.to(q.dtype), (lse if return_lse else None)

    def dense(self, layer: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All of `layer`'s keys and values, dequantized: [B, H_kv, seq_len(layer), D]."""
        view = self.view(layer)
        dtype = dtype or self.dtype
        k, v = gather_dequant(view, out_dtype=dtype)
        t = self.tables
        if t.host_columns:  # (the host columns go between the sinks and the device pages)
            hk, hv = gather_dequant(self.host.columns(layer, t.sink_blocks, t.host_upto), out_dtype=dtype)
            n = t.sink_blocks * self.block_size
            k, v = torch.cat([k[:, :, :n], hk, k[:, :, n:]], 2), torch.cat([v[:, :, :n], hv, v[:, :, n:]], 2)
        return torch.cat([k, view.tail_k.to(dtype)], 2), torch.cat([v, view.tail_v.to(dtype)], 2)

    # ------------------------------------------------------------------ rows
    @_storage_op
    def select_rows(self, indices) -> None:
        """Rows become copies of rows[indices]: reorder (beams), fork, drop, repeat. Copies
        block ids (refcounts) and the tails only, never a sealed block's bytes. With as many
        rows as before (beam search's reorder, every step) the tails' tokens and the graph
        table's rows move in place, so a decode graph's addresses stay valid."""
        if not self.initialized or self.batch_size == 0:
            return
        idx = torch.as_tensor(indices, dtype=torch.long).flatten()
        picked = idx.tolist()  # (one read back where the indices are on the device: beam search's, every step)
        if picked == list(range(self.batch_size)):
            return
        runs, rows = self.tables.shared_runs, self.batch_size
        self.tables.select(picked)
        if self.host is not None and (len(picked) != rows or self.tables.common < self.tables.host_upto):
            self.host.invalidate()  # (the rows' host columns changed, unless every row holds them alike)
        on = {device: idx.to(device) for device in self.devices}
        # (the tables' rows follow on each device: rebuilt from the host's lists, 2,048 ids cost ~0.3 ms of host time)
        self._tables = {device: table.index_select(0, on[device]) for device, table in self._tables.items()}
        if idx.numel() == rows:  # as many rows (beams each step): in place, the tokens the tails hold only
            t = max(self.tail_len)  # (a prefill's chunk may have left room for thousands)
            for seg in self.segments:
                if t:
                    seg.tail_k[:, :, :, :t] = seg.tail_k[:, :, :, :t].index_select(1, on[seg.device])
                    seg.tail_v[:, :, :, :t] = seg.tail_v[:, :, :, :t].index_select(1, on[seg.device])
            if self.device_step is not None:  # (its rows follow: a decode graph goes on)
                table = self.device_step.table
                table.copy_(table.index_select(0, on[self.device]))
                now = self.tables.shared_runs
                if now[0] != runs[0] or now[1] < runs[1]:  # (a recorded step reads each run's shared blocks once: record anew)
                    self.device_step = None
            return
        for seg in self.segments:
            seg.tail_k = seg.tail_k.index_select(1, on[seg.device])
            seg.tail_v = seg.tail_v.index_select(1, on[seg.device])
        self.device_step = None

    def reorder(self, beam_idx) -> None:
        self.select_rows(beam_idx)

    def fork(self, row: int) -> int:
        """Append a copy of `row` (sharing its sealed blocks); returns the new row's index."""
        self.select_rows(list(range(self.batch_size)) + [row])
        return self.batch_size - 1

    def free(self, row: int) -> None:
        """Drop `row`, returning blocks no other row holds."""
        if not 0 <= row < self.batch_size:
            raise IndexError(f"free: row {row} out of range for {self.batch_size} rows")
        self.select_rows([r for r in range(self.batch_size) if r != row])

    @_storage_op
    def crop(self, max_len: int) -> None:
        """Keep the first `max_len` tokens of every row. A block cut in the middle is
        dequantized back into the tail (its kept tokens lose nothing more than they had)."""
        if max_len < 0:
            raise ValueError(f"crop: max_len must be >= 0, got {max_len}")
        if not self.initialized or max_len >= self.seq_len():
            return
        self.tail_len = [min(self.tail_len)] * self.num_layers
        P, nb = self.block_size, self.num_blocks
        if max_len >= nb * P:
            self.tail_len = [max_len - nb * P] * self.num_layers
            return
        keep_blocks, keep = divmod(max_len, P)
        if keep:  # (the cut block alone, read from its tier)
            t, j = self.tables, keep_blocks
            for l in range(self.num_layers):
                if t.sink_blocks <= j < t.host_upto:
                    view = self.host.columns(l, j, j + 1)
                else:
                    view = self.view(l)
                    c = j if j < t.sink_blocks else j - t.host_columns
                    view.block_table = view.block_table[:, c : c + 1]
                    view.n_sink = int(j < t.sink_blocks)
                    view.shared = 0
                k, v = gather_dequant(view, out_dtype=self.dtype)
                tail_k, tail_v = self.tails(l)
                tail_k[:, :, :keep] = k[:, :, :keep]
                tail_v[:, :, :keep] = v[:, :, :keep]
        self.tables.truncate(keep_blocks)
        self.tail_len = [keep] * self.num_layers
        self._tables = {}
        self.device_step = None
        if self.host is not None:
            self.host.invalidate()

    def reset(self) -> None:
        """Drop every row and token; pools keep their memory for reuse."""
        self.tables.clear()
        self.tail_len = [0] * self.num_layers
        self._tables = {}
        self.device_step = None
        if self.host is not None:
            self.host.invalidate()

    # ------------------------------------------------------------------ report
    @_storage_op
    def memory_report(self) -> MemoryReport:
        """Tokens, blocks and bytes by kind and tier (full tail blocks are sealed first)."""
        if self.initialized and self.batch_size and len(set(self.tail_len)) == 1:
            self.seal()
        return memory_report(self)
