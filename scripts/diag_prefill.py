"""Sweep the prefill kernel's shape on the GPU against the staged path, one layer.

Usage (GPU machine, repo root): python3 scripts/diag_prefill.py [FORMAT] [CASES] [VARIANTS]
  FORMAT: a `bench` format name (int4, int8, int4+rot, int2, ...), /BLOCK for pages of BLOCK
          tokens (default 64), e.g. int4/256
  CASES: context:chunk pairs, e.g. 131072:16,131072:64 (default: the four below)
  VARIANTS: a JSON list of TUNE overrides, e.g. '[{}, {"prefill_rows": 64}]'
For each (context, chunk) case: the staged path (dense past + SDPA flash) and each kernel
variant (TUNE's prefill defaults plus overrides), attention only (the chunk appended once
beforehand), CUDA-event median of 5 after a compile call; each variant's output is checked
against the staged path's (relative to the output's size), and the tile, stages and local
memory (spilled registers) it took are printed. `longctx bench prefill` times the whole chunk
step (append, attend, seal) for the paths' defaults.
"""
import json
import sys

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, ".")
from longctx import SharedMemoryError  # noqa: E402
from longctx.bench import _config  # noqa: E402
from longctx.cache import PagedKVCache  # noqa: E402
from longctx.ops.paged_attention import prefill as PF  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402
from longctx.ops.paged_attention.prefill import paged_prefill_staged, paged_prefill_triton  # noqa: E402

Hq, H, D = 32, 8, 128
CASES = [(32768, 512), (131072, 512), (131072, 2048), (131072, 16384)]
VARIANTS = [{}, {"prefill_rows": 64}, {"prefill_rows": 64, "prefill_warps": 4}, {"prefill_stages": 3}, {"prefill_k16": 3, "prefill_v16": True}]


def ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[reps // 2]


def main(fmt="int4", cases=None, variants=None):
    fmt, _, block = fmt.partition("/")
    block = int(block or 64)
    default = dict(K.TUNE)
    took = {}
    fit = PF._prefill_fit

    def spy(grid, args, consts, block_size, st):  # the tile, stages and local memory each launch takes
        consts = fit(grid, args, consts, block_size, st)
        took.update(tile=consts["TP"] or block, stages=consts["num_stages"], spills=PF._compiled(grid, args, consts, 1 << 30)[1])
        return consts

    PF._prefill_fit = spy
    cases = [tuple(map(int, c.split(":"))) for c in cases.split(",")] if cases else CASES
    variants = json.loads(variants) if variants else VARIANTS
    for T, C in cases:
        g = torch.Generator(device="cuda").manual_seed(T)
        k = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(1, Hq, C, D, device="cuda", dtype=torch.bfloat16, generator=g)
        cache = PagedKVCache(_config(fmt, block), num_layers=1, num_kv_heads=H, head_dim=D)
        cache.append(0, k[:, :, : T - C], v[:, :, : T - C])
        cache.seal()
        cache.append(0, k[:, :, T - C :], v[:, :, T - C :])
        view = cache.view(0)
        ref = paged_prefill_staged(q, view, None)
        staged = ms(lambda q=q, view=view: paged_prefill_staged(q, view, None))
        print(f"== {fmt}, pages of {block}, context {T:,}, chunk {C:,}: staged {staged:.3f} ms", flush=True)
        for kw in variants:
            K.TUNE.clear()
            K.TUNE.update(default, **kw)
            try:
                out, _ = paged_prefill_triton(q, view, None, D**-0.5, return_lse=False)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                t = ms(lambda q=q, view=view: paged_prefill_triton(q, view, None, D**-0.5, return_lse=False))
                print(f"  kernel {kw or 'default'}: {t:.3f} ms, err {err:.1e}, tile {took['tile']}, {took['stages']} stages, {took['spills']} words of local memory", flush=True)
            except (OutOfResources, SharedMemoryError) as e:  # a variant over the shared memory or registers is reported, not fatal
                print(f"  kernel {kw}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        K.TUNE.clear()
        K.TUNE.update(default)
        cache.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
