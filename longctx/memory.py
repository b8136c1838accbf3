"""Memory accounting of a PagedKVCache: what it stores, by kind and tier, per token.

`memory_report(cache)` reads the cache's tables and formats; it counts stored data
(sealed blocks, sink blocks, tail tokens held) and, apart, what the tensors reserve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class MemoryReport:
    """What the cache holds. Bytes count stored data: sealed blocks (codes, scales, 16-bit
    pages), sink blocks and the tail tokens held; `reserved_bytes` is what the tensors
    occupy on the compute device (growth slack, tail capacity and staging included), and
    `host_reserved_bytes` what the host tier pins."""

    tokens: int  # per row
    rows: int
    blocks: dict[str, int]  # physical blocks in use: {"sink": n, "quantized": n, "dense": n}
    bytes_by_kind: dict[str, int]  # codes, scales, dense_pages, sinks, tails
    bytes_by_tier: dict[str, int]  # "device" (the compute device's memory: `device` names it) and "host"
    total_bytes: int
    reserved_bytes: int  # on the compute device (pools, sinks, tails, staging)
    bytes_per_token: float  # total_bytes / (rows * tokens)
    bf16_bytes_per_token: int  # a bf16 cache of the same model: K and V, all layers
    device: str = ""
    format: str = ""
    layers: int = 0
    host_reserved_bytes: int = 0  # the host tier's pinned pools
    # a model split over several devices: the device tier's bytes held, and reserved, on each
    bytes_by_device: dict[str, int] = field(default_factory=dict)
    reserved_by_device: dict[str, int] = field(default_factory=dict)

    @property
    def ratio_to_bf16(self) -> float:
        return self.bytes_per_token / self.bf16_bytes_per_token if self.tokens else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio_to_bf16"] = self.ratio_to_bf16
        return d

    def __str__(self) -> str:
        """A few readable lines: what is held, where, and what a token costs against bf16."""
        if not self.tokens:
            return f"KV cache ({self.format}, {self.layers} layers): empty"
        kinds = ", ".join(f"{kind} {_mib(n)}" for kind, n in self.bytes_by_kind.items() if n)

        def place(tier: str, n: int) -> str:
            if tier == "device" and len(self.bytes_by_device) > 1:
                return ", ".join(f"{d} {_mib(b)}" for d, b in self.bytes_by_device.items())
            return f"{self.device if tier == 'device' else tier} {_mib(n)}"

        tiers = ", ".join(place(tier, n) for tier, n in self.bytes_by_tier.items() if n)
        return (f"KV cache ({self.format}, {self.layers} layers): {self.tokens:,} tokens x {self.rows} row{'s' * (self.rows != 1)}\n"
                f"  blocks: {self.blocks['sink']} sink, {self.blocks['quantized']} quantized, {self.blocks['dense']} 16-bit\n"
                f"  holds {_mib(self.total_bytes)} ({kinds}) on {tiers}; reserves {_mib(self.reserved_bytes)}"
                + (f" + {_mib(self.host_reserved_bytes)} pinned host" if self.host_reserved_bytes else "") + "\n"
                f"  {self.bytes_per_token:,.0f} bytes a token, {self.ratio_to_bf16:.3f}x a bf16 cache's {self.bf16_bytes_per_token:,}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def memory_report(cache) -> MemoryReport:
    """Build the MemoryReport of a PagedKVCache as it stands (call cache.memory_report()
    to seal full tail blocks first)."""
    L, H, P, D = cache.num_layers, cache.num_kv_heads, cache.block_size, cache.head_dim
    bf16_bpt = L * 2 * H * D * 2
    if not cache.initialized:
        return MemoryReport(0, 0, {"sink": 0, "quantized": 0, "dense": 0}, {}, {"device": 0, "host": 0}, 0, 0, 0.0, bf16_bpt, layers=L, format=cache.config.describe())
    e = cache.formats[0].elem_bytes
    sink_ids, device_ids, host_ids = cache.tables.unique_ids()
    n_blocks = len(device_ids) + len(host_ids)  # (two id spaces)
    kinds = {"codes": 0, "scales": 0, "dense_pages": 0, "sinks": 0, "tails": 0}
    tiers = {"device": 0, "host": 0}  # (the device tier is the compute device's memory, whatever it is)
    per_block = {"codes": 0, "scales": 0, "dense": 0}  # one block id, summed over layers
    for fmt in cache.formats:
        for kind, n in fmt.block_bytes().items():
            per_block[kind] += n
    block_bytes = sum(per_block.values())
    tiers["device"] += block_bytes * len(device_ids)
    tiers["host"] += block_bytes * len(host_ids)
    kinds["codes"] = per_block["codes"] * n_blocks
    kinds["scales"] = per_block["scales"] * n_blocks
    kinds["dense_pages"] = per_block["dense"] * n_blocks
    sink_bytes = len(sink_ids) * L * 2 * H * P * D * e
    kinds["sinks"] = sink_bytes
    tail_bytes = cache.batch_size * L * 2 * H * min(cache.tail_len) * D * e
    kinds["tails"] = tail_bytes
    tiers["device"] += sink_bytes + tail_bytes
    total = sum(kinds.values())
    by_device: dict[str, int] = {}
    reserved_by: dict[str, int] = {}
    tail = min(cache.tail_len)
    for layer, (fmt, pages) in enumerate(zip(cache.formats, cache.pages)):
        d = str(cache.layer_device(layer))
        by_device[d] = by_device.get(d, 0) + sum(fmt.block_bytes().values()) * len(device_ids) + \
            (len(sink_ids) * P + cache.batch_size * tail) * 2 * H * D * e
        reserved_by[d] = reserved_by.get(d, 0) + sum(t.numel() * t.element_size() for t in pages.tensors().values())
    for seg in cache.segments:
        d = str(seg.device)
        reserved_by[d] += sum(t.numel() * t.element_size() for t in (seg.sink_k, seg.sink_v, seg.tail_k, seg.tail_v))
    host_reserved, staging = cache.host.reserved_bytes() if cache.host is not None else (0, {})
    for d, n in staging.items():
        reserved_by[d] += n
    reserved = sum(reserved_by.values())
    tokens, rows = cache.seq_len(), cache.batch_size
    n_dense = sum(1 for f in cache.formats if f.k_bits == 16 and f.v_bits == 16)
    return MemoryReport(
        tokens=tokens,
        rows=rows,
        blocks={"sink": len(sink_ids), "quantized": n_blocks if n_dense < L else 0, "dense": n_blocks if n_dense == L else 0},
        bytes_by_kind=kinds,
        bytes_by_tier=tiers,
        total_bytes=total,
        reserved_bytes=reserved,
        bytes_per_token=total / (tokens * rows) if tokens and rows else 0.0,
        bf16_bytes_per_token=bf16_bpt,
        device=", ".join(map(str, cache.devices)),
        format=cache.config.describe(),
        layers=L,
        host_reserved_bytes=host_reserved,
        bytes_by_device=by_device,
        reserved_by_device=reserved_by,
    )
