"""The host tier: placement, spilling, refcounts across tiers and exact attention over it.

A cache with a host tier forced small holds the same pages as one without (spilling moves
bytes, never re-quantizes), so its attention must equal the other's up to fp32 rounding of
the LSE merge, under every row operation.
"""

import pytest
import torch

from longctx import CacheFullError, KVConfig
from longctx.cache import PagedKVCache
from longctx.offload import plan_slices
from longctx.testing import random_kv

B, H, D, L = 2, 2, 64, 2


def pair(**kw):
    """(a cache with everything on the device, one whose device tier holds 30 blocks)."""
    kw = dict(block_size=16, **kw)
    return PagedKVCache(KVConfig(**kw), L, H, D), PagedKVCache(KVConfig(max_blocks=30, host_blocks=400, stage_blocks=5, **kw), L, H, D)


def append_both(caches, k, v):
    for c in caches:
        for layer in range(L):
            c.append(layer, k, v)


def assert_same_attention(ref, off, q, start=None, backend=None):
    for layer in range(L):
        o1, l1 = ref.attend(layer, q, start)
        o2, l2 = off.attend(layer, q, start)
        seen = torch.isfinite(l1)
        assert torch.equal(seen, torch.isfinite(l2))
        torch.testing.assert_close(o2, o1, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(l2[seen], l1[seen], atol=2e-6, rtol=1e-6)


def test_plan_slices_bounds_distinct_pages_and_merges_runs():
    rows = [[0, 10, 11, 12, 13, 20, 30], [0, 10, 11, 12, 14, 21, 31]]
    out = plan_slices(rows, 1, 7, stage_blocks=4)
    assert [(c0, c1) for c0, c1, _, _ in out] == [(1, 4), (4, 6), (6, 7)]
    c0, c1, table, runs = out[0]
    assert table == [[0, 1, 2], [0, 1, 2]] and runs == [(10, 3, 0)]  # one copy of ids 10..12
    assert out[1][2] == [[0, 2], [1, 3]] and out[1][3] == [(13, 2, 0), (20, 2, 2)]
    for _, _, tab, _ in out:
        assert max(max(r) for r in tab) < 4
    with pytest.raises(ValueError, match="more than the 1"):
        plan_slices(rows, 4, 5, stage_blocks=1)


@pytest.mark.parametrize("fmt", [dict(bits=16), dict(bits=4), dict(k_bits=8, v_bits=4), dict(bits=2, rotate=True)],
                         ids=["bf16", "int4", "k8v4", "int2+rot"])
def test_attention_with_a_host_tier_equals_all_on_device(fmt):
    """Prefill chunks and decode steps, left padding reaching into the host columns: the
    device part's positions move with the host columns it skips, the host slices see every
    query after them, and the LSE merge gives the one-tier answer."""
    ref, off = pair(**fmt)
    k, v = random_kv(B, H, 700, D)
    start = torch.tensor([0, 150], dtype=torch.int32)  # row 1's padding ends inside the host columns
    g = torch.Generator().manual_seed(1)
    t = 0
    for n in (100, 37, 150, 1, 1, 200, 5, 1, 1, 1):
        append_both((ref, off), k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
        assert_same_attention(ref, off, torch.randn(B, 4, n, D, generator=g), start)
    assert off.tables.host_columns >= off.num_blocks // 2 and off.block_alloc.num_used() <= 30
    assert off.seq_len() == ref.seq_len() == t
    for layer in range(L):  # the dequantized sequence too (other attention backends read it)
        for a, b in zip(ref.dense(layer), off.dense(layer)):
            assert torch.equal(a, b)
    r = off.memory_report()
    assert min(r.bytes_by_tier.values()) > 0 and r.total_bytes == ref.memory_report().total_bytes
    assert r.host_reserved_bytes > 0 and "pinned host" in str(r)


def test_beams_share_spilled_prompt_pages_and_rows_follow_across_tiers():
    """A prompt prefilled once, repeated for 3 beams: its spilled columns hold one host id
    each with three references; reorders, forks, frees and crops keep every refcount exact
    and the attention equal to the one-tier cache's."""
    ref, off = pair(bits=4)
    k, v = random_kv(1, H, 420, D, seed=3)
    append_both((ref, off), k, v)
    for c in (ref, off):
        c.select_rows([0, 0, 0])
    g = torch.Generator().manual_seed(2)
    for step in range(120):
        kk = torch.randn(3, H, 1, D, generator=g)
        vv = torch.randn(3, H, 1, D, generator=g)
        append_both((ref, off), kk, vv)
        assert_same_attention(ref, off, torch.randn(3, 4, 1, D, generator=g))
        if step % 7 == 3:
            order = torch.randint(0, 3, (3,), generator=g).tolist()
            for c in (ref, off):
                c.select_rows(order)
        off.tables.check()
    t = off.tables
    assert t.host_columns > 0
    prompt_cols = [j for j in range(t.sink_blocks, t.host_upto) if j < 420 // 16]
    assert prompt_cols and all(len({row[j] for row in t.rows}) == 1 for j in prompt_cols)
    assert all(off.host_alloc.refcount(t.rows[0][j]) == 3 for j in prompt_cols)
    for c in (ref, off):
        c.fork(1)
        c.free(0)
    off.tables.check()
    assert_same_attention(ref, off, torch.randn(3, 4, 1, D, generator=g))
    for cut in (off.seq_len() - 5, 16 * (off.tables.host_upto - 2) + 7, 40):  # in the device part, inside a host column, in the first blocks
        for c in (ref, off):
            c.crop(cut)
        off.tables.check()
        assert off.seq_len() == cut
        kk, vv = torch.randn(3, H, 1, D, generator=g), torch.randn(3, H, 1, D, generator=g)
        append_both((ref, off), kk, vv)
        assert_same_attention(ref, off, torch.randn(3, 4, 1, D, generator=g))
    off.reset()
    assert off.host_alloc.num_used() == 0 and off.block_alloc.num_used() == 0 and off.tables.host_columns == 0


def test_full_tiers_raise_with_the_tokens_that_fit_and_lose_nothing():
    cache = PagedKVCache(KVConfig(bits=4, block_size=16, max_blocks=4, host_blocks=6), L, H, D)
    k, v = random_kv(1, H, 300, D)
    for t in range(0, 160, 16):
        for layer in range(L):
            cache.append(layer, k[:, :, t : t + 16], v[:, :, t : t + 16])
    with pytest.raises(CacheFullError, match="host_blocks=6") as e:
        for layer in range(L):
            cache.append(layer, k[:, :, 160:200], v[:, :, 160:200])
    assert e.value.tokens_that_fit == cache.tokens_that_fit() < 40
    assert cache.seq_len() == 160
    cache.tables.check()
    ok = cache.tokens_that_fit()
    for layer in range(L):
        cache.append(layer, k[:, :, 160 : 160 + ok], v[:, :, 160 : 160 + ok])
    assert cache.memory_report().tokens == 160 + ok


def test_a_host_budget_the_machine_cannot_give_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"GiB of pinned host memory asked, but this machine has [\d,.]+ GiB available"):
        PagedKVCache(KVConfig(bits=16, block_size=256, max_blocks=4, host_blocks=2**31), 32, 8, 128)
    with pytest.raises(ValueError, match="needs max_blocks"):
        KVConfig(bits=4, host_blocks=10)


def test_a_failed_pinned_allocation_leaves_the_cache_as_it_was(monkeypatch):
    import longctx.offload as offload

    ref, off = pair(bits=4)
    k, v = random_kv(1, H, 700, D)
    append_both((ref, off), k[:, :, :300], v[:, :, :300])
    append_both((ref, off), k[:, :, 300:600], v[:, :, 300:600])  # (the next step's seal must spill)
    real = offload.pinned_buffer

    def no_pins(nbytes, pin):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(offload, "pinned_buffer", no_pins)
    before = ([list(r) for r in off.tables.rows], off.seq_len(), off.block_alloc.num_used())
    with pytest.raises(MemoryError, match="nothing was moved"):
        append_both((off,), k[:, :, 600:601], v[:, :, 600:601])
    assert ([list(r) for r in off.tables.rows], off.seq_len(), off.block_alloc.num_used()) == before
    assert off.host.pages == [] and off.tables.host_columns == 0
    monkeypatch.setattr(offload, "pinned_buffer", real)
    append_both((ref, off), k[:, :, 600:601], v[:, :, 600:601])
    assert off.tables.host_columns > 0
    assert_same_attention(ref, off, torch.randn(1, 4, 1, D))


@pytest.mark.parametrize("C", [1, 9])
def test_triton_kernels_read_host_slices(C):
    """The Triton decode and prefill kernels over views with an empty tail (the host slices):
    equal to the reference backend's (interpreted on the CPU)."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(bits=4, block_size=16, max_blocks=30, host_blocks=400, stage_blocks=5)
    ref = PagedKVCache(KVConfig(backend="reference", **kw), L, H, D)
    tri = PagedKVCache(KVConfig(backend="triton", **kw), L, H, D)
    k, v = random_kv(B, H, 300, D)
    k, v = k.to(device), v.to(device)
    for t in range(0, 300 - C, 100):
        append_both((ref, tri), k[:, :, t : min(t + 100, 300 - C)], v[:, :, t : min(t + 100, 300 - C)])
    append_both((ref, tri), k[:, :, 300 - C :], v[:, :, 300 - C :])
    assert tri.tables.host_columns > 0
    q = torch.randn(B, 4, C, D).to(device)
    start = torch.tensor([0, 70], dtype=torch.int32, device=device)
    for layer in range(L):
        o1, l1 = ref.attend(layer, q, start)
        o2, l2 = tri.attend(layer, q, start)
        torch.testing.assert_close(o2, o1, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(l2, l1, atol=2e-3, rtol=1e-4)
