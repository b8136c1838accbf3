"""Triton building blocks of the decode and prefill kernels over quantized pages: codes to
floats, K scores of a page (dequantized in registers), V sub-tiles of a page, unquantized
blocks (sinks, tail), the online-softmax step, the PV accumulators, the query loads and the
final stores. Both kernels (triton.py, prefill.py) inline them; none launches on its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..rotation import fwht, hadamard_planes

NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


# Layout: a byte of int4 codes holds channels 2i (low nibble) and 2i+1; of int2 codes,
# channels 4i..4i+3. Rather than interleaving unpacked codes back into [P, D] (a layout
# change that miscompiled as a tensor-core operand on triton 3.6), the kernel works on
# PER = 8/bits "sub-tiles": sub-tile r holds channels r, r+PER, r+2*PER... The query is
# loaded split the same way for K, and the output is accumulated per sub-tile for V and
# written back to its strided channels at the end. 8- and 16-bit sides use PER = 1.
#
# Codes become floats without int->float conversion instructions (a quarter-rate unit on
# recent GPUs, and the bound of the first kernels): OR-ing a code c < 2^10 into the bits of
# fp16 1024.0 gives the fp16 1024 + c exactly; into fp32 2^23, the fp32 2^23 + c. The fp16
# form goes straight into tensor-core dots, its 1024 offset folded into the zero-point term.
# The "tiny" form takes no OR at all: a code c < 2^10 as the bits of an fp16 is the subnormal
# c * 2^-24, exact, and the tensor cores multiply subnormal fp16 operands exactly, so a dot
# against tiny codes is the dot against the codes times 2^-24 (2^-20 for the odd nibbles of
# int4, which stay in place: c * 16 * 2^-24), taken out once after the page's dots (K) or at
# the end of the loop (V), where the exact form pays an f16x2 subtract a pair of codes.

# Forms of the fp16 codes (_codes_f16n): exact c, biased 1024 + c, tiny c * 2^-24.
EXACT = tl.constexpr(0)
BIASED = tl.constexpr(1)
TINY = tl.constexpr(2)


@triton.jit
def _code(x, r: tl.constexpr, BITS: tl.constexpr):
    """Codes of sub-tile r of a tile of code words (uint8, or int16 for 8 and 4 bits)."""
    if BITS == 8 and x.dtype == tl.uint8:
        return x
    return (x >> (r * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _f32(x, r: tl.constexpr, BITS: tl.constexpr):
    """Sub-tile r as fp32 codes, exact: (2^23 + c) - 2^23."""
    return (_code(x, r, BITS).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _code_bits(x, r: tl.constexpr, BITS: tl.constexpr):
    """Sub-tile r's codes c as int16 bits, 16c for the odd nibbles of int4 (where the nibble
    blocks leave them, unshifted): the tiny and biased forms' bits below the fp16 exponent."""
    c = _code(x, r, BITS).to(tl.int16)
    if BITS == 4 and r % 2 == 1:
        c = c << 4
    return c


@triton.jit
def _f16_tiny(x, r: tl.constexpr, BITS: tl.constexpr):
    """Sub-tile r as the fp16 subnormal c * 2^-24, or c * 2^-20 for the odd nibbles of int4
    (what the tiny nibble blocks give: 16 * c, left in place), exact (_tiny_unit)."""
    return _code_bits(x, r, BITS).to(tl.float16, bitcast=True)


@triton.constexpr_function
def _tiny_unit(r, bits, tiny=True):
    """What a tiny code of sub-tile r stands for: 2^-24 a unit, 2^-20 for int4's odd nibbles
    (1 where tiny is False: other forms are in units of 1)."""
    if not tiny:
        return 1.0
    return 2.0 ** -20 if bits == 4 and r % 2 == 1 else 2.0 ** -24


@triton.jit
def _f16_1024(x, r: tl.constexpr, BITS: tl.constexpr):
    """Sub-tile r as fp16 1024 + code, exact (codes < 2^10)."""
    return (_code(x, r, BITS).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)


# ASM (GPU): two int16 code words per 32-bit register -> two fp16 codes of sub-tile r, exact:
# int4 shifts nibble r of both words into place and ORs in fp16 1024 (one LOP3), then one
# f16x2 subtract of 1024; bf16 int4 codes the same way around bf16 128 (0x4300), then an FMA
# (128 + c) * 1 - 128: PTX's bf16x2 subtract needs sm_90, its FMA sm_80 (RTX 30 and 40 cards).
# int8 takes the exact one-sub-tile _asm_bytes block (below).
@triton.constexpr_function
def _asm_int4(r, bf16):
    shift = f"shr.b32 t, $1, {4 * r}; " if r else "mov.b32 t, $1; "
    if bf16:
        magic, sub = "0x43004300", "mov.b32 u, 0x3F803F80; mov.b32 k, 0xC300C300; fma.rn.bf16x2 $0, t, u, k; "
    else:
        magic, sub = "0x64006400", "mov.b32 k, 0x64006400; sub.f16x2 $0, t, k; "
    return "{ .reg .b32 t, k, u; " + shift + f"lop3.b32 t, t, 0x000F000F, {magic}, 0xea; " + sub + "}"


