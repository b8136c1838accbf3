"""Triton sealing kernel: N full blocks [N, H_kv, P, D] -> packed codes, scales, zero-points.

One program per (block, KV head) quantizes K (per channel over the block's P tokens) and V
(per token in groups of GS channels) in one pass, following quant.py's contract: zero-point
rounded down and scale rounded up to the storage dtype, codes computed against the stored
values, a constant range gives scale 0. Work is done in byte "planes" (plane r holds
channels r, r+PER, ...; PER = 8/bits) so packing is a shift-or of planes, never an
interleave. Rotated formats are rotated in the same program, on the planes, before their
ranges are taken: fp64 butterflies rounded to the input's dtype, `quant.rotate_to_seal` bit
for bit, so a rotated block needs no other launch and no rotated copy of the input.

Never imports the reference; tests/ops/test_quantize_blocks.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import BlockFormat, hadamard_scale
from ..backend import TRITON_OPTIONS
from ..paged_attention.codes import pick_subtile
from ..pages import Pages, placeholders
from ..rotation import hadamard_planes


@triton.jit
def _step(x, up: tl.constexpr, BITS16: tl.constexpr):
    """The next representable value of x (in its own dtype) towards +inf (up) or -inf."""
    if BITS16:
        i = x.to(tl.int16, bitcast=True)
        SIGN: tl.constexpr = -32768
    else:
        i = x.to(tl.int32, bitcast=True)
        SIGN: tl.constexpr = -2147483648
    is_zero = (i == 0) | (i == SIGN)
    neg = i < 0  # sign bit set: a larger magnitude is a larger signed integer
    if up:
        j = tl.where(is_zero, 1, tl.where(neg, i - 1, i + 1))  # from 0: smallest positive subnormal
    else:
        j = tl.where(is_zero, SIGN + 1, tl.where(neg, i + 1, i - 1))  # from 0: smallest negative subnormal
    return j.to(i.dtype).to(x.dtype, bitcast=True)


@triton.jit
def _range_to_scale(lo, hi, QMAX: tl.constexpr, SDT: tl.constexpr, BITS16: tl.constexpr):
    """(scale, zero) in SDT with zero <= lo and zero + scale * QMAX >= hi; range math in
    fp64 like the reference, so both store the same values."""
    z = lo.to(SDT)
    z = tl.where(z.to(tl.float64) > lo, _step(z, False, BITS16), z)
    s = ((hi - z.to(tl.float64)) / QMAX).to(SDT)
    s = tl.where(s.to(tl.float64) < (hi - z.to(tl.float64)) / QMAX, _step(s, True, BITS16), s)
    s = tl.where(z.to(tl.float64) + s.to(tl.float64) * QMAX < hi, _step(s, True, BITS16), s)
    return s, z


@triton.jit
def _codes(x, s, z, QMAX: tl.constexpr):
    """round-half-even((x - z) / s) clamped to [0, QMAX], in fp64 (0 where s == 0)."""
    sf = s.to(tl.float64)
    q = tl.where(sf > 0, (x - z.to(tl.float64)) / tl.where(sf > 0, sf, 1.0), 0.0)
    f = tl.floor(q)
    d = q - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + odd))
    return tl.minimum(tl.maximum(r, 0.0), QMAX).to(tl.uint8)


@triton.jit
def _rotated_planes(X, xb, s_x_p, P: tl.constexpr, PER: tl.constexpr, DS: tl.constexpr, SCALE: tl.constexpr):
    """The PER planes [P, DS] (plane r: channels r, r + PER, ...) of the block at X + xb rotated
    as `quant.rotate_to_seal`: butterflies in fp64 (`hadamard_planes`), rounded to fp32 and then
    to X's dtype, held in fp64 for the range math. Planes past PER repeat plane 0."""
    offs = tl.arange(0, P)[:, None] * s_x_p + PER * tl.arange(0, DS)[None, :]
    x0 = tl.load(X + xb + offs).to(tl.float64)
    x1 = x0
    x2 = x0
    x3 = x0
    if PER > 1:
        x1 = tl.load(X + xb + offs + 1).to(tl.float64)
    if PER > 2:
        x2 = tl.load(X + xb + offs + 2).to(tl.float64)
        x3 = tl.load(X + xb + offs + 3).to(tl.float64)
    x0, x1, x2, x3 = hadamard_planes(x0, x1, x2, x3, PER, DS, SCALE)
    DT: tl.constexpr = X.dtype.element_ty
    x0 = x0.to(tl.float32).to(DT).to(tl.float64)
    x1 = x1.to(tl.float32).to(DT).to(tl.float64)
    x2 = x2.to(tl.float32).to(DT).to(tl.float64)
    x3 = x3.to(tl.float32).to(DT).to(tl.float64)
    return x0, x1, x2, x3


