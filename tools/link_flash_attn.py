"""Finish a flash-attn pack (tools/pack_flash_attn.sh) on the GPU machine: compile its Python
binding (flash_api.cpp) against this machine's torch and Python, link it with the packed
sm_90 kernels, and check the result against SDPA, so that `import flash_attn` works with
DIR/python on sys.path.

    python3 tools/link_flash_attn.py DIR     # DIR: the pack unpacked (flash-attn-VERSION-sm90)

Exits non-zero, saying why, when the pack's kernels were built against another torch (their
Flash_fwd_params layout and c10 calls must match the binding's), or when the linked module's
paged decode disagrees with SDPA.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # longctx, from this checkout


def main(pack: str) -> None:
    import torch
    from torch.utils.cpp_extension import load

    if not os.path.isfile(os.path.join(pack, "BUILD")):
        sys.exit(f"{pack} is not an unpacked flash-attn pack (it has no BUILD file): tools/pack_flash_attn.sh makes one")
    build = dict(line.split(" ", 1) for line in open(os.path.join(pack, "BUILD")).read().splitlines())
    if build["torch"] != torch.__version__:
        sys.exit(f"the pack's kernels were built against torch {build['torch']}, this machine has {torch.__version__}: "
                 f"pack again with TORCH_VERSION={torch.__version__.split('+')[0]}")
    src = os.path.join(pack, "csrc")
    t0 = time.time()
    module = load(name="flash_attn_2_cuda", sources=[os.path.join(src, "flash_attn", "flash_api.cpp")],
                  extra_include_paths=[os.path.join(src, "flash_attn"), os.path.join(src, "flash_attn", "src"), os.path.join(src, "cutlass", "include")],
                  extra_cflags=["-O3", "-std=c++17", *build["flags"].split()], extra_ldflags=sorted(glob.glob(os.path.join(pack, "*.o"))),
                  build_directory=_fresh(os.path.join(pack, "build")), with_cuda=True)
    shutil.copy(module.__file__, os.path.join(pack, "python"))
    print(f"flash-attn {build['flash-attn']}: binding compiled and linked in {time.time() - t0:.0f} s ({module.__file__})")
    sys.path.insert(0, os.path.join(pack, "python"))
    check("cuda")


def check(device: str) -> None:
    """flash_attn_with_kvcache over shuffled bf16 pages of 256 tokens (`bench decode`'s peer's
    pages) against SDPA over the same keys and values in order (Llama-3-8B's heads, 1,000
    tokens, batch 2)."""
    import torch

    import flash_attn
    from flash_attn import flash_attn_with_kvcache

    from longctx.bench import flash_attn_pages

    B, Hq, H, D, T = 2, 32, 8, 128, 1000
    k, v, table = flash_attn_pages(B, T, H, D, device, seed=0)
    q = torch.randn(B, 1, Hq, D, device=device, dtype=torch.bfloat16, generator=torch.Generator(device=device).manual_seed(1))
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.full((B,), T, dtype=torch.int32, device=device), block_table=table)
    kd, vd = (x[table.long()].reshape(B, -1, H, D)[:, :T].transpose(1, 2).float() for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), kd, vd, enable_gqa=True).transpose(1, 2)
    err = (out.float() - ref).abs().max().item()
    print(f"flash-attn {flash_attn.__version__} ({flash_attn.__file__}): paged decode vs SDPA fp32, max |error| {err:.2e}")
    if not err < 2e-2:
        sys.exit("the linked flash-attn disagrees with SDPA")


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
