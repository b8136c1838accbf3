"""The Hadamard rotation (`quant.hadamard`) in Triton, for the kernels that rotate: the fp16
tensor-core form of a product with its signs, and butterflies.

A product with H = signs / sqrt(D) runs on fp16 tensor cores at fp32's accuracy: the values,
scaled by a power of two into fp16's range, are split into fp16 parts (a head, then what it
left, ...), each part is multiplied by the exact +-1 signs with fp32 sums, and 1/sqrt(D) and
the power of two are taken back out at the end. The gather rotates its pages back this way.

The butterflies (`fwht`, `hadamard_planes`) rotate values held as a kernel's channel sub-tiles
without any product: the decode kernel rotates its queries and its output with them in fp32, and
the sealing kernel rotates K and V in fp64 before quantizing them. Tests hold each kernel
that rotates to the torch reference and an fp64 oracle (tests/ops/).
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def pow2_into_f16(amax):
    """2^k (fp32) with amax * 2^k in [2^14, 2^15): values up to amax, so scaled, are fp16
    normals down to 2^-28 of amax, and their fp16 tails lose at most 2^-39 of it to
    subnormals. k is held to [-100, 100] (amax 0: the values are zeros). Elementwise."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.minimum(tl.maximum(14 - e, -100), 100)
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def dot_signs(x, signs, acc, PARTS: tl.constexpr = 2):
    """acc + x @ signs: x fp32 [M, K] already scaled into fp16's range (`pow2_into_f16`),
    signs fp16 +-1 [K, N], as PARTS (2 or 3) fp16 parts of x on tensor cores with fp32 sums.
    Two parts hold 22 bits of each value (a 16-bit value whole), three fp32's 24."""
    head = x.to(tl.float16)
    rest = x - head.to(tl.float32)
    tail = rest.to(tl.float16)
    low = tail
    if PARTS == 3:
        low = (rest - tail.to(tl.float32)).to(tl.float16)
    # (the parts formed before the dots: formed between them, the gather's rotated program took
    # 16 more instructions and 8 more barriers, sm_90)
    acc = tl.dot(head, signs, acc)
    acc = tl.dot(tail, signs, acc)
    if PARTS == 3:
        acc = tl.dot(low, signs, acc)
    return acc


@triton.jit
def fwht(x, N: tl.constexpr):
    """x [M, N] (fp32 or fp64) times the Sylvester Hadamard matrix of N (a power of two) with its
    +-1 entries (unnormalized) along the last axis, as log2(N) butterfly stages in x's dtype:
    stage s = 0, 1, ... pairs the entries whose indices differ in bit s into (a + b, a - b)."""
    M: tl.constexpr = x.shape[0]
    for s in tl.static_range(16):
        if (1 << s) < N:
            a, b = tl.split(tl.permute(tl.reshape(x, (M, N // (2 << s), 2, 1 << s)), (0, 1, 3, 2)))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, N))
    return x


@triton.jit
def hadamard_planes(x0, x1, x2, x3, PER: tl.constexpr, DS: tl.constexpr, scale):
    """The PER sub-tiles x_r [M, DS] (channel PER * i + r) of vectors x [M, PER * DS] -> those
    of x @ H, H the normalized Hadamard matrix of PER * DS (its entries' magnitude `scale`).
    H's entry (PER * i + r, PER * j + t) is the product of H_PER's (r, t) and H_DS's (i, j) signs
    (Sylvester's matrices: the popcount of a bitwise AND splits over the index's low and high
    bits), so the sub-tiles mix by H_PER first and each is then transformed along DS: the
    stages run over the channel's bits from the lowest, `quant.rotate_to_seal`'s order."""
    if PER == 2:
        x0, x1 = x0 + x1, x0 - x1
    if PER == 4:
        s0 = x0 + x1
        d0 = x0 - x1
        s1 = x2 + x3
        d1 = x2 - x3
        x0, x1, x2, x3 = s0 + s1, d0 + d1, s0 - s1, d0 - d1
    x0 = fwht(x0, DS) * scale
    if PER > 1:
        x1 = fwht(x1, DS) * scale
    if PER > 2:
        x2 = fwht(x2, DS) * scale
        x3 = fwht(x3, DS) * scale
    return x0, x1, x2, x3
