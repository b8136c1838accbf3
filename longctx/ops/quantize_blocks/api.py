"""Seal full tail blocks: unquantized [N, H_kv, P, D] -> the stored form of `Pages`.

Public entry: `quantize_blocks(k, v, fmt, backend=...)`. Tests: tests/ops/test_quantize_blocks.py.
"""

from __future__ import annotations

import torch

from ...quant import BlockFormat
from ..backend import resolve_backend
from ..pages import Pages


def quantize_blocks(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat, backend: str = "auto", checked: bool = False) -> dict[str, torch.Tensor]:
    """Quantize N full blocks.

    k, v: [N, H_kv, P, D] in fmt.dtype (P = fmt.block_size, D = fmt.head_dim).
    Returns the fields of `Pages` for these N blocks (k or k_codes/k_scale/k_zero, and the
    same for v), ready to be written at the blocks' pool slots. NaN or Inf input raises
    ValueError; `checked=True` says the caller has already checked (the triton backend
    then skips its own check, a host sync per call).
    """
    _check_shapes(k, v, fmt)
    match resolve_backend(backend, k, k.shape[-1], storage=True):
        case "reference":
            from .reference import quantize_blocks_reference

            return quantize_blocks_reference(k, v, fmt)
        case "triton":
            from .triton import quantize_blocks_triton

            return quantize_blocks_triton(k, v, fmt, checked=checked)


def _check_shapes(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat) -> None:
    expected = (fmt.num_kv_heads, fmt.block_size, fmt.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"quantize_blocks: {name} must be [N, {expected[0]}, {expected[1]}, {expected[2]}], got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"quantize_blocks: k {tuple(k.shape)} and v {tuple(v.shape)} differ")


def quantize_blocks_into(pages: Pages, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto", checked: bool = False) -> None:
    """Quantize N full blocks k, v [N, H_kv, P, D] and write them into `pages` (one layer's
    pool) at slots `ids` (int64 [N], on the pool's device): what `quantize_blocks` returns,
    written in place. The triton backend does it in one launch, with no intermediate
    tensors; NaN or Inf input raises ValueError before anything is written."""
    fmt = pages.fmt
    _check_shapes(k, v, fmt)
    if ids.dim() != 1 or ids.shape[0] != k.shape[0]:
        raise ValueError(f"quantize_blocks_into: ids must be [{k.shape[0]}] (one slot per block), got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != k.device:
        raise ValueError(f"quantize_blocks_into: ids must be int32/int64 on {k.device}, got {ids.dtype} on {ids.device}")
    match resolve_backend(backend, k, k.shape[-1], storage=True):
        case "reference":
            from .reference import quantize_blocks_reference

            for name, t in quantize_blocks_reference(k, v, fmt).items():
                getattr(pages, name)[ids] = t
        case "triton":
            from .triton import quantize_blocks_into_triton

            quantize_blocks_into_triton(pages, ids, k, v, checked=checked)
