"""LongCtxCache inside transformers, on tiny random Llama models (shapes and edge cases)."""

import warnings

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from longctx import KVConfig, LongCtxCache, UnsupportedModelError
from longctx.integrations.transformers import cache_kwargs, start_offsets
from longctx.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids, mask


def gen(model, cache, **kw):
    ids, mask = batch()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache), **kw)


def test_registered_in_both_interfaces():
    assert "longctx" in AttentionInterface._global_mapping
    assert "longctx" in AttentionMaskInterface._global_mapping


def test_attach_and_detach(model):
    model.set_attn_implementation("sdpa")
    cache = LongCtxCache(model, KVConfig(bits=16))
    assert model.config._attn_implementation == "longctx"
    cache.detach()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("block", [16, 64])
def test_bits16_greedy_equals_dynamic_cache_with_left_padding(model, block):
    model.set_attn_implementation("sdpa")
    ref = gen(model, DynamicCache(config=model.config), max_new_tokens=40)
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=block))
    out = gen(model, cache, max_new_tokens=40)
    cache.detach()
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1


def test_beams_bits16_equal_dynamic_cache(model):
    model.set_attn_implementation("sdpa")
    ref = gen(model, DynamicCache(config=model.config), max_new_tokens=20, num_beams=4, num_return_sequences=2)
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
    out = gen(model, cache, max_new_tokens=20, num_beams=4, num_return_sequences=2)
    cache.detach()
    assert torch.equal(out, ref)
    cache.paged.tables.check()


def test_other_attention_gets_dequantized_kv_and_one_warning(model):
    model.set_attn_implementation("sdpa")
    ref = gen(model, DynamicCache(config=model.config), max_new_tokens=20)
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=16), attach=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gen(model, cache, max_new_tokens=20)
    assert torch.equal(out, ref)
    assert sum("dequantizes the whole cache" in str(w.message) for w in caught) == 1


def test_longctx_attention_without_paged_cache_is_dense(model):
    """A model switched to "longctx" still works with DynamicCache and with no cache."""
    model.set_attn_implementation("sdpa")
    ref = gen(model, DynamicCache(config=model.config), max_new_tokens=15)
    ids, mask = batch()
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    model.set_attn_implementation("longctx")
    try:
        out = gen(model, DynamicCache(config=model.config), max_new_tokens=15)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, ref)
    valid = mask.bool()
    assert torch.allclose(logits[valid], ref_logits[valid], atol=1e-4)


def test_an_unmatched_hand_off_raises(model, monkeypatch):
    """The attention of a layer whose key is not the one LongCtxCache.update returned (a model
    that changes K between the cache and its attention) raises, where it would otherwise
    attend the new tokens alone and silently drop the cache; a hand-off left by a forward
    that stopped before its attention does not leak into the next forward's other layers."""
    from longctx.integrations import transformers as integration

    ids, mask = batch()
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :20], attention_mask=mask[:, :20], **cache_kwargs(model, cache))
        real = LongCtxCache.update

        def changed_key(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = real(self, key_states, value_states, layer_idx, *args, **kwargs)
            return k.clone(), v  # (what the layer's attention then receives)

        monkeypatch.setattr(LongCtxCache, "update", changed_key)
        with torch.no_grad(), pytest.raises(RuntimeError, match="another key than LongCtxCache.update returned"):
            model(input_ids=ids[:, 20:21], attention_mask=mask[:, :21], **cache_kwargs(model, cache))
        monkeypatch.setattr(LongCtxCache, "update", real)
        # a stale hand-off (layer 1's, its forward stopped) and a DynamicCache forward: layer 0 attends densely
        integration._pending.entry = (torch.zeros(1), cache.paged, 1)
        with torch.no_grad():
            out = model(input_ids=ids[:, :20], attention_mask=mask[:, :20], **cache_kwargs(model, DynamicCache(config=model.config))).logits
        assert torch.isfinite(out).all()
    finally:
        cache.detach()


def test_chunked_forward_matches_one_shot(model):
    """Feeding a prompt in chunks through model(...) with bits=16 gives the same logits."""
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
        parts = [model(input_ids=ids[:, c : c + 30], **cache_kwargs(model, cache), use_cache=True).logits for c in range(0, 100, 30)]
    cache.detach()
    assert torch.allclose(torch.cat(parts, 1), ref, atol=1e-4)


def test_crop_through_cache_api(model):
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
    ids = torch.randint(3, 128, (1, 50))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    cache.crop(-8)
    assert cache.get_seq_length() == 42
    cache.crop(20)
    assert cache.get_seq_length() == 20
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.detach()


def test_int4_generation_runs_and_reports(model):
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    out = gen(model, cache, max_new_tokens=30)
    cache.detach()
    report = cache.memory_report()
    assert report.tokens == out.shape[1] - 1 and report.rows == 2
    assert report.bytes_by_kind["codes"] > 0 and report.blocks["quantized"] > 0


def test_tails_return_to_a_block_after_a_long_generate_prompt(model):
    """generate() runs a prompt in one forward, which appends the whole prompt's K/V to the
    tails of every layer; once sealed, the tails hold (and reserve) less than a block again,
    instead of the prompt's bf16 copy beside its pages."""
    ids = torch.randint(3, 128, (1, 1500), generator=torch.Generator().manual_seed(1))
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, do_sample=False, max_new_tokens=3, pad_token_id=0, **cache_kwargs(model, cache))
    finally:
        cache.detach()
    paged = cache.paged
    seg, = paged.segments
    assert seg.tail_k.shape[3] <= 16 and seg.tail_v.shape[3] <= 16, tuple(seg.tail_k.shape)
    assert cache.memory_report().tokens == 1502
    # what the tails reserve: a block a layer and row, against the 1,500 prompt tokens they held
    tail_reserved = sum(t.numel() * t.element_size() for t in (seg.tail_k, seg.tail_v))
    assert tail_reserved == 2 * paged.num_layers * paged.num_kv_heads * 16 * paged.head_dim * seg.tail_k.element_size()


