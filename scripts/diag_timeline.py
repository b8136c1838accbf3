"""When each program of the decode kernel starts, walks its sealed pages and ends: the
kernel's STAMPS hook (%globaltimer readings, `triton.STAMP`), read from CUDA-graph replays of
the bench's views (merge launch, as the bench runs). It tells the kernel's span apart into
the launch ramp (programs starting late), the work (the side loop, per page) and the wave's
end (programs finishing after the others), and whether slow programs share SMs.

Usage (GPU machine, repo root): python3 scripts/diag_timeline.py [FORMAT:CONTEXT:BATCH ...]
  [--tune KEY=VALUE ...] [--save FILE.pt]
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from longctx.ops.paged_attention import paged_attention
from longctx.ops.paged_attention import triton as K
from scripts.diag_parts import config, overrides
from scripts.diag_speed import views

Hq, D = 32, 128


def pct(x: torch.Tensor, q: float) -> float:
    return torch.quantile(x.double(), q).item()


def timeline(fmt: str, T: int, B: int, copies: int = 4, reps: int = 10, snaps: int = 1):
    vs = views(B, T, config(fmt), n=copies)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    paged_attention(q, vs[0], backend="triton", return_lse=False)  # compile, fit
    grid = K.LAST["grid"]
    n = grid[0] * grid[1]
    bufs = [torch.zeros(n * 8, dtype=torch.int64, device="cuda") for _ in vs]

    def call(i):
        K.STAMP = bufs[i]
        try:
            return paged_attention(q, vs[i], backend="triton", return_lse=False)
        finally:
            K.STAMP = None

    call(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(vs)):
            call(i)
    raw = []  # [snaps][copies] int64 [programs, 8]: the stamps after each round of replays
    for _ in range(snaps):
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        raw.append([buf.view(n, 8).cpu().clone() for buf in bufs])
    rows = []
    for i, buf in enumerate(bufs):
        s = buf.view(n, 8).cpu()
        t0 = s[:, 0].min()
        entry, side0, side1, end = [(s[:, k] - t0).double() / 1e3 for k in range(4)]  # us
        sm, pages = s[:, 4], s[:, 5]
        span = end.max().item()
        walk = side1 - side0
        per_page = walk[pages > 0] / pages[pages > 0]
        rows.append((span, entry, side0, walk, side1, end, sm, pages, per_page))
        print(f"== {fmt} {T} B{B}, copy {i}: grid {grid}, span {span:.2f} us (first entry to last end)")
        print(f"   entries: median {pct(entry, .5):.2f}, p99 {pct(entry, .99):.2f}, last {entry.max():.2f} us")
        print(f"   side loop starts: median {pct(side0, .5):.2f}, last {side0.max():.2f} us after the first entry")
        print(f"   side loop: {pages.max().item()} pages at most, per program median {pct(walk, .5):.2f}, p10 {pct(walk, .1):.2f}, "
              f"p90 {pct(walk, .9):.2f}, max {walk.max():.2f} us; a page median {pct(per_page, .5):.3f} us")
        print(f"   ends: min {end.min():.2f}, median {pct(end, .5):.2f}, p90 {pct(end, .9):.2f}, max {span:.2f} us; "
              f"finish (store) median {pct(end - side1, .5):.2f} us")
        by_sm = torch.zeros(int(sm.max()) + 1, dtype=torch.float64).index_reduce_(0, sm.long(), end, "amax", include_self=False)
        used = torch.bincount(sm.long())
        ends = by_sm[used > 0]
        print(f"   SMs used {int((used > 0).sum())}, programs an SM {used[used > 0].min().item()}-{used.max().item()}; "
              f"an SM's last end: min {ends.min():.2f}, median {pct(ends, .5):.2f}, max {ends.max():.2f} us")
        slow = end > pct(end, .95)
        print(f"   the slowest 5 %: side loop {walk[slow].mean():.2f} us against {walk[~slow].mean():.2f}, start {side0[slow].mean():.2f} "
              f"against {side0[~slow].mean():.2f}, pages {pages[slow].double().mean():.1f} against {pages[~slow].double().mean():.1f}")
    return rows, raw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["int4:131072:1", "int4:524288:1", "int4:32768:8", "int8:131072:1"])
    ap.add_argument("--tune", nargs="*", default=[], help="TUNE overrides, KEY=VALUE (Python literals)")
    ap.add_argument("--save", default=None, help="write every case's raw stamps here (torch.save)")
    ap.add_argument("--snaps", type=int, default=1, help="rounds of replays whose stamps are kept (saved), to compare calls")
    a = ap.parse_args()
    K.TUNE.update(overrides(a.tune))
    K.TUNE["merge"] = "launch"  # as under the bench's graphs
    saved = {}
    for c in a.cases:
        fmt, T, B = c.split(":")
        rows, raw = timeline(fmt, int(T), int(B), snaps=a.snaps)
        saved[c] = dict(raw=raw, grid=K.LAST["grid"])
    if a.save:
        torch.save(saved, a.save)


if __name__ == "__main__":
    main()