@triton.jit
def _no_planes(P: tl.constexpr, DS: tl.constexpr):
    """Placeholders for `_plane`'s planes where nothing is rotated (never read)."""
    z = tl.zeros((P, DS), tl.float64)
    return z, z, z, z


@triton.jit
def _plane(X, xb, s_x_p, r: tl.constexpr, P: tl.constexpr, PER: tl.constexpr, DS: tl.constexpr,
           ROT: tl.constexpr, x0, x1, x2, x3):
    """Plane r [P, DS] fp64 of the block at X + xb: the rotated x_r where ROT, else loaded."""
    if ROT:
        x = pick_subtile(x0, x1, x2, x3, r)
    else:
        x = tl.load(X + xb + tl.arange(0, P)[:, None] * s_x_p + (r + PER * tl.arange(0, DS))[None, :]).to(tl.float64)
    return x


@triton.jit
def _quantize_kernel(
    K, V, KC, KS, KZ, VC, VS, VZ, IDS,
    s_x_n, s_x_h, s_x_p,
    s_kc_n, s_kc_h, s_kc_p,
    s_ks_n, s_ks_h, s_ks_g,
    s_vc_n, s_vc_h, s_vc_p,
    s_vs_n, s_vs_h, s_vs_p,
    H: tl.constexpr, P: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, KG: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, SDT: tl.constexpr, BITS16: tl.constexpr, HAS_IDS: tl.constexpr,
    ROT: tl.constexpr, SCALE: tl.constexpr,
):
    """Block n of the input is written at output row IDS[n] (pool slots) with HAS_IDS, else n.
    K's scales and zeros: a row per span of KG tokens (P // KG of them, stride s_ks_g)."""
    pid = tl.program_id(0)
    n = pid // H
    h = pid % H
    offs_p = tl.arange(0, P)
    xb = n.to(tl.int64) * s_x_n + h * s_x_h
    o = n.to(tl.int64)
    if HAS_IDS:
        o = tl.load(IDS + n).to(tl.int64)
    if K_BITS < 16:
        K_SUB: tl.constexpr = 8 // K_BITS
        DK: tl.constexpr = D // K_SUB
        QK: tl.constexpr = (1 << K_BITS) - 1
        offs_i = tl.arange(0, DK)
        k0, k1, k2, k3 = _no_planes(P, DK)
        if ROT:
            k0, k1, k2, k3 = _rotated_planes(K, xb, s_x_p, P, K_SUB, DK, SCALE)
        S: tl.constexpr = P // KG  # scale rows a block
        packed = tl.zeros((P, DK), tl.uint8)
        for r in tl.static_range(K_SUB):
            ch = r + K_SUB * offs_i
            x = _plane(K, xb, s_x_p, r, P, K_SUB, DK, ROT, k0, k1, k2, k3)
            if S == 1:
                s, z = _range_to_scale(tl.min(x, 0), tl.max(x, 0), QK, SDT, BITS16)
                sb = o * s_ks_n + h * s_ks_h + ch
                tl.store(KS + sb, s)
                tl.store(KZ + sb, z)
                packed = packed | (_codes(x, s[None, :], z[None, :], QK) << (r * K_BITS))
            else:
                xs = tl.reshape(x, (S, KG, DK))
                s, z = _range_to_scale(tl.min(xs, 1), tl.max(xs, 1), QK, SDT, BITS16)  # [S, DK]
                sb = o * s_ks_n + h * s_ks_h + tl.arange(0, S)[:, None] * s_ks_g + ch[None, :]
                tl.store(KS + sb, s)
                tl.store(KZ + sb, z)
                st = tl.reshape(tl.broadcast_to(s[:, None, :], (S, KG, DK)), (P, DK))
                zt = tl.reshape(tl.broadcast_to(z[:, None, :], (S, KG, DK)), (P, DK))
                packed = packed | (_codes(x, st, zt, QK) << (r * K_BITS))
        tl.store(KC + o * s_kc_n + h * s_kc_h + offs_p[:, None] * s_kc_p + offs_i[None, :], packed)
    if V_BITS < 16:
        V_SUB: tl.constexpr = 8 // V_BITS
        DV: tl.constexpr = D // V_SUB
        NG: tl.constexpr = D // GS
        W: tl.constexpr = GS // V_SUB  # columns of one group in one plane
        QV: tl.constexpr = (1 << V_BITS) - 1
        offs_j = tl.arange(0, DV)
        lo = tl.full((P, NG), float("inf"), tl.float64)
        hi = tl.full((P, NG), float("-inf"), tl.float64)
        v0, v1, v2, v3 = _no_planes(P, DV)
        if ROT:
            v0, v1, v2, v3 = _rotated_planes(V, xb, s_x_p, P, V_SUB, DV, SCALE)
        for r in tl.static_range(V_SUB):
            x = _plane(V, xb, s_x_p, r, P, V_SUB, DV, ROT, v0, v1, v2, v3)
            lo = tl.minimum(lo, tl.min(tl.reshape(x, (P, NG, W)), 2))
            hi = tl.maximum(hi, tl.max(tl.reshape(x, (P, NG, W)), 2))
        s, z = _range_to_scale(lo, hi, QV, SDT, BITS16)
        so = o * s_vs_n + h * s_vs_h + offs_p[:, None] * s_vs_p + tl.arange(0, NG)[None, :]
        tl.store(VS + so, s)
        tl.store(VZ + so, z)
        sb = tl.reshape(tl.broadcast_to(s[:, :, None], (P, NG, W)), (P, DV))
        zb = tl.reshape(tl.broadcast_to(z[:, :, None], (P, NG, W)), (P, DV))
        packed = tl.zeros((P, DV), tl.uint8)
        for r in tl.static_range(V_SUB):
            x = _plane(V, xb, s_x_p, r, P, V_SUB, DV, ROT, v0, v1, v2, v3)
            packed = packed | (_codes(x, sb, zb, QV) << (r * V_BITS))
        tl.store(VC + o * s_vc_n + h * s_vc_h + offs_p[:, None] * s_vc_p + offs_j[None, :], packed)


