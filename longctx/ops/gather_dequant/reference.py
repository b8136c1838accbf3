"""Eager torch definition: index the pools by the block table, dequantize, un-rotate."""

from __future__ import annotations

import torch

from ...quant import dequantize_k, dequantize_v, rotate
from ..pages import PagedView


def _flatten(x: torch.Tensor) -> torch.Tensor:
    # [B, n, H, P, D] -> [B, H, n*P, D]
    B, n, H, P, D = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(B, H, n * P, D)


def gather_dequant_reference(view: PagedView, out_dtype: torch.dtype):
    pages, fmt = view.pages, view.pages.fmt
    table = view.block_table.long()
    B, n = table.shape
    H, D = fmt.num_kv_heads, fmt.head_dim
    ns = min(view.n_sink, n)
    k_parts, v_parts = [], []
    if ns:
        k_parts.append(view.sink_k[table[:, :ns]].to(out_dtype))
        v_parts.append(view.sink_v[table[:, :ns]].to(out_dtype))
    if n > ns:
        ids = table[:, ns:]
        if fmt.k_bits == 16:
            k = pages.k[ids].to(out_dtype)
        else:
            k = dequantize_k(pages.k_codes[ids], pages.k_scale[ids], pages.k_zero[ids], fmt.k_bits, torch.float32)
            k = (rotate(k) if fmt.rotate else k).to(out_dtype)
        if fmt.v_bits == 16:
            v = pages.v[ids].to(out_dtype)
        else:
            v = dequantize_v(pages.v_codes[ids], pages.v_scale[ids], pages.v_zero[ids], fmt.v_bits, fmt.group_size, torch.float32)
            v = (rotate(v) if fmt.rotate else v).to(out_dtype)
        k_parts.append(k)
        v_parts.append(v)
    if not k_parts:
        empty = view.tail_k.new_empty(B, H, 0, D, dtype=out_dtype)
        return empty, empty.clone()
    return _flatten(torch.cat(k_parts, 1)), _flatten(torch.cat(v_parts, 1))