def test_start_offsets_left_padding_only():
    m = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert start_offsets(m, 4).tolist() == [2, 0]
    assert start_offsets(torch.tensor([[0, 0, 0, 0]]), 4).tolist() == [4]
    with pytest.raises(ValueError, match="left padding only"):
        start_offsets(torch.tensor([[1, 0, 1, 1]]), 4)
    with pytest.raises(ValueError, match="2D padding mask"):
        start_offsets(torch.ones(1, 1, 4, 4), 4)


FAMILIES = {  # tiny random models of each family, as transformers builds them
    "Qwen2": dict(),
    "Qwen3": dict(head_dim=64),
    "Gemma": dict(head_dim=64),  # its scaling: query_pre_attn_scalar
    "Granite": dict(attention_multiplier=0.3),  # a scaling that is not 1/sqrt(head_dim)
    "Phi3": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),  # head_dim 32: the reference path under auto
    "Olmo2": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "Cohere": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "Mistral": dict(sliding_window=None),
    "Qwen3Moe": dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_attention_families_generate_as_dynamic_cache(family):
    """Greedy generate() of a left-padded batch: bits 16 pages give DynamicCache's tokens exactly
    (each family's own scaling, norms and layouts reach our attention); int8 pages, fed the
    same tokens, give logits whose top token is DynamicCache's at every step, within 2 % of
    the logits' scale (int8 codes round within 1/510 of a channel's range; measured at most
    1.0 % on Phi-3, where int2 pages without a sink block are 1.4-100 % off)."""
    import transformers

    cfg = getattr(transformers, f"{family}Config")(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, **FAMILIES[family])
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    ids = torch.randint(3, 128, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():  # sharper attention than the random init's near-uniform one, so that a wrong scaling shows
        for layer in model.model.layers:
            attn = layer.self_attn
            (attn.q_proj if hasattr(attn, "q_proj") else attn.qkv_proj).weight.mul_(8.0)  # Phi-3 fuses q, k and v
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    cache = LongCtxCache(model, KVConfig(bits=16, block_size=16))
    out = model.generate(ids, **kw, **cache_kwargs(model, cache))
    cache.detach()
    assert torch.equal(out.sequences, ref.sequences)
    for ours, theirs in zip(out.logits, ref.logits):  # every step's logits (the prompt's: prefill; then decode over pages)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    forced = _teacher_forced(model, ids, mask, ref.sequences, KVConfig(bits=8, block_size=16))
    scale = max(step.abs().max().item() for step in ref.logits)
    for step, (ours, theirs) in enumerate(zip(forced, ref.logits)):
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), step
        assert (ours - theirs).abs().max().item() <= 0.02 * scale, step


def _teacher_forced(model, ids, mask, sequences, cfg):
    """Each step's last logits [B, V] of `sequences` (the prompt ids, left-padded by mask, then
    generated tokens) through a LongCtxCache of cfg: the prompt in one forward, then one token
    a forward over the pages, at generate()'s positions."""
    cache = LongCtxCache(model, cfg)
    P, out = ids.shape[1], []
    try:
        with torch.no_grad():
            out.append(model(input_ids=sequences[:, :P], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             **cache_kwargs(model, cache)).logits[:, -1])
            for t in range(P, sequences.shape[1] - 1):
                m = torch.cat([mask, torch.ones(mask.shape[0], t + 1 - P, dtype=mask.dtype)], 1)
                out.append(model(input_ids=sequences[:, t : t + 1], attention_mask=m, position_ids=(m.cumsum(-1) - 1)[:, -1:],
                                 **cache_kwargs(model, cache)).logits[:, -1])
    finally:
        cache.detach()
    return out


