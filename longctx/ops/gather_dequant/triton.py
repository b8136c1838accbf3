"""Triton gather + dequantize: a paged batch's sealed blocks -> dense [B, H, n_blocks*P, D].

One program per (row, KV head, logical block). Codes become fp32 without int->float
conversion instructions (the bit trick of the decode kernel), are scaled in fp32 and stored
in the output's dtype; rotated pages are rotated back in the kernel by a dot with the
Hadamard matrix's signs, one sub-tile of channels at a time (rows r, r+PER, ... of H), so
packed channels are never interleaved in registers. That dot runs on fp16 tensor cores at
fp32's accuracy (`rotation.dot_signs`: the tile's values, scaled by a power of two into fp16's
range, as an fp16 head and tail times the exact +-1 signs, with fp32 sums; 1/sqrt(D) and the
power of two are taken back out at the end; an "ieee" fp32 dot runs as FMAs, ~50,000
sm_90 instructions a program). The output may be a slice of a
larger staging buffer (prefill writes the past and then the tail into one buffer), or a
permuted view of one laid out token-major ([B, T, H, D], as flash-attn's pages are). With a
shift per row, row b's token t lands at position t - shift[b] and tokens t < shift[b] are not
written (the `flash` backend drops left padding this way).

Never imports the reference; tests/ops/test_gather_dequant_triton.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import hadamard_scale, hadamard_signs
from ..backend import TRITON_OPTIONS
from ..pages import PagedView, kernel_pools
from ..rotation import dot_signs, pow2_into_f16


@triton.jit
def _code_f32(x, r: tl.constexpr, BITS: tl.constexpr):
    c = x if BITS >= 8 else (x >> (r * BITS)) & ((1 << BITS) - 1)
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scaled(code, SCALE, ZERO, bh, offs_p, chan, P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr,
            PER_TOKEN: tl.constexpr, KG: tl.constexpr):
    """code [P, len(chan)] (fp32) * scale + zero of the block's channels `chan`."""
    if PER_TOKEN:  # V: [N, H, P, D/GS], group of channel c is c // GS
        sc_off = bh * P * NG + offs_p[:, None] * NG + (chan // GS)[None, :]
        return code * tl.load(SCALE + sc_off).to(tl.float32) + tl.load(ZERO + sc_off).to(tl.float32)
    elif KG == P:  # K: [N, H, 1, D], per channel
        return code * tl.load(SCALE + bh * D + chan).to(tl.float32)[None, :] + tl.load(ZERO + bh * D + chan).to(tl.float32)[None, :]
    else:  # K: [N, H, P / KG, D], per channel and span of KG tokens
        sc_off = (bh * (P // KG) + offs_p[:, None] // KG) * D + chan[None, :]
        return code * tl.load(SCALE + sc_off).to(tl.float32) + tl.load(ZERO + sc_off).to(tl.float32)


@triton.jit
def _side(SINK, DENSE, CODES, SCALE, ZERO, HMAT, OUT, blk, h, is_sink, offs_p, out_rows, keep,
          H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
          PER_TOKEN: tl.constexpr, ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr, KG: tl.constexpr):
    """One side (K or V) of one block: copy a sink or 16-bit page, or dequantize codes. keep:
    [P, 1] mask of the rows to store, or None (all)."""
    offs_d = tl.arange(0, D)
    bh = blk * H + h
    # (each branch names its own values: the compiler wants one type per name across a branch)
    if is_sink:
        xs = tl.load(SINK + bh * P * D + offs_p[:, None] * D + offs_d[None, :])
        tl.store(OUT + out_rows + offs_d[None, :], xs.to(OUT.dtype.element_ty), mask=keep)
    elif BITS == 16:
        xd = tl.load(DENSE + bh * P * D + offs_p[:, None] * D + offs_d[None, :])
        tl.store(OUT + out_rows + offs_d[None, :], xd.to(OUT.dtype.element_ty), mask=keep)
    else:
        PER: tl.constexpr = 8 // BITS if BITS < 8 else 1
        DS: tl.constexpr = D // PER
        NG: tl.constexpr = D // GS
        offs_s = tl.arange(0, DS)
        x = tl.load(CODES + bh * P * DS + offs_p[:, None] * DS + offs_s[None, :]).to(tl.int32)
        if ROTATE:
            # x @ H = sum over sub-tiles r of x_r @ H[chan_r, :]. First the tile's largest
            # magnitude, then x * 2^k (exact) as fp16 head + tail times the signs of H
            amax = 0.0
            for r in tl.static_range(PER):
                chan = PER * offs_s + r  # channels of sub-tile r
                val = _scaled(_code_f32(x, r, BITS), SCALE, ZERO, bh, offs_p, chan, P, D, NG, GS, PER_TOKEN, KG)
                amax = tl.maximum(amax, tl.max(tl.abs(val)))
            up = pow2_into_f16(amax)
            acc = tl.zeros((P, D), tl.float32)
            for r in tl.static_range(PER):
                chan = PER * offs_s + r
                val = _scaled(_code_f32(x, r, BITS), SCALE, ZERO, bh, offs_p, chan, P, D, NG, GS, PER_TOKEN, KG) * up
                signs = tl.load(HMAT + chan[:, None] * D + offs_d[None, :])  # fp16 +-1
                acc = dot_signs(val, signs, acc)  # (fp16 head + tail)
            tl.store(OUT + out_rows + offs_d[None, :], (acc * (INV_SQRT_D / up)).to(OUT.dtype.element_ty), mask=keep)
        else:
            # the codes of the whole page in channel order (sub-tile r holds channels PER*i + r),
            # so that the scales load and the output stores along D, 16 bytes a lane (a
            # sub-tile stored at a stride of PER channels gets 2-byte stores along tokens from
            # triton 3.6: 12x slower on the H200)
            code = _code_f32(x, 0, BITS)
            if PER == 2:
                code = tl.reshape(tl.join(code, _code_f32(x, 1, BITS)), (P, D))
            elif PER == 4:  # join(join(c0, c2), join(c1, c3)): [P, DS, 2, 2], index 2a + c is r
                code = tl.reshape(tl.join(tl.join(code, _code_f32(x, 2, BITS)), tl.join(_code_f32(x, 1, BITS), _code_f32(x, 3, BITS))), (P, D))
            val = _scaled(code, SCALE, ZERO, bh, offs_p, offs_d, P, D, NG, GS, PER_TOKEN, KG)
            tl.store(OUT + out_rows + offs_d[None, :], val.to(OUT.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["stride_tb", "n_sink"])  # they change per call
def _gather_kernel(TABLE, SHIFT, SINK_K, SINK_V, KD, VD, KC, KS, KZ, VC, VS, VZ, HMAT, OK, OV,
                   stride_tb, s_ob, s_oh, s_ot, n_sink,
                   H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                   GS: tl.constexpr, ROTATE: tl.constexpr, HAS_SHIFT: tl.constexpr, INV_SQRT_D: tl.constexpr, KG: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.program_id(1)
    b = pid // H
    h = pid % H
    blk = tl.load(TABLE + b * stride_tb + j).to(tl.int64)
    offs_p = tl.arange(0, P)
    t = j * P + offs_p  # the row's token within the gathered blocks
    if HAS_SHIFT:
        shift = tl.load(SHIFT + b)
        keep = (t >= shift)[:, None]
        t = t - shift
    else:
        keep = None
    rows = b * s_ob + h * s_oh + t[:, None] * s_ot
    is_sink = j < n_sink
    _side(SINK_K, KD, KC, KS, KZ, HMAT, OK, blk, h, is_sink, offs_p, rows, keep, H, D, P, K_BITS, GS, False, ROTATE, INV_SQRT_D, KG)
    _side(SINK_V, VD, VC, VS, VZ, HMAT, OV, blk, h, is_sink, offs_p, rows, keep, H, D, P, V_BITS, GS, True, ROTATE, INV_SQRT_D, KG)


def gather_dequant_triton(view: PagedView, out_k: torch.Tensor, out_v: torch.Tensor, shift: torch.Tensor | None = None) -> None:
    """Write the sealed past of `view` into out_k/out_v [B, H, >= n_blocks*P, D] (positions
    0 .. n_blocks*P-1; the rest is left alone). out_k and out_v must share strides and have
    a unit stride along D. shift: int32 [B] in 0 .. n_blocks*P, or None (zeros): row b's token
    t goes to position t - shift[b], and its tokens t < shift[b] are skipped."""
    fmt = view.pages.fmt
    table = view.block_table
    B, n = table.shape
    if n == 0:
        return
    H, P, D = fmt.num_kv_heads, fmt.block_size, fmt.head_dim
    if out_k.shape[0] != B or out_k.shape[1] != H or out_k.shape[2] < n * P or out_k.shape[3] != D:
        raise ValueError(f"gather_dequant_triton: out {tuple(out_k.shape)} cannot hold [B={B}, H={H}, {n * P}, D={D}]")
    if out_k.stride() != out_v.stride() or out_k.stride(-1) != 1:
        raise ValueError("gather_dequant_triton: out_k/out_v must share strides, unit stride along D")
    if shift is not None and (shift.shape != (B,) or shift.dtype != torch.int32 or shift.device != table.device):
        raise ValueError(f"gather_dequant_triton: shift must be int32 [B={B}] on {table.device}, got {shift.dtype} {tuple(shift.shape)} on {shift.device}")
    KD, VD, KC, KS, KZ, VC, VS, VZ = kernel_pools(view, "gather_dequant_triton")
    hmat = hadamard_signs(D, table.device) if fmt.rotate else view.sink_k  # (unread without rotation)
    _gather_kernel[(B * H, n)](
        table, shift if shift is not None else table, view.sink_k, view.sink_v, KD, VD, KC, KS, KZ, VC, VS, VZ, hmat, out_k, out_v,
        table.stride(0), out_k.stride(0), out_k.stride(1), out_k.stride(2), min(view.n_sink, n),
        H=H, D=D, P=P, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits, GS=fmt.group_size, ROTATE=fmt.rotate, HAS_SHIFT=shift is not None,
        INV_SQRT_D=hadamard_scale(D), KG=fmt.k_span, num_warps=4, **TRITON_OPTIONS,
    )
