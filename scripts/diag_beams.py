"""Where beam search through graph_decoding parts from generate()'s own, step by step.

Usage (repo root): python3 scripts/diag_beams.py [--prompts 2] [--beams 4] [--length 300]
    [--tokens 40] [--seed 6] [--pads 5,0] [--device cuda] [--bits 4] [--backend triton] [--graphs-only]

A tiny random Llama (3 layers, 8 query heads, 2 KV heads, head_dim 64, fp32), pages of 16
tokens (--bits, default 4). The baseline is generate()'s own beam search with the reference
backend (dequantize, then SDPA). Then, with --backend (default triton; the interpreter on a CPU:
set TRITON_INTERPRET=1): generate()'s own beam search twice (each beam's copy of the prompt
prefilled apart, so rows share no blocks: whole rows), graph_decoding with eager steps
(--graphs-only skips them) and, on CUDA, with CUDA graphs, each with the shared launch off
(TUNE["shared_from"] 0) and on (16: one block). For each run: the largest logit difference to the
baseline, the first step whose beam choice (sequences or beam indices) differs, and each step's
largest difference up to that point and just after; for a step far above the rest, each row's
difference and the baseline row nearest each row (two running beams in swapped slots show as a
swap there). A wrong read shows as a difference well above rounding at a step whose earlier
choices were all equal; a near tie as rounding-sized differences until the choices part.
"""

import argparse

import torch
import transformers

from longctx import KVConfig, LongCtxCache, graph_decoding
from longctx.integrations.transformers import cache_kwargs
from longctx.ops.paged_attention import triton as K
from longctx.testing import tiny_llama

BITS, BACKEND = 4, "triton"


def run(model, ids, mask, beams, tokens, custom, shared_from, **extra):
    K.TUNE["shared_from"] = shared_from
    calls = []
    real = K._decode_shared
    K._decode_shared = lambda *a, **k: (calls.append(a[4]), real(*a, **k))[1]
    try:
        cache = LongCtxCache(model, KVConfig(bits=BITS, block_size=16, backend=BACKEND))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=beams, max_new_tokens=tokens, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True, custom_generate=custom,
                                 **extra, **cache_kwargs(model, cache))
        cache.detach()
    finally:
        K._decode_shared = real
    return out, calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--pads", default="5,0")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager steps' runs")
    a = ap.parse_args()
    global BITS, BACKEND
    BITS, BACKEND = a.bits, a.backend
    dev = a.device
    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to(dev, torch.float32)
    ids = torch.randint(3, 128, (a.prompts, a.length), generator=torch.Generator().manual_seed(a.seed)).to(dev)
    pads = [int(p) for p in a.pads.split(",")][: a.prompts]
    pads += [0] * (a.prompts - len(pads))
    mask = (torch.arange(a.length)[None, :] >= torch.tensor(pads)[:, None]).long().to(dev)
    saved = K.TUNE["shared_from"]
    chosen, BACKEND = BACKEND, "reference"
    ref, _ = run(model, ids, mask, a.beams, a.tokens, None, 0)
    BACKEND = chosen
    R = torch.stack(ref.logits)
    print(f"{a.prompts} prompts x {a.beams} beams, {a.length} tokens (pads {pads}), {a.tokens} new, seed {a.seed}, {dev}, "
          f"transformers {transformers.__version__}, bits {BITS}; baseline: generate()'s own beam search, backend reference; "
          f"|logits| up to {R.abs().max().item():.3g}")
    cases = [(f"generate()'s own, backend {BACKEND}", None, 0, {}), (f"generate()'s own, backend {BACKEND}, again", None, 0, {})]
    if not a.graphs_only:
        cases += [("graph_decoding, eager steps", graph_decoding, f, dict(graphs=False)) for f in (0, 16)]
    if dev == "cuda":
        cases += [("graph_decoding, CUDA graphs", graph_decoding, f, dict(graphs=True)) for f in (0, 16)]
    for name, custom, shared_from, extra in cases:
        out, calls = run(model, ids, mask, a.beams, a.tokens, custom, shared_from, **extra)
        L = torch.stack(out.logits)
        n = min(len(L), len(R))
        step = (L[:n] - R[:n]).abs().flatten(1).max(1).values
        seq_eq = [torch.equal(out.sequences[:, : a.length + i + 1], ref.sequences[:, : a.length + i + 1]) for i in range(n)]
        bi_eq = [torch.equal(out.beam_indices[:, : i + 1], ref.beam_indices[:, : i + 1]) for i in range(n)]
        part = next((i for i in range(n) if not (seq_eq[i] and bi_eq[i])), None)
        print(f"\n{name}, shared_from {shared_from}: {len(calls)} shared calls (R {sorted(set(calls))}); "
              f"steps {len(L)} vs {len(R)}; largest |diff| {step.max().item():.3g}; choices first part at step {part}")
        upto = n if part is None else min(n, part + 3)
        print("  step: |diff| " + " ".join(f"{i}:{step[i].item():.2g}" for i in range(upto)))
        spike = int(step.argmax())
        if step[spike] > 100 * step.median():  # a step far above the rest: its rows
            rows = (L[spike] - R[spike]).abs().max(-1).values
            near = [int((R[spike] - L[spike][r]).abs().max(-1).values.argmin()) for r in range(len(rows))]
            print(f"  step {spike}: each row's |diff| {[f'{x:.2g}' for x in rows.tolist()]}; the baseline row nearest each of ours {near}")
        if part is not None and part < n:
            # the two runs' log-probabilities where the choices parted: how close the candidates were
            top_ref = torch.log_softmax(R[part].float(), -1).topk(3, -1)
            top_out = torch.log_softmax(L[part].float(), -1).topk(3, -1)
            print(f"  at step {part}: baseline top-3 log-probs rows 0..3 {top_ref.values[:4].tolist()}")
            print(f"                 ours     top-3 log-probs rows 0..3 {top_out.values[:4].tolist()}")
    K.TUNE["shared_from"] = saved


if __name__ == "__main__":
    main()