_SDT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def quantize_blocks_triton(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat, checked: bool = False) -> dict[str, torch.Tensor]:
    """Same contract as quantize_blocks_reference; NaN/Inf input raises (checked on the host,
    unless the caller says it has checked)."""
    N, H, P, D = k.shape
    if not checked:
        _check(k, v)
    out: dict[str, torch.Tensor] = {}
    if fmt.k_bits == 16:
        out["k"] = k.to(fmt.dtype)
    if fmt.v_bits == 16:
        out["v"] = v.to(fmt.dtype)
    dev, dt = k.device, fmt.dtype
    if fmt.k_bits != 16:
        out["k_codes"] = torch.empty(N, H, P, D * fmt.k_bits // 8, dtype=torch.uint8, device=dev)
        out["k_scale"] = torch.empty(N, H, fmt.k_groups, D, dtype=dt, device=dev)
        out["k_zero"] = torch.empty(N, H, fmt.k_groups, D, dtype=dt, device=dev)
    if fmt.v_bits != 16:
        out["v_codes"] = torch.empty(N, H, P, D * fmt.v_bits // 8, dtype=torch.uint8, device=dev)
        out["v_scale"] = torch.empty(N, H, P, D // fmt.group_size, dtype=dt, device=dev)
        out["v_zero"] = torch.empty(N, H, P, D // fmt.group_size, dtype=dt, device=dev)
    _launch(k, v, fmt, out, None)
    return out


def quantize_blocks_into_triton(pages: Pages, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, checked: bool = False) -> None:
    """Quantize N blocks straight into `pages` at pool slots `ids` (int64 [N], on the device):
    one launch, no intermediate tensors and no per-field copies."""
    if not checked:
        _check(k, v)
    fmt = pages.fmt
    if fmt.k_bits == 16:
        pages.k[ids] = k.to(fmt.dtype)
    if fmt.v_bits == 16:
        pages.v[ids] = v.to(fmt.dtype)
    _launch(k, v, fmt, pages.tensors(), ids)


def _check(k: torch.Tensor, v: torch.Tensor) -> None:
    if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise ValueError("cannot quantize keys/values: some are NaN or Inf; the model produced non-finite values, nothing was sealed")


def _launch(k: torch.Tensor, v: torch.Tensor, fmt: BlockFormat, out: dict, ids: torch.Tensor | None) -> None:
    """The sealing kernel over k, v [N, H, P, D] into out's quantized fields (rows ids[n] when
    ids is given, else n). The inputs are read in place when K and V share strides with unit
    channel stride (a block of the cache's tail is such a view). A rotated program holds all
    of a block's planes at once, in fp64, on a warp per 512 of its values (4 to 16 warps)."""
    N = k.shape[0]
    if N == 0 or (fmt.k_bits == 16 and fmt.v_bits == 16):
        return
    if k.stride() == v.stride() and k.stride(-1) == 1:
        kq, vq = k, v
    else:
        kq, vq = k.contiguous(), v.contiguous()
    u8, f = placeholders(k.device, fmt.dtype)  # for a 16-bit side, shaped for its strides
    KC, KS, KZ = (out["k_codes"], out["k_scale"], out["k_zero"]) if fmt.k_bits != 16 else (u8.view(1, 1, 1), f.view(1, 1, 1), f.view(1, 1, 1))
    VC, VS, VZ = (out["v_codes"], out["v_scale"], out["v_zero"]) if fmt.v_bits != 16 else (u8.view(1, 1, 1), f.view(1, 1, 1), f.view(1, 1, 1))
    _quantize_kernel[(N * fmt.num_kv_heads,)](
        kq, vq, KC, KS, KZ, VC, VS, VZ, ids if ids is not None else u8,
        kq.stride(0), kq.stride(1), kq.stride(2),
        KC.stride(0), KC.stride(1), KC.stride(2),
        KS.stride(0), KS.stride(1), KS.stride(2),
        VC.stride(0), VC.stride(1), VC.stride(2),
        VS.stride(0), VS.stride(1), VS.stride(2),
        H=fmt.num_kv_heads, P=fmt.block_size, D=fmt.head_dim, GS=fmt.group_size, KG=fmt.k_span, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits,
        SDT=_SDT[fmt.dtype], BITS16=fmt.dtype != torch.float32, HAS_IDS=ids is not None,
        ROT=fmt.rotate, SCALE=hadamard_scale(fmt.head_dim) if fmt.rotate else 1.0,
        num_warps=min(16, max(4, fmt.block_size * fmt.head_dim // 512)) if fmt.rotate else 4, **TRITON_OPTIONS,
    )
