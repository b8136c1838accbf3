"""Codes to floats in Triton, shared by the decode, prefill and sealing kernels: sub-tiles of
packed int8/int4/int2 code words as exact fp32 or fp16 codes, the biased (1024 + c) and tiny
(c * 2^-24) fp16 forms the tensor-core dots take, and their inline-PTX blocks on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Layout: a byte of int4 codes holds channels 2i (low nibble) and 2i+1; of int2 codes,
# channels 4i..4i+3. Rather than interleaving unpacked codes back into [P, D] (a layout
# change that miscompiled as a tensor-core operand on triton 3.6), the kernel works on
# PER = 8/bits "sub-tiles": sub-tile r holds channels r, r+PER, r+2*PER... The query is
# loaded split the same way for K, and the output is accumulated per sub-tile for V and
# written back to its strided channels at the end. 8- and 16-bit sides use PER = 1.
#
# Codes become floats without int->float conversion instructions (a quarter-rate unit on
# recent GPUs): OR-ing a code c < 2^10 into the bits of
# fp16 1024.0 gives the fp16 1024 + c exactly; into fp32 2^23, the fp32 2^23 + c. The fp16
# form goes straight into tensor-core dots, its 1024 offset folded into the zero-point term.
# The "tiny" form takes no OR at all: a code c < 2^10 as the bits of an fp16 is the subnormal
# c * 2^-24, exact, and the tensor cores multiply subnormal fp16 operands exactly, so a dot
# against tiny codes is the dot against the codes times 2^-24 (2^-20 for the odd nibbles of
# int4, which stay in place: c * 16 * 2^-24), taken out once after the page's dots (K) or at
# the end of the loop (V), where the exact form pays an f16x2 subtract a pair of codes.

# Forms of the fp16 codes (codes_f16n): exact c, biased 1024 + c, tiny c * 2^-24.
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
def f32_codes(x, r: tl.constexpr, BITS: tl.constexpr):
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
    (what the tiny nibble blocks give: 16 * c, left in place), exact (tiny_unit)."""
    return _code_bits(x, r, BITS).to(tl.float16, bitcast=True)


@triton.constexpr_function
def tiny_unit(r, bits, tiny=True):
    """What a tiny code of sub-tile r stands for: 2^-24 a unit, 2^-20 for int4's odd nibbles
    (1 where tiny is False: other forms are in units of 1)."""
    if not tiny:
        return 1.0
    return 2.0 ** -20 if bits == 4 and r % 2 == 1 else 2.0 ** -24


@triton.jit
def f16_1024(x, r: tl.constexpr, BITS: tl.constexpr):
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
# blocks only mask: c * 2^-24 and 16c * 2^-24 (tiny_unit). One sub-tile a block: Triton 3.8 moves a
# several-result block's extra results through shared memory (docs/kernels.md).
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
def codes_f16n(x, r: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, FORM: tl.constexpr):
    """Sub-tile r of code words x as fp16 in FORM: EXACT codes, BIASED as _f16_biased gives
    them, TINY as _f16_tiny; on the GPU (ASM) one inline-PTX block on int16 words of int4
    (_asm_nibbles) or int8 (_asm_bytes) codes."""
    if ASM and BITS == 8 and x.dtype == tl.int16:
        c = tl.inline_asm_elementwise(_asm_bytes(r, 1, FORM), "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    elif ASM and BITS == 4 and x.dtype == tl.int16:
        c = tl.inline_asm_elementwise(_asm_nibbles(r, 1, FORM), "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    elif FORM == BIASED:
        c = _f16_biased(x, r, BITS)
    elif FORM == TINY:
        c = _f16_tiny(x, r, BITS)
    else:
        c = f16_codes(x, r, BITS, ASM)
    return c


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
def int2_f16(x, shift, FORM: tl.constexpr, ASM: tl.constexpr):
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
def int2_words_f16(x, r: tl.constexpr, FORM: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r of int2 codes loaded as int16 words x [A, B, n] (a word's low byte is
    column 2i of the byte tile, its high byte column 2i + 1) as fp16 [A, B, 2n] in FORM:
    the columns of the byte tile's sub-tile r. (On byte tiles, uint8, the sm_90 side loop ran
    ~2,450 instructions a page, with shared-memory round trips.)"""
    lo = int2_f16(x, 2 * r, FORM, ASM)
    hi = int2_f16(x, 2 * r + 8, FORM, ASM)
    return tl.reshape(tl.join(lo, hi), (x.shape[0], x.shape[1], 2 * x.shape[2]))


@triton.constexpr_function
def v_words2(v_bits, dg):
    """Whether the side loop's folded V takes int2 codes as int16 words (int2_rows_f16): a
    group's columns a sub-tile (dg) come in pairs."""
    return v_bits == 2 and dg % 2 == 0


@triton.jit
def int2_rows_f16(x, r: tl.constexpr, FORM: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r of int2 codes from int16 words x [A, 2n, B] whose rows i and n + i hold the
    same word (loaded twice): row i takes its low byte's code, row n + i its high byte's, as
    fp16 in FORM. Elementwise, where a join along rows went through shared memory (in the dot
    operand's layout a thread holds rows i and i + 8 of each 16). On triton 3.6 the converted
    codes still take one shared-memory round trip a sub-tile to reach that layout."""
    n: tl.constexpr = x.shape[1] // 2
    return int2_f16(x, (2 * r + 8 * (tl.arange(0, 2 * n) // n))[None, :, None], FORM, ASM)


@triton.jit
def f16_codes(x, r: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Sub-tile r as fp16 codes, exact: by inline PTX on int16 words, else 1024 + c - 1024."""
    if ASM and x.dtype == tl.int16:
        return _asm16(x, r, BITS, tl.float16)
    return (f16_1024(x, r, BITS) - 1024.0).to(tl.float16)


@triton.jit
def codes16(x, r: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr):
    """Sub-tile r as DT (fp16, or bf16 for codes < 128) codes, exact."""
    if DT == tl.float16:
        return f16_codes(x, r, BITS, ASM)
    elif ASM and x.dtype == tl.int16 and BITS == 4:
        return _asm16(x, r, BITS, tl.bfloat16)
    else:
        return (_code(x, r, BITS).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0


@triton.jit
def pick_subtile(x0, x1, x2, x3, r: tl.constexpr):
    if r == 0:
        return x0
    elif r == 1:
        return x1
    elif r == 2:
        return x2
    else:
        return x3


