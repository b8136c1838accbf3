"""A cache whose layers live on several devices (a model split by accelerate's device_map).

On the CPU two placements are told apart by their index: layers on cpu:0 and cpu:1 form two
segments, with tails, sinks, table copies and host-tier staging of their own, though their
memory is the same. Every result must equal the one-device cache's, bit for bit.
"""

import pytest
import torch

from longctx import KVConfig
from longctx.cache import PagedKVCache
from longctx.testing import random_kv, tiny_llama

L, H, D = 4, 2, 64
SPLIT = ["cpu:0", "cpu:0", "cpu:1", "cpu:1"]


def pair(cfg):
    return PagedKVCache(cfg, L, H, D), PagedKVCache(cfg, L, H, D, devices=SPLIT)


def step(caches, k, v):
    for cache in caches:
        for layer in range(L):
            cache.append(layer, k * (1 + layer), v - layer)


def assert_same(one, two, q, start=None):
    assert one.tables.rows == two.tables.rows and one.tail_len == two.tail_len
    for layer in range(L):
        o1, l1 = one.attend(layer, q, start)
        o2, l2 = two.attend(layer, q, start)
        assert torch.equal(o1, o2) and torch.equal(l1, l2), layer
        for a, b in zip(one.dense(layer), two.dense(layer)):
            assert torch.equal(a, b), layer


@pytest.mark.parametrize("cfg", [KVConfig(bits=4, block_size=16), KVConfig(bits=2, rotate=True, block_size=64, k_span=16, sink_blocks=2),
                                 KVConfig(bits=4, block_size=16, max_blocks=24, host_blocks=200, stage_blocks=4)],
                         ids=["int4", "int2+rot", "host-tier"])
def test_a_split_cache_equals_one_device_through_steps_beams_and_crops(cfg):
    one, two = pair(cfg)
    k, v = random_kv(1, H, 700, D, seed=3)
    k3, v3 = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)  # three beams of one prompt
    step((one, two), k3[:, :, :150].contiguous(), v3[:, :, :150].contiguous())
    t = 150
    for n, order in ((1, [0, 0, 1]), (37, None), (1, [2, 1, 1]), (80, None), (1, [1, 0, 2]), (200, None)):
        kk, vv = random_kv(3, H, n, D, seed=t)
        step((one, two), kk, vv)
        t += n
        if order is not None:
            for c in (one, two):
                c.reorder(torch.tensor(order))
        assert_same(one, two, random_kv(3, 8, 1, D, seed=t)[0])
    assert len(two.segments) == 2 and two.devices == [torch.device("cpu", 0), torch.device("cpu", 1)]
    assert [list(s.layers) for s in two.segments] == [[0, 1], [2, 3]] and two.seals == one.seals
    if cfg.host_blocks:
        assert two.tables.host_columns > 0 and two.tables.host_columns == one.tables.host_columns
    for c in (one, two):
        c.fork(1)
        c.free(0)
        c.crop(t - 45)
    assert_same(one, two, random_kv(3, 8, 1, D, seed=1)[0], start=torch.tensor([0, 17, 40], dtype=torch.int32))


def test_each_device_keeps_its_own_tails_sinks_and_table():
    cfg = KVConfig(bits=4, block_size=16, sink_blocks=1)
    _, two = pair(cfg)
    k, v = random_kv(2, H, 70, D)
    step((two,), k, v)
    step((two,), k[:, :, :1], v[:, :, :1])
    first, second = two.segments
    assert first.tail_k.shape[0] == 2 and second.tail_k.shape[0] == 2 and first.tail_k is not second.tail_k
    for layer in range(L):
        seg, i = two.segment(layer)
        view = two.view(layer)
        assert view.tail_k.data_ptr() == seg.tail_k[i].data_ptr() and view.sink_k.data_ptr() == seg.sink_k[i].data_ptr()
        assert view.block_table is two.block_table(seg.device) and two.layer_device(layer) == seg.device
    a, b = two.block_table(torch.device("cpu", 0)), two.block_table(torch.device("cpu", 1))
    assert a is not b and torch.equal(a, b)
    report = two.memory_report()
    assert list(report.bytes_by_device) == ["cpu:0", "cpu:1"] and sum(report.bytes_by_device.values()) == report.bytes_by_tier["device"]
    assert report.bytes_by_device["cpu:0"] == report.bytes_by_device["cpu:1"] and report.device == "cpu:0, cpu:1"
    assert "cpu:0" in str(report) and "cpu:1" in str(report)


