"""PagedKVCache: sealing, sharing, row operations, limits, errors and memory accounting."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from longctx import CacheFullError, KVConfig
from longctx.cache import PagedKVCache
from longctx.testing import expected_dense, random_kv


def make(cfg=None, layers=2, heads=2, dim=64):
    return PagedKVCache(cfg or KVConfig(bits=4, block_size=16), num_layers=layers, num_kv_heads=heads, head_dim=dim)


def step(cache, k, v):
    """Append one step's tokens to every layer, as a model forward does."""
    for layer in range(cache.num_layers):
        cache.append(layer, k, v)


def test_chunk_is_sealed_at_the_next_step_not_before():
    cache = make()
    k, v = random_kv(1, 2, 40, 64)
    step(cache, k, v)
    assert cache.num_blocks == 0 and cache.view(0).tail_k.shape[2] == 40  # attends to itself exactly
    k2, v2 = random_kv(1, 2, 1, 64, seed=1)
    step(cache, k2, v2)
    assert cache.num_blocks == 2 and cache.tail_len == [9, 9] and cache.seq_len() == 41
    exp_k, exp_v = expected_dense(torch.cat([k, k2], 2), torch.cat([v, v2], 2), cache.config, sealed_tokens=40)
    dk, dv = cache.dense(1)
    assert torch.equal(dk, exp_k) and torch.equal(dv, exp_v)


def test_identical_rows_share_blocks_and_different_rows_do_not():
    cache = make()
    k, v = random_kv(1, 2, 48, 64)
    k2, v2 = random_kv(1, 2, 48, 64, seed=5)
    kb = torch.cat([k, k, k2, k], 0)
    vb = torch.cat([v, v, v2, v], 0)
    step(cache, kb, vb)
    step(cache, kb[:, :, :1], vb[:, :, :1])
    rows = cache.tables.rows
    assert rows[0] == rows[1] == rows[3] and rows[2] != rows[0]
    report = cache.memory_report()
    assert report.blocks == {"sink": 2, "quantized": 4, "dense": 0}
    cache.tables.check()


def test_rows_share_only_if_every_layer_matches():
    cache = make()
    k, v = random_kv(2, 2, 32, 64)
    same = torch.cat([k[:1], k[:1]], 0)
    vsame = torch.cat([v[:1], v[:1]], 0)
    cache.append(0, same, vsame)
    cache.append(1, k, v)  # layer 1 differs between the rows
    step(cache, same[:, :, :1], vsame[:, :, :1])
    assert cache.tables.rows[0] != cache.tables.rows[1]


def test_reorder_copies_tails_only_and_keeps_sealed_bytes():
    cache = make()
    k, v = random_kv(3, 2, 70, 64)
    step(cache, k, v)
    step(cache, k[:, :, :1], v[:, :, :1])
    before = {(l, name): (t.data_ptr(), t.clone()) for l, p in enumerate(cache.pages) for name, t in p.tensors().items()}
    seals = cache.seals
    dense_before = [cache.dense(0)[0][r].clone() for r in range(3)]
    cache.reorder(torch.tensor([2, 2, 0]))
    for l, p in enumerate(cache.pages):
        for name, t in p.tensors().items():
            ptr, data = before[(l, name)]
            assert t.data_ptr() == ptr and torch.equal(t, data), f"layer {l} {name} moved"
    assert cache.seals == seals
    after = cache.dense(0)[0]
    assert torch.equal(after[0], dense_before[2]) and torch.equal(after[1], dense_before[2]) and torch.equal(after[2], dense_before[0])
    cache.tables.check()


