"""Decode-attention benchmark: longctx formats against peer kernels, in one process.

Per-layer time of one decode step (q_len=1), the median over repetitions of a loop over
enough copies of the layer's KV (distinct memory) that the working set is far larger than
L2. Peers: SDPA over dense bf16 K/V (PyTorch's flash kernel) and "dequantize everything,
then SDPA" (how Hugging Face's QuantizedCache reads its cache). Results are dataclasses;
the CLI renders them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch

from .config import KVConfig
from .errors import BackendUnavailableError
from .ops.pages import Pages, PagedView
from .quant import BlockFormat

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128)
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64)
SHAPES = {"llama-3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2}


@dataclass
class DecodeRow:
    name: str  # format or peer
    context: int
    batch: int
    ms: float  # per layer, median
    kv_bytes: int  # bytes of K/V (codes, scales, dense) one step must read
    ratio_to_sdpa: float = float("nan")  # SDPA dense bf16 time / this time (>1: faster)

    @property
    def tb_per_s(self) -> float:
        return self.kv_bytes / (self.ms / 1e3) / 1e12

    def as_dict(self) -> dict:
        return {**asdict(self), "tb_per_s": self.tb_per_s}


def synthetic_view(batch: int, context: int, kv_heads: int, head_dim: int, cfg: KVConfig, device, dtype=torch.bfloat16, seed: int = 0) -> PagedView:
    """A paged batch of `context` tokens per row with random codes and scales: one sink
    block, sealed blocks at shuffled pool slots, and a half-full tail."""
    cfg = cfg.resolve(1, head_dim)
    P, H, D = cfg.block_size, kv_heads, head_dim
    g = torch.Generator(device="cpu").manual_seed(seed)
    tail = P // 2
    n_blocks = max(1, (context - tail) // P)
    fmt = BlockFormat(*cfg.layer_bits(0), P, cfg.group_size, D, H, dtype, cfg.rotate)
    n = batch * n_blocks
    pages = Pages(fmt)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(dtype).to(device)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)

    if fmt.k_bits == 16:
        pages.k = rnd(n, H, P, D)
    else:
        pages.k_codes = codes(n, H, P, D * fmt.k_bits // 8)
        pages.k_scale, pages.k_zero = rnd(n, H, D).abs() * 0.1, rnd(n, H, D)
    if fmt.v_bits == 16:
        pages.v = rnd(n, H, P, D)
    else:
        pages.v_codes = codes(n, H, P, D * fmt.v_bits // 8)
        pages.v_scale, pages.v_zero = rnd(n, H, P, D // fmt.group_size).abs() * 0.1, rnd(n, H, P, D // fmt.group_size)
    table = torch.randperm(n, generator=g).to(torch.int32).reshape(batch, n_blocks)
    ns = min(cfg.sink_blocks, n_blocks)
    table[:, :ns] = torch.arange(batch * ns, dtype=torch.int32).reshape(batch, ns)
    sink_k, sink_v = rnd(max(1, batch * ns), H, P, D), rnd(max(1, batch * ns), H, P, D)
    return PagedView(pages, sink_k, sink_v, table.to(device), ns, rnd(batch, H, tail, D), rnd(batch, H, tail, D))


def view_bytes(view: PagedView) -> int:
    """Bytes a decode step reads: every sealed block's data, sinks and tail."""
    n_tokens_blocks = view.block_table.numel()
    per_block = view.pages.fmt.block_bytes()
    ns = view.n_sink * view.block_table.shape[0]
    b = (n_tokens_blocks - ns) * sum(per_block.values())
    b += ns * 2 * view.sink_k[0].numel() * view.sink_k.element_size()
    b += 2 * view.tail_k.numel() * view.tail_k.element_size()
    return b


def _time(fn, copies: int, reps: int) -> float:
    """Median ms of one call, timing loops over all copies with CUDA events."""
    for i in range(min(copies, 3)):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(copies):
            fn(i)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / copies)
    ts.sort()
    return ts[len(ts) // 2]


def _copies(bytes_per_copy: int, target: int = 3 * 1024**3) -> int:
    return max(2, min(32, math.ceil(target / max(1, bytes_per_copy))))


def bench_decode(
    contexts=(4096, 32768, 131072, 524288),
    batches=(1,),
    formats=("int4", "int8", "bf16"),
    shape: str = "llama-3-8b",
    block_size: int = 64,
    peers: bool = True,
    reps: int = 20,
    device: str = "cuda",
    progress=None,
) -> list[DecodeRow]:
    """Per-layer decode latency of each format and peer, for every (context, batch)."""
    import torch.nn.functional as F

    from .ops.gather_dequant import gather_dequant
    from .ops.paged_attention import paged_attention

    if not torch.cuda.is_available():
        raise BackendUnavailableError("bench decode needs a CUDA GPU; this machine has none")
    dims = SHAPES[shape]
    Hq, H, D = dims["heads"], dims["kv_heads"], dims["head_dim"]
    presets = {"bf16": KVConfig(bits=16), "int8": KVConfig(bits=8), "int4": KVConfig(bits=4), "k8v4": KVConfig(bits=4, k_bits=8),
               "int2": KVConfig(bits=2, rotate=True), "int4+rot": KVConfig(bits=4, rotate=True)}
    rows: list[DecodeRow] = []
    for B in batches:
        for T in contexts:
            q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
            case: list[DecodeRow] = []
            dense_bytes = 2 * B * T * H * D * 2
            if peers:
                L = _copies(dense_bytes)
                kvs = [(torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16), torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)) for _ in range(L)]
                ms = _time(lambda i: F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], enable_gqa=True), L, reps)
                case.append(DecodeRow("SDPA dense bf16", T, B, ms, dense_bytes))
                del kvs
            for name in formats:
                cfg = dataclasses.replace(presets[name], block_size=block_size) if name in presets else None
                if cfg is None:
                    raise ValueError(f"unknown format {name!r}; choose from {', '.join(presets)}")
                one = synthetic_view(B, T, H, D, cfg, device)
                L = _copies(view_bytes(one))
                views = [one] + [synthetic_view(B, T, H, D, cfg, device, seed=i) for i in range(1, L)]
                ms = _time(lambda i: paged_attention(q, views[i], backend="triton", return_lse=False), L, reps)
                case.append(DecodeRow(f"longctx {cfg.describe()}", T, B, ms, view_bytes(one)))
                if peers and name == "int4":
                    def deq_all(i):
                        k, v = gather_dequant(views[i], out_dtype=torch.bfloat16)
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                    ms = _time(deq_all, L, max(3, reps // 4))
                    case.append(DecodeRow("dequantize-all then SDPA (int4)", T, B, ms, view_bytes(one)))
                del views, one
                torch.cuda.empty_cache()
            base = next((r.ms for r in case if r.name == "SDPA dense bf16"), float("nan"))
            for r in case:
                r.ratio_to_sdpa = base / r.ms
            rows.extend(case)
            if progress is not None:
                progress(case)
    return rows
