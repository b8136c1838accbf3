"""Block ids, free lists, reference counts, tiers and block tables. Pure Python: no torch.

The paged cache stores KV in fixed-size blocks. This module decides *which* block ids hold
what; `cache.py` owns the tensors those ids index. Each allocator is one id space over one
pool: logical blocks below `sink_blocks` come from the sink allocator (unquantized pages),
the sealed blocks from the device allocator (quantized pages in GPU memory) or, for the
oldest ones once a host tier exists, from the host allocator (the same pages in pinned host
memory). A table column is in one tier for every row: columns [sink_blocks, host_upto) are
the host's, the later ones the device's (`BlockTables.spill` moves the oldest device columns).

Invariants (checked by `BlockTables.check`, property-tested in tests/test_allocator.py):
- a block's refcount equals the number of table entries that hold it;
- a block is free exactly when its refcount is 0, and is freed exactly once;
- every id of a column comes from the allocator of that column's tier.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

from .errors import CacheFullError

class BlockAllocator:
    """Hands out block ids with reference counts.

    Ids are reused lowest-first so pools stay compact. `max_blocks` caps the ids in use
    (None: no cap); `allocate` is all-or-nothing.
    """

    def __init__(self, max_blocks: int | None = None, name: str = "blocks"):
        self.max_blocks = max_blocks
        self.name = name
        self._refs: list[int] = []  # _refs[block id] -> number of table entries holding it
        self._free: list[int] = []  # heap of free ids below capacity
        self._used = 0

    @property
    def capacity(self) -> int:
        """Number of ids ever created (the pool tensors need this many slots)."""
        return len(self._refs)

    def num_used(self) -> int:
        return self._used

    def num_available(self) -> int | None:
        """Ids that can still be allocated; None when there is no cap."""
        if self.max_blocks is None:
            return None
        return self.max_blocks - self._used

    def allocate(self, n: int) -> list[int]:
        """Return `n` ids, each with refcount 1; raises CacheFullError and changes nothing
        if they do not all fit."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        available = self.num_available()
        if available is not None and n > available:
            raise CacheFullError(
                f"{self.name}: {n} more blocks needed but only {available} of "
                f"max_blocks={self.max_blocks} are free",
            )
        ids = []
        for _ in range(n):
            if self._free:
                bid = heapq.heappop(self._free)
            else:
                bid = len(self._refs)
                self._refs.append(0)
            self._refs[bid] = 1
            ids.append(bid)
        self._used += n
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
            self._used -= 1
            return True
        return False

    def refcount(self, bid: int) -> int:
        return self._refs[bid]

    def used_ids(self) -> list[int]:
        return [bid for bid, r in enumerate(self._refs) if r > 0]


