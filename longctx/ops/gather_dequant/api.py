"""Quantized pages -> dense keys/values (prefill, and 16-bit callers such as eager/SDPA).

Public entry: `gather_dequant(view, backend=...)`. Tests: tests/ops/test_gather_dequant.py.
"""

from __future__ import annotations

import torch

from ...errors import BackendUnavailableError
from ..pages import PagedView


def gather_dequant(view: PagedView, backend: str = "auto", out_dtype: torch.dtype | None = None):
    """Dense (k, v), each [B, H_kv, n_blocks*P, D], unrotated, in `out_dtype` (default: the
    pages' dtype). The tail is not included: it is already dense."""
    if view.block_table.dim() != 2:
        raise ValueError(f"gather_dequant: block_table must be [B, n_blocks], got {tuple(view.block_table.shape)}")
    match backend:
        case "auto" | "reference":
            from .reference import gather_dequant_reference

            return gather_dequant_reference(view, out_dtype or view.pages.fmt.dtype)
        case _:
            raise BackendUnavailableError(f"gather_dequant has no backend {backend!r}; available: 'reference'")
