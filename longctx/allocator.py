"""Block ids, free lists, reference counts, tiers and block tables. Pure Python: no torch.

The paged cache stores KV in fixed-size blocks. This module decides *which* block ids hold
what; `cache.py` owns the tensors those ids index. Two allocators back one table: logical
blocks below `sink_blocks` come from the sink allocator (unquantized pages), the rest from
the main one (quantized pages).

Invariants (checked by `BlockTables.check`, property-tested in tests/test_allocator.py):
- a block's refcount equals the number of table entries that hold it;
- a block is free exactly when its refcount is 0, and is freed exactly once.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

from .errors import CacheFullError

TIERS = ("gpu", "host")


class BlockAllocator:
    """Hands out block ids with reference counts; every id carries a tier.

    Ids are reused lowest-first so pools stay compact. `max_blocks` caps the ids in use
    per tier (None: no cap); `allocate` is all-or-nothing.
    """

    def __init__(self, max_blocks: int | None = None, name: str = "blocks"):
        self.max_blocks = max_blocks
        self.name = name
        self._refs: list[int] = []  # _refs[block id] -> number of table entries holding it
        self._tier: list[str] = []  # _tier[block id] -> "gpu" | "host"
        self._free: list[int] = []  # heap of free ids below capacity
        self._used = Counter()  # tier -> ids in use

    @property
    def capacity(self) -> int:
        """Number of ids ever created (the pool tensors need this many slots)."""
        return len(self._refs)

    def num_used(self, tier: str | None = None) -> int:
        return sum(self._used.values()) if tier is None else self._used[tier]

    def num_available(self, tier: str = "gpu") -> int | None:
        """Ids that can still be allocated in `tier`; None when there is no cap."""
        if self.max_blocks is None:
            return None
        return self.max_blocks - self._used[tier]

    def allocate(self, n: int, tier: str = "gpu") -> list[int]:
        """Return `n` ids, each with refcount 1; raises CacheFullError and changes nothing
        if they do not all fit."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        available = self.num_available(tier)
        if available is not None and n > available:
            raise CacheFullError(
                f"{self.name}: {n} more blocks needed but only {available} of "
                f"max_blocks={self.max_blocks} are free in tier {tier!r}",
            )
        ids = []
        for _ in range(n):
            if self._free:
                bid = heapq.heappop(self._free)
            else:
                bid = len(self._refs)
                self._refs.append(0)
                self._tier.append(tier)
            self._refs[bid] = 1
            self._tier[bid] = tier
            ids.append(bid)
        self._used[tier] += n
        return ids

    def incref(self, bid: int) -> None:
        if self._refs[bid] <= 0:
            raise RuntimeError(f"{self.name}: incref of free block {bid}")
        self._refs[bid] += 1

    def decref(self, bid: int) -> bool:
        """Drop one reference; returns True when the block became free."""
        if self._refs[bid] <= 0:
            raise RuntimeError(f"{self.name}: double free of block {bid}")
        self._refs[bid] -= 1
        if self._refs[bid] == 0:
            heapq.heappush(self._free, bid)
            self._used[self._tier[bid]] -= 1
            return True
        return False

    def refcount(self, bid: int) -> int:
        return self._refs[bid]

    def tier(self, bid: int) -> str:
        return self._tier[bid]

    def set_tier(self, bid: int, tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if self._refs[bid] <= 0:
            raise RuntimeError(f"{self.name}: cannot move free block {bid}")
        self._used[self._tier[bid]] -= 1
        self._used[tier] += 1
        self._tier[bid] = tier

    def used_ids(self) -> list[int]:
        return [bid for bid, r in enumerate(self._refs) if r > 0]


class BlockTables:
    """Per-row block tables over two allocators (sinks, then quantized blocks).

    rows[r][j]: logical block j of row r -> physical id; in the sink allocator's id space
    when j < sink_blocks, else in the main allocator's. All rows hold the same number of
    blocks (rows of one batch share a length; padding is expressed by attention).
    """

    def __init__(self, sinks: BlockAllocator, blocks: BlockAllocator, sink_blocks: int):
        self.sinks = sinks
        self.blocks = blocks
        self.sink_blocks = sink_blocks
        self.rows: list[list[int]] = []
        # leading logical blocks that every row holds alike (the same ids): a prompt's blocks
        # under its beams. A reorder leaves their references as they are (`select`), so a
        # beam step costs the blocks the beams do not share, not the whole context.
        self._common = 0
        # runs of `_run` consecutive rows (a prompt's beams; the whole batch where nothing says
        # otherwise) and the leading blocks each run's rows hold alike: what attention may read
        # once for several rows (`shared_runs`)
        self._run = 0
        self._run_common = 0

    def allocator_for(self, logical: int) -> BlockAllocator:
        return self.sinks if logical < self.sink_blocks else self.blocks

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_blocks(self) -> int:
        """Logical blocks per row."""
        return len(self.rows[0]) if self.rows else 0

    @property
    def shared_runs(self) -> tuple[int, int]:
        """(rows a run, blocks): the rows fall in runs of that many consecutive rows, and the
        rows of each run hold their first `blocks` logical blocks alike (the same ids). A
        repeat of each row k times (beams prefilled once a prompt) makes runs of k rows;
        reorders within runs keep them, and the blocks only grow until a select mixes runs,
        a row count changes or a truncate."""
        return self._run, self._run_common

    def _runs_from(self, run: int, c: int) -> int:
        """The leading blocks each run of `run` rows holds alike, knowing that the first c are."""
        if not self.rows or run <= 0:
            return 0
        n = len(self.rows[0])
        while c < n and all(self.rows[r][c] == self.rows[r - r % run][c] for r in range(len(self.rows))):
            c += 1
        return c

    def ensure_rows(self, n: int) -> None:
        """Start `n` empty rows (only when the table is empty)."""
        if self.rows and len(self.rows) != n:
            raise ValueError(f"table has {len(self.rows)} rows, asked for {n}")
        if not self.rows:
            self.rows = [[] for _ in range(n)]
            self._common = 0
            self._run, self._run_common = n, 0

    def push(self, groups: Sequence[Sequence[int]], ids: Sequence[int]) -> None:
        """Append block ids[g] to every row in groups[g]. Each id arrives with the one
        reference `allocate` gave it; rows beyond the first in a group add a reference."""
        if len(groups) != len(ids):
            raise ValueError("one id per group")
        logical = self.num_blocks
        alloc = self.allocator_for(logical)
        covered = sorted(r for g in groups for r in g)
        if covered != list(range(self.num_rows)):
            raise ValueError(f"groups must cover each row exactly once, got {groups}")
        for group, bid in zip(groups, ids):
            for k, r in enumerate(group):
                if k:
                    alloc.incref(bid)
                self.rows[r].append(bid)
        if self._common == logical and len(groups) == 1:
            self._common += 1
        if self._run_common == logical and self._run:  # each run's rows took one id
            group_of = {r: g for g, group in enumerate(groups) for r in group}
            if all(group_of[r] == group_of[r - r % self._run] for r in range(self.num_rows)):
                self._run_common += 1

    def select(self, indices: Iterable[int]) -> None:
        """New rows are copies of rows[indices] (reorder, fork, drop, repeat): references
        are taken for the new table before the old one lets go, so shared blocks survive.

        Only the references that change are counted: the leading blocks all rows hold alike
        gain or lose one a row added or dropped (none in a reorder), and the rest by how many
        rows hold them before and after. A beam step at 128k (2,048 blocks a row) counts the
        few blocks its beams do not share rather than every entry of the table."""
        indices = list(indices)
        for i in indices:
            if not 0 <= i < self.num_rows:
                raise IndexError(f"row {i} out of range for {self.num_rows} rows")
        old, c = self.rows, self._common
        new_rows = [list(old[i]) for i in indices]
        change: Counter = Counter()  # (allocator is the sinks', id) -> references gained (lost: < 0)
        if len(new_rows) != len(old):
            for j, bid in enumerate(old[0][:c]):
                change[j < self.sink_blocks, bid] += len(new_rows) - len(old)
        for rows, sign in ((new_rows, 1), (old, -1)):
            for row in rows:
                for j in range(c, len(row)):
                    change[j < self.sink_blocks, row[j]] += sign
        for key, n in sorted(change.items(), key=lambda kv: -kv[1]):  # (gains before losses)
            alloc = self.sinks if key[0] else self.blocks
            for _ in range(abs(n)):
                if n > 0:
                    alloc.incref(key[1])
                else:
                    alloc.decref(key[1])
        self.rows = new_rows
        self._common = self._common_from(c if new_rows else 0)
        self._run, self._run_common = self._runs_after(indices, len(old))

    def _runs_after(self, indices: list[int], old_rows: int) -> tuple[int, int]:
        """Runs of the rows a select made (`shared_runs`): k copies of each old row in turn
        (a repeat) make runs of k rows holding all their blocks alike; new runs of the old
        run's size, each drawn from one old run (beam reorders), keep the old runs' blocks
        as a lower bound; else one run, the whole batch."""
        n, run = len(indices), self._run
        if not n:
            return 0, 0
        k = n // old_rows if old_rows and n % old_rows == 0 else 0
        if k > 1 and all(i == r // k for r, i in enumerate(indices)):
            return k, self.num_blocks
        if run and n % run == 0 and all(i // run == indices[r - r % run] // run for r, i in enumerate(indices)):
            return run, self._runs_from(run, self._run_common)
        return n, self._common

    def _common_from(self, c: int) -> int:
        """The leading blocks all rows hold alike, knowing that the first c are (one run of
        every row)."""
        return self._runs_from(self.num_rows, c)

    def truncate(self, n_blocks: int) -> None:
        """Keep the first `n_blocks` logical blocks of every row."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        dropped = [row[n_blocks:] for row in self.rows]
        for row, gone in zip(self.rows, dropped):
            for j, bid in enumerate(gone, start=n_blocks):
                self.allocator_for(j).decref(bid)
            del row[n_blocks:]
        self._common = min(self._common, n_blocks)
        self._run_common = min(self._run_common, n_blocks)

    def clear(self) -> None:
        self._release(self.rows)
        self.rows = []
        self._common = 0
        self._run, self._run_common = 0, 0

    def _release(self, rows: list[list[int]]) -> None:
        for row in rows:
            for j, bid in enumerate(row):
                self.allocator_for(j).decref(bid)

    def unique_ids(self) -> tuple[set[int], set[int]]:
        """(sink ids, block ids) held by any row."""
        sink_ids, block_ids = set(), set()
        for row in self.rows:
            sink_ids.update(row[: self.sink_blocks])
            block_ids.update(row[self.sink_blocks :])
        return sink_ids, block_ids

    def check(self) -> None:
        """Raise AssertionError unless every refcount equals the entries holding it, and the
        blocks all rows hold alike are as many as recorded."""
        common = self._common_from(0)
        assert self._common == common, f"{self._common} leading blocks recorded as held by every row, {common} are"
        run = self._run
        assert (run == 0) == (not self.rows) and (not run or self.num_rows % run == 0), f"runs of {run} rows in {self.num_rows}"
        assert self._run_common == self._runs_from(run, 0), f"{self._run_common} leading blocks recorded as held by each run of {run} rows"
        for alloc, lo, hi in ((self.sinks, 0, self.sink_blocks), (self.blocks, self.sink_blocks, None)):
            held = Counter(bid for row in self.rows for bid in row[lo:hi])
            for bid in range(alloc.capacity):
                assert alloc.refcount(bid) == held.get(bid, 0), (
                    f"{alloc.name} block {bid}: refcount {alloc.refcount(bid)} != {held.get(bid, 0)} holders"
                )
            assert alloc.num_used() == len(held), f"{alloc.name}: {alloc.num_used()} used != {len(held)} held"
