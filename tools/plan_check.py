"""Check `longctx plan` against a measured peak on a GPU (issue 4's acceptance).

A random-initialized Llama-3-8B-shaped model (bf16 weights, or bitsandbytes NF4 like
`load_model(load_in_4bit=True)` with fp32 absmax per 64 weights), limited to a memory budget
with `torch.cuda.set_per_process_memory_fraction`; the context is what `plan` says fits in
int4 for that budget. It prefills that many random tokens in plan's chunk, decodes a few,
and compares `torch.cuda.max_memory_allocated()` with plan's weights + KV + activations
(the CUDA context and the reserve are not allocator memory). Prints one JSON line per case.

Usage on the GPU machine (bitsandbytes carried as a wheel, see /work/.library/device/README):
  python3 tools/plan_check.py --weights-bits 16 --budget-gib 24
  python3 tools/plan_check.py --weights-bits 4 --budget-gib 24
"""

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from longctx import KVConfig  # noqa: E402
from longctx.bench import llama3_8b_shaped  # noqa: E402
from longctx.generate import prefill  # noqa: E402
from longctx.integrations.transformers import LongCtxCache, cache_kwargs  # noqa: E402
from longctx.plan import activation_bytes, kv_bytes, model_shape, plan, weight_bytes  # noqa: E402


def to_nf4(model) -> None:
    """Replace every decoder Linear by bitsandbytes' Linear4bit (NF4, no double quantization),
    quantizing on the GPU; embeddings, norms and the LM head stay bf16."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4", device="cpu")
                    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=False, quant_type="nf4")
                    setattr(parent, name, q.to("cuda"))
                    del child
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-bits", type=int, default=16, choices=(16, 4))
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap the planned context (time)")
    a = ap.parse_args()
    shape = model_shape("llama-3.1-8b")
    p = plan(shape, "budget", a.budget_gib, weights_bits=a.weights_bits, kv_bits=(4,), prefill_chunk=a.chunk)
    row = p.rows[0]
    T = min(row.max_tokens, a.max_tokens or row.max_tokens)
    cfg = KVConfig(bits=4, max_blocks=row.max_blocks)
    model = llama3_8b_shaped(max_positions=T + a.decode + 16)
    if a.weights_bits == 4:
        to_nf4(model)
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib * 2**30 / total))
    weights_measured = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, shape.vocab, (1, T), generator=torch.Generator().manual_seed(0))
    cache = LongCtxCache(model, cfg)
    t0 = time.perf_counter()
    status = "fits"
    try:
        with torch.inference_mode():
            logits = prefill(model, cache, ids, chunk=a.chunk, all_logits=False)
            tok = logits.argmax(-1, keepdim=True)
            for _ in range(a.decode):
                out = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache))
                tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        status = f"OOM: {str(e).splitlines()[0]}"
    predicted = weight_bytes(shape, a.weights_bits) + kv_bytes(shape, cfg, T) + activation_bytes(shape, a.chunk, T)
    peak = torch.cuda.max_memory_allocated()
    print(json.dumps({
        "weights_bits": a.weights_bits, "budget_gib": a.budget_gib, "tokens": T, "planned_tokens": row.max_tokens,
        "status": status, "seconds": round(time.perf_counter() - t0, 1),
        "weights_predicted_gib": weight_bytes(shape, a.weights_bits) / 2**30, "weights_measured_gib": weights_measured / 2**30,
        "peak_allocated_gib": peak / 2**30, "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "predicted_gib": predicted / 2**30, "peak_over_predicted": peak / predicted,
        "kv_report_gib": cache.memory_report().total_bytes / 2**30 if status == "fits" else None,
    }), flush=True)


if __name__ == "__main__":
    main()
