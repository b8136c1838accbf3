"""The block format against fp64: error bounds, exact cases, and no NaN/Inf ever."""

import pytest
import torch

from longctx.quant import dequantize_k, dequantize_v, hadamard, hadamard_scale, hadamard_signs, pack_codes, quantize_k, quantize_v, rotate, unpack_codes
from longctx.testing import random_kv

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """Half the spacing of `dtype` around |x| (the rounding of a dequantized value)."""
    finfo = torch.finfo(dtype)
    mag = x.abs().double().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * finfo.eps / 2 + finfo.smallest_normal * finfo.eps


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_pack_is_little_end_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x03]]
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_k_roundtrip_within_half_step(bits, dtype):
    k, _ = random_kv(2, 3, 64, 64, dtype=dtype, seed=bits)
    codes, scale, zero = quantize_k(k, bits, dtype)
    assert scale.shape == zero.shape == (2, 3, 64) and scale.dtype == dtype
    rec = dequantize_k(codes, scale, zero, bits, torch.float64)
    err = (rec - k.double()).abs()
    step = scale.double().unsqueeze(-2)
    assert (err <= step / 2 * (1 + 1e-6) + 1e-12).all()
    # the stored step is the ideal one, widened by at most the scale dtype's rounding
    rng = k.double().amax(-2) - k.double().amin(-2)
    ideal = rng / ((1 << bits) - 1)
    slack = 4 * torch.finfo(dtype).eps * (ideal + k.double().abs().amax(-2) / ((1 << bits) - 1))
    assert (scale.double() <= ideal + slack).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_v_roundtrip_within_half_step(bits, dtype):
    _, v = random_kv(2, 3, 64, 128, dtype=dtype, seed=bits)
    codes, scale, zero = quantize_v(v, bits, 64, dtype)
    assert scale.shape == (2, 3, 64, 2)
    rec = dequantize_v(codes, scale, zero, bits, 64, torch.float64)
    step = scale.double().repeat_interleave(64, -1)
    assert ((rec - v.double()).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantized_in_model_dtype_adds_only_its_rounding(bits, dtype):
    k, _ = random_kv(1, 2, 64, 64, dtype=dtype, seed=3)
    codes, scale, zero = quantize_k(k, bits, dtype)
    rec = dequantize_k(codes, scale, zero, bits, dtype).double()
    exact = dequantize_k(codes, scale, zero, bits, torch.float64)
    assert ((rec - exact).abs() <= ulp(exact, dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("value", [0.0, 3.25, -1e4, 1e-30])
def test_constant_block_is_exact(bits, dtype, value):
    x = torch.full((1, 2, 64, 64), value, dtype=dtype)
    codes, scale, zero = quantize_k(x, bits, dtype)
    assert (scale == 0).all()
    assert torch.equal(dequantize_k(codes, scale, zero, bits, dtype), x)
    codes, scale, zero = quantize_v(x, bits, 32, dtype)
    assert torch.equal(dequantize_v(codes, scale, zero, bits, 32, dtype), x)


@pytest.mark.parametrize("dtype, magnitude", [(torch.bfloat16, 1e30), (torch.float32, 1e30), (torch.float16, 1e4),
                                              (torch.bfloat16, 1e-30), (torch.float32, 1e-35), (torch.float16, 1e-6)])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_huge_and_tiny_magnitudes_stay_finite_and_bounded(bits, dtype, magnitude):
    x = (torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0)) * magnitude).to(dtype)
    for quant, deq in ((lambda t: quantize_k(t, bits, dtype), lambda c, s, z: dequantize_k(c, s, z, bits, torch.float64)),
                       (lambda t: quantize_v(t, bits, 64, dtype), lambda c, s, z: dequantize_v(c, s, z, bits, 64, torch.float64))):
        codes, scale, zero = quant(x)
        assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
        rec = deq(codes, scale, zero)
        assert torch.isfinite(rec).all()
        span = x.double().abs().max()
        assert ((rec - x.double()).abs() <= span / ((1 << bits) - 1) * 1.01 + torch.finfo(dtype).smallest_normal).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(1, 1, 16, 64)
    x[0, 0, 3, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_k(x, 4, torch.float32)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_v(x, 4, 64, torch.float32)


def test_fp16_scales_out_of_range_raise_clearly():
    x = torch.randn(1, 1, 16, 64) * 1e6
    with pytest.raises(ValueError, match="does not fit torch.float16 scales"):
        quantize_k(x, 4, torch.float16)


def test_hadamard_is_orthonormal_and_rotation_self_inverse():
    h = hadamard(64, torch.float64)
    assert torch.allclose(h @ h, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h, h.T)
    x = torch.randn(4, 64)
    assert torch.allclose(rotate(rotate(x)), x, atol=1e-5)
    q, k = torch.randn(64), torch.randn(64)
    assert torch.allclose(rotate(q) @ rotate(k), q @ k, atol=1e-4)  # scores unchanged
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_signs_times_scale_is_the_matrix(d):
    """The kernels' form of H (fp16 signs, 1/sqrt(d) apart) is the fp32 matrix exactly."""
    signs = hadamard_signs(d, torch.device("cpu"))
    assert signs.dtype == torch.float16 and set(signs.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs.float() * hadamard_scale(d), hadamard(d))


def test_rotation_spreads_an_outlier_channel():
    k, _ = random_kv(1, 1, 64, 64, seed=1, outliers=False)
    k[..., 7] *= 50  # one huge channel
    flat = k.reshape(-1, 64)
    assert rotate(flat).abs().amax(0).max() < flat.abs().amax(0).max() / 3
