"""`bench prefill`: per-layer time of a prompt's last prefill chunk, by each of longctx's
prefill paths (sealing included), against SDPA over dense bf16."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .common import bench_setup, time_calls


@dataclass
class PrefillRow:
    name: str
    context: int  # tokens in the cache after the chunk
    chunk: int
    ms: float  # one layer: seal the chunk's blocks (longctx) + attention of the chunk
    ratio_to_sdpa: float = float("nan")

    @property
    def tok_per_s(self) -> float:
        return self.chunk / (self.ms / 1e3)

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_per_s": self.tok_per_s}


def bench_prefill(contexts=(32768, 131072), chunks=(16384,), formats=("int4", "int8"), shape: str = "llama-3-8b", block_size: int = 64,
                  reps: int = 5, device: str = "cuda", progress=None, paths=("kernel", "staged")) -> list[PrefillRow]:
    """Per-layer time of the last prefill chunk of a `context`-token prompt, for each chunk
    length: longctx appends the chunk, attends over the pages and seals the chunk's blocks, by
    each prefill path (the kernel over the pages; staging the past densely, then SDPA's flash
    kernel); the peer is SDPA (flash, lower-right causal) over dense bf16 K/V, as
    DynamicCache + SDPA prefill runs."""
    from ..cache import PagedKVCache
    from ..ops.paged_attention.prefill import sdpa_lower_right

    for path in paths:
        if path not in ("kernel", "staged"):
            raise ValueError(f"prefill paths are 'kernel' and 'staged', got {path!r}")
    if any(T < 1 for T in contexts):
        raise ValueError(f"prefill contexts must be at least 1 token, got {list(contexts)}")
    if any(c < 2 for c in chunks):  # chunks longer than a context are cut to it
        raise ValueError(f"prefill chunks must be at least 2 tokens (one token is a decode step), got {list(chunks)}")
    cfgs, Hq, H, D = bench_setup("prefill", formats, block_size, shape)
    rows: list[PrefillRow] = []
    for T in contexts:
        g = torch.Generator(device=device).manual_seed(T)
        k = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
        for C in sorted({min(c, T) for c in chunks}):
            q = torch.randn(1, Hq, C, D, device=device, dtype=torch.bfloat16, generator=g)
            case = [PrefillRow("SDPA dense bf16 (flash)", T, C, time_calls(lambda _, q=q: sdpa_lower_right(q, k, v), 1, reps))]
            for name, cfg in cfgs.items():
                cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=H, head_dim=D)
                cache.append(0, k[:, :, : T - C], v[:, :, : T - C])
                cache.seal()
                for path in paths:
                    case.append(PrefillRow(f"longctx {cfg.describe()} ({path})", T, C, _time_chunk(cache, path, q, k, v, T, C, reps)))
                cache.reset()
                del cache
                torch.cuda.empty_cache()
            for r in case:
                r.ratio_to_sdpa = case[0].ms / r.ms
            rows.extend(case)
            if progress is not None:
                progress(case)
            del q
        del k, v
        torch.cuda.empty_cache()
    return rows


def _time_chunk(cache, path: str, q, k, v, T: int, C: int, reps: int) -> float:
    """Median ms of (append the chunk, attend by `path`, seal) on a cache holding T - C tokens."""
    from ..ops.paged_attention.tuning import TUNE

    saved = TUNE["prefill"]
    TUNE["prefill"] = path
    try:
        ts = []
        for i in range(reps + 1):  # the first compiles
            cache.crop(T - C)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            cache.append(0, k[:, :, T - C :], v[:, :, T - C :])
            cache.attend(0, q, start=None, return_lse=False)
            cache.seal()
            e.record()
            torch.cuda.synchronize()
            if i:
                ts.append(s.elapsed_time(e))
    finally:
        TUNE["prefill"] = saved
    ts.sort()
    return ts[len(ts) // 2]
