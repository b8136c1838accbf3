"""What balancing the shares between an SM's first and second warps could buy, from saved stamps.

Reads `scripts/diag_timeline.py --snaps N --save FILE` (any machine, no GPU) and prints, per
case: the page time by rank on the SM (launch order) and, where the stamps hold them, by warp
slot; how often the launch order (lin < 4 x SMs) names the first warps; the SMs holding 7 and
8 programs, their pages and when their last program ends; and the largest end,
measured and under two models of weighted shares (notes v26; its per-scheduler-pair model is
arithmetic on the page times printed here):
  - "SM": each SM's programs end together at the SM's summed page rate (the second warps speed
    up as the first ones finish);
  - "own": each program keeps its measured page rate; the first-warp shares are dealt by launch
    order, or by each program's true rank (a run-time claim, charged `--claim` us).
Shares are weighted by `--weights` (a first warp's against a second's); the sink and tail
blocks cost what they cost in the stamps (how much later their splits start their pages).

Usage: python3 scripts/slot_model.py FILE.pt [--weights 1.04 1.077] [--claim 0.7]
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from scripts.diag_balance import block_costs, weighted_bounds


def ranks(sm: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
    """Each program's rank on its SM by launch order (linear block id)."""
    rank = torch.zeros_like(lin)
    for m in sm.unique():
        sel = (sm == m).nonzero().flatten()
        rank[sel[lin[sel].argsort()]] = torch.arange(len(sel))
    return rank


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--weights", type=float, nargs="*", default=[1.04, 1.077])
    ap.add_argument("--claim", type=float, default=0.7, help="us a run-time claim adds to a program's start")
    a = ap.parse_args()
    for case, v in torch.load(a.file).items():
        BH, S = v["grid"]
        runs = [s.double() for snap in v["raw"] for s in snap]
        n = runs[0].shape[0]
        idx = torch.arange(n)
        pid, split = idx // S, idx % S
        lin = pid + BH * split
        sms = int(max(r[:, 4].max() for r in runs)) + 1
        print(f"== {case}: grid ({BH}, {S}), {len(runs)} runs, {sms} SMs")
        rows = {k: [] for k in ("measured", "SM") + tuple(f"{how} x{w}" for w in a.weights for how in ("own, launch order", "own, true rank"))}
        for r in runs:
            t0 = r[:, 0].min()
            side0, side1, end = r[:, 1] - t0, r[:, 2] - t0, r[:, 3] - t0
            side0, side1, end = side0 / 1e3, side1 / 1e3, end / 1e3  # us
            sm, pages = r[:, 4].long(), r[:, 5]
            rank = ranks(sm, lin)
            rate = torch.where(pages > 2, (side1 - side0) / pages.clamp(min=1), torch.nan)  # us a page
            for c in (rank < 4, rank >= 4):
                rate[c & rate.isnan()] = rate[c & ~rate.isnan()].mean()
            base = side0.median().item()
            page = rate.median().item()
            dense, tail = block_costs(side0, page, split, S, 1, 1)  # (the bench's views: one sink block, a tail block)
            n_blocks = int(pages.sum().item() / BH) + 1  # sealed pages a row and head, plus the sink block
            rows["measured"].append(end.max().item())
            # SM model: an SM's programs end together at its summed rate
            ends = []
            for m in sm.unique():
                sel = (sm == m) & (pages > 2)
                ends.append((pages[sel].sum() / (1 / rate[sel]).sum()).item() + base + 0.3)
            rows["SM"].append(max(ends))
            for w in a.weights:
                bounds = [weighted_bounds([w if p + BH * s < 4 * sms else 1.0 for s in range(S)], 1, n_blocks - 1, 1, dense, tail)
                          for p in range(BH)]
                for how, fast in (("own, launch order", None), ("own, true rank", rank < 4)):
                    item = idx.clone()
                    claim = 0.0
                    if fast is not None:  # first warps claim the first-class shares in launch order, the rest the others
                        nf = int((lin < 4 * sms).sum())
                        f = fast.nonzero().flatten()
                        f = f[lin[f].argsort()]
                        o = (~fast).nonzero().flatten()
                        o = o[lin[o].argsort()]
                        order = torch.cat([f[:nf], o, f[nf:]])
                        by_lin = lin.argsort()
                        item[order] = by_lin[torch.arange(n)]
                        claim = a.claim
                    new = []
                    for i in range(n):
                        j = int(item[i])
                        lo, hi = bounds[j // S][j % S], bounds[j // S][j % S + 1]
                        sealed = max(0, min(hi, n_blocks) - max(lo, 1))
                        new.append(base + claim + (dense * page if lo < 1 else 0) + (tail * page if hi > n_blocks else 0) + sealed * rate[i].item() + 0.3)
                    rows[f"{how} x{w}"].append(max(new))
        r = runs[0]
        sm = r[:, 4].long()
        rank = ranks(sm, lin)
        per = (r[:, 2] - r[:, 1]) / 1e3 / r[:, 5].clamp(min=1)
        print("   us a page by rank:", ", ".join(f"{k} {per[(rank == k) & (r[:, 5] > 2)].mean():.3f}" for k in range(int(rank.max()) + 1)))
        if (r[:, 6] > 0).any():
            slot = r[:, 6].long()
            print("   us a page by warp slot:", ", ".join(f"{k} {per[(slot == k) & (r[:, 5] > 2)].mean():.3f}" for k in range(int(slot.max()) + 1)))
        print(f"   launch order names the first warps (lin < 4 x SMs == rank < 4) for {((lin < 4 * sms) == (rank < 4)).double().mean():.3f} of programs")
        # SMs by how many programs they hold: their pages and their last program's end (mean over the runs)
        for k in sorted({int(c) for c in torch.bincount(sm)[torch.bincount(sm) > 0]}):
            pages_k, last_k, count = [], [], 0
            for run in runs:
                m, e = run[:, 4].long(), (run[:, 3] - run[:, 0].min()) / 1e3
                held = torch.bincount(m)
                pick = (held == k).nonzero().flatten()
                count = len(pick)
                pages_k += [run[m == j, 5].sum().item() for j in pick]
                last_k += [e[m == j].max().item() for j in pick]
            print(f"   SMs holding {k} programs: {count}, {sum(pages_k) / len(pages_k):.1f} pages, last end {sum(last_k) / len(last_k):.2f} us "
                  f"({min(last_k):.2f}-{max(last_k):.2f})")
        for k, vals in rows.items():
            x = torch.tensor(vals)
            print(f"   largest end, {k}: {x.mean():.2f} us ({x.min():.2f}-{x.max():.2f})")


if __name__ == "__main__":
    main()
