"""Quantized pages -> dense keys/values (prefill, and 16-bit callers such as eager/SDPA), or
-> 16-bit pages in flash-attn's paged layout (the `flash` backend).

Public entries: `gather_dequant(view, backend=...)`, `gather_dequant_pages(view, ...)`.
Tests: tests/ops/test_gather_dequant_triton.py (kernel vs reference), tests/ops/test_paged_attention.py.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backend import resolve_backend
from ..pages import PagedView


def gather_dequant(view: PagedView, backend: str = "auto", out_dtype: torch.dtype | None = None, extra: int = 0):
    """Dense (k, v), each [B, H_kv, n_blocks*P + extra, D], unrotated, in `out_dtype` (default:
    the pages' dtype). The tail is not included (it is already dense); `extra` positions are
    left unwritten after the past, for a caller that appends the tail (one staging buffer,
    no concatenation). backend: "auto" (triton on CUDA), "triton" or "reference"."""
    if view.block_table.dim() != 2:
        raise ValueError(f"gather_dequant: block_table must be [B, n_blocks], got {tuple(view.block_table.shape)}")
    if extra < 0:
        raise ValueError(f"gather_dequant: extra must be >= 0, got {extra}")
    dtype = out_dtype or view.pages.fmt.dtype
    match resolve_backend(backend, view.block_table, view.pages.fmt.head_dim, storage=True):
        case "reference":
            from .reference import gather_dequant_reference

            k, v = gather_dequant_reference(view, dtype)
            if extra:
                pad = k.new_empty(k.shape[0], k.shape[1], extra, k.shape[3])
                k, v = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
            return k, v
        case "triton":
            from .triton import gather_dequant_triton

            B, n = view.block_table.shape
            fmt = view.pages.fmt
            shape = (B, fmt.num_kv_heads, n * fmt.block_size + extra, fmt.head_dim)
            k = torch.empty(shape, dtype=dtype, device=view.block_table.device)
            v = torch.empty_like(k)
            gather_dequant_triton(view, k, v)
            return k, v


@dataclasses.dataclass(frozen=True)
class FlashPages:
    """16-bit pages in flash-attn's paged KV layout (`flash_attn_with_kvcache(block_table=...)`).

    k, v:        [B * m, page_size, H_kv, D]; row b owns pages b*m .. b*m + m - 1.
    block_table: int32 [B, m], those page ids.
    seqlens:     int32 [B], how many tokens row b holds, from its first page's slot 0 on; the
                 slots after them are unwritten.
    """

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor


def gather_dequant_pages(
    view: PagedView,
    blocks: range | None = None,
    start: torch.Tensor | None = None,
    page_size: int = 256,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> FlashPages:
    """Logical blocks `blocks` (a step-1 range, default all) of every row's sealed past,
    dequantized and unrotated, as `page_size`-token pages of `out_dtype` (default the pages'
    dtype) in flash-attn's layout. Left padding is dropped: row b keeps its tokens at positions
    >= start[b] (None: all), in order, packed from slot 0 of its first page, and
    seqlens[b] counts them. Keys and values of one token share a slot, so attention over
    the pages without a causal mask equals attention over those tokens. flash-attn 2 needs
    page_size to be a multiple of 256. backend: "auto" (triton on CUDA), "triton" or
    "reference"."""
    n = view.block_table.shape[1]
    blocks = range(n) if blocks is None else blocks
    if not isinstance(blocks, range) or blocks.step != 1 or not 0 <= blocks.start <= blocks.stop <= n:
        raise ValueError(f"gather_dequant_pages: blocks must be a step-1 range within 0..{n}, got {blocks}")
    if page_size < 1:
        raise ValueError(f"gather_dequant_pages: page_size must be >= 1, got {page_size}")
    fmt = view.pages.fmt
    B, P, H, D = view.block_table.shape[0], fmt.block_size, fmt.num_kv_heads, fmt.head_dim
    dtype = out_dtype or fmt.dtype
    device = view.block_table.device
    if start is not None and (start.dim() != 1 or start.shape[0] != B):
        raise ValueError(f"gather_dequant_pages: start must be [B={B}], got {tuple(start.shape)}")
    first, tokens = blocks.start * P, len(blocks) * P
    # tokens of the range before start[b] are left padding: the shift that drops them
    shift = torch.zeros(B, dtype=torch.int32, device=device) if start is None else (start.to(device).long() - first).clamp(0, tokens).to(torch.int32)
    seqlens = (tokens - shift).to(torch.int32)
    m = max(1, -(-tokens // page_size))
    buf_k = torch.empty(B, m * page_size, H, D, dtype=dtype, device=device)
    buf_v = torch.empty_like(buf_k)
    if tokens:
        part = dataclasses.replace(view, block_table=view.block_table[:, blocks.start : blocks.stop], n_sink=max(0, min(view.n_sink, n) - blocks.start))
        match resolve_backend(backend, view.block_table, D, storage=True):
            case "reference":
                from .reference import gather_dequant_reference

                k, v = gather_dequant_reference(part, dtype)  # [B, H, tokens, D]
                for b in range(B):  # (a copy a row: the reference serves tests, the CPU and head_dims the kernel does not take)
                    s = int(shift[b])
                    buf_k[b, : tokens - s] = k[b, :, s:].transpose(0, 1)
                    buf_v[b, : tokens - s] = v[b, :, s:].transpose(0, 1)
            case "triton":
                from .triton import gather_dequant_triton

                gather_dequant_triton(part, buf_k.transpose(1, 2), buf_v.transpose(1, 2), shift=shift)
    table = torch.arange(B * m, dtype=torch.int32, device=device).view(B, m)
    return FlashPages(buf_k.view(B * m, page_size, H, D), buf_v.view(B * m, page_size, H, D), table, seqlens)
