"""Allocator and block tables: unit tests and a hypothesis state machine."""

import sys
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from longctx.allocator import BlockAllocator, BlockTables
from longctx.errors import CacheFullError


def test_allocator_imports_no_torch():
    import subprocess

    code = "import sys, longctx.allocator; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_reuse_lowest_first_and_double_free():
    a = BlockAllocator(max_blocks=3)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        a.allocate(1)
    assert a.decref(1) is True
    assert a.allocate(1) == [1]
    a.decref(1)
    with pytest.raises(RuntimeError, match="double free"):
        a.decref(1)
    with pytest.raises(RuntimeError, match="incref of free"):
        a.incref(1)


def test_allocate_is_all_or_nothing():
    a = BlockAllocator(max_blocks=4)
    a.allocate(3)
    with pytest.raises(CacheFullError, match="2 more blocks needed but only 1"):
        a.allocate(2)
    assert a.num_used() == 3


def test_spill_moves_the_oldest_device_columns_with_their_references():
    """Beams over a prompt: spilling moves whole columns to the host allocator, a shared id
    once with all its references, and frees the device ids; crop and clear give host ids back."""
    sinks, blocks, host = BlockAllocator(None, "sinks"), BlockAllocator(4, "blocks"), BlockAllocator(3, "host")
    t = BlockTables(sinks, blocks, sink_blocks=1, host=host)
    t.ensure_rows(1)
    for j in range(3):
        t.push([[0]], t.allocator_for(j).allocate(1))  # sink, then device ids 0, 1
    t.select([0, 0])
    t.push([[0], [1]], blocks.allocate(2))  # each beam's own block: ids 2, 3
    assert blocks.num_available() == 0
    moves = t.spill(1)
    assert moves == [(0, 0)] and t.host_upto == 2 and t.host_columns == 1
    assert host.refcount(0) == 2 and blocks.refcount(0) == 0 and blocks.num_available() == 1
    with pytest.raises(CacheFullError):  # column 3 holds two ids, column 2 one: three more than host's two
        t.spill(2)
    assert t.host_upto == 2 and host.num_used() == 1, "a failed spill changes nothing"
    t.check()
    assert t.spill(1) == [(1, 1)] and host.num_available() == 1
    assert t.rows == [[0, 0, 1, 2], [0, 0, 1, 3]] and t.host_upto == 3
    t.check()
    t.truncate(2)
    assert t.host_upto == 2 and host.num_used() == 1 and blocks.num_used() == 0
    t.clear()
    assert t.host_upto == 1 and host.num_used() == 0
    with pytest.raises(ValueError, match="device columns"):
        t.spill(1)


def test_a_reorder_counts_only_the_blocks_rows_do_not_share():
    """Beams over a long prompt: a reorder takes and drops references only for the blocks
    past what every row holds alike (the prompt's stay as they are), and the counts stay
    exact."""
    sinks, blocks = BlockAllocator(None, "sinks"), BlockAllocator(None, "blocks")
    t = BlockTables(sinks, blocks, sink_blocks=1)
    t.ensure_rows(1)
    for j in range(1000):
        t.push([[0]], t.allocator_for(j).allocate(1))
    t.select([0, 0, 0, 0])  # the prompt repeated for four beams
    for _ in range(2):  # each beam's own blocks
        t.push([[0], [1], [2], [3]], blocks.allocate(4))
    calls = Counter()
    for a in (sinks, blocks):
        for name in ("incref", "decref"):
            def counted(bid, _f=getattr(a, name), _n=name):
                calls[_n] += 1
                return _f(bid)
            setattr(a, name, counted)
    t.select([2, 2, 0, 1])
    t.check()
    assert 0 < sum(calls.values()) <= 16, calls  # (every entry would be 8,016 calls)
    assert t.rows[0] == t.rows[1] and t.rows[0][:1000] == t.rows[3][:1000]


