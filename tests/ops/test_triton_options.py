"""Every Triton launch passes `TRITON_OPTIONS` (floating-point contraction asked for by name:
Triton 3.9 warns when a launch leaves it unset, and says 3.10 turns it off by default)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from longctx import KVConfig, PagedKVCache  # noqa: E402
from longctx.ops.backend import TRITON_OPTIONS  # noqa: E402
from longctx.ops.gather_dequant import gather_dequant  # noqa: E402
from longctx.ops.gather_dequant import triton as G  # noqa: E402
from longctx.ops.paged_attention import prefill as PF  # noqa: E402
from longctx.ops.paged_attention import merge as M  # noqa: E402
from longctx.ops.paged_attention import triton as K  # noqa: E402
from longctx.ops.paged_attention import tuning as T  # noqa: E402
from longctx.ops.quantize_blocks import triton as Q  # noqa: E402
from longctx.testing import random_kv  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Spy:
    """A kernel whose launches (kernel[grid](...) and warmup) record their keywords."""

    def __init__(self, kernel, name: str, seen: list):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.append((self.name, kw))
            return launch(*args, **kw)

        return run

    def warmup(self, *args, **kw):
        self.seen.append((self.name + ".warmup", kw))
        return self.kernel.warmup(*args, **kw)

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


def test_every_triton_launch_asks_for_fp_fusion(monkeypatch):
    assert TRITON_OPTIONS == {"enable_fp_fusion": True}
    seen = []
    for module, name in [(K, "decode_kernel"), (M, "merge_kernel"), (T, "_tiny_probe_kernel"), (PF, "_prefill_kernel"),
                         (PF, "merge_kernel"), (G, "_gather_kernel"), (Q, "_quantize_kernel")]:
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), ".".join(module.__name__.split(".")[-2:] + [name]), seen))
    T._TINY_OK.clear()  # the probe runs again (the side loop asks for it)
    monkeypatch.setitem(T.TUNE, "merge", "launch")  # the merge launch ("auto" merges in the kernel outside CUDA graphs)
    cfg = KVConfig(bits=4, block_size=16, backend="triton")
    # the appends and the seal quantize 12 blocks of 16, on the device (the triton backend runs on
    # CPU tensors only under the interpreter)
    k, v = random_kv(1, 2, 200, 64, seed=3)
    cache = PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=64)
    for t0, t1 in [(0, 37), (37, 192), (192, 200)]:
        cache.append(0, k[:, :, t0:t1].to(DEVICE), v[:, :, t0:t1].to(DEVICE))
    cache.seal()
    view = cache.view(0)
    q = torch.randn(1, 4, 1, 64).to(DEVICE)
    K.paged_decode_triton(q, view, None, 0.125, splits=3)  # the decode kernel, then the merge launch (and the probe)
    PF.paged_prefill_triton(torch.randn(1, 4, 8, 64).to(DEVICE), view, None, 0.125, splits=2)  # prefill, then its merge
    gather_dequant(view, backend="triton")
    rot = PagedKVCache(KVConfig(bits=4, rotate=True, block_size=16, backend="triton"), num_layers=1, num_kv_heads=2, head_dim=64)
    rot.append(0, k.to(DEVICE), v.to(DEVICE))
    K.paged_decode_triton(q, rot.view(0), None, 0.125)  # rotated pages: each program rotates its queries and its share back
    names = {n for n, _ in seen}
    assert {"paged_attention.triton.decode_kernel", "paged_attention.merge.merge_kernel", "paged_attention.prefill._prefill_kernel",
            "paged_attention.prefill.merge_kernel", "gather_dequant.triton._gather_kernel", "quantize_blocks.triton._quantize_kernel",
            "paged_attention.tuning._tiny_probe_kernel"} <= names, names
    bad = [(n, {k: kw.get(k) for k in TRITON_OPTIONS}) for n, kw in seen if any(kw.get(k) != v for k, v in TRITON_OPTIONS.items())]
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_kernel_compiles_with_fp_fusion_whatever_triton_defaults_to():
    """With TRITON_DEFAULT_FP_FUSION=0 (the default Triton 3.10 announces), the compiled decode
    kernel still has FP contraction on. In a fresh process: a kernel compiled earlier in this
    one (same keywords) would come from the in-memory cache whatever the default."""
    code = """
import torch
from longctx import KVConfig
from longctx.bench import synthetic_view
from longctx.ops.paged_attention import paged_attention
from longctx.ops.paged_attention import triton as K
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
view = synthetic_view(1, 8192, 8, 128, KVConfig(bits=4, block_size=64), "cuda")
paged_attention(q, view, backend="triton")
print(K.compiled_kernel(K.decode_plans(q, view)[-1], q, view).metadata.enable_fp_fusion)
"""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="0", PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), root])))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "True", p.stdout
