import pytest
import torch

from longctx.errors import BackendUnavailableError
from longctx.ops.quantize_blocks import quantize_blocks
from longctx.quant import BlockFormat, dequantize_v, hadamard_scale, hadamard_signs, quantize_k, rotate_to_seal, unpack_codes


@pytest.mark.parametrize("kb, vb, rot, span", [(8, 8, False, 0), (4, 4, False, 0), (2, 2, True, 0), (8, 4, False, 0), (16, 4, False, 0),
                                               (16, 16, False, 0), (2, 2, True, 16), (4, 4, False, 32)],
                         ids=["int8", "int4", "int2+rot", "k8v4", "k16v4", "bf16", "int2+rot-span16", "int4-span32"])
def test_quantize_blocks_matches_format(kb, vb, rot, span):
    """Sealing gives quant.py's codes and scales; K a scale row per span (the page: one)."""
    P = 64 if span else 16
    fmt = BlockFormat(kb, vb, P, 32, 64, 2, torch.float32, rot, span)
    g = torch.Generator().manual_seed(kb + vb + rot)
    k, v = torch.randn(5, 2, P, 64, generator=g), torch.randn(5, 2, P, 64, generator=g)
    out = quantize_blocks(k, v, fmt)
    if kb == 16:
        assert torch.equal(out["k"], k)
    else:
        kr = rotate_to_seal(k) if rot else k
        ck, sk, zk = quantize_k(kr, kb, torch.float32, fmt.k_span)
        assert torch.equal(out["k_codes"], ck) and torch.equal(out["k_scale"], sk) and torch.equal(out["k_zero"], zk)
        assert out["k_codes"].shape == (5, 2, P, 64 * kb // 8) and sk.shape == (5, 2, P // fmt.k_span, 64)
        # each span's range: its own tokens' min and max, per channel
        spans = kr.double().reshape(5, 2, P // fmt.k_span, fmt.k_span, 64)
        assert (zk.double() <= spans.amin(3)).all() and (zk.double() + sk.double() * (2**kb - 1) >= spans.amax(3)).all()
        rec = dequantize_k_tensor(out, kb).reshape(spans.shape)
        assert ((rec - spans).abs() <= sk.double().unsqueeze(-2) / 2 * (1 + 1e-6) + 1e-30).all()
    if vb == 16:
        assert torch.equal(out["v"], v)
    else:
        assert out["v_scale"].shape == (5, 2, P, 2)
        stored = (rotate_to_seal(v) if rot else v).double()  # codes live in the rotated space
        step = out["v_scale"].double().repeat_interleave(32, -1)
        # each code the nearest level: reconstructed in fp64 (dequantize_v computes in fp32,
        # whose rounding near |v| ~ 2 exceeds the bound's slack: 12 of 600 seeded runs failed)
        rec = unpack_codes(out["v_codes"], vb).double() * step + out["v_zero"].double().repeat_interleave(32, -1)
        assert ((rec - stored).abs() <= step / 2 * (1 + 1e-6)).all()
        assert torch.allclose(dequantize_v(out["v_codes"], out["v_scale"], out["v_zero"], vb, 32, torch.float64), rec, rtol=0, atol=1e-6)


def test_quantize_blocks_validates_shapes():
    fmt = BlockFormat(4, 4, 16, 64, 64, 2, torch.float32)
    with pytest.raises(ValueError, match=r"k must be \[N, 2, 16, 64\], got \(3, 2, 8, 64\)"):
        quantize_blocks(torch.randn(3, 2, 8, 64), torch.randn(3, 2, 8, 64), fmt)
    with pytest.raises(BackendUnavailableError):
        quantize_blocks(torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64), fmt, backend="triton9")


TRITON_FORMATS = [(8, 8, False, 0), (4, 4, False, 0), (2, 2, True, 0), (8, 4, False, 0), (16, 4, False, 0), (4, 16, False, 0),
                  (8, 8, True, 0), (4, 4, True, 0), (8, 2, True, 0), (16, 2, True, 0), (4, 16, True, 0), (2, 2, True, 16), (4, 4, False, 16),
                  (8, 2, True, 16)]
TRITON_IDS = ["int8", "int4", "int2+rot", "k8v4", "k16v4", "k4v16", "int8+rot", "int4+rot", "k8v2+rot", "k16v2+rot", "k4v16+rot",
              "int2+rot-P64-span16", "int4-P64-span16", "k8v2+rot-P64-span16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kb, vb, rot, span", TRITON_FORMATS, ids=TRITON_IDS)
def test_triton_quantize_matches_reference(kb, vb, rot, span, dtype):
    pytest.importorskip("triton")
    from longctx.ops.quantize_blocks.reference import quantize_blocks_reference
    from longctx.ops.quantize_blocks.triton import quantize_blocks_triton
    from longctx.testing import random_kv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 is not faithful; bf16 runs on the GPU")
    P = 64 if span else 16
    fmt = BlockFormat(kb, vb, P, 32, 64, 2, dtype, rot, span)
    k, v = random_kv(3, 2, P, 64, dtype=dtype, seed=kb + vb)
    k[1, 0] = 2.5  # a constant block: scale 0, exact
    ref = quantize_blocks_reference(k, v, fmt)  # on the CPU: a rotated block seals alike on any device
    got = {n: t.cpu() for n, t in quantize_blocks_triton(k.to(device), v.to(device), fmt).items()}
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert torch.equal(g, r), f"{name}: only {(g == r).float().mean().item():.4f} equal"
    if kb != 16:
        rec = dequantize_k_tensor(got, kb)
        kr = (rotate_to_seal(k) if rot else k).double()
        step = got["k_scale"].double().repeat_interleave(fmt.k_span, -2)
        assert ((rec - kr).abs() <= step / 2 * (1 + 1e-6) + 1e-30).all()
        assert (got["k_scale"][1, 0] == 0).all()
    if vb != 16:
        rec = dequantize_v(got["v_codes"], got["v_scale"], got["v_zero"], vb, 32, torch.float64)
        vr = (rotate_to_seal(v) if rot else v).double()
        step = got["v_scale"].double().repeat_interleave(32, -1)
        assert ((rec - vr).abs() <= step / 2 * (1 + 1e-6) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kb, vb, P, D, span", [(4, 4, 64, 128, 0), (2, 2, 256, 64, 0), (8, 2, 64, 128, 0), (2, 2, 64, 128, 16)],
                         ids=["int4-P64-D128", "int2-P256-D64", "k8v2-P64-D128", "int2-P64-D128-span16"])
def test_triton_rotated_seal_of_whole_blocks(kb, vb, P, D, span, dtype):
    """Rotated blocks of the sizes the cache seals (a rotated program holds the whole block, on
    more warps as blocks grow): the reference's bits, in a pool at slots, from strided views."""
    pytest.importorskip("triton")
    from longctx.ops.pages import Pages
    from longctx.ops.quantize_blocks import quantize_blocks_into
    from longctx.ops.quantize_blocks.reference import quantize_blocks_reference
    from longctx.testing import random_kv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 is not faithful; bf16 runs on the GPU")
    fmt = BlockFormat(kb, vb, P, 32, D, 2, dtype, True, span)
    tail_k, tail_v = random_kv(2, 2, 2 * P, D, dtype=dtype, seed=P + D)
    k = torch.stack([tail_k[1, :, P:], tail_k[0, :, :P]])  # views into a tail, as the cache seals
    v = torch.stack([tail_v[1, :, P:], tail_v[0, :, :P]])
    ref = quantize_blocks_reference(k, v, fmt)
    pages = Pages(fmt)
    for name, t in ref.items():
        setattr(pages, name, torch.zeros((3, *t.shape[1:]), dtype=t.dtype, device=device))
    quantize_blocks_into(pages, torch.tensor([2, 0], device=device), k.to(device), v.to(device), backend="triton")
    for name, r in ref.items():
        assert torch.equal(getattr(pages, name)[[2, 0]].cpu(), r), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_rotate_to_seal_rounds_the_exact_rotation(dtype):
    """16-bit values: the fp64 sums are exact, so sealing's rotation is the exact product with
    H's signs times H's fp32 entry, rounded to fp32 and then to the dtype, in any order of sums;
    a length that is not a power of two is refused."""
    g = torch.Generator().manual_seed(3)
    for d in (16, 64, 128):
        x = (torch.randn(4, 3, d, generator=g) * torch.logspace(-3, 3, d)).to(dtype)
        exact = (x.double() @ hadamard_signs(d, torch.device("cpu")).double()) * hadamard_scale(d)
        assert torch.equal(rotate_to_seal(x), exact.float().to(dtype)), d
    assert torch.equal(rotate_to_seal(torch.zeros(2, 32, dtype=dtype)), torch.zeros(2, 32, dtype=dtype))
    with pytest.raises(ValueError, match="power of two, got 96"):
        rotate_to_seal(torch.ones(2, 96))


def dequantize_k_tensor(got, bits):
    from longctx.quant import dequantize_k

    return dequantize_k(got["k_codes"], got["k_scale"], got["k_zero"], bits, torch.float64)


def test_triton_quantize_rejects_nan():
    pytest.importorskip("triton")
    from longctx.ops.quantize_blocks.triton import quantize_blocks_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = BlockFormat(4, 4, 16, 64, 64, 1, torch.float32)
    k = torch.randn(1, 1, 16, 64, device=device)
    k[0, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_blocks_triton(k, k.clone(), fmt)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kb, vb, rot", [(4, 4, False), (8, 4, False), (2, 2, True), (16, 4, False), (16, 16, False)],
                         ids=["int4", "k8v4", "int2+rot", "k16v4", "bf16"])
def test_quantize_blocks_into_writes_the_slots_only(backend, kb, vb, rot):
    """In place at pool slots equals quantize_blocks then index writes, for strided views of
    a tail-like buffer (the cache passes those), and leaves every other slot alone."""
    if backend == "triton":
        pytest.importorskip("triton")
    from longctx.ops.pages import Pages
    from longctx.ops.quantize_blocks import quantize_blocks_into
    from longctx.testing import random_kv

    device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
    dtype = torch.float16
    fmt = BlockFormat(kb, vb, 16, 32, 64, 2, dtype, rot)
    tail_k, tail_v = random_kv(2, 2, 48, 64, dtype=dtype, seed=kb * vb)  # [B, H, 3 blocks of 16, D]
    tail_k, tail_v = tail_k.to(device), tail_v.to(device)
    # blocks 1 and 2 of row 1, then block 0 of row 0: views into the tail, not contiguous
    k = torch.stack([tail_k[1, :, 16:32], tail_k[1, :, 32:48], tail_k[0, :, 0:16]])
    v = torch.stack([tail_v[1, :, 16:32], tail_v[1, :, 32:48], tail_v[0, :, 0:16]])
    one_k, one_v = tail_k[1, :, 16:32].unsqueeze(0), tail_v[1, :, 16:32].unsqueeze(0)  # a strided view
    assert not one_k.is_contiguous()
    ref = quantize_blocks(k.cpu(), v.cpu(), fmt, backend="reference")
    pages = Pages(fmt)
    fill = {}
    for name, t in ref.items():
        pool = torch.full((6, *t.shape[1:]), 7, dtype=t.dtype, device=device)  # 7: "untouched"
        setattr(pages, name, pool)
        fill[name] = pool.clone()
    slots = torch.tensor([4, 1, 2], device=device)
    quantize_blocks_into(pages, slots, k, v, backend=backend)
    quantize_blocks_into(pages, torch.tensor([5], device=device), one_k, one_v, backend=backend)
    for name, r in ref.items():
        got = getattr(pages, name).cpu()
        assert torch.equal(got[[4, 1, 2]], r), name
        assert torch.equal(got[5], r[0]), name  # the single strided block
        assert torch.equal(got[[0, 3]], fill[name][[0, 3]].cpu()), name
    with pytest.raises(ValueError, match=r"ids must be \[3\]"):
        quantize_blocks_into(pages, slots[:2], k, v, backend=backend)
    with pytest.raises(ValueError, match="ids must be int32/int64"):
        quantize_blocks_into(pages, slots.float(), k, v, backend=backend)
