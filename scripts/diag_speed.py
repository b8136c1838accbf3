"""Sweep the decode kernel's variants and launch knobs on the GPU; print a table, write the best.

Usage (GPU machine, repo root): python3 scripts/diag_speed.py OUT.json [CASE ...]
(CASE: substrings of the SWEEP labels to run, e.g. "int4 4k"; all by default.)
Each variant is checked against the reference path (gather + dequantize + SDPA) on the same
view before it is timed; a variant that errs is reported and never chosen.
"""
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.bench import _copies, _time_graph, bench_decode, synthetic_view, view_bytes  # noqa: E402
from longctx.ops.paged_attention import paged_attention  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402

Hq, H, D = 32, 8, 128
DEFAULT = dict(K.TUNE)


def views(B, T, cfg, n=None):
    one = synthetic_view(B, T, H, D, cfg, "cuda")
    L = n or _copies(view_bytes(one))
    return [one] + [synthetic_view(B, T, H, D, cfg, "cuda", seed=i) for i in range(1, L)]


def measure(vs, q, tune, reps=15):
    K.TUNE.clear()
    K.TUNE.update(tune)
    ref, _ = paged_attention(q, vs[0], backend="reference")
    out, _ = paged_attention(q, vs[0], backend="triton")
    # relative to the output's size: synthetic int8 values reach ~40, where a bf16 ulp is 0.25
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    # GPU time (CUDA graph replay): eager timing at 128k is bound by the host's launches
    ms = _time_graph(lambda i: paged_attention(q, vs[i], backend="triton", return_lse=False), len(vs), reps)
    kern = K.LAST.get("kernel")
    regs = (kern.n_regs, kern.n_spills, K.LAST.get("grid")) if kern is not None else (-1, -1, None)
    return ms, err, regs


def sdpa_ms(B, T):
    """The bench's SDPA dense bf16 peer, GPU time (CUDA-graph replays)."""
    rows = bench_decode([T], [B], formats=(), graph=True)
    return next(r.ms for r in rows if r.name == "SDPA dense bf16")


# (label, bits, context, batch, block size, variants): each variant is TUNE's default plus
# its overrides. The sweeps of earlier sessions (pages, asm, warps, stages, occupancy, v16,
# words) and what they found are in notes/decode-kernel.md.
# Side by side (TUNE["side"]): W sealed pages a step, one a warp, along the batch dimension of
# 3-D dots (no cross-warp exchange a page). side_k16: K's arithmetic there (1: scales folded
# into the query per page against fp16 1024 + code; 3: K dequantized in 16 bits). The sweeps
# of the first side-by-side session (rows, stages, register caps) are in the notes (v11).
# side_vt: values transposed, their per-token scales folded into the probabilities (notes v12).
# The sweep of asm, side 1/2 and register caps that chose the defaults is in the notes (v12).
# side_bits 8 (the default now): int8 pages side by side too, their codes converted by PRMT
# blocks (K biased by 1024 against q*s, V exact). Register caps at 168 spilled on the GPU and
# ran about twice as long (notes v13).
# side_short: short contexts (a page or two a program) side by side too, side pages a split.
# side_vbias (v13, removed): V's codes biased by 1024 as K's, the bias taken out once at the
# end; no faster. side_dense: side by side, the sinks' and the tail's tokens a step (16, 32).
# side_apart: the sinks and the tail in a split of their own (the last), the sealed pages in
# the others, so that no program walks its share of pages and the tail too. Measured with
# the merge launch's spill at more than 128 splits (notes v13), which merge_chunk 128 (the
# default) removes.
# v14 (notes v14): a working tree that ran the side loop first and the sinks and tail after it
# (their state, and the query they need, had been live across the side loop) compiled to 168
# registers with side_dense 16 (12 warps an SM) and 255 with 32; these variants timed it:
# side_dense 16 (12 warps) 128k 0.0563 against 0.0530 ms, 512k 0.1851 against 0.1903, B8 32k
# 0.0998 against 0.0936, 4k 0.0125 against 0.0117; with three stages too, 0.0771 at 128k. Not
# kept.
D16 = {"side_dense": 16}
# v15 (notes v15): side_zdot (V's zero-point term as a small dot) is the default for V of at
# most 4 bits, merge_cols 32 (the merge launch in column blocks at small batch) too; these
# variants time each without it.
NZ = {"side_zdot": 0}
NC = {"merge_cols": 0}
# v16 (notes v16): side_skip (programs of more than two pages without sinks or tail skip the
# unquantized loops) is the default; these variants time each without it, and three side
# stages (faster at 512k, slower at 128k). Whole-call readings move by ~5 %: confirm a win with
# scripts/diag_parts.py --ab (kernel times, alternating rounds).
SK = {"side_skip": False}
S3 = {"side_stages": 3}
SWEEP = [
    ("int4 4k", 4, 4096, 1, 64, [{}, NZ, NC]),
    ("int4 128k", 4, 131072, 1, 64, [{}, SK, NZ, NC, D16, S3]),
    ("int4 512k", 4, 524288, 1, 64, [{}, SK, NZ, NC, S3]),
    ("int8 128k", 8, 131072, 1, 64, [{}, SK, {"side_zdot": 8}, NC]),
    ("int4 32k B8", 4, 32768, 8, 64, [{}, SK, NZ, S3]),
]


def main(path, only=None):
    results, best = [], {}
    torch.manual_seed(0)
    for label, bits, T, B, bs, variants in SWEEP:
        if only and not any(o in label for o in only):
            continue
        base = sdpa_ms(B, T)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        print(f"== {label}: SDPA dense bf16 {base:.4f} ms", flush=True)
        vs = views(B, T, KVConfig(bits=bits, block_size=bs))
        cands = []
        for kw in variants:
            tune = dict(DEFAULT, **kw)
            t0 = time.time()
            try:
                ms, err, regs = measure(vs, q, tune)
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                print(f"  {kw}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            ok = err < 0.02
            row = dict(case=label, T=T, B=B, block_size=bs, **tune, ms=ms, ratio=base / ms, sdpa_ms=base, err=err, regs=regs[0], spills=regs[1])
            results.append(row)
            if ok:
                cands.append(row)
            print(f"  {kw or 'default'}: {ms:.4f} ms ({base / ms:.2f}x) err {err:.1e} regs/spills/grid {regs} {'' if ok else 'BAD'} [{time.time() - t0:.1f}s]", flush=True)
        if cands:
            best[label] = min(cands, key=lambda r: r["ms"])
            print("  best:", {k: best[label][k] for k in ("ms", "ratio", *DEFAULT)}, flush=True)
        del vs
        torch.cuda.empty_cache()
        K.TUNE.clear()
        K.TUNE.update(DEFAULT)
    json.dump(dict(results=results, best=best), open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/diag_speed.json", sys.argv[2:])