def test_reorder_in_place_moves_the_held_tokens_and_the_graph_table():
    """A reorder that keeps the row count (beam search, every step) moves the tails' held
    tokens and the graph table's rows in place, leaving the room after the tokens alone; one
    that changes it (fork) makes new tails and drops the graph table."""
    cache = make()
    k, v = random_kv(3, 2, 80, 64, seed=9)
    step(cache, k, v)  # (a chunk of 80: the tails' room outlasts the seal)
    step(cache, k[:, :, :1], v[:, :, :1])
    tail_k, table = cache.segments[0].tail_k, cache.graph_table()[0]
    held = max(cache.tail_len)
    assert 0 < held < tail_k.shape[3]
    room = tail_k[:, :, :, held:].clone()
    want_k = tail_k[:, :, :, :held].index_select(1, torch.tensor([2, 2, 0])).clone()
    want_t = table.index_select(0, torch.tensor([2, 2, 0]))
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.segments[0].tail_k is tail_k and cache.graph_table()[0] is table
    assert torch.equal(tail_k[:, :, :, :held], want_k) and torch.equal(tail_k[:, :, :, held:], room)
    assert torch.equal(table, want_t) and torch.equal(table[:, : cache.num_blocks], cache.block_table())
    cache.fork(0)
    assert cache.segments[0].tail_k is not tail_k and cache.device_step is None and cache.batch_size == 4
    cache.tables.check()


def test_views_say_which_rows_hold_their_prompt_alike():
    """Two prompts repeated for three beams each: views carry the runs (three rows) and the
    prompt's blocks they hold alike, kept by reorders within runs (the graph table moves in
    place); a reorder that mixes the runs shrinks them, and drops the graph table, whose
    recorded steps read each run's shared blocks once."""
    cache = make()
    k, v = random_kv(2, 2, 70, 64, seed=4)
    step(cache, k, v)
    cache.seal()
    nb = cache.num_blocks
    cache.select_rows([0, 0, 0, 1, 1, 1])
    view = cache.view(0)
    assert (view.shared_run, view.shared) == (3, nb) and nb > 0
    k1, v1 = random_kv(6, 2, 1, 64, seed=5)
    step(cache, k1, v1)
    table = cache.graph_table()[0]
    cache.reorder(torch.tensor([2, 0, 0, 5, 3, 4]))
    assert cache.graph_table()[0] is table and (cache.view(0).shared_run, cache.view(0).shared) == (3, nb)
    cache.reorder(torch.tensor([0, 1, 3, 2, 4, 5]))
    assert cache.device_step is None and (cache.view(0).shared_run, cache.view(0).shared) == (6, 0)
    cache.tables.check()


def test_fork_and_free():
    cache = make()
    k, v = random_kv(2, 2, 40, 64)
    step(cache, k, v)
    step(cache, k[:, :, :1], v[:, :, :1])
    new = cache.fork(1)
    assert new == 2 and cache.tables.rows[2] == cache.tables.rows[1]
    assert torch.equal(cache.dense(0)[0][2], cache.dense(0)[0][1])
    used = cache.block_alloc.num_used()
    cache.free(1)
    assert cache.block_alloc.num_used() == used  # row 2 still holds them
    cache.free(1)
    assert cache.block_alloc.num_used() < used
    cache.tables.check()
    with pytest.raises(IndexError):
        cache.free(5)


@pytest.mark.parametrize("cut", [0, 10, 16, 37, 40])
def test_crop(cut):
    cfg = KVConfig(bits=16, block_size=16)
    cache = make(cfg)
    k, v = random_kv(2, 2, 40, 64)
    step(cache, k, v)
    step(cache, k[:, :, :2], v[:, :, :2])
    cache.crop(cut)
    assert cache.seq_len() == cut
    dk, dv = cache.dense(1)
    assert torch.equal(dk, k[:, :, :cut]) and torch.equal(dv, v[:, :, :cut])
    cache.tables.check()
    step(cache, k[:, :, :5], v[:, :, :5])  # and it keeps working
    assert cache.seq_len() == cut + 5


def test_cache_full_loses_nothing():
    cfg = KVConfig(bits=4, block_size=16, max_blocks=3)
    cache = make(cfg)
    k, v = random_kv(1, 2, 60, 64)
    step(cache, k, v)  # 60 tokens: 1 sink + 2 quantized blocks, 12 in the tail
    before = [t.clone() for t in cache.dense(0)]
    with pytest.raises(CacheFullError) as err:
        step(cache, k[:, :, :40], v[:, :, :40])
    assert "more tokens fit" in str(err.value) and "Nothing was lost" in str(err.value)
    assert err.value.tokens_that_fit == cache.tokens_that_fit() > 0
    assert cache.seq_len() == 60
    assert all(torch.equal(a, b) for a, b in zip(before, cache.dense(0)))
    fit = err.value.tokens_that_fit
    step(cache, k[:, :, :fit], v[:, :, :fit])  # what it said fits does fit
    assert cache.seq_len() == 60 + fit


