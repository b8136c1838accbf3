"""Split shares weighted by the warp slot each split runs in, timed against the equal shares.

On the H200 a grid's programs land on the same SMs and warp slots on every replay, and the
first warp of each scheduler (slots 0-3) walks pages ~8 % faster than the second (notes v26).
This script learns each program's slot from one timeline run (the kernel's STAMPS), builds
boundaries that give first-slot splits `weight` times a second-slot split's share (the sink
and tail blocks charged at what they cost in that run, in pages), and times the bench's call
with them (the kernel's BOUNDS, `triton.BOUND`) against the equal shares, in alternating
rounds, then prints the new timeline's ends. It answers which model of notes v26 holds: do the
programs keep their own rates, or do the second warps speed up as the first ones finish?

Usage (GPU machine, repo root):
  python3 scripts/diag_balance.py [FORMAT:CONTEXT:BATCH ...] [--weights 1.08 1.04] [--rounds 2] [--save FILE.pt]
Then, on any machine, what each class of program did under each set of shares (notes v27):
  python3 scripts/diag_balance.py --read FILE.pt
"""
import argparse
import bisect
import math
import sys

import torch

sys.path.insert(0, ".")
from longctx.bench import bench_decode
from longctx.ops.paged_attention import triton as K
from scripts.diag_parts import config
from scripts.diag_speed import views
from scripts.diag_timeline import timeline


def weighted_bounds(weights, n_sink, n_sealed, n_tail, dense, tail) -> list[int]:
    """Boundaries [len(weights) + 1] over a row's logical blocks (n_sink sink blocks, n_sealed
    pages, n_tail tail blocks): split s's share of the work in proportion to weights[s], a
    sink block costing `dense` pages and the whole tail `tail`. A block goes to the split
    whose share holds its start, so the boundaries partition the blocks whatever the weights."""
    unit = 1000  # integer work units a page
    cost = [round(dense * unit)] * n_sink + [unit] * n_sealed + [round(tail * unit / max(n_tail, 1))] * n_tail
    starts = [0]
    for c in cost:
        starts.append(starts[-1] + c)
    total, wsum = starts[-1], sum(weights)
    out, acc = [], 0.0
    for s in range(len(weights) + 1):
        cut = total if s == len(weights) else round(total * acc / wsum)
        out.append(bisect.bisect_left(starts, cut, 0, len(cost)))  # blocks starting before the cut
        if s < len(weights):
            acc += weights[s]
    return out


def block_costs(side0, page_us: float, split, S: int, n_sink: int, n_tail: int) -> tuple[float, float]:
    """What a sink block and the whole tail cost, in pages, from one run's stamps: how much later
    than the median program the splits holding them (the first and the last) start their pages
    (side0 [programs], us; split [programs], each program's split of S). At least a page each."""
    base = side0.median().item()
    dense = max(1.0, (side0[split == 0].median().item() - base) / page_us / max(n_sink, 1))
    tail = max(1.0, (side0[split == S - 1].median().item() - base) / page_us) if n_tail else 0.0
    return dense, tail


