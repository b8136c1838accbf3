"""Triton decode and prefill kernels vs the reference and an fp64 oracle, on a named grid.

On CPU this runs under TRITON_INTERPRET=1 (set by conftest) with fp32/fp16 inputs (the
interpreter's bf16 dot is broken); on CUDA (gpu marker) with bf16 too. Error budget: the
kernel's error against fp64 may be at most twice the reference's, or a dtype floor.
"""

import pytest
import torch

pytest.importorskip("triton")

from longctx import KVConfig, SharedMemoryError  # noqa: E402
from longctx.ops.paged_attention import paged_attention  # noqa: E402
from longctx.ops.paged_attention import prefill  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402
from longctx.ops.paged_attention import merge as MERGE  # noqa: E402
from longctx.ops.paged_attention import tuning as TUNING  # noqa: E402
from longctx.ops.paged_attention.triton import paged_decode_triton  # noqa: E402
from longctx.ops.paged_attention.tuning import TUNE, loaded, num_splits, programs_fit  # noqa: E402
from longctx.testing import attention_fp64, expected_dense  # noqa: E402

from .test_paged_attention import fill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (B, T, Hq, Hkv, D, block, cfg kwargs, padding, splits)
CASES = [
    (1, 1, 4, 4, 64, 16, dict(bits=4), False, None),
    (2, 63, 9, 3, 64, 16, dict(bits=4), True, None),
    (2, 64, 8, 2, 64, 16, dict(bits=8), False, 3),
    (1, 1000, 8, 1, 128, 64, dict(bits=4), False, None),
    (2, 300, 4, 4, 64, 16, dict(bits=2, rotate=True), True, 5),
    (1, 600, 3, 1, 128, 256, dict(bits=4), False, 2),
    (2, 200, 4, 1, 64, 16, dict(bits=4, k_bits=8), True, 4),
    (1, 130, 8, 2, 128, 16, dict(bits=16), True, 3),
    (2, 97, 8, 2, 64, 32, dict(bits=4, rotate=True), False, 2),
    (1, 257, 4, 2, 64, 16, dict(bits=8, sink_blocks=0), False, 7),
    (1, 150, 4, 2, 128, 16, dict(bits=4, group_size=32), False, 2),
    (1, 150, 4, 2, 128, 16, dict(bits=4, group_size=16), False, 2),  # 8 V groups a token: no word type, 2-byte loads
    (1, 100, 4, 2, 64, 16, dict(bits=4, k_bits=16), False, 2),
    (1, 150, 4, 2, 128, 16, dict(bits=8), True, 2),  # 8-bit V: one group of 128 channels a token (the default)
    (1, 150, 4, 2, 64, 16, dict(bits=2, group_size=8), True, 2),  # int2 V words: a group's 2 bytes a sub-tile, one word
    (1, 150, 4, 2, 64, 16, dict(bits=2, rotate=True, group_size=4), False, 2),  # 1 byte a group: V stays on bytes
    (1, 200, 8, 2, 128, 16, dict(bits=2, rotate=True), True, 3),  # int2 K words in two dots a sub-tile (16 columns each)
    (2, 300, 8, 2, 128, 64, dict(bits=2, rotate=True, k_span=16), True, 3),  # K a scale row per 16 tokens of a page of 64
    (1, 300, 4, 2, 64, 128, dict(bits=4, k_span=32), False, 2),
]


def case_id(c):
    B, T, Hq, Hkv, D, P, kw, pad, sp = c
    name = KVConfig(**kw).describe() + ("" if kw.get("sink_blocks", 1) else "-nosink") + (f"-g{kw['group_size']}" if "group_size" in kw else "")
    name += f"-span{kw['k_span']}" if "k_span" in kw else ""
    return f"B{B}-T{T}-H{Hq}/{Hkv}-D{D}-P{P}-{name}" + ("-pad" if pad else "") + (f"-s{sp}" if sp else "")


def dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_decode_within_budget(case, dtype):
    _within_budget(case, dtype)


def _within_budget(case, dtype, starts=None):
    """The decode kernel's error against fp64 within twice the reference backend's (or the
    dtype's floor); left padding of 4b + 1 tokens in row b where the case pads, or `starts`."""
    B, T, Hq, Hkv, D, P, kw, pad, sp = case
    cfg = KVConfig(block_size=P, **kw)
    cache, k, v = fill(cfg, B, T, 1, Hkv, D, dtype=dtype, seed=T)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(T + 1)).to(dtype)
    start = torch.tensor([min(4 * b + 1, T - 1) for b in range(B)], dtype=torch.int32) if pad else None
    if starts is not None:
        start = torch.tensor(starts, dtype=torch.int32)
    qd = q.to(DEVICE)
    sd = start.to(DEVICE) if start is not None else None
    out, lse = paged_decode_triton(qd, view, sd, D**-0.5, splits=sp)
    ref_out, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=T - 1)
    exact_out, exact_lse = attention_fp64(q, k_exp, v_exp, start)
    err_kernel = (out.cpu().double() - exact_out).abs().max().item()
    err_ref = (ref_out.double() - exact_out).abs().max().item()
    assert torch.isfinite(out).all()
    assert err_kernel <= max(2 * err_ref, FLOOR[dtype]), (err_kernel, err_ref)
    assert (lse.cpu().double() - exact_lse).abs().max().item() <= max(2 * (ref_lse.double() - exact_lse).abs().max().item(), FLOOR[dtype])
    return K.decode_plans(qd, view, sd, D**-0.5, splits=sp)[-1]  # (the call's own plan, from the cache)


def test_decode_plans_are_cached_and_keyed(monkeypatch):
    """A decode call's plan (splits, loop shape, constexprs) is built once and reused while
    what decides it stays: the same call again takes it from the cache and gives the same
    bits; a longer context (more blocks), another TUNE or left padding gets its own plan,
    within the budget."""
    monkeypatch.setattr(K, "_PLANS", {})
    case = (1, 300, 8, 2, 64, 16, dict(bits=4), False, None)
    cfg = KVConfig(block_size=16, bits=4)
    cache, k, v = fill(cfg, 1, 300, 1, 2, 64, dtype=torch.float16, seed=3)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(4)).to(torch.float16).to(DEVICE)
    a, _ = paged_decode_triton(q, view, None, 64**-0.5)
    assert len(K._PLANS) == 1
    b, _ = paged_decode_triton(q, view, None, 64**-0.5)
    assert len(K._PLANS) == 1 and torch.equal(a, b)
    for T in (300, 1000):  # 1000 tokens: more blocks, more splits' work, a plan of its own
        _within_budget(case[:1] + (T,) + case[2:], torch.float16)
    assert len(K._PLANS) == 2  # (300 tokens again, other values in the same shapes: no new plan)
    monkeypatch.setitem(TUNE, "side_short", 0 if TUNE["side_short"] else 2)
    _within_budget(case, torch.float16)
    _within_budget(case, torch.float16, starts=[7])
    assert len(K._PLANS) == 4
    st = K.setup(q[:, :, 0], view, None, "test", consts=False)
    assert K._plan_key(st, q, view, None, None, False) in K._PLANS


# (B, T, Hq, Hkv, D, block, cfg kwargs, padding, splits): tails of 12, 4 and 2 tokens in blocks of 16
DEVICE_TAIL_CASES = [
    (1, 300, 8, 2, 64, 16, dict(bits=4), False, None),
    (2, 200, 4, 1, 64, 16, dict(bits=4, k_bits=8), True, 4),
    (1, 130, 8, 2, 128, 16, dict(bits=16), True, 3),
    (2, 98, 4, 2, 64, 16, dict(bits=4, rotate=True), False, 2),
]


@pytest.mark.parametrize("case", DEVICE_TAIL_CASES, ids=[case_id(c) for c in DEVICE_TAIL_CASES])
def test_device_tail_length(case):
    """A tail whose length is on the device (a CUDA graph's replays advance it) reads the
    tail's first tail_len slots, not the room after them: the same bits as the host length
    where the room stays within the tail's block; within the budget against the host length
    where a whole block of room gives the splits another block to share; and paths without
    device lengths (the reference backend) read it back."""
    import dataclasses

    B, T, Hq, Hkv, D, P, kw, pad, sp = case
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    cfg = KVConfig(block_size=P, **kw)
    cache, _, _ = fill(cfg, B, T, 1, Hkv, D, dtype=dtype, seed=T)
    cache.seal()  # (as a decode step starts: the tail shorter than a block)
    view = _to(cache.view(0), DEVICE)
    t = view.tail_k.shape[2]
    assert 0 < t < P
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(T + 1)).to(dtype).to(DEVICE)
    start = torch.tensor([min(4 * b + 1, T - 1) for b in range(B)], dtype=torch.int32, device=DEVICE) if pad else None
    length = torch.tensor([t], dtype=torch.int32, device=DEVICE)

    def roomy(room: int):
        """The view with `room` slots after the tail, holding values that would swamp any
        softmax that read them."""
        k = torch.cat([view.tail_k, torch.full((B, Hkv, room, D), 300.0, dtype=dtype, device=DEVICE)], 2)
        v = torch.cat([view.tail_v, torch.full((B, Hkv, room, D), -1e3, dtype=dtype, device=DEVICE)], 2)
        return dataclasses.replace(view, tail_k=k, tail_v=v, tail_len=length)

    want, want_lse = paged_decode_triton(q, view, start, D**-0.5, splits=sp)
    got, got_lse = paged_decode_triton(q, roomy(P - t), start, D**-0.5, splits=sp)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    got, got_lse = paged_decode_triton(q, roomy(2 * P - t), start, D**-0.5, splits=sp)
    tol = FLOOR[dtype]
    assert (got.float() - want.float()).abs().max().item() <= tol and (got_lse - want_lse).abs().max().item() <= tol
    ref, ref_lse = paged_attention(q, roomy(P - t), start=start, backend="reference")
    ref_host, ref_host_lse = paged_attention(q, view, start=start, backend="reference")
    assert torch.equal(ref, ref_host) and torch.equal(ref_lse, ref_host_lse)
    with pytest.raises(ValueError, match="tail_len must be an int32"):
        paged_attention(q, dataclasses.replace(roomy(P - t), tail_len=length.long()), start=start, backend="triton")


