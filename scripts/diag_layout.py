"""What read bandwidth the decode kernel's page walk can reach with no arithmetic, and whether
the pool's split layout costs any of it.

A page of int4 K and V (64 tokens, head_dim 128, groups of 64) is six pieces a KV head: K codes
(4 KiB; int8 8 KiB), V codes (the same), and K's scales, K's zeros, V's scales and V's zeros (256 B each),
each in its own pool tensor (`split`), as the cache stores them. The kernel here walks the
same pages as the decode kernel (one-warp programs, one per KV head and split, 128 splits: 16
pages a program at 128k, 64 at 512k, through a shuffled block table, Triton's pipelined
copies) and only sums what it reads.
It reads the same bytes laid out three ways:
  split   - six tensors, as the cache has them;
  record  - one record per (block, head) (9 KiB at int4), the six pieces back to back, shuffled blocks;
  ordered - records, each program's blocks consecutive in memory (a dense stream).
Also SDPA's flash kernel over dense bf16 K/V of the same context (the bench's peer), for the
bandwidth it reaches. Times are means of CUDA-graph replays over two pools (so that L2 cannot
hold a pool between replays).

With --spin N the walk also does N dependent FMAs on each word of K and V codes a page (N x 32
a thread at int4): how much arithmetic a page the walk hides behind its copies.

Usage (GPU machine, repo root): python3 scripts/diag_layout.py [CONTEXT ...] [--bits 4] [--stages 2 3] [--per-step 1 2]
    [--layouts split record ordered] [--spin 0 20 40]
(batch 8 at 32k walks the pages and programs of batch 1 at 256k: 1,024 programs of 32 pages)
"""
import argparse
import functools
import math

import torch
import triton
import triton.language as tl

H, D, P = 8, 128, 64
SMALL = 64  # int32 words of one scale or zero piece (fp16/bf16, 128 channels or 64 tokens x 2 groups): 256 B


def big(bits: int) -> int:
    """int32 words of a page's K (or V) codes: 1024 at int4, 2048 at int8."""
    return P * D * bits // 8 // 4


@triton.jit
def _walk(TABLE, KC, VC, KS, KZ, VS, VZ, OUT, pages_per, n_blocks, H: tl.constexpr, BIG: tl.constexpr, SMALL: tl.constexpr,
          RECORD: tl.constexpr, NS: tl.constexpr, PS: tl.constexpr, SPIN: tl.constexpr = 0):
    """One program per (KV head, split) reads its pages_per blocks of TABLE, PS a step in NS
    pipeline stages (an odd count re-reads the last page), from the six pool tensors or, with
    RECORD, from one record per (block, head) in KC; stores a checksum of them in OUT."""
    pid = tl.program_id(0)
    h = pid % H
    split = pid // H
    ob = tl.arange(0, BIG)
    osm = tl.arange(0, SMALL)
    acc = tl.zeros((BIG,), tl.int32)
    acs = tl.zeros((SMALL,), tl.int32)
    lo = split * pages_per
    hi = tl.minimum(lo + pages_per, n_blocks)
    for j in tl.range(lo, hi, PS, num_stages=NS):
        for w in tl.static_range(PS):
            bh = (tl.load(TABLE + tl.minimum(j + w, hi - 1)) * H + h).to(tl.int64)
            if RECORD:
                base = KC + bh * (2 * BIG + 4 * SMALL)
                a = tl.load(base + ob)
                b = tl.load(base + BIG + ob)
                c = tl.load(base + 2 * BIG + osm)
                d = tl.load(base + 2 * BIG + SMALL + osm)
                e = tl.load(base + 2 * BIG + 2 * SMALL + osm)
                f = tl.load(base + 2 * BIG + 3 * SMALL + osm)
            else:
                a = tl.load(KC + bh * BIG + ob)
                b = tl.load(VC + bh * BIG + ob)
                c = tl.load(KS + bh * SMALL + osm)
                d = tl.load(KZ + bh * SMALL + osm)
                e = tl.load(VS + bh * SMALL + osm)
                f = tl.load(VZ + bh * SMALL + osm)
            if SPIN:  # SPIN dependent FMAs on each word of K and V codes: arithmetic a page, to hide
                x = (a + b).to(tl.float32)
                for _ in tl.static_range(SPIN):
                    x = x * 0.999 + 1.0
                acc ^= x.to(tl.int32)
            else:
                acc ^= a + b
            acs ^= c + d + e + f
    tl.store(OUT + pid, tl.sum(acc, 0) + tl.sum(acs, 0))


