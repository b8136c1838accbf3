"""Triton rotation (`longctx.ops.rotation.rotate_triton`) vs fp64 (CPU: TRITON_INTERPRET=1)."""

import pytest
import torch

pytest.importorskip("triton")

from longctx.ops.rotation import rotate_triton  # noqa: E402
from longctx.quant import hadamard, hadamard_scale  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _check(x: torch.Tensor, y: torch.Tensor) -> None:
    """y is x @ H to within one rounding to x's dtype of an fp32 sum: against the fp64
    product, |error| <= half a unit of x's dtype in the last place of the exact value, plus
    fp32's accumulation bound (D terms, each below the row's sum of magnitudes / sqrt(D))."""
    D = x.shape[-1]
    ref = x.double().cpu() @ hadamard(D, torch.float64)
    got = y.double().cpu()
    rowsum = x.double().cpu().abs().sum(-1, keepdim=True) / D**0.5
    half_ulp = torch.finfo(x.dtype).eps / 2 * ref.abs()
    tiny = torch.finfo(x.dtype).tiny  # (16-bit outputs below their normal range round in absolute steps)
    bound = half_ulp + D * torch.finfo(torch.float32).eps * rowsum + (torch.finfo(x.dtype).eps * tiny)
    over = (got - ref).abs() - bound
    assert over.max().item() <= 0, (over.max().item(), (got - ref).abs().max().item())


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 9, 1, 128), (2, 4, 7, 128), (37, 64), (16,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rotate_triton_matches_fp64(shape, dtype):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    y = rotate_triton(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == x.stride()
    _check(x, y)


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_rotate_triton_rows_far_from_one_and_zero(dtype):
    """Each row scaled on its own: rows at 2^-20 and 2^12 of unit scale (fp32 also 2^-60 and
    2^40) keep their accuracy beside each other, and a row of zeros stays zeros."""
    g = torch.Generator().manual_seed(7)
    scales = [2.0**-20, 1.0, 2.0**12, 0.0] + ([2.0**-60, 2.0**40] if dtype == torch.float32 else [])
    x = torch.cat([torch.randn(3, 128, generator=g) * s for s in scales]).to(dtype).to(DEVICE)
    y = rotate_triton(x)
    _check(x, y)
    assert (y[9:12] == 0).all()


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_rotate_triton_keeps_every_bit(dtype):
    """Row i holds one value v_i (every mantissa bit set at random) at channel i, so its sum
    is exact: the result must be H's signs times v_i * fp32(1/sqrt(D)), rounded once to the
    dtype, bit for bit. Splitting fp32 values into fewer fp16 parts than they need loses
    their low bits."""
    D = 128
    g = torch.Generator().manual_seed(3)
    v = (torch.rand(D, generator=g, dtype=torch.float64) + 1) * 2.0 ** torch.randint(-8, 8, (D,), generator=g)
    v = v.to(dtype)
    x = torch.diag(v.float()).to(dtype)
    y = rotate_triton(x.to(DEVICE)).cpu()
    signs = torch.sign(hadamard(D, torch.float64)).float()
    want = (signs * (v.float() * hadamard_scale(D))[:, None]).to(dtype)
    assert torch.equal(y, want), (y.float() - want.float()).abs().max().item()


def test_rotate_triton_strided_input():
    """A view with a gap between rows (q[:, :, 0] of a longer chunk) and one transposed: the
    result is right, contiguous where the input is not dense, strided like a dense input."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q = torch.randn(2, 4, 3, 64).to(dtype).to(DEVICE)
    view = q[:, :, 1]
    y = rotate_triton(view)
    assert y.is_contiguous()
    _check(view, y)
    t = torch.randn(2, 3, 4, 64).to(dtype).to(DEVICE).transpose(1, 2)  # [2, 4, 3, 64], dense
    y = rotate_triton(t)
    assert y.stride() == t.stride()
    _check(t, y)


def test_rotate_triton_rejects_bad_input():
    with pytest.raises(ValueError, match=r"D a power of two.*\(2, 48\)"):
        rotate_triton(torch.zeros(2, 48, device=DEVICE))
    with pytest.raises(ValueError, match="at most 4 dims"):
        rotate_triton(torch.zeros(1, 1, 1, 1, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"at most 4 dims.*\(\)"):
        rotate_triton(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(ValueError, match="float64"):
        rotate_triton(torch.zeros(2, 64, dtype=torch.float64, device=DEVICE))
