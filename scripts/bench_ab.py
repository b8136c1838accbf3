"""The bench's own number (`bench_decode(..., graph=True)`: a whole call, CUDA-graph replays,
ratio to SDPA dense bf16 in the same process) for TUNE's defaults and for override sets, in
alternating rounds: an A/B of what the acceptance targets measure, where scripts/diag_parts.py
times the kernels alone.

Usage (GPU machine, repo root):
  python3 scripts/bench_ab.py --ab "pdl=True" [--cases int4:131072:1 ...] [--rounds 2] [--block-size 128]
"""
import argparse
import sys

sys.path.insert(0, ".")
from longctx.bench import bench_decode
from scripts.diag_parts import ab_sets, tuned


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["int4:131072:1", "int4:524288:1", "int4:32768:8", "int8:131072:1"])
    ap.add_argument("--ab", nargs="*", default=[], help='override sets "KEY=VALUE,KEY=VALUE"')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64, help="tokens a page")
    a = ap.parse_args()
    sets = ab_sets(a.ab)
    for c in a.cases:
        fmt, T, B = c.split(":")
        for r in range(a.rounds):
            for o in sets:
                with tuned(o):
                    rows = bench_decode([int(T)], [int(B)], formats=(fmt,), graph=True, block_size=a.block_size)
                sdpa = next(x.ms for x in rows if x.name == "SDPA dense bf16")
                ours = next(x.ms for x in rows if x.name.startswith("longctx"))
                print(f"{c} round {r} {o or 'default'}: SDPA {sdpa * 1e3:.2f} us, {fmt} {ours * 1e3:.2f} us, {sdpa / ours:.3f}x", flush=True)


if __name__ == "__main__":
    main()
