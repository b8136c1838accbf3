"""`longctx.graph_decoding` as generate()'s decoding method, on the CPU (eager steps: graphs
need CUDA; tests/test_cuda.py replays them): the same sequences, scores and cache as
generate()'s own loop over a LongCtxCache, and clear errors for what it does not do."""

import pytest
import torch
from transformers import DynamicCache

from longctx import KVConfig, LongCtxCache, graph_decoding
from longctx.integrations.transformers import cache_kwargs
from longctx.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, vocab=128)


def prompt(rows: int = 1, length: int = 40, pad: int = 0):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, :pad] = 0
    return ids, mask


def both(model, ids, mask, seed=None, kv=None, **kw):
    """(generate's own loop, graph_decoding), each over a fresh LongCtxCache, same arguments."""
    outs = []
    for custom in (None, graph_decoding):
        cache = LongCtxCache(model, KVConfig(**(kv or dict(bits=4, block_size=16))))
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, custom_generate=custom, **cache_kwargs(model, cache), **kw)
        outs.append((out, cache))
        cache.detach()
    return outs


@pytest.mark.parametrize("kv", [dict(bits=4, block_size=16), dict(bits=16, block_size=16), dict(bits=2, rotate=True, block_size=16)],
                         ids=["int4", "bits16", "int2+rot"])
def test_greedy_equals_generate(model, kv):
    ids, mask = prompt()
    (a, ca), (b, cb) = both(model, ids, mask, kv=kv, do_sample=False, max_new_tokens=30)
    assert b.shape == (1, 70) and torch.equal(a, b)
    assert ca.get_seq_length() == cb.get_seq_length() == 69  # the last token is not fed, as in generate


def test_sampling_equals_generate(model):
    ids, mask = prompt()
    (a, _), (b, _) = both(model, ids, mask, seed=3, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=25)
    assert torch.equal(a, b)
    (c, _), _ = both(model, ids, mask, seed=4, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=25)
    assert not torch.equal(a, c)  # (the seed matters: the comparison above compares draws)


def test_left_padded_batch_equals_generate(model):
    """Eager steps with the growing mask and each row's own positions: the same tokens and,
    step by step, the same logits (a position off by one moves them, if not the argmax)."""
    ids, mask = prompt(rows=2, pad=9)
    (a, _), (b, _) = both(model, ids, mask, do_sample=False, max_new_tokens=20, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)


def test_eos_and_pad_equal_generate(model):
    ids, mask = prompt(rows=2, pad=5)
    (free, _), _ = both(model, ids, mask, do_sample=False, max_new_tokens=12)
    eos = int(free[0, 40 + 3])  # row 0's fourth new token
    (a, _), (b, _) = both(model, ids, mask, do_sample=False, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(a, b)
    assert (b[0, 44:] == 0).all() or b.shape[1] == 44  # row 0 stopped at its EOS: pad after it


def test_scores_logits_and_cache_returned(model):
    ids, mask = prompt()
    (a, ca), (b, cb) = both(model, ids, mask, do_sample=False, max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                           output_logits=True, repetition_penalty=1.3)
    assert torch.equal(a.sequences, b.sequences)
    assert len(b.scores) == len(b.logits) == 8
    for x, y in zip(a.scores + a.logits, b.scores + b.logits, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert (getattr(b, "cache", None) or getattr(b, "past_key_values", None)) is cb


def test_on_token_gets_each_step_s_tokens(model):
    ids, mask = prompt(rows=2, pad=3)
    got = []
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0,
                             custom_generate=graph_decoding, on_token=got.append, **cache_kwargs(model, cache))
    cache.detach()
    assert len(got) == 6 and torch.equal(torch.stack(got, 1), out[:, 40:])


def test_a_cache_holding_the_prefix_feeds_the_rest(model):
    ids, mask = prompt()
    (a, _), _ = both(model, ids, mask, do_sample=False, max_new_tokens=10)
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    with torch.no_grad():
        model(input_ids=ids[:, :25], use_cache=True, **cache_kwargs(model, cache))
        b = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0, graphs=False,
                           custom_generate=graph_decoding, prefill_chunk_size=7, **cache_kwargs(model, cache))
        with pytest.raises(ValueError, match="nothing new to feed"):
            model.generate(input_ids=b[:, :40], do_sample=False, max_new_tokens=2, pad_token_id=0, custom_generate=graph_decoding,
                           **cache_kwargs(model, cache))
    cache.detach()
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw, match", [(dict(num_beams=2), "num_beams=2"), (dict(output_attentions=True, return_dict_in_generate=True), "attentions"),
                                       (dict(use_cache=False), "use_cache"), (dict(graphs=True), "graphs=True: .*CUDA")])
