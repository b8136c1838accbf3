"""Triton building blocks of the decode and prefill kernels over quantized pages: K scores of a
page (dequantized in registers), V sub-tiles of a page, unquantized blocks (sinks, tail), the
online-softmax step, the PV accumulators, the query loads and the final stores, in the 2-D
form (a page across the program's warps) and side by side (a page a warp). Both kernels
(decode_kernel.py, prefill.py) inline them; none launches on its own. Codes become floats in
codes.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..rotation import fwht, hadamard_planes
from .codes import BIASED, EXACT, TINY, codes16, codes_f16n, f16_codes, f32_codes, int2_f16, int2_rows_f16, int2_words_f16, pick_subtile
from .codes import v_words2

NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def step_id(trow, j, j1):
    """The block id of logical block j of a row's table trow, for a split whose sealed blocks
    end at j1: at or past j1 it repeats a valid one (the table has at least one column), whose
    scores the caller masks or never reads. No load mask: the interpreter takes no scalar bool."""
    return tl.load(trow + tl.maximum(tl.minimum(j, j1 - 1), 0))


@triton.jit
def _token_groups(X, row, ok, NG: tl.constexpr):
    """[..., NG] per-token group values (V's scales or zeros) of pool rows `row` [...] (one or
    two dimensions), masked by ok. 16-bit values load as one word per token (NG of them in an
    int16/32/64): a 4- or 8-byte load the pipeliner prefetches, where 2-byte loads stayed in
    the loop and stalled it (Nsight Compute, H200, triton 3.6); split by shifts."""
    DT: tl.constexpr = X.dtype.element_ty
    if DT.primitive_bitwidth == 16 and NG <= 4:
        w = tl.expand_dims(_words16(X, row, ok, NG), -1)
        out = (w >> (16 * tl.arange(0, NG)).to(w.dtype)).to(tl.int16).to(DT, bitcast=True)
    else:
        out = tl.load(X + tl.expand_dims(row, -1) * NG + tl.arange(0, NG), mask=tl.expand_dims(ok, -1), other=0.0)
    return out


@triton.jit
def _words16(X, idx, mask, N: tl.constexpr):
    """Words idx of N consecutive 16-bit values of X (N = 1, 2 or 4: int16, int32, int64;
    zero where masked): 4- or 8-byte loads, which the pipeliner prefetches with cp.async."""
    WT: tl.constexpr = tl.int16 if N == 1 else (tl.int32 if N == 2 else tl.int64)
    return tl.load(X.to(tl.pointer_type(WT)) + idx, mask=mask, other=0)


@triton.jit
def _half16(w, r: tl.constexpr, DT: tl.constexpr):
    """The r-th 16-bit value (from the low end) of integer words w, as the 16-bit float DT."""
    return (w >> (16 * r)).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online softmax, base 2, over one block of scores s [..., rows, P] (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, -1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - tl.expand_dims(m_new, -1))
    return m_new, l_i * alpha + tl.sum(p, -1), p, alpha


@triton.jit
def acc_values(a0, a1, a2, a3, alpha, p, v0, v1, v2, v3, V_SUB: tl.constexpr, PREC: tl.constexpr):
    """Rescale the V_SUB sub-tile accumulators [..., rows, DV] by alpha [..., rows] and add p @ v_r
    (v None: rescale only)."""
    c = tl.expand_dims(alpha, -1)
    a0 = a0 * c
    if V_SUB > 1:
        a1 = a1 * c
    if V_SUB > 2:
        a2 = a2 * c
        a3 = a3 * c
    if v0 is not None:
        a0 += tl.dot(p, v0, input_precision=PREC)
        if V_SUB > 1:
            a1 += tl.dot(p, v1, input_precision=PREC)
        if V_SUB > 2:
            a2 += tl.dot(p, v2, input_precision=PREC)
            a3 += tl.dot(p, v3, input_precision=PREC)
    return a0, a1, a2, a3


@triton.jit
def _load_q(Q, base, offs_g, gmask, r: tl.constexpr, PER: tl.constexpr, DS: tl.constexpr, stride_qh, scale):
    offs = r + PER * tl.arange(0, DS)
    return tl.load(Q + base + offs_g[:, None] * stride_qh + offs[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * scale


@triton.jit
def _store(O, off, a0, a1, a2, a3, inv, om, V_SUB: tl.constexpr):
    tl.store(O + off, (a0 * inv).to(O.dtype.element_ty), mask=om)
    if V_SUB > 1:
        tl.store(O + off + 1, (a1 * inv).to(O.dtype.element_ty), mask=om)
    if V_SUB > 2:
        tl.store(O + off + 2, (a2 * inv).to(O.dtype.element_ty), mask=om)
        tl.store(O + off + 3, (a3 * inv).to(O.dtype.element_ty), mask=om)


@triton.jit
def _k_scales(KS, KZ, ksw, kzw, chan, mask, r: tl.constexpr, W16: tl.constexpr):
    """K's scales and zeros of sub-tile r: split from the words ksw/kzw loaded once a page
    (W16: 16-bit values), else loaded at pool offsets chan + r (chan: channel K_SUB*i of the
    page's head, any shape; masked by mask)."""
    DT: tl.constexpr = KS.dtype.element_ty
    if W16:
        sr = _half16(ksw, r, DT)
        zr = _half16(kzw, r, DT)
    else:
        sr = tl.load(KS + chan + r, mask=mask, other=0.0)
        zr = tl.load(KZ + chan + r, mask=mask, other=0.0)
    return sr, zr


@triton.jit
def page_scores(KD, KC, KS, KZ, bh, t0, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                 D: tl.constexpr, P: tl.constexpr, DK: tl.constexpr, K_SUB: tl.constexpr, K_BITS: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr,
                 KG: tl.constexpr = 0):
    """Base-2 scores [G_PAD, T] of a page at its tokens offs_p [T], t0 .. t0 + T - 1 (pool row
    bh = block * H + head, pages of P tokens, K's scale rows a span of KG tokens; 0: the page).
    A tile within one span takes that span's scale row; a tile over several (KG < T) dequantizes
    K a token's span at a time (K16 3 in KDT, else in fp32 rounded into DOT). Quantized K:
    K16 == 3 dequantizes sub-tile r in KDT (fp16, or bf16 for codes < 128 with bf16 scales:
    codes * s + z, one FMA per two values) and dots it with the fixed KDT query qp_r; 0 and 2
    fold the per-channel scales into the query instead, (q*s)_r . codes_r (0: fp32 codes
    through DOT; 2: fp16 codes), then add q . z. K16 == 4
    dequantizes in fp32 and rounds once into DOT (the prefill kernel's choice: its query block
    shares each page's dequantization, and the 16-bit dequantization rounds twice where the
    multiply and add are not fused, as under the interpreter)."""
    s = tl.zeros((qp.shape[0], offs_p.shape[0]), tl.float32)
    if K_BITS == 16:  # (one return at the end: an early return in a branch miscompiled on the GPU)
        k = tl.load(KD + bh * P * D + offs_p[:, None] * D + offs_d[None, :])
        s = tl.dot(qp.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)
    else:
        xk = tl.load(KC + bh * P * DK + offs_p[:, None] * DK + offs_k[None, :])
        km = offs_k >= 0
        # 16-bit scales and zeros load as words of K_SUB values (channels K_SUB*i .. K_SUB*i + K_SUB - 1):
        # 4- or 8-byte loads the pipeliner prefetches (2-byte loads it left in the loop, where
        # their latency was the kernel's largest stall), split into sub-tiles by shifts
        DT: tl.constexpr = KS.dtype.element_ty
        W16: tl.constexpr = DT.primitive_bitwidth == 16
        SPAN: tl.constexpr = P if KG == 0 else KG
        T: tl.constexpr = offs_p.shape[0]
        if SPAN >= T:  # one scale row: the tile's span's
            srow = bh * (P // SPAN) + t0 // SPAN
            ks_idx = srow * DK + offs_k
            ks_chan = srow * D + K_SUB * offs_k
            kmask = km
        else:  # a scale row a token: [T, DK]
            srow = bh * (P // SPAN) + offs_p // SPAN
            ks_idx = srow[:, None] * DK + offs_k[None, :]
            ks_chan = srow[:, None] * D + K_SUB * offs_k[None, :]
            kmask = ks_idx >= 0
        ksw = xk  # (unused unless W16)
        kzw = xk
        if W16:
            ksw = _words16(KS, ks_idx, kmask, K_SUB)
            kzw = _words16(KZ, ks_idx, kmask, K_SUB)
        zq = tl.zeros((qp.shape[0],), tl.float32)  # q . z (K16 < 3)
        for r in tl.static_range(K_SUB):
            qr = pick_subtile(qp0, qp1, qp2, qp3, r)
            sr, zr = _k_scales(KS, KZ, ksw, kzw, ks_chan, kmask, r, W16)
            if SPAN < T:  # K dequantized a token's span at a time
                if K16 == 3:
                    s += tl.dot(qr, tl.trans(codes16(xk, r, K_BITS, ASM, KDT) * sr.to(KDT) + zr.to(KDT)))
                else:
                    kf = f32_codes(xk, r, K_BITS) * sr.to(tl.float32) + zr.to(tl.float32)
                    s += tl.dot(qr.to(DOT), tl.trans(kf.to(DOT)), input_precision=PREC)
            elif K16 == 3:  # K dequantized in KDT against the fixed KDT query
                s += tl.dot(qr, tl.trans(codes16(xk, r, K_BITS, ASM, KDT) * sr.to(KDT)[None, :] + zr.to(KDT)[None, :]))
            elif K16 == 4:  # K dequantized in fp32, rounded once into DOT, against the fixed DOT query
                kf = f32_codes(xk, r, K_BITS) * sr.to(tl.float32)[None, :] + zr.to(tl.float32)[None, :]
                s += tl.dot(qr, tl.trans(kf.to(DOT)), input_precision=PREC)
            else:  # scales folded into the fp32 query
                qs = qr * sr.to(tl.float32)[None, :]
                zq += tl.sum(qr * zr.to(tl.float32)[None, :], 1)
                if K16 == 2:
                    s += tl.dot(qs.to(tl.float16), tl.trans(f16_codes(xk, r, K_BITS, ASM)))
                else:
                    s += tl.dot(qs.to(DOT), tl.trans(f32_codes(xk, r, K_BITS).to(DOT)), input_precision=PREC)
        if K16 < 3 and SPAN >= T:
            s += zq[:, None]
    return s


@triton.jit
def dense_scores(kbase, sp, valid, q, offs_p, offs_d, DOT: tl.constexpr, PREC: tl.constexpr):
    """Base-2 scores [rows, P] of q against one unquantized block (a sink page or the tail;
    token stride sp), invalid tokens read as zeros (masked by the caller)."""
    k = tl.load(kbase + offs_p[:, None] * sp + offs_d[None, :], mask=valid[:, None], other=0.0)
    return tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)


@triton.jit
def dense_values(vbase, sp, valid, offs_p, offs_v, V_SUB: tl.constexpr, DOT: tl.constexpr):
    """V of one unquantized block as the V_SUB sub-tiles the accumulators take (channels r,
    r + V_SUB, ...)."""
    vptr = vbase + offs_p[:, None] * sp + V_SUB * offs_v[None, :]
    vm = valid[:, None]
    v0 = tl.load(vptr, mask=vm, other=0.0).to(DOT)
    v1 = v0
    v2 = v0
    v3 = v0
    if V_SUB > 1:
        v1 = tl.load(vptr + 1, mask=vm, other=0.0).to(DOT)
    if V_SUB > 2:
        v2 = tl.load(vptr + 2, mask=vm, other=0.0).to(DOT)
        v3 = tl.load(vptr + 3, mask=vm, other=0.0).to(DOT)
    return v0, v1, v2, v3


@triton.jit
def _values_from_codes(xv, vs, vz, p, V_BITS: tl.constexpr, V16: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                       V_SUB: tl.constexpr):
    """V sub-tiles r = 0..PV-1 of code words xv, dequantized against per-column scales vs and
    zeros vz (their dtype VT: 16-bit with V16, one FMA per value; else fp32, rounded once into
    DOT), and p in the dtype the dot takes: (pv, v0..v3). Any shape (2-D or 3-D tiles)."""
    VT: tl.constexpr = vs.dtype
    if V16 and ASM and VT == tl.float16 and V_BITS == 4 and xv.dtype == tl.int16:  # a nibble block a sub-tile
        for r in tl.static_range(4):
            vr = codes_f16n(xv, r, V_BITS, ASM, EXACT) * vs + vz
            if r == 0:
                v0 = vr
            elif r == 1:
                v1 = vr
            elif r == 2:
                v2 = vr
            else:
                v3 = vr
        pv = p.to(VT)
    elif V16:  # 16-bit codes, exact
        v0 = codes16(xv, 0, V_BITS, ASM, VT) * vs + vz
        v1 = v0
        v2 = v0
        v3 = v0
        if V_SUB > 1:
            v1 = codes16(xv, 1, V_BITS, ASM, VT) * vs + vz
        if V_SUB > 2:
            v2 = codes16(xv, 2, V_BITS, ASM, VT) * vs + vz
            v3 = codes16(xv, 3, V_BITS, ASM, VT) * vs + vz
        pv = p.to(VT)
    else:
        v0 = (f32_codes(xv, 0, V_BITS) * vs + vz).to(DOT)
        v1 = v0
        v2 = v0
        v3 = v0
        if V_SUB > 1:
            v1 = (f32_codes(xv, 1, V_BITS) * vs + vz).to(DOT)
        if V_SUB > 2:
            v2 = (f32_codes(xv, 2, V_BITS) * vs + vz).to(DOT)
            v3 = (f32_codes(xv, 3, V_BITS) * vs + vz).to(DOT)
        pv = p.to(DOT)
    return pv, v0, v1, v2, v3


@triton.jit
def page_values(VD, VC, VS, VZ, row, ok, p, offs_v, D: tl.constexpr, DV: tl.constexpr, V_SUB: tl.constexpr, NG: tl.constexpr,
                 GS: tl.constexpr, V_BITS: tl.constexpr, V16: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr):
    """V sub-tiles of sealed pages' tokens at pool rows `row` [T] (masked by ok), dequantized
    in registers, and the probabilities p [rows, T] in the dtype their dot takes: (pv, v0..v3)."""
    vm = ok[:, None]
    if V_BITS == 16:
        v0 = tl.load(VD + row[:, None] * D + offs_v[None, :], mask=vm, other=0.0).to(DOT)
        v1 = v0
        v2 = v0
        v3 = v0
        pv = p.to(DOT)
    else:
        xv = tl.load(VC + row[:, None] * DV + offs_v[None, :], mask=vm, other=0)
        # column i of every sub-tile is in group i // (GS // V_SUB)
        # V16 == 2: bf16 when the scales are bf16 and the codes < 128 (exact), saving their conversion
        VT: tl.constexpr = (tl.bfloat16 if V16 == 2 and V_BITS <= 4 and VS.dtype.element_ty == tl.bfloat16
                            else tl.float16 if V16 else tl.float32)
        T: tl.constexpr = row.shape[0]
        vs = tl.reshape(tl.broadcast_to(_token_groups(VS, row, ok, NG).to(VT)[:, :, None], (T, NG, GS // V_SUB)), (T, DV))
        vz = tl.reshape(tl.broadcast_to(_token_groups(VZ, row, ok, NG).to(VT)[:, :, None], (T, NG, GS // V_SUB)), (T, DV))
        pv, v0, v1, v2, v3 = _values_from_codes(xv, vs, vz, p, V_BITS, V16, DOT, ASM, V_SUB)
    return pv, v0, v1, v2, v3


@triton.jit
def _opaque(x, PTX: tl.constexpr):
    """x (fp32) itself; compiled for a GPU (PTX), through a move the compiler must take as having
    side effects. Triton sizes a tensor-core operand's registers (kWidth) by walking back through
    its producers, and halves the size where the walk meets a join, as the butterflies' are: the
    side loop's query operand then went through shared memory every page (sm_90: 1,140
    instructions a page and 9 barriers, against 1,074 and 2). The walk stops at such a move."""
    if PTX:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def load_queries(Q, base, rows, rmask, stride, scale, D: tl.constexpr, K_SUB: tl.constexpr, DK: tl.constexpr,
                 ROTATE: tl.constexpr, K16: tl.constexpr, KDT: tl.constexpr, DOT: tl.constexpr,
                 INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False):
    """The query rows (offsets `rows` * stride from base, masked by rmask) as the kernels use
    them, scaled: q unrotated [rows, D] (sinks, tail), qp [rows, D] and its K_SUB sub-tiles
    qp0..qp3 [rows, DK] for the sealed pages (with ROTATE rotated here in fp32,
    `hadamard_planes`, INV_SQRT_D the entries' magnitude; PTX: compiled for a GPU, see
    `_opaque`), the sub-tiles in the 16-bit type K is dequantized into when K16 >= 3."""
    q = _load_q(Q, base, rows, rmask, 0, 1, D, stride, scale)
    qp = q
    qp0 = _load_q(Q, base, rows, rmask, 0, K_SUB, DK, stride, scale)
    qp1 = qp0
    qp2 = qp0
    qp3 = qp0
    if K_SUB > 1:
        qp1 = _load_q(Q, base, rows, rmask, 1, K_SUB, DK, stride, scale)
    if K_SUB > 2:
        qp2 = _load_q(Q, base, rows, rmask, 2, K_SUB, DK, stride, scale)
        qp3 = _load_q(Q, base, rows, rmask, 3, K_SUB, DK, stride, scale)
    if ROTATE:
        qp = fwht(qp, D) * INV_SQRT_D
        qp0, qp1, qp2, qp3 = hadamard_planes(qp0, qp1, qp2, qp3, K_SUB, DK, INV_SQRT_D)
        qp = _opaque(qp, PTX)  # (the 2-D loop's; the side loop takes the sub-tiles)
        qp0 = _opaque(qp0, PTX)
        qp1 = _opaque(qp1, PTX)
        qp2 = _opaque(qp2, PTX)
        qp3 = _opaque(qp3, PTX)
    if K16 >= 3:  # fixed 16-bit queries for K dequantized in registers
        QT: tl.constexpr = KDT if K16 == 3 else DOT
        qp0 = qp0.to(QT)
        qp1 = qp1.to(QT)
        qp2 = qp2.to(QT)
        qp3 = qp3.to(QT)
    return q, qp, qp0, qp1, qp2, qp3


@triton.jit
def zero_state(M: tl.constexpr, DV: tl.constexpr):
    """Online-softmax state of M rows: running max, sum, and the V_SUB sub-tile accumulators,
    unrotated (a0..a3) and rotated (r0..r3: sealed pages when ROTATE)."""
    z = tl.zeros((M, DV), tl.float32)
    return tl.full((M,), NEG_BIG, tl.float32), tl.zeros((M,), tl.float32), z, z, z, z, z, z, z, z


@triton.jit
def acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, V_SUB: tl.constexpr, PREC: tl.constexpr,
                ROTATE: tl.constexpr):
    """Accumulate a sealed page's p @ v: into the rotated accumulators with ROTATE (the
    unrotated ones only rescaled), else into the unrotated ones."""
    if ROTATE:
        a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, alpha, pv, None, None, None, None, V_SUB, PREC)
        r0, r1, r2, r3 = acc_values(r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, V_SUB, PREC)
    else:
        a0, a1, a2, a3 = acc_values(a0, a1, a2, a3, alpha, pv, v0, v1, v2, v3, V_SUB, PREC)
    return a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def store_partial(O, LSE, orow, omask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D: tl.constexpr, V_SUB: tl.constexpr,
                  ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr = 1.0):
    """Store the normalized outputs (rows orow of [*, D] O; with ROTATE the rotated
    accumulators r0..r3 rotated back here and added) and the natural-log LSE (-inf and zeros
    for rows that saw no key)."""
    seen = l_i > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)[:, None]
    o_off = orow[:, None] * D + V_SUB * offs_v[None, :]
    om = omask[:, None]
    if ROTATE:
        r0, r1, r2, r3 = hadamard_planes(r0, r1, r2, r3, V_SUB, D // V_SUB, INV_SQRT_D)
        a0 += r0
        if V_SUB > 1:
            a1 += r1
        if V_SUB > 2:
            a2 += r2
            a3 += r3
    _store(O, o_off, a0, a1, a2, a3, inv, om, V_SUB)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    tl.store(LSE + orow, lse, mask=omask)


# Side by side: W sealed pages a loop step along a leading batch dimension of 3-D dots. The
# compiler puts each batch entry (a page) on its own warp, so a warp scores, softmaxes and
# accumulates its page alone: no cross-warp reductions or shared-memory exchange of the
# probabilities a page (the 2-D loop synchronizes the program's warps six times a page).


@triton.jit
def _side_rows(bh, sub, offs_p, P: tl.constexpr, PS: tl.constexpr):
    """Pool rows of the tokens offs_p of pages at pool rows bh (block * H + head) of P tokens,
    or with PS > P of their P-token tiles starting `sub` tokens into pages of PS; the three
    broadcast against each other (the callers shape them)."""
    row = bh * (PS if PS > P else P) + offs_p
    if PS > P:
        row += sub
    return row


@triton.jit
def side_scores(KC, KS, KZ, bh, sub, q30, q31, q32, q33, offs_p, offs_k,
                 D: tl.constexpr, P: tl.constexpr, DK: tl.constexpr, K_SUB: tl.constexpr, K_BITS: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr,
                 PS: tl.constexpr = 0, TINY_CODES: tl.constexpr = False, KG: tl.constexpr = 0):
    """Base-2 scores [W, G_PAD, P] of the quantized pages at pool rows bh [W] (block * H +
    head), or with PS > P of their P-token tiles starting `sub` [W] tokens into pages of PS
    (each within one span of KG tokens, whose K scale row it takes; KG 0: the page), against the query sub-tiles, transposed and broadcast
    over W (q30..q33 [W, DK, G_PAD]), computed transposed (K·Qᵀ: the page's codes are the dot's first operand, the few
    query rows the second, which the tensor cores pad to 8 columns where a first operand pads
    to 16 rows). K16 == 1 folds K's per-channel scales into the fp32 query, (q*s)_r rounded to
    fp16, and dots it with fp16 1024 + code (int4: 1024 + 16 * code for odd nibbles, against
    q*s/16; about one LOP3 a pair of codes), then adds q . z - 1024 * the sum of the rounded
    q*s the dots saw; with TINY_CODES it dots the rounded q*s (q*s/16) with the tiny codes
    instead (one AND a pair), scales the dots by 2^24 and adds q . z alone; 0 dequantizes K in
    fp32, rounded once into DOT. The query is held as the dots' [DK, rows] operand so that q*s is formed in a
    layout near it (sm_90, triton 3.6: 2 barriers a page where [rows, DK] took 10, 15
    butterfly shuffles where it took 34; int8 1,315 instructions a page against 1,463)."""
    W: tl.constexpr = q30.shape[0]
    G_PAD: tl.constexpr = q30.shape[2]
    W2: tl.constexpr = K_BITS == 2 and K16 == 1  # int2 codes as int16 words (int2_words_f16)
    HALF: tl.constexpr = W2 and DK // 2 >= 16  # ... in two dots a sub-tile where each keeps a dot's 16 columns (below)
    st = tl.zeros((W, P, G_PAD), tl.float32)
    corr = tl.zeros((W, DK // 2 if HALF else DK, G_PAD), tl.float32)  # q*z [- 1024 * fp16(q*s)], summed once (K16 == 1)
    rows = _side_rows(bh[:, None, None], sub[:, None, None], offs_p[None, :, None], P, PS)
    if W2:
        xk = tl.load(KC.to(tl.pointer_type(tl.int16)) + rows * (DK // 2) + tl.arange(0, DK // 2)[None, None, :])
    else:
        xk = tl.load(KC + rows * DK + offs_k[None, None, :])
    W16: tl.constexpr = KS.dtype.element_ty.primitive_bitwidth == 16
    # K's scales and zeros, as words of K_SUB 16-bit values (W16) or at channels chan + r: the
    # channels K_SUB*i of each page's head, or with HALF the words' low bytes' 8j (the high
    # bytes' 8j + 4 apart: chan_hi, ksw_hi, kzw_hi)
    step: tl.constexpr = 2 if HALF else 1
    offs_c = tl.arange(0, DK // step)
    PG: tl.constexpr = PS if PS > P else P  # tokens a page
    SPAN: tl.constexpr = PG if KG == 0 else KG
    srow = bh  # the tiles' K scale rows [W]
    if SPAN < PG:
        srow = bh * (PG // SPAN) + sub // SPAN
    chan = srow[:, None] * D + K_SUB * step * offs_c[None, :]
    chan_hi = chan + 4
    idx = srow[:, None] * DK + step * offs_c[None, :]
    ksw = xk
    kzw = xk
    ksw_hi = xk
    kzw_hi = xk
    if W16:
        ksw = _words16(KS, idx, idx >= 0, K_SUB)
        kzw = _words16(KZ, idx, idx >= 0, K_SUB)
        if HALF:
            ksw_hi = _words16(KS, idx + 1, idx >= 0, K_SUB)
            kzw_hi = _words16(KZ, idx + 1, idx >= 0, K_SUB)
    for r in tl.static_range(K_SUB):
        if HALF:
            # Two dots, the low bytes' codes against the query's even columns and the high
            # bytes' against its odd ones: joined into one operand, the codes made Triton halve
            # both operands' register width (kWidth), which sent the query's through shared
            # memory each sub-tile (sm_90: 1,491 instructions a page and 17 barriers)
            lo = int2_f16(xk, 2 * r, TINY if TINY_CODES else BIASED, ASM)
            hi = int2_f16(xk, 2 * r + 8, TINY if TINY_CODES else BIASED, ASM)
            ql, qh = tl.split(tl.permute(tl.reshape(pick_subtile(q30, q31, q32, q33, r), (W, DK // 2, 2, G_PAD)), (0, 1, 3, 2)))
            sl, zl = _k_scales(KS, KZ, ksw, kzw, chan, chan >= 0, r, W16)
            sh, zh = _k_scales(KS, KZ, ksw_hi, kzw_hi, chan_hi, chan_hi >= 0, r, W16)
            qsl = (ql * sl.to(tl.float32)[:, :, None]).to(tl.float16)
            qsh = (qh * sh.to(tl.float32)[:, :, None]).to(tl.float16)
            corr += ql * zl.to(tl.float32)[:, :, None] + qh * zh.to(tl.float32)[:, :, None]
            if not TINY_CODES:
                corr -= 1024.0 * (qsl.to(tl.float32) + qsh.to(tl.float32))
            st += tl.dot(lo, qsl)
            st += tl.dot(hi, qsh)
        else:
            if W2:
                c0 = int2_words_f16(xk, r, TINY if TINY_CODES else BIASED, ASM)
            elif K16 == 1:
                c0 = codes_f16n(xk, r, K_BITS, ASM, TINY if TINY_CODES else BIASED)
            qr = pick_subtile(q30, q31, q32, q33, r)
            sr, zr = _k_scales(KS, KZ, ksw, kzw, chan, chan >= 0, r, W16)
            if K16 == 1:
                qs = qr * sr.to(tl.float32)[:, :, None]
                if K_BITS == 4 and r % 2 == 1:
                    qs = qs * 0.0625  # against 1024 + 16 * code, or 16 * code tiny
                qs = qs.to(tl.float16)
                if TINY_CODES:
                    corr += qr * zr.to(tl.float32)[:, :, None]
                else:
                    corr += qr * zr.to(tl.float32)[:, :, None] - 1024.0 * qs.to(tl.float32)
                st += tl.dot(c0, qs)
            else:
                kf = f32_codes(xk, r, K_BITS) * sr.to(tl.float32)[:, None, :] + zr.to(tl.float32)[:, None, :]
                st += tl.dot(kf.to(DOT), qr.to(DOT), input_precision=PREC)
    s = tl.permute(st, (0, 2, 1))
    if K16 == 1 and TINY_CODES:
        s = s * 16777216.0 + tl.sum(corr, 1)[:, :, None]  # tiny codes: units of 2^-24
    elif K16 == 1:
        s += tl.sum(corr, 1)[:, :, None]
    return s


@triton.jit
def side_values(VC, VS, VZ, bh, sub, p, offs_p, offs_v, P: tl.constexpr, DV: tl.constexpr, V_SUB: tl.constexpr,
                 NG: tl.constexpr, GS: tl.constexpr, V_BITS: tl.constexpr, V16: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                 PS: tl.constexpr = 0):
    """V sub-tiles [W, P, DV] of the quantized pages at pool rows bh [W] (with PS > P: their
    P-token tiles `sub` [W] tokens into pages of PS), dequantized in registers, and the
    probabilities p [W, G_PAD, P] in the dtype their dot takes: (pv, v0..v3)."""
    W: tl.constexpr = p.shape[0]
    row = _side_rows(bh[:, None], sub[:, None], offs_p[None, :], P, PS)  # [W, P] rows of the [N * H * block_size, ...] pool
    xv = tl.load(VC + row[:, :, None] * DV + offs_v[None, None, :])
    VT: tl.constexpr = (tl.bfloat16 if V16 == 2 and V_BITS <= 4 and VS.dtype.element_ty == tl.bfloat16
                        else tl.float16 if V16 else tl.float32)
    ok = row >= 0  # (every side-by-side row is a valid one)
    vs = tl.reshape(tl.broadcast_to(_token_groups(VS, row, ok, NG).to(VT)[:, :, :, None], (W, P, NG, GS // V_SUB)), (W, P, DV))
    vz = tl.reshape(tl.broadcast_to(_token_groups(VZ, row, ok, NG).to(VT)[:, :, :, None], (W, P, NG, GS // V_SUB)), (W, P, DV))
    return _values_from_codes(xv, vs, vz, p, V_BITS, V16, DOT, ASM, V_SUB)


@triton.jit
def side_values_folded(VC, VS, VZ, bh, sub, pt, x0, x1, x2, x3, z_acc, alpha, offs_p, P: tl.constexpr, DV: tl.constexpr,
                        V_SUB: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, V_BITS: tl.constexpr, ASM: tl.constexpr,
                        ZERO_DOT: tl.constexpr = False, PS: tl.constexpr = 0, TINY_CODES: tl.constexpr = False):
    """Side by side (pool rows bh [W]; with PS > P their P-token tiles `sub` [W] tokens into
    pages of PS), values transposed with their per-token scales folded into the
    probabilities: for each group g of V's channels, codes_gᵀ [GS/V_SUB, P] (exact fp16 codes, the
    dot's first operand: converted in its registers) @ (p * s_g) [P, rows], the NG groups along
    the batch dimension of the accumulators x_r [W * NG, GS/V_SUB, rows]; sum_t p z_g goes to
    z_acc [W, NG, rows], as a sum over the page's tokens, or with ZERO_DOT as a small dot of the
    fp16 zeros and probabilities (a dot's operand, the zeros' load is then prefetched by the
    pipeliner like the others, where the sum leaves it in the loop; fp16 holds the zeros as it
    holds p * s_g, losing bits only below its normal range, 6.1e-5). All are rescaled by alpha
    [W, rows] first. (Codes biased by 1024 as K's, the bias taken out once from the sums of the
    fp16 p * s_g, saved an instruction a pair but measured no faster on the H200, and int2 with
    rotation left the error budget there.) With TINY_CODES the codes are tiny instead
    (one AND or PRMT a pair, no subtract): x_r then holds its sums in units of tiny_unit(r),
    which unfold_values takes out."""
    W: tl.constexpr = bh.shape[0]
    R: tl.constexpr = pt.shape[2]
    DG: tl.constexpr = GS // V_SUB  # a group's columns of a sub-tile
    row = _side_rows(bh[:, None], sub[:, None], offs_p[None, :], P, PS)  # [W, P]
    # code words [W * NG, DG, P]: batch entry b is page b // NG's group b % NG (loaded in this
    # shape: a reshape of the loaded tile would keep its conversion out of the dot's registers)
    offs_b = tl.arange(0, W * NG)
    bh_b = tl.reshape(tl.broadcast_to(bh[:, None], (W, NG)), (W * NG,))
    sub_b = tl.reshape(tl.broadcast_to(sub[:, None], (W, NG)), (W * NG,)) if PS > P else sub
    tok = _side_rows(bh_b[:, None, None], sub_b[:, None, None], offs_p[None, None, :], P, PS)  # [W * NG, 1, P]
    W2: tl.constexpr = v_words2(V_BITS, DG)
    if W2:  # int2 codes as int16 words [W * NG, DG, P], each word in rows i and DG / 2 + i (int2_rows_f16)
        xv = tl.load(VC.to(tl.pointer_type(tl.int16)) + tok * (DV // 2) + (offs_b % NG)[:, None, None] * (DG // 2)
                     + (tl.arange(0, DG) % (DG // 2))[None, :, None])
    else:
        xv = tl.load(VC + tok * DV + (offs_b % NG)[:, None, None] * DG
                     + tl.arange(0, DG)[None, :, None])
    ok = row >= 0
    sg = _token_groups(VS, row, ok, NG).to(tl.float32)  # [W, P, NG]
    zg = _token_groups(VZ, row, ok, NG).to(tl.float16 if ZERO_DOT else tl.float32)
    pg = tl.permute(pt[:, :, :, None] * sg[:, :, None, :], (0, 3, 1, 2))  # [W, NG, P, rows]
    pg = tl.reshape(pg.to(tl.float16), (W * NG, P, R))
    if ZERO_DOT:
        z_acc = z_acc * alpha[:, None, :] + tl.dot(tl.permute(zg, (0, 2, 1)), pt.to(tl.float16))
    else:
        z_acc = z_acc * alpha[:, None, :] + tl.sum(pt[:, :, None, :] * zg[:, :, :, None], 1)
    c = tl.reshape(tl.broadcast_to(alpha[:, None, None, :], (W, NG, 1, R)), (W * NG, 1, R))
    for r in tl.static_range(V_SUB):
        if W2:
            cr = int2_rows_f16(xv, r, TINY if TINY_CODES else EXACT, ASM)
        else:
            cr = codes_f16n(xv, r, V_BITS, ASM, TINY if TINY_CODES else EXACT)
        if r == 0:
            x0 = x0 * c + tl.dot(cr, pg)
        elif r == 1:
            x1 = x1 * c + tl.dot(cr, pg)
        elif r == 2:
            x2 = x2 * c + tl.dot(cr, pg)
        else:
            x3 = x3 * c + tl.dot(cr, pg)
    return x0, x1, x2, x3, z_acc


@triton.jit
def unfold_values(x, z_acc, NG: tl.constexpr, UNIT: tl.constexpr = 1.0, HALVES: tl.constexpr = False):
    """[W, rows, DV] from side_values_folded's x_r [W * NG, GS/V_SUB, rows] (sums in units of
    UNIT: tiny_unit(r) for tiny codes) and z_acc [W, NG, rows]. HALVES: x's rows i and
    GS/V_SUB/2 + i are a group's bytes 2i and 2i + 1 (int2 words, int2_rows_f16)."""
    W: tl.constexpr = z_acc.shape[0]
    R: tl.constexpr = z_acc.shape[2]
    DG: tl.constexpr = x.shape[1]
    if UNIT != 1.0:
        x = x * (1.0 / UNIT)
    if HALVES:
        x = tl.reshape(tl.permute(tl.reshape(x, (W * NG, 2, DG // 2, R)), (0, 2, 1, 3)), (W * NG, DG, R))
    y = tl.reshape(x, (W, NG, DG, R)) + z_acc[:, :, None, :]
    return tl.permute(tl.reshape(y, (W, NG * DG, R)), (0, 2, 1))


@triton.jit
def fold_states(x, c):
    """sum over the side-by-side pages of x [W, G_PAD, DV], each scaled by c [W, G_PAD]."""
    return tl.sum(x * c[:, :, None], 0)