# (B, T, Hq, Hkv, D, block, cfg kwargs, padding, splits): 18, 12 and 6 blocks a row
DEVICE_COUNT_CASES = [
    (1, 300, 8, 2, 64, 16, dict(bits=4), False, None),
    (2, 200, 4, 1, 64, 16, dict(bits=4, k_bits=8, sink_blocks=2), True, 5),
    (1, 100, 8, 2, 128, 16, dict(bits=16), False, 4),
    (2, 104, 4, 2, 64, 16, dict(bits=2, rotate=True), True, 3),
]


@pytest.mark.parametrize("case", DEVICE_COUNT_CASES, ids=[case_id(c) for c in DEVICE_COUNT_CASES])
def test_device_block_count(case):
    """A table with room whose block count is on the device (seals between a CUDA graph's
    replays add columns in place): the kernel, planned once for the table's width, works out
    each split's share from the count it loads and reads only the counted columns, for every
    count from the full table down to none sealed (the sink blocks clamped to it): against
    the reference over the table cut to the count, and against the same kernel given the
    cut table."""
    import dataclasses

    B, T, Hq, Hkv, D, P, kw, pad, sp = case
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    cfg = KVConfig(block_size=P, **kw)
    cache, _, _ = fill(cfg, B, T, 1, Hkv, D, dtype=dtype, seed=T)
    cache.seal()
    view = _to(cache.view(0), DEVICE)
    nb = view.block_table.shape[1]
    # room: ids of sealed blocks in another order (read by mistake, they would count twice)
    room = view.block_table[:, cfg.sink_blocks :].flip(1)[:, :7]
    wide = dataclasses.replace(view, block_table=torch.cat([view.block_table, room], 1), n_sink=cfg.sink_blocks)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(T + 1)).to(dtype).to(DEVICE)
    start = torch.tensor([min(4 * b + 1, 40) for b in range(B)], dtype=torch.int32, device=DEVICE) if pad else None
    tol = FLOOR[dtype]
    for count in (nb, nb - 1, nb // 2, cfg.sink_blocks, 0):
        dev = dataclasses.replace(wide, n_blocks=torch.tensor([count], dtype=torch.int32, device=DEVICE))
        cut = dataclasses.replace(view, block_table=view.block_table[:, :count], n_sink=min(cfg.sink_blocks, count))
        got, got_lse = paged_decode_triton(q, dev, start, D**-0.5, splits=sp)
        want, want_lse = paged_decode_triton(q, cut, start, D**-0.5, splits=sp)
        ref, ref_lse = paged_attention(q, cut, start=start, backend="reference")
        assert torch.isfinite(got).all(), count
        for other, other_lse in ((want, want_lse), (ref, ref_lse)):
            assert (got.float() - other.float()).abs().max().item() <= tol, count
            assert (got_lse - other_lse).abs().max().item() <= tol, count
        back, back_lse = paged_attention(q, dev, start=start, backend="reference")  # (read back: the same as the cut view)
        assert torch.equal(back, ref) and torch.equal(back_lse, ref_lse)
    with pytest.raises(ValueError, match="n_blocks must be an int32"):
        paged_attention(q, dataclasses.replace(wide, n_blocks=torch.tensor([nb], device=DEVICE)), start=start, backend="triton")


def _to(view, device):
    import dataclasses

    pages = dataclasses.replace(view.pages, **{n: t.to(device) for n, t in view.pages.tensors().items()})
    return dataclasses.replace(view, pages=pages, sink_k=view.sink_k.to(device), sink_v=view.sink_v.to(device),
                               block_table=view.block_table.to(device), tail_k=view.tail_k.to(device), tail_v=view.tail_v.to(device))


def test_dispatch_and_padding_query():
    cfg = KVConfig(bits=4, block_size=16)  # the cache is filled on the CPU; only attention runs on DEVICE
    cache, k, v = fill(cfg, 2, 40, 1, 2, 64)
    q = torch.randn(2, 4, 1, 64)
    view = _to(cache.view(0), DEVICE)
    start = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)  # row 1 sees nothing
    out, lse = paged_attention(q.to(DEVICE), view, start=start, backend="triton")
    assert torch.isfinite(out).all() and (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_num_splits():
    assert num_splits(1, 8, 2048, 132, 4) == 66  # long context: one whole wave, 4 programs per SM
    assert num_splits(8, 8, 512, 132, 4) == 8  # 512 programs of 528 slots, not 9 splits (576: a second wave)
    assert num_splits(1, 8, 2048, 132, 8) == 132
    assert num_splits(1, 8, 4, 132, 4) == 4  # never more splits than blocks
    assert num_splits(256, 8, 8000, 132, 4) == 1  # big batch: one program per row and head
    assert num_splits(1, 8, 2048, 132) == num_splits(1, 8, 2048, 132, TUNE["programs_per_sm"])


def test_programs_fit():
    # 165 registers, 41 KiB of shared memory, 4 warps: 168 registers allocated a thread, 5,376 a
    # warp, 12 warps of 65,536 registers: 3 programs (Nsight Compute on the H200 said 3)
    assert programs_fit(165, 41984, 4) == 3
    assert programs_fit(128, 41984, 4) == 4
    assert programs_fit(64, 41984, 4) == 5  # then shared memory binds: 228 KiB / 42 KiB
    assert programs_fit(64, 8192, 4) == 8  # and registers again: 2,048 a warp, 32 warps
    assert programs_fit(32, 1024, 1) == 32  # never more than 32 blocks
    assert programs_fit(255, 300_000, 8) == 1  # what does not fit still launches one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_fits_one_wave():
    """Long context, batch 1: the (head, split) programs fill whole waves of the programs per SM
    that the compiled kernel's registers and shared memory allow, never more, on both loops
    (int8 pages side by side, bf16 pages the 2-D loop); short contexts take side_short pages
    side by side."""
    from longctx.bench import synthetic_view

    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bits, side, warps, cap, stages in [(8, TUNE["side"], TUNE["side"], TUNE["side_programs"], TUNE["side_stages"]),
                                           (16, 0, TUNE["num_warps"], TUNE["programs16"], TUNE["stages16"])]:
        view = synthetic_view(1, 65536, 8, 128, KVConfig(bits=bits, block_size=64), "cuda")
        paged_attention(q, view, backend="triton")
        plan = K.decode_plans(q, view)[-1]
        k, (rows, splits) = loaded(K.compiled_kernel(plan, q, view)), plan.grid
        slots = min(cap, programs_fit(k.n_regs, k.metadata.shared, warps, torch.cuda.get_device_properties(0))) * sms
        assert plan.summary["side"] == side and k.metadata.num_warps == warps and k.metadata.num_stages == stages
        assert rows == 8 and 0.9 * slots < rows * splits <= slots  # (whole steps per split round a little off)
    # 4k: a page or two per program, side_short of them a step
    view = synthetic_view(1, 4096, 8, 128, KVConfig(bits=4, block_size=64), "cuda")
    paged_attention(q, view, backend="triton")
    plan = K.decode_plans(q, view)[-1]
    k = K.compiled_kernel(plan, q, view)
    assert plan.summary["side"] == TUNE["side_short"] and k.metadata.num_warps == TUNE["side_short"]
    assert plan.grid[1] == 64 // TUNE["side_short"] and k.metadata.num_stages == TUNE["side_stages"]


def _plain_inputs(case, dtype):
    """(q, view) on the device for an unpadded case, as _within_budget builds them."""
    B, T, Hq, Hkv, D, P, kw, pad, sp = case
    cache, _, _ = fill(KVConfig(block_size=P, **kw), B, T, 1, Hkv, D, dtype=dtype, seed=T)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(T + 1)).to(dtype)
    return q.to(DEVICE), _to(cache.view(0), DEVICE)


def _long(case, splits):
    """A CASES case with its split count replaced: programs of more than two pages."""
    return case[:-1] + (splits,)


# cases with pages of at most 4 bits a side and at most 64 tokens, which may go side by side
SIDE_CASES = [_long(CASES[1], 1), _long(CASES[3], 2), _long(CASES[4], 2), _long(CASES[8], 1), _long(CASES[10], 1),
              _long(CASES[11], 2), _long(CASES[17], 2)]


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("case", SIDE_CASES, ids=[case_id(c) for c in SIDE_CASES])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_side_by_side_pages_within_budget(case, side, dtype, monkeypatch):
    """Sealed pages side by side (one a warp, folded into one softmax state at the end), one
    or two a step: K's scales folded into the query and V transposed with its scales folded
    into the probabilities (16-bit inputs), or both in fp32 (fp32 inputs); the grid's error
    budget, with padding, rotation, int2, GQA 3, V groups of 16 and 32, one split and merged
    splits."""
    monkeypatch.setitem(TUNE, "side", side)
    plan = _within_budget(case, dtype)
    half = dtype != torch.float32
    assert plan.summary["side"] == side and plan.summary["k16"] == int(half) and plan.summary["v_transposed"] == half


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("kw", [dict(bits=4), dict(bits=8, sink_blocks=0)], ids=["int4", "int8-nosink"])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_side_by_side_masks_padding_in_sealed_pages(side, kw, dtype, monkeypatch):
    """Left padding past the sink block, so that sealed pages hold padding tokens (the grid's
    padding of a few tokens stays in the sink block): whole padded pages and one cut in the
    middle, in programs of several pages; a row without padding beside it."""
    monkeypatch.setitem(TUNE, "side", side)
    plan = _within_budget((2, 300, 8, 2, 64, 16, kw, True, 3), dtype, starts=[0, 83])
    assert plan.summary["side"] == side