class BlockTables:
    """Per-row block tables over two allocators (sinks, then quantized blocks).

    rows[r][j]: logical block j of row r -> physical id; in the sink allocator's id space
    when j < sink_blocks, else in the main allocator's. All rows hold the same number of
    blocks (rows of one batch share a length; padding is expressed by attention).
    """

    def __init__(self, sinks: BlockAllocator, blocks: BlockAllocator, sink_blocks: int, host: BlockAllocator | None = None):
        self.sinks = sinks
        self.blocks = blocks
        self.host = host
        self.sink_blocks = sink_blocks
        # logical blocks [sink_blocks, host_upto) of every row are in the host tier (ids of
        # `host`), the later ones on the device (ids of `blocks`)
        self.host_upto = sink_blocks
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
        if logical < self.sink_blocks:
            return self.sinks
        return self.host if logical < self.host_upto else self.blocks

    @property
    def host_columns(self) -> int:
        """Logical blocks of each row in the host tier (they follow the sinks)."""
        return self.host_upto - self.sink_blocks

    def spill(self, n: int) -> list[tuple[int, int]]:
        """Move the oldest `n` device columns (logical blocks host_upto .. host_upto + n - 1 of
        every row) to the host tier: each distinct device id gets a host id holding as many
        references, and is freed. Returns the (device id, host id) pairs whose bytes the
        caller copies before the device ids are written again. All or nothing: raises
        CacheFullError, changing nothing, when the host ids do not all fit."""
        if self.host is None:
            raise RuntimeError("spill: these tables have no host tier")
        lo = self.host_upto
        if not 0 <= n <= max(0, self.num_blocks - lo):
            raise ValueError(f"spill: {n} columns asked, {max(0, self.num_blocks - lo)} device columns held")
        moved: dict[int, int] = {}  # device id -> host id
        cols = [sorted({row[j] for row in self.rows}) for j in range(lo, lo + n)]
        host_ids = iter(self.host.allocate(sum(map(len, cols))))
        for col in cols:
            for bid in col:
                moved[bid] = next(host_ids)
        for bid, hid in moved.items():  # (an id sits in one column: its references are that column's)
            for _ in range(self.blocks.refcount(bid) - 1):
                self.host.incref(hid)
        for row in self.rows:
            for j in range(lo, lo + n):
                bid = row[j]
                row[j] = moved[bid]
                self.blocks.decref(bid)
        self.host_upto = lo + n
        return sorted(moved.items())

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_blocks(self) -> int:
        """Logical blocks per row."""
        return len(self.rows[0]) if self.rows else 0

    @property
    def common(self) -> int:
        """The leading logical blocks every row holds alike (the same ids)."""
        return self._common

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
        change: Counter = Counter()  # (tier: 0 sinks, 1 host, 2 device; id) -> references gained (lost: < 0)
        if len(new_rows) != len(old):
            for j, bid in enumerate(old[0][:c]):
                change[self._tier_of(j), bid] += len(new_rows) - len(old)
        for rows, sign in ((new_rows, 1), (old, -1)):
            for row in rows:
                for j in range(c, len(row)):
                    change[self._tier_of(j), row[j]] += sign
        allocs = (self.sinks, self.host, self.blocks)
        for key, n in sorted(change.items(), key=lambda kv: -kv[1]):  # (gains before losses)
            alloc = allocs[key[0]]
            for _ in range(abs(n)):
                if n > 0:
                    alloc.incref(key[1])
                else:
                    alloc.decref(key[1])
        self.rows = new_rows
        self._common = self._common_from(c if new_rows else 0)
        self._run, self._run_common = self._runs_after(indices, len(old))

    def _tier_of(self, logical: int) -> int:
        return 0 if logical < self.sink_blocks else 1 if logical < self.host_upto else 2

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
        self.host_upto = max(self.sink_blocks, min(self.host_upto, n_blocks))
        self._common = min(self._common, n_blocks)
        self._run_common = min(self._run_common, n_blocks)

    def clear(self) -> None:
        self._release(self.rows)
        self.rows = []
        self.host_upto = self.sink_blocks
        self._common = 0
        self._run, self._run_common = 0, 0

    def _release(self, rows: list[list[int]]) -> None:
        for row in rows:
            for j, bid in enumerate(row):
                self.allocator_for(j).decref(bid)

    def unique_ids(self) -> tuple[set[int], set[int], set[int]]:
        """(sink ids, device block ids, host block ids) held by any row."""
        sink_ids, block_ids, host_ids = set(), set(), set()
        for row in self.rows:
            sink_ids.update(row[: self.sink_blocks])
            host_ids.update(row[self.sink_blocks : self.host_upto])
            block_ids.update(row[self.host_upto :])
        return sink_ids, block_ids, host_ids

    def check(self) -> None:
        """Raise AssertionError unless every refcount equals the entries holding it, and the
        blocks all rows hold alike are as many as recorded."""
        common = self._common_from(0)
        assert self._common == common, f"{self._common} leading blocks recorded as held by every row, {common} are"
        run = self._run
        assert (run == 0) == (not self.rows) and (not run or self.num_rows % run == 0), f"runs of {run} rows in {self.num_rows}"
        assert self._run_common == self._runs_from(run, 0), f"{self._run_common} leading blocks recorded as held by each run of {run} rows"
        assert self.sink_blocks <= self.host_upto <= max(self.sink_blocks, self.num_blocks), f"host columns end at {self.host_upto}"
        assert self.host is not None or self.host_upto == self.sink_blocks, "host columns without a host allocator"
        tiers = [(self.sinks, 0, self.sink_blocks), (self.blocks, self.host_upto, None)]
        if self.host is not None:
            tiers.append((self.host, self.sink_blocks, self.host_upto))
        for alloc, lo, hi in tiers:
            held = Counter(bid for row in self.rows for bid in row[lo:hi])
            for bid in range(alloc.capacity):
                assert alloc.refcount(bid) == held.get(bid, 0), (
                    f"{alloc.name} block {bid}: refcount {alloc.refcount(bid)} != {held.get(bid, 0)} holders"
                )
            assert alloc.num_used() == len(held), f"{alloc.name}: {alloc.num_used()} used != {len(held)} held"