def test_max_blocks_allocates_the_pools_once():
    cache = make(KVConfig(bits=4, block_size=16, max_blocks=20))
    k, v = random_kv(1, 2, 300, 64)
    step(cache, k[:, :, :40], v[:, :, :40])
    step(cache, k[:, :, 40:41], v[:, :, 40:41])  # seals the first quantized block
    codes = cache.pages[0].k_codes
    assert codes.shape[0] == 20
    step(cache, k[:, :, 41:300], v[:, :, 41:300])
    step(cache, k[:, :, :1], v[:, :, :1])  # seals up to 18 quantized blocks: no regrowth
    assert cache.block_alloc.num_used() == 300 // 16 - 1
    assert cache.pages[0].k_codes.data_ptr() == codes.data_ptr() and cache.pages[0].k_codes.shape[0] == 20


def test_nan_raises_and_seals_nothing():
    cache = make()
    k, v = random_kv(1, 2, 40, 64)
    k[0, 1, 20, 7] = float("nan")  # in block 1: the first quantized block
    step(cache, k, v)
    with pytest.raises(ValueError, match="NaN or Inf"):
        step(cache, k[:, :, :1], v[:, :, :1])
    assert cache.num_blocks == 0 and cache.block_alloc.num_used() == 0 and cache.sink_alloc.num_used() == 0


def test_a_failing_seal_frees_its_slots_and_changes_nothing(monkeypatch):
    """Blocks are quantized straight into new pool slots before any table references them:
    if that fails (a kernel error, out of memory), the slots are freed and the cache reads as
    before; the next step seals normally."""
    import longctx.cache as cache_module

    cache = make()
    k, v = random_kv(1, 2, 80, 64)
    step(cache, k[:, :, :40], v[:, :, :40])
    step(cache, k[:, :, 40:41], v[:, :, 40:41])  # seals blocks 0 (sink) and 1
    before = (cache.num_blocks, cache.block_alloc.num_used(), cache.sink_alloc.num_used())
    k_before, _ = cache.dense(0)
    real = cache_module.quantize_blocks_into

    def broken(*a, **kw):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(cache_module, "quantize_blocks_into", broken)
    step(cache, k[:, :, 41:64], v[:, :, 41:64])  # the tail holds 32 tokens: blocks 2 and 3 are full
    with pytest.raises(RuntimeError, match="kernel failed"):
        cache.seal()
    assert (cache.num_blocks, cache.block_alloc.num_used(), cache.sink_alloc.num_used()) == before
    assert cache.tail_len == [32, 32]
    monkeypatch.setattr(cache_module, "quantize_blocks_into", real)
    step(cache, k[:, :, 64:65], v[:, :, 64:65])
    assert cache.num_blocks == 4 and cache.block_alloc.num_used() == 3 and cache.tail_len == [1, 1]
    dk, dv = cache.dense(0)
    ek, ev = expected_dense(k[:, :, :65], v[:, :, :65], cache.config, sealed_tokens=64)
    assert torch.equal(dk, ek) and torch.equal(dv, ev)
    assert torch.equal(dk[:, :, :32], k_before[:, :, :32])  # the blocks sealed before the failure


def test_block_table_grows_by_columns_and_matches_the_rows():
    """Sealing appends the new blocks' ids to the cached device table instead of rebuilding
    it; row operations (reorder, fork, free) move its rows on the device. Either way it
    equals the host's rows."""
    cache = make()
    k, v = random_kv(3, 2, 400, 64)
    t = 0
    for n in (40, 1, 30, 17, 1, 64, 100, 1):
        step(cache, k[:, :, t : t + n], v[:, :, t : t + n])
        t += n
        before = cache._tables.get(cache.device)
        table = cache.block_table()
        assert torch.equal(table.cpu(), torch.tensor(cache.tables.rows, dtype=torch.int32).reshape(3, cache.num_blocks))
        assert table.dtype == torch.int32 and (before is None or before is table)
        if n == 17:
            for op in (lambda: cache.reorder(torch.tensor([2, 0, 1])), lambda: cache.fork(1), lambda: cache.free(0)):
                op()
                assert torch.equal(cache.block_table(), torch.tensor(cache.tables.rows, dtype=torch.int32))


