"""Do beams that share their prompt's blocks pay for reading them once a row? One layer's decode
attention (bench decode's Llama-3-8B shape, int4) at CONTEXT tokens, timed as `bench decode
--graph` times it: one row; four rows repeated from it (`select_rows`, as graph_decoding
repeats a prompt for its beams: the same block ids, so the GPU's L2 may serve the three later
reads); the same four rows through the shared blocks' launch (`_decode_shared`: a group's
rows read them once), the default where they reach TUNE["shared_from"] tokens; four rows with
blocks of their own.

Usage (GPU machine, repo root): python3 scripts/diag_shared_rows.py [CONTEXT ...]
"""
import os
import sys

import torch

sys.path.insert(0, ".")
from longctx.bench import _config, _time_graph  # noqa: E402
from longctx.cache import PagedKVCache  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402


def filled(rows: int, context: int, g: torch.Generator) -> PagedKVCache:
    cache = PagedKVCache(_config("int4", 64), num_layers=1, num_kv_heads=8, head_dim=128)
    for t0 in range(0, context, 16384):
        n = min(16384, context - t0)
        kv = [torch.randn(rows, 8, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
        cache.append(0, *kv)
        cache.seal()
    kv = [torch.randn(rows, 8, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    cache.append(0, *kv)  # (the step's own token, in the tail)
    return cache


# the shared blocks' launch as TUNE has it, then other (shared_rows, shared_warps): SHARED="8:1 16:2"
VARIANTS = [(K.TUNE["shared_rows"], K.TUNE["shared_warps"])] + [tuple(int(x) for x in v.split(":")) for v in os.environ.get("SHARED", "").split()]


def main(contexts):
    g = torch.Generator(device="cuda").manual_seed(0)
    q4 = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    for context in contexts:
        times = {}
        one = filled(1, context, g)
        times["1 row"] = _time_graph(lambda _: one.attend(0, q4[:1], return_lse=False), 4, 20)
        one.select_rows([0, 0, 0, 0])
        assert one.tables.rows[0] == one.tables.rows[3]
        saved = K.TUNE["shared_from"]
        K.TUNE["shared_from"] = 0
        times["4 rows sharing their blocks, whole rows"] = _time_graph(lambda _: one.attend(0, q4, return_lse=False), 4, 20)
        whole = one.attend(0, q4)
        K.TUNE["shared_from"] = 1
        for rows, warps in VARIANTS:  # (TUNE's shared_rows, shared_warps)
            saved_v = K.TUNE["shared_rows"], K.TUNE["shared_warps"]
            K.TUNE["shared_rows"], K.TUNE["shared_warps"] = rows, warps
            name = f"shared launch ({rows} queries, {warps} warps)"
            times[name] = _time_graph(lambda _: one.attend(0, q4, return_lse=False), 4, 20)
            shared = one.attend(0, q4)
            print(f"  {name}: {K.LAST['shared']} (R, blocks, splits of each launch), {K.LAST['shared_kernel'].n_regs} registers, "
                  f"{K.LAST['shared_kernel'].n_spills} spills; max |out - whole rows'| {(shared[0] - whole[0]).abs().max().item():.2e}, "
                  f"lse {(shared[1] - whole[1]).abs().max().item():.2e}", flush=True)
            K.TUNE["shared_rows"], K.TUNE["shared_warps"] = saved_v
        K.TUNE["shared_from"] = saved
        del one
        own = filled(4, context, g)
        assert len({row[-1] for row in own.tables.rows}) == 4
        times["4 rows of their own"] = _time_graph(lambda _: own.attend(0, q4, return_lse=False), 4, 20)
        del own
        torch.cuda.empty_cache()
        print(f"{context} tokens: " + "; ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [131072, 262144])
