"""The reference path on a CUDA device (skipped without one)."""

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
