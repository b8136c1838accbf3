"""Prefill chunks (q_len = C > 1) on the triton backend, two paths; `prefill_path` picks one
by the chunk's length and the format (TUNE in triton.py).

Staged (`paged_prefill_staged`): the sealed past is dequantized by the gather_dequant kernel
into one staging buffer of the query's dtype, the tail is copied after it, and PyTorch's SDPA
runs with a lower-right causal mask (query i of C sits at position T - C + i): its flash
kernel on CUDA. The staging buffer is one layer's past at a time and is freed when the layer
returns, so a 128k-token prompt prefilled in chunks never holds more than one layer's dense
K/V. GQA runs as G calls of plain multi-head attention (the query heads g, g+G, ... pair with
KV heads 0, 1, ...), so no kernel ever needs a GQA mode or a repeated K/V.

In place (`paged_prefill_triton`): the decode kernel's page walk (triton_tiles.py) for a block
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
from .triton import TUNE, _merge_kernel, _merge_rotated, _rotated_partials, _rotation_knobs, _setup, fit_key, num_splits, shared_limit
from .triton import SPILL_MAX, compiled_fit, fit_tile, page_tiles  # noqa: F401  (SPILL_MAX: the prefill fit's, for its callers)
from .triton_tiles import LOG2E, _acc, _acc_sealed, _dense_scores, _dense_values, _finish
from .triton_tiles import _load_queries, _page_scores, _page_values, _softmax_step, _step_ids, _zero_state


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
    Q, QR, TABLE, START,
    SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, TAIL_K, TAIL_V,
    O, OR, LSE,
    stride_qb, stride_qh, stride_qt, stride_tb, s_tk_b, s_tk_h, s_tk_p,
    n_blocks, n_sink, tail_len, C, blocks_per_split, scale, n_splits,
    H: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr,
    HAS_START: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr,
    WORDS: tl.constexpr, ASM: tl.constexpr, PK: tl.constexpr, PV: tl.constexpr,
    ROT_Q: tl.constexpr = False, ROT_O: tl.constexpr = False, INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False,
    TP: tl.constexpr = 0,
):
    """Prefill chunks over the quantized pages, no bf16 copy of the past: the decode kernel's
    page walk with M rows = BT query tokens x the G query heads of one KV head (token-major,
    padded to M). The C queries are the tail's last C tokens (query i at position n_blocks * P
    + tail_len - C + i); sinks and sealed pages precede all of them, the tail is causal. Grid
    (row x KV head, query block, split); outputs [B, H*G, C, n_splits, D] and LSE
    [B, H*G, C, n_splits] (natural log), each split normalized on its own. Rotated pages as in
    decode: ROT_Q, the program rotates its queries; ROT_O, it rotates its sealed pages' share
    back before storing (else OR holds it, rotated, for `_merge_rotated`). A step reads a tile
    of TP tokens of a page (0: the whole page): tile u holds tokens u * TP .. u * TP + TP - 1
    of the view, of page u // R; its K scales are the page's, read again for each tile. Tiles
    keep the kernel within a consumer card's shared memory over pages of 256 tokens."""
    TT: tl.constexpr = P if TP == 0 else TP  # tokens a step
    R: tl.constexpr = P // TT  # tiles a page
    DK: tl.constexpr = D // PK
    DV: tl.constexpr = D // PV
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
    q, qp, qp0, qp1, qp2, qp3 = _load_queries(Q, QR, 0, qrow, rmask, 1, scale * LOG2E, D, PK, DK, ROTATE, K16, KDT, DOT,
                                              ROT_Q, INV_SQRT_D, PTX)
    start = 0
    if HAS_START:
        start = tl.load(START + b)
    ti = tail_len - C + t  # the query's own index in the tail: it sees tail tokens 0 .. ti

    # logical blocks: sinks [0, n_sink), sealed [n_sink, n_blocks), tail; none past this
    # program's last query (causal). Steps walk tiles: tile u of block u // R.
    t_last = tl.minimum(rb * BT + BT, C) - 1
    total = n_blocks + (tail_len - C + t_last) // P + 1
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, total)

    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _zero_state(M, DV)
    every = offs_p >= 0

    # 1. sink pages (unquantized, unrotated)
    for u in range(lo * R, tl.minimum(hi, n_sink) * R):
        blk = tl.load(TABLE + b * stride_tb + u // R).to(tl.int64)
        base = ((blk * H + h) * P + (u % R) * TT) * D
        s = _dense_scores(SINK_K + base, D, every, q, offs_p, offs_d, DOT, PREC)
        s = tl.where((u * TT + offs_p >= start)[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        v0, v1, v2, v3 = _dense_values(SINK_V + base, D, every, offs_p, offs_v, PV, DOT)
        a0, a1, a2, a3 = _acc(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, PV, PREC)
        if ROTATE:
            r0, r1, r2, r3 = _acc(r0, r1, r2, r3, alpha, p, None, None, None, None, PV, PREC)

    # 2. sealed pages
    j0 = tl.maximum(lo, n_sink)
    j1 = tl.minimum(hi, n_blocks)
    trow = TABLE + b * stride_tb
    n0, _, _, _ = _step_ids(trow, j0, j1, 1)
    for u in range(j0 * R, j1 * R):
        blk0 = n0.to(tl.int64)
        n0, _, _, _ = _step_ids(trow, (u + 1) // R, j1, 1)
        offs_t = (u % R) * TT + offs_p  # the tile's tokens in its page
        s = _page_scores(KD, KC, KS, KZ, blk0 * H + h, 0, j1 - u // R, qp, qp0, qp1, qp2, qp3, offs_t, offs_d, offs_k,
                         D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
        s = tl.where((u * TT + offs_p >= start)[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        row = (blk0 * H + h) * P + offs_t
        pv, v0, v1, v2, v3 = _page_values(VD, VC, VS, VZ, row, every, p, offs_v, D, DV, PV, NG, GS, V_BITS, V16, DOT, ASM)
        a0, a1, a2, a3, r0, r1, r2, r3 = _acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, PV, PREC, ROTATE)

    # 3. the tail (unquantized, unrotated), causal; no tile past the last query's own token
    u_end = hi * R
    if R > 1:
        u_end = tl.minimum(u_end, n_blocks * R + (tail_len - C + t_last) // TT + 1)
    for u in range(tl.maximum(lo, n_blocks) * R, u_end):
        tt = (u - n_blocks * R) * TT + offs_p
        valid = tt < tail_len
        base = b * s_tk_b + h * s_tk_h + (u - n_blocks * R) * TT * s_tk_p
        s = _dense_scores(TAIL_K + base, s_tk_p, valid, q, offs_p, offs_d, DOT, PREC)
        see = (valid & (n_blocks * P + tt >= start))[None, :] & (tt[None, :] <= ti[:, None])
        s = tl.where(see, s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        v0, v1, v2, v3 = _dense_values(TAIL_V + base, s_tk_p, valid, offs_p, offs_v, PV, DOT)
        a0, a1, a2, a3 = _acc(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, PV, PREC)
        if ROTATE:
            r0, r1, r2, r3 = _acc(r0, r1, r2, r3, alpha, p, None, None, None, None, PV, PREC)

    _finish(O, OR, LSE, ((b * H * G + hq) * C + t) * n_splits + split, rmask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D, PV, ROTATE,
            ROT_O, INV_SQRT_D)


def prefill_path(chunk: int, fmt) -> str:
    """"kernel" or "staged" for a prefill chunk of `chunk` queries over pages of format `fmt`
    (a BlockFormat), by TUNE["prefill"]; "auto" takes the kernel where it measured faster
    (H200, whole chunk steps of `longctx bench prefill` at 128k, notes/decode-kernel.md v39,
    v40): chunks under prefill_staged_from tokens of pages with a side of 8 bits or fewer (int4:
    1.99 against 2.29 ms for 16 tokens, 2.36 against 2.54 for 64; staged 3.33 against 4.41
    for 256 and 4.52-4.72 against 7.30-7.57 for 512; int8 alike). Rotated pages alike: their
    gather rotates each page back on tensor cores (int4+rot staged 4.39 against 5.09 for 256,
    5.41 against 8.94 for 512; int2 4.31 against 5.46 and 5.43 against 9.02). 16-bit pages
    stage: the kernel was not measured on them. (Until the gather wrote whole rows, v39,
    staging lost to the kernel up to 1,024 int4 tokens; until it rotated on fp16 tensor
    cores, v40, int4+rot staged 512 tokens in 61.3 ms.)"""
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
    where not even the smallest tile fits in one stage. On the CPU: the first tile.
    - H200, int4 pages of 256 tokens, a 128k past, attention alone (`scripts/diag_prefill.py`,
      notes v45), ms for chunks of 64 / 127 tokens: tiles of 128 in two stages (22 words of
      local memory) 0.914 / 1.497 and 0.981 / 1.562 in two calls; whole pages in one stage (238
      words; spills in the page loop) 1.033 / 1.633 and 1.030 / 1.649 (chunks of 16 went either
      way); tiles of 64 in two 1.134 / 1.953. Under a 99 KiB card's limit: tiles of 128 in one
      stage 1.123 / 1.794, of 32 in two 1.419 / 2.528 (hence the larger tile before more stages).
    - sm_89 (RTX 4090), compiled here (`scripts/sass_decode.py --arch 89`), not run: tiles of 128
      fit in one stage but spill (148 words; 147 loads and 143 stores a step of the page loop),
      tiles of 64 in two stages fit and spill 32 words (7 and 2 a step)."""
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
    st = _setup(q, view, start, "paged_prefill_triton", rotate_q=not _rotation_knobs(view.pages.fmt)[0])
    fmt, qq, qr, table, n_blocks, tail_len, total = st.fmt, st.q, st.qr, st.table, st.n_blocks, st.tail_len, st.total
    B, Hq, C, D = q.shape
    H, G = fmt.num_kv_heads, st.consts["G"]
    tail_k, tail_v = view.tail_k, view.tail_v
    bt = max(1, TUNE["prefill_rows"] // G)  # query tokens a program
    n_rb = -(-C // bt)
    splits = splits or num_splits(B * n_rb, H, total, st.sm, TUNE["prefill_programs"])
    bps = max(1, math.ceil(total / splits))
    splits = max(1, math.ceil(total / bps))
    apart = _rotated_partials(st.consts)  # the sealed pages' share stored rotated, apart
    one = splits == 1 and not apart  # the kernel writes the final output
    o = torch.empty(B, Hq, C, splits, D, dtype=q.dtype if one else torch.float32, device=q.device)
    o_r = torch.empty_like(o) if apart else o
    lse = torch.empty(B, Hq, C, splits, dtype=torch.float32, device=q.device)
    grid = (B * H, n_rb, splits)
    args = (qq, qr, table, start if start is not None else table,
            view.sink_k, view.sink_v, *st.pools, tail_k, tail_v, o, o_r, lse,
            qq.stride(0), qq.stride(1), qq.stride(2), table.stride(0), tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            n_blocks, st.n_sink, tail_len, C, bps, scale, splits)
    consts = dict(st.consts, BT=bt, M=max(16, triton.next_power_of_2(bt * G)), K16=TUNE["prefill_k16"] if st.consts["K16"] else 0,
                  V16=st.consts["V16"] and TUNE["prefill_v16"], num_warps=TUNE["prefill_warps"], num_stages=TUNE["prefill_stages"],
                  **TRITON_OPTIONS)
    consts = _prefill_fit(grid, args, consts, view.pages.fmt.block_size, st)
    _prefill_kernel[grid](*args, **consts)
    if one:
        return o[:, :, :, 0], (lse[..., 0] if return_lse else None)
    out = torch.empty(B, Hq, C, D, dtype=q.dtype, device=q.device)
    lout = torch.empty(B, Hq, C, dtype=torch.float32, device=q.device)
    if apart:
        _merge_rotated(o, o_r, lse, out, lout, st.sm)
        return out, (lout if return_lse else None)
    # every (row, query head, token) is one merge row: HQ=1 and row strides
    _merge_kernel[(B * Hq * C,)](o, lse, out, lout, splits, splits * D, 0, D, splits, 0, D, 0,
                                 HQ=1, D=D, S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4, **TRITON_OPTIONS)
    return out, (lout if return_lse else None)
