"""Prefill chunks (q_len = C > 1) on the triton backend, two paths; `prefill_path` picks one
by the chunk's length and the format (TUNE in tuning.py).

Staged (`paged_prefill_staged`): the sealed past is dequantized by the gather_dequant kernel
into one staging buffer of the query's dtype, the tail is copied after it, and PyTorch's SDPA
runs with a lower-right causal mask (query i of C sits at position T - C + i): its flash
kernel on CUDA. The staging buffer is one layer's past at a time and is freed when the layer
returns, so a 128k-token prompt prefilled in chunks never holds more than one layer's dense
K/V. GQA runs as G calls of plain multi-head attention (the query heads g, g+G, ... pair with
KV heads 0, 1, ...), so no kernel ever needs a GQA mode or a repeated K/V.

In place (`paged_prefill_triton`): the decode kernel's page walk (tiles.py) for a block
of query tokens, no copy of the past; it also serves rows with left padding (start given) and
callers that need the LSE, which the flash kernel cannot (the padding mask is per row, and it
does not return the LSE).

Never imports the reference; tests compare the two (tests/ops/test_paged_attention_triton.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from ..backend import TRITON_OPTIONS
from ..gather_dequant import gather_dequant
from ..pages import PagedView
from .merge import merge_kernel
from .tiles import LOG2E, acc_sealed, acc_values, dense_scores, dense_values, load_queries, page_scores, page_values, softmax_step
from .tiles import step_id, store_partial, zero_state
from .triton import setup
from .tuning import TUNE, compiled_fit, fit_key, fit_tile, num_splits, page_tiles, shared_limit


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


@triton.jit(do_not_specialize=["stride_qt", "stride_tb", "n_blocks", "n_sink", "tail_len", "C", "blocks_per_split", "n_splits"])
def _prefill_kernel(
    Q, TABLE, START,
    SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, TAIL_K, TAIL_V,
    O, LSE,
    stride_qb, stride_qh, stride_qt, stride_tb, s_tk_b, s_tk_h, s_tk_p,
    n_blocks, n_sink, tail_len, C, blocks_per_split, scale, n_splits,
    H: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr,
    HAS_START: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr,
    ASM: tl.constexpr, K_SUB: tl.constexpr, V_SUB: tl.constexpr, INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False,
    TP: tl.constexpr = 0, KG: tl.constexpr = 0,
):
    """Prefill chunks over the quantized pages, no bf16 copy of the past: the decode kernel's
    page walk with M rows = BT query tokens x the G query heads of one KV head (token-major,
    padded to M). The C queries are the tail's last C tokens (query i at position n_blocks * P
    + tail_len - C + i); sinks and sealed pages precede all of them, the tail is causal (an
    empty tail: the queries follow the pages and see all of them). Grid
    (row x KV head, query block, split); outputs [B, H*G, C, n_splits, D] and LSE
    [B, H*G, C, n_splits] (natural log), each split normalized on its own. Rotated pages as in
    decode: the program rotates its queries and its sealed pages' share back. A step reads a tile
    of TP tokens of a page (0: the whole page): tile u holds tokens u * TP .. u * TP + TP - 1
    of the view, of page u // R; its K scales are its span's (KG tokens; 0: the page's), read again
    for each tile. Tiles
    keep the kernel within a consumer card's shared memory over pages of 256 tokens."""
    TT: tl.constexpr = P if TP == 0 else TP  # tokens a step
    R: tl.constexpr = P // TT  # tiles a page
    DK: tl.constexpr = D // K_SUB
    DV: tl.constexpr = D // V_SUB
    NG: tl.constexpr = D // GS
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    rb = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, TT)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    t = rb * BT + offs_m // G  # the row's query token in the chunk
    hq = h * G + offs_m % G  # and its query head
    rmask = (offs_m < BT * G) & (t < C)
    qrow = b * stride_qb + hq * stride_qh + t * stride_qt
    q, qp, qp0, qp1, qp2, qp3 = load_queries(Q, 0, qrow, rmask, 1, scale * LOG2E, D, K_SUB, DK, ROTATE, K16, KDT, DOT,
                                             INV_SQRT_D, PTX)
    start = 0
    if HAS_START:
        start = tl.load(START + b)
    ti = tail_len - C + t  # the query's own index in the tail: it sees tail tokens 0 .. ti

    # logical blocks: sinks [0, n_sink), sealed [n_sink, n_blocks), tail; none past this
    # program's last query (causal). Steps walk tiles: tile u of block u // R.
    t_last = tl.minimum(rb * BT + BT, C) - 1
    total = n_blocks + tl.cdiv(tl.maximum(tail_len - C + t_last + 1, 0), P)  # (an empty tail: the queries follow the pages)
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, total)

    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = zero_state(M, DV)
    every = offs_p >= 0

    # 1. sink pages (unquantized, unrotated)
    for u in range(lo * R, tl.minimum(hi, n_sink) * R):
        blk = tl.load(TABLE + b * stride_tb + u // R).to(tl.int64)
        base = ((blk * H + h) * P + (u % R) * TT) * D
        s = dense_scores(SINK_K + base, D, every, q, offs_p, offs_d, DOT, PREC)
        s = tl.where((u * TT + offs_p >= start)[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
        v0, v1, v2, v3 = dense_values(SINK_V + base, D, every, offs_p, offs_v, V_SUB, DOT)
        a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, V_SUB, PREC)
        if ROTATE:
            r0, r1, r2, r3 = acc_values(r0, r1, r2, r3, alpha, p, None, None, None, None, V_SUB, PREC)

    # 2. sealed pages
    j0 = tl.maximum(lo, n_sink)
    j1 = tl.minimum(hi, n_blocks)
    trow = TABLE + b * stride_tb
    n0 = step_id(trow, j0, j1)
    for u in range(j0 * R, j1 * R):
        blk0 = n0.to(tl.int64)
        n0 = step_id(trow, (u + 1) // R, j1)
        offs_t = (u % R) * TT + offs_p  # the tile's tokens in its page
        s = page_scores(KD, KC, KS, KZ, blk0 * H + h, (u % R) * TT, qp, qp0, qp1, qp2, qp3, offs_t, offs_d, offs_k,
                         D, P, DK, K_SUB, K_BITS, DOT, PREC, K16, ASM, KDT, KG)
        s = tl.where((u * TT + offs_p >= start)[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
        row = (blk0 * H + h) * P + offs_t
        pv, v0, v1, v2, v3 = page_values(VD, VC, VS, VZ, row, every, p, offs_v, D, DV, V_SUB, NG, GS, V_BITS, V16, DOT, ASM)
        a0, a1, a2, a3, r0, r1, r2, r3 = acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, V_SUB, PREC, ROTATE)

    # 3. the tail (unquantized, unrotated), causal; no tile past the last query's own token
    u_end = hi * R
    if R > 1:
        u_end = tl.minimum(u_end, n_blocks * R + tl.cdiv(tl.maximum(tail_len - C + t_last + 1, 0), TT))
    for u in range(tl.maximum(lo, n_blocks) * R, u_end):
        tt = (u - n_blocks * R) * TT + offs_p
        valid = tt < tail_len
        base = b * s_tk_b + h * s_tk_h + (u - n_blocks * R) * TT * s_tk_p
        s = dense_scores(TAIL_K + base, s_tk_p, valid, q, offs_p, offs_d, DOT, PREC)
        see = (valid & (n_blocks * P + tt >= start))[None, :] & (tt[None, :] <= ti[:, None])
        s = tl.where(see, s, float("-inf"))
        m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
        v0, v1, v2, v3 = dense_values(TAIL_V + base, s_tk_p, valid, offs_p, offs_v, V_SUB, DOT)
        a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, V_SUB, PREC)
        if ROTATE:
            r0, r1, r2, r3 = acc_values(r0, r1, r2, r3, alpha, p, None, None, None, None, V_SUB, PREC)

    store_partial(O, LSE, ((b * H * G + hq) * C + t) * n_splits + split, rmask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D, V_SUB,
                  ROTATE, INV_SQRT_D)


def prefill_path(chunk: int, fmt) -> str:
    """"kernel" or "staged" for a prefill chunk of `chunk` queries over pages of format `fmt`
    (a BlockFormat), by TUNE["prefill"]; "auto" takes the kernel where it measured faster
    (docs/kernels.md): chunks under prefill_staged_from tokens of pages with a side of 8 bits
    or fewer, rotated pages alike. 16-bit pages stage."""
    option = TUNE["prefill"]
    if option not in ("auto", "kernel", "staged"):
        raise ValueError(f"TUNE['prefill'] must be 'auto', 'kernel' or 'staged', got {option!r}")
    if option == "auto":
        bits = min(fmt.k_bits, fmt.v_bits)
        below = TUNE["prefill_staged_from"] if bits <= 8 else 0
        return "kernel" if chunk < below else "staged"
    return option


def prefill_tiles(block_size: int) -> list[int]:
    """Tokens a prefill step may read (TUNE["prefill_tile"]), largest first (`page_tiles`)."""
    return page_tiles(block_size, "prefill_tile")


_TILES: dict = {}  # the tile and stages a prefill launch takes, by its constexprs, tiles and dtypes


def _compiled(grid, args, consts: dict, limit: int) -> tuple[int, int | None]:
    """`compiled_fit` of the prefill kernel."""
    return compiled_fit(_prefill_kernel, grid, args, consts, limit)


def _prefill_fit(grid, args, consts: dict, block_size: int, st) -> dict:
    """The prefill launch's constexprs with its tile (TP; 0: the whole page) and stages. On a GPU:
    the largest tile (`prefill_tiles`), in the most stages (consts' num_stages at most), whose
    kernel fits the device's shared memory (`shared_limit`) and spills at most SPILL_MAX words a
    thread; where every one that fits spills more, the one that spills least; SharedMemoryError
    where not even the smallest tile fits in one stage. On the CPU: the first tile. A larger
    tile before more stages: under a 99 KiB limit on the H200, tiles of 128 in one stage beat
    tiles of 32 in two by 20-41 % (docs/kernels.md)."""
    tiles = prefill_tiles(block_size)
    if not st.gpu:
        return dict(consts, TP=tiles[0] if tiles[0] < block_size else 0)
    key = (fit_key(_prefill_kernel, st.device, consts), tuple(tiles), tuple(getattr(a, "dtype", None) for a in args))
    fit = _TILES.get(key)
    if fit is None:
        limit = shared_limit(st.device)

        def chosen(tile: int, stages: int) -> dict:
            return dict(consts, TP=tile if tile < block_size else 0, num_stages=stages)

        tile, stages = fit_tile(lambda tile, stages: _compiled(grid, args, chosen(tile, stages), limit), tiles, consts["num_stages"], limit,
                                "paged_prefill_triton", "16-bit inputs, or backend='reference'")
        fit = _TILES[key] = chosen(tile, stages)
    return fit


def paged_prefill_triton(q, view: PagedView, start, scale, return_lse: bool = True, splits: int | None = None):
    """Prefill chunk over the quantized pages: q [B, H_q, C, D], the tail's last C tokens ->
    (out [B, H_q, C, D], lse [B, H_q, C] fp32 or None). Sinks and sealed pages are read in
    place, the tail causally; left padding by `start`. The KV length is split across programs
    as in decode when the chunk's query blocks alone do not fill the GPU (or into `splits`),
    then merged."""
    st = setup(q, view, start, "paged_prefill_triton")
    fmt, qq, table, n_blocks, tail_len, total = st.fmt, st.q, st.table, st.n_blocks, st.tail_len, st.total
    B, Hq, C, D = q.shape
    H, G = fmt.num_kv_heads, st.consts["G"]
    tail_k, tail_v = view.tail_k, view.tail_v
    bt = max(1, TUNE["prefill_rows"] // G)  # query tokens a program
    n_rb = -(-C // bt)
    splits = splits or num_splits(B * n_rb, H, total, st.sm, TUNE["prefill_programs"])
    bps = max(1, math.ceil(total / splits))
    splits = max(1, math.ceil(total / bps))
    one = splits == 1  # the kernel writes the final output
    o = torch.empty(B, Hq, C, splits, D, dtype=q.dtype if one else torch.float32, device=q.device)
    lse = torch.empty(B, Hq, C, splits, dtype=torch.float32, device=q.device)
    grid = (B * H, n_rb, splits)
    args = (qq, table, start if start is not None else table,
            view.sink_k, view.sink_v, *st.pools, tail_k, tail_v, o, lse,
            qq.stride(0), qq.stride(1), qq.stride(2), table.stride(0), tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            n_blocks, st.n_sink, tail_len, C, bps, scale, splits)
    # K dequantized in fp32 and rounded once into the dot's type (the query block shares each
    # page's dequantization; 16-bit dequantization rounds twice where the FMA is not fused), V
    # in fp32 (16-bit dequantization measured slower)
    consts = dict(st.consts, BT=bt, M=max(16, triton.next_power_of_2(bt * G)), K16=4 if st.consts["K16"] else 0, V16=False,
                  num_warps=TUNE["prefill_warps"], num_stages=TUNE["prefill_stages"], **TRITON_OPTIONS)
    consts = _prefill_fit(grid, args, consts, view.pages.fmt.block_size, st)
    _prefill_kernel[grid](*args, **consts)
    if one:
        return o[:, :, :, 0], (lse[..., 0] if return_lse else None)
    out = torch.empty(B, Hq, C, D, dtype=q.dtype, device=q.device)
    lout = torch.empty(B, Hq, C, dtype=torch.float32, device=q.device)
    # every (row, query head, token) is one merge row: HQ=1 and row strides
    merge_kernel[(B * Hq * C,)](o, lse, out, lout, splits, splits * D, 0, D, splits, 0, D, 0,
                                HQ=1, D=D, S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4, **TRITON_OPTIONS)
    return out, (lout if return_lse else None)
