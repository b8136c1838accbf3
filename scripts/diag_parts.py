"""Where a decode call's GPU time goes: each kernel's mean duration inside CUDA-graph replays
(torch.profiler's CUPTI records), against the call's whole replay time from the bench's own
graph timing. The gap between the sum of the kernels and the call is launch latency and idle
SMs between the kernels, which no kernel change removes.

Usage (GPU machine, repo root): python3 scripts/diag_parts.py [FORMAT:CONTEXT:BATCH ...] [--tune KEY=VALUE ...]
  FORMAT: int4, int8 or bf16, optionally /gN for V groups of N channels (int8/g128)
  e.g. python3 scripts/diag_parts.py int4:4096:1 int4:131072:1 int4:524288:1 --tune side_dense=16
--ordered: each row's table walks the pool in order (the bench's views place the blocks at
shuffled slots): how much the kernel's time depends on where the pages lie in DRAM.
--bare: also each case without the sink block and with a one-token tail (sealed pages only):
what the sinks and the tail add to the call.
--splits N [N ...]: also each case at these split counts (the launcher's choice otherwise):
with contexts at one split count, the kernel's time per page a program against its fixed part.
--ab "KEY=VALUE,KEY=VALUE" [...]: A/B runs: each case with TUNE's defaults (after --tune) and
with each of these override sets, in turn, --rounds times (same process, same views' shapes).
"""
import argparse
import ast
import contextlib
import dataclasses
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from longctx import KVConfig
from longctx.bench import _time_graph, bench_decode
from longctx.ops.paged_attention import paged_attention
from longctx.ops.paged_attention import triton as K
from scripts.diag_speed import views

Hq, D = 32, 128
BITS = {"int4": 4, "int8": 8, "bf16": 16}


def config(fmt: str) -> KVConfig:
    """A case's format: int4, int8 or bf16, optionally /gN for V groups of N channels
    (e.g. int8/g128; the default otherwise)."""
    name, _, g = fmt.partition("/g")
    return KVConfig(bits=BITS[name], block_size=64, group_size=int(g) if g else None)


def parts(fmt: str, T: int, B: int, copies: int = 4, reps: int = 20, ordered: bool = False, bare: bool = False, splits: int | None = None,
          vs=None):
    vs = vs or views(B, T, config(fmt), n=copies)
    if bare:  # the sink block read as a sealed page (its pool slot holds one), one tail token
        vs = [dataclasses.replace(v, n_sink=0, tail_k=v.tail_k[:, :, :1], tail_v=v.tail_v[:, :, :1]) for v in vs]
    if ordered:  # row b's sealed block j at pool slot b * n + j (the sink columns keep theirs)
        for v in vs:
            t = v.block_table
            order = torch.arange(t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape)
            t[:, v.n_sink:] = order[:, v.n_sink:]
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)

    def call(i):
        if splits:
            return K.paged_decode_triton(q, vs[i], None, D**-0.5, return_lse=False, splits=splits)
        return paged_attention(q, vs[i], backend="triton", return_lse=False)

    whole = _time_graph(call, len(vs), reps)
    g = torch.cuda.CUDAGraph()
    call(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(len(vs)):
            call(i)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    dur = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            dur[e.name].append(e.device_time)  # us
    calls = reps * len(vs)
    kern = K.LAST.get("kernel")
    how = (" (table in pool order)" if ordered else "") + (" (no sinks, one tail token)" if bare else "") + (f" ({splits} splits)" if splits else "")
    print(f"== {fmt} {T} B{B}{how}: whole call {whole * 1e3:.2f} us (graph timing); grid {K.LAST.get('grid')}, "
          f"registers {getattr(kern, 'n_regs', '?')}, spills {getattr(kern, 'n_spills', '?')}", flush=True)
    total = 0.0
    for name, ds in sorted(dur.items(), key=lambda kv: -sum(kv[1])):
        per_call = sum(ds) / calls
        total += per_call
        print(f"  {name[:60]:60s} x{len(ds) / calls:.0f} a call, {sum(ds) / len(ds):8.2f} us each, {per_call:8.2f} us a call")
    print(f"  kernels {total:.2f} us a call; the rest {whole * 1e3 - total:.2f} us (launches, idle gaps)", flush=True)


def overrides(items) -> dict:
    """TUNE overrides from KEY=VALUE strings (Python literals)."""
    out = {}
    for kv in items:
        k, v = kv.split("=", 1)
        if k not in K.TUNE:
            raise SystemExit(f"unknown TUNE key {k!r}")
        out[k] = ast.literal_eval(v)
    return out


def ab_sets(items) -> list[dict]:
    """TUNE's defaults ({}) and then each "KEY=VALUE,KEY=VALUE" override set of --ab."""
    return [{}] + [overrides(x.split(",")) for x in items]


@contextlib.contextmanager
def tuned(o: dict):
    """TUNE with the overrides `o` inside the block, as it was after it."""
    base = dict(K.TUNE)
    K.TUNE.update(o)
    try:
        yield
    finally:
        K.TUNE.clear()
        K.TUNE.update(base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["int4:4096:1", "int4:131072:1", "int4:524288:1", "int4:32768:8", "int8:131072:1"])
    ap.add_argument("--tune", nargs="*", default=[], help="TUNE overrides, KEY=VALUE (Python literals)")
    ap.add_argument("--sdpa", action="store_true", help="also the bench's SDPA dense bf16 time for each case")
    ap.add_argument("--ordered", action="store_true", help="also each case with its tables in pool order")
    ap.add_argument("--bare", action="store_true", help="also each case without sinks and with a one-token tail")
    ap.add_argument("--splits", nargs="*", type=int, default=[], help="also each case at these split counts")
    ap.add_argument("--ab", nargs="*", default=[], help='override sets "KEY=VALUE,KEY=VALUE" run in turn with the defaults')
    ap.add_argument("--rounds", type=int, default=2, help="with --ab: rounds of the default and every set")
    a = ap.parse_args()
    if a.ab and (a.ordered or a.bare or a.splits or a.sdpa):
        raise SystemExit("--ab runs the default and its sets alone: leave out --ordered, --bare, --splits and --sdpa")
    K.TUNE.update(overrides(a.tune))
    print("TUNE overrides:", a.tune or "none")
    sets = ab_sets(a.ab)
    for c in a.cases:
        fmt, T, B = c.split(":")
        if a.ab:
            vs = views(int(B), int(T), config(fmt), n=4)
            for r in range(a.rounds):
                for o in sets:
                    print(f"-- round {r}, {o or 'default'}")
                    with tuned(o):
                        parts(fmt, int(T), int(B), vs=vs)
            del vs
            continue
        parts(fmt, int(T), int(B))
        if a.ordered:
            parts(fmt, int(T), int(B), ordered=True)
        if a.bare:
            parts(fmt, int(T), int(B), bare=True)
        for n in a.splits:
            parts(fmt, int(T), int(B), splits=n)
        if a.sdpa:
            rows = bench_decode([int(T)], [int(B)], formats=(), graph=True)
            print("  SDPA dense bf16:", next(r.ms for r in rows if r.name == "SDPA dense bf16") * 1e3, "us")


if __name__ == "__main__":
    main()
