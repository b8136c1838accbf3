"""Triton decode attention over quantized pages (q_len = 1), flash-decoding style.

One program per (row, KV head, split): it loads the G query heads of its KV head once, walks
its share of the row's logical blocks (sink pages, sealed quantized pages, then the
unquantized tail), dequantizes codes in registers and keeps an online softmax. Splits are
merged by log-sum-exp. No bf16 copy of the cache is ever written.

With rotation the sealed pages hold K·H and V·H: their scores use the rotated query, and
their share of the output is accumulated apart and rotated back once, after the merge.

Never imports the reference; tests compare the two (tests/ops/test_paged_attention_triton.py).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ...quant import hadamard
from ..pages import PagedView

NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _dequant(codes_ptr, row_off, offs_p, offs_d, stride_p, BITS: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
    """Load a [P, D] tile of codes (packed little-end-first) and return them as fp32.

    Each channel reads its own byte and shifts (a byte is read 8/BITS times, from L1):
    no join/reshape, whose layouts miscompiled as tensor-core operands on triton 3.6."""
    PER: tl.constexpr = 8 // BITS
    x = tl.load(codes_ptr + row_off + offs_p[:, None] * stride_p + (offs_d // PER)[None, :])
    if BITS == 8:
        return x.to(tl.float32)
    shift = ((offs_d % PER) * BITS).to(tl.uint8)
    return ((x >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _online_update(s, v, m_i, l_i, acc, DOT: tl.constexpr, PREC: tl.constexpr):
    """One block of the online softmax: s [G_PAD, P] fp32 scores (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_new, l_i, acc, alpha


@triton.jit
def _dense_block(K, V, off, q, m_i, l_i, acc, acc_r, pos, start, valid,
                 DOT: tl.constexpr, PREC: tl.constexpr, ROTATE: tl.constexpr):
    """An unquantized, unrotated [P, D] block (sink page or tail) at K/V + off."""
    k = tl.load(K + off, mask=valid[:, None], other=0.0)
    v = tl.load(V + off, mask=valid[:, None], other=0.0)
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)
    s = tl.where((valid & (pos >= start))[None, :], s, float("-inf"))
    m_i, l_i, acc, alpha = _online_update(s, v, m_i, l_i, acc, DOT, PREC)
    if ROTATE:
        acc_r = acc_r * alpha[:, None]
    return m_i, l_i, acc, acc_r


