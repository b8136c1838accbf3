"""Triton decode attention over quantized pages (q_len = 1), flash-decoding style.

One program per (row, KV head, split): it loads the G query heads of its KV head once, walks
its share of the row's logical blocks (sink pages, sealed quantized pages, then the
unquantized tail), dequantizes codes in registers and keeps an online softmax. Splits are
merged by log-sum-exp: in eager calls inside the same launch (the last split of each head to
finish does it, or with many splits the last of each group of splits, then the last group's),
under CUDA graph capture in a second launch (faster there, `TUNE["merge"]`; "grid" puts merge
programs after the splits in the decode grid instead). No bf16 copy of the cache is ever
written.

With rotation the sealed pages hold K·H and V·H: their scores use the rotated query, and
their share of the output is accumulated apart and rotated back once. Each program rotates its
own queries and its share back (fast Walsh-Hadamard butterflies in fp32), so that its partial
is unrotated and merges as unrotated pages' do (`TUNE["rot_query"]`, `TUNE["rot_out"]`; off,
a launch rotates the queries first and `_merge_rotated` rotates the shares back).

The kernel's building blocks (code conversion, page scores and values, the softmax step) are
in triton_tiles.py, shared with the prefill kernel (prefill.py). Never imports the reference;
tests compare the two (tests/ops/test_paged_attention_triton.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer, smid

from ...errors import BackendUnavailableError, SharedMemoryError
from ...quant import hadamard_scale, hadamard_signs
from ..backend import TRITON_OPTIONS
from ..pages import PagedView, kernel_pools
from ..rotation import rotate_triton
from .triton_tiles import LOG2E, _acc, _acc_sealed, _dense_scores, _dense_values, _finish
from .triton_tiles import NEG_BIG, _side_values_folded, _tiny_unit, _unfold_values, _fold, _load_queries, _page_scores, _page_values, _side_scores, _side_values
from .triton_tiles import _softmax_step, _step_ids, _v_words2, _zero_state


# Integers that change from step to step are not specialized: Triton would compile a new
# variant the first time each turns 1 or a multiple of 16 (tail_len does within 16 steps).
@triton.jit(do_not_specialize=["stride_tb", "n_blocks", "n_sink", "tail_len", "blocks_per_split", "n_splits", "apart", "j_first", "slot0",
                               "n_slots"])
def _decode_kernel(
    Q, QR, TABLE, START,
    SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, TAIL_K, TAIL_V,
    O, OR, LSE, OUT, LOUT, COUNT,
    stride_qb, stride_qh, stride_tb, s_tk_b, s_tk_h, s_tk_p,
    n_blocks, n_sink, tail_len, blocks_per_split, scale, n_splits, apart, j_first, slot0, n_slots,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr,
    HAS_START: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr,
    PAGES: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr, MERGE: tl.constexpr, GM: tl.constexpr, SB: tl.constexpr,
    PK: tl.constexpr, PV: tl.constexpr, WP: tl.constexpr = 0, SVT: tl.constexpr = False, DENSE: tl.constexpr = 0,
    ZDOT: tl.constexpr = False, SKIP: tl.constexpr = False, MASK: tl.constexpr = True, TREE: tl.constexpr = 0,
    STAMPS=None, PDL: tl.constexpr = False, GRID: tl.constexpr = 0, S_PAD: tl.constexpr = 0, SC: tl.constexpr = 0,
    BD: tl.constexpr = 0, TINY_CODES: tl.constexpr = False, BOUNDS=None, TAIL_DEV: tl.constexpr = False,
    BLOCKS_DEV: tl.constexpr = False, R: tl.constexpr = 1, ROT_Q: tl.constexpr = False, ROT_O: tl.constexpr = False,
    INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False, TD: tl.constexpr = 0,
):
    """Pool tensors are contiguous: pages [N, H, P, D*bits/8] (codes) or [N, H, P, D], K
    scales [N, H, D], V scales [N, H, P, D/GS], sinks [N_sink, H, P, D]; outputs [B, H*G,
    n_splits, D] and LSE [B, H*G, n_splits]; with MERGE also the merged OUT [B, H*G, D] and
    LOUT [B, H*G] (COUNT: int32 zeros, one per row and KV head, or with TREE
    cdiv(n_splits, TREE) + 1 of them; left at zero). K16/V16: quantized
    K/V go through fp16 dots (DOT is 16-bit), else through DOT with fp32 dequantization.
    STAMPS (diagnostics only, `STAMP` below; None compiles none of it): int64 [programs, 8]
    of %globaltimer readings at the program's entry, before and after its sealed pages and
    at its end, its SM, its sealed pages and its warp slot on the SM. PDL (TUNE["pdl"]: launched as a programmatic
    dependent, sm_90+): wait for the kernels before it, then let the next launch start.
    GRID > 0 (TUNE["merge"] "grid"): the grid has GRID more programs a (row, KV head) after its
    n_splits splits (program_id(1) n_splits ..), each merging one query head's columns (BD of
    them, or all D; S_PAD, SC as `_merge_head`) once the splits' counter (COUNT, two int32 a
    row and KV head, zeros, left at zero) says that all of them have stored their partials.
    TINY_CODES (TUNE["side_tiny"]): the side loop's K (K16 1) and V (SVT) dots take the codes
    as fp16 subnormals (triton_tiles' tiny form) rather than biased or exact ones. BOUNDS
    (experiments only, `BOUND` below; None compiles none of it): int32 [rows * H, n_splits + 1],
    each (row, KV head)'s split boundaries over its logical blocks (0 .. total, nondecreasing),
    in place of blocks_per_split's equal shares. TAIL_DEV: tail_len is a pointer to the tail's
    length (int32; a CUDA graph's replays change it on the device), which is loaded.
    BLOCKS_DEV: n_blocks is a pointer to the table's block count (int32; seals between a CUDA
    graph's replays change it on the device, up to the table's width), and n_sink the sink
    blocks a full table has; each split's share is then worked out here from the count, in
    whole steps of PAGES as the launcher's plan does (blocks_per_split is not read).
    j_first: the first logical block the splits share out (the blocks before it are another
    launch's); partials go to slot slot0 + split of n_slots a (row, query head). R > 1: a
    program (b, h) takes the G queries of KV head h of each of rows b * R .. b * R + R - 1,
    which hold the blocks this launch reads alike (read from row b * R's table), as R * G query
    rows (a group's rows may start at different positions: each query masks by its row's).
    ROTATE with ROT_Q: the program rotates its queries itself (Q's rows; QR is not read); with
    ROT_O: it rotates its sealed pages' share back before storing, so that O holds unrotated
    partials (OR is not written) and they merge as unrotated pages' do (INV_SQRT_D: the
    Hadamard matrix's entries' magnitude; PTX: compiled for a GPU, where inline PTX may stand).
    TD > 0 (TUNE["loop_tile"], with PAGES 1): the 2-D loop reads its pages in tiles of TD
    tokens, a tile a step (K's scales are the page's, read again each tile), where a whole
    page does not fit the GPU's shared memory."""
    if GRID > 0:  # noqa: SIM102 (a constexpr test alone: without merge programs none of this compiles)
        if tl.program_id(1) >= n_splits:
            _grid_merge(O, LSE, OUT, LOUT, COUNT, tl.program_id(0), tl.program_id(1) - n_splits, n_splits,
                        H, G, D, GRID, S_PAD, SC, BD, PDL)
            return
    DK: tl.constexpr = D // PK
    DV: tl.constexpr = D // PV
    NG: tl.constexpr = D // GS
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:  # nothing before this reads what earlier kernels wrote
        gdc_wait()
        gdc_launch_dependents()
    if STAMPS is not None:
        stamp = STAMPS + (pid * n_splits + split) * 8
        tl.store(stamp, globaltimer())
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, P)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    gmask = offs_g < R * G
    if TAIL_DEV:
        tail_len = tl.load(tail_len)
    if BLOCKS_DEV:
        n_blocks = tl.load(n_blocks)
        n_sink = tl.minimum(n_sink, n_blocks)
    total = n_blocks + tl.cdiv(tail_len, P)
    if BLOCKS_DEV:  # (side_apart: the sealed blocks over all splits but the last, which takes the sinks and the tail)
        if apart:
            blocks_per_split = PAGES * tl.maximum(1, tl.cdiv(n_blocks - n_sink, (n_splits - 1) * PAGES))
        else:
            blocks_per_split = PAGES * tl.maximum(1, tl.cdiv(total - j_first, n_splits * PAGES))
    if BOUNDS is not None:
        lo = tl.load(BOUNDS + pid * (n_splits + 1) + split)
        hi = tl.load(BOUNDS + pid * (n_splits + 1) + split + 1)
    else:
        lo = j_first + split * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, total)
    j0 = tl.maximum(lo, n_sink)  # the sealed blocks j0 .. j1 - 1
    j1 = tl.minimum(hi, n_blocks)
    if apart:  # the last split takes the unquantized blocks alone, the others the sealed ones
        alone = split == n_splits - 1
        j0 = tl.where(alone, n_blocks, tl.minimum(n_sink + split * blocks_per_split, n_blocks))
        j1 = tl.where(alone, n_blocks, tl.minimum(j0 + blocks_per_split, n_blocks))
        lo = tl.where(alone, 0, j0)
        hi = tl.where(alone, total, j0)
    # side by side: the first step's block ids, loaded before the query so that the two
    # loads' latencies overlap (loaded after it, the ids waited for the query's first use,
    # and the first pages for the ids)
    trow = TABLE + b * R * stride_tb  # (with R > 1 the group's first row: its rows hold these blocks alike)
    ids = j0
    if WP > 0:
        TILES: tl.constexpr = P // _side_tile(P)  # the side loop's tiles a page
        ids = _side_ids(trow, j0 * TILES, j1, WP, TILES)
    if R > 1:  # query g of the program: row b * R + g // G's head h * G + g % G
        qoffs = (b * R + offs_g // G) * stride_qb + (h * G + offs_g % G) * stride_qh
        orows = (b * R + offs_g // G) * (H * G) + h * G + offs_g % G
    else:
        qoffs = b * stride_qb + h * G * stride_qh + offs_g * stride_qh
        orows = b * H * G + h * G + offs_g
    q, qp, qp0, qp1, qp2, qp3 = _load_queries(Q, QR, 0, qoffs, gmask, 1, scale * LOG2E, D, PK, DK, ROTATE, K16, KDT, DOT,
                                              ROT_Q, INV_SQRT_D, PTX)
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
    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _zero_state(G_PAD, DV)
    if not SKIP or (lo < n_sink) | (hi > n_blocks):
        m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _unquantized(
            trow, SINK_K, SINK_V, TAIL_K + b * s_tk_b + h * s_tk_h, TAIL_V + b * s_tk_b + h * s_tk_h, s_tk_p,
            h, lo, hi, n_blocks, n_sink, tail_len, s_rows, s_cols, q, offs_d, offs_v, H, G_PAD, D, P, DV, PV, DOT, PREC, DENSE)

    # 2. sealed pages: WP side by side a step (a warp each), or PAGES a step across the warps
    if STAMPS is not None:
        tl.store(stamp + 1, globaltimer())
    if WP > 0:
        m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _sealed_side(
            KC, KS, KZ, VC, VS, VZ, trow, ids, h, j0, j1, s_side,
            qp0, qp1, qp2, qp3, m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3,
            H, G_PAD, D, P, K_BITS, V_BITS, GS, ROTATE, DOT, PREC, K16, V16, KDT, ASM, PK, PV, WP, SVT, ZDOT, MASK, TINY_CODES)
    elif TD > 0:  # a tile of TD tokens a step: step u reads tokens (u % RD) * TD .. of block u // RD
        RD: tl.constexpr = P // TD
        offs_i = tl.arange(0, TD)
        nxt, _, _, _ = _step_ids(trow, j0, j1, 1)  # (the next step's block id, loop-carried as below)
        for u in range(j0 * RD, j1 * RD):
            j = u // RD
            blk = nxt.to(tl.int64)
            nxt, _, _, _ = _step_ids(trow, (u + 1) // RD, j1, 1)
            i_t = (u % RD) * TD + offs_i  # the tile's tokens in its page
            s = _page_scores(KD, KC, KS, KZ, blk * H + h, 0, 1, qp, qp0, qp1, qp2, qp3, i_t, offs_d, offs_k,
                             D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
            s = tl.where((j * P + i_t)[None, :] >= s_rows, s, float("-inf"))
            m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
            pv, v0, v1, v2, v3 = _page_values(VD, VC, VS, VZ, (blk * H + h) * P + i_t, i_t >= 0, p, offs_v, D, DV, PV, NG, GS, V_BITS, V16,
                                              DOT, ASM)
            a0, a1, a2, a3, r0, r1, r2, r3 = _acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, PV, PREC, ROTATE)
    else:  # PAGES of them per iteration (more loads in flight per program): K scores per
        # page (_page_scores) joined into one [G_PAD, PAGES*P] tile whose token t is page
        # t % PAGES, row t // PAGES; V rows are loaded in that order.
        T: tl.constexpr = PAGES * P
        offs_t = tl.arange(0, T)
        n_t = offs_t % PAGES
        i_t = offs_t // PAGES
        # block ids a step ahead (loop-carried): the pipeliner then issues a step's page loads
        # without first waiting for its table loads
        n0, n1, n2, n3 = _step_ids(trow, j0, j1, PAGES)
        for j in range(j0, j1, PAGES):
            blk0, blk1, blk2, blk3 = n0.to(tl.int64), n1.to(tl.int64), n2.to(tl.int64), n3.to(tl.int64)
            n0, n1, n2, n3 = _step_ids(trow, j + PAGES, j1, PAGES)
            s = _page_scores(KD, KC, KS, KZ, blk0 * H + h, 0, j1 - j, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                             D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
            bt = tl.full((T,), 0, tl.int64) + blk0
            if PAGES > 1:
                s1 = _page_scores(KD, KC, KS, KZ, blk1 * H + h, 1, j1 - j, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                                  D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
                bt = tl.where(n_t == 1, blk1, bt)
                if PAGES > 2:
                    s2 = _page_scores(KD, KC, KS, KZ, blk2 * H + h, 2, j1 - j, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                                      D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
                    s3 = _page_scores(KD, KC, KS, KZ, blk3 * H + h, 3, j1 - j, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                                      D, P, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT)
                    bt = tl.where(n_t == 2, blk2, tl.where(n_t == 3, blk3, bt))
                    s = tl.reshape(tl.join(tl.join(s, s2), tl.join(s1, s3)), (G_PAD, T))  # t % 4 == page
                else:
                    s = tl.reshape(tl.join(s, s1), (G_PAD, T))
            page = j + n_t
            ok = page < j1
            s = tl.where(ok[None, :] & ((page * P + i_t)[None, :] >= s_rows), s, float("-inf"))
            m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
            row = (bt * H + h) * P + i_t  # the token's row in the [N * H * P, ...] pool
            pv, v0, v1, v2, v3 = _page_values(VD, VC, VS, VZ, row, ok, p, offs_v, D, DV, PV, NG, GS, V_BITS, V16, DOT, ASM)
            a0, a1, a2, a3, r0, r1, r2, r3 = _acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, PV, PREC, ROTATE)

    if STAMPS is not None:
        tl.store(stamp + 2, globaltimer())
    _finish(O, OR, LSE, orows * n_slots + slot0 + split, gmask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D, PV, ROTATE,
            ROT_O, INV_SQRT_D)
    if GRID > 0:  # this split's partial is stored (every thread's: the barrier), for the merge programs
        tl.debug_barrier()
        tl.atomic_add(COUNT + 2 * pid, 1, sem="release")
    if STAMPS is not None:
        tl.store(stamp + 3, globaltimer())
        tl.store(stamp + 4, smid().to(tl.int64))
        tl.store(stamp + 5, tl.maximum(j1 - j0, 0).to(tl.int64))
        tl.store(stamp + 6, _warp_slot().to(tl.int64))
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
                o, lse = _merge_range(O, LSE, row0, n_splits, 0, n_splits, 1, G, GM, SB, D)
                _store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, GM, D)
                tl.atomic_xchg(COUNT + pid, 0)
        else:
            n_groups = tl.cdiv(n_splits, TREE)
            grp = split // TREE
            g0 = grp * TREE
            size = tl.minimum(n_splits - g0, TREE)  # the last group may be smaller
            counters = COUNT + pid * (n_groups + 1)
            done = tl.atomic_add(counters + grp, 1, sem="acq_rel")
            if done == size - 1:
                o, lse = _merge_range(O, LSE, row0, n_splits, g0, size, 1, G, GM, SB, D)
                tl.atomic_xchg(counters + grp, 0)
                if n_groups == 1:
                    _store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, GM, D)
                else:
                    _store_rows(O, LSE, row0, n_splits, g0, o, lse, G, GM, D)
                    tl.debug_barrier()
                    done = tl.atomic_add(counters + n_groups, 1, sem="acq_rel")
                    if done == n_groups - 1:
                        o, lse = _merge_range(O, LSE, row0, n_splits, 0, n_groups, TREE, G, GM, SB, D)
                        _store_rows(OUT, LOUT, row0, 1, 0, o, lse, G, GM, D)
                        tl.atomic_xchg(counters + n_groups, 0)


@triton.jit
def _unquantized(trow, SINK_K, SINK_V, tail_k, tail_v, s_tk_p, h, lo, hi, n_blocks, n_sink, tail_len, s_rows, s_cols, q, offs_d, offs_v,
                 H: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, DV: tl.constexpr, PV: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, DENSE: tl.constexpr):
    """The online-softmax state (m_i, l_i, a0..a3, r0..r3) of a split's unquantized blocks
    lo .. hi - 1, the first it sees: the sink pages (of the row's table trow) and the tail
    (tail_k/tail_v: this row and head's; token stride s_tk_p), positions before s_rows
    ([rows, 1] or a scalar; s_cols the same as [1, rows]) masked. The rotated accumulators r0..r3
    stay zero (no rotated page has been seen yet). DENSE > 0 (side by side: a warp a page;
    at most P): DENSE tokens a step, transposed (_dense_block_t); 0: a block a step across the
    program's warps."""
    m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3 = _zero_state(G_PAD, DV)
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
                                                      m_i, l_i, e0, e1, e2, e3, offs_u, offs_d, DV, PV, DOT, PREC)
        for t0 in tl.range((tl.maximum(lo, n_blocks) - n_blocks) * P, tl.minimum(tail_len, (hi - n_blocks) * P), DT, num_stages=2):
            t = t0 + offs_u
            m_i, l_i, e0, e1, e2, e3 = _dense_block_t(tail_k + t0 * s_tk_p, tail_v + t0 * s_tk_p, s_tk_p, t < tail_len, n_blocks * P + t,
                                                      s_cols, qt, m_i, l_i, e0, e1, e2, e3, offs_u, offs_d, DV, PV, DOT, PREC)
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
                s = _dense_scores(kbase, sp, valid, q, offs_p, offs_d, DOT, PREC)
                s = tl.where(valid[None, :] & (pos[None, :] >= s_rows), s, float("-inf"))
                m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
                v0, v1, v2, v3 = _dense_values(vbase, sp, valid, offs_p, offs_v, PV, DOT)
                a0, a1, a2, a3 = _acc(a0, a1, a2, a3, alpha, p.to(DOT), v0, v1, v2, v3, PV, PREC)
    return m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def _dense_block_t(kbase, vbase, sp, valid, pos, s_cols, qt, m_i, l_i, e0, e1, e2, e3, offs_u, offs_d,
                   DV: tl.constexpr, PV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over the tokens offs_u of an unquantized block (token stride
    sp; valid: present, pos: their positions, those before s_cols [1, rows] or a scalar
    masked), transposed: scores K·qᵀ [DT, rows] (qt
    [D, rows]) and accumulators e_r [DV, rows] += V_rᵀ @ pᵀ (the few rows pad to 8 columns of
    the tensor-core tile, not 16 rows). K and V load whole rows (vector loads) and V splits
    into its PV sub-tiles in registers: strided or masked scalar loads, each with its own
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
    if PV == 1:
        e0 = e0 * c + tl.dot(tl.permute(v, (1, 0)), pd, input_precision=PREC)
    elif PV == 2:
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
def _side_tile(P):
    """Tokens a tile of the side loop, for pages of P tokens (a page is P // _side_tile(P) tiles)."""
    return min(P, SIDE_TILE)


@triton.jit
def _side_ids(trow, u, j1, WP: tl.constexpr, R: tl.constexpr = 1):
    """Block ids [WP] of the side-by-side step at tile u (R tiles a block: tile u is in logical
    block u // R) of a split whose sealed blocks end at j1: ids at or past j1 repeat a valid
    one (the table has at least one column), whose scores are masked."""
    return tl.load(trow + tl.maximum(tl.minimum((u + tl.arange(0, WP)) // R, j1 - 1), 0))


@triton.jit
def _warp_slot():
    """The warp's slot on its SM (%warpid; the scheduler that issues it is slot % 4)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %warpid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sealed_side(KC, KS, KZ, VC, VS, VZ, trow, ids, h, j0, j1, s_side, qp0, qp1, qp2, qp3,
                 m_i, l_i, a0, a1, a2, a3, r0, r1, r2, r3,
                 H: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, K_BITS: tl.constexpr,
                 V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 K16: tl.constexpr, V16: tl.constexpr, KDT: tl.constexpr, ASM: tl.constexpr, PK: tl.constexpr,
                 PV: tl.constexpr, WP: tl.constexpr, SVT: tl.constexpr, ZDOT: tl.constexpr, MASK: tl.constexpr,
                 TINY_CODES: tl.constexpr = False):
    """The sealed (quantized) blocks j0 .. j1 - 1 of a row's table (trow; ids [WP]: the block
    ids of the first step), WP tiles of at most 64 tokens side by side a step (triton_tiles'
    _side_*; a page of P > 64 tokens is P // 64 tiles, which share its K scales): each keeps its
    own online softmax over the tiles it sees, and the WP states fold into the program's (m_i,
    l_i, accumulators) at the end; tokens before s_side ([1, rows, 1] or a scalar) are
    masked; with ROTATE the sealed pages' share goes to the rotated
    accumulators r0..r3. MASK False (the launcher's rule, TUNE["side_unmasked"]: one page a
    step and no left padding, where no score is masked) leaves out the masking. TINY_CODES: K's
    and V's codes go into their dots as fp16 subnormals (K16 1 and SVT only)."""
    DK: tl.constexpr = D // PK
    DV: tl.constexpr = D // PV
    NG: tl.constexpr = D // GS
    T: tl.constexpr = _side_tile(P)  # tokens a tile
    R: tl.constexpr = P // T  # tiles a page
    offs_w = tl.arange(0, WP)
    offs_p = tl.arange(0, T)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    q30 = tl.broadcast_to(tl.permute(qp0, (1, 0))[None, :, :], (WP, DK, G_PAD))  # transposed: the dots' second operand
    q31 = tl.broadcast_to(tl.permute(qp1, (1, 0))[None, :, :], (WP, DK, G_PAD))
    q32 = tl.broadcast_to(tl.permute(qp2, (1, 0))[None, :, :], (WP, DK, G_PAD))
    q33 = tl.broadcast_to(tl.permute(qp3, (1, 0))[None, :, :], (WP, DK, G_PAD))
    mw = tl.full((WP, G_PAD), NEG_BIG, tl.float32)
    lw = tl.zeros((WP, G_PAD), tl.float32)
    w0 = tl.zeros((WP, G_PAD, DV), tl.float32)
    x0 = tl.zeros((WP * NG, GS // PV, G_PAD), tl.float32)  # SVT: per group and sub-tile, transposed
    x1 = x0
    x2 = x0
    x3 = x0
    z_acc = tl.zeros((WP, NG, G_PAD), tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    # block ids a step ahead (loop-carried), as in the 2-D loop
    for u in range(j0 * R, j1 * R, WP):
        bh = ids.to(tl.int64) * H + h
        sub = ((u + offs_w) % R) * T  # the tile's first token in its page (R > 1)
        ids = _side_ids(trow, u + WP, j1, WP, R)
        s = _side_scores(KC, KS, KZ, bh, sub, q30, q31, q32, q33, offs_p, offs_k, D, T, DK, PK, K_BITS, DOT, PREC, K16, ASM, KDT, P,
                         TINY_CODES)
        if MASK:
            tile = u + offs_w  # the tile's first token is the row's token tile * T
            keep = (tile < j1 * R)[:, None, None] & ((tile[:, None] * T + offs_p[None, :])[:, None, :] >= s_side)
            s = tl.where(keep, s, float("-inf"))
        mw, lw, p, alpha = _softmax_step(s, mw, lw)
        if SVT:
            x0, x1, x2, x3, z_acc = _side_values_folded(VC, VS, VZ, bh, sub, tl.permute(p, (0, 2, 1)), x0, x1, x2, x3, z_acc, alpha,
                                                        offs_p, T, DV, PV, NG, GS, V_BITS, ASM, ZDOT, P, TINY_CODES)
        else:
            pv, v0, v1, v2, v3 = _side_values(VC, VS, VZ, bh, sub, p, offs_p, offs_v, T, DV, PV, NG, GS, V_BITS, V16, DOT, ASM, P)
            w0, w1, w2, w3 = _acc(w0, w1, w2, w3, alpha, pv, v0, v1, v2, v3, PV, PREC)
    if SVT:
        HALVES: tl.constexpr = _v_words2(V_BITS, GS // PV)  # (int2 words: the rows back in channel order)
        w0 = _unfold_values(x0, z_acc, NG, _tiny_unit(0, V_BITS, TINY_CODES), HALVES)
        w1 = _unfold_values(x1, z_acc, NG, _tiny_unit(1, V_BITS, TINY_CODES), HALVES)
        w2 = _unfold_values(x2, z_acc, NG, _tiny_unit(2, V_BITS, TINY_CODES), HALVES)
        w3 = _unfold_values(x3, z_acc, NG, _tiny_unit(3, V_BITS, TINY_CODES), HALVES)
    m_new = tl.maximum(m_i, tl.max(mw, 0))
    c_in = tl.exp2(m_i - m_new)
    c_w = tl.exp2(mw - m_new[None, :])
    l_i = l_i * c_in + tl.sum(lw * c_w, 0)
    f0 = _fold(w0, c_w)
    f1 = f0
    f2 = f0
    f3 = f0
    if PV > 1:
        f1 = _fold(w1, c_w)
    if PV > 2:
        f2 = _fold(w2, c_w)
        f3 = _fold(w3, c_w)
    a0, a1, a2, a3 = _acc(a0, a1, a2, a3, c_in, None, None, None, None, None, PV, PREC)
    if ROTATE:
        r0, r1, r2, r3 = _acc(r0, r1, r2, r3, c_in, None, None, None, None, None, PV, PREC)
        r0, r1, r2, r3 = r0 + f0, r1 + f1, r2 + f2, r3 + f3
    else:
        a0, a1, a2, a3 = a0 + f0, a1 + f1, a2 + f2, a3 + f3
    return m_new, l_i, a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def _lse_step(lse, o, m, den, acc):
    """One chunk of an online log-sum-exp merge over splits, the last axis of lse [..., S] (the
    chunk's natural-log LSEs) and the second last of o [..., S, D] (their normalized outputs):
    the running max m, denominator den [...] and unnormalized sum acc [..., D] rescaled to the
    new max and the chunk added. Returns (m, m_safe, den, acc), m_safe the max with -inf (no
    split seen yet) as 0."""
    m_new = tl.maximum(m, tl.max(lse, -1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    c = tl.exp(m - m_safe)
    w = tl.exp(lse - tl.expand_dims(m_safe, -1))
    den = den * c + tl.sum(w, -1)
    acc = acc * tl.expand_dims(c, -1) + tl.sum(o * tl.expand_dims(w, -1), -2)
    return m_new, m_safe, den, acc


@triton.jit
def _merge_range(O, LSE, row0, n_splits, s0, count, stride, G: tl.constexpr, GM: tl.constexpr, SB: tl.constexpr, D: tl.constexpr):
    """The log-sum-exp merge of `count` partials of query rows row0 .. row0 + G - 1, those of
    splits s0, s0 + stride, ... (of n_splits a row in O [rows, n_splits, D] and LSE [rows,
    n_splits]), SB at a time (online, like the softmax): (out [GM, D], lse [GM]), itself a
    partial (normalized, with its natural-log LSE; -inf and 0 where no split saw a key).
    Partials are read past L1 (.cg): other programs wrote them."""
    offs_g = tl.arange(0, GM)
    offs_d = tl.arange(0, D)
    rows = row0 + offs_g
    gm = offs_g < G
    m = tl.full((GM,), float("-inf"), tl.float32)
    den = tl.zeros((GM,), tl.float32)
    acc = tl.zeros((GM, D), tl.float32)
    for i0 in range(0, count, SB):
        offs_i = i0 + tl.arange(0, SB)
        offs_s = s0 + offs_i * stride
        ms = gm[:, None] & (offs_i < count)[None, :]
        lse = tl.load(LSE + rows[:, None] * n_splits + offs_s[None, :], mask=ms, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(O + (rows[:, None, None] * n_splits + offs_s[None, :, None]) * D + offs_d[None, None, :],
                    mask=ms[:, :, None], other=0.0, cache_modifier=".cg")
        m, _, den, acc = _lse_step(lse, o, m, den, acc)
    ok = den > 0
    out = tl.where(ok[:, None], acc / tl.where(ok, den, 1.0)[:, None], 0.0)
    return out, tl.where(ok, m + tl.log(tl.where(ok, den, 1.0)), float("-inf"))


@triton.jit
def _store_rows(O, LSE, row0, n, s, out, lse, G: tl.constexpr, GM: tl.constexpr, D: tl.constexpr):
    """Rows row0 .. row0 + G - 1 of out [GM, D] and lse [GM] at slot s of n a row: O [rows,
    n, D] (in its dtype), LSE [rows, n]."""
    offs_g = tl.arange(0, GM)
    rows = row0 + offs_g
    gm = offs_g < G
    offs_d = tl.arange(0, D)
    tl.store(O + (rows[:, None] * n + s) * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=gm[:, None])
    tl.store(LSE + rows * n + s, lse, mask=gm)


@triton.jit
def _unrotate(o_r, SIGNS, offs_d, D: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """o_r [D] (rotated) @ H at columns offs_d: H's +-1 signs (fp16 [D, D]) in fp32, times
    1/sqrt(D)."""
    rows = tl.arange(0, D)
    return tl.sum(o_r[:, None] * tl.load(SIGNS + rows[:, None] * D + offs_d[None, :]).to(tl.float32), 0) * INV_SQRT_D


@triton.jit
def _partials(X, b, hq, offs_s, smask, cols, s_o_b, s_o_h, s_o_s, CM: tl.constexpr):
    """Splits offs_s (masked by smask; zeros past S) of (row b, query head hq)'s partials X at
    columns cols: [len(offs_s), len(cols)]."""
    return tl.load(X + b * s_o_b + hq * s_o_h + offs_s[:, None] * s_o_s + cols[None, :], mask=smask[:, None], other=0.0,
                   cache_modifier=CM)


@triton.jit
def _merge_head(O, LSE, OUT, LOUT, b, hq, cb, S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
                HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr, BD: tl.constexpr, CG: tl.constexpr,
                OR, SIGNS, ROT: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """Merge the S splits of (row b, query head hq) by log-sum-exp, columns cb * BD .. (all D
    with BD 0): all S_PAD at once, or SC at a time with an online rescale where S_PAD is
    larger (SC > 0). CG reads the partials past L1 (other programs of the same launch wrote
    them). ROT (rotated pages): OR holds a second set of partials (strided as O), in the
    rotated basis; their merge over all D columns is rotated back (`_unrotate`, SIGNS and
    INV_SQRT_D) and added (OR, SIGNS unread without ROT)."""
    DC: tl.constexpr = BD if BD > 0 else D  # this program's columns
    offs_d = tl.arange(0, DC)
    if BD > 0:
        offs_d += cb * BD
    CM: tl.constexpr = ".cg" if CG else ""
    if SC == 0 or S_PAD <= SC:
        offs_s = tl.arange(0, S_PAD)
        smask = offs_s < S
        lse = tl.load(LSE + b * s_l_b + hq * s_l_h + offs_s, mask=smask, other=float("-inf"), cache_modifier=CM)
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe)
        denom = tl.sum(w, 0)
        w = w / tl.where(denom > 0, denom, 1.0)
        o = _partials(O, b, hq, offs_s, smask, offs_d, s_o_b, s_o_h, s_o_s, CM)
        out = tl.sum(o * w[:, None], 0)
        if ROT:
            o_r = _partials(OR, b, hq, offs_s, smask, tl.arange(0, D), s_o_b, s_o_h, s_o_s, CM)
            out += _unrotate(tl.sum(o_r * w[:, None], 0), SIGNS, offs_d, D, INV_SQRT_D)
    else:
        m_safe = 0.0
        m = float("-inf")
        denom = 0.0
        acc = tl.zeros((DC,), tl.float32)
        if ROT:
            acc_r = tl.zeros((D,), tl.float32)
        for s0 in range(0, S, SC):
            offs_s = s0 + tl.arange(0, SC)
            smask = offs_s < S
            lse = tl.load(LSE + b * s_l_b + hq * s_l_h + offs_s, mask=smask, other=float("-inf"), cache_modifier=CM)
            o = _partials(O, b, hq, offs_s, smask, offs_d, s_o_b, s_o_h, s_o_s, CM)
            if ROT:  # (with the running max and denominator from before this chunk)
                o_r = _partials(OR, b, hq, offs_s, smask, tl.arange(0, D), s_o_b, s_o_h, s_o_s, CM)
                _, _, _, acc_r = _lse_step(lse, o_r, m, denom, acc_r)
            m, m_safe, denom, acc = _lse_step(lse, o, m, denom, acc)
        if ROT:
            acc += _unrotate(acc_r, SIGNS, offs_d, D, INV_SQRT_D)
        out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + b * s_out_b + hq * s_out_h + offs_d, out.to(OUT.dtype.element_ty))
    lout = tl.where(denom > 0, m_safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
    if BD > 0:
        tl.store(LOUT + b * HQ + hq, lout, mask=cb == 0)  # one column block writes it
    else:
        tl.store(LOUT + b * HQ + hq, lout)


@triton.jit
def _grid_merge(O, LSE, OUT, LOUT, COUNT, pid, e, n_splits, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                GRID: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """Merge program e of (row, KV head) pid in the decode grid (GRID of them: query head
    e // (D // BD), column block e % (D // BD)). It waits until COUNT[2 pid] counts n_splits
    stored partials (each split adds 1 with release, this acquires), merges its head's
    columns in split order with the merge launch's code (`_merge_head`; one warp sums what
    the launch's four do, so on a GPU the bits may differ in the sums' order), then
    counts itself in COUNT[2 pid + 1]; the last of the GRID sets both back to zero for the
    next call. The decode programs never wait, so the merge programs cannot starve them while
    they are fewer than the GPU's program slots (the launcher's rule); the hardware dispatches
    them last (program_id(1) is the slow axis), the interpreter after their own splits."""
    if PDL:  # the counters were last reset by the launch before
        gdc_wait()
        gdc_launch_dependents()
    NCB: tl.constexpr = D // BD if BD > 0 else 1
    HQ: tl.constexpr = H * G
    cnt = COUNT + 2 * pid
    # polled with plain volatile loads (an acquire a poll invalidates the SM's L1 each time,
    # under the splits running there), then acquired once: the splits' adds are one release
    # sequence, so this sees every partial stored before them. The acquire's count is what the
    # merge reads as its split count (always n_splits): an add of zero whose result goes unused
    # is dropped on the way to PTX (triton 3.6 and 3.8: no acquire at all), and with it the
    # ordering. (Without it, on the H200, test_merge_programs_in_the_grid's second call gave other
    # bits than its first, notes v37; with it, five runs of those tests passed, notes v38.)
    done = tl.load(cnt, volatile=True)
    while done < n_splits:
        done = tl.load(cnt, volatile=True)
    done = tl.minimum(tl.atomic_add(cnt, 0, sem="acquire"), n_splits)
    # O [B, HQ, n_splits, D] and LSE [B, HQ, n_splits] (contiguous) -> OUT [B, HQ, 1, D], LOUT [B, HQ, 1]
    _merge_head(O, LSE, OUT, LOUT, pid // H, (pid % H) * G + e // NCB, e % NCB, done, HQ * n_splits * D, n_splits * D, D,
                HQ * n_splits, n_splits, HQ * D, D, HQ, D, S_PAD, SC, BD, True, O, O, False, 1.0)
    if tl.atomic_add(cnt + 1, 1, sem="acq_rel") == GRID - 1:
        tl.atomic_xchg(cnt, 0)
        tl.atomic_xchg(cnt + 1, 0)


@triton.jit(do_not_specialize=["S", "s_o_b", "s_o_h", "s_o_s", "s_l_b", "s_l_h"])
def _merge_kernel(O, LSE, OUT, LOUT, S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
                  HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr = 0, BD: tl.constexpr = 0,
                  PDL: tl.constexpr = False):
    """Merge the splits of one (row, query head) by log-sum-exp (`_merge_head`): the second
    launch of TUNE["merge"] == "launch" (S_PAD compiles a variant per power of two of splits).
    SC > 0 (TUNE["merge_chunk"]) reads the splits SC at a time where S_PAD is larger; else all
    at once. BD > 0 (`_merge_cols`): the program merges BD of the D columns, program_id(1)
    which (grid (rows * HQ, D // BD)); 0: all D. PDL: launched as a programmatic dependent
    (sm_90+), so it waits for the decode kernel's partials here."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    _merge_head(O, LSE, OUT, LOUT, pid // HQ, pid % HQ, tl.program_id(1), S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
                HQ, D, S_PAD, SC, BD, False, O, O, False, 1.0)


# Launch knobs, measured on the H200 (notes/decode-kernel.md); scripts/diag_speed.py sweeps them.
# merge: "kernel" = the last split of each head merges inside the decode launch (one launch
# less: ~20 us of host time per call); "launch" = a second, parallel merge kernel (~9 us less
# GPU time at 128k, int4, H200); "auto" = "launch" while a CUDA graph is being captured (its
# launches cost no host time on replay), else "kernel"; "grid" (only where asked for) = merge
# programs after the splits in the decode grid itself (`_grid_merge`), one a query head and
# block of merge_cols columns, each polling its (row, KV head)'s count of stored partials and
# merging them as the launch does: no second launch, no gap, but slower on the H200 (the bench's
# call under graphs, scripts/bench_ab.py, two rounds, notes v23): int4 128k 49.7, 49.4 us
# (reading 64 splits at a time: 49.4, 49.1) against 48.4, 48.1 with the launch; batch 8 at 32k
# 88.3, 88.4 (89.6, 89.2) against 87.4, 88.3; 512k (one round, an acquire a poll then) 168.7
# (165.1) against 167.1. Merge programs beyond half the GPU's program slots fall back to the
# launch (they wait for the splits, which must find room).
# The merge launch as a programmatic dependent whose programs wait for their own head's
# splits (counted by the splits, so heads merge during the wave's end; built and reverted,
# notes v26) was slower too: int4 128k 49.6, 49.0 us against 46.7, 47.7 (500 ns between polls
# 48.7, 48.8 against 47.1, 46.7), 512k 162.5, 160.8 against 158.8, 158.7, batch 8 at 32k
# 86.7, 85.9 against 83.9, 85.1.
# k16=3 (K dequantized in bf16/fp16 against a fixed query) over 2 (scales folded into the
# query per page): int4 128k 0.1333 vs 0.1448 ms, 512k 0.4648 vs 0.5318 (H200, graph timing).
# One page a step with three pipeline stages, 4 programs per SM (128 registers: one wave),
# over two pages and two stages at 8 per SM, once K's scales loaded as prefetchable words:
# int4 128k 0.1080 vs 0.1248 ms, 512k 0.3827 vs 0.4401 (H200, graph timing, notes v8).
# 16-bit pages keep what met their target (0.1394 ms at 128k): two stages, 8 programs per SM
# (stages16, programs16); with 3 stages and 4 per SM they ran 0.1462 ms, with 2 and 4 0.1602.
# short_stages: quantized pages when a program gets at most two of them (short contexts):
# int4 4k 0.0155 ms with two stages against 0.0179 with three (SDPA 0.0119; notes v9).
# programs_per_sm is an upper bound: the launcher compiles the kernel first and lowers it to
# what fits in one SM's registers and shared memory (`programs_fit`). On the H200's triton 3.6
# the kernel takes 128 registers (4 per SM) with the merge in a second launch, as under CUDA
# graphs, and 165 (3 per SM) with the in-kernel merge, as in eager calls: there 512 programs
# had been launched for 396 slots (1.29 waves, Nsight Compute). Under graphs the second launch
# stays ("auto"): in-kernel at 4k int4 0.0164 against 0.0177 ms, but int8 4k 0.0188 against
# 0.0182 and int4 128k 0.1090-0.1153 against 0.1015-0.1054 (merging fewer splits at once did
# not lower its registers). maxnreg (0: none) caps registers: capped at 128, int4 128k ran
# 0.1094-0.1108 ms against 0.1009-0.1054 uncapped. Side by side (v16, decode kernel alone,
# scripts/diag_parts.py --ab): capped at 184 (11 warps an SM, 18 spills) int4 128k 76.1-76.4 us,
# at 168 (12 warps, 38 spills) 66.0-66.3, against 46.6 uncapped at 255 (8 warps).
# side: sealed pages of at most side_bits bits a side go `side` a loop step, one a warp, each with its
# own softmax state until the end (`_sealed_side`, `_side`): no cross-warp exchange a page, where
# the 2-D loop (num_warps warps on one page) synchronizes six times. Its rows: the query heads of
# a KV head padded to side_rows (4; triton pads a dot's M under 16 inside the tensor-core tile
# itself), side_stages pipeline stages, at most side_programs programs per SM (the compiled
# kernel's fit decides). side_k16: K's arithmetic there (1: its per-channel scales folded into
# the query per page, against fp16 1024 + code; 3: K dequantized in 16 bits; 0: fp32). asm: the
# int4 sub-tiles one inline-PTX block converts (1, 2 or 4; 0: no inline PTX). 1 since notes v37:
# Triton 3.8 (torch 2.14's pin) leaves the extra results of a several-result inline-PTX block in
# a blocked layout and moves them into the dots' operand layout through shared memory
# (sm_90 SASS, int4 side loop: 1,189 instructions a page with 4 against 1,038 with 1; int8
# 1,259 with 30 spill reloads against 1,089; the shared-rows launch 1,488 against 1,254). ptxas
# shares the blocks' common shift, so 1 costs 3.6, 3.7 and 3.9 nothing (int4: 1,049 / 1,041 /
# 1,053 against 1,061 / 1,064 / 1,062 with 4); H200, triton 3.6, the bench's call: asm 1 within
# the rounds' spread of 4 (128k 46.84, 46.83 against 46.96, 46.39 us); on 3.8, int4 128k 46.60
# against 78.22 us with 4, int8 72.74 against 164.67 (notes v37).
# H200, graph timing (scripts/diag_speed.py, notes v12), int4 at 128k / 512k / batch 8 at 32k,
# side_k16 1: side 1 0.0651 / 0.2521 / 0.1168 ms; side 2 0.0776 / 0.2548 / 0.1371, with asm 1
# 0.0754 / 0.2433 / 0.1334; side 1 with asm 1 0.0658 / 0.2608 / 0.1207, asm 2 0.0652 / 0.2576 /
# 0.1209; side 2 capped at 168 registers (12 warps an SM, 26 spill reloads a page) 0.0905 /
# 0.3038 / 0.1598; the 2-D loop 0.1057 / 0.3676 / 0.1959. side_k16 3 (side 2): 0.0844 at 128k
# against 0.0772. v11's sweep (side_k16 3: rows, stages, register caps) is in the notes.
# side_vt: the values transposed, Vᵀ as the dot's first operand converted in its own registers
# (exact codes, no scale FMA, no shared-memory round trip of the dequantized tile), V's
# per-token scales folded into the fp16 probabilities per group of channels and sum_t p z
# accumulated apart (`_side_values_folded`; 16-bit inputs). H200, side 1, graph timing, int4
# 128k / 512k / B8 32k: 0.0559 / 0.2275 / 0.1054 ms against 0.0652 / 0.2553 / 0.1172 without
# (2.25x / 2.07x / 2.28x SDPA in that run). sm_90 compile with triton 3.6 (scripts/sass_decode.py
# --svt 1), side 1, groups of 64: 1,325 instructions a page and 9 barriers against 1,600 and 10;
# with groups of 32 (8 rows a group's dot) 2,305, and side 2 1,422 with 25 barriers (neither
# measured on the GPU).
# v13 (H200, graph timing, scripts/diag_speed.py; notes v13): the sinks and the tail 16 tokens
# a step, transposed (`_unquantized`; the whole-page step had held ~250 registers), int4 128k /
# 512k / B8 32k 0.0511 / 0.2282 / 0.0910 ms (2.54x / 2.11x / 2.70x SDPA in that run); capped at
# 168 registers 0.0991 at 128k (24 spills). side_bits 8: int8 pages side by side too (BYTES
# blocks), 128k 0.0809 ms against the 2-D loop's 0.1220 (1.58x against 1.05x), 512k 0.3558,
# B8 32k 0.1614; capped at 168 registers 0.1857. side_short: pages a step side by side where a
# program gets at most two (0: the 2-D loop): int4 4k 0.0119 ms with 2, 0.0133 with 4, 0.0178
# with the 2-D loop (SDPA 0.0115). side_apart (the sinks and the tail in the last split, alone):
# int4 4k 0.0102 against 0.0112 ms, but 128k 0.0899 against 0.0516 and int8 128k 0.1200 against
# 0.0790, where it made 129 splits: the merge launch then compiled for 256 (S_PAD) and spilled
# (sm_90, triton 3.6: 2,680 bytes of stack against none at 128; scripts/sass_decode.py
# --merge-splits). merge_chunk: the merge launch reads at most this many splits at once (0:
# all): 128 leaves launches of up to 128 splits as they were and takes 512k's 131 (the
# default's own grid there) in two steps of 128 with no spill: int4 512k 0.1895 ms against
# 0.2183 with 0, int8 512k 0.2809 against 0.3522 (v14, same sweep). With merge_cols' 32 columns
# at batch 1, 131 splits at once compile without spills (118 registers) but save ~0.1 us of the
# 2.9 us merge (v28): the chunks stay for launches of all 128 columns. With it, side_apart wins
# at 4k (0.0102 against 0.0113) and ties at 512k (0.1880 against 0.1895), but loses at 128k
# (0.0541 against 0.0525), int8 128k (0.0818 against 0.0797) and B8 32k (0.1020 against
# 0.0910): off by default. side_zdot: with side_vt, V's zero-point term sum_t p z per group
# as a small dot of the fp16 zeros and probabilities rather than a sum over the page's
# tokens. As a dot's operand the zeros' load is prefetched by the pipeliner with the others;
# the sum left it in the loop, where it stalled each page (Nsight Compute, notes v14). sm_90
# SASS (triton 3.6, int4): 1,257 instructions a page against 1,290, 74 shuffles against 86.
# side_zdot is the largest V width that takes it (0: none). H200, CUPTI kernel times in graph
# replays, two alternating rounds (scripts/diag_parts.py --ab, notes v15): int4 decode kernel
# 46.6 against 47.9 us at 128k, 160.4-160.7 against 165.0-165.1 at 512k, 84.8-85.0 against
# 87.1 at batch 8 / 32k, 7.0 against 7.2 at 4k; int8 at 128k slower, 77.7-78.0 against 75.0.
# merge_cols: the merge launch's programs take blocks of this many columns where one program a
# head would leave SMs idle (`_merge_cols`; 0: never). Same runs, merge kernel at batch 1:
# 2.28-2.32 against 2.97-2.99 us at 128k, 3.59-3.61 against 4.51-4.58 at 512k, 1.70-1.76
# against 2.01-2.02 at 4k (at batch 8, 256 heads, blocks of 32 ran 2.39 against 2.09 us: the
# rule keeps all columns there). Launched as a programmatic dependent of the decode kernel
# (PDL: it may start while that ends) the merge saved nothing measurable in the whole call
# (128k 54.2-54.9 against 53.2-55.2 us): not kept. pdl (off): both launches as programmatic
# dependents, the decode kernel too (notes v21); the bench's whole call (scripts/bench_ab.py,
# two rounds): int4 128k 49.6, 49.1 against 48.6, 48.7 us; 512k 164.1, 164.5 against 165.2,
# 166.2; batch 8 at 32k 88.7, 88.3 against 86.8, 86.9: no gain. side_skip: side by side, a program with no
# sink page and no tail block skips the unquantized loops altogether; their pipelined
# prologues (address arithmetic and predicated-off copies) otherwise run in every program.
# sm_90 SASS (triton 3.6, int4, side_zdot): ~890 instructions outside the side loop in such a
# program against ~1,600; the side loop 1,260 a page against 1,257, no spills. H200, decode
# kernel alone (scripts/diag_parts.py --ab, two rounds, notes v16): int4 128k 46.1, 46.0
# against 46.6, 46.6 us; 512k 161.8, 161.6 against 162.1, 162.2; batch 8 at 32k 85.1, 85.5
# against 85.6, 85.6; int8 128k 73.9, 74.0 against 75.7, 75.8; but int4 4k 7.5, 7.6 against
# 6.9, 6.9 (programs of two pages: side_short), so it applies only where programs get more.
# side_unmasked: one page a step with no left padding masks no score, so the side loop leaves
# the masking out (sixteen FSELs and the compare a page) where both sides have at most this
# many bits (0: never). H200, decode kernel alone, three rounds of four trees (notes v19): int4
# 128k 44.9-45.0 against 45.3-45.5 us; int8 128k slower, 74.4-74.8 against 72.6-73.0.
# side_stages 3 (the sinks and tail loops kept at two, 18.7 KB of shared memory a program;
# int8 pages take 34.5 KB, 6 programs an SM), same runs (v16): int4 128k 46.4, 46.6 against
# 45.4, 45.3 us; 512k 155.2, 155.0 against 157.9, 158.2; batch 8 at 32k 83.4, 83.4 against
# 83.7, 83.4; 4k 7.4, 7.4 against 6.8, 6.8. Cheaper a page, dearer a program: not kept. v28
# (diag_parts --ab, decode kernel): slower at 512k too now, 155.6-155.8 against 152.9-153.1 us;
# 128k 46.2-46.4 against 43.8-43.9; batch 8 83.8-84.0 against 80.5-80.6.
# Tried and dropped (v16, same kind of runs): an L2 prefetch (`prefetch.global.L2`) of the
# pages one to three steps ahead, slower by 2-16 us at 128k and more with distance. v17: asm 1
# capped at 200 registers (10 warps an SM, no spills in the side loop) 71.4 against 45.8 us at
# int4 128k; the driver asked for the largest shared-memory carveout: no change; three stages
# from 32 pages a program on: int4 0.5-1.3 % faster, int8 slower (six programs an SM); the side
# loop skewed (a step scoring the next pages while it accumulates its own values): slower
# everywhere, int4 128k 48.4 against 45.9 us.
# side_tiles: pages of more than 64 tokens go side by side as tiles of 64 tokens, one tile a
# step, each loading its page's K scales (False: the 2-D loop, as before). The 2-D loop ran
# int4 pages of 128 tokens at 0.1020 ms at 128k on the H200 (1.27x SDPA; pages of 64 side by
# side 0.0482, notes v22). sm_90 SASS (triton 3.6, scripts/sass_decode.py --block-size): int4
# 1,283 instructions a tile with pages of 128 (1,285 with 256) against 1,246 a page of 64; int8
# 1,299 / 1,296 against 1,225; 255 registers, no spills. H200, pages of 128, the bench's call
# under graphs (scripts/bench_ab.py --block-size 128, two rounds, notes v23): int4 128k 47.9,
# 48.3 us against 101.2, 100.5 through the 2-D loop (2.61x against 1.25x SDPA); 512k 163.2,
# 163.7 against 334.2, 334.8; batch 8 at 32k 86.5 against 185.5: as fast as pages of 64.
# side_tiny: the side loop's codes go into K's dots (side_k16 1) and V's transposed dots
# (side_vt) as fp16 subnormals, c * 2^-24 (int4's odd nibbles 16c * 2^-24): one AND (int4) or
# PRMT with a zero byte (int8) a pair of codes, where fp16 1024 + c left K a 1024 * q*s term to
# subtract from every score and V an f16x2 subtract or FMA a pair; the units come out of K's
# scores a page and V's sums at the end (triton_tiles' tiny form; the tensor cores multiply
# subnormal fp16 exactly: the GPU tests pass on the H200). sm_90 SASS (triton 3.6): int4 1,061
# instructions a page against 1,246, int8 1,043 against 1,225. H200, the bench's whole call
# (scripts/bench_ab.py, two rounds, notes v25): int4 128k 46.2, 47.0 against 47.9, 47.9 us;
# 512k 156.4, 156.4 against 162.3, 161.8; batch 8 at 32k 82.9, 83.2 against 86.3, 86.0; int8
# 128k 72.5, 72.2 against 72.2, 72.8 (no change). PTX leaves mma's handling of subnormal
# inputs unspecified, so a device takes tiny codes only where a probe dot shows it exact
# (`tiny_codes_exact`, once a device; a graph captured before any eager call takes the
# biased and exact codes).
TUNE = dict(num_warps=4, num_stages=3, short_stages=2, programs_per_sm=4, maxnreg=0, stages16=2, programs16=8, k16=3, v16=True,
            pages=1, words=True, asm=1, merge="auto", merge_chunk=128, merge_cols=32, merge_tree=16, merge_tree_from=64, side=1, side_bits=8, side_short=2, side_k16=1, side_vt=True, side_dense=32, side_apart=False, side_zdot=4, side_skip=True, side_unmasked=4, side_rows=4, side_stages=2, side_programs=16, side_tiles=True, side_tiny=True, pdl=False,
            rot_query=True, rot_out=True, shared_from=8192, shared_rows=8, shared_warps=1,
            prefill="auto", prefill_staged_from=128, prefill_rows=128, prefill_programs=1, prefill_warps=8, prefill_stages=2,
            prefill_k16=4, prefill_v16=False, prefill_tile=0, loop_tile=0, shared_limit=0)
# loop_tile: tokens of a page the 2-D decode loop (pages with a 16-bit side) reads a step, its
# sinks and tail alike (a power of two >= 16), or 0: whole pages where they fit the device's
# shared memory in one stage, else the largest tile (at most 64 tokens, `loop_tiles`) that
# fits, by prefill_tile's rule (`fit_tile`). fp32 queries over 16-bit pages of 256 tokens need 155,712
# bytes in one stage (sm_89, scripts/sass_decode.py --dtype fp32): over an RTX 3090's or
# 4090's 101,376, where tiles of 64 need 78,080.
# shared_limit: bytes of shared memory a launch may use, where lower than the device's (0: the
# device's). A launch whose kernel needs more takes fewer stages (`stages_that_fit`); tests set
# it to run a consumer card's 99 KiB on the H200.
# rot_query, rot_out: rotated pages' queries rotated by each decode or prefill program, and its
# sealed pages' share of the output rotated back before its partial is stored (fp32 butterflies,
# `hadamard_planes`), so that rotated splits merge as unrotated ones do (in the kernel, the
# launch or the grid). Off: `rotate_triton` launches first, and `_merge_rotated` merges two
# partials a split and rotates the result back. H200, the bench's whole call (scripts/bench_ab.py,
# e544bed, notes v42), int4+rot with both / the output only / neither in the kernel, us: 4k 12.02
# / 15.51 / 16.94, 128k 48.50 / 52.45 / 59.18, 512k 159.87 / 164.03 / 173.16; int2 at 128k 74.82 /
# 81.22 / 87.51.
# shared_from, shared_rows, shared_warps: where the rows of each run (a prompt's beams,
# `PagedView.shared_run`) hold their first blocks alike and they reach shared_from tokens (0:
# never), a decode call reads them in a launch of its own whose programs each take a group of a
# run's rows' queries (at most shared_rows: R = 2 rows of GQA 4), then each row's own blocks and tail in a second launch, and merges both
# (`_decode_shared`). The GPU's L2 does not spare the repeats: one layer (Llama-3-8B shape,
# int4, graph timing, scripts/diag_shared_rows.py, notes v34), 4 rows sharing 128k tokens read
# whole 146.9 us against 49.1 for one row. Through the shared launch: 8 queries a program on one
# warp (255 registers, 14 spills) 94.6 us; 16 queries on one warp (192 spills) 160.9, on two
# warps (4 spills, fewer splits fit) 134.4, on four 200.4; 8 queries on two warps 205.0. At 32k:
# 36.6 us (8 on one warp) against 46.0 whole. A beam step of bench e2e's model at 128k, 4 beams
# (scripts/diag_generate.py 131072 64 1 4 --shared): 13.7 ms against 16.2 reading whole rows.
# prefill (prefill.py): "kernel" (paged_prefill_triton: the pages read in place), "staged" (the
# past dequantized into a bf16 buffer, then SDPA's flash kernel), or "auto" (`prefill_path`).
# The kernel dequantizes each page once per block of prefill_rows query rows (query tokens x G
# heads), staging once per chunk, and staging's flash kernel is the faster dense attention:
# the kernel wins only on short chunks. Its shape (H200, scripts/diag_prefill.py, int4, 128k
# past, attention alone): 128 rows and 8 warps 6.53 ms for a 512-token chunk, 25.1 for 2,048,
# 203 for 16,384; 64 rows and 8 warps 12.7 / 49.9 / 396; 64 rows and 4 warps 6.59 / 26.2 / 216;
# three stages or 16-bit dequantization (k16=3, v16) slower; staging 7.62 / 19.1 / 101 (its gather
# then stored a sub-tile of channels at a time; whole rows since v39: the whole chunk step 4.52 / 16.4 / 99.1).
# 128 rows and 8 warps take 255 registers: one program per SM (prefill_programs).
# prefill_staged_from: `prefill_path`'s crossover.
# prefill_tile: tokens of a page a prefill step reads (a power of two >= 16), or 0: the largest of
# the page (at most 128 tokens) and its halves that fits the device's shared memory without
# spilling registers, in the most stages that do (prefill.py, `_prefill_fit`). Whole pages of 256
# tokens need 131,072 bytes in one stage: over a 99 KiB card's, and slower than tiles of 128 on
# the H200.
STAMP: torch.Tensor | None = None  # diagnostics: int64 [>= programs * 8] for the kernel's STAMPS (scripts/diag_timeline.py)
BOUND: torch.Tensor | None = None  # experiments: int32 [rows * KV heads, splits + 1], the kernel's BOUNDS (scripts/diag_balance.py)
LAST: dict = {}  # the last decode kernel launched (compiled: registers, spills; its grid)


def num_splits(batch: int, kv_heads: int, total_blocks: int, sm_count: int, programs_per_sm: int | None = None) -> int:
    """Splits of the KV length so that the (row, KV head, split) programs fill `programs_per_sm`
    per SM (what fits at once, `programs_fit`) in one whole wave, rounding down: a second,
    nearly empty wave doubled the time (batch 8 at 32k: 9 splits ran 0.279 ms, 8 by the same
    rule would leave 3 % of the slots idle). Short contexts and big batches get one program per
    (row, head), whose output needs no merge."""
    slots = (programs_per_sm or TUNE["programs_per_sm"]) * sm_count
    per_row_head = max(1, slots // max(1, batch * kv_heads))
    return max(1, min(per_row_head, total_blocks, 256))


def programs_fit(regs: int, shared: int, num_warps: int, props=None) -> int:
    """Programs of `num_warps` warps, `regs` registers a thread and `shared` bytes of shared
    memory that one SM holds at once (CUDA's occupancy rules: registers allocated per warp in
    units of 256, 1 KiB of shared memory reserved per block; sm_90's limits where `props`, a
    torch device-properties object, does not say)."""
    regs_sm = getattr(props, "regs_per_multiprocessor", 0) or 65536
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
    threads_sm = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    per_warp = -(-max(1, regs) * 32 // 256) * 256
    by_regs = (regs_sm // per_warp) // num_warps
    by_smem = smem_sm // (shared + 1024)
    return max(1, min(by_regs, by_smem, threads_sm // (32 * num_warps), 32))


@functools.lru_cache(maxsize=8)
def _device_shared(device_index: int) -> int:
    """Shared memory a block may have on the device (what Triton checks before a launch)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def shared_limit(device_index: int) -> int:
    """The device's shared memory a block, or TUNE["shared_limit"] where that is set and lower
    (a test of the fallback below on a card with more)."""
    cap = TUNE["shared_limit"]
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
        raise ValueError(f"TUNE['shared_limit'] must be a byte count >= 0 (0: the device's), got {cap!r}")
    own = _device_shared(device_index)
    return min(own, cap) if cap else own


_STAGES: dict = {}  # the stages a launch takes, by kernel, device, constexprs and options


def fit_key(fn, device_index: int, consts: dict) -> tuple:
    """A cache key for a launch's fit to the device's shared memory: the kernel, the device, the
    limit and the constexprs and options (by repr: True and 1 compile apart)."""
    return (fn, device_index, TUNE["shared_limit"], repr(sorted(consts.items())))


def too_big(what: str, shared: int, limit: int, smallest: str = "with one stage",
            advice: str = "smaller blocks (KVConfig's block_size), 16-bit inputs, or backend='reference'") -> SharedMemoryError:
    """The error of a launch whose kernel does not fit the device's shared memory even in its
    `smallest` form."""
    return SharedMemoryError(
        f"{what}: the Triton kernel needs {shared} bytes of shared memory a block even {smallest}, and this GPU allows {limit}; use {advice}")


TILE_MAX = 128  # tokens a step reads at most where a loop reads pages in tiles, unless asked for more (`page_tiles`)
SPILL_MAX = 64  # words of local memory (spilled registers) a thread a tile's kernel may take before a smaller tile is tried


def page_tiles(block_size: int, option: str) -> list[int]:
    """Tokens of a page a loop step may read (TUNE[option]), largest first: the page or, past
    TILE_MAX tokens, TILE_MAX, and their halves down to 16 (0, "auto"); or the one tile asked
    for (a page's size or more: the whole page)."""
    tile = TUNE[option]
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0 or (tile and (tile < 16 or tile & (tile - 1))):
        raise ValueError(f"TUNE[{option!r}] must be 0 (auto) or a power of two >= 16, got {tile!r}")
    if tile:
        return [min(tile, block_size)]
    top = min(block_size, TILE_MAX)
    return [top >> i for i in range(top.bit_length()) if top >> i >= 16]


def compiled_fit(fn, grid, args, consts: dict, limit: int) -> tuple[int, int | None]:
    """(shared memory a block, local memory words a thread) of `fn`'s kernel compiled for `args`
    with `consts` (warmed up, not launched); the words None where the shared memory is over
    `limit` (the binary is then not loaded: Triton refuses to load one over the device's)."""
    kernel = fn.warmup(*args, grid=grid, **consts)
    if kernel.metadata.shared > limit:
        return kernel.metadata.shared, None
    return kernel.metadata.shared, getattr(loaded(kernel), "n_spills", None) or 0


def fit_tile(compiled, tiles: list[int], stages: int, limit: int, what: str, advice: str) -> tuple[int, int]:
    """(tile, stages) of a loop that reads pages in tiles: the largest of `tiles`, in the most
    stages (`stages` at most), whose kernel fits `limit` bytes of shared memory and spills at
    most SPILL_MAX words a thread; where every one that fits spills more, the one that spills
    least; SharedMemoryError where not even the smallest tile fits in one stage.
    compiled(tile, stages) gives (shared bytes, local words or None where over the limit). A
    larger tile before more stages: the prefill kernel's tiles of 32 in two stages lost 20-41 %
    to tiles of 128 in one under a 99 KiB limit on the H200 (notes v45)."""
    least = None  # (spills, tile, stages) of the fitting ones, the first best
    for tile in tiles:
        for n in range(stages, 0, -1):
            need, spills = compiled(tile, n)
            if spills is not None:
                if spills <= SPILL_MAX:
                    return tile, n
                if least is None or spills < least[0]:
                    least = (spills, tile, n)
    if least is None:
        raise too_big(what, need, limit, f"with one stage and tiles of {tiles[-1]} tokens", advice)
    return least[1], least[2]


def stages_that_fit(fn, grid, args, consts: dict, device_index: int, what: str) -> int:
    """num_stages for a launch of `fn` with `consts` (its constexprs and options, num_stages
    among them): theirs where the compiled kernel's shared memory fits the device
    (`shared_limit`), else the most below it that fits. Copies in flight take shared memory a
    stage; sm_86 and sm_89 cards (RTX 3090, 4090) allow 99 KiB a block and sm_80 163, where the
    H200 the stages were chosen on allows 227: pages of 256 tokens in two stages do not fit
    there. Raises SharedMemoryError, naming the sizes, where even one stage does not. `args`
    may be a callable that gives them (built only where the choice is not cached yet). The
    error is cached too: a kernel that does not fit is not compiled again."""
    key = fit_key(fn, device_index, consts)
    stages = _STAGES.get(key)
    if stages is None:
        limit = shared_limit(device_index)
        args = args() if callable(args) else args
        for stages in range(consts.get("num_stages") or 3, 0, -1):
            shared = fn.warmup(*args, grid=grid, **dict(consts, num_stages=stages)).metadata.shared  # (compiled, not launched)
            if shared <= limit:
                break
        else:
            stages = too_big(what, shared, limit)
        _STAGES[key] = stages
    if isinstance(stages, SharedMemoryError):
        raise stages
    return stages


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_FIT: dict = {}  # programs per SM that fit, by device, format and TUNE


def loaded(kernel):
    """A compiled (warmed-up) kernel with its binary loaded, which reports its registers
    (n_regs) and local memory (n_spills, words a thread)."""
    if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    return kernel


def _fit(kernel, num_warps: int, device: int) -> int:
    """programs_fit of a compiled (warmed-up) decode kernel on `device`."""
    regs = getattr(loaded(kernel), "n_regs", None)
    if regs is None:  # a Triton that does not say: keep TUNE's count
        return 32
    return programs_fit(regs, kernel.metadata.shared, num_warps, torch.cuda.get_device_properties(device))


@triton.jit
def _tiny_probe_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """C [M, N] fp32 = A [M, K] (int16 bits read as fp16) @ B [K, N] fp16, one tensor-core dot."""
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, K)
    offs_n = tl.arange(0, N)
    a = tl.load(A + offs_m[:, None] * K + offs_k[None, :]).to(tl.float16, bitcast=True)
    b = tl.load(B + offs_k[:, None] * N + offs_n[None, :])
    tl.store(C + offs_m[:, None] * N + offs_n[None, :], tl.dot(a, b))


_TINY_OK: dict = {}  # by device: whether its dots multiply subnormal fp16 exactly


def tiny_codes_exact(device: torch.device) -> bool | None:
    """Whether `device`'s tensor-core dots multiply subnormal fp16 operands exactly, which
    TUNE["side_tiny"] relies on (PTX leaves the handling of subnormal mma inputs unspecified;
    the H200 does). A probe dot of codes 0..255 as fp16 bits (c * 2^-24) against fp16 values of
    the scales' magnitudes, one warp as the side loop's dots, against fp64; run once a device
    and cached. None (not cached) while a CUDA graph is being captured on the current stream,
    where the probe cannot wait for its result."""
    key = _device_key(device)
    if key in _TINY_OK:
        return _TINY_OK[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    codes, b = _tiny_probe_inputs()
    out = torch.empty(16, 16, dtype=torch.float32, device=device)
    _tiny_probe_kernel[(1,)](codes.to(device), b.to(device), out, 16, 32, 16, num_warps=1, **TRITON_OPTIONS)
    ok = _tiny_probe_verdict(out.cpu(), codes, b)
    _TINY_OK[key] = ok
    return ok


def _device_key(device: torch.device) -> str:
    """A device's key in _TINY_OK, with its index: "cuda" (the current device) keys as "cuda:0"
    would when that device is 0."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _tiny_probe_inputs():
    """The probe's codes [16, 32] (0..255, int16) and fp16 values [32, 16] (columns from 1e-4 to
    10 in magnitude, as q*s spans)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (16, 32), generator=g, dtype=torch.int16)
    b = (torch.randn(32, 16, generator=g) * torch.logspace(-4, 1, 16)).to(torch.float16)
    return codes, b


def _tiny_probe_verdict(out: torch.Tensor, codes: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the probe's dot `out` is (codes * 2^-24) @ b to fp32 accumulation (1e-5 of the
    sum of the terms' magnitudes): a flushed or truncated subnormal operand is far off."""
    a = codes.double() * 2.0**-24
    return bool(((out.double() - a @ b.double()).abs() <= 1e-5 * (a @ b.double().abs())).all())


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """Per-device int32 zeros, one per (row, KV head): the in-kernel merge's finished-split
    counts. Each merge sets its counter back to 0, so the buffer is reused across calls (and
    CUDA graph replays) without clearing; one stream at a time uses it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def _per(bits: int, words: bool) -> int:
    """Sub-tiles of one side (the kernel's PK/PV): codes per load word, int16 words for 8 and
    4 bits when `words`, bytes otherwise. (int2 keeps the bytes' 4 sub-tiles: the side loop
    reads its codes as int16 words itself, two bytes' sub-tile r a word, whatever `words` says:
    triton_tiles' _int2_words_f16 and _int2_rows_f16.)"""
    return 1 if bits == 16 else (16 if words and bits >= 4 else 8) // bits


def _words(codes: torch.Tensor, bits: int, words: bool) -> torch.Tensor:
    return codes.view(torch.int16) if words and bits in (4, 8) else codes


def _merge_mode(option: str, capturing: bool) -> str:
    """TUNE["merge"] checked (with the merge's other knobs) and resolved: "auto" is "launch"
    under CUDA graph capture, else "kernel"."""
    if option not in ("auto", "kernel", "launch", "grid"):
        raise ValueError(f"TUNE['merge'] must be 'auto', 'kernel', 'launch' or 'grid', got {option!r}")
    c = TUNE["merge_chunk"]
    if isinstance(c, bool) or not isinstance(c, int) or c < 0 or c & (c - 1):
        raise ValueError(f"TUNE['merge_chunk'] must be 0 (all splits at once) or a power of two, got {c!r}")
    c = TUNE["merge_cols"]
    if isinstance(c, bool) or not isinstance(c, int) or c < 0 or (c and (c & (c - 1) or c < 16)):
        raise ValueError(f"TUNE['merge_cols'] must be 0 (all columns) or a power of two of at least 16, got {c!r}")
    c = TUNE["merge_tree"]
    if isinstance(c, bool) or not isinstance(c, int) or c < 0 or c == 1:
        raise ValueError(f"TUNE['merge_tree'] must be 0 (the last split merges all) or a group size of at least 2, got {c!r}")
    c = TUNE["merge_tree_from"]
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise ValueError(f"TUNE['merge_tree_from'] must be a split count (an int >= 0), got {c!r}")
    if option == "auto":
        return "launch" if capturing else "kernel"
    return option


def _merge_tree(splits: int) -> int:
    """Splits a group of the in-kernel merge (0: the last split merges them all, SB a step,
    8 at Llama-3's shape): TUNE["merge_tree"] from TUNE["merge_tree_from"] splits on. H200,
    int4 at 128k (128 splits), decode kernel with the in-kernel merge: all at once 56.9-57.0
    us, groups of 8 51.7-51.8, of 16 50.9-51.0 (512k: 176.5-177.0, 169.8-170.1, 167.5-167.6;
    int8 128k: 84.2-84.3, 78.1-78.3, 78.0-78.2); at 32 splits (int4 4k) groups are slower,
    10.47 us all at once against 10.64 (groups of 8) and 11.45 (16), notes v20."""
    g = TUNE["merge_tree"]
    return g if g and splits >= TUNE["merge_tree_from"] else 0


def _merge_cols(D: int, heads: int, sm: int) -> int:
    """Columns a program of the merge launch (0: all D): blocks of TUNE["merge_cols"] (checked
    by _merge_mode; 0: never) while the `heads` (rows x query heads) programs times the
    blocks stay within one per SM. Batch 1 of Llama-3's 32 heads leaves 100 of the H200's 132
    SMs idle with one program a head; four blocks of 32 columns fill 128."""
    c = TUNE["merge_cols"]
    if not c or c >= D:
        return 0
    n = D // c
    while n > 1 and heads * n > sm:
        n //= 2
    return D // n if n > 1 else 0


def _pages_per_step(fmt) -> int:
    """Sealed pages per loop step: TUNE's for quantized pages, up to 128 tokens a step (two
    256-token pages overflowed shared memory); 16-bit pages one at a time, as when they met
    their target (two a step were not faster in the one run that tried them)."""
    if fmt.k_bits == 16 and fmt.v_bits == 16:
        return 1
    return max(1, min(TUNE["pages"], 128 // fmt.block_size))


def _side(fmt, short: bool) -> int:
    """Sealed pages a loop step side by side, one a warp (0: the 2-D loop): for pages of at
    most TUNE["side_bits"] bits on both sides, TUNE["side"] of them, or TUNE["side_short"]
    where a program gets at most two pages (short contexts). Pages of more than SIDE_TILE tokens
    go as tiles of that many (TUNE["side_tiles"]; else through the 2-D loop)."""
    for name, ok in (("side", (0, 1, 2, 4, 8)), ("side_short", (0, 1, 2, 4, 8)), ("side_k16", (0, 1, 3)), ("side_bits", (4, 8)),
                     ("side_dense", (16, 32)), ("side_zdot", (0, 4, 8)), ("side_unmasked", (0, 4, 8))):
        if TUNE[name] not in ok or isinstance(TUNE[name], bool):
            raise ValueError(f"TUNE[{name!r}] must be one of {', '.join(map(str, ok))}, got {TUNE[name]!r}")
    for name in ("side_vt", "side_apart", "side_skip", "side_tiles", "side_tiny", "pdl"):
        if TUNE[name] not in (False, True):
            raise ValueError(f"TUNE[{name!r}] must be True or False, got {TUNE[name]!r}")
    if not TUNE["side"] or max(fmt.k_bits, fmt.v_bits) > TUNE["side_bits"] or (fmt.block_size > SIDE_TILE and not TUNE["side_tiles"]):
        return 0
    return TUNE["side_short"] if short else TUNE["side"]


def _side_k16(half: bool, scales16: bool) -> int:
    """K's arithmetic side by side (TUNE["side_k16"]): 1 folds the scales into the query per
    page, 3 dequantizes K in 16 bits (needs 16-bit scales; else 1), 0 (and fp32 inputs) in fp32."""
    k16 = TUNE["side_k16"] if half else 0
    return 1 if k16 == 3 and not scales16 else k16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Setup(NamedTuple):
    """What both launchers derive from a query [B, H_q, C, D] and a view."""
    fmt: object
    q: torch.Tensor  # stride 1 along D
    qr: torch.Tensor  # q rotated (the query of the sealed pages), or q
    table: torch.Tensor  # at least one column
    n_blocks: int
    n_sink: int  # sink blocks the table holds (at most n_blocks)
    tail_len: int
    total: int  # logical blocks: sinks, sealed pages, then the tail's
    device: int | None  # CUDA device index
    sm: int  # SMs to fill (4 off the GPU, where the interpreter runs)
    gpu: bool  # compiled for a GPU, not interpreted
    pools: tuple
    consts: dict | None  # the constexprs both kernels take (`_kernel_consts`; None where not asked for)


def _setup(q, view: PagedView, start, who: str, consts: bool = True, rotate_q: bool = True) -> _Setup:
    """What a launch takes from q and the view; with consts=False its constexprs are None
    (`_kernel_consts` gives them: a cached decode plan holds its own). rotate_q False: qr is q
    for rotated pages too (the kernel rotates its queries itself, ROT_Q)."""
    fmt = view.pages.fmt
    B, D = q.shape[0], q.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    qr = q
    if fmt.rotate and rotate_q:  # (one launch; torch's q.float() @ H then .to took three)
        qr = rotate_triton(q)
        if qr.stride() != q.stride():  # (q not dense: qr is contiguous, and the kernels index both alike)
            q = q.contiguous()
    table = view.block_table
    n_blocks = table.shape[1]
    if n_blocks == 0:
        table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    tail_k, tail_v = view.tail_k, view.tail_v
    if tail_k.stride(-1) != 1 or tail_k.stride() != tail_v.stride():
        raise ValueError(f"{who}: tail_k/tail_v must be contiguous along D and strided alike")
    tail_len = tail_k.shape[2]
    total = n_blocks + (tail_len + fmt.block_size - 1) // fmt.block_size
    device = _device(q)
    sm = _sm_count(device) if q.is_cuda else 4
    words = TUNE["words"]
    pools = kernel_pools(view, who, lambda c, bits: _words(c, bits, words))
    gpu = q.is_cuda and not _interpreting()
    return _Setup(fmt, q, qr, table, n_blocks, min(view.n_sink, n_blocks), tail_len, total, device, sm, gpu, pools,
                  _kernel_consts(fmt, q, pools[3], start, gpu, who) if consts else None)


def _kernel_consts(fmt, q, KS, start, gpu: bool, who: str) -> dict:
    """The constexprs both kernels take, from the format, q [B, H_q, ..., D], K's scales (KS,
    for their dtype), whether rows start late, and TUNE (checked here)."""
    words = TUNE["words"]
    per_v = _per(fmt.v_bits, words)
    if fmt.group_size % per_v:
        raise BackendUnavailableError(f"{who} needs group_size divisible by {per_v} at {fmt.v_bits} bits, got {fmt.group_size}")
    Hq, D = q.shape[1], q.shape[-1]
    dot = tl.float16 if q.dtype == torch.float16 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float32)
    half = dot != tl.float32
    if TUNE["asm"] not in (0, 1, 2, 4):
        raise ValueError(f"TUNE['asm'] must be 0 (no inline PTX) or the int4 sub-tiles one block converts (1, 2, 4), got {TUNE['asm']!r}")
    if TUNE["k16"] not in (0, 1, 2, 3) or TUNE["v16"] not in (0, 1, 2):
        raise ValueError(f"TUNE['k16'] must be 0-3 and TUNE['v16'] 0-2 (False/True count as 0/1), got {TUNE['k16']!r}, {TUNE['v16']!r}")
    k16 = TUNE["k16"] if half else 0
    if k16 == 3 and KS.dtype not in (torch.float16, torch.bfloat16):
        k16 = 2  # K dequantizes in 16 bits from 16-bit scales
    # bf16 holds 128 + c exactly for codes c < 128 (int4, int2), not int8's: int8 K dequantizes
    # in fp16 (bf16 scales and zeros convert exactly within fp16's normal range, 6.1e-5 to
    # 65504; smaller ones lose bits as subnormals, larger ones would overflow)
    kdt = tl.bfloat16 if KS.dtype == torch.bfloat16 and fmt.k_bits <= 4 else tl.float16
    rot_q, rot_o = _rotation_knobs(fmt)
    return dict(H=fmt.num_kv_heads, G=Hq // fmt.num_kv_heads, D=D, P=fmt.block_size, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits,
                GS=fmt.group_size, ROTATE=fmt.rotate, HAS_START=start is not None, DOT=dot, PREC="ieee" if not half else "tf32",
                K16=k16, V16=half and TUNE["v16"], KDT=kdt, WORDS=words, ASM=int(TUNE["asm"]) if gpu else 0,
                # sub-tiles per side: codes per load word (int16 words for 8 and 4 bits when WORDS)
                PK=_per(fmt.k_bits, words), PV=per_v,
                # rotated pages: the queries and the sealed pages' share rotated in the program
                ROT_Q=rot_q, ROT_O=rot_o, INV_SQRT_D=hadamard_scale(D) if fmt.rotate else 1.0, PTX=gpu)


def _device(q) -> int | None:
    return q.device.index if q.device.index is not None else torch.cuda.current_device() if q.is_cuda else None


@triton.jit(do_not_specialize=["S"])
def _merge_rotated_kernel(O, OR, LSE, SIGNS, OUT, LOUT, S, D: tl.constexpr, S_PAD: tl.constexpr, SC: tl.constexpr,
                          BD: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """The merge launch for rotated pages (`_merge_rotated`): `_merge_head` with ROT over
    contiguous rows (row program_id(0), column block program_id(1))."""
    _merge_head(O, LSE, OUT, LOUT, tl.program_id(0), 0, tl.program_id(1), S, S * D, 0, D, S, 0, D, 0,
                1, D, S_PAD, SC, BD, False, OR, SIGNS, True, INV_SQRT_D)


def _merge_rotated(o, o_r, lse, out, lout, sm: int) -> None:
    """Splits' two partial outputs (unrotated o, rotated o_r [..., S, D] fp32, contiguous,
    each normalized on its own) merged by their LSE [..., S] into out [..., D] (any float
    dtype) and lout [...] (fp32; -inf where no split saw a key), the rotated part rotated back:
    one launch of the merge (`_merge_rotated_kernel`), where a torch merge had taken ~25 small
    kernels (on the H200 under CUDA graphs, int4+rot decode at 4k 0.076 ms against int4's
    0.010; notes v40). The merge launch's shape for the rows (`merge_shape`, sm SMs to fill),
    its splits read at most 32 at a time: each read takes the rotated partials' D columns."""
    S, D = o.shape[-2], o.shape[-1]
    rows = lse.numel() // S
    for t, n in ((o, rows * S * D), (o_r, rows * S * D), (lse, rows * S), (out, rows * D), (lout, rows)):
        if not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"_merge_rotated: buffers must be contiguous [rows={rows}, S={S}, D={D}] and their merges, got {tuple(t.shape)}")
    _merge_mode(TUNE["merge"], False)  # (checks the merge's knobs)
    merge = merge_shape(rows, 1, D, sm, S)
    merge["SC"] = min(merge["SC"] or 32, 32)
    _merge_rotated_kernel[(rows, D // merge["BD"] if merge["BD"] else 1)](
        o, o_r, lse, hadamard_signs(D, o.device), out, lout, S, D=D, **merge, INV_SQRT_D=hadamard_scale(D), num_warps=4, **TRITON_OPTIONS)


class _Plan(NamedTuple):
    """What a decode launch derives from its shapes, dtypes, lengths and TUNE, apart from the
    tensors themselves (`_decode_plan`). The layers of a decode step launch alike, and so do
    the steps until the next block seals: `_PLANS` keeps plans by what decides them, so that a
    call's host work is its checks, its buffers and the launch."""
    splits: int
    bps: int  # logical blocks a split (whole loop steps)
    apart: bool  # side_apart: the sinks and the tail in a split of their own
    merged: bool  # one split: the kernel writes the final output
    mode: str  # how the splits merge (`merge_mode`): "kernel", "grid", "launch" or ""
    grid: tuple  # the decode launch's grid: (rows x KV heads, splits and any merge programs)
    counters: int  # int32 counters the launch takes (0: none; the table stands in)
    consts: dict  # the launch's keywords: constexprs and options
    pdl: dict  # the merge launch's PDL keywords
    merge: dict  # the merge launch's shape (`merge_shape`; {} unless mode is "launch")
    last: dict  # what LAST reports besides the compiled kernel


class _Part(NamedTuple):
    """One of the two launches of a decode call over rows that hold their first blocks alike
    (`_decode_shared`): its programs take `rows` rows' queries (R; > 1 for the shared blocks,
    read once for a group of rows), its splits start at logical block `first`, and its
    partials go to slots slot0 .. of the `slots` both launches fill a (row, query head)."""
    rows: int = 1
    first: int = 0
    slot0: int = 0
    slots: int = 0


_PLANS: dict = {}  # decode plans by their key (`paged_decode_triton`; and the shared launch's merge shapes), emptied when large
_PLANS_MAX = 1024


def _plan_key(st: _Setup, q, view: PagedView, start, splits, capturing: bool):
    """What decides a decode plan, or None where it is not cached (the STAMP and BOUND hooks,
    whose launches are experiments): the format, shapes and dtypes, the lengths (in blocks,
    and whether there are sink blocks and a tail), the split count asked for, graph capture,
    the device's probe for tiny codes (run here the first time, so that the first call's key
    is the next ones'), and TUNE."""
    if STAMP is not None or BOUND is not None:
        return None
    tiny = tiny_codes_exact(q.device)
    return (st.fmt, tuple(q.shape), q.dtype, st.pools[3].dtype, start is None, st.device, st.gpu, st.total, st.n_blocks,
            st.n_sink, st.tail_len > 0, view.tail_len is None, view.n_blocks is None, splits, capturing, tiny, tuple(TUNE.items()))


def _rotation_knobs(fmt) -> tuple[bool, bool]:
    """Whether a launch over pages of `fmt` rotates its queries in the kernel, and its sealed
    pages' share back (TUNE["rot_query"], TUNE["rot_out"], checked; both False unrotated)."""
    for name in ("rot_query", "rot_out"):
        if not isinstance(TUNE[name], bool):
            raise ValueError(f"TUNE[{name!r}] must be True (in the kernel) or False (a launch of its own), got {TUNE[name]!r}")
    return fmt.rotate and TUNE["rot_query"], fmt.rotate and TUNE["rot_out"]


def _rotated_partials(consts: dict) -> bool:
    """Whether a decode launch with these constexprs (a plan's) stores its sealed pages' share
    rotated, apart (OR), for `_merge_rotated` to rotate back: rotated pages, with
    TUNE["rot_out"] off."""
    return consts["ROTATE"] and not consts["ROT_O"]


def _decode_args(st: _Setup, view: PagedView, start, scale, plan: _Plan, part: _Part | None = None, bufs=None):
    """The decode launch's buffers and arguments under `plan`: (o, o_r, lse, out, lout, args).
    A part of a call (`_decode_shared`) writes its partials into bufs = (o, o_r, lse), whose
    slots both parts share."""
    q, fmt = st.q, st.fmt
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    c = plan.consts
    if c["WP"] and 2 in (fmt.k_bits, fmt.v_bits):  # the side loop reads int2 codes as int16 words (triton_tiles' _int2_*)
        for side, bits, codes, words in (("K", fmt.k_bits, st.pools[2], c["K16"] == 1),
                                         ("V", fmt.v_bits, st.pools[5], c["SVT"] and fmt.group_size // c["PV"] % 2 == 0)):
            if bits == 2 and words and codes.data_ptr() % 2:
                raise ValueError(f"paged_decode_triton: the int2 {side} codes are read as 16-bit words and must start at an even "
                                 f"address; this pool starts at an odd one (a view of a larger buffer?)")
    if part is not None:
        o, o_r, lse = bufs
        first, slot0, slots = part.first, part.slot0, part.slots
    else:
        o = torch.empty(B, Hq, plan.splits, D, dtype=q.dtype if plan.merged else torch.float32, device=q.device)
        o_r = torch.empty_like(o) if _rotated_partials(plan.consts) else o
        lse = torch.empty(B, Hq, plan.splits, dtype=torch.float32, device=q.device)
        first, slot0, slots = 0, 0, plan.splits
    out, lout, count = o, lse, st.table
    if part is None and (plan.splits > 1 or _rotated_partials(plan.consts)):  # (rotated partials: `_merge_rotated` writes them)
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
        lout = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
        if plan.counters:
            count = _counters(q.device, plan.counters)
    tail_k, tail_v = view.tail_k, view.tail_v
    args = (st.q, st.qr, st.table, start if start is not None else st.table,
            view.sink_k, view.sink_v, *st.pools, tail_k, tail_v,
            o, o_r, lse, out, lout, count,
            st.q.stride(0), st.q.stride(1), st.table.stride(0), tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            st.n_blocks if view.n_blocks is None else view.n_blocks, st.n_sink, st.tail_len if view.tail_len is None else view.tail_len,
            plan.bps, scale, plan.splits, int(plan.apart), first, slot0, slots)
    return o, o_r, lse, out, lout, args


def _decode_plan(st: _Setup, view: PagedView, start, scale, splits: int | None, capturing: bool,
                 part: _Part | None = None) -> tuple[_Plan, bool]:
    """The launch plan of a decode call (split count, loop shape, merge, constexprs), and
    whether it may be cached (not while the tiny-code probe is still to run). Compiles the
    kernel where the split count depends on how many programs fit. A part of a call
    (`_decode_shared`: its rows a program and first block) leaves the merge to its caller."""
    fmt, q, sm, gpu, device = st.fmt, st.q, st.sm, st.gpu, st.device
    R, first = (part.rows, part.first) if part is not None else (1, 0)
    total = st.total - first  # the logical blocks this launch's splits share
    B, Hq, D = q.shape[0] // R, q.shape[1], q.shape[-1]
    H, G = fmt.num_kv_heads, st.consts["G"]
    KS = st.pools[3]
    half = st.consts["DOT"] != tl.float32
    sixteen = fmt.k_bits == 16 and fmt.v_bits == 16
    ppsm = TUNE["programs16"] if sixteen else TUNE["programs_per_sm"]
    guess = splits or num_splits(B, H, total, sm, ppsm)
    # programs of one or two pages (short contexts) have nothing for a third stage to prefetch
    short = not sixteen and math.ceil(total / guess) <= 2
    side = _side(fmt, short)
    opts = dict(num_warps=side or TUNE["num_warps"], **TRITON_OPTIONS)
    if R > 1 and side:  # the shared blocks' launch: a group's R x G queries over more warps (TUNE["shared_warps"])
        opts["num_warps"] = side * TUNE["shared_warps"]
    k16 = _side_k16(half, KS.dtype in (torch.float16, torch.bfloat16)) if side else st.consts["K16"]
    stages = TUNE["side_stages"] if side else TUNE["stages16"] if sixteen else TUNE["short_stages"] if short else TUNE["num_stages"]
    if stages is not None:
        opts["num_stages"] = stages
    if side:
        ppsm = TUNE["side_programs"]
        guess = splits or num_splits(B, H, total, sm, ppsm)
    if TUNE["maxnreg"] and not sixteen and gpu:
        opts["maxnreg"] = TUNE["maxnreg"]  # programs_per_sm programs must fit the register file
    pages_per_step = side or _pages_per_step(fmt)
    # the 2-D loop in tiles of a page: the one TUNE["loop_tile"] asks for, or (auto, on a GPU,
    # `fit_stages`) the largest that fits where whole pages do not
    tiles = loop_tiles(fmt.block_size)  # (checks TUNE["loop_tile"] whichever loop the pages take)
    if side:
        tiles = []
    td = tiles[0] if tiles and TUNE["loop_tile"] else 0
    if td:
        pages_per_step = 1
    rows = max(TUNE["side_rows"] if side else 16, triton.next_power_of_2(R * G))  # (triton pads a dot's M < 16 itself)
    # values transposed, their scales folded into the fp16 probabilities (16-bit inputs only)
    svt = bool(side and TUNE["side_vt"] and half)
    # (the probe runs only where a side loop's dots would take tiny codes)
    tiny = tiny_codes_exact(q.device) if side and (k16 == 1 or svt) and TUNE["side_tiny"] else False
    consts = dict(st.consts, K16=k16, G_PAD=rows, PAGES=pages_per_step, WP=side, SVT=svt, ZDOT=svt and fmt.v_bits <= TUNE["side_zdot"],
                  SKIP=bool(side) and TUNE["side_skip"] and not short, DENSE=min(TUNE["side_dense"], fmt.block_size) if side else td, TD=td,
                  MASK=not (side == 1 and start is None and max(fmt.k_bits, fmt.v_bits) <= TUNE["side_unmasked"]),
                  TINY_CODES=bool(tiny), GM=triton.next_power_of_2(G), SB=max(1, 4096 // (triton.next_power_of_2(G) * D)),
                  TAIL_DEV=view.tail_len is not None, BLOCKS_DEV=view.n_blocks is not None, R=R, **opts)
    # programmatic dependent launch (sm_90+): each launch may start while the one before it
    # ends, and waits for it on the GPU (gdc_wait) before reading what it wrote
    pdl = dict(PDL=True, launch_pdl=True) if gpu and TUNE["pdl"] and torch.cuda.get_device_capability(device) >= (9, 0) else {}
    consts.update(pdl)
    last = dict(side=side, tile=td, k16=k16, svt=svt, zdot=consts["ZDOT"], skip=consts["SKIP"], short=short, mask=consts["MASK"], tiny=consts["TINY_CODES"])

    # the partials are unrotated: they merge as such (else `_merge_rotated` merges them)
    plain = not _rotated_partials(consts)

    def merge_mode(splits: int) -> str:
        """How the splits merge: "kernel" (the last split), "grid" (merge programs in the same
        grid) or "launch" (a second kernel); "" where there is nothing to merge or
        `_merge_rotated` merges (one split, rotated partials) or the caller merges (a part)."""
        return _merge_mode(TUNE["merge"], capturing) if splits > 1 and plain and part is None else ""

    def plan_for(splits: int, warmup: bool = False) -> _Plan:
        """The plan at (about) `splits` splits: whole loop steps a split, so the count may fall."""
        n_sink, sealed = st.n_sink, st.n_blocks - st.n_sink
        # side_apart: the sinks and the tail get a split of their own, the sealed pages the rest
        apart = bool(side and TUNE["side_apart"] and splits > 1 and sealed > 0 and (n_sink or st.tail_len) and part is None)
        if apart:
            bps = side * max(1, math.ceil(sealed / (splits - 1) / side))
            splits = math.ceil(sealed / bps) + 1
        else:
            bps = pages_per_step * max(1, math.ceil(total / splits / pages_per_step))  # whole steps per split
            splits = max(1, math.ceil(total / bps))
        mode = merge_mode(splits)
        extra = {}
        if mode == "grid":
            extra = merge_shape(B, Hq, D, sm, splits)
            extra["GRID"] = G * (D // extra["BD"] if extra["BD"] else 1)  # merge programs a (row, KV head)
            # the merge programs wait for the splits: they must leave the splits room on the
            # GPU whatever order it starts programs in (half its slots; the interpreter runs
            # them after their splits)
            if gpu and not warmup and B * H * extra["GRID"] > fit_for(splits) * sm // 2:
                mode, extra = "launch", {}
        tree = _merge_tree(splits) if mode == "kernel" else 0
        counters = 0
        if splits > 1 and plain and mode in ("kernel", "grid"):
            # grid: the splits stored, the merge programs done; tree: a counter per group, and one for the groups
            counters = B * H * (2 if mode == "grid" else (math.ceil(splits / tree) + 1 if tree else 1))
        return _Plan(splits, bps, apart, splits == 1 and plain and part is None, mode, (B * H, splits + extra.get("GRID", 0)), counters,
                     dict(consts, MERGE=mode == "kernel", TREE=tree, **extra), pdl,
                     merge_shape(B, Hq, D, sm, splits) if mode == "launch" else {}, dict(last, tree=tree, apart=apart, merge=mode))

    def fit_for(splits: int) -> int:
        """Programs of the compiled kernel (its merge mode at `splits`) one SM holds (GPU)."""
        key = (device, fmt, q.dtype, KS.dtype, start is not None, view.tail_len is None, view.n_blocks is None, merge_mode(splits), stages, side,
               consts["TD"], R, tuple(TUNE.items()))
        fit = _FIT.get(key)
        if fit is None:  # (the in-kernel merge costs registers: 165 against 128 on triton 3.6)
            plan = plan_for(splits, warmup=True)
            args = _decode_args(st, view, start, scale, plan)[-1]
            fit = _FIT[key] = _fit(_decode_kernel.warmup(*args, grid=plan.grid, **plan.consts), opts["num_warps"], device)
        return fit

    def fit_stages(plan: _Plan) -> bool:
        """Fewer stages where the plan's kernel does not fit the device's shared memory, or
        for the 2-D loop (TUNE["loop_tile"] auto) tiles of its pages where whole pages do not
        fit in one stage; whether that changed them (plans made since take them)."""
        nonlocal stages, pages_per_step
        try:
            fits = stages_that_fit(_decode_kernel, plan.grid, lambda: _decode_args(st, view, start, scale, plan)[-1], plan.consts, device,
                                   "paged_decode_triton")
        except SharedMemoryError:
            if not tiles or TUNE["loop_tile"] or plan.consts["TD"]:
                raise
            tile, fits = _loop_fit(plan.grid, _decode_args(st, view, start, scale, plan)[-1], plan.consts, tiles, device)
            consts.update(TD=tile, DENSE=tile, PAGES=1)
            pages_per_step = 1
            last["tile"] = tile
        else:
            if fits == plan.consts.get("num_stages"):
                return False
        stages = opts["num_stages"] = consts["num_stages"] = fits
        return True

    if gpu:
        fit_stages(plan_for(guess, warmup=True))
    if splits is None:
        splits = guess
        if gpu:  # as many programs per SM as fit, given the compiled kernel's registers
            fit = fit_for(splits)
            if fit < ppsm:
                splits = num_splits(B, H, total, sm, fit)
    plan = plan_for(splits)
    if gpu and fit_stages(plan):  # (another merge mode than the guess's)
        plan = plan_for(splits)
    # not cached while the probe is still to run (under graph capture), nor the merge grid,
    # whose shape `merge_shape` decides at each call
    return plan, tiny is not None and plan.mode != "grid"


LOOP_TILE_MAX = 64  # tokens a tile of the 2-D loop's auto choice at most (`loop_tiles`)


def loop_tiles(block_size: int) -> list[int]:
    """Tiles of a page the 2-D decode loop may read, largest first, none of them the whole page:
    TUNE["loop_tile"]'s where set (none where that is a page or more), else the page's halves
    of at most LOOP_TILE_MAX tokens down to 16. At most 64: bf16 queries over 16-bit pages of
    256 tokens, the bench's call on the H200 (scripts/bench_ab.py, notes v46), 128k 129.4 /
    160.9 / 129.9 us and batch 8 at 32k 247.6 / 310.4 / 248.9 with whole pages / tiles of 128 /
    tiles of 64."""
    asked = TUNE["loop_tile"]
    return [t for t in page_tiles(block_size, "loop_tile") if t < block_size and (asked or t <= LOOP_TILE_MAX)]


_LOOP_TILES: dict = {}  # the tile and stages of a 2-D loop whose whole pages do not fit, by its constexprs, tiles and dtypes


def _loop_fit(grid, args, consts: dict, tiles: list[int], device: int) -> tuple[int, int]:
    """(tile, stages) of a decode launch through the 2-D loop whose whole pages do not fit the
    device's shared memory even in one stage: `fit_tile`'s choice among `tiles` (`loop_tiles`),
    cached. fp32 queries over 16-bit pages of 256 tokens,
    compiled for sm_89 (scripts/sass_decode.py --dtype fp32 --tile): whole pages 155,712 bytes
    in one stage; tiles of 128 147,712 (the sinks' and tail's loop keeps two stages); tiles of
    64 78,080 in one stage (364 words of local memory), of 32 43,264 in two (92 words). Not
    timed on a card with that limit."""
    key = (fit_key(_decode_kernel, device, consts), tuple(tiles), tuple(getattr(a, "dtype", None) for a in args))
    fit = _LOOP_TILES.get(key)
    if fit is None:
        limit = shared_limit(device)

        def compiled(tile: int, stages: int):
            return compiled_fit(_decode_kernel, grid, args, dict(consts, TD=tile, DENSE=tile, PAGES=1, num_stages=stages), limit)

        fit = _LOOP_TILES[key] = fit_tile(compiled, tiles, consts.get("num_stages") or 3, limit, "paged_decode_triton",
                                          "smaller blocks (KVConfig's block_size), 16-bit inputs, or backend='reference'")
    return fit


def merge_shape(B: int, Hq: int, D: int, sm: int, splits: int) -> dict:
    """The merge's compile-time shape (`_merge_head`), the launch's and the grid's: splits
    padded to a power of two, read TUNE["merge_chunk"] at a time, in blocks of BD columns
    (`_merge_cols`; 0: all). (After `_merge_mode`, which checks the knobs.)"""
    return dict(S_PAD=max(2, triton.next_power_of_2(splits)), SC=TUNE["merge_chunk"], BD=_merge_cols(D, B * Hq, sm))


def shared_rows(batch: int, G: int, shared_blocks: int, block_size: int, run: int = 0) -> int:
    """Rows a program of the shared blocks' launch takes (R; 1: no such launch, the call reads
    whole rows): where the rows of each run of `run` consecutive rows (0: all `batch` rows)
    hold their first `shared_blocks` blocks alike (a prompt's under its beams) and they are at
    least TUNE["shared_from"] tokens, the largest divisor of the run from 2 whose queries (R x
    G a KV head) stay within TUNE["shared_rows"]."""
    for name in ("shared_from", "shared_rows", "shared_warps"):
        v = TUNE[name]
        least = int(name == "shared_warps")
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"TUNE[{name!r}] must be an int >= {least}, got {v!r}")
    if not TUNE["shared_from"] or shared_blocks * block_size < TUNE["shared_from"]:
        return 1
    run = run or batch
    if batch % run:
        raise ValueError(f"shared_rows: runs of {run} rows do not divide a batch of {batch}")
    for r in range(min(run, TUNE["shared_rows"] // max(1, G)), 1, -1):
        if run % r == 0:
            return r
    return 1


def _decode_shared(st: _Setup, view: PagedView, start, scale, R: int, capturing: bool, key):
    """Decode over rows whose first view.shared blocks are the same ids within each run of
    view.shared_run rows (beams over their prompt; R divides the run): a launch over those
    blocks whose programs take the queries of R rows at once, so that a group of rows reads
    them once (the GPU's L2 did not spare the repeats: four rows sharing 128k tokens took 146 us
    a layer against 48 for one, notes v34); a launch over each row's other blocks and tail; one
    merge of both launches' partials. -> (out [B, H_q, 1, D], lse [B, H_q, 1])."""
    q, fmt = st.q, st.fmt
    B, Hq, D = q.shape
    c = min(view.shared, st.n_blocks)
    st_s = st._replace(n_blocks=c, n_sink=min(st.n_sink, c), tail_len=0, total=c)
    view_s = dataclasses.replace(view, tail_k=view.tail_k[:, :, :0], tail_v=view.tail_v[:, :, :0], tail_len=None, n_blocks=None)
    plans = [_cached_plan(None if key is None else (key, name, R, c), s, v, start, scale, None, capturing, part)
             for name, s, v, part in (("shared", st_s, view_s, _Part(R, 0)), ("rest", st, view, _Part(1, c)))]
    S = plans[0].splits + plans[1].splits
    o = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
    o_r = torch.empty_like(o) if _rotated_partials(plans[0].consts) else o
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    kernels = []
    for s, v, plan, part in ((st_s, view_s, plans[0], _Part(R, 0, 0, S)), (st, view, plans[1], _Part(1, c, plans[0].splits, S))):
        args = _decode_args(s, v, start, scale, plan, part, (o, o_r, lse))[-1]
        kernels.append(_decode_kernel[plan.grid](*args, **plan.consts))
    # (LAST: the rest's launch, as a whole-row call's; the shared blocks' launch beside it)
    LAST.update(kernel=kernels[1], grid=plans[1].grid, **plans[1].last, shared=(R, c, plans[0].splits, plans[1].splits),
                shared_kernel=kernels[0], shared_grid=plans[0].grid)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    lout = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
    if _rotated_partials(plans[0].consts):
        _merge_rotated(o, o_r, lse, out, lout, st.sm)
        return out, lout
    mk = None if key is None else (key, "merge", R, c)
    merge = _PLANS.get(mk) if mk is not None else None
    if merge is None:
        _merge_mode(TUNE["merge"], capturing)  # (checks the merge's knobs)
        merge = merge_shape(B, Hq, D, st.sm, S)
        if mk is not None:
            _PLANS[mk] = merge
    _merge_launch(o, lse, out, lout, S, merge, {})
    return out, lout


def _cached_plan(key, st: _Setup, view: PagedView, start, scale, splits, capturing: bool, part: _Part | None = None) -> _Plan:
    """`_decode_plan`'s plan, from `_PLANS` by `key` where it was made before (None: not
    cached), else made (with the setup's constexprs where it has none) and kept."""
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        if st.consts is None:
            st = st._replace(consts=_kernel_consts(st.fmt, st.q, st.pools[3], start, st.gpu, "paged_decode_triton"))
        plan, cacheable = _decode_plan(st, view, start, scale, splits, capturing, part)
        if key is not None and cacheable:
            if len(_PLANS) >= _PLANS_MAX:  # (a plan per block count: long generations would pile them up)
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _merge_launch(o, lse, out, lout, S: int, merge: dict, pdl: dict) -> None:
    """The merge launch (`_merge_kernel`): the S partials a (row, query head) of o [B, H_q, S,
    D] and lse [B, H_q, S] into out [B, H_q, 1, D] and lout [B, H_q, 1], in `merge`'s shape."""
    B, Hq, _, D = o.shape
    _merge_kernel[(B * Hq, D // merge["BD"] if merge["BD"] else 1)](
        o, lse, out, lout, S, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HQ=Hq, D=D, **merge, num_warps=4, **pdl, **TRITON_OPTIONS)


def paged_decode_triton(q, view: PagedView, start, scale, return_lse: bool = True, splits: int | None = None):
    """q [B, H_q, 1, D] -> (out [B, H_q, 1, D], lse [B, H_q, 1] fp32 or None). Where the view's
    rows share their first blocks (view.shared) the call takes two launches (`_decode_shared`),
    unless `splits` asks for a split count (experiments) or a diagnostic hook is set."""
    st = _setup(q[:, :, 0], view, start, "paged_decode_triton", consts=False, rotate_q=not _rotation_knobs(view.pages.fmt)[0])
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    key = _plan_key(st, q, view, start, splits, capturing)
    R = 1
    if view.shared and q.shape[0] > 1 and splits is None and STAMP is None and BOUND is None:  # (one row: nothing to share)
        R = shared_rows(q.shape[0], q.shape[1] // st.fmt.num_kv_heads, min(view.shared, st.n_blocks), st.fmt.block_size, view.shared_run)
    if R > 1:
        out, lout = _decode_shared(st, view, start, scale, R, capturing, key)
        return out, (lout if return_lse else None)
    plan = _cached_plan(key, st, view, start, scale, splits, capturing)
    o, o_r, lse, out, lout, args = _decode_args(st, view, start, scale, plan)
    hooks = {} if STAMP is None else dict(STAMPS=STAMP)  # diagnostics and experiments, compiled out when None
    if BOUND is not None:  # (experiments: the splits' boundaries from the caller)
        if plan.apart or tuple(BOUND.shape) != (plan.grid[0], plan.splits + 1) or BOUND.dtype != torch.int32:
            raise ValueError(f"BOUND must be int32 [{plan.grid[0]}, {plan.splits + 1}] (rows x KV heads, splits + 1) and side_apart off, "
                             f"got {BOUND.dtype} {tuple(BOUND.shape)}")
        hooks["BOUNDS"] = BOUND
    LAST.update(kernel=_decode_kernel[plan.grid](*args, **plan.consts, **hooks), grid=plan.grid, shared=None, **plan.last)
    if plan.merged:
        return o, (lse if return_lse else None)
    if _rotated_partials(plan.consts):
        _merge_rotated(o, o_r, lse, out, lout, st.sm)
        return out, (lout if return_lse else None)
    if plan.mode == "launch":
        _merge_launch(o, lse, out, lout, plan.splits, plan.merge, plan.pdl)
    return out, (lout if return_lse else None)