def test_keys_on_another_device_than_their_layer_are_refused_and_change_nothing():
    _, two = pair(KVConfig(bits=4, block_size=16))
    k, v = random_kv(1, H, 20, D)
    step((two,), k, v)
    with pytest.raises(ValueError, match="layer 2's keys are on meta, but its pages live on cpu:1"):
        two.append(2, k.to("meta"), v.to("meta"))
    assert two.tail_len == [20] * L
    with pytest.raises(ValueError, match="one device a layer, 4, got 3"):
        PagedKVCache(KVConfig(), L, H, D, devices=SPLIT[:3])
    with pytest.raises(RuntimeError, match="live on cpu:0, cpu:1; a recorded step runs on one device"):
        two.graph_table()


def _hooked(model, devices):
    """`model` with accelerate's hooks placing decoder layer i's execution on devices[i], as
    dispatch_model does for a device_map over several GPUs."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    for layer, device in zip(model.model.layers, devices):
        add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device(device), io_same_device=False))
    return model


def test_a_model_split_by_accelerate_hooks_generates_as_on_one_device(tmp_path):
    """LongCtxCache reads each layer's execution device from accelerate's hooks: greedy and
    beam search over the split cache give the one-device tokens, and a saved cache loads
    back into a split one."""
    from longctx.integrations.transformers import LongCtxCache, cache_kwargs, layer_devices

    cfg = KVConfig(bits=4, block_size=16)
    plain, split = tiny_llama(layers=L, vocab=96, seed=4), _hooked(tiny_llama(layers=L, vocab=96, seed=4), SPLIT)
    assert layer_devices(plain) == [torch.device("cpu")] * L
    assert layer_devices(split) == [torch.device(d) for d in SPLIT]
    ids = torch.randint(1, 96, (2, 90), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (plain, split):
        runs = []
        for beams in (1, 3):
            cache = LongCtxCache(model, cfg)
            with torch.no_grad():
                runs.append(model.generate(input_ids=ids, do_sample=False, num_beams=beams, max_new_tokens=24, pad_token_id=0,
                                           **cache_kwargs(model, cache)))
            cache.detach()
        outs.append(runs)
        if model is split:
            assert len(cache.paged.segments) == 2 and cache.paged.seals > 0
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    cache = LongCtxCache(split, cfg)
    with torch.no_grad():
        split(input_ids=ids, **cache_kwargs(split, cache))
    cache.save(tmp_path / "split.kvc", ids)
    cache.detach()
    for model in (plain, split):
        loaded, saved = LongCtxCache.load(model, tmp_path / "split.kvc")
        assert torch.equal(saved, ids) and len(loaded.paged.segments) == (2 if model is split else 1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, -1:] + 1, **cache_kwargs(model, loaded)).logits
        loaded.detach()
        if model is plain:
            want = logits
    assert torch.equal(logits, want)


def test_split_device_map_places_every_weight_once():
    """The device_map that `load_model(device_map="auto")` hands accelerate: the layers in
    order by card, the embeddings first, the head last (or first when tied), every parameter
    under exactly one key."""
    from longctx.models import split_device_map

    for tied, counts in ((False, [3, 1]), (True, [2, 2]), (False, [1, 1, 2])):
        model = tiny_llama(layers=L, tie_word_embeddings=tied)
        dm = split_device_map(model, counts)
        assert [dm[f"model.layers.{i}"] for i in range(L)] == [d for d, n in enumerate(counts) for _ in range(n)]
        assert dm["model.embed_tokens"] == 0 and dm["model.norm"] == len(counts) - 1 and dm["model.rotary_emb"] == 0
        assert dm["lm_head"] == (0 if tied else len(counts) - 1)
        for name, _ in model.named_parameters():
            assert sum(name == key or name.startswith(key + ".") for key in dm) == 1, name
    with pytest.raises(ValueError, match="no list of 5 decoder layers"):
        split_device_map(tiny_llama(layers=L), [3, 2])


@pytest.mark.parametrize("args, message", [
    (["--device-map", "everywhere"], "--device-map must be auto, balanced, balanced_low_0 or sequential, got 'everywhere'"),
    (["--device-map", "auto", "--device", "cpu"], "--device-map auto places the model on the GPUs itself; drop --device cpu"),
])
def test_chat_device_map_errors_are_one_line(args, message):
    from typer.testing import CliRunner

    from longctx.cli import app

    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["chat", *args, "--prompt", "hi"])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_device_map_without_a_gpu_is_refused_before_loading():
    from longctx.models import load_model

    with pytest.raises(ValueError, match="splits a model over CUDA GPUs; none is visible here"):
        load_model(device_map="auto")


@pytest.mark.gpu
def test_layers_on_the_gpu_and_the_cpu_give_the_one_device_logits():
    """Two real devices on a one-GPU machine: layers 0-1 on cuda:0, 2-3 on the CPU (accelerate's
    hooks move the hidden states), the head back on cuda:0. Each layer's pages, tails and sinks
    live on its device, the kernels run where the layer does, and the logits over a prefill and
    teacher-forced decode steps match the all-GPU model's; CUDA graphs are refused with the reason."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from longctx.graphs import GraphDecoder
    from longctx.integrations.transformers import LongCtxCache, cache_kwargs

    cfg = KVConfig(bits=4, block_size=16, backend="reference")
    whole = tiny_llama(layers=L, head_dim=64, vocab=96, seed=2).cuda()
    split = tiny_llama(layers=L, head_dim=64, vocab=96, seed=2).cuda()
    places = ["cuda:0", "cuda:0", "cpu", "cpu"]
    for layer, device in zip(split.model.layers, places):
        layer.to(device)
        add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device(device), io_same_device=False))
    add_hook_to_module(split.model.norm, AlignDevicesHook(execution_device=torch.device("cuda:0"), io_same_device=False))
    ids = torch.randint(1, 96, (2, 100), generator=torch.Generator().manual_seed(1)).cuda()
    logits = []
    for model in (whole, split):
        cache = LongCtxCache(model, cfg)
        out = []
        with torch.no_grad():
            out.append(model(input_ids=ids[:, :80], **cache_kwargs(model, cache)).logits)
            for t in range(80, 100):
                out.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(model, cache)).logits)
        logits.append(torch.cat(out, 1))
        if model is split:
            paged = cache.paged
            assert paged.devices == [torch.device("cuda", 0), torch.device("cpu")] and paged.seals > 0
            assert all(t.device.type == places[l][:4] for l in range(L) for t in paged.pages[l].tensors().values())
            assert "several devices" in GraphDecoder.unsupported(model, cache)
        cache.detach()
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)


