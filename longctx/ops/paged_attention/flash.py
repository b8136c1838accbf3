"""The `flash` backend: the sealed past dequantized into 16-bit pages of 256 tokens, a bounded
slice at a time, then flash-attn's paged kernel (`flash_attn_with_kvcache(block_table=...)`)
on each slice and on the tail, merged by log-sum-exp.

flash-attn reads 16-bit pages only, laid out token-major ([pages, 256, H_kv, D]; FA2 wants
page sizes that are multiples of 256), so nothing of the pool can be read in place: the
`gather_dequant_pages` kernel writes each slice of the past (at most `STAGE_BYTES` of K and V
together) into a staging pool, and the slice's attention runs without a causal mask (every
sealed token precedes every query). Left padding is dropped while gathering (a row's pages
hold its tokens from start[b] on), which flash-attn's paged path cannot do itself (its
`cache_leftpad` does not combine with a block table). The tail, dense already, runs
causally with the mask aligned to the bottom right, as the queries are its last C tokens.

Only where flash-attn (>= 2.6, CUDA, fp16/bf16 queries) imports. PyPI has flash-attn 2 as
source only, so on the CPU tests/ops/test_paged_attention.py checks this module against an
fp64 oracle through a torch stand-in for flash-attn's documented contract
(`longctx.testing.flash_kvcache_standin`); where flash-attn imports on a GPU (the GPU machine,
through tools/pack_flash_attn.sh) the same grid runs on the real kernel, and
tests/test_cuda.py holds the stand-in to it.
"""

from __future__ import annotations

import torch

from ...errors import BackendUnavailableError
from ..gather_dequant import gather_dequant_pages
from ..pages import PagedView
from .reference import merge_partials

PAGE = 256  # flash-attn 2's paged kernel takes page sizes that are multiples of 256
STAGE_BYTES = 256 << 20  # 16-bit K and V of one slice of the past, all rows together


def _kvcache_fn():
    """flash_attn.flash_attn_with_kvcache, or BackendUnavailableError naming what is missing."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as e:
        raise BackendUnavailableError(f"backend 'flash' needs flash-attn >= 2.6 ({e}): pip install 'longctx[flash]'") from None
    return flash_attn_with_kvcache


def slice_blocks(view: PagedView, itemsize: int, stage_bytes: int) -> int:
    """Logical blocks per slice of the past: whole staging pages of every row that fit
    `stage_bytes` of K and V (a slice is padded to whole pages), at least one block."""
    fmt = view.pages.fmt
    per_token = view.block_table.shape[0] * fmt.num_kv_heads * fmt.head_dim * itemsize * 2
    unit = max(PAGE, fmt.block_size)  # tokens of whole pages and whole blocks (powers of two)
    return max(1, stage_bytes // per_token // unit * unit // fmt.block_size)


def paged_attention_flash(q, view: PagedView, start, scale, return_lse: bool = True, stage_bytes: int | None = None):
    """paged_attention's contract (api.py). stage_bytes: the staging bound, default STAGE_BYTES."""
    fn = _kvcache_fn()
    B, Hq, C, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendUnavailableError(f"backend 'flash' takes fp16/bf16 queries (flash-attn's kernels), got {q.dtype}; load the model in bf16 or use 'triton'")
    if D % 8 or D > 256:
        raise BackendUnavailableError(f"backend 'flash' needs head_dim a multiple of 8 and at most 256 (flash-attn), got {D}")
    scale = D**-0.5 if scale is None else scale
    qt = q.transpose(1, 2)  # flash-attn's [B, C, H_q, D]
    n = view.block_table.shape[1]
    per = slice_blocks(view, q.element_size(), STAGE_BYTES if stage_bytes is None else stage_bytes)
    acc = None  # the slices so far, merged as they come (memory stays one slice's, however many)
    for j0 in range(0, n, per):
        pages = gather_dequant_pages(view, range(j0, min(n, j0 + per)), start, PAGE, q.dtype)
        out, lse = fn(qt, pages.k, pages.v, cache_seqlens=pages.seqlens, block_table=pages.block_table,
                      softmax_scale=scale, causal=False, return_softmax_lse=True)
        seen = (pages.seqlens > 0)[:, None, None].expand(B, Hq, C)  # rows whose slice is all padding saw nothing
        acc = _merged(acc, _part(out, lse, seen))
        del pages
    # the tail: row b's tokens from start[b] on, the queries its last C (bottom-right causal)
    L = view.tail_k.shape[2]
    tail_k, tail_v = view.tail_k.transpose(1, 2), view.tail_v.transpose(1, 2)  # [B, L, H, D]
    if start is None:
        shift = torch.zeros(B, dtype=torch.long, device=q.device)
    else:
        shift = (start.to(q.device).long() - view.past_len).clamp(0, L)
        idx = (torch.arange(L, device=q.device)[None, :] + shift[:, None]).clamp_max(L - 1)
        idx = idx[:, :, None, None].expand_as(tail_k)
        tail_k, tail_v = tail_k.gather(1, idx), tail_v.gather(1, idx)
    seqlens = (L - shift).to(torch.int32)
    out, lse = fn(qt, tail_k.to(q.dtype), tail_v.to(q.dtype), cache_seqlens=seqlens, softmax_scale=scale, causal=True, return_softmax_lse=True)
    # query i sees tail keys up to its own position: none when it is left padding itself
    seen = (torch.arange(C, device=q.device)[None, :] + seqlens[:, None] - C >= 0)[:, None, :].expand(B, Hq, C)
    out, lse = _merged(acc, _part(out, lse, seen))
    return out.to(q.dtype), (lse if return_lse else None)


def _merged(acc, part):
    return part if acc is None else merge_partials([acc, part])


def _part(out, lse, seen):
    """flash-attn's (out [B, C, H_q, D], lse [B, H_q, C]) as a partial [B, H_q, C, D]; rows
    that saw no key get a zero output and a -inf LSE (flash-attn leaves the LSE unspecified)."""
    return torch.where(seen[..., None], out.transpose(1, 2), 0.0), torch.where(seen, lse.float(), float("-inf"))
