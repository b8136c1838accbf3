"""The quantized block format, as a torch reference: pack/unpack, quantize/dequantize.

Every backend shares this contract (../shared/DESIGN.md, "The quantized block format"):

- K, per channel within a block: for each block, KV head and channel, one scale and one
  zero-point over each span of `k_span` tokens (by default the block's `P`: one span), so a
  block holds P / k_span scale rows. Scores fold them into the query:
  q.k = (q*s).k_int + q.z, a span at a time.
- V, per token in groups of `group_size` channels: one scale and zero-point per token and group.
- Codes are unsigned and asymmetric (min/max), packed little-end-first along head_dim:
  int8 one per byte, int4 two per byte (low nibble first), int2 four per byte.
- Scales and zero-points are stored in the cache's dtype (the model's K/V dtype unless the
  config says otherwise). The zero-point is rounded *down* and the scale *up* to that dtype
  before the codes are computed against them, so the stored range always covers the block
  and every value reconstructs within half a (stored) step. A constant range gives scale 0
  and exact reconstruction; NaN/Inf input raises instead of poisoning a block.
- Optional rotation: x @ H with H the normalized Hadamard matrix (H @ H = I), applied by the
  cache before quantizing (`rotate_to_seal`: the same bits on every device and backend) and
  undone after dequantizing (or folded into the query).

Shapes: K block data [..., P, D] -> codes [..., P, D*bits/8] uint8, scale/zero [..., P/k_span, D];
V block data [..., P, D] -> codes [..., P, D*bits/8] uint8, scale/zero [..., P, D/group].
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

CODES_PER_BYTE = {8: 1, 4: 2, 2: 4}


@dataclass(frozen=True)
class BlockFormat:
    """Storage format of one layer's pages."""

    k_bits: int
    v_bits: int
    block_size: int
    group_size: int
    head_dim: int
    num_kv_heads: int
    dtype: torch.dtype  # unquantized data and scales
    rotate: bool = False
    k_span: int = 0  # tokens a K scale row covers (0: the block)

    def __post_init__(self) -> None:
        if not self.k_span:
            object.__setattr__(self, "k_span", self.block_size)

    @property
    def k_groups(self) -> int:
        """K scale rows a block holds per KV head (block_size / k_span)."""
        return self.block_size // self.k_span

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def code_bytes_per_token(self) -> int:
        """Packed code bytes per token per KV head, K and V together (0 for 16-bit)."""
        k = 0 if self.k_bits == 16 else self.head_dim * self.k_bits // 8
        v = 0 if self.v_bits == 16 else self.head_dim * self.v_bits // 8
        return k + v

    def block_bytes(self) -> dict[str, int]:
        """Bytes of one block over all KV heads, split into codes, scales and dense data."""
        P, D, H, e = self.block_size, self.head_dim, self.num_kv_heads, self.elem_bytes
        out = {"codes": 0, "scales": 0, "dense": 0}
        if self.k_bits == 16:
            out["dense"] += H * P * D * e
        else:
            out["codes"] += H * P * D * self.k_bits // 8
            out["scales"] += H * self.k_groups * 2 * D * e
        if self.v_bits == 16:
            out["dense"] += H * P * D * e
        else:
            out["codes"] += H * P * D * self.v_bits // 8
            out["scales"] += H * P * 2 * (D // self.group_size) * e
        return out


def layer_page_bytes(cfg, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[int]:
    """Each of the `layers` layers' bytes of one sealed page in the formats of `cfg`, a resolved
    KVConfig."""
    return [sum(cfg.block_format(l, head_dim, kv_heads, dtype).block_bytes().values()) for l in range(layers)]


@functools.lru_cache(maxsize=16)
def page_bytes(cfg, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(one block id's bytes over all `layers`, the largest layer's) in the formats of `cfg`, a
    resolved KVConfig: what a sealed page costs in each tier, and per layer in a staging slice."""
    sizes = layer_page_bytes(cfg, layers, kv_heads, head_dim, dtype)
    return sum(sizes), max(sizes)


def _hadamard_cpu(d: int) -> torch.Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [d, d]: symmetric, H @ H = I. One shared tensor
    per (d, dtype, device), built once: treat it as read-only."""
    return _hadamard_on(d, dtype, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=32)
def _hadamard_on(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(d).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def hadamard_signs(d: int, device: torch.device) -> torch.Tensor:
    """The signs of `hadamard(d)`, +-1 in fp16 [d, d] (exact; the matrix is these times
    1/sqrt(d)), once per (d, device): the Triton kernels multiply by them on fp16 tensor cores
    or in fp32 and apply 1/sqrt(d) apart. Read-only."""
    return torch.where(_hadamard_cpu(d) > 0, 1.0, -1.0).to(torch.float16).to(device)


@functools.lru_cache(maxsize=32)
def hadamard_scale(d: int) -> float:
    """The magnitude of `hadamard(d)`'s entries, 1/sqrt(d) as the fp32 matrix holds it."""
    return _hadamard_on(d, torch.float32, torch.device("cpu"))[0, 0].item()


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last dim, computed in fp32 and returned in x's dtype. Self-inverse."""
    h = hadamard(x.shape[-1], torch.float32, x.device)
    return (x.float() @ h).to(x.dtype)


def rotate_to_seal(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last dim as sealing quantizes it, in x's dtype: log2(D) butterfly stages
    in fp64 (stage s pairs the channels whose indices differ in bit s into (a + b, a - b), from
    s = 0 up), times H's entry magnitude (`hadamard_scale`), rounded to fp32 and then to x's
    dtype. The fp64 sums of 16-bit values are exact, of fp32 ones while a row's magnitudes
    span less than 2^22, and the Triton sealing kernel (`hadamard_planes`) runs these very
    operations in this order, so a block seals to the same bits on any device and backend;
    `rotate`'s fp32 matmul rounds its sums as each BLAS does."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"rotate_to_seal: the last dim must be a power of two, got {d}")
    y = x.double()
    lead = y.shape[:-1]
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return (y * hadamard_scale(d)).float().to(x.dtype)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2**bits) -> packed uint8 [..., D*bits/8]."""
    per = CODES_PER_BYTE[bits]
    if per == 1:
        return codes.to(torch.uint8)
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [..., D*bits/8] -> uint8 codes [..., D]."""
    per = CODES_PER_BYTE[bits]
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(
            f"cannot quantize {what}: {bad} value(s) are NaN or Inf (shape {tuple(x.shape)}); "
            "the model produced non-finite keys/values, nothing was sealed"
        )


def _round_down(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r = v.to(dtype)
    too_big = r.double() > v
    return torch.where(too_big, torch.nextafter(r, torch.full_like(r, -math.inf)), r)


def _round_up(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r = v.to(dtype)
    too_small = r.double() < v
    return torch.where(too_small, torch.nextafter(r, torch.full_like(r, math.inf)), r)


def _affine_quantize(x: torch.Tensor, dim: int, bits: int, dtype: torch.dtype, what: str):
    """Codes (uint8, unpacked), scale and zero-point (dtype) over `dim` (kept as size 1)."""
    _check_finite(x, what)
    qmax = (1 << bits) - 1
    xd = x.double()
    lo = xd.amin(dim, keepdim=True)
    hi = xd.amax(dim, keepdim=True)
    zero = _round_down(lo, dtype)
    scale = _round_up((hi - zero.double()) / qmax, dtype)
    # Rounding of (hi - zero)/qmax itself can leave the range a hair short: bump once more.
    short = zero.double() + scale.double() * qmax < hi
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise ValueError(
            f"cannot quantize {what}: its range [{lo.min().item():.4g}, {hi.max().item():.4g}] "
            f"does not fit {dtype} scales; use KVConfig(dtype='bfloat16') or 'float32'"
        )
    s = scale.double()
    q = torch.where(s > 0, (xd - zero.double()) / torch.where(s > 0, s, 1.0), 0.0)
    codes = q.round().clamp_(0, qmax).to(torch.uint8)
    return codes, scale, zero


def quantize_k(k: torch.Tensor, bits: int, dtype: torch.dtype, span: int | None = None):
    """K block [..., P, D] -> (packed codes [..., P, D*bits/8], scale, zero): with `span`, a
    scale row per span of tokens, [..., P/span, D]; without, one over the block, [..., D]."""
    *lead, P, D = k.shape
    if span is None:
        codes, scale, zero = _affine_quantize(k, -2, bits, dtype, "keys")
        return pack_codes(codes, bits), scale.squeeze(-2), zero.squeeze(-2)
    if span < 1 or P % span:
        raise ValueError(f"quantize_k: span {span} must divide the block's {P} tokens")
    codes, scale, zero = _affine_quantize(k.reshape(*lead, P // span, span, D), -2, bits, dtype, "keys")
    return pack_codes(codes.reshape(*lead, P, D), bits), scale.squeeze(-2), zero.squeeze(-2)


def dequantize_k(packed, scale, zero, bits: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_k: [..., P, D] in out_dtype (scale and zero [..., D] or, a row a
    span, [..., P/span, D])."""
    codes = unpack_codes(packed, bits).float()
    if scale.dim() == codes.dim() - 1:
        return (codes * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).to(out_dtype)
    *lead, P, D = codes.shape
    S = scale.shape[-2]
    x = codes.reshape(*lead, S, P // S, D) * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)
    return x.reshape(*lead, P, D).to(out_dtype)


def quantize_v(v: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype):
    """V block [..., P, D] -> (packed codes [..., P, D*bits/8], scale/zero [..., P, D/group])."""
    *lead, D = v.shape
    g = v.reshape(*lead, D // group_size, group_size)
    codes, scale, zero = _affine_quantize(g, -1, bits, dtype, "values")
    return pack_codes(codes.reshape(*lead, D), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_v(packed, scale, zero, bits: int, group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_v: [..., P, D] in out_dtype."""
    codes = unpack_codes(packed, bits).float()
    *lead, D = codes.shape
    g = codes.reshape(*lead, D // group_size, group_size)
    x = g * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.reshape(*lead, D).to(out_dtype)
