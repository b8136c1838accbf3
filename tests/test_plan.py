"""`longctx plan`: KV bytes equal the cache's own accounting; a case computed by hand."""

import pytest

from longctx import KVConfig
from longctx.config import kv_preset
from longctx.cache import PagedKVCache
from longctx.plan import (
    RUNTIME_OVERHEAD,
    UnknownNameError,
    activation_bytes,
    catalog_gpus,
    catalog_models,
    gpu_memory,
    kv_bytes,
    model_shape,
    parse_size_gib,
    plan,
    weight_bytes,
)
from longctx.testing import random_kv

SMOL = model_shape("smollm2-135m")


@pytest.mark.parametrize("kw", [dict(bits=16), dict(bits=8), dict(bits=4), dict(bits=4, k_bits=8), dict(bits=2, rotate=True),
                                dict(bits=4, layers_16bit=(0, 29)), dict(bits=4, sink_blocks=0), dict(bits=4, block_size=16)],
                         ids=lambda kw: KVConfig(**kw).describe() + ("-l16" if "layers_16bit" in kw else "") + ("-nosink" if "sink_blocks" in kw else "")
                         + (f"-p{kw['block_size']}" if "block_size" in kw else ""))
@pytest.mark.parametrize("tokens, rows", [(1, 1), (64, 1), (65, 2), (300, 1)])
def test_kv_bytes_equal_memory_report(kw, tokens, rows):
    cfg = KVConfig(**kw, dtype="bfloat16")
    cache = PagedKVCache(cfg, num_layers=SMOL.layers, num_kv_heads=SMOL.kv_heads, head_dim=SMOL.head_dim)
    k, v = random_kv(rows, SMOL.kv_heads, tokens, SMOL.head_dim, seed=tokens)
    for layer in range(SMOL.layers):
        cache.append(layer, k, v)
    rep = cache.memory_report()
    assert rep.tokens == tokens and rep.rows == rows
    assert kv_bytes(SMOL, cfg, tokens, rows) == rep.total_bytes
    assert kv_bytes(SMOL, cfg, tokens, rows) / (tokens * rows) == rep.bytes_per_token


def test_a_plan_computed_by_hand():
    # SmolLM2-135M, bf16 weights, a bf16 KV cache, a 4 GiB budget, 2048-token chunks:
    params = 30 * (576 * (9 * 64 + 2 * 3 * 64) + 9 * 64 * 576 + 3 * 576 * 1536 + 2 * 576) + 576 + 49152 * 576  # tied
    assert params == SMOL.param_count() == 134_515_008
    weights = 2 * params
    for_kv = 4 * 2**30 - weights - RUNTIME_OVERHEAD - int(0.05 * 4 * 2**30)
    kv_per_token = 30 * 2 * 3 * 64 * 2  # layers * (K, V) * kv heads * head_dim * bf16
    staging_per_token = 2 * 3 * 64 * 2  # one layer's dense past while a chunk prefills
    chunk = 2048 * 576 * 2 * 4 + 2048 * (9 + 6) * 64 * 2 + 2048 * 1536 * 2 * 3 + 49152 * 4 * 2
    expected = (for_kv - chunk) // (kv_per_token + staging_per_token)
    assert (kv_per_token, expected) == (23040, 124_884)
    p = plan(SMOL, "test", 4.0, weights_bits=16, kv_bits=(16,), prefill_chunk=2048)
    assert p.budget.weights == weights and p.budget.for_kv == for_kv
    assert p.rows[0].max_tokens == expected and p.rows[0].kv_bytes_per_token == kv_per_token
    assert not p.rows[0].fits_model_limit or expected >= 8192


def test_fewer_bits_fit_more_and_bigger_budgets_fit_more():
    shape = model_shape("llama-3.1-8b")
    p = plan(shape, "rtx-4090", 24, weights_bits=4)
    tokens = [r.max_tokens for r in p.rows]
    assert [r.format for r in p.rows] == ["bf16", "int8", "int4", "int2+rot"]
    assert tokens == sorted(tokens) and tokens[0] > 0
    # bf16 K/V of Llama-3.1-8B: 128 KiB per token; int4 at 64-token pages well under a third
    assert p.rows[0].kv_bytes_per_token == 131072 and p.rows[2].kv_bytes_per_token < 0.3 * 131072
    assert plan(shape, "a100-80gb", 79, weights_bits=4, kv_bits=(4,)).rows[0].max_tokens > tokens[2]
    assert plan(shape, "rtx-4090", 24, weights_bits=16, kv_bits=(4,)).rows[0].max_tokens < tokens[2]
    assert plan(shape, "rtx-4090", 24, weights_bits=4, kv_bits=(4,), batch=2).rows[0].max_tokens < tokens[2]
    off = plan(shape, "rtx-4090", 24, weights_bits=4, kv_bits=(4,), host_gib=32).rows[0]
    assert off.max_tokens_offload > off.max_tokens


