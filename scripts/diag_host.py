"""Where a decode step's host time goes (GPU machine): per-call wall time of the triton
decode path at a short context (the GPU's share is ~20 us there), split by cProfile.

Usage (repo root): python3 scripts/diag_host.py
"""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.bench import synthetic_view  # noqa: E402
from longctx.ops.paged_attention import paged_attention  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    view = synthetic_view(1, 4096, 8, 128, KVConfig(bits=4), "cuda")
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    empty = torch.empty(1, device="cuda")
    print(f"torch.empty on cuda: {per_call_us(lambda: torch.empty(4, 8, device='cuda')):.1f} us")
    print(f"tensor add: {per_call_us(lambda: empty + 1):.1f} us")
    for splits in (None, 1):
        f = lambda: K.paged_decode_triton(q, view, None, 0.088, return_lse=False, splits=splits)  # noqa: E731
        print(f"paged_decode_triton splits={splits}: {per_call_us(f):.1f} us")
    f = lambda: paged_attention(q, view, backend="triton", return_lse=False)  # noqa: E731
    print(f"paged_attention(triton): {per_call_us(f):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        f()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
