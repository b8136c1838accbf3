"""Sealing rotated blocks in one launch against rotating them in torch first (GPU machine).

Usage (repo root): python3 scripts/diag_seal_rot.py [FORMAT ...]   (default: int4+rot int2)

For N blocks of the Llama-3-8B shape (8 KV heads, 64 tokens, head_dim 128, bf16): a decode
step's seal (N = 1), a batch's (N = 8) and a 16k-token prefill chunk's (N = 256), each sealed
into a pool at slots. "one launch" is `quantize_blocks_into` as the cache calls it (the kernel
rotates, `quant.rotate_to_seal`); "torch first" is the path it replaced: `quant.rotate` of K
and V (a cast, an fp32 matmul and a cast back, each), then the unrotated kernel. Per case: the
GPU time (CUDA events, median of 7 runs of 20 calls), the memory allocated beyond the inputs
and the pool while sealing (`max_memory_allocated`), and the share of codes both paths store
alike (they round the rotation differently).
"""

import dataclasses
import statistics
import sys

import torch

sys.path.insert(0, ".")
from longctx.bench import _config  # noqa: E402
from longctx.cache import PagedKVCache  # noqa: E402
from longctx.ops.pages import Pages  # noqa: E402
from longctx.ops.quantize_blocks import quantize_blocks_into  # noqa: E402
from longctx.quant import BlockFormat, rotate  # noqa: E402

H, P, D = 8, 64, 128


def pool(fmt: BlockFormat, n: int) -> Pages:
    pages = Pages(fmt)
    for name, shape, dt in PagedKVCache._pool_fields(fmt, n):
        setattr(pages, name, torch.zeros(shape, dtype=dt, device="cuda"))
    return pages


def seal_one_launch(pages, ids, k, v):
    quantize_blocks_into(pages, ids, k, v, backend="triton", checked=True)


def seal_torch_first(pages, ids, k, v):
    plain = Pages(dataclasses.replace(pages.fmt, rotate=False), **pages.tensors())
    quantize_blocks_into(plain, ids, rotate(k).contiguous(), rotate(v).contiguous(), backend="triton", checked=True)


def main(names):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{'format':<10} {'blocks':>6} {'one launch us':>14} {'torch first us':>15} {'extra MiB: one / torch':>23} {'same codes':>11}")
    for name in names:
        cfg = _config(name, P).resolve(1, D)
        if not cfg.rotate:
            raise SystemExit(f"{name}: not a rotated format")
        fmt = BlockFormat(*cfg.layer_bits(0), P, cfg.group_size, D, H, torch.bfloat16, True)
        for n in (1, 8, 256):
            k = torch.randn(n, H, P, D, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(n, H, P, D, device=dev, dtype=torch.bfloat16, generator=g)
            ids = torch.arange(n, device=dev)
            got = {}
            for path, seal in (("one", seal_one_launch), ("torch", seal_torch_first)):
                pages = pool(fmt, n)
                seal(pages, ids, k, v)  # compiles
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                seal(pages, ids, k, v)
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                runs = []
                for _ in range(7):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(20):
                        seal(pages, ids, k, v)
                    e.record()
                    torch.cuda.synchronize()
                    runs.append(s.elapsed_time(e) * 1e3 / 20)
                got[path] = (statistics.median(runs), extra, pages.k_codes if fmt.k_bits != 16 else pages.v_codes)
            same = (got["one"][2] == got["torch"][2]).float().mean().item()
            print(f"{name:<10} {n:>6} {got['one'][0]:>14.1f} {got['torch'][0]:>15.1f} {got['one'][1]:>10.1f} / {got['torch'][1]:<10.1f} {same:>11.5f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["int4+rot", "int2"])