def test_sliding_window_model_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        LongCtxCache(MistralForCausalLM(cfg), KVConfig())


def test_hybrid_layer_types_are_refused():
    model = tiny_llama()
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(UnsupportedModelError, match="sliding_attention layers"):
        LongCtxCache(model, KVConfig())


def test_group_size_checked_against_model():
    with pytest.raises(ValueError, match="group_size=64.*head_dim=32"):
        LongCtxCache(tiny_llama(), KVConfig(group_size=64))


def test_flash_backend_beams_with_left_padding_equal_reference(monkeypatch):
    """The flash backend inside generate() (beam search, a left-padded row, int4 pages, prefill
    and decode): the same beams as the reference backend. flash-attn is stood in for by
    longctx.testing's model of its documented contract, and the backend let through on the
    CPU (it asks for CUDA and flash-attn)."""
    from longctx.ops.paged_attention import api, flash
    from longctx.testing import flash_kvcache_standin

    resolve = api.resolve_backend
    monkeypatch.setattr(api, "resolve_backend", lambda b, q, d=None, storage=False: "flash" if b == "flash" else resolve(b, q, d, storage))
    calls = []
    monkeypatch.setattr(flash, "_kvcache_fn", lambda: lambda *a, **kw: calls.append(kw) or flash_kvcache_standin(*a, **kw))
    model = tiny_llama().to(torch.float16)  # flash-attn takes fp16/bf16
    out = {}
    for backend in ("reference", "flash"):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16, backend=backend))
        out[backend] = gen(model, cache, max_new_tokens=20, num_beams=3)
        cache.detach()
    assert calls and any(c.get("block_table") is not None for c in calls)  # the sealed pages went through flash-attn's paged call
    assert torch.equal(out["flash"], out["reference"])


def test_graph_decoding_says_why_it_cannot_serve():
    """CUDA-graph decoding (`longctx.graphs`) where it cannot serve: graphs=True raises naming
    what is missing; the default takes eager steps, with the same tokens as graphs=False."""
    from longctx.generate import greedy
    from longctx.graphs import GraphDecoder, graph_decoder

    model = tiny_llama(layers=2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    assert "LongCtxCache" in GraphDecoder.unsupported(model, DynamicCache(config=model.config))
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    assert "CUDA device" in GraphDecoder.unsupported(model, cache)
    with pytest.raises(ValueError, match="graphs=True: CUDA-graph decoding needs the model on a CUDA device"):
        greedy(model, cache, ids, max_new_tokens=3, graphs=True)
    assert graph_decoder(model, cache, None) is None and graph_decoder(model, cache, False) is None
    cache.reset()
    auto, _ = greedy(model, cache, ids, max_new_tokens=20)
    cache.detach()
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    eager, _ = greedy(model, cache, ids, max_new_tokens=20, graphs=False)
    cache.detach()
    assert torch.equal(auto, eager)


def test_graph_decoder_falls_back_to_eager_steps_where_recording_fails(monkeypatch):
    """A step that cannot be recorded (here every recording raises): strict raises it; the
    default warns once and takes eager steps, with the eager path's tokens."""
    from longctx.generate import prefill
    from longctx.graphs import GraphDecoder

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphDecoder, "unsupported", staticmethod(lambda *a, **k: None))  # (no CUDA here)
    monkeypatch.setattr(GraphDecoder, "_record", broken)
    model = tiny_llama(layers=2)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    runs = []
    for strict in (True, False, None):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        with torch.inference_mode():
            logits = prefill(model, cache, ids)
            decoder = GraphDecoder(model, cache, strict=bool(strict)) if strict is not None else None
            toks = []
            for i in range(20):
                tok = torch.tensor([[int(logits[0].argmax())]])
                toks.append(int(tok))
                if decoder is None:
                    logits = model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
                elif strict:
                    with pytest.raises(RuntimeError, match="stream is capturing"):
                        decoder.step(tok)
                    break
                else:
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        logits = decoder.step(tok)
                    assert len(seen) == (1 if i == 0 else 0)
        cache.detach()
        runs.append(toks)
        if strict is False:
            fallback = decoder
    assert fallback.failed.startswith("RuntimeError") and fallback.recorded == fallback.replayed == 0
    assert runs[1] == runs[2] and len(runs[1]) == 20
