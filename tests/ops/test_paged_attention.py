"""Paged attention (reference backend) against an fp64 oracle over a named shape grid.

The oracle reads keys/values that `longctx.testing.expected_dense` rebuilds block by block
from quant.py, so these tests check paging, sinks, tails, causal offsets, GQA and left
padding independently of the cache's tables and the op's gather.
"""

import importlib.util

import pytest
import torch

from longctx import KVConfig
from longctx.cache import PagedKVCache
from longctx.errors import BackendUnavailableError
from longctx.ops.gather_dequant import gather_dequant
from longctx.ops.paged_attention import dense_attention, paged_attention
from longctx.testing import assert_close_fp64, attention_fp64, expected_dense, random_kv

# (B, T, C, Hq, Hkv, D, block, cfg kwargs, left padding)
CASES = [
    (1, 1, 1, 4, 4, 64, 16, dict(bits=4), False),
    (2, 63, 1, 9, 3, 64, 16, dict(bits=4), True),
    (2, 64, 1, 8, 2, 64, 16, dict(bits=8), False),
    (1, 1000, 1, 8, 1, 128, 64, dict(bits=4), False),
    (2, 1000, 16, 8, 2, 64, 64, dict(bits=4), True),
    (2, 300, 7, 4, 4, 64, 16, dict(bits=2, rotate=True), True),
    (1, 640, 1, 3, 1, 128, 256, dict(bits=4), False),
    (2, 200, 3, 4, 1, 64, 16, dict(bits=4, k_bits=8), True),
    (1, 130, 1, 8, 2, 128, 16, dict(bits=16), True),
    (2, 97, 5, 6, 2, 64, 32, dict(bits=4, rotate=True), False),
    (1, 257, 1, 4, 2, 64, 16, dict(bits=8, sink_blocks=0), False),
    (1, 520, 64, 8, 8, 64, 256, dict(bits=2, rotate=True), False),
    (2, 80, 80, 4, 2, 64, 16, dict(bits=4), True),  # the whole sequence is one chunk
]


def case_id(c):
    B, T, C, Hq, Hkv, D, P, kw, pad = c
    name = KVConfig(**kw).describe() + ("" if kw.get("sink_blocks", 1) else "-nosink")
    return f"B{B}-T{T}-C{C}-H{Hq}/{Hkv}-D{D}-P{P}-{name}" + ("-pad" if pad else "")


def fill(cfg, B, T, C, Hkv, D, dtype=torch.float32, chunk=37, seed=0):
    """A one-layer cache holding T tokens, appended in uneven chunks, the last C on their own."""
    k, v = random_kv(B, Hkv, T, D, dtype=dtype, seed=seed)
    cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=Hkv, head_dim=D)
    t = 0
    while t < T - C:
        n = min(chunk, T - C - t)
        cache.append(0, k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
    cache.append(0, k[:, :, T - C :], v[:, :, T - C :])
    return cache, k, v


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_paged_attention_matches_fp64(case):
    B, T, C, Hq, Hkv, D, P, kw, pad = case
    cfg = KVConfig(block_size=P, **kw)
    cache, k, v = fill(cfg, B, T, C, Hkv, D)
    assert cache.seq_len() == T and cache.view(0).tail_k.shape[2] >= C
    q = torch.randn(B, Hq, C, D, generator=torch.Generator().manual_seed(7))
    start = torch.tensor([min(5 * b + 3 * pad * b, T - 1) if pad else 0 for b in range(B)], dtype=torch.int32) if pad else None
    out, lse = paged_attention(q, cache.view(0), start=start)
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=T - C)
    ref_out, ref_lse = attention_fp64(q, k_exp, v_exp, start)
    assert_close_fp64(out, ref_out, atol=2e-5, rtol=1e-4, what="out")
    assert_close_fp64(lse, ref_lse, atol=2e-5, rtol=1e-5, what="lse")
    out2, none = paged_attention(q, cache.view(0), start=start, return_lse=False)
    assert none is None and torch.allclose(out2, out, atol=1e-5)


def test_fp16_pages():
    cfg = KVConfig(bits=4, block_size=16)
    cache, k, v = fill(cfg, 2, 100, 1, 2, 64, dtype=torch.float16)
    q = torch.randn(2, 4, 1, 64).half()
    out, lse = paged_attention(q, cache.view(0))
    assert out.dtype == torch.float16
    ref_out, ref_lse = attention_fp64(q, *expected_dense(k, v, cfg, sealed_tokens=99))
    assert_close_fp64(out, ref_out, atol=2e-3, rtol=2e-3, what="fp16 out")


