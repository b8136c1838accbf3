"""Prefill chunks (q_len = C > 1) on the triton backend, the staged path: stage, then a fused
dense kernel. (The other path reads the pages in place: `paged_prefill_triton` in triton.py;
`prefill_path` picks one by the chunk's length and the format.)

The sealed past is dequantized by the gather_dequant kernel into one staging buffer of the
query's dtype, the tail is copied after it, and PyTorch's SDPA runs with a lower-right
causal mask (query i of C sits at position T - C + i) — its flash kernel on CUDA. The
staging buffer is one layer's past at a time and is freed when the layer returns, so a
128k-token prompt prefilled in chunks never holds more than one layer's dense K/V.

GQA runs as G calls of plain multi-head attention (the query heads g, g+G, ... pair with
KV heads 0, 1, ...), so no kernel ever needs a GQA mode or a repeated K/V.

Rows with left padding (start given) and callers that need the LSE take the kernel path:
the padding mask is per row, and the flash kernel does not return the LSE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..gather_dequant import gather_dequant
from ..pages import PagedView


def paged_prefill_staged(q: torch.Tensor, view: PagedView, scale: float | None) -> torch.Tensor:
    """out [B, H_q, C, D] for queries at the end of the view, no padding, causal."""
    tail = view.tail_k.shape[2]
    k, v = gather_dequant(view, out_dtype=q.dtype, extra=tail)
    past = k.shape[2] - tail
    k[:, :, past:].copy_(view.tail_k)
    v[:, :, past:].copy_(view.tail_v)
    return sdpa_lower_right(q, k, v, scale)


def sdpa_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """SDPA of q [B, H_q, C, D] over dense k, v [B, H_kv, T, D], query i at position T - C + i
    (lower-right causal), GQA as G calls of plain multi-head attention (flash on CUDA)."""
    G = q.shape[1] // k.shape[1]
    mask = causal_lower_right(q.shape[2], k.shape[2])
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = torch.empty_like(q)
    for g in range(G):
        out[:, g::G] = F.scaled_dot_product_attention(q[:, g::G], k, v, attn_mask=mask, scale=scale)
    return out
