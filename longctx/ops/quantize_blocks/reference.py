"""Eager torch definition of sealing: rotate (optional, `rotate_to_seal`), then quant.py's K/V quantizers."""

from __future__ import annotations

import torch

from ...quant import BlockFormat, quantize_k, quantize_v, rotate_to_seal


def quantize_blocks_reference(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if fmt.k_bits == 16:
        out["k"] = k.to(fmt.dtype)
    else:
        kq = rotate_to_seal(k) if fmt.rotate else k
        out["k_codes"], out["k_scale"], out["k_zero"] = quantize_k(kq, fmt.k_bits, fmt.dtype, fmt.k_span)
    if fmt.v_bits == 16:
        out["v"] = v.to(fmt.dtype)
    else:
        vq = rotate_to_seal(v) if fmt.rotate else v
        out["v_codes"], out["v_scale"], out["v_zero"] = quantize_v(vq, fmt.v_bits, fmt.group_size, fmt.dtype)
    return out