@triton.jit
def _asm16(x, r: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """Sub-tile r of int16 code words as DT codes, exact, GPU only: fp16 for 4 or 8 bits,
    bf16 for 4 bits (its 7 mantissa bits hold 128 + c for c < 128 only)."""
    if BITS == 8:
        asm: tl.constexpr = _asm_bytes(r, 1, 0)
    else:
        asm: tl.constexpr = _asm_int4(r, DT == tl.bfloat16)
    if DT == tl.bfloat16:
        out = tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    return out


# Nibbles (GPU): two int16 words of int4 codes per 32-bit register -> fp16 pairs of sub-tiles
# first .. first + n - 1 in one inline-PTX block (form: 0 exact, 1 biased, 2 tiny): nibbles 0
# and 2 (the latter after one shift by 8) OR-ed into fp16 1024 give 1024 + c, nibbles 1 and 3
# give 1024 + 16c. Biased blocks leave them so (the caller folds 1/16 and the 1024 offset into
# its other operand); exact ones turn them into c (a subtract, or an FMA by 1/16 and -64). Tiny
# blocks only mask: c * 2^-24 and 16c * 2^-24 (_tiny_unit). Several sub-tiles a block share the
# shift; fewer keep fewer converted tiles live at once (registers).
@triton.constexpr_function
def _asm_nibbles(first, n, form):
    src, body = f"${n}", ""
    for i, r in enumerate(range(first, first + n)):
        if r == 2 or (r == 3 and first == 3):
            body += f"shr.b32 t, {src}, 8; "
        mask = "0x00F000F0" if r % 2 else "0x000F000F"
        word = "t" if r >= 2 else src
        if form == 2:
            body += f"and.b32 ${i}, {word}, {mask}; "
            continue
        body += f"lop3.b32 ${i}, {word}, {mask}, 0x64006400, 0xea; "
        if form == 0:
            body += f"fma.rn.f16x2 ${i}, ${i}, u, w; " if r % 2 else f"sub.f16x2 ${i}, ${i}, k; "
    consts = "mov.b32 k, 0x64006400; mov.b32 u, 0x2C002C00; mov.b32 w, 0xD400D400; " if form == 0 else ""
    return "{ .reg .b32 t, k, u, w; " + consts + body + "}"


# Bytes (GPU): two int16 words of int8 codes per 32-bit register -> the fp16 pairs of sub-tiles
# first .. first + n - 1 (both, or one) in one inline-PTX block (form as _asm_nibbles): a PRMT
# puts byte r of each word next to a 0x64 byte (fp16 1024 + c); exact blocks then subtract 1024
# (an f16x2 subtract a pair). Tiny blocks put a zero byte there instead (c * 2^-24).
@triton.constexpr_function
def _asm_bytes(first, n, form):
    body = ""
    for i, r in enumerate(range(first, first + n)):
        body += f"prmt.b32 ${i}, ${n}, k, {'0x4341' if r else '0x4240'}; " + (f"sub.f16x2 ${i}, ${i}, m; " if form == 0 else "")
    high = "0x00000000" if form == 2 else "0x64646464"
    return "{ .reg .b32 k, m; mov.b32 k, " + high + "; mov.b32 m, 0x64006400; " + body + "}"


@triton.jit
def _f16_biased(x, r: tl.constexpr, BITS: tl.constexpr):
    """Sub-tile r as fp16 1024 + code, or 1024 + 16 * code for the odd nibbles of int4 (what
    the biased nibble blocks give: the caller divides its other operand by 16 there), exact."""
    return (_code_bits(x, r, BITS) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _codes_f16n(x, first: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, FORM: tl.constexpr):
    """Sub-tiles first .. first + n - 1 of code words x as fp16 (a 4-tuple, the rest repeating
    the first) in FORM: EXACT codes, BIASED as _f16_biased gives them, TINY as _f16_tiny. n
    (_codes_per_block) is ASM (1, 2 or 4) for int4 in int16 words on the GPU (one _asm_nibbles
    block), 1 (ASM 1) or 2 for int8 there (one _asm_bytes block), else 1."""
    if ASM and BITS == 8 and x.dtype == tl.int16:
        if ASM == 1:
            c0 = tl.inline_asm_elementwise(_asm_bytes(first, 1, FORM), "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
            c1 = c0
        else:  # (first is 0)
            c0, c1 = tl.inline_asm_elementwise(_asm_bytes(0, 2, FORM), "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True,
                                               pack=2)
        c2 = c0
        c3 = c1
    elif ASM and BITS == 4 and x.dtype == tl.int16:
        asm: tl.constexpr = _asm_nibbles(first, ASM, FORM)
        if ASM == 1:
            c0 = tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
            c1 = c0
            c2 = c0
            c3 = c0
        elif ASM == 2:
            c0, c1 = tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
            c2 = c0
            c3 = c1
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [x], dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    elif FORM == BIASED:
        c0 = _f16_biased(x, first, BITS)
        c1 = c0
        c2 = c0
        c3 = c0
    elif FORM == TINY:
        c0 = _f16_tiny(x, first, BITS)
        c1 = c0
        c2 = c0
        c3 = c0
    else:
        c0 = _f16(x, first, BITS, ASM)
        c1 = c0
        c2 = c0
        c3 = c0
    return c0, c1, c2, c3


# int2 codes in int16 words (GPU): two words per 32-bit register, each shifted by the same
# amount (at most 14, so no bit of the high word reaches the low word's code), masked to the
# code's two bits in each half; BIASED ORs fp16 1024 in, EXACT then subtracts it (an f16x2
# subtract a pair), TINY leaves the subnormal c * 2^-24. The shift is an operand ($2, equal in
# both halves): the rows of one tile may take different bytes of their words.
@triton.constexpr_function
def _asm_int2(form):
    body = "and.b32 s, $2, 0xF; shr.b32 t, $1, s; "
    if form == 2:
        return "{ .reg .b32 t, s; " + body + "and.b32 $0, t, 0x00030003; }"
    body += "lop3.b32 $0, t, 0x00030003, 0x64006400, 0xea; "
    if form == 0:
        body += "mov.b32 k, 0x64006400; sub.f16x2 $0, $0, k; "
    return "{ .reg .b32 t, s, k; " + body + "}"


@triton.jit
def _int2_f16(x, shift, FORM: tl.constexpr, ASM: tl.constexpr):
    """The int2 codes at bits shift, shift + 1 of int16 words x (shift: int16, broadcast
    against x, the same for a word's pair in a register) as fp16 in FORM (EXACT, BIASED
    1024 + c, TINY c * 2^-24), exact: inline PTX on the GPU (ASM), else integer ops."""
    if ASM:
        sh = (tl.zeros(x.shape, tl.int16) + shift).to(tl.int16)
        return tl.inline_asm_elementwise(_asm_int2(FORM), "=r,r,r", [x, sh], dtype=tl.float16, is_pure=True, pack=2)
    c = ((x >> shift) & 3).to(tl.int16)
    if FORM == TINY:
        return c.to(tl.float16, bitcast=True)
    if FORM == BIASED:
        return (c | 0x6400).to(tl.float16, bitcast=True)
    return c.to(tl.float16)


@triton.jit
def _int2_words_f16(x, r: tl.constexpr, FORM: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r of int2 codes loaded as int16 words x [A, B, n] (a word's low byte is
    column 2i of the byte tile, its high byte column 2i + 1) as fp16 [A, B, 2n] in FORM:
    the columns of the byte tile's sub-tile r. (On byte tiles, uint8, the sm_90 side loop ran
    ~2,450 instructions a page, with shared-memory round trips: notes v41.)"""
    lo = _int2_f16(x, 2 * r, FORM, ASM)
    hi = _int2_f16(x, 2 * r + 8, FORM, ASM)
    return tl.reshape(tl.join(lo, hi), (x.shape[0], x.shape[1], 2 * x.shape[2]))


@triton.constexpr_function
def _v_words2(v_bits, dg):
    """Whether the side loop's folded V takes int2 codes as int16 words (_int2_rows_f16): a
    group's columns a sub-tile (dg) come in pairs."""
    return v_bits == 2 and dg % 2 == 0


@triton.jit
def _int2_rows_f16(x, r: tl.constexpr, FORM: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r of int2 codes from int16 words x [A, 2n, B] whose rows i and n + i hold the
    same word (loaded twice): row i takes its low byte's code, row n + i its high byte's, as
    fp16 in FORM. Elementwise, where a join along rows went through shared memory (in the dot
    operand's layout a thread holds rows i and i + 8 of each 16). On triton 3.6 the converted
    codes still take one shared-memory round trip a sub-tile to reach that layout (notes v41)."""
    n: tl.constexpr = x.shape[1] // 2
    return _int2_f16(x, (2 * r + 8 * (tl.arange(0, 2 * n) // n))[None, :, None], FORM, ASM)


@triton.constexpr_function
def _codes_per_block(bits, asm, dtype):
    """Sub-tiles one _codes_f16n call converts: an inline-PTX block's on int16 words on the GPU
    (int4: asm of them; int8: one with asm 1, else both), else 1."""
    if not asm or dtype != tl.int16:
        return 1
    return asm if bits == 4 else min(asm, 2) if bits == 8 else 1


@triton.jit
def _f16(x, r: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r as fp16 codes, exact: by inline PTX on int16 words, else 1024 + c - 1024."""
    if ASM and x.dtype == tl.int16:
        return _asm16(x, r, BITS, tl.float16)
    return (_f16_1024(x, r, BITS) - 1024.0).to(tl.float16)


@triton.jit
def _codes16(x, r: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr):
    """Sub-tile r as DT (fp16, or bf16 for codes < 128) codes, exact."""
    if DT == tl.float16:
        return _f16(x, r, BITS, ASM)
    elif ASM and x.dtype == tl.int16 and BITS == 4:
        return _asm16(x, r, BITS, tl.bfloat16)
    else:
        return (_code(x, r, BITS).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0


@triton.jit
def _pick(x0, x1, x2, x3, r: tl.constexpr):
    if r == 0:
        return x0
    elif r == 1:
        return x1
    elif r == 2:
        return x2
    else:
        return x3


@triton.jit
def _step_ids(trow, j, j1, PAGES: tl.constexpr):
    """Block ids of the PAGES pages of the loop step at logical block j of a split whose
    sealed blocks end at j1: ids at or past j1 repeat a valid one (the table has at least one
    column), whose scores are masked. No load mask: the interpreter takes no scalar bool."""
    last = j1 - 1
    i0 = tl.load(trow + tl.maximum(tl.minimum(j, last), 0))
    i1 = i0
    i2 = i0
    i3 = i0
    if PAGES > 1:
        i1 = tl.load(trow + tl.maximum(tl.minimum(j + 1, last), 0))
    if PAGES > 2:
        i2 = tl.load(trow + tl.maximum(tl.minimum(j + 2, last), 0))
        i3 = tl.load(trow + tl.maximum(tl.minimum(j + 3, last), 0))
    return i0, i1, i2, i3


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
def _softmax_step(s, m_i, l_i):
    """Online softmax, base 2, over one block of scores s [..., rows, P] (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, -1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - tl.expand_dims(m_new, -1))
    return m_new, l_i * alpha + tl.sum(p, -1), p, alpha


@triton.jit
def _acc(a0, a1, a2, a3, alpha, p, v0, v1, v2, v3, PV: tl.constexpr, PREC: tl.constexpr):
    """Rescale the PV sub-tile accumulators [..., rows, DV] by alpha [..., rows] and add p @ v_r
    (v None: rescale only)."""
    c = tl.expand_dims(alpha, -1)
    a0 = a0 * c
    if PV > 1:
        a1 = a1 * c
    if PV > 2:
        a2 = a2 * c
        a3 = a3 * c
    if v0 is not None:
        a0 += tl.dot(p, v0, input_precision=PREC)
        if PV > 1:
            a1 += tl.dot(p, v1, input_precision=PREC)
        if PV > 2:
            a2 += tl.dot(p, v2, input_precision=PREC)
            a3 += tl.dot(p, v3, input_precision=PREC)
    return a0, a1, a2, a3


@triton.jit
def _load_q(Q, base, offs_g, gmask, r: tl.constexpr, PER: tl.constexpr, DS: tl.constexpr, stride_qh, scale):
    offs = r + PER * tl.arange(0, DS)
    return tl.load(Q + base + offs_g[:, None] * stride_qh + offs[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * scale


@triton.jit
def _store(O, off, a0, a1, a2, a3, inv, om, PV: tl.constexpr):
    tl.store(O + off, (a0 * inv).to(O.dtype.element_ty), mask=om)
    if PV > 1:
        tl.store(O + off + 1, (a1 * inv).to(O.dtype.element_ty), mask=om)
    if PV > 2:
        tl.store(O + off + 2, (a2 * inv).to(O.dtype.element_ty), mask=om)
        tl.store(O + off + 3, (a3 * inv).to(O.dtype.element_ty), mask=om)


@triton.jit
def _k_scales(KS, KZ, ksw, kzw, chan, mask, r: tl.constexpr, W16: tl.constexpr):
    """K's scales and zeros of sub-tile r: split from the words ksw/kzw loaded once a page
    (W16: 16-bit values), else loaded at pool offsets chan + r (chan: channel PK*i of the
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
def _page_scores(KD, KC, KS, KZ, bh, n: tl.constexpr, left, qp, qp0, qp1, qp2, qp3, offs_p, offs_d, offs_k,
                 D: tl.constexpr, P: tl.constexpr, DK: tl.constexpr, PK: tl.constexpr, K_BITS: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr):
    """Base-2 scores [G_PAD, T] of the n-th page of a loop step at its tokens offs_p [T] (pool
    row bh = block * H + head, pages of P tokens; its loads are skipped when n >= left, the
    pages left in the split). Quantized K:
    K16 == 3 dequantizes sub-tile r in KDT (fp16, or bf16 for codes < 128 with bf16 scales:
    codes * s + z, one FMA per two values) and dots it with the fixed KDT query qp_r; 0-2 fold the per-channel scales into the query
    instead, (q*s)_r . codes_r (0: fp32 codes through DOT; 1: fp16 1024 + code, subtracting
    1024 * the sum of the rounded q*s the dots saw; 2: fp16 codes), then add q . z. K16 == 4
    dequantizes in fp32 and rounds once into DOT (the prefill kernel's choice: its query block
    shares each page's dequantization, and the 16-bit dequantization rounds twice where the
    multiply and add are not fused, as under the interpreter)."""
    pm = (offs_p[:, None] * 0 + n) < left  # tensor masks: the interpreter takes no scalar bool
    s = tl.zeros((qp.shape[0], offs_p.shape[0]), tl.float32)
    if K_BITS == 16:  # (one return at the end: an early return in a branch miscompiled on the GPU)
        k = tl.load(KD + bh * P * D + offs_p[:, None] * D + offs_d[None, :], mask=pm, other=0.0)
        s = tl.dot(qp.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)
    else:
        xk = tl.load(KC + bh * P * DK + offs_p[:, None] * DK + offs_k[None, :], mask=pm, other=0)
        km = (offs_k * 0 + n) < left
        # 16-bit scales and zeros load as words of PK values (channels PK*i .. PK*i + PK - 1):
        # 4- or 8-byte loads the pipeliner prefetches (2-byte loads it left in the loop, where
        # their latency was the kernel's largest stall), split into sub-tiles by shifts
        DT: tl.constexpr = KS.dtype.element_ty
        W16: tl.constexpr = DT.primitive_bitwidth == 16
        ksw = xk  # (unused unless W16)
        kzw = xk
        if W16:
            ksw = _words16(KS, bh * DK + offs_k, km, PK)
            kzw = _words16(KZ, bh * DK + offs_k, km, PK)
        off = tl.zeros((qp.shape[0],), tl.float32)  # sum of the fp16 (q*s) the dots saw (K16 == 1)
        zq = tl.zeros((qp.shape[0],), tl.float32)  # q . z (K16 < 3)
        for r in tl.static_range(PK):
            qr = _pick(qp0, qp1, qp2, qp3, r)
            sr, zr = _k_scales(KS, KZ, ksw, kzw, bh * D + PK * offs_k, km, r, W16)
            if K16 == 3:  # K dequantized in KDT against the fixed KDT query
                s += tl.dot(qr, tl.trans(_codes16(xk, r, K_BITS, ASM, KDT) * sr.to(KDT)[None, :] + zr.to(KDT)[None, :]))
            elif K16 == 4:  # K dequantized in fp32, rounded once into DOT, against the fixed DOT query
                kf = _f32(xk, r, K_BITS) * sr.to(tl.float32)[None, :] + zr.to(tl.float32)[None, :]
                s += tl.dot(qr, tl.trans(kf.to(DOT)), input_precision=PREC)
            else:  # scales folded into the fp32 query
                qs = qr * sr.to(tl.float32)[None, :]
                zq += tl.sum(qr * zr.to(tl.float32)[None, :], 1)
                if K16 == 1:
                    qs = qs.to(tl.float16)
                    s += tl.dot(qs, tl.trans(_f16_1024(xk, r, K_BITS)))
                    off += tl.sum(qs.to(tl.float32), 1)
                elif K16 == 2:
                    s += tl.dot(qs.to(tl.float16), tl.trans(_f16(xk, r, K_BITS, ASM)))
                else:
                    s += tl.dot(qs.to(DOT), tl.trans(_f32(xk, r, K_BITS).to(DOT)), input_precision=PREC)
        if K16 < 3:
            s += zq[:, None] - 1024.0 * off[:, None]
    return s


@triton.jit
def _dense_scores(kbase, sp, valid, q, offs_p, offs_d, DOT: tl.constexpr, PREC: tl.constexpr):
    """Base-2 scores [rows, P] of q against one unquantized block (a sink page or the tail;
    token stride sp), invalid tokens read as zeros (masked by the caller)."""
    k = tl.load(kbase + offs_p[:, None] * sp + offs_d[None, :], mask=valid[:, None], other=0.0)
    return tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC)


@triton.jit
def _dense_values(vbase, sp, valid, offs_p, offs_v, PV: tl.constexpr, DOT: tl.constexpr):
    """V of one unquantized block as the PV sub-tiles the accumulators take (channels r,
    r + PV, ...)."""
    vptr = vbase + offs_p[:, None] * sp + PV * offs_v[None, :]
    vm = valid[:, None]
    v0 = tl.load(vptr, mask=vm, other=0.0).to(DOT)
    v1 = v0
    v2 = v0
    v3 = v0
    if PV > 1:
        v1 = tl.load(vptr + 1, mask=vm, other=0.0).to(DOT)
    if PV > 2:
        v2 = tl.load(vptr + 2, mask=vm, other=0.0).to(DOT)
        v3 = tl.load(vptr + 3, mask=vm, other=0.0).to(DOT)
    return v0, v1, v2, v3


@triton.jit
def _values_from_codes(xv, vs, vz, p, V_BITS: tl.constexpr, V16: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                       PV: tl.constexpr):
    """V sub-tiles r = 0..PV-1 of code words xv, dequantized against per-column scales vs and
    zeros vz (their dtype VT: 16-bit with V16, one FMA per value; else fp32, rounded once into
    DOT), and p in the dtype the dot takes: (pv, v0..v3). Any shape (2-D or 3-D tiles)."""
    VT: tl.constexpr = vs.dtype
    if V16 and ASM and VT == tl.float16 and V_BITS == 4 and xv.dtype == tl.int16:  # nibble blocks of ASM sub-tiles
        for r in tl.static_range(4):
            if r % ASM == 0:
                c0, c1, c2, c3 = _codes_f16n(xv, r, V_BITS, ASM, EXACT)
            vr = _pick(c0, c1, c2, c3, r % ASM) * vs + vz
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
        v0 = _codes16(xv, 0, V_BITS, ASM, VT) * vs + vz
        v1 = v0
        v2 = v0
        v3 = v0
        if PV > 1:
            v1 = _codes16(xv, 1, V_BITS, ASM, VT) * vs + vz
        if PV > 2:
            v2 = _codes16(xv, 2, V_BITS, ASM, VT) * vs + vz
            v3 = _codes16(xv, 3, V_BITS, ASM, VT) * vs + vz
        pv = p.to(VT)
    else:
        v0 = (_f32(xv, 0, V_BITS) * vs + vz).to(DOT)
        v1 = v0
        v2 = v0
        v3 = v0
        if PV > 1:
            v1 = (_f32(xv, 1, V_BITS) * vs + vz).to(DOT)
        if PV > 2:
            v2 = (_f32(xv, 2, V_BITS) * vs + vz).to(DOT)
            v3 = (_f32(xv, 3, V_BITS) * vs + vz).to(DOT)
        pv = p.to(DOT)
    return pv, v0, v1, v2, v3


@triton.jit
def _page_values(VD, VC, VS, VZ, row, ok, p, offs_v, D: tl.constexpr, DV: tl.constexpr, PV: tl.constexpr, NG: tl.constexpr,
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
        # column i of every sub-tile is in group i // (GS // PV)
        # V16 == 2: bf16 when the scales are bf16 and the codes < 128 (exact), saving their conversion
        VT: tl.constexpr = (tl.bfloat16 if V16 == 2 and V_BITS <= 4 and VS.dtype.element_ty == tl.bfloat16
                            else tl.float16 if V16 else tl.float32)
        T: tl.constexpr = row.shape[0]
        vs = tl.reshape(tl.broadcast_to(_token_groups(VS, row, ok, NG).to(VT)[:, :, None], (T, NG, GS // PV)), (T, DV))
        vz = tl.reshape(tl.broadcast_to(_token_groups(VZ, row, ok, NG).to(VT)[:, :, None], (T, NG, GS // PV)), (T, DV))
        pv, v0, v1, v2, v3 = _values_from_codes(xv, vs, vz, p, V_BITS, V16, DOT, ASM, PV)
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
def _load_queries(Q, QR, base, rows, rmask, stride, scale, D: tl.constexpr, PK: tl.constexpr, DK: tl.constexpr,
                  ROTATE: tl.constexpr, K16: tl.constexpr, KDT: tl.constexpr, DOT: tl.constexpr,
                  ROT_Q: tl.constexpr = False, INV_SQRT_D: tl.constexpr = 1.0, PTX: tl.constexpr = False):
    """The query rows (offsets `rows` * stride from base, masked by rmask) as the kernels use
    them, scaled: q unrotated [rows, D] (sinks, tail), qp [rows, D] and its PK sub-tiles
    qp0..qp3 [rows, DK] for the sealed pages (rotated with ROTATE: read from QR, or with ROT_Q
    rotated here in fp32 from Q's, `hadamard_planes`, INV_SQRT_D the entries' magnitude; PTX:
    compiled for a GPU, see `_opaque`), the sub-tiles in the 16-bit type K is dequantized into
    when K16 >= 3."""
    q = _load_q(Q, base, rows, rmask, 0, 1, D, stride, scale)
    QP = QR if ROTATE and not ROT_Q else Q
    qp = _load_q(QP, base, rows, rmask, 0, 1, D, stride, scale)
    qp0 = _load_q(QP, base, rows, rmask, 0, PK, DK, stride, scale)
    qp1 = qp0
    qp2 = qp0
    qp3 = qp0
    if PK > 1:
        qp1 = _load_q(QP, base, rows, rmask, 1, PK, DK, stride, scale)
    if PK > 2:
        qp2 = _load_q(QP, base, rows, rmask, 2, PK, DK, stride, scale)
        qp3 = _load_q(QP, base, rows, rmask, 3, PK, DK, stride, scale)
    if ROTATE and ROT_Q:
        qp = fwht(qp, D) * INV_SQRT_D
        qp0, qp1, qp2, qp3 = hadamard_planes(qp0, qp1, qp2, qp3, PK, DK, INV_SQRT_D)
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
def _zero_state(M: tl.constexpr, DV: tl.constexpr):
    """Online-softmax state of M rows: running max, sum, and the PV sub-tile accumulators,
    unrotated (a0..a3) and rotated (r0..r3: sealed pages when ROTATE)."""
    z = tl.zeros((M, DV), tl.float32)
    return tl.full((M,), NEG_BIG, tl.float32), tl.zeros((M,), tl.float32), z, z, z, z, z, z, z, z


@triton.jit
def _acc_sealed(a0, a1, a2, a3, r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, PV: tl.constexpr, PREC: tl.constexpr,
                ROTATE: tl.constexpr):
    """Accumulate a sealed page's p @ v: into the rotated accumulators with ROTATE (the
    unrotated ones only rescaled), else into the unrotated ones."""
    if ROTATE:
        a0, a1, a2, a3 = _acc(a0, a1, a2, a3, alpha, pv, None, None, None, None, PV, PREC)
        r0, r1, r2, r3 = _acc(r0, r1, r2, r3, alpha, pv, v0, v1, v2, v3, PV, PREC)
    else:
        a0, a1, a2, a3 = _acc(a0, a1, a2, a3, alpha, pv, v0, v1, v2, v3, PV, PREC)
    return a0, a1, a2, a3, r0, r1, r2, r3


@triton.jit
def _finish(O, OR, LSE, orow, omask, a0, a1, a2, a3, r0, r1, r2, r3, m_i, l_i, offs_v, D: tl.constexpr, PV: tl.constexpr,
            ROTATE: tl.constexpr, ROT_O: tl.constexpr = False, INV_SQRT_D: tl.constexpr = 1.0):
    """Store the normalized outputs (rows orow of [*, D] O, and with ROTATE the rotated ones to
    OR, or with ROT_O rotated back here and added to O's) and the natural-log LSE (-inf and
    zeros for rows that saw no key)."""
    seen = l_i > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)[:, None]
    o_off = orow[:, None] * D + PV * offs_v[None, :]
    om = omask[:, None]
    if ROTATE and ROT_O:
        r0, r1, r2, r3 = hadamard_planes(r0, r1, r2, r3, PV, D // PV, INV_SQRT_D)
        a0 += r0
        if PV > 1:
            a1 += r1
        if PV > 2:
            a2 += r2
            a3 += r3
    _store(O, o_off, a0, a1, a2, a3, inv, om, PV)
    if ROTATE and not ROT_O:
        _store(OR, o_off, r0, r1, r2, r3, inv, om, PV)
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
def _side_scores(KC, KS, KZ, bh, sub, q30, q31, q32, q33, offs_p, offs_k,
                 D: tl.constexpr, P: tl.constexpr, DK: tl.constexpr, PK: tl.constexpr, K_BITS: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, K16: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr,
                 PS: tl.constexpr = 0, TINY_CODES: tl.constexpr = False):
    """Base-2 scores [W, G_PAD, P] of the quantized pages at pool rows bh [W] (block * H +
    head), or with PS > P of their P-token tiles starting `sub` [W] tokens into pages of PS
    (which share the page's K scales), against the query sub-tiles, transposed and broadcast
    over W (q30..q33 [W, DK, G_PAD]), computed transposed (K·Qᵀ: the page's codes are the dot's first operand, the few
    query rows the second, which the tensor cores pad to 8 columns where a first operand pads
    to 16 rows). K16 == 1 folds K's per-channel scales into the fp32 query, (q*s)_r rounded to
    fp16, and dots it with fp16 1024 + code (int4: 1024 + 16 * code for odd nibbles, against
    q*s/16; about one LOP3 a pair of codes), then adds q . z - 1024 * the sum of the rounded
    q*s the dots saw; with TINY_CODES it dots the rounded q*s (q*s/16) with the tiny codes
    instead (one AND a pair), scales the dots by 2^24 and adds q . z alone; 3 dequantizes K in
    KDT against 16-bit queries; 0 in fp32, rounded once into DOT. The query is held as the dots' [DK, rows] operand so that q*s is formed in a
    layout near it (sm_90, triton 3.6: 2 barriers a page where [rows, DK] took 10, 15
    butterfly shuffles where it took 34; int8 1,315 instructions a page against 1,463)."""
    W: tl.constexpr = q30.shape[0]
    G_PAD: tl.constexpr = q30.shape[2]
    W2: tl.constexpr = K_BITS == 2 and K16 == 1  # int2 codes as int16 words (_int2_words_f16)
    HALF: tl.constexpr = W2 and DK // 2 >= 16  # ... in two dots a sub-tile where each keeps a dot's 16 columns (below)
    st = tl.zeros((W, P, G_PAD), tl.float32)
    corr = tl.zeros((W, DK // 2 if HALF else DK, G_PAD), tl.float32)  # q*z [- 1024 * fp16(q*s)], summed once (K16 == 1)
    rows = _side_rows(bh[:, None, None], sub[:, None, None], offs_p[None, :, None], P, PS)
    if W2:
        xk = tl.load(KC.to(tl.pointer_type(tl.int16)) + rows * (DK // 2) + tl.arange(0, DK // 2)[None, None, :])
    else:
        xk = tl.load(KC + rows * DK + offs_k[None, None, :])
    W16: tl.constexpr = KS.dtype.element_ty.primitive_bitwidth == 16
    # K's scales and zeros, as words of PK 16-bit values (W16) or at channels chan + r: the
    # channels PK*i of each page's head, or with HALF the words' low bytes' 8j (the high
    # bytes' 8j + 4 apart: chan_hi, ksw_hi, kzw_hi)
    step: tl.constexpr = 2 if HALF else 1
    offs_c = tl.arange(0, DK // step)
    chan = bh[:, None] * D + PK * step * offs_c[None, :]
    chan_hi = chan + 4
    idx = bh[:, None] * DK + step * offs_c[None, :]
    ksw = xk
    kzw = xk
    ksw_hi = xk
    kzw_hi = xk
    if W16:
        ksw = _words16(KS, idx, idx >= 0, PK)
        kzw = _words16(KZ, idx, idx >= 0, PK)
        if HALF:
            ksw_hi = _words16(KS, idx + 1, idx >= 0, PK)
            kzw_hi = _words16(KZ, idx + 1, idx >= 0, PK)
    N: tl.constexpr = _codes_per_block(K_BITS, ASM, xk.dtype)
    for r in tl.static_range(PK):
        if HALF:
            # Two dots, the low bytes' codes against the query's even columns and the high
            # bytes' against its odd ones: joined into one operand, the codes made Triton halve
            # both operands' register width (kWidth), which sent the query's through shared
            # memory each sub-tile (sm_90: 1,491 instructions a page and 17 barriers, notes v42)
            lo = _int2_f16(xk, 2 * r, TINY if TINY_CODES else BIASED, ASM)
            hi = _int2_f16(xk, 2 * r + 8, TINY if TINY_CODES else BIASED, ASM)
            ql, qh = tl.split(tl.permute(tl.reshape(_pick(q30, q31, q32, q33, r), (W, DK // 2, 2, G_PAD)), (0, 1, 3, 2)))
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
                c0 = _int2_words_f16(xk, r, TINY if TINY_CODES else BIASED, ASM)
                c1 = c0
                c2 = c0
                c3 = c0
            elif K16 == 1 and r % N == 0:
                c0, c1, c2, c3 = _codes_f16n(xk, r, K_BITS, ASM, TINY if TINY_CODES else BIASED)
            qr = _pick(q30, q31, q32, q33, r)
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
                st += tl.dot(_pick(c0, c1, c2, c3, r % N), qs)
            elif K16 == 3:
                kd = _codes16(xk, r, K_BITS, ASM, KDT) * sr.to(KDT)[:, None, :] + zr.to(KDT)[:, None, :]
                st += tl.dot(kd, qr)
            else:
                kf = _f32(xk, r, K_BITS) * sr.to(tl.float32)[:, None, :] + zr.to(tl.float32)[:, None, :]
                st += tl.dot(kf.to(DOT), qr.to(DOT), input_precision=PREC)
    s = tl.permute(st, (0, 2, 1))
    if K16 == 1 and TINY_CODES:
        s = s * 16777216.0 + tl.sum(corr, 1)[:, :, None]  # tiny codes: units of 2^-24
    elif K16 == 1:
        s += tl.sum(corr, 1)[:, :, None]
    return s


@triton.jit
def _side_values(VC, VS, VZ, bh, sub, p, offs_p, offs_v, P: tl.constexpr, DV: tl.constexpr, PV: tl.constexpr,
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
    vs = tl.reshape(tl.broadcast_to(_token_groups(VS, row, ok, NG).to(VT)[:, :, :, None], (W, P, NG, GS // PV)), (W, P, DV))
    vz = tl.reshape(tl.broadcast_to(_token_groups(VZ, row, ok, NG).to(VT)[:, :, :, None], (W, P, NG, GS // PV)), (W, P, DV))
    return _values_from_codes(xv, vs, vz, p, V_BITS, V16, DOT, ASM, PV)


@triton.jit
def _side_values_folded(VC, VS, VZ, bh, sub, pt, x0, x1, x2, x3, z_acc, alpha, offs_p, P: tl.constexpr, DV: tl.constexpr,
                        PV: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, V_BITS: tl.constexpr, ASM: tl.constexpr,
                        ZDOT: tl.constexpr = False, PS: tl.constexpr = 0, TINY_CODES: tl.constexpr = False):
    """Side by side (pool rows bh [W]; with PS > P their P-token tiles `sub` [W] tokens into
    pages of PS), values transposed with their per-token scales folded into the
    probabilities: for each group g of V's channels, codes_gᵀ [GS/PV, P] (exact fp16 codes, the
    dot's first operand: converted in its registers) @ (p * s_g) [P, rows], the NG groups along
    the batch dimension of the accumulators x_r [W * NG, GS/PV, rows]; sum_t p z_g goes to
    z_acc [W, NG, rows], as a sum over the page's tokens, or with ZDOT as a small dot of the
    fp16 zeros and probabilities (a dot's operand, the zeros' load is then prefetched by the
    pipeliner like the others, where the sum leaves it in the loop; fp16 holds the zeros as it
    holds p * s_g, losing bits only below its normal range, 6.1e-5). All are rescaled by alpha
    [W, rows] first. (Codes biased by 1024 as K's, the bias taken out once from the sums of the
    fp16 p * s_g, saved an instruction a pair but measured no faster on the H200, and int2 with
    rotation left the error budget there: notes v13.) With TINY_CODES the codes are tiny instead
    (one AND or PRMT a pair, no subtract): x_r then holds its sums in units of _tiny_unit(r),
    which _unfold_values takes out."""
    W: tl.constexpr = bh.shape[0]
    R: tl.constexpr = pt.shape[2]
    DG: tl.constexpr = GS // PV  # a group's columns of a sub-tile
    row = _side_rows(bh[:, None], sub[:, None], offs_p[None, :], P, PS)  # [W, P]
    # code words [W * NG, DG, P]: batch entry b is page b // NG's group b % NG (loaded in this
    # shape: a reshape of the loaded tile would keep its conversion out of the dot's registers)
    offs_b = tl.arange(0, W * NG)
    bh_b = tl.reshape(tl.broadcast_to(bh[:, None], (W, NG)), (W * NG,))
    sub_b = tl.reshape(tl.broadcast_to(sub[:, None], (W, NG)), (W * NG,)) if PS > P else sub
    tok = _side_rows(bh_b[:, None, None], sub_b[:, None, None], offs_p[None, None, :], P, PS)  # [W * NG, 1, P]
    W2: tl.constexpr = _v_words2(V_BITS, DG)
    if W2:  # int2 codes as int16 words [W * NG, DG, P], each word in rows i and DG / 2 + i (_int2_rows_f16)
        xv = tl.load(VC.to(tl.pointer_type(tl.int16)) + tok * (DV // 2) + (offs_b % NG)[:, None, None] * (DG // 2)
                     + (tl.arange(0, DG) % (DG // 2))[None, :, None])
    else:
        xv = tl.load(VC + tok * DV + (offs_b % NG)[:, None, None] * DG
                     + tl.arange(0, DG)[None, :, None])
    ok = row >= 0
    sg = _token_groups(VS, row, ok, NG).to(tl.float32)  # [W, P, NG]
    zg = _token_groups(VZ, row, ok, NG).to(tl.float16 if ZDOT else tl.float32)
    pg = tl.permute(pt[:, :, :, None] * sg[:, :, None, :], (0, 3, 1, 2))  # [W, NG, P, rows]
    pg = tl.reshape(pg.to(tl.float16), (W * NG, P, R))
    if ZDOT:
        z_acc = z_acc * alpha[:, None, :] + tl.dot(tl.permute(zg, (0, 2, 1)), pt.to(tl.float16))
    else:
        z_acc = z_acc * alpha[:, None, :] + tl.sum(pt[:, :, None, :] * zg[:, :, :, None], 1)
    c = tl.reshape(tl.broadcast_to(alpha[:, None, None, :], (W, NG, 1, R)), (W * NG, 1, R))
    N: tl.constexpr = _codes_per_block(V_BITS, ASM, xv.dtype)
    for r in tl.static_range(PV):
        if W2:
            cr = _int2_rows_f16(xv, r, TINY if TINY_CODES else EXACT, ASM)
        else:
            if r % N == 0:
                c0, c1, c2, c3 = _codes_f16n(xv, r, V_BITS, ASM, TINY if TINY_CODES else EXACT)
            cr = _pick(c0, c1, c2, c3, r % N)
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
def _unfold_values(x, z_acc, NG: tl.constexpr, UNIT: tl.constexpr = 1.0, HALVES: tl.constexpr = False):
    """[W, rows, DV] from _side_values_folded's x_r [W * NG, GS/PV, rows] (sums in units of
    UNIT: _tiny_unit(r) for tiny codes) and z_acc [W, NG, rows]. HALVES: x's rows i and
    GS/PV/2 + i are a group's bytes 2i and 2i + 1 (int2 words, _int2_rows_f16)."""
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
def _fold(x, c):
    """sum over the side-by-side pages of x [W, G_PAD, DV], each scaled by c [W, G_PAD]."""
    return tl.sum(x * c[:, :, None], 0)