def test_interrupted_step_is_rolled_back():
    cache = make(layers=3)
    k, v = random_kv(1, 2, 10, 64)
    step(cache, k, v)
    cache.append(0, k[:, :, :4], v[:, :, :4])  # forward interrupted after layer 0
    assert cache.seq_len() == 10
    step(cache, k[:, :, :1], v[:, :, :1])
    assert cache.tail_len == [11, 11, 11]


def test_batch_mismatch_and_bad_shapes():
    cache = make()
    step(cache, *random_kv(2, 2, 5, 64))
    with pytest.raises(ValueError, match="batch of 3 rows, but the cache holds 2"):
        cache.append(0, *random_kv(3, 2, 1, 64))
    with pytest.raises(ValueError, match=r"k/v must be \[B, 2, C, 64\]"):
        cache.append(0, *random_kv(2, 3, 1, 64))


@pytest.mark.parametrize("name, bound", [("int8", 0.54), ("int4", 0.293), ("int2+rot", 0.216)])
def test_bytes_per_token_at_4096_tokens(name, bound):
    """SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64), bf16 keys/values, the named
    formats (int2+rot: K's scales a row per 16 tokens)."""
    from longctx.config import kv_preset

    cache = PagedKVCache(kv_preset(name), num_layers=30, num_kv_heads=3, head_dim=64)
    for c0 in range(0, 4096, 1024):
        k, v = random_kv(1, 3, 1024, 64, dtype=torch.bfloat16, seed=c0)
        step(cache, k, v)
    r = cache.memory_report()
    assert r.tokens == 4096 and r.rows == 1
    assert r.bf16_bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert r.total_bytes == sum(r.bytes_by_kind.values()) == sum(r.bytes_by_tier.values())
    assert set(r.bytes_by_tier) == {"device", "host"} and r.device == "cpu"  # (tiers by role: this device is no GPU)
    text = str(r)
    assert text.startswith(f"KV cache ({r.format}, {r.layers} layers): {r.tokens:,} tokens") and "on cpu" in text and "x a bf16 cache" in text
    assert r.bytes_by_kind["sinks"] == 30 * 2 * 3 * 64 * 64 * 2  # one bf16 sink block
    assert r.ratio_to_bf16 <= bound, r.as_dict()
    assert r.reserved_bytes >= r.total_bytes


def test_reset_frees_everything():
    cache = make()
    step(cache, *random_kv(2, 2, 50, 64))
    step(cache, *random_kv(2, 2, 1, 64))
    cache.reset()
    assert cache.seq_len() == 0 and cache.block_alloc.num_used() == 0 and cache.sink_alloc.num_used() == 0
    step(cache, *random_kv(3, 2, 20, 64))  # a new batch size after reset
    assert cache.batch_size == 3