def test_host_tier_plan_fits_both_budgets_and_differs_by_format():
    """With a host tier: the GPU holds weights, reserves, a chunk's activations and tails, sinks
    and a tail block, two staging slices and the device pool; host memory holds host_blocks blocks;
    the tokens are the two pools' blocks a row. Each format's figure is its own (fewer bytes a
    token, more tokens), and the step is the host bytes over the link."""
    from longctx.plan import _sealed_block_bytes, activation_bytes, kv_bytes, offload_step_ms, pcie_gbps

    shape = model_shape("llama-3.1-8b")
    p = plan(shape, "rtx-4060-ti-16gb", 16, weights_bits=4, host_gib=64)
    assert p.pcie_gbps == pcie_gbps("rtx-4060-ti-16gb") == 12.5  # PCIe 4.0 x8
    tokens = [r.max_tokens_offload for r in p.rows]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    for r in p.rows:
        cfg = kv_preset(r.format)  # (plan's rows are the named formats)
        per_block = _sealed_block_bytes(shape, cfg.resolve(shape.layers, shape.head_dim), 2)
        assert r.host_bytes == r.host_blocks * per_block <= 64 * 2**30 < (r.host_blocks + 1) * per_block
        tails = 6 * 2048 * 32 * 8 * 128  # (a chunk in every layer's tail, and its finiteness check)
        gpu = kv_bytes(shape, cfg, 127, 1) + activation_bytes(shape, 2048, 0) + tails + r.staging_bytes + r.offload_max_blocks * per_block
        assert gpu <= p.budget.for_kv < gpu + per_block
        assert r.max_tokens_offload == (1 + r.offload_max_blocks + r.host_blocks) * 64 + 63
        assert r.offload_step_ms == pytest.approx(r.host_bytes / 12.5e9 * 1e3)
        # the step at a given context: the host tier full at the longest, empty while the GPU holds all
        assert offload_step_ms(shape, cfg, r.max_tokens_offload, r.offload_max_blocks, 12.5) == pytest.approx(r.offload_step_ms)
        assert offload_step_ms(shape, cfg, (1 + r.offload_max_blocks) * 64, r.offload_max_blocks, 12.5) == 0
    with pytest.raises(ValueError, match="GB/s > 0"):
        plan(shape, "rtx-4090", 24, host_gib=8, pcie=0)


def test_nothing_fits_when_weights_do_not():
    p = plan(model_shape("qwen2.5-14b"), "rtx-3060-8gb", 8, weights_bits=16, kv_bits=(4,))
    assert p.budget.for_kv < 0 and p.rows[0].max_tokens == 0


def test_weights_by_bits():
    shape = model_shape("llama-3.1-8b")
    assert weight_bytes(shape, 16) == 2 * shape.param_count()
    assert 0.25 < weight_bytes(shape, 4) / weight_bytes(shape, 16) < 0.4  # embeddings stay 16-bit
    assert 0.5 < weight_bytes(shape, 8) / weight_bytes(shape, 16) < 0.6
    with pytest.raises(ValueError, match="16, 8 or 4"):
        weight_bytes(shape, 3)


def test_catalog_is_big_enough_and_consistent():
    models, gpus = catalog_models(), catalog_gpus()
    assert len(models) >= 12 and len(gpus) >= 15
    for name in models:
        s = model_shape(name)
        assert s.heads % s.kv_heads == 0 and s.param_count() > 0
    assert {"consumer", "datacenter"} == {g["kind"] for g in gpus.values()}
    # published sizes: Llama-3.1-8B 8.03B, Mistral-7B-v0.3 7.25B, Qwen2.5-7B 7.62B parameters
    assert round(model_shape("llama-3.1-8b").param_count() / 1e9, 2) == 8.03
    assert round(model_shape("mistral-7b").param_count() / 1e9, 2) == 7.25
    assert round(model_shape("qwen2.5-7b").param_count() / 1e9, 2) == 7.62


def test_unknown_names_suggest_close_matches(tmp_path):
    with pytest.raises(UnknownNameError, match="did you mean llama-3.1-8b"):
        model_shape("lama-3.1-8b")
    with pytest.raises(UnknownNameError, match="did you mean rtx-4090"):
        gpu_memory("rtx-4009", None)
    with pytest.raises(Exception, match="no model directory"):
        model_shape(str(tmp_path / "missing"))


def test_local_dir_with_config_json(tmp_path):
    import json

    cfg = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = model_shape(str(tmp_path))
    assert s.param_count() == SMOL.param_count() and s.head_dim == 64 and s.max_context == 8192


def test_sizes_and_activations():
    # GiB and MiB are powers of two; GB and MB powers of ten (a "24GB" budget is 22.35 GiB)
    assert parse_size_gib("22.5GiB") == 22.5 and parse_size_gib("512MiB") == 0.5 and parse_size_gib("24") == 24
    assert parse_size_gib("24GB") == 24e9 / 2**30 and parse_size_gib("512MB") == 512e6 / 2**30
    with pytest.raises(ValueError, match="bad memory size"):
        parse_size_gib("lots")
    a, b = activation_bytes(SMOL, 2048, 10_000), activation_bytes(SMOL, 2048, 20_000)
    assert b - a == 10_000 * 2 * 3 * 64 * 2  # the staged past grows with the context