def by_class(saved: dict) -> None:
    """Per case, set of shares and copy: the first-slot and second-slot programs' mean pages, median
    time a page, median and last end (the splits holding the sink and the tail left out), how many
    programs sit in the other class than in the run the shares were learned from, and who ended last."""
    for case, sets in saved.items():
        learned = sets["equal shares"]["raw"][0][0][:, 6] < 4
        S = next((len(v["bounds"][0]) - 1 for v in sets.values() if "bounds" in v), None)  # splits a row
        for name, v in sets.items():
            for i, s in enumerate(v["raw"][0]):
                s = s.double()
                end = (s[:, 3] - s[:, 0].min()) / 1e3
                walk, pages, first = (s[:, 2] - s[:, 1]) / 1e3, s[:, 5], s[:, 6] < 4
                inner = pages > 0
                if S:
                    split = torch.arange(len(s)) % S
                    inner &= (split > 0) & (split < S - 1)
                parts = []
                for label, sel in (("first", first & inner), ("second", ~first & inner)):
                    parts.append(f"{label}: {pages[sel].mean():.2f} pages, {(walk[sel] / pages[sel]).median():.3f} us a page, "
                                 f"ends median {end[sel].median():.2f} max {end[sel].max():.2f}")
                last = int(end.argmax())
                print(f"{case} {name}, copy {i}: " + " | ".join(parts) + f" | class moved {(first != learned).double().mean():.3f}"
                      f" | last: slot {int(s[last, 6])}, {int(pages[last])} pages, end {end[last]:.2f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["int4:131072:1", "int4:524288:1", "int4:32768:8"])
    ap.add_argument("--weights", type=float, nargs="*", default=[1.08], help="a first-slot split's share against a second-slot one's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save", default=None, help="write each case's stamps (equal shares and each weighted set) and tables here (torch.save)")
    ap.add_argument("--read", default=None, help="print what a --save file holds, by warp-slot class (no GPU)")
    a = ap.parse_args()
    if a.read:
        return by_class(torch.load(a.read))
    saved = {}
    K.TUNE["merge"] = "launch"  # as under the bench's graphs
    for c in a.cases:
        fmt, T, B = c.split(":")
        T, B = int(T), int(B)
        K.BOUND = None
        _, raw = timeline(fmt, T, B)
        saved[c] = {"equal shares": {"raw": raw}}
        BH, S = K.LAST["grid"]
        s = raw[0][0].double()
        t = (s[:, :4] - s[:, 0].min()) / 1e3  # us: entry, side loop start and end, program end
        side0, slot, pages = t[:, 1], s[:, 6], s[:, 5]
        v = views(B, T, config(fmt), n=1)[0]
        P = v.pages.fmt.block_size
        n_blocks, n_sink, tail_len = v.block_table.shape[1], v.n_sink, v.tail_k.shape[2]
        n_tail = math.ceil(tail_len / P)
        page_us = ((t[:, 2] - t[:, 1])[pages > 0] / pages[pages > 0]).median().item()
        split = torch.arange(BH * S) % S  # the stamps' order: program (row x KV head) * S + split
        dense, tail = block_costs(side0, page_us, split, S, n_sink, n_tail)
        print(f"== {c}: grid ({BH}, {S}), {n_sink} sink, {n_blocks - n_sink} sealed, tail {tail_len} tokens; "
              f"first slots {(slot < 4).float().mean():.2f} of programs; a page {page_us:.3f} us, "
              f"a sink block {dense:.2f} pages, the tail {tail:.2f}")
        sets = {"equal shares": None}
        for w in a.weights:
            rows = [weighted_bounds([w if slot[p * S + sp] < 4 else 1.0 for sp in range(S)], n_sink, n_blocks - n_sink, n_tail, dense, tail)
                    for p in range(BH)]
            sets[f"first slots x{w}"] = torch.tensor(rows, dtype=torch.int32, device="cuda")
        for r in range(a.rounds):
            for name, bound in sets.items():
                K.BOUND = bound
                try:
                    res = bench_decode([T], [B], formats=(fmt,), graph=True)
                finally:
                    K.BOUND = None
                sdpa = next(x.ms for x in res if x.name == "SDPA dense bf16")
                ours = next(x.ms for x in res if x.name.startswith("longctx"))
                print(f"{c} round {r} {name}: SDPA {sdpa * 1e3:.2f} us, {fmt} {ours * 1e3:.2f} us, {sdpa / ours:.3f}x", flush=True)
        for name, bound in sets.items():
            if bound is None:
                continue
            K.BOUND = bound
            try:
                print(f"-- timeline with {name}:")
                saved[c][name] = {"raw": timeline(fmt, T, B)[1], "bounds": bound.cpu()}
            finally:
                K.BOUND = None
        if a.save:
            torch.save(saved, a.save)  # after each case, so that a time limit keeps the cases done


if __name__ == "__main__":
    main()
