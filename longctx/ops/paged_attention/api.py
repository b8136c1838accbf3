"""Attention over paged, quantized KV: decode (q_len=1) and prefill chunks (q_len=C, causal).

Public entries:
- `paged_attention(q, view, start=None, scale=None, backend="auto")` -> (out, lse)
- `dense_attention(q, k, v, start=None, scale=None)` -> (out, lse), the same semantics over
  dense K/V (used when the longctx attention runs without a paged cache).
Tests: tests/ops/test_paged_attention.py.
"""

from __future__ import annotations

import torch

from ...errors import SharedMemoryError
from ..backend import resolve_backend
from ..pages import PagedView


def _check_start(start: torch.Tensor | None, batch: int) -> None:
    if start is None:
        return
    if start.dim() != 1 or start.shape[0] != batch or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be an int32/int64 tensor [B={batch}], got {start.dtype} {tuple(start.shape)}")


def paged_attention(
    q: torch.Tensor,
    view: PagedView,
    start: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of C new queries over a paged batch whose last C tokens are the queries' own.

    q:     [B, H_q, C, D], H_q a multiple of H_kv (GQA). Query i sits at position
           view.total_len - C + i and sees keys at positions start[b] .. its own (causal).
           With an empty tail the queries sit after the view instead: each sees every key
           from start[b] on (a part of a longer past, e.g. host pages, merged by LSE).
    view:  sinks + sealed pages + tail (the tail holds the C new tokens, or none).
    start: int [B], first non-padding position of each row (left padding); None = 0.
    scale: softmax scale, default D**-0.5.
    Returns out [B, H_q, C, D] in q.dtype and lse [B, H_q, C] fp32 (natural log; -inf and a
    zero output where a query sees no key, e.g. a padding query), or None for lse when
    return_lse is False (cheaper: callers that merge nothing skip it).
    """
    if q.dim() != 4:
        raise ValueError(f"paged_attention: q must be [B, H_q, C, D], got {tuple(q.shape)}")
    B, Hq, C, D = q.shape
    tk = view.tail_k
    if tk.dim() != 4 or tk.shape[0] != B or tk.shape[3] != D:
        raise ValueError(f"paged_attention: tail_k {tuple(tk.shape)} does not match q {tuple(q.shape)}")
    Hkv = tk.shape[1]
    if Hq % Hkv:
        raise ValueError(f"paged_attention: H_q={Hq} is not a multiple of H_kv={Hkv}")
    if C > tk.shape[2] > 0:
        raise ValueError(f"paged_attention: {C} queries but only {tk.shape[2]} tokens in the tail; append them first")
    if view.block_table.shape[0] != B:
        raise ValueError(f"paged_attention: block_table {tuple(view.block_table.shape)} has a different batch than q {tuple(q.shape)}")
    _check_start(start, B)
    if start is not None and not start.is_contiguous():  # (the kernels read row b's at start + b)
        start = start.contiguous()
    name = resolve_backend(backend, q, D)
    if tk.shape[2] == 0 and name in ("flex", "flash"):
        raise ValueError(f"paged_attention: backend {name!r} reads a view with its queries in the tail; an empty tail takes 'triton' or 'reference'")
    for what, n in (("tail_len", view.tail_len), ("n_blocks", view.n_blocks)):
        if n is not None and (n.dtype != torch.int32 or n.numel() != 1 or n.device != tk.device):
            raise ValueError(f"paged_attention: {what} must be an int32 tensor of one element on {tk.device}, got {n.dtype} {tuple(n.shape)} on {n.device}")
    if (view.tail_len is not None or view.n_blocks is not None) and (name != "triton" or C > 1):  # only the decode kernel loads them itself
        view = view.host_lengths()
        if C > view.tail_k.shape[2] > 0:
            raise ValueError(f"paged_attention: {C} queries but tail_len says {view.tail_k.shape[2]} tokens in the tail")
    match name:
        case "reference":
            from .reference import paged_attention_reference

            return paged_attention_reference(q, view, start, scale, return_lse)
        case "triton":
            if C > 1:  # prefill chunks: the kernel over the pages, or staging + SDPA (prefill.py)
                from . import prefill

                def stageable() -> bool:  # staging + SDPA returns no LSE and takes no left padding
                    return not return_lse and not (start is not None and bool((start > 0).any()))

                if prefill.prefill_path(C, view.pages.fmt) == "kernel" or not stageable() or tk.shape[2] == 0:
                    try:
                        return prefill.paged_prefill_triton(q, view, start, D**-0.5 if scale is None else scale, return_lse)
                    except SharedMemoryError:  # (not even a tile of 16 tokens fits the GPU): staging serves where it can
                        if not stageable():
                            raise
                return prefill.paged_prefill_staged(q, view, scale), None
            from .triton import paged_decode_triton

            return paged_decode_triton(q, view, start, D**-0.5 if scale is None else scale, return_lse)
        case "flex":
            from .flex import paged_attention_flex

            return paged_attention_flex(q, view, start, scale, return_lse)
        case "flash":
            from .flash import paged_attention_flash

            return paged_attention_flash(q, view, start, scale, return_lse)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `paged_attention` over dense k, v [B, H_kv, T, D] (T >= C)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"dense_attention: q [B,H_q,C,D], k/v [B,H_kv,T,D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        raise ValueError(f"dense_attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    _check_start(start, q.shape[0])
    from .reference import attention_reference

    return attention_reference(q, k, v, start, scale, return_lse)