def graph_time(fns, reps=20):
    """Mean ms of one call, the calls of `fns` in turn inside one CUDA graph, replayed back to
    back. Not the bench's `_time_graph` (the median of single replays, each waited for): that
    divides each replay's launch latency by the calls in the graph, two here, and read higher
    (one H200 call with it: the walk 38.5 us at 128k, SDPA 131.8; four calls with this one:
    36.3-36.9 and 124.6-127.3)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps / len(fns)


def walk(T: int, bits: int, splits: int, runs, layouts, spins=(0,)) -> None:
    """Time the walk at context T over two pools of random words, for each (stages, pages a
    step) in `runs`, each layout and each count of FMAs a code word (`spins`)."""
    dev = "cuda"
    BIG = big(bits)
    REC = 2 * BIG + 4 * SMALL  # a record's words
    n = T // P
    per = math.ceil(n / splits)
    grid = (H * math.ceil(n / per),)
    nbytes = n * H * REC * 4
    pools = []
    for _ in range(2):
        pieces = [torch.randint(-2**31, 2**31 - 1, (n * H * w,), dtype=torch.int32, device=dev) for w in (BIG, BIG, SMALL, SMALL, SMALL, SMALL)]
        rec = torch.randint(-2**31, 2**31 - 1, (n * H * REC,), dtype=torch.int32, device=dev)
        pools.append((pieces, rec, torch.randperm(n, device=dev).to(torch.int32), torch.arange(n, dtype=torch.int32, device=dev)))
    out = torch.empty(grid[0], dtype=torch.int32, device=dev)
    print(f"== int{bits}, context {T}: {n} blocks a head, {per} pages a program, {grid[0]} programs, {nbytes / 1e6:.1f} MB a call")

    def call(pool, name, stages, ps, spin):
        pieces, rec, shuf, order = pool
        args = (shuf, *pieces) if name == "split" else (order if name == "ordered" else shuf, rec, rec, rec, rec, rec, rec)
        _walk[grid](*args, out, per, n, H=H, BIG=BIG, SMALL=SMALL, RECORD=name != "split", NS=stages, PS=ps, SPIN=spin, num_warps=1,
                    num_stages=stages)

    for stages, ps in runs:
        for name in layouts:
            for spin in spins:
                ms = graph_time([functools.partial(call, pool, name, stages, ps, spin) for pool in pools])
                what = f", {spin} FMAs a word ({spin * BIG // 32} a thread and page)" if spin else ""
                print(f"  {name:8s} {stages} stages, {ps} a step{what}: {ms * 1e3:8.2f} us, {nbytes / ms / 1e9:6.2f} TB/s", flush=True)


def sdpa(T: int) -> None:
    """SDPA's time over dense bf16 K and V of context T (32 query heads on 8 KV heads)."""
    kv = [torch.randn(1, H, T, D, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    q = torch.randn(1, 4 * H, 1, D, dtype=torch.bfloat16, device="cuda")
    fns = [functools.partial(torch.nn.functional.scaled_dot_product_attention, q, kv[i], kv[(i + 1) % 4], enable_gqa=True) for i in range(4)]
    ms = graph_time(fns)
    dense = 2 * H * T * D * 2
    print(f"  SDPA dense bf16: {ms * 1e3:8.2f} us, {dense / ms / 1e9:6.2f} TB/s ({dense / 1e6:.0f} MB)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("contexts", nargs="*", type=int, default=[131072, 524288])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--layouts", nargs="*", default=["split", "record", "ordered"], choices=("split", "record", "ordered"))
    ap.add_argument("--stages", nargs="*", type=int, default=[2, 3])
    ap.add_argument("--per-step", nargs="*", type=int, default=[1, 2], help="pages a loop step")
    ap.add_argument("--splits", type=int, default=128)
    ap.add_argument("--no-sdpa", action="store_true", help="leave out SDPA's time")
    ap.add_argument("--spin", nargs="*", type=int, default=[0], help="dependent FMAs on each K and V code word a page (0: none)")
    a = ap.parse_args()
    if any(T < P or T % P for T in a.contexts):
        ap.error(f"contexts must be positive multiples of the page size, {P} tokens: got {a.contexts}")
    if not (a.stages and a.per_step and a.spin and a.layouts):
        ap.error("--stages, --per-step, --spin and --layouts each need at least one value")
    if a.splits < 1 or min(a.spin) < 0 or min(a.stages) < 1 or min(a.per_step) < 1:
        ap.error("--splits, --stages and --per-step take positive counts, --spin counts from 0")
    for T in a.contexts:
        walk(T, a.bits, a.splits, [(s, p) for s in a.stages for p in a.per_step], a.layouts, a.spin)
        torch.cuda.empty_cache()
        if not a.no_sdpa:
            sdpa(T)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
