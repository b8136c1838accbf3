"""Decode from CUDA graphs (`longctx.graphs.GraphDecoder`) against eager steps on a model with
bitsandbytes 4-bit weights (the notebooks' 7B setup, smaller): whether its layers record, the
greedy tokens of both ways, and ms a token each.

A random Llama-shaped model is saved to a temporary folder and loaded back with
`BitsAndBytesConfig(load_in_4bit=True)` (NF4, bf16 compute), then for each way: a prompt
prefilled into a LongCtxCache int4, `--steps` greedy tokens (`longctx.generate.greedy`,
graphs=True strict, graphs=False).

Usage (GPU machine, bitsandbytes installed): python3 scripts/diag_graphs.py [--layers 4] [--context 8192] [--steps 256]
"""
import argparse
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
from longctx import KVConfig, LongCtxCache  # noqa: E402
from longctx.generate import greedy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=256)
    a = ap.parse_args()
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=32000, max_position_embeddings=a.context + a.steps + 16, rope_theta=500000.0)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = LlamaForCausalLM.from_pretrained(d, quantization_config=q, device_map="cuda", dtype=torch.bfloat16).eval()
    print("model:", a.layers, "layers, Llama-3-8B widths, NF4 weights:", type(model.model.layers[0].mlp.down_proj).__name__)
    ids = torch.randint(0, cfg.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    for graphs in (False, True):
        cache = LongCtxCache(model, KVConfig(bits=4))
        greedy(model, cache, ids[:, :600], max_new_tokens=4, chunk=512, graphs=graphs)  # (compiles, first records)
        cache.reset()
        torch.cuda.synchronize()
        new, stats = greedy(model, cache, ids, max_new_tokens=a.steps, chunk=2048, graphs=graphs)
        cache.detach()
        runs[graphs] = new
        print(f"graphs={graphs}: {stats.decode_s / stats.new_tokens * 1e3:.2f} ms/token over {stats.new_tokens} tokens, prefill {stats.prefill_s:.2f} s")
    same = (runs[False] == runs[True]).float().mean().item()
    first = next((i for i, (x, y) in enumerate(zip(runs[False].tolist(), runs[True].tolist())) if x != y), None)
    print(f"greedy tokens equal at {same:.3f} of steps; first difference at step {first}")
    print("eager", runs[False][:16].tolist())
    print("graph", runs[True][:16].tolist())


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t:.1f} s")