def test_plan_gpus_prints_the_split_and_each_cards_peak():
    from typer.testing import CliRunner

    from longctx.cli import app
    from longctx.plan import model_shape, plan

    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, ["plan", "--gpu", "rtx-3090", "--gpus", "2", "--weights-bits", "4", "--kv-bits", "4"])
    want = plan(model_shape("llama-3.1-8b"), "rtx-3090", 24.0, weights_bits=4, kv_bits=(4,), gpus=2).rows[0]
    assert result.exit_code == 0, result.output
    assert "2 x rtx-3090 (24 GiB each)" in result.output and f"{want.max_tokens:,}" in result.output
    assert " / ".join(map(str, want.layers_per_gpu)) in result.output and "Budget of each card" in result.output
    bad = runner.invoke(app, ["plan", "--gpus", "0"])
    assert bad.exit_code == 2 and "--gpus must be 1 or more, got 0" in bad.output


def test_bench_plan_on_more_gpus_than_the_machine_has_is_refused_in_one_line():
    from typer.testing import CliRunner

    from longctx.cli import app

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["bench", "plan", "--gpus", str(have + 1), "--weights-bits", "4"])
    want = f"needs {have + 1} CUDA GPUs; this machine has {have}" if have else "bench plan needs a CUDA GPU; this machine has none"
    assert result.exit_code == 2 and want in result.output, result.output
