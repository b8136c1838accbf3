"""model.generate() over a LongCtxCache: transformers' own loop against
`custom_generate=longctx.graph_decoding` (decode steps from CUDA graphs), on bench e2e's
random Llama-3-8B-shaped model (bf16 weights, int4 KV).

Usage (GPU machine, repo root): python3 scripts/diag_generate.py [CONTEXT] [NEW_TOKENS] [BATCH] [BEAMS] [--ours | --shared]
BATCH > 1: a left-padded batch, row i padded by i * CONTEXT // (2 * BATCH) tokens.
BEAMS > 1: beam search (generate's own prefills every beam's copy of the prompt, graph_decoding
one a prompt).
--ours: graph_decoding only, whole rows read (the old select keeps no shared blocks, so the
shared launch is off in both), with the block tables as they are and as they were before
reorders counted only the blocks rows do not share (each reorder took and dropped a reference
for every entry of the table, and dropped the device table, rebuilt from the host's lists).
--shared: graph_decoding only, with attention reading the prompt's blocks once for a group of
beams (the default, `_decode_shared`) and for every row (TUNE["shared_from"] = 0).
Each run is generate(max_new_tokens=1) (the prefill and one token) and then
generate(max_new_tokens=1 + NEW_TOKENS) on a fresh cache; decode ms/token is the difference
over NEW_TOKENS. Both greedy (or beams); the script prints whether their tokens agree.
"""
import contextlib
import sys
import time

import torch

sys.path.insert(0, ".")
from longctx import KVConfig, LongCtxCache, graph_decoding
from longctx.bench import llama3_8b_shaped
from longctx.integrations.transformers import cache_kwargs


def timed(model, ids, mask, new, custom, beams=1):
    cache = LongCtxCache(model, KVConfig(bits=4))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, custom_generate=custom, num_beams=beams,
                             prefill_chunk_size=4096, **cache_kwargs(model, cache))
    torch.cuda.synchronize()
    cache.detach()
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def whole_table_select(self, indices):
    """BlockTables.select before it counted only the blocks rows do not share."""
    indices = list(indices)
    new_rows = [list(self.rows[i]) for i in indices]
    for row in new_rows:
        for j, bid in enumerate(row):
            self.allocator_for(j).incref(bid)
    self._release(self.rows)
    self.rows = new_rows
    self._common = 0  # (a lower bound: push keeps it; nothing in the old code read it)
    self._run, self._run_common = len(new_rows), 0  # (no runs: the shared launch's, which came later, off)


@contextlib.contextmanager
def old_tables():
    from longctx.allocator import BlockTables
    from longctx.cache import PagedKVCache

    select, select_rows = BlockTables.select, PagedKVCache.select_rows

    def dropping(self, indices):  # (the device table was dropped, and rebuilt from the host's lists)
        select_rows(self, indices)
        self._table_tensor = None

    BlockTables.select, PagedKVCache.select_rows = whole_table_select, dropping
    try:
        yield
    finally:
        BlockTables.select, PagedKVCache.select_rows = select, select_rows


@contextlib.contextmanager
def whole_rows():
    from longctx.ops.paged_attention.triton import TUNE

    saved = TUNE["shared_from"]
    TUNE["shared_from"] = 0
    try:
        yield
    finally:
        TUNE["shared_from"] = saved


def main(context=4096, new=64, batch=1, beams=1, ours=False, shared=False):
    model = llama3_8b_shaped(32, context + new + 16)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).cuda()
    pads = torch.arange(batch) * (context // (2 * batch))
    mask = (torch.arange(context)[None, :] >= pads[:, None]).long().cuda()
    print(f"batch {batch}, padding {pads.tolist()}, beams {beams}")
    toks = {}
    runs = (("graph_decoding, tables before", graph_decoding, old_tables), ("graph_decoding", graph_decoding, whole_rows)) if ours else \
        (("graph_decoding, whole rows", graph_decoding, whole_rows), ("graph_decoding", graph_decoding, contextlib.nullcontext)) if shared else \
        (("generate's loop", None, contextlib.nullcontext), ("graph_decoding", graph_decoding, contextlib.nullcontext))
    for name, custom, tables in runs:
        with tables():
            timed(model, ids, mask, 3, custom, beams)  # warm-up: kernels compile, the first graph records
            one, _ = timed(model, ids, mask, 1, custom, beams)
            many, toks[name] = timed(model, ids, mask, 1 + new, custom, beams)
        print(f"{name}: prefill + 1 token {one:.2f} s; decode {(many - one) / new * 1e3:.1f} ms/step over {new} steps", flush=True)
    for r, (a, b) in enumerate(zip(*toks.values())):
        print(f"row {r}: tokens equal {sum(x == y for x, y in zip(a, b))}/{len(a)}; first part at {next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:] if not a.startswith("--")), ours="--ours" in sys.argv, shared="--shared" in sys.argv)
