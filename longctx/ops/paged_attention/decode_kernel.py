"""The Triton decode kernel (q_len = 1) over quantized pages, flash-decoding style.

One program per (row, KV head, split): it loads the G query heads of its KV head once, walks
its share of the row's logical blocks (sink pages, sealed quantized pages, then the
unquantized tail), dequantizes codes in registers and keeps an online softmax. Sealed pages of
at most 8 bits go side by side, one page a warp (`_sealed_side`); 16-bit pages go through the
2-D loop, a page a step across the program's warps (in tiles of TD tokens where a whole page
does not fit the GPU's shared memory). Splits are merged by log-sum-exp: with MERGE, inside
the launch (the last split of each head to finish merges; with TREE in two levels), else by
the merge launch (merge.py). No bf16 copy of the cache is ever written.

With rotation the sealed pages hold K·H and V·H: each program rotates its own queries and the
sealed pages' share of its output back (fast Walsh-Hadamard butterflies in fp32), so that its
partial is unrotated and merges as unrotated pages' do.

The building blocks (code conversion, page scores and values, the softmax step) are in
tiles.py and codes.py, shared with the prefill kernel (prefill.py); the launcher is
triton.py. Never imports the reference; tests compare the two
(tests/ops/test_paged_attention_triton.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .merge import merge_range, store_rows
from .tiles import LOG2E, NEG_BIG, acc_sealed, acc_values, dense_scores, dense_values, fold_states, load_queries, page_scores
from .tiles import page_values, side_scores, side_values, side_values_folded, softmax_step, step_id, store_partial
from .codes import tiny_unit, v_words2
from .tiles import unfold_values, zero_state


# Integers that change from step to step are not specialized: Triton would compile a new
# variant the first time each turns 1 or a multiple of 16 (tail_len does within 16 steps).
@triton.jit(do_not_specialize=["stride_tb", "n_blocks", "n_sink", "tail_len", "blocks_per_split", "n_splits", "j_first", "slot0",
                               "n_slots"])
def decode_kernel(
    Q, TABLE, START,
    SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, TAIL_K, TAIL_V,
    O, LSE, OUT, LOUT, COUNT,
    stride_qb, stride_qh, stride_tb, s_tk_b, s_tk_h, s_tk_p,
    n_blocks, n_sink, tail_len, blocks_per_split, scale, n_splits, j_first, slot0, n_slots,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr,
    HAS_START: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr,
    ASM: tl.constexpr, MERGE: tl.constexpr, G_MERGE: tl.constexpr, MERGE_STEP: tl.constexpr,
    K_SUB: tl.constexpr, V_SUB: tl.constexpr, SIDE_PAGES: tl.constexpr = 0, V_TRANSPOSED: tl.constexpr = False,
    DENSE: tl.constexpr = 0, ZERO_DOT: tl.constexpr = False, SKIP: tl.constexpr = False, MASK: tl.constexpr = True,
    TREE: tl.constexpr = 0, TINY_CODES: tl.constexpr = False, TAIL_DEV: tl.constexpr = False,
    BLOCKS_DEV: tl.constexpr = False, R: tl.constexpr = 1, INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False,
    TD: tl.constexpr = 0, KG: tl.constexpr = 0,
):
    """Pool tensors are contiguous: pages [N, H, P, D*bits/8] (codes) or [N, H, P, D], K
    scales [N, H, P / KG, D] (a row a span of KG tokens; KG 0 or P: one a page), V scales [N, H, P, D/GS], sinks [N_sink, H, P, D]; outputs [B, H*G,
    n_slots, D] and LSE [B, H*G, n_slots]; with MERGE also the merged OUT [B, H*G, D] and
    LOUT [B, H*G] (COUNT: int32 zeros, one per row and KV head, or with TREE
    cdiv(n_splits, TREE) + 1 of them; left at zero).

    K_SUB/V_SUB: sub-tiles of a side (codes a load word: int16 words for 8 and 4 bits).
    K16/V16: quantized K/V go through 16-bit dots (DOT is 16-bit), else through DOT with fp32
    dequantization (K16: 1 scales folded into the query per page, 2 K dequantized in fp16 from
    fp32 scales, 3 in KDT). SIDE_PAGES > 0: sealed pages that many a step side by side, one a
    warp (`_sealed_side`); V_TRANSPOSED, ZERO_DOT, MASK and TINY_CODES shape that loop (see
    there); DENSE: the sinks' and tail's tokens a step (transposed, `_unquantized`). SKIP:
    programs with no sink page and no tail block skip those loops. TD > 0 (2-D loop): pages
    read in tiles of TD tokens, a tile a step (K's scales are the page's, read again each
    tile). G_MERGE, MERGE_STEP: the in-kernel merge's rows (G padded) and splits a step.

    TAIL_DEV: tail_len is a pointer to the tail's length (int32; a CUDA graph's replays change
    it on the device). BLOCKS_DEV: n_blocks is a pointer to the table's block count (int32;
    seals between a CUDA graph's replays change it, up to the table's width), and n_sink the
    sink blocks a full table has; each split's share is then worked out here from the count, in
    whole pages as the launcher's plan does (blocks_per_split is not read).
    j_first: the first logical block the splits share out (the blocks before it are another
    launch's); partials go to slot slot0 + split of n_slots a (row, query head). R > 1: a
    program (b, h) takes the G queries of KV head h of each of rows b * R .. b * R + R - 1,
    which hold the blocks this launch reads alike (read from row b * R's table), as R * G query
    rows (a group's rows may start at different positions: each query masks by its row's).
    ROTATE: the program rotates its queries and its sealed pages' share back (INV_SQRT_D: the
    Hadamard matrix's entries' magnitude; PTX: compiled for a GPU, where inline PTX may stand)."""
    DK: tl.constexpr = D // K_SUB
    DV: tl.constexpr = D // V_SUB
    NG: tl.constexpr = D // GS
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    gmask = offs_g < R * G
    if TAIL_DEV:
        tail_len = tl.load(tail_len)
    if BLOCKS_DEV:
        n_blocks = tl.load(n_blocks)
        n_sink = tl.minimum(n_sink, n_blocks)
    total = n_blocks + tl.cdiv(tail_len, P)
    if BLOCKS_DEV:  # whole loop steps a split, as the launcher's plan takes them
        STEP: tl.constexpr = SIDE_PAGES if SIDE_PAGES > 0 else 1
        blocks_per_split = STEP * tl.maximum(1, tl.cdiv(total - j_first, n_splits * STEP))
    lo = j_first + split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, total)
    j0 = tl.maximum(lo, n_sink)  # the sealed blocks j0 .. j1 - 1
    j1 = tl.minimum(hi, n_blocks)
    # side by side: the first step's block ids, loaded before the query so that the two
    # loads' latencies overlap (loaded after it, the ids waited for the query's first use,
    # and the first pages for the ids)
    trow = TABLE + b * R * stride_tb  # (with R > 1 the group's first row: its rows hold these blocks alike)
    ids = j0
    if SIDE_PAGES > 0:
        TILES: tl.constexpr = P // _side_tile(P, KG)  # the side loop's tiles a page
        ids = _side_ids(trow, j0 * TILES, j1, SIDE_PAGES, TILES)
    if R > 1:  # query g of the program: row b * R + g // G's head h * G + g % G
        qoffs = (b * R + offs_g // G) * stride_qb + (h * G + offs_g % G) * stride_qh
        orows = (b * R + offs_g // G) * (H * G) + h * G + offs_g % G
    else:
        qoffs = b * stride_qb + h * G * stride_qh + offs_g * stride_qh
        orows = b * H * G + h * G + offs_g
    q, qp, qp0, qp1, qp2, qp3 = load_queries(Q, 0, qoffs, gmask, 1, scale * LOG2E, D, K_SUB, DK, ROTATE, K16, KDT, DOT,
                                             INV_SQRT_D, PTX)
    # each query's first attended position (left padding), shaped for the scores it masks:
    # [rows, tokens] (s_rows), transposed [tokens, rows] (s_cols), side by side [pages, rows,
    # tokens] (s_side); one scalar where the program's queries are one row's
    s_rows = 0
    s_cols = 0
    s_side = 0
    if HAS_START:
        if R > 1:
            sv = tl.load(START + b * R + offs_g // G, mask=gmask, other=0)
            s_rows = sv[:, None]
            s_cols = sv[None, :]
            s_side = sv[None, :, None]
        else:
            s_rows = tl.load(START + b)
            s_cols = s_rows
            s_side = s_rows

    # 1. + 3. unquantized, unrotated blocks: sink pages, then the tail after the table; with
    # SKIP only in the programs that have some (the loops' pipelined prologues cost every
    # program ~700 instructions, sm_90, even with no step to take)
    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = zero_state(G_PAD, DV)
    if not SKIP or (lo < n_sink) | (hi > n_blocks):
        m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _unquantized(
            trow, SINK_K, SINK_V, TAIL_K + b * s_tk_b + h * s_tk_h, TAIL_V + b * s_tk_b + h * s_tk_h, s_tk_p,
            h, lo, hi, n_blocks, n_sink, tail_len, s_rows, s_cols, q, offs_d, offs_v, H, G_PAD, D, P, DV, V_SUB, DOT, PREC, DENSE)

    # 2. sealed pages: SIDE_PAGES side by side a step (a warp each), or one a step across the
    # warps (the 2-D loop), in tiles of TD tokens where TD > 0
    if SIDE_PAGES > 0:
        m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _sealed_side(
            KC, KS, KZ, VC, VS, VZ, trow, ids, h, j0, j1, s_side,
            qp0, qp1, qp2, qp3, m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3,
            H, G_PAD, D, P, K_BITS, V_BITS, GS, ROTATE, DOT, PREC, K16, V16, KDT, ASM, K_SUB, V_SUB, SIDE_PAGES, V_TRANSPOSED,
            ZERO_DOT, MASK, TINY_CODES, KG)
    else:
        TT: tl.constexpr = P if TD == 0 else TD  # tokens a step
        RD: tl.constexpr = P // TT  # steps a page: step u reads tokens (u % RD) * TT .. of block u // RD
        offs_i = tl.arange(0, TT)
        nxt = step_id(trow, j0, j1)  # the next step's block id, loop-carried: the pipeliner then
        for u in range(j0 * RD, j1 * RD):  # issues a step's page loads without first waiting for its table load
            j = u // RD
            blk = nxt.to(tl.int64)
            nxt = step_id(trow, (u + 1) // RD, j1)
            i_t = (u % RD) * TT + offs_i  # the step's tokens in its page
            s = page_scores(KD, KC, KS, KZ, blk * H + h, (u % RD) * TT, qp, qp0, qp1, qp2, qp3, i_t, offs_d, offs_k,
                            D, P, DK, K_SUB, K_BITS, DOT, PREC, K16, ASM, KDT, KG)
            s = tl.where((j * P + i_t)[None, :] >= s_rows, s, float("-inf"))
            m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
            pv, v0, v1, v2, v3 = page_values(VD, VC, VS, VZ, (blk * H + h) * P + i_t, i_t >= 0, p, offs_v, D, DV, V_SUB, NG, GS, V_BITS,
                                             V16, DOT, ASM)
            a0, a1, a2, a3, r0, r1, r2, r3 = acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, V_SUB, PREC, ROTATE)

    store_partial(O, LSE, orows * n_slots + slot0 + split, gmask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D, V_SUB, ROTATE,
                  INV_SQRT_D)
    if MERGE:
        # The splits of this (row, KV head) merge in the launch, no second one: TREE == 0, the
        # last split to finish merges all of them; TREE > 0, in two levels, the last to finish
        # of each group of TREE splits merges its group (over the group's first partial), the
        # last group merger the groups. COUNT counts finished splits (a counter per row and KV
        # head, and with TREE one per group plus one for the groups); mergers set theirs back to 0.
        row0 = b * H * G + h * G
        tl.debug_barrier()  # every thread's partial is written before the release
        if TREE == 0:
            done = tl.atomic_add(COUNT + pid, 1, sem="acq_rel")
            if done == n_splits - 1:
                o, lse = merge_range(O, LSE, row0, n_splits, 0, n_splits, 1, G, G_MERGE, MERGE_STEP, D)
                store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, G_MERGE, D)
                tl.atomic_xchg(COUNT + pid, 0)
        else:
            n_groups = tl.cdiv(n_splits, TREE)
            grp = split // TREE
            g0 = grp * TREE
            size = tl.minimum(n_splits - g0, TREE)  # the last group may be smaller
            counters = COUNT + pid * (n_groups + 1)
            done = tl.atomic_add(counters + grp, 1, sem="acq_rel")
            if done == size - 1:
                o, lse = merge_range(O, LSE, row0, n_splits, g0, size, 1, G, G_MERGE, MERGE_STEP, D)
                tl.atomic_xchg(counters + grp, 0)
                if n_groups == 1:
                    store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, G_MERGE, D)
                else:
                    store_rows(O, LSE, row0, n_splits, g0, o, lse, G, G_MERGE, D)
                    tl.debug_barrier()
                    done = tl.atomic_add(counters + n_groups, 1, sem="acq_rel")
                    if done == n_groups - 1:
                        o, lse = merge_range(O, LSE, row0, n_splits, 0, n_groups, TREE, G, G_MERGE, MERGE_STEP, D)
                        store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, G_MERGE, D)
                        tl.atomic_xchg(counters + n_groups, 0)


@triton.jit
def _unquantized(trow, SINK_K, SINK_V, tail_k, tail_v, s_tk_p, h, lo, hi, n_blocks, n_sink, tail_len, s_rows, s_cols, q, offs_d, offs_v,
                 H: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, DV: tl.constexpr, V_SUB: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, DENSE: tl.constexpr):
    """The online-softmax state (m_i, l_i, a0..a3, r0..r3) of a split's unquantized blocks
    lo .. hi - 1, the first it sees: the sink pages (of the row's table trow) and the tail
    (tail_k/tail_v: this row and head's; token stride s_tk_p), positions before s_rows
    ([rows, 1] or a scalar; s_cols the same as [1, rows]) masked. The rotated accumulators r0..r3
    stay zero (no rotated page has been seen yet). DENSE > 0 (side by side: a warp a page;
    at most P): DENSE tokens a step, transposed (_dense_block_t); 0: a block a step across the
    program's warps."""
    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = zero_state(G_PAD, DV)
    if DENSE > 0:
        DT: tl.constexpr = DENSE
        R: tl.constexpr = P // DT  # steps a page
        offs_u = tl.arange(0, DT)
        qt = tl.permute(q.to(DOT), (1, 0))
        e0 = tl.zeros((DV, G_PAD), tl.float32)
        e1 = e0
        e2 = e0
        e3 = e0
        # two stages whatever the launch's num_stages (the side loop's side_stages): three of
        # these 16-bit tiles took 32 KB of shared memory a program, against 18.7 with two
        for u in tl.range(lo * R, tl.minimum(hi, n_sink) * R, num_stages=2):
            blk = tl.load(trow + u // R).to(tl.int64)
            off = (blk * H + h) * P * D + (u % R) * DT * D
            m_i, l_i, e0, e1, e2, e3 = _dense_block_t(SINK_K + off, SINK_V + off, D, offs_u >= 0, u * DT + offs_u, s_cols, qt,
                                                      m_i, l_i, e0, e1, e2, e3, offs_u, offs_d, DV, V_SUB, DOT, PREC)
        for t0 in tl.range((tl.maximum(lo, n_blocks) - n_blocks) * P, tl.minimum(tail_len, (hi - n_blocks) * P), DT, num_stages=2):
            t = t0 + offs_u
            m_i, l_i, e0, e1, e2, e3 = _dense_block_t(tail_k + t0 * s_tk_p, tail_v + t0 * s_tk_p, s_tk_p, t < tail_len, n_blocks * P + t,
                                                      s_cols, qt, m_i, l_i, e0, e1, e2, e3, offs_u, offs_d, DV, V_SUB, DOT, PREC)
        a0 = tl.permute(e0, (1, 0))
        a1 = tl.permute(e1, (1, 0))
        a2 = tl.permute(e2, (1, 0))
        a3 = tl.permute(e3, (1, 0))
    else:
        offs_p = tl.arange(0, P)
        for j in range(lo, hi):
            is_sink = j < n_sink
            is_tail = j >= n_blocks
            if is_sink or is_tail:
                t = (j - n_blocks) * P + offs_p
                if is_sink:
                    blk = tl.load(trow + j).to(tl.int64)
                    kbase = SINK_K + (blk * H + h) * P * D
                    vbase = SINK_V + (blk * H + h) * P * D
                    sp = D
                    valid = offs_p >= 0
                    pos = j * P + offs_p
                else:
                    kbase = tail_k + (j - n_blocks) * P * s_tk_p
                    vbase = tail_v + (j - n_blocks) * P * s_tk_p
                    sp = s_tk_p
                    valid = t < tail_len
                    pos = n_blocks * P + t
                s = dense_scores(kbase, sp, valid, q, offs_p, offs_d, DOT, PREC)
                s = tl.where(valid[None, :] & (pos[None, :] >= s_rows), s, float("-inf"))
                m_i, l_i, p, alpha = softmax_step(s, m_i, l_i)
                v0, v1, v2, v3 = dense_values(vbase, sp, valid, offs_p, offs_v, V_SUB, DOT)
                a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, V_SUB, PREC)
    return m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def _dense_block_t(kbase, vbase, sp, valid, pos, s_cols, qt, m_i, l_i, e0, e1, e2, e3, offs_u, offs_d,
                   DV: tl.constexpr, V_SUB: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over the tokens offs_u of an unquantized block (token stride
    sp; valid: present, pos: their positions, those before s_cols [1, rows] or a scalar
    masked), transposed: scores K·qᵀ [DT, rows] (qt
    [D, rows]) and accumulators e_r [DV, rows] += V_rᵀ @ pᵀ (the few rows pad to 8 columns of
    the tensor-core tile, not 16 rows). K and V load whole rows (vector loads) and V splits
    into its V_SUB sub-tiles in registers: strided or masked scalar loads, each with its own
    address registers, had taken ~250 registers a thread, and the kernel's count is its
    hungriest loop's."""
    DT: tl.constexpr = offs_u.shape[0]
    k = tl.load(kbase + offs_u[:, None] * sp + offs_d[None, :], mask=valid[:, None], other=0.0)
    st = tl.dot(k.to(DOT), qt, input_precision=PREC)
    st = tl.where(valid[:, None] & (pos[:, None] >= s_cols), st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pt, 0)
    pd = pt.to(DOT)
    v = tl.load(vbase + offs_u[:, None] * sp + offs_d[None, :], mask=valid[:, None], other=0.0).to(DOT)
    c = alpha[None, :]
    if V_SUB == 1:
        e0 = e0 * c + tl.dot(tl.permute(v, (1, 0)), pd, input_precision=PREC)
    elif V_SUB == 2:
        v0, v1 = tl.split(tl.reshape(v, (DT, DV, 2)))  # channel 2i + r
        e0 = e0 * c + tl.dot(tl.permute(v0, (1, 0)), pd, input_precision=PREC)
        e1 = e1 * c + tl.dot(tl.permute(v1, (1, 0)), pd, input_precision=PREC)
    else:
        v02, v13 = tl.split(tl.reshape(v, (DT, DV, 2, 2)))  # channel 4i + 2 r1 + r0, split on r0
        v0, v2 = tl.split(v02)
        v1, v3 = tl.split(v13)
        e0 = e0 * c + tl.dot(tl.permute(v0, (1, 0)), pd, input_precision=PREC)
        e1 = e1 * c + tl.dot(tl.permute(v1, (1, 0)), pd, input_precision=PREC)
        e2 = e2 * c + tl.dot(tl.permute(v2, (1, 0)), pd, input_precision=PREC)
        e3 = e3 * c + tl.dot(tl.permute(v3, (1, 0)), pd, input_precision=PREC)
    return m_new, l_i, e0, e1, e2, e3


SIDE_TILE = 64  # tokens a step of the side loop takes at most: larger pages go as tiles of this many


@triton.constexpr_function
def _side_tile(P, KG=0):
    """Tokens a tile of the side loop, for pages of P tokens whose K scale rows cover KG tokens
    (0: the page): at most SIDE_TILE and one span (a page is P // _side_tile(P, KG) tiles)."""
    return min(P, SIDE_TILE, KG or P)


@triton.jit
def _side_ids(trow, u, j1, SIDE_PAGES: tl.constexpr, R: tl.constexpr = 1):
    """Block ids [SIDE_PAGES] of the side-by-side step at tile u (R tiles a block: tile u is in logical
    block u // R) of a split whose sealed blocks end at j1: ids at or past j1 repeat a valid
    one (the table has at least one column), whose scores are masked."""
    return tl.load(trow + tl.maximum(tl.minimum((u + tl.arange(0, SIDE_PAGES)) // R, j1 - 1), 0))



@triton.jit
def _sealed_side(KC, KS, KZ, VC, VS, VZ, trow, ids, h, j0, j1, s_side, qp0, qp1, qp2, qp3,
                 m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3,
                 H: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr, ASM: tl.constexpr, K_SUB: tl.constexpr,
                 V_SUB: tl.constexpr, SIDE_PAGES: tl.constexpr, V_TRANSPOSED: tl.constexpr, ZERO_DOT: tl.constexpr, MASK: tl.constexpr,
                 TINY_CODES: tl.constexpr = False, KG: tl.constexpr = 0):
    """The sealed (quantized) blocks j0 .. j1 - 1 of a row's table (trow; ids [SIDE_PAGES]: the block
    ids of the first step), SIDE_PAGES tiles of at most 64 tokens and one K span side by side a
    step (tiles.py's side_*; a page of P > 64 tokens is P // 64 tiles, which share its K scales,
    and a page of spans of KG < 64 tokens P // KG tiles, each with its span's): each keeps its
    own online softmax over the tiles it sees, and the SIDE_PAGES states fold into the program's
    (m_i, l_i, accumulators) at the end; tokens before s_side ([1, rows, 1] or a scalar) are
    masked; with ROTATE the sealed pages' share goes to the rotated accumulators r0..r3. MASK
    False (the launcher's rule: one page a step, no left padding and at most 4 bits, where no
    score is masked and leaving the masking out measured faster) leaves out the masking.
    K16 1 folds K's scales into the query (16-bit inputs; 0: fp32); V_TRANSPOSED takes V as the
    dots' first operand with its scales folded into the probabilities, ZERO_DOT its zero-point
    term as a dot. TINY_CODES: K's and V's codes go into their dots as fp16 subnormals (K16 1 and
    V_TRANSPOSED only)."""
    DK: tl.constexpr = D // K_SUB
    DV: tl.constexpr = D // V_SUB
    NG: tl.constexpr = D // GS
    T: tl.constexpr = _side_tile(P, KG)  # tokens a tile (within one span of K's scales)
    R: tl.constexpr = P // T  # tiles a page
    offs_w = tl.arange(0, SIDE_PAGES)
    offs_p = tl.arange(0, T)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    q30 = tl.broadcast_to(tl.permute(qp0, (1, 0))[None, :, :], (SIDE_PAGES, DK, G_PAD))  # transposed: the dots' second operand
    q31 = tl.broadcast_to(tl.permute(qp1, (1, 0))[None, :, :], (SIDE_PAGES, DK, G_PAD))
    q32 = tl.broadcast_to(tl.permute(qp2, (1, 0))[None, :, :], (SIDE_PAGES, DK, G_PAD))
    q33 = tl.broadcast_to(tl.permute(qp3, (1, 0))[None, :, :], (SIDE_PAGES, DK, G_PAD))
    mw = tl.full((SIDE_PAGES, G_PAD), NEG_BIG, tl.float32)
    lw = tl.zeros((SIDE_PAGES, G_PAD), tl.float32)
    w0 = tl.zeros((SIDE_PAGES, G_PAD, DV), tl.float32)
    x0 = tl.zeros((SIDE_PAGES * NG, GS // V_SUB, G_PAD), tl.float32)  # V_TRANSPOSED: per group and sub-tile, transposed
    x1 = x0
    x2 = x0
    x3 = x0
    z_acc = tl.zeros((SIDE_PAGES, NG, G_PAD), tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    # block ids a step ahead (loop-carried), as in the 2-D loop
    for u in range(j0 * R, j1 * R, SIDE_PAGES):
        bh = ids.to(tl.int64) * H + h
        sub = ((u + offs_w) % R) * T  # the tile's first token in its page (R > 1)
        ids = _side_ids(trow, u + SIDE_PAGES, j1, SIDE_PAGES, R)
        s = side_scores(KC, KS, KZ, bh, sub, q30, q31, q32, q33, offs_p, offs_k, D, T, DK, K_SUB, K_BITS, DOT, PREC, K16, ASM, KDT, P,
                         TINY_CODES, KG)
        if MASK:
            tile = u + offs_w  # the tile's first token is the row's token tile * T
            keep = (tile < j1 * R)[:, None, None] & ((tile[:, None] * T + offs_p[None, :])[:, None, :] >= s_side)
            s = tl.where(keep, s, float("-inf"))
        mw, lw, p, alpha = softmax_step(s, mw, lw)
        if V_TRANSPOSED:
            x0, x1, x2, x3, z_acc = side_values_folded(VC, VS, VZ, bh, sub, tl.permute(p, (0, 2, 1)), x0, x1, x2, x3, z_acc, alpha,
                                                        offs_p, T, DV, V_SUB, NG, GS, V_BITS, ASM, ZERO_DOT, P, TINY_CODES)
        else:
            pv, v0, v1, v2, v3 = side_values(VC, VS, VZ, bh, sub, p, offs_p, offs_v, T, DV, V_SUB, NG, GS, V_BITS, V16, DOT, ASM, P)
            w0, w1, w2, w3 = acc_values(w0, w1, w2, w3, alpha, pv, v0, v1, v2, v3, V_SUB, PREC)
    if V_TRANSPOSED:
        HALVES: tl.constexpr = v_words2(V_BITS, GS // V_SUB)  # (int2 words: the rows back in channel order)
        w0 = unfold_values(x0, z_acc, NG, tiny_unit(0, V_BITS, TINY_CODES), HALVES)
        w1 = unfold_values(x1, z_acc, NG, tiny_unit(1, V_BITS, TINY_CODES), HALVES)
        w2 = unfold_values(x2, z_acc, NG, tiny_unit(2, V_BITS, TINY_CODES), HALVES)
        w3 = unfold_values(x3, z_acc, NG, tiny_unit(3, V_BITS, TINY_CODES), HALVES)
    m_new = tl.maximum(m_i, tl.max(mw, 0))
    c_in = tl.exp2(m_i - m_new)
    c_w = tl.exp2(mw - m_new[None, :])
    l_i = l_i * c_in + tl.sum(lw * c_w, 0)
    f0 = fold_states(w0, c_w)
    f1 = f0
    f2 = f0
    f3 = f0
    if V_SUB > 1:
        f1 = fold_states(w1, c_w)
    if V_SUB > 2:
        f2 = fold_states(w2, c_w)
        f3 = fold_states(w3, c_w)
    a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, c_in, None, None, None, None, None, V_SUB, PREC)
    if ROTATE:
        r0, r1, r2, r3 = acc_values(r0, r1, r2, r3, c_in, None, None, None, None, None, V_SUB, PREC)
        r0, r1, r2, r3 = r0 + f0, r1 + f1, r2 + f2, r3 + f3
    else:
        a0, a1, a2, a3 = a0 + f0, a1 + f1, a2 + f2, a3 + f3
    return m_new, l_i, a0, a1, a2, a3, r0, r1, r2, r3