def test_quantization_error_shrinks_with_bits():
    """Against exact attention on the original K/V: int8 beats int4 beats int2."""
    errs = {}
    for bits in (8, 4, 2):
        cfg = KVConfig(bits=bits, block_size=16, rotate=bits == 2)
        cache, k, v = fill(cfg, 1, 512, 1, 2, 64, seed=1)
        q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(3))
        out, _ = paged_attention(q, cache.view(0))
        exact, _ = attention_fp64(q, k, v)
        errs[bits] = (out.double() - exact).abs().max().item()
    assert errs[8] < errs[4] < errs[2], errs
    assert errs[8] < 0.01, errs


def test_padding_query_gets_zero_output_and_neg_inf_lse():
    cfg = KVConfig(bits=4, block_size=16)
    cache, k, v = fill(cfg, 2, 20, 4, 1, 64)
    q = torch.randn(2, 2, 4, 64)
    start = torch.tensor([0, 18], dtype=torch.int32)  # row 1: queries at 16, 17 see nothing
    out, lse = paged_attention(q, cache.view(0), start=start)
    assert torch.isfinite(out).all()
    assert (out[1, :, :2] == 0).all() and torch.isneginf(lse[1, :, :2]).all()
    assert torch.isfinite(lse[1, :, 2:]).all()


def test_dense_attention_same_contract():
    k, v = random_kv(2, 2, 50, 64, seed=4)
    q = torch.randn(2, 6, 3, 64)
    start = torch.tensor([0, 9])
    out, lse = dense_attention(q, k, v, start)
    ref_out, ref_lse = attention_fp64(q, k, v, start)
    assert_close_fp64(out, ref_out, atol=2e-5, rtol=1e-4, what="out")
    assert_close_fp64(lse, ref_lse, atol=2e-5, rtol=1e-5, what="lse")


def test_gather_dequant_is_the_expected_dense_past():
    cfg = KVConfig(bits=4, block_size=16, rotate=True)
    cache, k, v = fill(cfg, 2, 90, 1, 2, 64)
    cache.seal()
    view = cache.view(0)
    gk, gv = gather_dequant(view)
    k_exp, v_exp = expected_dense(k, v, cfg)
    n = view.past_len
    assert gk.shape == (2, 2, n, 64)
    assert torch.equal(gk, k_exp[:, :, :n]) and torch.equal(gv, v_exp[:, :, :n])


