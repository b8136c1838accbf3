"""Seal full tail blocks: unquantized [N, H_kv, P, D] -> the stored form of `Pages`.

Public entry: `quantize_blocks(k, v, fmt, backend=...)`. Tests: tests/ops/test_quantize_blocks.py.
"""

from __future__ import annotations

import torch

from ...quant import BlockFormat
from ..backend import resolve_backend


def quantize_blocks(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat, backend: str = "auto", checked: bool = False) -> dict[str, torch.Tensor]:
    """Quantize N full blocks.

    k, v: [N, H_kv, P, D] in fmt.dtype (P = fmt.block_size, D = fmt.head_dim).
    Returns the fields of `Pages` for these N blocks (k or k_codes/k_scale/k_zero, and the
    same for v), ready to be written at the blocks' pool slots. NaN or Inf input raises
    ValueError; `checked=True` says the caller has already checked (the triton backend
    then skips its own check, a host sync per call).
    """
    expected = (fmt.num_kv_heads, fmt.block_size, fmt.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"quantize_blocks: {name} must be [N, {expected[0]}, {expected[1]}, {expected[2]}], got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"quantize_blocks: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    match resolve_backend(backend, k, k.shape[-1], storage=True):
        case "reference":
            from .reference import quantize_blocks_reference

            return quantize_blocks_reference(k, v, fmt)
        case "triton":
            from .triton import quantize_blocks_triton

            return quantize_blocks_triton(k, v, fmt, checked=checked)