def test_runs_of_beams_hold_their_prompt_alike():
    """Two prompts' beams: a repeat of each row four times makes runs of four rows holding
    every block alike; the beams' own blocks and reorders within runs keep the prompt's
    blocks (and a push every run's rows share extends them); a reorder that mixes runs falls
    back to the whole batch; a truncate cuts them."""
    t = BlockTables(BlockAllocator(None, "sinks"), BlockAllocator(None, "blocks"), sink_blocks=1)
    t.ensure_rows(2)
    assert t.shared_runs == (2, 0)
    for j in range(10):
        t.push([[0], [1]], t.allocator_for(j).allocate(2))
    assert t.shared_runs == (2, 0)  # (two prompts: nothing held alike)
    t.select([0, 0, 0, 0, 1, 1, 1, 1])
    assert t.shared_runs == (4, 10)
    t.push([[0, 1, 2, 3], [4, 5, 6, 7]], t.blocks.allocate(2))  # each run's rows one block: still alike
    assert t.shared_runs == (4, 11)
    t.push([[r] for r in range(8)], t.blocks.allocate(8))  # each beam its own
    assert t.shared_runs == (4, 11)
    t.select([1, 1, 3, 0, 6, 4, 4, 5])  # beam search's reorder: within each prompt's run
    assert t.shared_runs == (4, 11)
    t.select([0, 0, 0, 0, 4, 4, 4, 4])  # beams that agree again: more held alike
    assert t.shared_runs == (4, 12)
    t.check()
    t.truncate(5)
    assert t.shared_runs == (4, 5)
    t.select([0, 1, 2, 4, 3, 5, 6, 7])  # rows of two prompts in one run
    assert t.shared_runs == (8, 0)
    t.check()
    t.select([0, 1, 2, 3])  # (a drop of half the rows: one run of them all)
    assert t.shared_runs == (4, 0) and t.shared_runs[1] == t._common_from(0)
    t.clear()
    assert t.shared_runs == (0, 0)


class TablesMachine(RuleBasedStateMachine):
    """Random append/fork/reorder/crop/free/clear on block tables; the refcount of every
    block must equal the entries holding it, and nothing may leak or be freed twice."""

    def __init__(self):
        super().__init__()
        self.sinks = BlockAllocator(None, "sinks")
        self.blocks = BlockAllocator(None, "blocks")
        self.host = BlockAllocator(None, "host")
        self.t = BlockTables(self.sinks, self.blocks, sink_blocks=1, host=self.host)
        self.t.ensure_rows(2)

    @rule(data=st.data())
    def append(self, data):
        n = self.t.num_rows
        if n == 0:
            return
        # random partition of rows into sharing groups
        labels = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
        groups = {}
        for r, lab in enumerate(labels):
            groups.setdefault(lab, []).append(r)
        groups = list(groups.values())
        alloc = self.t.allocator_for(self.t.num_blocks)
        self.t.push(groups, alloc.allocate(len(groups)))

    @precondition(lambda self: self.t.num_rows > 0)
    @rule(data=st.data())
    def reorder(self, data):
        n = self.t.num_rows
        idx = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
        self.t.select(idx)

    @precondition(lambda self: 0 < self.t.num_rows <= 3)
    @rule(k=st.integers(2, 3))
    def repeat(self, k):  # (beams prefilled once a prompt)
        self.t.select([r for r in range(self.t.num_rows) for _ in range(k)])

    @precondition(lambda self: self.t.num_rows > 0)
    @rule(data=st.data())
    def reorder_within_runs(self, data):  # (beam search's reorder)
        run = self.t.shared_runs[0]
        idx = [r - r % run + data.draw(st.integers(0, run - 1)) for r in range(self.t.num_rows)]
        before = self.t.shared_runs
        self.t.select(idx)
        assert self.t.shared_runs[0] == before[0] and self.t.shared_runs[1] >= before[1]

    @precondition(lambda self: 0 < self.t.num_rows < 6)
    @rule(data=st.data())
    def fork(self, data):
        row = data.draw(st.integers(0, self.t.num_rows - 1))
        self.t.select(list(range(self.t.num_rows)) + [row])

    @precondition(lambda self: self.t.num_rows > 1)
    @rule(data=st.data())
    def free(self, data):
        row = data.draw(st.integers(0, self.t.num_rows - 1))
        self.t.select([r for r in range(self.t.num_rows) if r != row])

    @rule(data=st.data())
    def spill(self, data):  # (the oldest device columns to the host tier)
        lo = self.t.host_upto
        self.t.spill(data.draw(st.integers(0, max(0, self.t.num_blocks - lo))))

    @rule(data=st.data())
    def crop(self, data):
        self.t.truncate(data.draw(st.integers(0, self.t.num_blocks)))

    @rule()
    def clear_and_restart(self):
        self.t.clear()
        assert self.sinks.num_used() == 0 and self.blocks.num_used() == 0 and self.host.num_used() == 0, "leak after clear"
        self.t.ensure_rows(2)

    @invariant()
    def refcounts_match_holders(self):
        self.t.check()


TestTables = TablesMachine.TestCase
TestTables.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