def test_validation_quotes_shapes():
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 2, 40, 1, 2, 64)
    with pytest.raises(ValueError, match=r"q must be \[B, H_q, C, D\], got \(2, 4, 64\)"):
        paged_attention(torch.randn(2, 4, 64), cache.view(0))
    with pytest.raises(ValueError, match="H_q=3 is not a multiple of H_kv=2"):
        paged_attention(torch.randn(2, 3, 1, 64), cache.view(0))
    with pytest.raises(ValueError, match="does not match q"):
        paged_attention(torch.randn(2, 4, 1, 32), cache.view(0))
    with pytest.raises(ValueError, match=r"start must be an int32/int64 tensor \[B=2\]"):
        paged_attention(torch.randn(2, 4, 1, 64), cache.view(0), start=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(BackendUnavailableError, match="no backend 'nope'"):
        paged_attention(torch.randn(2, 4, 1, 64), cache.view(0), backend="nope")


# ---------------------------------------------------------------------- the flex backend
@pytest.mark.parametrize("B, T, C, Hq, Hkv, P, sinks, pad", [(2, 70, 1, 4, 2, 16, 1, True), (1, 100, 1, 6, 3, 16, 0, False),
                                                          (2, 90, 12, 4, 1, 16, 1, True), (1, 40, 1, 2, 2, 16, 1, False)],
                         ids=["decode-pad", "decode-nosink", "prefill-pad", "short"])
def test_flex_matches_fp64_on_16bit_pages(B, T, C, Hq, Hkv, P, sinks, pad):
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = KVConfig(bits=16, block_size=P, sink_blocks=sinks)
    cache, k, v = fill(cfg, B, T, C, Hkv, 64)
    q = torch.randn(B, Hq, C, 64, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([0, 21][:B], dtype=torch.int32) if pad else None
    out, lse = paged_attention(q, cache.view(0), start=start, backend="flex")
    ref_out, ref_lse = attention_fp64(q, k, v, start)
    assert_close_fp64(out, ref_out, atol=2e-5, rtol=1e-4, what="out")
    assert_close_fp64(lse, ref_lse, atol=2e-5, rtol=1e-5, what="lse")


def test_flex_refuses_quantized_pages_and_storage_ops_still_work():
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = KVConfig(bits=4, block_size=16, backend="flex")
    cache, _, _ = fill(cfg, 1, 40, 1, 2, 64)  # sealing with backend="flex" takes the default storage path
    with pytest.raises(BackendUnavailableError, match="16-bit pages only"):
        paged_attention(torch.randn(1, 2, 1, 64), cache.view(0), backend="flex")


# ---------------------------------------------------------------------- the flash backend
# The backend is checked through a torch stand-in for flash_attn_with_kvcache's documented
# contract (longctx.testing) against the fp64 oracle on the CPU, where flash-attn cannot run,
# and with flash-attn's own kernel on the same grid where it imports on a GPU (tests/test_cuda.py
# holds the stand-in to the kernel there).


@pytest.fixture
def standin(monkeypatch):
    from longctx.ops.paged_attention import flash
    from longctx.testing import flash_kvcache_standin

    calls = []

    def fn(*args, **kw):
        calls.append(kw)
        return flash_kvcache_standin(*args, **kw)

    monkeypatch.setattr(flash, "_kvcache_fn", lambda: fn)
    return calls


def _flash_vs_fp64(case, stage, device):
    """The flash backend on `case` (its view sealed on the CPU, then moved to `device`) against
    the fp64 oracle, which reads the same fp16 keys and values as flash-attn's pages; returns
    the view's block count."""
    from longctx.bench import copy_view
    from longctx.ops.paged_attention.flash import paged_attention_flash

    B, T, C, Hq, Hkv, D, P, kw, pad = case
    cfg = KVConfig(block_size=P, **kw)
    cache, k, v = fill(cfg, B, T, C, Hkv, D)
    view = copy_view(cache.view(0), device)
    q = torch.randn(B, Hq, C, D, generator=torch.Generator().manual_seed(7)).half()
    start = torch.tensor([min(8 * b, T - 1) for b in range(B)], dtype=torch.int32) if pad else None
    out, lse = paged_attention_flash(q.to(device), view, None if start is None else start.to(device), None,
                                     stage_bytes=None if stage == "one-slice" else 1)
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=T - C)
    ref_out, ref_lse = attention_fp64(q, k_exp.half(), v_exp.half(), start)
    assert out.dtype == torch.float16 and out.device.type == torch.device(device).type
    assert_close_fp64(out.cpu(), ref_out, atol=1e-3, rtol=1e-3, what="out")  # fp16 output: one rounding
    assert_close_fp64(lse.cpu(), ref_lse, atol=2e-5, rtol=1e-5, what="lse")
    return view.block_table.shape[1]


@pytest.mark.parametrize("stage", ["one-slice", "block-slices"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_flash_matches_fp64(case, stage, standin):
    n = _flash_vs_fp64(case, stage, "cpu")
    slices = sum(c.get("block_table") is not None for c in standin)
    assert slices == (min(n, 1) if stage == "one-slice" else n) and len(standin) == slices + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                    reason="needs a CUDA GPU and flash-attn (PyPI has it as source only; tools/pack_flash_attn.sh builds it for the GPU machine)")
@pytest.mark.parametrize("stage", ["one-slice", "block-slices"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_flash_attn_matches_fp64(case, stage):
    """The same grid and error budget with flash-attn's own kernel, on the GPU (the pages
    gathered by the Triton kernel)."""
    _flash_vs_fp64(case, stage, "cuda")


def test_flash_drops_left_padding_across_slices(standin):
    """Row 1's first 40 tokens are padding: with one block per slice its first two slices hold
    nothing, and its queries before position 40 see no key at all (zero output, -inf LSE)."""
    from longctx.ops.paged_attention.flash import paged_attention_flash

    cfg = KVConfig(bits=4, block_size=16)
    cache, k, v = fill(cfg, 2, 48, 10, 2, 64)  # queries at 38..47
    q = torch.randn(2, 4, 10, 64, generator=torch.Generator().manual_seed(2)).half()
    start = torch.tensor([0, 40], dtype=torch.int32)
    out, lse = paged_attention_flash(q, cache.view(0), start, None, stage_bytes=1)
    seqlens = [c["cache_seqlens"].tolist() for c in standin if c.get("block_table") is not None]
    assert seqlens == [[16, 0], [16, 0]]  # 38 tokens: 2 sealed blocks, then the tail
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=38)
    ref_out, ref_lse = attention_fp64(q, k_exp.half(), v_exp.half(), start)
    assert (out[1, :, :2] == 0).all() and torch.isneginf(lse[1, :, :2]).all()
    assert_close_fp64(out, ref_out, atol=1e-3, rtol=1e-3, what="out")
    assert_close_fp64(lse, ref_lse, atol=2e-5, rtol=1e-5, what="lse")


def test_flash_unavailable_and_unsupported_inputs_say_why(standin):
    from longctx.ops.paged_attention.flash import paged_attention_flash

    cfg = KVConfig(bits=4, block_size=16, backend="flash")
    cache, _, _ = fill(cfg, 1, 40, 1, 2, 64)  # sealing with backend="flash" takes the default storage path
    q = torch.randn(1, 2, 1, 64)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(BackendUnavailableError, match=r"needs flash-attn >= 2.6: pip install 'longctx\[flash\]'"):
            paged_attention(q.half(), cache.view(0), backend="flash")
    else:
        with pytest.raises(BackendUnavailableError, match="runs on CUDA tensors"):
            paged_attention(q.half(), cache.view(0), backend="flash")
    with pytest.raises(BackendUnavailableError, match="fp16/bf16 queries"):
        paged_attention_flash(q, cache.view(0), None, None)
    with pytest.raises(BackendUnavailableError, match="multiple of 8 and at most 256"):
        paged_attention_flash(torch.randn(1, 2, 1, 12).half(), _short_view(12), None, None)


def _short_view(D):
    cache, _, _ = fill(KVConfig(bits=8, block_size=16), 1, 20, 1, 1, D)
    return cache.view(0)


def test_gather_pages_is_the_rows_tokens_from_start():
    """gather_dequant_pages against the dense gather: each row's tokens of the block range from
    start[b] on, packed from slot 0, in 256-token pages through the block table."""
    from longctx.ops.gather_dequant import gather_dequant_pages

    cfg = KVConfig(bits=4, block_size=16, rotate=True)
    cache, _, _ = fill(cfg, 3, 700, 1, 2, 64)
    cache.seal()
    view = cache.view(0)
    dk, dv = gather_dequant(view)  # [B, H, n*16, D]
    start = torch.tensor([0, 37, 300], dtype=torch.int32)
    for blocks in (range(43), range(2, 20), range(20, 20)):
        p = gather_dequant_pages(view, blocks, start)
        first, tokens = blocks.start * 16, len(blocks) * 16
        m = max(1, -(-tokens // 256))
        assert p.k.shape == (3 * m, 256, 2, 64) and p.block_table.tolist() == [[b * m + i for i in range(m)] for b in range(3)]
        for b in range(3):
            s = min(max(int(start[b]) - first, 0), tokens)
            assert int(p.seqlens[b]) == tokens - s
            got_k = p.k[p.block_table[b].long()].flatten(0, 1)[: tokens - s].transpose(0, 1)
            got_v = p.v[p.block_table[b].long()].flatten(0, 1)[: tokens - s].transpose(0, 1)
            assert torch.equal(got_k, dk[b, :, first + s : first + tokens]) and torch.equal(got_v, dv[b, :, first + s : first + tokens])
    with pytest.raises(ValueError, match="step-1 range within 0..43"):
        gather_dequant_pages(view, range(44))
    with pytest.raises(ValueError, match=r"step-1 range within 0..43, got \[0, 1\]"):
        gather_dequant_pages(view, [0, 1])
    with pytest.raises(ValueError, match=r"start must be \[B=3\]"):
        gather_dequant_pages(view, start=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("P", [16, 64, 256])
def test_flash_slices_stay_within_the_staging_bound(P):
    """A slice's staging pages (K and V of every row, padded to whole 256-token pages) fit
    the bound whenever one page does; below that a slice is one block."""
    from longctx.ops.paged_attention.flash import PAGE, slice_blocks

    cache, _, _ = fill(KVConfig(bits=4, block_size=P), 2, 40, 1, 2, 64)
    per_token = 2 * 2 * 64 * 2 * 2  # rows x heads x D x bf16 x (K, V)
    for stage in (1, per_token * PAGE - 1, per_token * PAGE, 5 * per_token * PAGE + 7, 256 << 20):
        n = slice_blocks(cache.view(0), 2, stage)
        staged = -(-n * P // PAGE) * PAGE * per_token
        assert n >= 1 and (staged <= stage or (n == 1 and stage < per_token * max(P, PAGE))), (stage, n)
        assert stage < per_token * max(P, PAGE) or staged > stage - per_token * max(P, PAGE)  # and no page of room left unused
