"""Where a decode step's appending and sealing time goes (GPU machine): `bench seal`'s setup,
then per kind of step (attend alone, append + attend without a seal, append + attend with a
seal) the time per step, and a torch.profiler table of 2 * block_size steps by host time.

Usage (GPU machine, repo root): python3 scripts/diag_seal.py [int4 int8 ...]
"""

import sys
import time

import torch

sys.path.insert(0, ".")
from longctx.bench import _setup  # noqa: E402
from longctx.cache import PagedKVCache  # noqa: E402


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return us


def main(formats):
    from longctx.cache import _index

    dev = torch.device("cuda")
    print("host us per call: _index(3 ints) %.1f, torch.tensor(3 ints, device=cuda) %.1f, _index(2048 ints) %.1f"
          % (host_us(lambda: _index([1, 2, 3], dev)), host_us(lambda: torch.tensor([1, 2, 3], device=dev)),
             host_us(lambda: _index(list(range(2048)), dev))))
    cfgs, Hq, H, D = _setup("seal", formats, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, cfg in cfgs.items():
        cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=H, head_dim=D)
        for _ in range(8):
            n = 16384
            cache.append(0, torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g),
                         torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g))
            cache.seal()
        q = torch.randn(1, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(1024, 2, 1, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        i = 0

        def steps(n, append=True, attend=True):
            nonlocal i
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                if append:
                    cache.append(0, new[i % 1024, 0], new[i % 1024, 1])
                    i += 1
                if attend:
                    cache.attend(0, q, return_lse=False)
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / n, (time.perf_counter() - t0) * 1e3 / n

        steps(128)  # warm-up, compiles
        print(f"== {name}: tail {cache.tail_len[0]}, blocks {cache.num_blocks}")
        print("attend alone      ms/step (events, host wall): %.4f %.4f" % steps(64, append=False))
        while cache.tail_len[0] != 1:
            steps(1)
        print("append + attend, no seal:                      %.4f %.4f" % steps(62))
        print("append + attend, the seal step:                %.4f %.4f" % steps(1))
        print("append alone x64 (one seal among them):        %.4f %.4f" % steps(64, attend=False))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            steps(128)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        cache.reset()
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["int4", "int8"])