TILE_CASES = [(2, 600, 8, 2, 64, 128, dict(bits=4), True, 2), (1, 700, 4, 1, 128, 256, dict(bits=4, group_size=32), False, 1),
              (2, 520, 9, 3, 64, 128, dict(bits=2, rotate=True), True, 3), (1, 400, 8, 2, 128, 128, dict(bits=8), False, 2),
              (2, 600, 4, 2, 64, 256, dict(bits=4, k_bits=8), True, 1), (2, 400, 8, 2, 128, 64, dict(bits=2, rotate=True, k_span=16), True, 2)]


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("case", TILE_CASES, ids=[case_id(c) for c in TILE_CASES])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_side_by_side_tiles_of_big_pages_within_budget(case, side, dtype, monkeypatch):
    """Pages of 128 and 256 tokens side by side, each as tiles of 64 tokens that share the
    page's K scales: the grid's budget with GQA 3 and 4, int2 with rotation, int8, k8v4, V
    groups of 32, left padding, one split and several."""
    monkeypatch.setitem(TUNE, "side", side)
    monkeypatch.setitem(TUNE, "side_short", side)  # (programs of at most two pages)
    plan = _within_budget(case, dtype)
    assert plan.summary["side"] == side


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("P, starts", [(128, [0, 200]), (256, [70, 333])])
@pytest.mark.parametrize("dtype", dtypes()[1:], ids=lambda d: str(d)[6:])
def test_side_by_side_tiles_mask_padding(P, starts, side, dtype, monkeypatch):
    """Left padding that ends inside a sealed page's second or later tile (rows padded past
    the sink page), in programs of several pages, beside a row padded less."""
    monkeypatch.setitem(TUNE, "side", side)
    monkeypatch.setitem(TUNE, "side_short", side)  # (programs of at most two pages)
    plan = _within_budget((2, 900, 8, 2, 64, P, dict(bits=4), True, 2), dtype, starts=starts)
    assert plan.summary["side"] == side


LOOP_TILES = [
    ((1, 600, 8, 2, 64, 256, dict(bits=16), False, 2), 64),  # the case it is for: 16-bit pages of 256 tokens
    ((2, 330, 9, 3, 64, 64, dict(bits=16), False, 3), 16),  # padding (starts) ends in a sealed page's third tile
    ((2, 420, 4, 1, 64, 128, dict(bits=4, k_bits=16), False, 2), 32),  # and in the sink page's second
    ((1, 300, 8, 2, 128, 64, dict(bits=16, k_bits=4), True, None), 32),
    ((1, 500, 4, 2, 64, 128, dict(bits=4, group_size=32), True, 3), 32),  # quantized pages (TUNE side 0)
    ((2, 260, 8, 2, 64, 64, dict(bits=2, rotate=True), False, 1), 16),
    ((1, 300, 8, 2, 128, 64, dict(bits=2, rotate=True, k_span=16), True, 2), 32),  # a tile over two spans of K's scales
    ((1, 300, 4, 2, 64, 64, dict(bits=4, k_span=16), False, 2), 16),  # a tile a span
]
LOOP_STARTS = {1: [100, 0], 2: [40, 150]}  # (cases' indices in LOOP_TILES)


@pytest.mark.parametrize("i", range(len(LOOP_TILES)), ids=[f"{case_id(c)}-tile{t}" for c, t in LOOP_TILES])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_2d_loop_in_tiles_of_a_page_within_budget(i, dtype, monkeypatch):
    """The 2-D decode loop reading each page (the sink page, sealed pages, the tail) in tiles of
    fewer tokens, K's scales the page's: the budget with 16-bit pages, mixed 16-bit and
    quantized sides, quantized pages, left padding ending inside a tile, GQA 3, splits."""
    case, tile = LOOP_TILES[i]
    monkeypatch.setitem(TUNE, "loop_tile", tile)
    monkeypatch.setitem(TUNE, "side", 0)  # (quantized pages: the 2-D loop)
    monkeypatch.setattr(K, "_PLANS", {})
    plan = _within_budget(case, dtype, starts=LOOP_STARTS.get(i))
    assert plan.summary["tile"] == tile and plan.summary["side"] == 0


def test_loop_tile_option(monkeypatch):
    """TUNE["loop_tile"]: 0 reads whole pages; a tile of a page's size or more, too; anything
    else than a power of two >= 16 is refused. The tiles the auto choice may fall back to."""
    case = (1, 300, 4, 2, 64, 64, dict(bits=16), False, 2)
    monkeypatch.setattr(K, "_PLANS", {})
    for tile in (0, 64, 256):
        monkeypatch.setitem(TUNE, "loop_tile", tile)
        plan = _within_budget(case, torch.float32)
        assert plan.summary["tile"] == 0
    for bad in (8, 48, True, 32.0):
        monkeypatch.setitem(TUNE, "loop_tile", bad)
        with pytest.raises(ValueError, match="loop_tile"):
            _within_budget(case, torch.float32)
        with pytest.raises(ValueError, match="loop_tile"):  # (refused for pages the side loop takes too)
            _within_budget((1, 300, 4, 2, 64, 64, dict(bits=4), False, 2), torch.float32)
    # the tiles a fallback may take (auto: at most 64 tokens; tiles of 128 ran 24 % slower on the H200)
    monkeypatch.setitem(TUNE, "loop_tile", 0)
    assert K.loop_tiles(256) == [64, 32, 16] and K.loop_tiles(128) == [64, 32, 16] and K.loop_tiles(64) == [32, 16] and K.loop_tiles(16) == []
    monkeypatch.setitem(TUNE, "loop_tile", 128)
    assert K.loop_tiles(256) == [128] and K.loop_tiles(128) == []


def test_2d_loop_takes_tiles_where_whole_pages_do_not_fit(monkeypatch):
    """`_loop_fit`: the largest tile, in the most stages, whose decode kernel fits the device's
    shared memory (and spills at most SPILL_MAX words), cached; SharedMemoryError naming the
    smallest tile's need where none fits."""
    made = {(128, 2): (200000, 0), (128, 1): (147712, 0), (64, 2): (120000, 0), (64, 1): (78080, 91), (32, 2): (43264, 23),
            (32, 1): (30000, 0), (16, 2): (30000, 0), (16, 1): (20000, 0)}
    asked = []

    def compiled(fn, grid, args, consts, limit):
        assert fn is K.decode_kernel and consts["DENSE"] == consts["TD"]
        asked.append((consts["TD"], consts["num_stages"]))
        need, spills = made[asked[-1]]
        return need, spills if need <= limit else None

    monkeypatch.setattr(K, "compiled_fit", compiled)
    monkeypatch.setattr(K, "_LOOP_TILES", {})
    monkeypatch.setattr(K, "shared_limit", lambda device: 101376)
    assert K._loop_fit((1,), (), dict(num_stages=2), [128, 64, 32, 16], 0) == (32, 2)
    assert asked == [(128, 2), (128, 1), (64, 2), (64, 1), (32, 2)]
    assert K._loop_fit((1,), (), dict(num_stages=2), [128, 64, 32, 16], 0) == (32, 2) and len(asked) == 5  # cached
    monkeypatch.setattr(K, "shared_limit", lambda device: 10000)
    with pytest.raises(SharedMemoryError, match="needs 20000 bytes .* tiles of 16 tokens, and this GPU allows 10000"):
        K._loop_fit((1,), (), dict(num_stages=2, X=1), [128, 64, 32, 16], 0)


# int8 pages (and mixed int8 K, int4 V), which go side by side too
SIDE8_CASES = [_long(CASES[2], 1), _long(CASES[6], 2), _long(CASES[9], 2), CASES[13]]


@pytest.mark.parametrize("case", SIDE8_CASES, ids=[case_id(c) for c in SIDE8_CASES])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_side_by_side_int8_pages_within_budget(case, dtype):
    """int8 pages side by side (on the GPU through the byte blocks of inline PTX, the codes as
    fp16 subnormals where the probe allows), V transposed for 16-bit inputs."""
    plan = _within_budget(case, dtype)
    half = dtype != torch.float32
    assert plan.summary["side"] == TUNE["side"] and plan.summary["k16"] == int(half) and plan.summary["v_transposed"] == half


def test_tiny_probe_tells_exact_from_flushed_subnormals():
    """The probe's verdict: the exact product passes; operands flushed to zero (what PTX allows
    mma to do with subnormal inputs), or codes that lose their low bit, do not. Then the probe
    itself on this test's device (the interpreter on the CPU), cached."""
    codes, b = TUNING._tiny_probe_inputs()
    exact = ((codes.double() * 2.0**-24) @ b.double()).float()
    assert TUNING._tiny_probe_verdict(exact, codes, b)
    assert not TUNING._tiny_probe_verdict(torch.zeros_like(exact), codes, b)
    truncated = (((codes & ~1).double() * 2.0**-24) @ b.double()).float()
    assert not TUNING._tiny_probe_verdict(truncated, codes, b)
    device = torch.device(DEVICE)
    TUNING._TINY_OK.pop(TUNING._device_key(device), None)
    assert TUNING.tiny_codes_exact(device) is True and TUNING._TINY_OK[TUNING._device_key(device)] is True


def test_side_tiny_falls_back_where_the_probe_fails(monkeypatch):
    """A device whose dots do not multiply subnormal fp16 exactly gets the biased and exact
    codes, within the grid's budget; one whose dots do gets the tiny codes."""
    monkeypatch.setattr(K, "_PLANS", {})
    monkeypatch.setitem(TUNING._TINY_OK, TUNING._device_key(torch.device(DEVICE)), False)
    plan = _within_budget(SIDE_CASES[1], torch.float16)
    assert plan.summary["side"] and not plan.summary["tiny"]
    monkeypatch.setitem(TUNING._TINY_OK, TUNING._device_key(torch.device(DEVICE)), True)
    plan = _within_budget(SIDE_CASES[1], torch.float16)
    assert plan.summary["tiny"]


def test_side_skip_leaves_short_programs_alone():
    """Programs with no sink page and no tail skip those loops only where programs get more than
    two pages: at two (side_short, 4k contexts) skipping measured slower (docs/kernels.md)."""
    short = _long(CASES[1], 4)  # the short-program test's first case
    for case, expect in [(short, False), (SIDE_CASES[1], True)]:
        plan = _within_budget(case, torch.float16)
        assert plan.summary["side"] and plan.summary["short"] == (not expect) and plan.summary["skip"] == expect, case_id(case)


