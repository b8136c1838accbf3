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

import math

import torch
import triton
import triton.language as tl

from ...quant import hadamard
from ..pages import PagedView

NEG_BIG = -1.0e30


@triton.jit
def _dequant(codes_ptr, row_off, offs_p, offs_d, stride_p, BITS: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
    """Load a [P, D] tile of codes (packed little-end-first) and return them as fp32."""
    if BITS == 8:
        x = tl.load(codes_ptr + row_off + offs_p[:, None] * stride_p + offs_d[None, :])
        return x.to(tl.float32)
    elif BITS == 4:
        offs_h = tl.arange(0, D // 2)
        x = tl.load(codes_ptr + row_off + offs_p[:, None] * stride_p + offs_h[None, :])
        lo = (x & 15).to(tl.float32)
        hi = (x >> 4).to(tl.float32)
        return tl.reshape(tl.join(lo, hi), (P, D))
    else:
        offs_q = tl.arange(0, D // 4)
        x = tl.load(codes_ptr + row_off + offs_p[:, None] * stride_p + offs_q[None, :])
        c0 = (x & 3).to(tl.float32)
        c1 = ((x >> 2) & 3).to(tl.float32)
        c2 = ((x >> 4) & 3).to(tl.float32)
        c3 = ((x >> 6) & 3).to(tl.float32)
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (P, D))


@triton.jit
def _online_update(s, v, m_i, l_i, acc, DOT: tl.constexpr):
    """One block of the online softmax: s [G_PAD, P] fp32 scores (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))
    return m_new, l_i, acc, alpha


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
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GS: tl.constexpr, ROTATE: tl.constexpr, DOT: tl.constexpr,
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
        qr = tl.load(QR + q_off, mask=gmask[:, None], other=0.0).to(tl.float32) * scale
    start = tl.load(START + b)

    n_tail_blocks = tl.cdiv(tail_len, P)
    total = n_blocks + n_tail_blocks
    lo = split * blocks_per_split

    m_i = tl.full((G_PAD,), NEG_BIG, tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    acc_r = tl.zeros((G_PAD, D), tl.float32)

    # Logical blocks [lo, hi): sink pages (unquantized), sealed pages (quantized unless
    # 16-bit; rotated when ROTATE), then the unquantized tail as blocks after the table.
    for j in range(lo, lo + blocks_per_split):
        if j < n_sink:
            blk = tl.load(TABLE + b * stride_tb + j)
            off = blk * s_sk_n + h * s_sk_h + offs_p[:, None] * s_sk_p + offs_d[None, :]
            k = tl.load(SINK_K + off).to(tl.float32)
            v = tl.load(SINK_V + off).to(tl.float32)
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)))
            s = tl.where(((j * P + offs_p) >= start)[None, :], s, float("-inf"))
            m_i, l_i, acc, alpha = _online_update(s, v, m_i, l_i, acc, DOT)
            if ROTATE:
                acc_r = acc_r * alpha[:, None]
        elif j < n_blocks:
            blk = tl.load(TABLE + b * stride_tb + j)
            if K_BITS == 16:
                k = tl.load(KD + blk * s_kd_n + h * s_kd_h + offs_p[:, None] * s_kd_p + offs_d[None, :]).to(tl.float32)
            else:
                kc = _dequant(KC, blk * s_kc_n + h * s_kc_h, offs_p, offs_d, s_kc_p, K_BITS, D, P)
                ks = tl.load(KS + blk * s_ks_n + h * s_ks_h + offs_d).to(tl.float32)
                kz = tl.load(KZ + blk * s_ks_n + h * s_ks_h + offs_d).to(tl.float32)
                k = kc * ks[None, :] + kz[None, :]
            if V_BITS == 16:
                v = tl.load(VD + blk * s_vd_n + h * s_vd_h + offs_p[:, None] * s_vd_p + offs_d[None, :]).to(tl.float32)
            else:
                vc = _dequant(VC, blk * s_vc_n + h * s_vc_h, offs_p, offs_d, s_vc_p, V_BITS, D, P)
                vs_off = blk * s_vs_n + h * s_vs_h + offs_p[:, None] * s_vs_p + (offs_d // GS)[None, :]
                vs = tl.load(VS + vs_off).to(tl.float32)
                vz = tl.load(VZ + vs_off).to(tl.float32)
                v = vc * vs + vz
            if ROTATE:
                s = tl.dot(qr.to(DOT), tl.trans(k.to(DOT)))
                s = tl.where(((j * P + offs_p) >= start)[None, :], s, float("-inf"))
                m_i, l_i, acc_r, alpha = _online_update(s, v, m_i, l_i, acc_r, DOT)
                acc = acc * alpha[:, None]
            else:
                s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)))
                s = tl.where(((j * P + offs_p) >= start)[None, :], s, float("-inf"))
                m_i, l_i, acc, alpha = _online_update(s, v, m_i, l_i, acc, DOT)
        elif j < total:
            t = (j - n_blocks) * P + offs_p
            valid = t < tail_len
            off = b * s_tk_b + h * s_tk_h + t[:, None] * s_tk_p + offs_d[None, :]
            k = tl.load(TAIL_K + off, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(TAIL_V + off, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)))
            s = tl.where((valid & ((n_blocks * P + t) >= start))[None, :], s, float("-inf"))
            m_i, l_i, acc, alpha = _online_update(s, v, m_i, l_i, acc, DOT)
            if ROTATE:
                acc_r = acc_r * alpha[:, None]

    seen = l_i > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    o_off = b * s_o_b + (h * G + offs_g)[:, None] * s_o_h + split * s_o_s + offs_d[None, :]
    tl.store(O + o_off, acc * inv[:, None], mask=gmask[:, None])
    if ROTATE:
        tl.store(OR + o_off, acc_r * inv[:, None], mask=gmask[:, None])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(LSE + b * s_l_b + (h * G + offs_g) * s_l_h + split, lse, mask=gmask)


def num_splits(batch: int, kv_heads: int, total_blocks: int, sm_count: int) -> int:
    """Splits of the KV length so that about two waves of programs fill the GPU; short
    contexts get one program per (row, head) (one cheap launch, no merge work)."""
    target = 2 * sm_count
    per_row_head = max(1, math.ceil(target / max(1, batch * kv_heads)))
    return max(1, min(per_row_head, total_blocks, 256))


def paged_decode_triton(q, view: PagedView, start, scale, return_lse: bool = True, splits: int | None = None):
    """q [B, H_q, 1, D] -> (out [B, H_q, 1, D], lse [B, H_q, 1] or None)."""
    pages, fmt = view.pages, view.pages.fmt
    B, Hq, C, D = q.shape
    H, P = fmt.num_kv_heads, fmt.block_size
    G = Hq // H
    q2 = q[:, :, 0]
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    qr = (q2.float() @ hadamard(D, torch.float32, q.device)).to(q2.dtype) if fmt.rotate else q2
    table = view.block_table
    n_blocks = table.shape[1]
    if table.numel() == 0:
        table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    tail_k, tail_v = view.tail_k, view.tail_v
    tail_len = tail_k.shape[2]
    assert tail_k.stride(-1) == 1 and tail_k.stride() == tail_v.stride(), "tail must be contiguous in D and alike"
    total = n_blocks + (tail_len + P - 1) // P
    if splits is None:
        sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = num_splits(B, H, total, sm)
    bps = max(1, math.ceil(total / splits))
    splits = max(1, math.ceil(total / bps))
    start_t = torch.zeros(B, dtype=torch.int32, device=q.device) if start is None else start.to(torch.int32)
    o = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    o_r = torch.empty_like(o) if fmt.rotate else o
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    u8 = torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=q.device)
    f = torch.zeros(1, 1, 1, 1, dtype=view.sink_k.dtype, device=q.device)
    KD = pages.k if fmt.k_bits == 16 else f
    VD = pages.v if fmt.v_bits == 16 else f
    KC, KS, KZ = (pages.k_codes, pages.k_scale, pages.k_zero) if fmt.k_bits != 16 else (u8, f[0], f[0])
    VC, VS, VZ = (pages.v_codes, pages.v_scale, pages.v_zero) if fmt.v_bits != 16 else (u8, f, f)
    for t in (view.sink_k, KD, VD, KC, VC):
        assert t.stride(-1) == 1, "pages must be contiguous along their last dim"
    dot = tl.float16 if q.dtype == torch.float16 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float32)
    _decode_kernel[(B * H, splits)](
        q2, qr, table, start_t,
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
        K_BITS=fmt.k_bits, V_BITS=fmt.v_bits, GS=fmt.group_size, ROTATE=fmt.rotate, DOT=dot,
        num_warps=4,
    )
    # merge the splits by log-sum-exp
    m = lse.amax(-1, keepdim=True)
    w = torch.exp(lse - torch.where(torch.isfinite(m), m, 0.0))
    denom = w.sum(-1, keepdim=True)
    w = torch.where(denom > 0, w / torch.where(denom > 0, denom, 1.0), 0.0)
    out = (o * w[..., None]).sum(2)
    if fmt.rotate:
        out = out + (o_r * w[..., None]).sum(2) @ hadamard(D, torch.float32, q.device)
    total_lse = (m.squeeze(-1) + torch.log(denom.squeeze(-1))) if return_lse else None
    return out[:, :, None].to(q.dtype), (total_lse[:, :, None] if return_lse else None)
