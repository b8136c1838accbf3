"""Triton vs reference backends inside a model (GPU): a random-initialized SmolLM2-shaped
Llama in bf16, a 700-token prompt prefilled in 256-token chunks, then decode steps; prints
how far each run's logits and cached keys are from the others'.

Usage (GPU machine, repo root): python3 scripts/diag_model.py
"""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.generate import prefill  # noqa: E402
from longctx.integrations.transformers import LongCtxCache, cache_kwargs  # noqa: E402

DEV = os.environ.get("DEV", "cuda")  # DEV=cpu BACKENDS=reference: a smoke run on the CPU
BACKENDS = os.environ.get("BACKENDS", "reference,triton").split(",")
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=9, num_key_value_heads=3,
                  vocab_size=4096, max_position_embeddings=4096)
model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32).eval()
ids = torch.randint(0, 4096, (1, 700), device=DEV)
runs = {}
for bits in (16, 4):
    for backend in BACKENDS:
        cache = LongCtxCache(model, KVConfig(bits=bits, backend=backend))
        logits = [prefill(model, cache, ids, chunk=256)]
        tok = logits[0].argmax(-1, keepdim=True)
        with torch.inference_mode():
            for _ in range(3):
                out = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].float()
                logits.append(out)
                tok = out.argmax(-1, keepdim=True)
            k0, v0 = cache.paged.dense(0)
            k5, v5 = cache.paged.dense(5)
        runs[(bits, backend)] = (logits, k0.float(), k5.float(), cache.paged.num_blocks, cache.paged.seals)
        cache.detach()
        print(bits, backend, "blocks", cache.paged.num_blocks, "seals", cache.paged.seals, flush=True)
names = list(runs)
for i, a in enumerate(names):
    for b in names[i + 1:]:
        la, lb = runs[a][0], runs[b][0]
        d = [f"{(x - y).abs().max().item():.3f}" for x, y in zip(la, lb)]
        print(f"{a} vs {b}: logits max|diff| per step {d}; layer0 K {(runs[a][1] - runs[b][1]).abs().max().item():.4f}, "
              f"layer5 K {(runs[a][2] - runs[b][2]).abs().max().item():.4f}", flush=True)