def test_planned_max_blocks_hold_the_planned_tokens():
    p = plan(SMOL, "small", 1.1, kv_bits=(4,), block_size=64)
    row = p.rows[0]
    assert 500 < row.max_tokens < 5000  # a budget of ~48 MiB for KV and activations
    cfg = KVConfig(bits=4, block_size=64, max_blocks=row.max_blocks, dtype="bfloat16")
    cache = PagedKVCache(cfg, num_layers=SMOL.layers, num_kv_heads=SMOL.kv_heads, head_dim=SMOL.head_dim)
    k, v = random_kv(1, SMOL.kv_heads, row.max_tokens, SMOL.head_dim)
    for layer in range(SMOL.layers):
        cache.append(layer, k, v)
    rep = cache.memory_report()  # seals every full block: exactly max_blocks quantized pages
    assert rep.blocks["quantized"] == row.max_blocks == cache.block_alloc.num_used()
    assert cache.pages[0].k_codes.shape[0] == row.max_blocks


def test_a_format_the_model_cannot_use_is_reported_not_fatal():
    p = plan(model_shape("phi-3-mini-128k"), "rtx-4090", 24)  # head_dim 96: no Hadamard rotation
    rows = {r.format: r for r in p.rows}
    assert "power-of-two head_dim" in rows["int2+rot"].unavailable and rows["int2+rot"].max_tokens == 0
    assert rows["int4"].max_tokens > rows["int8"].max_tokens > rows["bf16"].max_tokens > 0


@pytest.mark.parametrize("model, weights_bits", [("llama-3.1-8b", 4), ("smollm2-135m", 16), ("qwen2.5-7b", 8)])
def test_a_split_over_one_card_is_the_one_card_plan(model, weights_bits):
    """split_layers' per-card arithmetic, on one card, gives plan's longest context exactly."""
    from longctx.config import bits_format
    from longctx.plan import split_layers

    shape = model_shape(model)
    for bits, fmt in ((16, bits_format(16)), (4, bits_format(4)), (2, bits_format(2)), (4, KVConfig(bits=4, layers_16bit=(0, 1)))):
        one = plan(shape, "test", 24.0, weights_bits=weights_bits, kv_bits=(bits,)).rows[0].max_tokens
        if fmt.layers_16bit:
            one = plan_with(shape, fmt, weights_bits)
        assert split_layers(shape, fmt, [24 * 2**30], weights_bits=weights_bits) == (one, [shape.layers]), (model, fmt.describe())


def plan_with(shape, cfg, weights_bits):
    """plan's one-card search for a config of no named format: weights, overhead and reserve, then
    KV and activations within the rest."""
    from longctx.plan import FRAGMENTATION, _largest

    total = 24 * 2**30
    for_kv = total - weight_bytes(shape, weights_bits) - RUNTIME_OVERHEAD - int(FRAGMENTATION * total)
    return _largest(lambda t: kv_bytes(shape, cfg, t) + activation_bytes(shape, min(2048, max(t, 1)), t) <= for_kv)


def test_two_cards_split_by_layers_and_hold_each_card_to_its_budget():
    from longctx.config import bits_format
    from longctx.plan import FRAGMENTATION, card_peaks, split_layers

    shape = model_shape("llama-3.1-8b")
    one, two = (plan(shape, "rtx-3090", 24.0, weights_bits=4, kv_bits=(4, 16), gpus=g) for g in (1, 2))
    for a, b in zip(one.rows, two.rows):
        assert a.layers_per_gpu == [] and sum(b.layers_per_gpu) == 32 and len(b.gpu_peak_bytes) == 2
        assert b.max_tokens > 2 * a.max_tokens  # (each card holds half the layers' KV, and one end of the weights)
        room = 24 * 2**30 - RUNTIME_OVERHEAD - int(FRAGMENTATION * 24 * 2**30)
        assert all(peak <= room for peak in b.gpu_peak_bytes) and max(b.gpu_peak_bytes) > 0.99 * room
    cfg = bits_format(4)
    best = two.rows[0].max_tokens
    assert split_layers(shape, cfg, [24 * 2**30] * 2, weights_bits=4, tokens=best + 64) == (0, [])  # the longest: a block more does not fit
    assert card_peaks(shape, cfg, two.rows[0].layers_per_gpu, best, 4) == two.rows[0].gpu_peak_bytes
    # an uneven pair: the smaller card takes fewer layers
    tokens, counts = split_layers(shape, cfg, [24 * 2**30, 12 * 2**30], weights_bits=4)
    assert counts[0] > counts[1] and sum(counts) == 32 and one.rows[0].max_tokens < tokens < best
    with pytest.raises(ValueError, match="has 30 decoder layers, and a card takes whole layers"):
        plan(SMOL, "test", 4.0, gpus=31)
    with_host = plan(shape, "rtx-3090", 24.0, weights_bits=4, kv_bits=(4,), gpus=2, host_gib=64)
    assert with_host.rows[0].max_tokens_offload > 3 * best and with_host.rows[0].offload_max_blocks > 0