@triton.jit
def _decode_kernel(
    Q, QR, TABLE, START,
    SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, TAIL_K, TAIL_V,
    O, OR, LSE,
    stride_qb, stride_qh,
    stride_tb,
    s_sk_n, s_sk_h, s_sk_p,
    s_kd_n, s_kd_h, s_kd_p,
    s_vd_n, s_vd_h, s_vd_p,
    s_kc_n, s_kc_h, s_kc_p,
    s_ks_n, s_ks_h,
    s_vc_n, s_vc_h, s_vc_p,
    s_vs_n, s_vs_h, s_vs_p,
    s_tk_b, s_tk_h, s_tk_p,
    s_o_b, s_o_h, s_o_s,
    s_l_b, s_l_h,
    n_blocks, n_sink, tail_len, blocks_per_split, scale,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr,
    HAS_START: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, P)
    gmask = offs_g < G
    q_off = b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=gmask[:, None], other=0.0).to(tl.float32) * scale
    if ROTATE:
        qp = tl.load(QR + q_off, mask=gmask[:, None], other=0.0).to(tl.float32) * scale
    else:
        qp = q
    start = 0
    if HAS_START:
        start = tl.load(START + b)

    total = n_blocks + tl.cdiv(tail_len, P)
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, total)

    m_i = tl.full((G_PAD,), NEG_BIG, tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    acc_r = tl.zeros((G_PAD, D), tl.float32)
    all_p = offs_p >= 0

    # 1. sink pages: unquantized, unrotated
    for j in range(lo, tl.minimum(hi, n_sink)):
        blk = tl.load(TABLE + b * stride_tb + j).to(tl.int64)
        off = blk * s_sk_n + h * s_sk_h + offs_p[:, None] * s_sk_p + offs_d[None, :]
        m_i, l_i, acc, acc_r = _dense_block(SINK_K, SINK_V, off, q, m_i, l_i, acc, acc_r, j * P + offs_p, start, all_p, DOT, PREC, ROTATE)

    # 2. sealed pages: K scores fold the per-channel scales into the query,
    #    (q*s).codes + q.z; V is dequantized in registers with per-token group scales.
    for j in range(tl.maximum(lo, n_sink), tl.minimum(hi, n_blocks)):
        blk = tl.load(TABLE + b * stride_tb + j).to(tl.int64)
        if K_BITS == 16:
            k = tl.load(KD + blk * s_kd_n + h * s_kd_h + offs_p[:, None] * s_kd_p + offs_d[None, :])
            s = tl.dot(qp.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)
        else:
            kc = _dequant(KC, blk * s_kc_n + h * s_kc_h, offs_p, offs_d, s_kc_p, K_BITS, D, P)
            ks = tl.load(KS + blk * s_ks_n + h * s_ks_h + offs_d).to(tl.float32)
            kz = tl.load(KZ + blk * s_ks_n + h * s_ks_h + offs_d).to(tl.float32)
            s = tl.dot((qp * ks[None, :]).to(DOT), tl.trans(kc.to(DOT)), input_precision=PREC)
            s = s + tl.sum(qp * kz[None, :], 1)[:, None]
        if V_BITS == 16:
            v = tl.load(VD + blk * s_vd_n + h * s_vd_h + offs_p[:, None] * s_vd_p + offs_d[None, :])
        else:
            vc = _dequant(VC, blk * s_vc_n + h * s_vc_h, offs_p, offs_d, s_vc_p, V_BITS, D, P)
            offs_n = tl.arange(0, D // GS)
            vs_off = blk * s_vs_n + h * s_vs_h + offs_p[:, None] * s_vs_p + offs_n[None, :]
            vs = tl.load(VS + vs_off).to(tl.float32)
            vz = tl.load(VZ + vs_off).to(tl.float32)
            vs = tl.reshape(tl.broadcast_to(vs[:, :, None], (P, D // GS, GS)), (P, D))
            vz = tl.reshape(tl.broadcast_to(vz[:, :, None], (P, D // GS, GS)), (P, D))
            v = vc * vs + vz
        s = tl.where(((j * P + offs_p) >= start)[None, :], s, float("-inf"))
        if ROTATE:
            m_i, l_i, acc_r, alpha = _online_update(s, v, m_i, l_i, acc_r, DOT, PREC)
            acc = acc * alpha[:, None]
        else:
            m_i, l_i, acc, alpha = _online_update(s, v, m_i, l_i, acc, DOT, PREC)

    # 3. the tail: unquantized, unrotated, as blocks after the table
    for j in range(tl.maximum(lo, n_blocks), hi):
        t = (j - n_blocks) * P + offs_p
        off = b * s_tk_b + h * s_tk_h + t[:, None] * s_tk_p + offs_d[None, :]
        m_i, l_i, acc, acc_r = _dense_block(TAIL_K, TAIL_V, off, q, m_i, l_i, acc, acc_r, n_blocks * P + t, start, t < tail_len, DOT, PREC, ROTATE)

    seen = l_i > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    o_off = b * s_o_b + (h * G + offs_g)[:, None] * s_o_h + split * s_o_s + offs_d[None, :]
    tl.store(O + o_off, (acc * inv[:, None]).to(O.dtype.element_ty), mask=gmask[:, None])
    if ROTATE:
        tl.store(OR + o_off, acc_r * inv[:, None], mask=gmask[:, None])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(LSE + b * s_l_b + (h * G + offs_g) * s_l_h + split, lse, mask=gmask)


@triton.jit
def _merge_kernel(O, LSE, OUT, LOUT, S, s_o_b, s_o_h, s_o_s, s_l_b, s_l_h, s_out_b, s_out_h,
                  HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr):
    """Merge the splits of one (row, query head) by log-sum-exp."""
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    smask = offs_s < S
    lse = tl.load(LSE + b * s_l_b + hq * s_l_h + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    denom = tl.sum(w, 0)
    w = w / tl.where(denom > 0, denom, 1.0)
    o = tl.load(O + b * s_o_b + hq * s_o_h + offs_s[:, None] * s_o_s + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(OUT + b * s_out_b + hq * s_out_h + offs_d, out.to(OUT.dtype.element_ty))
    tl.store(LOUT + b * HQ + hq, tl.where(denom > 0, m_safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf")))


def num_splits(batch: int, kv_heads: int, total_blocks: int, sm_count: int) -> int:
    """Splits of the KV length so that about eight programs per SM keep enough loads in
    flight; short contexts and big batches get one program per (row, head), whose output
    needs no merge."""
    target = 8 * sm_count
    per_row_head = max(1, math.ceil(target / max(1, batch * kv_heads)))
    return max(1, min(per_row_head, total_blocks, 256))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_DUMMIES: dict = {}


def _dummies(device, dtype):
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = (torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=device), torch.zeros(1, 1, 1, 1, dtype=dtype, device=device))
    return _DUMMIES[key]


_HADAMARD: dict = {}


def _hadamard_on(d: int, device) -> torch.Tensor:
    key = (d, str(device))
    if key not in _HADAMARD:
        _HADAMARD[key] = hadamard(d, torch.float32, device)
    return _HADAMARD[key]


def paged_decode_triton(q, view: PagedView, start, scale, return_lse: bool = True, splits: int | None = None):
    """q [B, H_q, 1, D] -> (out [B, H_q, 1, D], lse [B, H_q, 1] fp32 or None)."""
    pages, fmt = view.pages, view.pages.fmt
    B, Hq, _, D = q.shape
    H, P = fmt.num_kv_heads, fmt.block_size
    G = Hq // H
    q2 = q[:, :, 0]
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    hmat = _hadamard_on(D, q.device) if fmt.rotate else None
    qr = (q2.float() @ hmat).to(q2.dtype) if fmt.rotate else q2
    table = view.block_table
    n_blocks = table.shape[1]
    if n_blocks == 0:
        table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    tail_k, tail_v = view.tail_k, view.tail_v
    tail_len = tail_k.shape[2]
    if tail_k.stride(-1) != 1 or tail_k.stride() != tail_v.stride():
        raise ValueError("paged_decode_triton: tail_k/tail_v must be contiguous along D and strided alike")
    total = n_blocks + (tail_len + P - 1) // P
    if splits is None:
        sm = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 4
        splits = num_splits(B, H, total, sm)
    bps = max(1, math.ceil(total / splits))
    splits = max(1, math.ceil(total / bps))
    merged = splits == 1 and not fmt.rotate  # one split: the kernel writes the final output
    o = torch.empty(B, Hq, splits, D, dtype=q.dtype if merged else torch.float32, device=q.device)
    o_r = torch.empty_like(o) if fmt.rotate else o
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    u8, f = _dummies(q.device, view.sink_k.dtype)
    KD = pages.k if fmt.k_bits == 16 else f
    VD = pages.v if fmt.v_bits == 16 else f
    KC, KS, KZ = (pages.k_codes, pages.k_scale, pages.k_zero) if fmt.k_bits != 16 else (u8, f[0], f[0])
    VC, VS, VZ = (pages.v_codes, pages.v_scale, pages.v_zero) if fmt.v_bits != 16 else (u8, f, f)
    dot = tl.float16 if q.dtype == torch.float16 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float32)
    _decode_kernel[(B * H, splits)](
        q2, qr, table, start if start is not None else table,
        view.sink_k, view.sink_v, KD, VD, KC, KS, KZ, VC, VS, VZ, tail_k, tail_v,
        o, o_r, lse,
        q2.stride(0), q2.stride(1),
        table.stride(0),
        view.sink_k.stride(0), view.sink_k.stride(1), view.sink_k.stride(2),
        KD.stride(0), KD.stride(1), KD.stride(2),
        VD.stride(0), VD.stride(1), VD.stride(2),
        KC.stride(0), KC.stride(1), KC.stride(2),
        KS.stride(0), KS.stride(1),
        VC.stride(0), VC.stride(1), VC.stride(2),
        VS.stride(0), VS.stride(1), VS.stride(2),
        tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        n_blocks, min(view.n_sink, n_blocks), tail_len, bps, scale,
        H=H, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, P=P,
        K_BITS=fmt.k_bits, V_BITS=fmt.v_bits, GS=fmt.group_size, ROTATE=fmt.rotate,
        HAS_START=start is not None, DOT=dot, PREC="ieee" if dot == tl.float32 else "tf32",
        num_warps=4,
    )
    if merged:
        return o, (lse if return_lse else None)
    if fmt.rotate:  # two partial outputs per split; merge in torch, then rotate back
        m = lse.amax(-1, keepdim=True)
        w = torch.exp(lse - torch.where(torch.isfinite(m), m, 0.0))
        denom = w.sum(-1, keepdim=True)
        w = torch.where(denom > 0, w / torch.where(denom > 0, denom, 1.0), 0.0)
        out = (o * w[..., None]).sum(2) + (o_r * w[..., None]).sum(2) @ hmat
        total_lse = torch.where(denom > 0, m + torch.log(torch.where(denom > 0, denom, 1.0)), float("-inf"))
        return out[:, :, None].to(q.dtype), (total_lse if return_lse else None)
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    lout = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
    _merge_kernel[(B * Hq,)](o, lse, out, lout, splits, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                             out.stride(0), out.stride(1), HQ=Hq, D=D, S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out, (lout if return_lse else None)