def test_what_it_does_not_do_raises(model, kw, match):
    ids, mask = prompt()  # (graphs=True: on the CPU, CUDA-graph decoding cannot serve)
    cache = LongCtxCache(model, KVConfig(bits=4))
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, custom_generate=graph_decoding,
                       **cache_kwargs(model, cache), **kw)
    cache.detach()


def test_graphs_true_raises_before_the_prefill(model):
    ids, mask = prompt(rows=2, pad=4)
    cache = LongCtxCache(model, KVConfig(bits=4))
    with torch.no_grad(), pytest.raises(ValueError, match="graphs=True: .*CUDA device"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, custom_generate=graph_decoding, graphs=True,
                       **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0  # nothing was prefilled
    cache.detach()


def replays_run_eagerly(monkeypatch):
    """GraphDecoder on the CPU: each "replay" runs the recorded step's forward again under
    `static_step`, with the decoder's device counters as they are, which is what a CUDA graph's
    replay does with the buffers it holds. What this leaves to the GPU tests is the capture."""
    from longctx.graphs import GraphDecoder

    def record(self):
        decoder = self

        class Replay:
            def replay(self):
                with decoder.paged.static_step(decoder.slot, decoder.length, decoder.start):
                    decoder._forward()

        self.graph = Replay()
        self.recorded += 1
        self._set_counters()

    monkeypatch.setattr(GraphDecoder, "unsupported", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(GraphDecoder, "_record", record)
    made = []
    init = GraphDecoder.__init__
    monkeypatch.setattr(GraphDecoder, "__init__", lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    return made


@pytest.mark.parametrize("kv, records", [(dict(bits=4, block_size=16, max_blocks=64), 1), (dict(bits=16, block_size=16, max_blocks=64), 1),
                                         (dict(bits=4, block_size=16), 3)], ids=["int4", "bits16", "int4-pools-grow"])
def test_left_padded_batch_steps_from_graphs(model, kv, records, monkeypatch):
    """A left-padded batch decodes through GraphDecoder (its replays run eagerly here): each
    row's padding goes to the kernel as its start, its positions skip the padding, and the
    logits are generate()'s eager loop's at every step, over two seals. One recording serves
    them (the seals write into the graph table), unless the pools grow (allocated as needed,
    not up to max_blocks): new pools are new addresses, so a new recording, at both seals
    here. A row's start or positions wrong by its padding moves its logits."""
    made = replays_run_eagerly(monkeypatch)
    ids, mask = prompt(rows=3, pad=9)
    mask[1, :4] = 0  # (three paddings: 0, 4, 9)
    (a, _), (b, cb) = both(model, ids, mask, kv=kv, do_sample=False, max_new_tokens=30, return_dict_in_generate=True, output_logits=True)
    (decoder,) = made
    assert decoder.start.tolist() == [0, 4, 9] and decoder.replayed == 29 and decoder.recorded == records
    assert cb.paged.num_blocks == 4 and cb.paged.seals > 0  # (two seals in the 29 steps: tails 8 -> 16, 16)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert cb.get_seq_length() == 69


def test_graph_decoder_checks_its_start(model, monkeypatch):
    from longctx.graphs import GraphDecoder
    from longctx.generate import prefill

    replays_run_eagerly(monkeypatch)
    ids, _ = prompt(rows=2)
    cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
    prefill(model, cache, ids)
    for bad in ([1], [0, 41], [-1, 0], [0.5, 0], [True, False]):
        with pytest.raises(ValueError, match="start must be integers \\[2\\] in 0..40"):
            GraphDecoder(model, cache, start=torch.tensor(bad))
    assert GraphDecoder(model, cache, start=torch.tensor([0, 0])).start is None  # (no padding: the unmasked kernel)
    cache.detach()


def test_another_cache_raises(model):
    ids, mask = prompt()
    with torch.no_grad(), pytest.raises(ValueError, match="LongCtxCache.*DynamicCache"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, custom_generate=graph_decoding,
                       **cache_kwargs(model, DynamicCache(config=model.config)))


def test_prefill_takes_a_mask_that_covers_cache_and_prompt(model):
    from longctx.generate import prefill

    ids, mask = prompt(rows=2, pad=4)
    cache = LongCtxCache(model, KVConfig(bits=4))
    with pytest.raises(ValueError, match="must cover the cached tokens"):
        prefill(model, cache, ids, attention_mask=mask[:, 1:])
    cache.detach()
