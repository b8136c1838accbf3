"""Quantized pages -> dense keys/values (prefill, and 16-bit callers such as eager/SDPA).

Public entry: `gather_dequant(view, backend=...)`. Tests: tests/ops/test_gather_dequant_triton.py (kernel vs reference), tests/ops/test_paged_attention.py.
"""

from __future__ import annotations

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