def test_zero_point_dot_for_4_bit_values_only():
    """int4 V takes its zero-point term as a dot, int8 V as a sum (the dot measured slower
    there: docs/kernels.md); fp32 inputs neither (V in fp32)."""
    for case, v_bits in [(SIDE_CASES[1], 4), (SIDE8_CASES[0], 8), (SIDE8_CASES[1], 4)]:
        plan = _within_budget(case, torch.float16)
        assert plan.summary["v_transposed"] and plan.summary["zero_dot"] == (v_bits <= 4), case_id(case)


@pytest.mark.parametrize("side, dense", [(1, 16), (2, 32)], ids=lambda v: str(v))
@pytest.mark.parametrize("case", [_long(CASES[1], 4), _long(CASES[3], 16), _long(CASES[4], 10)], ids=lambda c: case_id(c))
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
def test_side_by_side_short_programs_within_budget(case, side, dense, dtype, monkeypatch):
    """TUNE["side_short"]: programs of a page or two (short contexts) side by side, with more
    warps than pages masking the missing ones; sinks and tail side_dense tokens a step (32: a
    16-token page's one step)."""
    monkeypatch.setitem(TUNE, "side_short", side)
    monkeypatch.setitem(TUNE, "side_dense", dense)
    plan = _within_budget(case, dtype)
    assert plan.summary["side"] == side


def test_side_rule(monkeypatch):
    """Pages of at most 8 bits a side go side by side (`side` pages a step, `side_short` in
    programs of at most two pages), whatever their size (big pages as tiles of 64 tokens);
    pages with a 16-bit side take the 2-D loop, as every page does with side 0."""
    from longctx.quant import BlockFormat

    def fmt(bits, k_bits=None, block=64, k_span=None):
        cfg = KVConfig(bits=bits, k_bits=k_bits, block_size=block, k_span=k_span)
        return BlockFormat(*cfg.layer_bits(0), block, cfg.group_size, 128, 8, torch.bfloat16, cfg.rotate, cfg.key_span)

    monkeypatch.setitem(TUNE, "side_short", 0)
    assert K.side_pages(fmt(4), short=False) == TUNE["side"]
    assert K.side_pages(fmt(4), short=True) == 0  # one or two pages a program: the 2-D loop
    assert K.side_pages(fmt(2, block=16), short=False) == K.side_pages(fmt(2, k_span=16), short=False) == TUNE["side"]
    assert K.side_pages(fmt(4, block=128), short=False) == K.side_pages(fmt(4, block=256), short=False) == TUNE["side"]
    monkeypatch.setitem(TUNE, "side_short", 2)
    assert K.side_pages(fmt(4), short=True) == 2 and K.side_pages(fmt(4), short=False) == TUNE["side"]
    assert K.side_pages(fmt(8), short=False) == K.side_pages(fmt(4, k_bits=8), short=False) == TUNE["side"]
    assert K.side_pages(fmt(16), short=False) == K.side_pages(fmt(4, k_bits=16), short=False) == 0
    assert K.side_pages(fmt(8, block=128), short=False) == TUNE["side"]
    for bad in (3, True, -1):
        monkeypatch.setitem(TUNE, "side", bad)
        with pytest.raises(ValueError, match="TUNE\\['side'\\]"):
            K.side_pages(fmt(4), short=False)
    monkeypatch.setitem(TUNE, "side", 0)
    assert K.side_pages(fmt(4), short=False) == 0


PREFILL_CASES = [
    (1, 200, 37, 8, 2, 64, 16, dict(bits=4)),
    (2, 130, 64, 4, 4, 64, 32, dict(bits=8)),
    (1, 150, 20, 9, 3, 64, 16, dict(bits=2, rotate=True)),
    (1, 40, 40, 4, 1, 128, 16, dict(bits=4)),  # the first chunk: nothing sealed yet
    (1, 300, 40, 8, 2, 128, 64, dict(bits=2, rotate=True, k_span=16)),  # tiles over several spans of K's scales
]


@pytest.mark.parametrize("path", ["kernel", "staged"])
@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-C{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-P{c[6]}-" + KVConfig(**c[7]).describe()
                         + (f"-span{c[7]['k_span']}" if "k_span" in c[7] else ""))
def test_triton_prefill_within_budget(case, dtype, path, monkeypatch):
    """Both prefill paths through paged_attention's dispatch (zero padding stays staged)."""
    B, T, C, Hq, Hkv, D, P, kw = case
    cfg = KVConfig(block_size=P, **kw)
    cache, k, v = fill(cfg, B, T, C, Hkv, D, dtype=dtype, seed=T)
    q = torch.randn(B, Hq, C, D, generator=torch.Generator().manual_seed(T + 2)).to(dtype)
    monkeypatch.setitem(TUNE, "prefill", path)
    monkeypatch.setattr(prefill, "paged_prefill_staged" if path == "kernel" else "paged_prefill_triton", _never)
    out, lse = paged_attention(q.to(DEVICE), _to(cache.view(0), DEVICE), start=torch.zeros(B, dtype=torch.int32, device=DEVICE),
                               backend="triton", return_lse=False)
    assert lse is None and out.shape == q.shape and out.dtype == dtype
    ref_out, _ = paged_attention(q, cache.view(0), backend="reference")
    exact_out, _ = attention_fp64(q, *expected_dense(k, v, cfg, sealed_tokens=T - C))
    err_kernel = (out.cpu().double() - exact_out).abs().max().item()
    err_ref = (ref_out.double() - exact_out).abs().max().item()
    assert err_kernel <= max(2 * err_ref, FLOOR[dtype]), (err_kernel, err_ref)


def _never(*args, **kwargs):
    raise AssertionError("this prefill path must not run here")


def test_triton_prefill_with_padding_or_lse_reads_the_pages(monkeypatch):
    """Left padding or a wanted LSE: the kernel path even where staging is asked for (SDPA's
    flash kernel takes no per-row padding and returns no LSE)."""
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 2, 60, 10, 2, 64)
    q = torch.randn(2, 4, 10, 64)
    start = torch.tensor([0, 7], dtype=torch.int32)
    view = _to(cache.view(0), DEVICE)
    monkeypatch.setitem(TUNE, "prefill", "staged")
    monkeypatch.setattr(prefill, "paged_prefill_staged", _never)
    out, lse = paged_attention(q.to(DEVICE), view, start=start.to(DEVICE), backend="triton")
    ref_out, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    assert torch.allclose(out.cpu(), ref_out, atol=1e-5) and torch.allclose(lse.cpu(), ref_lse, atol=1e-5)


def test_in_kernel_merge_leaves_its_counters_at_zero(monkeypatch):
    """The last split of each head merges and resets its counter: a second call (and any
    other layer) reuses the buffer without clearing it, and gets the same result."""
    _tune(monkeypatch, {"merge": "kernel"})
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 2, 200, 1, 2, 64, dtype=torch.float16, seed=3)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(2, 8, 1, 64, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    first, lse1 = paged_decode_triton(q, view, None, 64**-0.5, splits=5)
    counters = MERGE._COUNTERS[q.device]
    assert (counters == 0).all()
    second, lse2 = paged_decode_triton(q, view, None, 64**-0.5, splits=5)
    assert torch.equal(first, second) and torch.equal(lse1, lse2) and (counters == 0).all()
    # (that the merged result is right is the grid's job: its split cases merge in-kernel)


def _tune(monkeypatch, values: dict) -> None:
    """TUNE's entries set for one test (the one dict every kernel module reads)."""
    for key, value in values.items():
        monkeypatch.setitem(TUNE, key, value)


def _merge_case():
    """Two rows of 881 tokens (56 logical blocks of 16) over two KV heads with four query heads
    each, row 1 left-padded past its first 300 tokens (with 7 or 8 splits its first two see
    no key): (q, start, cache, k, v, cfg) on the CPU, for the merge tests."""
    B, T, Hq, Hkv, D, P = 2, 16 * 55 + 1, 8, 2, 64, 16
    cfg = KVConfig(bits=4, block_size=P, sink_blocks=0)
    cache, k, v = fill(cfg, B, T, 1, Hkv, D, dtype=torch.float16, seed=11)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(12)).half()
    return q, torch.tensor([0, 300], dtype=torch.int32), cache, k, v, cfg


def _merged_within_budget(out, lse, q, start, cache, k, v, cfg):
    """A merged output and LSE within twice the reference's error against the fp64 oracle."""
    ref_out, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=k.shape[2] // cfg.block_size * cfg.block_size)  # whole blocks are sealed
    exact_out, exact_lse = attention_fp64(q, k_exp, v_exp, start)
    err = (out.cpu().double() - exact_out).abs().max().item()
    err_ref = (ref_out.double() - exact_out).abs().max().item()
    assert err <= max(2 * err_ref, FLOOR[torch.float16]), (err, err_ref)
    err_lse = (lse.cpu().double() - exact_lse).abs().max().item()
    assert err_lse <= max(2 * (ref_lse.double() - exact_lse).abs().max().item(), FLOOR[torch.float16]), err_lse


@pytest.mark.parametrize("tree, splits", [(2, 7), (3, 7), (4, 8), (8, 7), (2, 2)], ids=lambda x: str(x))
def test_in_kernel_merge_in_two_levels(tree, splits, monkeypatch):
    """TUNE["merge_tree"]: the splits merge in groups of `tree` (the last group smaller where
    they do not divide), then the groups; one group writes the output at once. Against the
    reference and the fp64 oracle (one row left-padded past its first splits, whose partials
    see no key), as the grid holds the flat merge; the counters end at zero, and a second
    call gives the same bits."""
    _tune(monkeypatch, {"merge": "kernel", "merge_tree": tree, "merge_tree_from": 0})
    q, start, cache, k, v, cfg = _merge_case()
    view = _to(cache.view(0), DEVICE)
    out, lse = paged_decode_triton(q.to(DEVICE), view, start.to(DEVICE), q.shape[-1]**-0.5, splits=splits)
    plan = K.decode_plans(q.to(DEVICE), view, start.to(DEVICE), splits=splits)[-1]
    assert plan.grid == (q.shape[0] * k.shape[1], splits) and plan.summary["tree"] == tree  # (rows x KV heads, splits)
    assert (MERGE._COUNTERS[q.to(DEVICE).device] == 0).all()
    again, lse2 = paged_decode_triton(q.to(DEVICE), view, start.to(DEVICE), q.shape[-1]**-0.5, splits=splits)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
    _merged_within_budget(out, lse, q, start, cache, k, v, cfg)


