"""Triton gather_dequant vs the reference, on a named grid (CPU: TRITON_INTERPRET=1)."""

import pytest
import torch

pytest.importorskip("triton")

from longctx import KVConfig  # noqa: E402
from longctx.ops.gather_dequant import gather_dequant  # noqa: E402

from .test_paged_attention import fill  # noqa: E402
from .test_paged_attention_triton import _to  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, T, H, D, block, cfg kwargs)
CASES = [
    (2, 90, 2, 64, 16, dict(bits=4)),
    (1, 200, 1, 128, 64, dict(bits=8)),
    (2, 70, 2, 64, 16, dict(bits=2, rotate=True)),
    (2, 70, 2, 64, 16, dict(bits=2)),  # unrotated int2: four sub-tiles joined into channel order
    (2, 100, 3, 64, 32, dict(bits=4, rotate=True)),
    (1, 90, 2, 64, 16, dict(bits=4, k_bits=8)),
    (1, 90, 2, 64, 16, dict(bits=4, k_bits=16)),
    (1, 90, 2, 64, 16, dict(bits=16, v_bits=4)),
    (2, 50, 2, 64, 16, dict(bits=16)),
    (1, 120, 2, 128, 16, dict(bits=4, group_size=32, sink_blocks=0)),
    (2, 300, 2, 128, 64, dict(bits=2, rotate=True, k_span=16)),  # K a scale row per 16 tokens
    (1, 200, 2, 64, 64, dict(bits=4, k_span=32)),
]


def dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-D{c[3]}-P{c[4]}-" + "-".join(f"{k}{v}" for k, v in c[5].items()))
def test_triton_gather_matches_reference(case, dtype):
    B, T, H, D, P, kw = case
    cfg = KVConfig(block_size=P, **kw)
    cache, _, _ = fill(cfg, B, T, 1, H, D, dtype=dtype, seed=T)
    cache.seal()
    view = cache.view(0)
    ref_k, ref_v = gather_dequant(view, backend="reference", out_dtype=dtype)
    k, v = gather_dequant(_to(view, DEVICE), backend="triton", out_dtype=dtype, extra=3)
    n = ref_k.shape[2]
    assert k.shape == (B, H, n + 3, D) and v.shape == k.shape
    # fp32: the kernel fuses multiply-add (and rotates with its own dot), the reference rounds
    # twice: a few fp32 ulps. 16-bit: at most one step of the output dtype.
    for got, ref in ((k[:, :, :n].cpu(), ref_k), (v[:, :, :n].cpu(), ref_v)):
        tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        err = ((got.double() - ref.double()).abs() / ref.double().abs().clamp_min(1.0)).max().item()
        assert err <= tol, err
        if not cfg.rotate and dtype != torch.float32:  # fp32: FMA vs two roundings differ in ulps
            assert (got != ref).double().mean().item() < 0.01  # identical almost everywhere


@pytest.mark.parametrize("scale", [2.0**-30, 2.0**24], ids=["tiny", "huge"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_triton_gather_rotates_values_far_from_one(bits, scale):
    """Rotated pages of values far outside fp16's range (fp32 cache): the kernel's fp16 dot
    takes the tile into range by a power of two and back, so each value keeps fp32's relative
    accuracy, measured against the value's own scale."""
    from longctx.cache import PagedKVCache
    from longctx.testing import random_kv

    cfg = KVConfig(bits=bits, rotate=True, block_size=16)
    k, v = random_kv(2, 2, 70, 64, seed=bits)
    cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=64)
    cache.append(0, k * scale, v * scale)
    cache.seal()
    view = cache.view(0)
    ref = gather_dequant(view, backend="reference", out_dtype=torch.float32)
    got = gather_dequant(_to(view, DEVICE), backend="triton", out_dtype=torch.float32)
    for g, r in zip(got, ref):
        assert r.abs().max().item() > scale  # the values are at their scale, not flushed
        err = ((g.cpu().double() - r.double()).abs() / r.double().abs().clamp_min(scale)).max().item()
        assert err <= 1e-5, err


def test_auto_is_reference_on_cpu_tensors():
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 1, 40, 1, 2, 64)
    cache.seal()
    k, v = gather_dequant(cache.view(0), extra=2)
    rk, rv = gather_dequant(cache.view(0), backend="reference")
    assert torch.equal(k[:, :, :-2], rk) and torch.equal(v[:, :, :-2], rv) and k.shape[2] == rk.shape[2] + 2
    with pytest.raises(ValueError, match="extra"):
        gather_dequant(cache.view(0), extra=-1)


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-D{c[3]}-P{c[4]}-" + "-".join(f"{k}{v}" for k, v in c[5].items()))
def test_triton_gather_pages_matches_reference(case, dtype):
    """The flash backend's pages: the kernel writes token-major pages with each row shifted
    past its left padding; the slots the rows hold must equal the reference's. Pages of P
    tokens leave row 0 (no padding) no free slot, so a padding token written anywhere would
    overwrite one of its tokens."""
    from longctx.ops.gather_dequant import gather_dequant_pages

    B, T, H, D, P, kw = case
    cfg = KVConfig(block_size=P, **kw)
    cache, _, _ = fill(cfg, B, T, 1, H, D, dtype=dtype, seed=T)
    cache.seal()
    view = cache.view(0)
    n = view.block_table.shape[1]
    start = torch.tensor([0, P + 3, 5][:B], dtype=torch.int32)
    for blocks, page in ((range(n), 256), (range(1, n), 256), (range(n), P)):
        ref = gather_dequant_pages(view, blocks, start, page, backend="reference")
        got = gather_dequant_pages(_to(view, DEVICE), blocks, start.to(DEVICE), page, backend="triton")
        assert torch.equal(got.seqlens.cpu(), ref.seqlens) and torch.equal(got.block_table.cpu(), ref.block_table)
        assert got.k.shape == ref.k.shape and got.k.dtype == dtype
        for b in range(B):
            s = int(ref.seqlens[b])
            assert s == len(blocks) * P - min(max(int(start[b]) - blocks.start * P, 0), len(blocks) * P)
            for g, r in ((got.k, ref.k), (got.v, ref.v)):
                rows_g = g[got.block_table[b].long()].flatten(0, 1)[:s].cpu()
                rows_r = r[ref.block_table[b]].flatten(0, 1)[:s]
                tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
                err = ((rows_g.double() - rows_r.double()).abs() / rows_r.double().abs().clamp_min(1.0)).max().item() if s else 0.0
                assert err <= tol, (b, err)