class CacheMachine(RuleBasedStateMachine):
    """Random append/fork/reorder/crop/free on an exact (16-bit) cache, checked against a
    shadow copy of every row's tokens and against the allocator's refcounts."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(KVConfig(bits=16, block_size=16, sink_blocks=1), num_layers=2, num_kv_heads=1, head_dim=16)
        self.rows = None  # shadow: list of [T, 16] keys per row (values = -keys)
        self.counter = 0

    def _tokens(self, n):
        self.counter += 1
        return torch.randint(-50, 50, (n, 16), generator=torch.Generator().manual_seed(self.counter)).float()

    @rule(n=st.integers(1, 40), same=st.booleans())
    def append(self, n, same):
        b = 2 if self.rows is None else len(self.rows)
        if self.rows is None:
            self.rows = [torch.zeros(0, 16) for _ in range(b)]
        new = [self._tokens(n)] * b if same else [self._tokens(n) for _ in range(b)]
        k = torch.stack(new)[:, None]
        for layer in range(2):
            self.cache.append(layer, k, -k)
        self.rows = [torch.cat([r, t]) for r, t in zip(self.rows, new)]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def reorder(self, data):
        n = len(self.rows)
        idx = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
        self.cache.reorder(torch.tensor(idx))
        self.rows = [self.rows[i] for i in idx]

    @precondition(lambda self: self.rows and len(self.rows) < 5)
    @rule(data=st.data())
    def fork(self, data):
        r = data.draw(st.integers(0, len(self.rows) - 1))
        self.cache.fork(r)
        self.rows.append(self.rows[r])

    @precondition(lambda self: self.rows and len(self.rows) > 1)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.integers(0, len(self.rows) - 1))
        self.cache.free(r)
        del self.rows[r]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def crop(self, data):
        n = data.draw(st.integers(0, self.rows[0].shape[0]))
        self.cache.crop(n)
        self.rows = [r[:n] for r in self.rows]

    @invariant()
    def contents_and_refcounts(self):
        self.cache.tables.check()
        if not self.rows:
            return
        expect = torch.stack(self.rows)[:, None]
        for layer in range(2):
            k, v = self.cache.dense(layer)
            assert torch.equal(k, expect) and torch.equal(v, -expect)
        sink_ids, block_ids, host_ids = self.cache.tables.unique_ids()
        assert self.cache.block_alloc.num_used() == len(block_ids), "leaked blocks"
        assert self.cache.sink_alloc.num_used() == len(sink_ids), "leaked sink blocks"
        host = self.cache.host_alloc
        assert (host.num_used() if host else 0) == len(host_ids), "leaked host blocks"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class HostTierMachine(CacheMachine):
    """The same with 16 device blocks and a host tier: appends spill the oldest columns, and
    every row operation works across both tiers."""

    def __init__(self):
        super().__init__()
        cfg = KVConfig(bits=16, block_size=16, sink_blocks=1, max_blocks=16, host_blocks=100_000, stage_blocks=7)
        self.cache = PagedKVCache(cfg, num_layers=2, num_kv_heads=1, head_dim=16)


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


class SplitMachine(HostTierMachine):
    """The same with its two layers on two placements (cpu:0 and cpu:1: a model split over two
    devices, tests/test_devices.py), each with its own tails, sinks and table copy."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(self.cache.config, num_layers=2, num_kv_heads=1, head_dim=16, devices=["cpu:0", "cpu:1"])

    @invariant()
    def table_copies_agree(self):
        if self.rows and self.cache.initialized:
            a, b = (self.cache.block_table(torch.device("cpu", i)) for i in (0, 1))
            assert a is not b and torch.equal(a, b) and len(self.cache.segments) == 2


TestSplitMachine = SplitMachine.TestCase
TestSplitMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_graph_table_takes_seals_in_place_until_full(monkeypatch):
    """The table recorded steps read (`graph_table`): block_table()'s columns and room after
    them, the count on the device; seals write their columns into it in place while it has
    room, and drop it when full; a reorder of as many rows moves its rows in place, fewer rows
    or a crop drop it, so a new one (a new recording) follows.
    Within static_step, views give it with the count."""
    from longctx import cache as C

    monkeypatch.setattr(C, "GRAPH_ROOM", (2, 16))
    cfg = KVConfig(bits=4, block_size=16, sink_blocks=1)
    k, v = random_kv(2, 2, 200, 32, seed=6)
    c = PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=32)
    c.append(0, k[:, :, :40], v[:, :, :40])
    c.seal()
    table, count = c.graph_table()
    assert table.shape == (2, 4) and int(count) == 2 and torch.equal(table[:, :2], c.block_table())
    for t in (56, 72):  # two seals: the room
        c.append(0, k[:, :, t - 16 : t], v[:, :, t - 16 : t])
        c.seal()
        assert c.graph_table()[0] is table and int(count) == c.num_blocks and torch.equal(table[:, : c.num_blocks], c.block_table())
    slot, length = torch.tensor([c.tail_len[0]]), torch.tensor([c.tail_len[0] + 1], dtype=torch.int32)
    with c.static_step(slot, length):  # one object holds the step's device state, and views hand it down
        step, view = c.device_step, c.view(0)
        assert step.recording and step.table is table and step.count is count and step.slot is slot and step.length is length
        assert view.block_table is table and view.n_blocks is count and view.tail_len is length and view.n_sink == 1
    assert c.device_step is step and not step.recording and step.slot is None
    c.append(0, k[:, :, 72:88], v[:, :, 72:88])
    c.seal()  # full: dropped
    assert c.device_step is None and int(count) == 4
    again, count = c.graph_table()
    assert again is not table and again.shape == (2, 7) and int(count) == 5 and torch.equal(again[:, :5], c.block_table())
    row1 = again[1].clone()
    c.select_rows([1, 0])  # (as many rows: its rows move in place)
    assert c.graph_table()[0] is again and torch.equal(again[:, :5], c.block_table()) and torch.equal(again[0], row1)
    c.free(0)  # (fewer rows: dropped)
    assert c.device_step is None
    table, count = c.graph_table()
    assert table.shape == (1, 7) and torch.equal(table[:, :5], c.block_table())
    c.crop(70)
    assert c.device_step is None


