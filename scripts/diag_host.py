"""Where a decode step's host time goes (GPU machine): per-call wall time of the triton
decode path at a short context (the GPU's share is ~20 us there), the decode launch alone
against the launcher's other work, then a cProfile. (scripts/diag_step.py: the same in a
whole model's step.)

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


def launch_parts(q, view):
    """The decode launch alone, replayed with the arguments the launcher passed last (eager:
    the in-kernel merge), against the launcher's other host work."""
    real = K._decode_kernel
    seen = {}

    class Recorder:  # records the launcher's grid and arguments, then launches as it would
        def __getitem__(self, grid):
            def go(*args, **kw):
                seen.update(grid=grid, args=args, kw=kw)
                return real[grid](*args, **kw)
            return go

        def __getattr__(self, name):
            return getattr(real, name)

    K._decode_kernel = Recorder()
    try:
        K.paged_decode_triton(q, view, None, 0.088, return_lse=False)
    finally:
        K._decode_kernel = real
    grid, args, kw = seen["grid"], seen["args"], seen["kw"]
    print(f"decode launch alone (grid {grid}, {len(args)} arguments, {len(kw)} keywords): "
          f"{per_call_us(lambda: real[grid](*args, **kw)):.1f} us")
    print(f"_setup as decode calls it (no constexprs): {per_call_us(lambda: K._setup(q[:, :, 0], view, None, 'x', consts=False)):.1f} us; "
          f"with them (a plan's build, prefill): {per_call_us(lambda: K._setup(q[:, :, 0], view, None, 'x')):.1f} us")
    print(f"four torch.empty on cuda: {per_call_us(lambda: [torch.empty(1, 32, 1, 128, device='cuda') for _ in range(4)]):.1f} us")
    print(f"hash(tuple(TUNE.items())): {per_call_us(lambda: hash(tuple(K.TUNE.items()))):.2f} us")
    print(f"torch.cuda.is_current_stream_capturing(): {per_call_us(torch.cuda.is_current_stream_capturing):.2f} us")


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
    launch_parts(q, view)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        f()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