def _replays(g, outs, n=3):
    """The outputs of n replays of CUDA graph g, each cloned after its replay."""
    res = []
    for _ in range(n):
        g.replay()
        torch.cuda.synchronize()
        res.append([o.clone() for o in outs])
    return res


def _rewritten_views_graph(B, T, bits):
    """Two bench views (Llama-3's heads, pages of 64, CUDA) and a CUDA graph capture helper
    that, before each view's call, writes its K codes (zeros, then the saved codes: a kernel
    the call must wait for): (views, q, capture), capture() -> (graph, outputs)."""
    from longctx.bench import synthetic_view

    vs = [synthetic_view(B, T, 8, 128, KVConfig(bits=bits, block_size=64), "cuda", seed=s) for s in (0, 1)]
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    codes = [next(t for n, t in v.pages.tensors().items() if n in ("k_codes", "k")) for v in vs]
    saved = [c.clone() for c in codes]

    def capture():
        outs = [torch.empty(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in vs]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c, s, v, o in zip(codes, saved, vs, outs):
                c.zero_()
                c.copy_(s)
                o.copy_(paged_decode_triton(q, v, None, 128**-0.5)[0])
        return g, outs

    return vs, q, capture


@pytest.mark.parametrize("tune", [{"side": 3}, {"side_short": 3}, {"side": True}, {"merge": "grid"}, {"loop_tile": 48}, {"side_tiny": True},
                                  {"pages": 2}])
def test_unknown_kernel_options_are_refused(tune, monkeypatch):
    """A typo in TUNE, or a knob it no longer has, must not silently run another code path."""
    _tune(monkeypatch, {**tune})
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 1, 40, 1, 2, 64, dtype=torch.float16)
    q = torch.randn(1, 4, 1, 64).half().to(DEVICE)
    with pytest.raises(ValueError, match="TUNE"):
        paged_decode_triton(q, _to(cache.view(0), DEVICE), None, 64**-0.5)


@pytest.mark.parametrize("side", ["k_codes", "v_codes"])
def test_int2_codes_at_an_odd_address_are_refused(side):
    """The side loop reads int2 codes as 16-bit words: a pool that starts at an odd address (a
    view into a larger buffer) is refused with an error naming the side, where the GPU would
    fault on the misaligned loads; the same codes copied to an aligned pool decode as before."""
    import dataclasses

    cfg = KVConfig(bits=2, rotate=True, block_size=16)
    cache, _, _ = fill(cfg, 1, 100, 1, 2, 64, dtype=torch.float16, seed=5)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    codes = getattr(view.pages, side)
    buf = torch.empty(codes.numel() + 1, dtype=torch.uint8, device=DEVICE)
    odd = buf[1:].view(codes.shape)
    odd.copy_(codes)
    bad = dataclasses.replace(view, pages=dataclasses.replace(view.pages, **{side: odd}))
    with pytest.raises(ValueError, match=f"int2 {side[0].upper()} codes .* even address"):
        paged_decode_triton(q, bad, None, 64**-0.5)
    even = buf[: codes.numel()].view(codes.shape)
    even.copy_(codes)
    good = dataclasses.replace(view, pages=dataclasses.replace(view.pages, **{side: even}))
    assert torch.equal(paged_decode_triton(q, good, None, 64**-0.5)[0], paged_decode_triton(q, view, None, 64**-0.5)[0])


ROTATED_CASES = [
    (2, 300, 8, 2, 64, 16, dict(bits=4, rotate=True), True, 5),
    (1, 260, 4, 1, 128, 64, dict(bits=2, rotate=True), False, None),
    (2, 97, 6, 2, 64, 32, dict(bits=4, k_bits=8, rotate=True), False, 2),
    (1, 150, 4, 2, 64, 16, dict(bits=8, rotate=True), True, 3),
    (1, 40, 4, 2, 64, 16, dict(bits=4, rotate=True), False, 1),
]


@pytest.mark.parametrize("merge", ["kernel", "launch"])
@pytest.mark.parametrize("case", ROTATED_CASES, ids=[case_id(c) for c in ROTATED_CASES])
def test_rotated_partials_merge_as_unrotated_ones(case, merge, monkeypatch):
    """Each program rotates its queries and its sealed pages' share back, so rotated pages'
    splits merge in both merge modes the unrotated ones have: in the last split, in a launch."""
    monkeypatch.setitem(TUNE, "merge", merge)
    plan = _within_budget(case, dtypes()[-1])
    assert plan.summary["merge"] == (merge if plan.splits > 1 else "")


