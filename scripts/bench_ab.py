"""The bench's own number (`bench_decode(..., graph=True)`: a whole call, CUDA-graph replays,
ratio to SDPA dense bf16 in the same process) for TUNE's defaults and for override sets, in
alternating rounds: an A/B of what the acceptance targets measure, where scripts/diag_parts.py
times the kernels alone.

Usage (GPU machine, repo root):
  python3 scripts/bench_ab.py --ab "pdl=True" [--cases int4:131072:1 ...] [--rounds 2] [--block-size 128]
  python3 scripts/bench_ab.py --ab "scales=float16"   # the views' scales and zeros in fp16 (the dense data stays bf16)
"""
import argparse
import contextlib
import sys

import torch

sys.path.insert(0, ".")
import longctx.bench.decode as LB  # (bench_decode's module: its synthetic_view is the one to stand in for)
from longctx.bench import bench_decode
from scripts.diag_parts import overrides, tuned


@contextlib.contextmanager
def scales_as(dtype):
    """The bench's synthetic views with their scales and zero points in `dtype` (None: as built)."""
    build = LB.synthetic_view

    def view(*args, **kw):
        v = build(*args, **kw)
        for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
            t = getattr(v.pages, name, None)
            if t is not None:
                setattr(v.pages, name, t.to(dtype))
        return v

    if dtype is not None:
        LB.synthetic_view = view
    try:
        yield
    finally:
        LB.synthetic_view = build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["int4:131072:1", "int4:524288:1", "int4:32768:8", "int8:131072:1"])
    ap.add_argument("--ab", nargs="*", default=[], help='override sets "KEY=VALUE,KEY=VALUE"')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64, help="tokens a page")
    a = ap.parse_args()
    sets = [({}, None)]  # TUNE's defaults, then each set of --ab; "scales=DTYPE" is the views' choice, not TUNE's
    for item in a.ab:
        parts = item.split(",")
        scales = [x.split("=", 1)[1] for x in parts if x.startswith("scales=")]
        if scales and not isinstance(getattr(torch, scales[-1], None), torch.dtype):
            raise SystemExit(f"scales={scales[-1]!r} is not a torch dtype (e.g. float16)")
        sets.append((overrides([x for x in parts if not x.startswith("scales=")]), scales[-1] if scales else None))
    for c in a.cases:
        fmt, T, B = c.split(":")
        for r in range(a.rounds):
            for o, scales in sets:
                with tuned(o), scales_as(getattr(torch, scales) if scales else None):
                    rows = bench_decode([int(T)], [int(B)], formats=(fmt,), graph=True, block_size=a.block_size)
                sdpa = next(x.ms for x in rows if x.name == "SDPA dense bf16")
                ours = next(x.ms for x in rows if x.name.startswith("longctx"))
                name = " ".join([str(o)] * bool(o) + [f"scales {scales}"] * bool(scales)) or "default"
                print(f"{c} round {r} {name}: SDPA {sdpa * 1e3:.2f} us, {fmt} {ours * 1e3:.2f} us, {sdpa / ours:.3f}x", flush=True)


if __name__ == "__main__":
    main()
