"""The fastest plain read of a decode step's bytes on this GPU: the ceiling any decode kernel
over those bytes has, against SDPA dense bf16 in the same process.

For each case (context, batch; Llama-3-8B shape: 8 KV heads, head_dim 128) and format (int4
unless --formats names others) it reads, as one contiguous stream with no arithmetic but an XOR,
as many bytes as the bench's view of the format holds for one step (codes and scales), and as
many as SDPA's dense bf16 K and V. The stream kernel
is swept over tile size, warps, pipeline stages and program count, and the fastest setting
is timed again, twice, the lower time kept (the bench's rows keep their median). Then the
bench's own rows for the same case (`bench_decode(..., graph=True)`: SDPA dense bf16 and the
format's call), so that every ratio comes from one process:

  ceiling  = SDPA / fastest read of the format's bytes   (a kernel beats it only by reading
             its bytes faster than every setting swept here)
  bytes    = fastest read of bf16's bytes / fastest read of the format's bytes
  call     = SDPA / the format's call                     (the bench's ratio)
  of read  = fastest read of the format's bytes / the format's call

Times are CUDA-graph replays over copies far beyond L2 (the bench's `time_graph`, `copies_for`).
Also a read followed by a one-program second launch in the same graph: what a second kernel
(the split merge) costs a call even when it does no work.

Usage (GPU machine, repo root): python3 tools/read_floor.py [--cases 128k:1,512k:1,32k:8] [--formats int4,int2+rot] [--quick]
CPU check of the kernel under the interpreter: TRITON_INTERPRET=1 python3 tools/read_floor.py --check
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _stream(X, OUT, n_words, tiles_per, BLOCK: tl.constexpr, NS: tl.constexpr):
    """Program p XORs tiles [p * tiles_per, (p + 1) * tiles_per) of BLOCK int32 words of X
    (masked at n_words) and stores the result at OUT[p]."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * tiles_per * BLOCK
    acc = tl.zeros((BLOCK,), tl.int32)
    for t in tl.range(0, tiles_per, num_stages=NS):
        offs = lo + t * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(X + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    tl.store(OUT + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _touch(OUT):
    """The one-program second launch: one store."""
    tl.store(OUT, 1)


def stream(x: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int, stages: int) -> None:
    n = x.numel()
    tiles = triton.cdiv(n, block)
    programs = min(programs, tiles)
    _stream[(programs,)](x, out, n, triton.cdiv(tiles, programs), BLOCK=block, NS=stages, num_warps=warps)


def check() -> None:
    """The kernel's XOR against NumPy's, on odd sizes (the mask) and several program counts."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    for n, programs, block in [(1, 1, 64), (1000, 3, 64), (4096, 4, 128), (12345, 7, 256)]:
        x = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
        out = torch.zeros(programs, dtype=torch.int32)
        stream(x, out, programs, block, 1, 2)
        got = int(np.bitwise_xor.reduce(out.numpy()))
        want = int(np.bitwise_xor.reduce(x.numpy()))
        assert got == want, (n, programs, block, got, want)
    print("stream kernel: XOR matches NumPy's at 4 sizes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="128k:1,512k:1,32k:8")
    ap.add_argument("--formats", default="int4", help="the bench's named formats, at its block size (64)")
    ap.add_argument("--quick", action="store_true", help="a smaller sweep")
    ap.add_argument("--check", action="store_true", help="check the kernel (CPU interpreter) and stop")
    a = ap.parse_args()
    if a.check:
        check()
        return
    from longctx.bench.common import copies_for, bench_setup, time_graph
    from longctx.bench.decode import dense_bytes_of, pages_bytes, bench_decode, decode_cases
    from longctx.cli.bench import parse_cases

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), "SMs", sms, "torch", torch.__version__, "triton", triton.__version__)
    formats = tuple(f.strip() for f in a.formats.split(","))
    cfgs, _, H, D = bench_setup("decode", formats, 64)  # the bench's formats and shape
    blocks = (1024, 4096) if a.quick else (512, 1024, 2048, 4096)
    warps = (4, 8) if a.quick else (4, 8, 16)
    stages = (2, 3) if a.quick else (2, 3, 4)
    grids = (4, 8) if a.quick else (1, 2, 4, 8, 16)
    out = torch.zeros(sms * 16, dtype=torch.int32, device=dev)
    done: dict[int, tuple[float, str]] = {}

    def fastest(nbytes: int) -> tuple[float, str]:
        """(fastest stream ms, the stream's setting) for nbytes."""
        if nbytes in done:
            return done[nbytes]
        words = math.ceil(nbytes / 4)
        L = copies_for(words * 4)
        xs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=dev) for _ in range(L)]
        best = (float("inf"), (0, 0, 0, 0))
        for blk, w, ns, gm in itertools.product(blocks, warps, stages, grids):
            if blk // (32 * w) < 4:
                continue  # fewer than 4 words a thread: no 16-byte loads
            ms = time_graph(lambda i: stream(xs[i], out, gm * sms, blk, w, ns), L, 5)
            best = min(best, (ms, (blk, w, ns, gm * sms)))
        blk, w, ns, gm = best[1]
        how = f"tile {blk} words, {w} warps, {ns} stages, {gm} programs"
        ms = min(time_graph(lambda i: stream(xs[i], out, gm, blk, w, ns), L, 20) for _ in range(2))
        two = min(time_graph(lambda i: (stream(xs[i], out, gm, blk, w, ns), _touch[(1,)](out)), L, 20) for _ in range(2))
        del xs
        torch.cuda.empty_cache()
        done[nbytes] = (ms, how + f"; with a second launch {two * 1e3:.2f} us")
        return done[nbytes]

    lines = []
    for T, B in decode_cases(cases=parse_cases(a.cases)):
        bf_bytes = dense_bytes_of(B, T, H, D)
        rb, howb = fastest(bf_bytes)
        rows = bench_decode(cases=[(T, B)], formats=formats, graph=True)
        sdpa = next(r.ms for r in rows if r.name == "SDPA dense bf16")
        lines.append(f"{T // 1024}k, batch {B}: bf16 bytes {bf_bytes / 1e6:.1f} MB read in {rb * 1e3:.2f} us ({bf_bytes / rb / 1e9:.2f} TB/s) "
                     f"[{howb}]; SDPA {sdpa * 1e3:.2f} us ({bf_bytes / sdpa / 1e9:.2f} TB/s)")
        for name in formats:
            nbytes, _ = pages_bytes(B, T, H, D, cfgs[name])
            read, how = fastest(nbytes)
            call = next(row.ms for row in rows if row.name == f"longctx {name}")
            lines.append(
                f"    {name}: bytes {nbytes / 1e6:.1f} MB read in {read * 1e3:.2f} us ({nbytes / read / 1e9:.2f} TB/s) [{how}]; call {call * 1e3:.2f} us\n"
                f"    {name}: ceiling SDPA/read {sdpa / read:.2f}x; bytes read(bf16)/read {rb / read:.2f}x; "
                f"SDPA/call {sdpa / call:.2f}x; the call at {read / call:.0%} of the read's speed")
        print("\n".join(lines[-1 - len(formats):]), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