def test_static_step_writes_at_the_device_slot_and_restores_the_host_counts():
    """A step recorded for CUDA graphs (`static_step`): each layer's token goes to the tail
    slot the device says, views give the block's slots with the device length, the host's
    tail lengths are as before on exit (the recorded step has not run), and the tail then
    holds what an eager step writes."""
    from longctx.ops.paged_attention import paged_attention

    cfg = KVConfig(bits=4, block_size=16)
    k, v = random_kv(1, 2, 41, 32, seed=5)
    eager, static = (PagedKVCache(cfg, num_layers=2, num_kv_heads=2, head_dim=32) for _ in range(2))
    for c in (eager, static):
        for layer in range(2):
            c.append(layer, k[:, :, :40], v[:, :, :40])
        c.seal()
    assert static.tail_len == [8, 8]
    slot, length = torch.tensor([8]), torch.tensor([9], dtype=torch.int32)
    with static.static_step(slot, length):
        for layer in range(2):
            static.append(layer, k[:, :, 40:], v[:, :, 40:])
            view = static.view(layer)
            assert view.tail_k.shape[2] == 16 and view.tail_len is length
        with pytest.raises(ValueError, match="one token a row"):
            static.append(0, k[:, :, :2], v[:, :, :2])
    assert static.tail_len == [8, 8]
    for layer in range(2):
        eager.append(layer, k[:, :, 40:], v[:, :, 40:])
    static.tail_len = [9, 9]  # what whoever replays counts
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        assert torch.equal(static.view(layer).tail_k, eager.view(layer).tail_k)
        assert torch.equal(static.view(layer).tail_v, eager.view(layer).tail_v)
        assert torch.equal(paged_attention(q, static.view(layer))[0], paged_attention(q, eager.view(layer))[0])
    static.append(0, k[:, :, :7], v[:, :, :7])  # layer 0 ahead by 7: unequal tails
    with pytest.raises(RuntimeError, match="equal tails shorter than a block"):
        with static.static_step(slot, length):
            pass
    static.tail_len = [16, 16]
    with pytest.raises(RuntimeError, match="seal first"):
        with static.static_step(slot, length):
            pass
    with pytest.raises(ValueError, match="slot must be int64"):
        with eager.static_step(slot.int(), length):
            pass
    for start in (torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)):  # (one row here)
        with pytest.raises(ValueError, match="start must be int32 \\[1\\]"):
            with eager.static_step(slot, length, start):
                pass
    with eager.static_step(slot, length, torch.tensor([5], dtype=torch.int32)):  # attend takes the step's start where given none
        padded = eager.attend(0, q, return_lse=False)[0]
        assert torch.equal(eager.attend(0, q, torch.tensor([2], dtype=torch.int32), return_lse=False)[0],
                           paged_attention(q, eager.view(0), start=torch.tensor([2], dtype=torch.int32), return_lse=False)[0])
    assert torch.equal(padded, paged_attention(q, eager.view(0), start=torch.tensor([5], dtype=torch.int32), return_lse=False)[0])
    assert not torch.equal(padded, eager.attend(0, q, return_lse=False)[0])
