"""Eager decode calls (no CUDA graph: the launcher's eager choices, such as the in-kernel
merge, apply), TUNE's defaults and override sets in turn, on the same views: each call's
mean time from the bench's own eager timer (`longctx.bench._time`), and the kernel's grid.

Usage (GPU machine, repo root):
  python3 scripts/diag_eager.py [FORMAT:CONTEXT:BATCH ...] --ab "KEY=VALUE,KEY=VALUE" [...] [--rounds N]
  e.g. python3 scripts/diag_eager.py int4:131072:1 int8:131072:1 --ab "merge_tree=0"
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from longctx.bench import _copies, _time, synthetic_view, view_bytes
from longctx.ops.paged_attention import paged_attention
from longctx.ops.paged_attention import triton as K
from scripts.diag_parts import ab_sets, config, tuned

Hq, H, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["int4:131072:1", "int4:524288:1", "int8:131072:1", "int4:4096:1"])
    ap.add_argument("--ab", nargs="*", default=[], help='override sets "KEY=VALUE,KEY=VALUE" run in turn with the defaults')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    sets = ab_sets(a.ab)
    for c in a.cases:
        fmt, T, B = c.split(":")
        T, B = int(T), int(B)
        cfg = config(fmt)
        one = synthetic_view(B, T, H, D, cfg, "cuda")
        L = _copies(view_bytes(one))
        views = [one] + [synthetic_view(B, T, H, D, cfg, "cuda", seed=i) for i in range(1, L)]
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        for r in range(a.rounds):
            for o in sets:
                with tuned(o):
                    ms = _time(lambda i: paged_attention(q, views[i], backend="triton", return_lse=False), L, a.reps)
                print(f"{fmt} {T} B{B} round {r} {o or 'default'}: {ms * 1e3:.2f} us a call; grid {K.LAST.get('grid')}, "
                      f"tree {K.LAST.get('tree')}", flush=True)
        del views, one
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
