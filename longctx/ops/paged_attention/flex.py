"""The `flex` backend: PyTorch FlexAttention reading 16-bit pages in place (the seed paper's
paged attention), for comparison with the fused kernels and as a portable GPU path.

FlexAttention cannot dequantize, so it serves caches whose pages are 16-bit (bits=16) and
raises BackendUnavailableError otherwise. A pool [N, H, P, D] is read without a copy as one
KV "head" of N*H*P positions (page n's head h is block n*H + h): for query head hq of row b
the block mask lists blocks table[b] * H + hq // G, and the mask_mod says the same thing
position by position (FlexAttention defines its result by the mask_mod; the block mask only
lets it skip blocks). Sink pages (their own pool) take a second call, the unquantized tail a
third (exact, causal); the three partial results are merged by log-sum-exp.

On CUDA the FlexAttention call is compiled once per shape (torch.compile); on the CPU it runs
eagerly (slow, for tests). Tests: tests/ops/test_paged_attention.py -k flex.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ...errors import BackendUnavailableError
from ..pages import PagedView
from .reference import attention_reference, merge_partials

Q_BLOCK = 128


@functools.cache
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def _pool_attention(q, pool_k, pool_v, ids, first_logical: int, start, scale, G: int):
    """Attention of q over the pages ids [B, m] (logical blocks first_logical..) of one pool."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Hq, C, D = q.shape
    N, H, P, _ = pool_k.shape
    dev = q.device
    k1, v1 = pool_k.reshape(1, 1, N * H * P, D), pool_v.reshape(1, 1, N * H * P, D)
    m = ids.shape[1]
    inv = torch.full((B, N), -1, dtype=torch.long, device=dev)  # physical page -> logical block, per row
    inv.scatter_(1, ids, torch.arange(first_logical, first_logical + m, device=dev).expand(B, m).contiguous())
    first = torch.zeros(B, dtype=torch.long, device=dev) if start is None else start.long()

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // (H * P)
        head = (kv_idx // P) % H
        j = inv[b, page]
        return (head == h // G) & (j >= 0) & (j * P + kv_idx % P >= first[b])

    q_blocks = -(-C // Q_BLOCK)
    kv_indices = torch.zeros(B, Hq, q_blocks, N * H, dtype=torch.int32, device=dev)
    blocks = ids[:, None, :] * H + (torch.arange(Hq, device=dev) // G)[None, :, None]  # [B, Hq, m]
    kv_indices[..., :m] = blocks[:, :, None, :].to(torch.int32)
    kv_num = torch.full((B, Hq, q_blocks), m, dtype=torch.int32, device=dev)
    bm = BlockMask.from_kv_blocks(kv_num, kv_indices, BLOCK_SIZE=(Q_BLOCK, P), mask_mod=mask_mod, seq_lengths=(C, N * H * P))
    with warnings.catch_warnings():
        if dev.type != "cuda":  # eager on purpose off the GPU: its "not compiled" warning is noise
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        fn = _flex_fn(dev.type)
        args = (q, k1.to(q.dtype), v1.to(q.dtype))
        # the compiled kernel walks KV_BLOCK_N keys at a time, which must divide a page: its
        # default (64 or more) does not divide 16- or 32-token pages (a lowering error on CUDA)
        opts = {"kernel_options": {"BLOCK_N": min(P, 64)}} if dev.type == "cuda" else {}
        try:  # torch >= 2.9 asks for the LSE through AuxRequest; older releases through return_lse
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = fn(*args, block_mask=bm, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True), **opts)
            lse = aux.lse
        except ImportError:
            out, lse = fn(*args, block_mask=bm, scale=scale, enable_gqa=True, return_lse=True, **opts)
    return out.float(), lse.float()


def paged_attention_flex(q, view: PagedView, start, scale, return_lse: bool = True):
    fmt = view.pages.fmt
    if fmt.k_bits != 16 or fmt.v_bits != 16:
        raise BackendUnavailableError(
            f"backend 'flex' reads 16-bit pages only (FlexAttention cannot dequantize); this cache stores "
            f"{fmt.k_bits}-bit keys and {fmt.v_bits}-bit values: use 'triton' or 'reference'"
        )
    B, Hq, C, D = q.shape
    H = fmt.num_kv_heads
    G = Hq // H
    scale = D**-0.5 if scale is None else scale
    table = view.block_table.long()
    n = table.shape[1]
    ns = min(view.n_sink, n)
    parts = []
    if n > ns:
        parts.append(_pool_attention(q, view.pages.k, view.pages.v, table[:, ns:], ns, start, scale, G))
    if ns:
        parts.append(_pool_attention(q, view.sink_k, view.sink_v, table[:, :ns], 0, start, scale, G))
    past = n * fmt.block_size
    tail_start = None if start is None else (start.long() - past).clamp_min(0)
    t_out, t_lse = attention_reference(q, view.tail_k, view.tail_v, tail_start, scale, return_lse=True)
    parts.append((t_out.float(), t_lse.float()))
    out, lse = merge_partials(parts)
    return out.to(q.dtype), (lse if return_lse else None)