@pytest.mark.parametrize("splits", [1, 5, 37, 131])
@pytest.mark.parametrize("chunk, cols", [(0, 0), (2, 0), (8, 16), (64, 0), (0, 32)])
def test_merge_kernel_chunks(splits, chunk, cols):
    """The merge launch (TUNE["merge"] "launch", as under CUDA graphs) against torch's
    log-sum-exp merge, reading the splits all at once (chunk 0) or `chunk` at a time (more
    than 128 splits at once spill), a program all D columns (cols 0) or `cols` of
    them (TUNE["merge_cols"]); splits that saw no key (LSE -inf) weigh nothing, and a head
    none of whose splits saw a key gets zeros and -inf."""
    B, Hq, D = 2, 3, 64
    g = torch.Generator().manual_seed(splits * 100 + chunk + cols)
    o = torch.randn(B, Hq, splits, D, generator=g)
    lse = torch.randn(B, Hq, splits, generator=g) * 4
    lse[0, 1, ::3] = float("-inf")
    lse[1, 2] = float("-inf")  # this head saw nothing
    out = torch.empty(B, Hq, 1, D, dtype=torch.float32)
    lout = torch.empty(B, Hq, 1, dtype=torch.float32)
    o, lse, out, lout = (t.to(DEVICE) for t in (o, lse, out, lout))
    lout.fill_(7.0)
    MERGE.merge_kernel[(B * Hq, D // cols if cols else 1)](o, lse, out, lout, splits, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                                                          lse.stride(1), out.stride(0), out.stride(1), HQ=Hq, D=D,
                                                          S_PAD=max(2, 1 << (splits - 1).bit_length()), SC=chunk, BD=cols)
    o, lse, out, lout = (t.cpu().double() for t in (o, lse, out, lout))
    ref_lse = torch.logsumexp(lse, -1)
    w = torch.exp(lse - torch.where(torch.isfinite(ref_lse), ref_lse, 0.0)[..., None])
    ref = torch.where(torch.isfinite(ref_lse)[..., None], (o * w[..., None]).sum(-2), 0.0)
    assert torch.allclose(out[:, :, 0], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lout[:, :, 0]), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lout[:, :, 0][fin], ref_lse[fin], atol=1e-5)
    assert (out[1, 2] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cols", [16, 32, 64])
def test_merge_launch_column_blocks_under_graphs(cols, monkeypatch):
    """Under CUDA graph capture the splits merge in a second launch; at batch 1 its programs
    take blocks of TUNE["merge_cols"] columns (as many as the SMs hold, `merge_cols`). A
    replay gives what one program a head gives, to the rounding of the sums' order, and that
    is within the reference's budget. Two views alternate in the graph."""
    from longctx.bench import synthetic_view

    vs = [synthetic_view(1, 16384, 8, 128, KVConfig(bits=4, block_size=64), "cuda", seed=s) for s in (0, 1)]
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)

    def replayed():
        outs = [torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in vs]
        paged_decode_triton(q, vs[0], None, 128**-0.5)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for v, o in zip(vs, outs):
                o.copy_(paged_decode_triton(q, v, None, 128**-0.5)[0])
        assert K.decode_plans(q, vs[0])[-1].grid[1] > 1
        return _replays(g, outs)

    _tune(monkeypatch, {"merge_cols": 0})
    plain = replayed()
    _tune(monkeypatch, {"merge_cols": cols})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bd = MERGE.merge_cols(128, 32, sms)
    blocks = 128 // bd if bd else 1
    assert 32 * blocks <= sms and (blocks == 128 // cols or 64 * blocks > sms)
    got = replayed()
    for a, b in zip(plain, got):
        for x, y in zip(a, b):  # (the sums over the splits may run in another order)
            assert torch.allclose(x.float(), y.float(), rtol=2**-7, atol=2**-7 * y.float().abs().max().item())
    for v, o in zip(vs, got[0]):
        ref, _ = paged_attention(q, v, backend="reference")
        assert (o.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


def test_merge_tree_rule(monkeypatch):
    """merge_tree: groups of TUNE["merge_tree"] splits from TUNE["merge_tree_from"] splits on
    (fewer: the last split merges all); 0 turns the groups off."""
    for tree, start, splits, want in [(16, 64, 128, 16), (16, 64, 64, 16), (16, 64, 63, 0), (16, 64, 32, 0), (8, 0, 2, 8), (0, 0, 256, 0)]:
        monkeypatch.setitem(TUNE, "merge_tree", tree)
        monkeypatch.setitem(TUNE, "merge_tree_from", start)
        assert MERGE.merge_tree(splits) == want, (tree, start, splits)


def test_merge_column_blocks_fill_idle_sms(monkeypatch):
    """merge_cols: blocks of TUNE["merge_cols"] columns while the merge's programs (heads x
    blocks) stay within one per SM; all columns (0) otherwise."""
    for cols, D, heads, sms, want in [(32, 128, 32, 132, 32), (16, 128, 32, 132, 32), (16, 128, 8, 132, 16), (64, 128, 32, 132, 64),
                                      (32, 128, 256, 132, 0), (32, 128, 100, 132, 0), (32, 128, 66, 132, 64), (32, 64, 32, 132, 32),
                                      (0, 128, 1, 132, 0), (128, 128, 1, 132, 0), (256, 128, 1, 132, 0)]:
        monkeypatch.setitem(TUNE, "merge_cols", cols)
        assert MERGE.merge_cols(D, heads, sms) == want, (cols, D, heads, sms)


def test_merge_option(monkeypatch):
    """TUNE["merge"]: "auto" merges in the decode launch when eager and in a launch of its own
    under graph capture; "kernel" and "launch" whatever the capture; anything else is refused."""
    for option, capturing, want in [("auto", False, "kernel"), ("auto", True, "launch"), ("kernel", True, "kernel"), ("launch", False, "launch")]:
        monkeypatch.setitem(TUNE, "merge", option)
        assert MERGE.merge_mode(capturing) == want
    for bad in ("grid", "fused"):
        monkeypatch.setitem(TUNE, "merge", bad)
        with pytest.raises(ValueError, match="merge"):
            MERGE.merge_mode(False)


def test_head_dims_the_kernels_cannot_tile_go_to_the_reference():
    from longctx.errors import BackendUnavailableError
    from longctx.ops.backend import resolve_backend

    x = torch.zeros(1, device=DEVICE)
    assert resolve_backend("auto", x, 96) == "reference"  # e.g. Phi-3: head_dim 96
    assert resolve_backend("auto", x, 32) == "reference"  # (on an H200 the 4- and 2-bit decode loops do not compile at 32)
    assert resolve_backend("triton", x, 64) == "triton"
    for d in (96, 32, 16):
        with pytest.raises(BackendUnavailableError, match="power-of-two head_dim >= 64"):
            resolve_backend("triton", x, d)
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 1, 40, 1, 1, 96)
    with pytest.raises(BackendUnavailableError, match="power-of-two head_dim"):
        paged_attention(torch.randn(1, 2, 1, 96), cache.view(0), backend="triton")
    out, _ = paged_attention(torch.randn(1, 2, 1, 96), cache.view(0))  # auto: the reference serves it
    assert torch.isfinite(out).all()


# Prefill chunks through the kernel over the pages: (B, T, C, Hq, Hkv, D, block, cfg kwargs,
# padding, splits). Splits None: the launcher's choice, which splits the KV length where the
# query blocks alone leave the GPU (4 "SMs" under the interpreter) idle (the C=7 and C=9
# cases), merged by the merge kernel.
KERNEL_PREFILL = [
    (1, 100, 7, 4, 2, 64, 16, dict(bits=4), False, None),
    (2, 150, 20, 9, 3, 64, 16, dict(bits=4), True, 3),
    (1, 300, 33, 4, 4, 64, 16, dict(bits=2, rotate=True), False, 4),
    (2, 200, 16, 8, 2, 128, 64, dict(bits=8), True, None),
    (1, 130, 40, 8, 1, 64, 16, dict(bits=16), False, 2),
    (2, 97, 5, 4, 1, 64, 32, dict(bits=4, k_bits=8, rotate=True), True, None),
    (1, 120, 9, 4, 2, 64, 16, dict(bits=4, sink_blocks=0), False, None),
    (1, 200, 130, 8, 2, 64, 16, dict(bits=4), False, None),
]


def prefill_id(c):
    B, T, C, Hq, Hkv, D, P, kw, pad, sp = c
    return (f"B{B}-T{T}-C{C}-H{Hq}/{Hkv}-D{D}-P{P}-{KVConfig(**kw).describe()}" + ("" if kw.get("sink_blocks", 1) else "-nosink")
            + ("-pad" if pad else "") + (f"-s{sp}" if sp else ""))


@pytest.mark.parametrize("dtype", dtypes(), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", KERNEL_PREFILL, ids=[prefill_id(c) for c in KERNEL_PREFILL])
def test_prefill_kernel_within_budget(case, dtype):
    """The kernel alone, with splits, GQA, rotation, mixed bits, no sinks, left padding
    (row 1 starts inside the chunk) and the LSE."""
    _prefill_within_budget(case, dtype)


@pytest.mark.parametrize("rot_query, rot_out", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["in-kernel", "query-in-kernel", "out-in-kernel", "launches"])
@pytest.mark.parametrize("case", [c for c in KERNEL_PREFILL if c[7].get("rotate")],
                         ids=[prefill_id(c) for c in KERNEL_PREFILL if c[7].get("rotate")])
def _prefill_within_budget(case, dtype):
    B, T, C, Hq, Hkv, D, P, kw, pad, sp = case
    cfg = KVConfig(block_size=P, **kw)
    cache, k, v = fill(cfg, B, T, C, Hkv, D, dtype=dtype, seed=T)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(B, Hq, C, D, generator=torch.Generator().manual_seed(T + 2)).to(dtype)
    if pad is True:  # row 1 of a padded batch starts inside the chunk: its first queries see nothing
        pad = [min(4 * b + 1, T - 1) if b == 0 else T - C + 2 for b in range(B)]
    start = torch.tensor(pad, dtype=torch.int32) if pad else None  # (or each row's first position, given)
    out, lse = prefill.paged_prefill_triton(q.to(DEVICE), view, start.to(DEVICE) if pad else None, D**-0.5, splits=sp)
    ref_out, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    k_exp, v_exp = expected_dense(k, v, cfg, sealed_tokens=T - C)
    exact_out, exact_lse = attention_fp64(q, k_exp, v_exp, start)
    out, lse = out.cpu().double(), lse.cpu().double()
    assert out.shape == (B, Hq, C, D) and lse.shape == (B, Hq, C)
    assert torch.isfinite(out).all()
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (out[~seen] == 0).all()  # queries that see no key
    err_kernel = (out - exact_out).abs().max().item()
    err_ref = (ref_out.double() - exact_out).abs().max().item()
    assert err_kernel <= max(2 * err_ref, FLOOR[dtype]), (err_kernel, err_ref)
    err_lse = (lse[seen] - exact_lse[seen]).abs().max().item()
    assert err_lse <= max(2 * (ref_lse.double()[seen] - exact_lse[seen]).abs().max().item(), FLOOR[dtype]), err_lse


# Pages read in tiles of fewer tokens (TUNE["prefill_tile"]; on a GPU, where a whole page does
# not fit its shared memory): (case as KERNEL_PREFILL, padding as each row's first position, tile)
TILED_PREFILL = [
    ((2, 300, 20, 8, 2, 64, 64, dict(bits=4), [83, 0], 3), 16),  # padding ends in a sealed page's second tile
    ((1, 260, 130, 4, 1, 64, 64, dict(bits=2, rotate=True), False, None), 32),  # query blocks end in different tail tiles
    ((2, 200, 9, 4, 2, 128, 64, dict(bits=8), [0, 40], 2), 16),  # and in the sink page's third
    ((1, 230, 37, 8, 2, 64, 64, dict(bits=16), [150], 4), 32),
    ((1, 180, 11, 4, 2, 64, 128, dict(bits=4, k_bits=8), False, 3), 32),
]


@pytest.mark.parametrize("case, tile", TILED_PREFILL, ids=[f"{prefill_id(c)}-tile{t}" for c, t in TILED_PREFILL])
def test_prefill_kernel_in_tiles_of_a_page(case, tile, monkeypatch):
    """The prefill kernel reading each page as tiles of fewer tokens (the sink page, sealed
    pages and the tail alike; K's scales the page's) keeps its budget: left padding that ends
    inside a tile, splits, query blocks whose causal ends fall in different tail tiles,
    rotation, 16-bit and mixed-bits pages, and the LSE."""
    monkeypatch.setitem(TUNE, "prefill_tile", tile)
    launched = []
    real = prefill._prefill_fit

    def spy(*args):  # records the tile each launch takes
        consts = real(*args)
        launched.append(consts["TP"])
        return consts

    monkeypatch.setattr(prefill, "_prefill_fit", spy)
    _prefill_within_budget(case, dtypes()[-1])
    assert launched == [tile]


def test_prefill_tiles(monkeypatch):
    """The tiles a prefill step may take: the page, or 128 tokens of a longer one, and their
    halves down to 16 tokens (auto); or the one asked for, never more than the page; anything
    else refused."""
    assert prefill.prefill_tiles(256) == [128, 64, 32, 16] and prefill.prefill_tiles(64) == [64, 32, 16]
    assert prefill.prefill_tiles(16) == [16]
    monkeypatch.setitem(TUNE, "prefill_tile", 256)
    assert prefill.prefill_tiles(256) == [256] and prefill.prefill_tiles(32) == [32]
    for bad in (8, 48, -16, True, 64.0):
        monkeypatch.setitem(TUNE, "prefill_tile", bad)
        with pytest.raises(ValueError, match="prefill_tile"):
            prefill.prefill_tiles(64)


def test_prefill_takes_the_largest_tile_that_fits(monkeypatch):
    """On a GPU the prefill launch takes the largest tile, in the most stages, whose kernel fits
    the device's shared memory and spills at most SPILL_MAX words a thread (TP 0: the whole
    page); where all that fit spill more, the least spilling; where none fits even in one
    stage, SharedMemoryError names the smallest tile's need; the choice is cached, apart for
    each tile option."""
    from types import SimpleNamespace

    # by (tile, stages): (shared bytes, local words a thread) for int4 pages of 256 tokens: sizes of sm_90 and sm_89 compiles, some made up
    made = {(0, 2): (262144, 0), (128, 2): (163840, 0), (64, 2): (114688, 32), (32, 2): (90000, 0), (16, 2): (80000, 0),
            (0, 1): (131072, 0), (128, 1): (98304, 148), (64, 1): (81920, 0), (32, 1): (70000, 0), (16, 1): (60000, 0)}
    asked = []

    def compiled(grid, args, consts, limit):
        asked.append((consts["TP"], consts["num_stages"]))
        need, spills = made[asked[-1]]
        return need, spills if need <= limit else None

    monkeypatch.setattr(prefill, "_compiled", compiled)
    monkeypatch.setattr(prefill, "_TILES", {})
    gpu = SimpleNamespace(gpu=True, device=0)
    for tile, limit, want in ((0, 232448, [(128, 2)]), (0, 101376, [(128, 2), (128, 1), (64, 2), (64, 1)]),
                              (0, 120000, [(128, 2), (128, 1), (64, 2)]), (256, 232448, [(0, 2), (0, 1)]), (256, 300000, [(0, 2)]),
                              (32, 101376, [(32, 2)])):
        monkeypatch.setitem(TUNE, "prefill_tile", tile)
        monkeypatch.setattr(prefill, "shared_limit", lambda device, limit=limit: limit)
        asked.clear()
        got = prefill._prefill_fit((1,), (), dict(num_stages=2, X=limit), 256, gpu)
        assert asked == want and (got["TP"], got["num_stages"]) == want[-1], (tile, limit, got, asked)
        assert prefill._prefill_fit((1,), (), dict(num_stages=2, X=limit), 256, gpu) == got and len(asked) == len(want)  # cached
    made.update({(64, 2): (114688, 100), (64, 1): (81920, 90), (32, 2): (90000, 80), (32, 1): (70000, 70), (16, 2): (80000, 99), (16, 1): (60000, 75)})
    monkeypatch.setitem(TUNE, "prefill_tile", 0)  # all that fit spill: the least spilling
    monkeypatch.setattr(prefill, "shared_limit", lambda device: 101376)
    asked.clear()
    got = prefill._prefill_fit((1,), (), dict(num_stages=2, X=1), 256, gpu)
    assert (got["TP"], got["num_stages"]) == (32, 1) and len(asked) == 8
    monkeypatch.setattr(prefill, "shared_limit", lambda device: 50000)
    with pytest.raises(SharedMemoryError, match="needs 60000 bytes .* tiles of 16 tokens, and this GPU allows 50000"):
        prefill._prefill_fit((1,), (), dict(num_stages=2), 256, gpu)
    assert prefill._prefill_fit((1,), (), dict(num_stages=2), 256, SimpleNamespace(gpu=False))["TP"] == 128  # the CPU: the first
    assert prefill._prefill_fit((1,), (), dict(num_stages=2), 64, SimpleNamespace(gpu=False))["TP"] == 0  # (the whole page)


def test_prefill_path(monkeypatch):
    fmt = {bits: fill(KVConfig(bits=bits, block_size=16), 1, 20, 4, 1, 64)[0].view(0).pages.fmt for bits in (4, 8, 16)}
    staged_from = TUNE["prefill_staged_from"]
    for bits in (4, 8):
        assert prefill.prefill_path(staged_from - 1, fmt[bits]) == "kernel" and prefill.prefill_path(staged_from, fmt[bits]) == "staged"
    assert prefill.prefill_path(8, fmt[16]) == "staged"  # the kernel not measured on 16-bit pages
    # rotated pages alike (their gather rotates each page back on tensor cores)
    rot = {bits: fill(KVConfig(bits=bits, rotate=True, block_size=16), 1, 20, 4, 1, 64)[0].view(0).pages.fmt for bits in (2, 4, 8)}
    for bits in (2, 4, 8):
        assert prefill.prefill_path(staged_from - 1, rot[bits]) == "kernel" and prefill.prefill_path(staged_from, rot[bits]) == "staged"
    monkeypatch.setitem(TUNE, "prefill", "kernel")
    assert prefill.prefill_path(10**6, fmt[16]) == "kernel"
    monkeypatch.setitem(TUNE, "prefill", "fast")
    with pytest.raises(ValueError, match="prefill"):
        prefill.prefill_path(8, fmt[4])


@pytest.mark.parametrize("C", [1, 20])
def test_a_strided_start_is_read_by_row(C):
    """`start` taken as a view with a stride (every other row of a longer tensor): the
    kernels read row b's first position at start + b, so the call makes it contiguous."""
    cfg = KVConfig(bits=4, block_size=16)  # (the cache is filled on the CPU; attention runs on DEVICE)
    cache, _, _ = fill(cfg, 3, 90, C, 2, 64)
    view = _to(cache.view(0), DEVICE)
    q = torch.randn(3, 8, C, 64, generator=torch.Generator().manual_seed(2))
    wide = torch.tensor([0, 99, 17, 99, 40, 99], dtype=torch.int32)
    out, lse = paged_attention(q.to(DEVICE), view, start=wide.to(DEVICE)[::2], backend="triton")
    want, want_lse = paged_attention(q.to(DEVICE), view, start=wide[::2].contiguous().to(DEVICE), backend="triton")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, ref_lse = paged_attention(q, cache.view(0), start=wide[::2].contiguous(), backend="reference")
    assert torch.allclose(out.cpu(), ref, atol=1e-4) and torch.allclose(lse.cpu(), ref_lse, atol=1e-4)


def _beams(cfg, B, T, own, Hkv, D, dtype, seed, prompts=1):
    """A one-layer cache as beam search leaves it: `prompts` prompts of T tokens prefilled
    once and each row repeated B // prompts times (the sealed blocks shared), then `own`
    tokens of each row's own (its own blocks once sealed) and a decode step's token in the
    tail."""
    from longctx.cache import PagedKVCache

    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=Hkv, head_dim=D)
    kv = [torch.randn(prompts, Hkv, T, D, generator=g).to(dtype) for _ in range(2)]
    cache.append(0, *kv)
    cache.seal()
    cache.select_rows([r // (B // prompts) for r in range(B)])
    for n in (own, 1):
        cache.seal()
        cache.append(0, *[torch.randn(B, Hkv, n, D, generator=g).to(dtype) for _ in range(2)])
    return cache


# (B, T, own tokens, Hq, Hkv, D, block, cfg kwargs, starts, queries, R, prompts): R, the rows a
# group of the shared launch takes, from B, G, the queries a program (TUNE["shared_rows"]) and
# the runs (B // prompts beams a prompt)
SHARED_CASES = [
    (4, 200, 40, 8, 2, 64, 16, dict(bits=4), None, 8, 2, 1),  # (the default: two groups of two beams)
    (6, 150, 20, 8, 2, 64, 16, dict(bits=8), [3, 3, 3, 9, 9, 9], 16, 3, 1),
    (8, 130, 33, 2, 2, 64, 16, dict(bits=2, rotate=True), None, 8, 8, 1),
    (2, 120, 10, 8, 1, 128, 16, dict(bits=16), [5, 5], 16, 2, 1),
    (4, 300, 70, 8, 2, 64, 32, dict(bits=4, k_bits=8, sink_blocks=2), [0, 7, 0, 40], 16, 4, 1),
    (4, 257, 30, 12, 4, 64, 16, dict(bits=4, rotate=True, sink_blocks=0), None, 16, 4, 1),  # GQA 3: 12 queries of 16
    (8, 160, 20, 8, 2, 64, 16, dict(bits=4), [0, 0, 0, 0, 9, 9, 9, 9], 8, 2, 2),  # two prompts' four beams
    (6, 140, 30, 2, 2, 64, 16, dict(bits=8), None, 8, 3, 2),  # two prompts' three beams: one group a prompt
]


@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: f"B{c[0]}x{c[11]}-T{c[1]}+{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-P{c[6]}-" + KVConfig(**c[7]).describe() + ("-pad" if c[8] else ""))
def test_shared_blocks_read_once_for_a_group(case, monkeypatch):
    """Rows that hold their first blocks alike (beams over one prompt) take two launches: the
    shared blocks once for each group of R rows, their queries stacked as one program's, and
    each row's own blocks and tail; one merge; groups within each prompt's run of beams. Against the same kernel over whole rows and the
    reference: every row's output and LSE (rows differ in their queries, their own blocks and
    where padding allows, their starts, so a row's queries or partials sent to another's slot
    fail), with the host's lengths and with the device's (a CUDA graph's view: a wider table
    with its count, the tail's length)."""
    import dataclasses

    B, T, own, Hq, Hkv, D, P, kw, starts, queries, R, prompts = case
    monkeypatch.setitem(TUNE, "shared_rows", queries)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    cfg = KVConfig(block_size=P, **kw)
    cache = _beams(cfg, B, T, own, Hkv, D, dtype, seed=T, prompts=prompts)
    view = _to(cache.view(0), DEVICE)
    c = T // P
    assert view.shared == c and view.shared_run == B // prompts and view.block_table.shape[1] == (T + own) // P
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(T + 1)).to(dtype).to(DEVICE)
    start = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if starts else None
    monkeypatch.setitem(TUNE, "shared_from", 0)
    assert K.shared_rows(B, Hq // Hkv, c, P, view.shared_run) == 1
    whole, whole_lse = paged_decode_triton(q, view, start, D**-0.5)
    assert len(K.decode_plans(q, view, start, D**-0.5)) == 1
    monkeypatch.setitem(TUNE, "shared_from", P)
    assert K.shared_rows(B, Hq // Hkv, c, P, view.shared_run) == R
    ref, ref_lse = paged_attention(q, view, start=start, backend="reference")
    tol = FLOOR[dtype]
    wide = dataclasses.replace(view, block_table=torch.cat([view.block_table, view.block_table[:, :5]], 1),
                               n_blocks=torch.tensor([view.block_table.shape[1]], dtype=torch.int32, device=DEVICE),
                               tail_k=torch.cat([view.tail_k, torch.full_like(view.tail_k[:, :, :3], 300.0)], 2),
                               tail_v=torch.cat([view.tail_v, torch.full_like(view.tail_v[:, :, :3], -1e3)], 2),
                               tail_len=torch.tensor([view.tail_k.shape[2]], dtype=torch.int32, device=DEVICE), n_sink=cfg.sink_blocks)
    for v in (view, wide):
        got, got_lse = paged_decode_triton(q, v, start, D**-0.5)
        plans = K.decode_plans(q, v, start, D**-0.5)
        assert len(plans) == 2 and plans[0].consts["R"] == R and plans[1].consts["R"] == 1
        assert torch.isfinite(got).all()
        for other, other_lse in ((whole, whole_lse), (ref, ref_lse)):
            assert (got.float() - other.float()).abs().max().item() <= tol
            assert (got_lse - other_lse).abs().max().item() <= tol


def test_shared_rows_rule(monkeypatch):
    """The shared blocks' launch only where they reach TUNE["shared_from"] tokens, over the
    largest group of rows dividing the batch whose queries fit TUNE["shared_rows"]; bad knobs
    are refused."""
    assert (TUNE["shared_from"], TUNE["shared_rows"], TUNE["shared_warps"]) == (8192, 8, 1)
    assert K.shared_rows(4, 4, 128, 64) == 2  # 8k tokens, 4 beams of GQA 4: two rows' 8 queries a program
    assert K.shared_rows(4, 4, 127, 64) == 1  # below 8k tokens: whole rows
    assert K.shared_rows(3, 4, 2048, 64) == 1 and K.shared_rows(8, 2, 2048, 64) == 4 and K.shared_rows(6, 1, 2048, 64) == 6
    assert K.shared_rows(4, 8, 2048, 64) == 1 and K.shared_rows(1, 4, 2048, 64) == 1
    assert K.shared_rows(8, 1, 2048, 64, run=4) == 4 and K.shared_rows(6, 1, 2048, 64, run=3) == 3  # (groups within runs)
    with pytest.raises(ValueError, match="do not divide"):
        K.shared_rows(6, 1, 2048, 64, run=4)
    monkeypatch.setitem(TUNE, "shared_rows", 16)
    assert K.shared_rows(8, 4, 2048, 64) == 4 and K.shared_rows(6, 4, 2048, 64) == 3 and K.shared_rows(5, 4, 2048, 64) == 1
    assert K.shared_rows(4, 8, 2048, 64) == 2
    monkeypatch.setitem(TUNE, "shared_from", 0)
    assert K.shared_rows(8, 4, 2048, 64) == 1
    for name, bad in (("shared_from", -1), ("shared_from", True), ("shared_rows", 2.0), ("shared_warps", 0)):
        with monkeypatch.context() as m:
            m.setitem(TUNE, name, bad)
            with pytest.raises(ValueError, match=f"{name}.*>= {int(name == 'shared_warps')}"):
                K.shared_rows(8, 4, 2048, 64)


class _Compiled:
    def __init__(self, shared):
        self.metadata = type("M", (), {"shared": shared})()


class _FakeKernel:
    """Stands in for a Triton kernel's warmup: shared memory by stage count, calls recorded."""
    def __init__(self, by_stages):
        self.by_stages, self.calls = by_stages, []

    def warmup(self, *args, grid, **consts):
        self.calls.append(consts["num_stages"])
        return _Compiled(self.by_stages[consts["num_stages"]])


def test_stages_that_fit_the_devices_shared_memory(monkeypatch):
    """A launch keeps its stages where the compiled kernel fits the device's shared memory a
    block, else takes the most stages that fit; one stage too big raises, naming both sizes;
    TUNE["shared_limit"] lowers the device's limit, never raises it; the choice is cached."""
    monkeypatch.setattr(TUNING, "_STAGES", {})
    monkeypatch.setattr(TUNING, "_device_shared", lambda device: 101376)  # an RTX 4090's
    fits = _FakeKernel({3: 90000, 2: 60000, 1: 30000})
    assert TUNING.stages_that_fit(fits, (1,), (), dict(num_stages=3), 0, "t") == 3
    big = _FakeKernel({3: 196736, 2: 143360, 1: 77824})  # pages of 256 tokens
    assert TUNING.stages_that_fit(big, (1,), (), dict(num_stages=3), 0, "t") == 1 and big.calls == [3, 2, 1]
    assert TUNING.stages_that_fit(big, (1,), (), dict(num_stages=3), 0, "t") == 1 and big.calls == [3, 2, 1]  # cached
    assert TUNING.stages_that_fit(big, (1,), (), dict(num_stages=2, X=1), 0, "t") == 1  # other constexprs: asked again
    made = []
    assert TUNING.stages_that_fit(big, (1,), lambda: made.append(1) or (), dict(num_stages=2, X=2), 0, "t") == 1 and made == [1]
    assert TUNING.stages_that_fit(big, (1,), lambda: made.append(1) or (), dict(num_stages=2, X=2), 0, "t") == 1 and made == [1]  # (cached: not built)
    with pytest.raises(SharedMemoryError, match=r"needs 120000 bytes .* allows 101376"):
        TUNING.stages_that_fit(_FakeKernel({2: 200000, 1: 120000}), (1,), (), dict(num_stages=2), 0, "t")
    monkeypatch.setitem(TUNE, "shared_limit", 70000)
    assert TUNING.stages_that_fit(fits, (1,), (), dict(num_stages=3), 0, "t") == 2
    monkeypatch.setitem(TUNE, "shared_limit", 500000)  # above the device's: the device's
    assert TUNING.shared_limit(0) == 101376
    monkeypatch.setitem(TUNE, "shared_limit", -1)
    with pytest.raises(ValueError, match="shared_limit"):
        TUNING.shared_limit(0)


SMALL_SHARED = [  # pages of 256 tokens (bf16 pages in two stages on the H200: 143,360 bytes of shared memory)
    (1, 600, 8, 2, 128, 256, dict(bits=16), False, 2),
    (1, 600, 8, 2, 128, 256, dict(bits=8), True, 2),
    (1, 600, 8, 2, 128, 256, dict(bits=4), False, None),
    (2, 300, 4, 1, 64, 256, dict(bits=4, rotate=True), True, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL_SHARED, ids=[case_id(c) for c in SMALL_SHARED])
def test_decode_and_prefill_within_a_consumer_cards_shared_memory(case, monkeypatch):
    """With an RTX 4090's 99 KiB of shared memory a block (TUNE["shared_limit"], on the H200),
    bf16 decode launches that would need more take fewer stages and stay within the budget, each
    launched kernel within the limit. A prefill chunk with left padding and the LSE (which
    staging cannot serve) runs the prefill kernel over tiles of its pages where a whole page of
    256 tokens does not fit (131,072 bytes in one stage on sm_90), within the budget and the
    limit. (fp32 inputs: the next test.)"""
    dtype = torch.bfloat16
    limit = 101376
    monkeypatch.setitem(TUNE, "shared_limit", limit)
    monkeypatch.setitem(TUNE, "prefill", "kernel")
    monkeypatch.setattr(K, "_PLANS", {})
    launched = []
    real = K.stages_that_fit

    def spy(fn, grid, args, consts, device, what):
        stages = real(fn, grid, args, consts, device, what)
        args = args() if callable(args) else args
        launched.append(fn.warmup(*args, grid=grid, **dict(consts, num_stages=stages)).metadata.shared)
        return stages

    monkeypatch.setattr(K, "stages_that_fit", spy)
    B, T, Hq, Hkv, D, P, kw, pad, sp = case
    _within_budget(case, dtype)
    assert launched and max(launched) <= limit, launched
    launched.clear()
    fit = prefill._prefill_fit

    def fit_spy(grid, args, consts, block_size, st):
        consts = fit(grid, args, consts, block_size, st)
        launched.append((consts["TP"], *prefill._compiled(grid, args, consts, limit)))
        return consts

    monkeypatch.setattr(prefill, "_prefill_fit", fit_spy)
    _prefill_within_budget((B, T, 9, Hq, Hkv, D, P, kw, [3 * b for b in range(B)], sp), dtype)
    assert len(launched) == 1 and 0 < launched[0][0] < P and launched[0][1] <= limit, launched  # a tile of the page
    assert launched[0][2] <= TUNING.SPILL_MAX, launched


@pytest.mark.gpu
def test_fp32_decode_over_16_bit_pages_within_a_consumer_cards_shared_memory(monkeypatch):
    """fp32 queries over 16-bit pages of 256 tokens go through the 2-D loop, whose whole pages
    need 155,712 bytes of shared memory even in one stage (sm_89 and sm_90): under an RTX 4090's
    99 KiB (TUNE["shared_limit"], on the H200) the launch reads them in tiles (`_loop_fit`),
    within the limit and the budget. Without the limit the H200 reads whole pages. (Mixed pages,
    k16v4, take the same path: their whole pages compile for minutes in three stages, two and
    one, so their tiles are checked by test_2d_loop_in_tiles_of_a_page_within_budget.)"""
    case = (1, 600, 8, 2, 128, 256, dict(bits=16), True, 2)
    limit = 101376
    monkeypatch.setitem(TUNE, "shared_limit", 0)  # (the device's, whatever a run set)
    monkeypatch.setattr(K, "_PLANS", {})
    plan, q, view = _within_budget(case, torch.float32), *_plain_inputs(case, torch.float32)
    assert plan.summary["tile"] == 0 and K.compiled_kernel(plan, q, view).metadata.shared > limit
    monkeypatch.setitem(TUNE, "shared_limit", limit)
    monkeypatch.setattr(K, "_PLANS", {})
    plan = _within_budget(case, torch.float32)
    shared = K.compiled_kernel(plan, q, view).metadata.shared
    assert 16 <= plan.summary["tile"] < 256 and shared <= limit, (plan.summary["tile"], shared)


def test_prefill_stages_where_the_kernel_does_not_fit(monkeypatch):
    """A prefill chunk whose kernel needs more shared memory than the GPU has (SharedMemoryError)
    goes through staging + SDPA where that serves (no LSE wanted, no left padding), and the
    error reaches the caller where it does not."""
    cfg = KVConfig(bits=4, block_size=16)
    cache, _, _ = fill(cfg, 2, 60, 10, 2, 64)
    q = torch.randn(2, 4, 10, 64)
    view = _to(cache.view(0), DEVICE)

    def too_big(*args, **kwargs):
        raise SharedMemoryError("paged_prefill_triton: the Triton kernel needs 131072 bytes of shared memory a block")

    monkeypatch.setitem(TUNE, "prefill", "kernel")
    monkeypatch.setattr(prefill, "paged_prefill_triton", too_big)
    out, lse = paged_attention(q.to(DEVICE), view, backend="triton", return_lse=False)
    ref_out, _ = paged_attention(q, cache.view(0), backend="reference")
    assert lse is None and torch.allclose(out.cpu(), ref_out, atol=1e-5)
    with pytest.raises(SharedMemoryError, match="131072"):
        paged_attention(q.to(DEVICE), view, backend="triton", return_lse=True)
    with pytest.raises(SharedMemoryError, match="131072"):
        paged_attention(q.to(DEVICE), view, start=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), backend="triton", return_lse=False)
