"""`longctx.graph_decoding` as generate()'s decoding method, on the CPU (eager steps: graphs
need CUDA; tests/test_cuda.py replays them): the same sequences, scores and cache as
generate()'s own loops (greedy, sampling, beam search) over a LongCtxCache, and clear errors
for what it does not do."""

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


def test_returned_sequences_equal_generate(model):
    """num_return_sequences: generate() repeats each prompt; graph_decoding prefills it once
    and repeats the cache's rows, and the draws are generate()'s."""
    ids, mask = prompt(rows=2, pad=6)
    (a, ca), (b, cb) = both(model, ids, mask, seed=3, do_sample=True, num_return_sequences=3, max_new_tokens=20)
    assert b.shape == (6, 60) and torch.equal(a, b)
    assert len({tuple(r) for r in b[:3, 40:].tolist()}) > 1  # (the copies drew apart)
    assert cb.paged.batch_size == 6 and cb.get_seq_length() == ca.get_seq_length() == 59


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


BEAMS = {"3 beams": dict(num_beams=3), "4 beams, 2 returned, early stop": dict(num_beams=4, num_return_sequences=2, length_penalty=0.6, early_stopping=True),
         "never stop early, long favoured": dict(num_beams=2, early_stopping="never", length_penalty=1.5)}


@pytest.mark.parametrize("kv", [dict(bits=4, block_size=16), dict(bits=16, block_size=16)], ids=["int4", "bits16"])
@pytest.mark.parametrize("opts", list(BEAMS.values()), ids=list(BEAMS))
def test_beam_search_equals_generate(model, kv, opts):
    """Beam search, left-padded batch of two, over two seals: the sequences, their scores,
    each step's scores and logits, the beam indices and the cache's rows are generate()'s own
    beam search's."""
    ids, mask = prompt(rows=2, pad=7)
    (a, ca), (b, cb) = both(model, ids, mask, kv=kv, do_sample=False, max_new_tokens=20, return_dict_in_generate=True, output_scores=True,
                           output_logits=True, **opts)
    R = opts.get("num_return_sequences", 1)
    assert b.sequences.shape == (2 * R, 60) and torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.beam_indices, b.beam_indices)
    assert torch.allclose(a.sequences_scores, b.sequences_scores, rtol=1e-5, atol=1e-6)
    assert len(b.scores) == len(b.logits) == 20
    for x, y in zip(a.scores + a.logits, b.scores + b.logits, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-4)
    assert cb.paged.batch_size == ca.paged.batch_size == 2 * opts["num_beams"]
    assert cb.get_seq_length() == ca.get_seq_length() == 59 and cb.paged.tables.rows == ca.paged.tables.rows


class Favour:
    """A logits processor that adds `by` to some tokens' scores (here: the EOS tokens, so that
    beams end often and at many lengths)."""

    def __init__(self, tokens, by):
        self.tokens, self.by = tokens, by

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.tokens] += self.by
        return scores


ENDINGS = {"default": dict(), "early stop, 3 returned": dict(early_stopping=True, num_return_sequences=3), "short favoured": dict(length_penalty=-1.0),
           "never stop early, long favoured": dict(early_stopping="never", length_penalty=1.5), "long favoured": dict(length_penalty=2.0)}


@pytest.mark.parametrize("by", [2.0, 3.5])
@pytest.mark.parametrize("extra", list(ENDINGS.values()), ids=list(ENDINGS))
def test_beams_that_end_early_equal_generate(model, extra, by):
    """Two EOS tokens, favoured so that beams reach them within a few steps: finished
    hypotheses of several lengths, filled past their end; steps where more than half the
    candidates stop (hence three candidates a beam with two EOS tokens); prompts whose
    hypotheses are final while the other's go on; and the loop's end when no running beam
    can beat them. All as generate()'s beam search has them."""
    from transformers import LogitsProcessorList

    ids, mask = prompt(rows=2, pad=4)
    eos = [5, 77]
    steps = []  # each forward: True for a decode step
    hook = model.register_forward_pre_hook(lambda m, a, kw: steps.append(kw["input_ids"].shape[1] == 1), with_kwargs=True)
    try:
        (a, _), (b, _) = both(model, ids, mask, do_sample=False, num_beams=3, max_new_tokens=30, eos_token_id=eos, return_dict_in_generate=True,
                              output_scores=True, logits_processor=LogitsProcessorList([Favour(eos, by)]), **extra)
    finally:
        hook.remove()
    second = steps.index(False, 1)  # (the second run's prefill)
    assert sum(steps[:second]) == sum(steps[second:])  # the same steps: it stops where generate's does,
    assert sum(steps[second:]) < 29 or extra.get("early_stopping") == "never"  # before max_new_tokens (but where it never stops early)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.beam_indices, b.beam_indices)
    assert torch.allclose(a.sequences_scores, b.sequences_scores, rtol=1e-5, atol=1e-6)
    assert any(int(t) in eos for t in b.sequences[:, 40:].flatten())


@pytest.mark.skipif(tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 24),
                    reason="transformers before 5.24 keep sampled beams in the order drawn; graph_decoding keeps the best first, as 5.24 does")
def test_sampled_beams_equal_generate(model):
    ids, mask = prompt(rows=2, pad=3)
    (a, _), (b, _) = both(model, ids, mask, seed=5, do_sample=True, num_beams=3, temperature=0.9, top_k=30, max_new_tokens=15)
    assert torch.equal(a, b)
    (c, _), _ = both(model, ids, mask, seed=6, do_sample=True, num_beams=3, temperature=0.9, top_k=30, max_new_tokens=15)
    assert not torch.equal(a, c)  # (the seed matters: the comparison above compares draws)


def test_copies_of_a_prompt_are_prefilled_once(model):
    """generate() repeats each prompt once a beam (and once a returned sequence): graph_decoding
    feeds one row a prompt and then repeats the cache's rows, which share the prompt's blocks.
    A cache that already holds one row a prompt is continued the same way."""
    ids, mask = prompt(rows=2, pad=5)
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        (a, ca), (b, cb) = both(model, ids, mask, do_sample=False, num_beams=4, max_new_tokens=5)
    finally:
        hook.remove()
    assert fed == [(8, 40)] + [(8, 1)] * 4 + [(2, 40)] + [(8, 1)] * 4  # generate's own prefill feeds every copy; ours one a prompt
    assert torch.equal(a, b)
    shared = cb.paged.tables.rows
    assert all(r[:2] == shared[0][:2] for r in shared[:4]) and all(r[:2] == shared[4][:2] for r in shared[4:])  # (the prompt's sealed blocks)
    # a cache holding the first 30 tokens: one row a prompt (ours), or every copy (generate's own)
    outs, fed = [], []
    for custom, rows in ((None, 8), (graph_decoding, 2)):
        cache = LongCtxCache(model, KVConfig(bits=4, block_size=16))
        with torch.no_grad():
            pick = torch.arange(2).repeat_interleave(rows // 2)
            model(input_ids=ids[pick, :30], attention_mask=mask[pick, :30], use_cache=True, **cache_kwargs(model, cache))
            hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
            try:
                outs.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=4, max_new_tokens=5, pad_token_id=0,
                                           custom_generate=custom, **cache_kwargs(model, cache)))
            finally:
                hook.remove()
        cache.detach()
    assert fed == [(8, 10)] + [(8, 1)] * 4 + [(2, 10)] + [(8, 1)] * 4
    assert torch.equal(*outs)


@pytest.mark.parametrize("kw, match", [(dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "diverse"),
                                       (dict(num_beams=2, on_token=print), "on_token.*num_beams"),
                                       (dict(output_attentions=True, return_dict_in_generate=True), "attentions"),
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


@pytest.mark.parametrize("kv", [dict(bits=4, block_size=16, max_blocks=64), dict(bits=16, block_size=16, max_blocks=64)], ids=["int4", "bits16"])
def test_beam_search_steps_from_graphs(model, kv, monkeypatch):
    """Beam search through GraphDecoder (replays run eagerly here), a left-padded batch of
    two prompts, three beams each, over two seals: every step's reorder moves the cache's rows
    in place (tails and the graph table's rows), so one recording serves all 29 steps, and
    the sequences, beam indices and logits are generate()'s own beam search's."""
    made = replays_run_eagerly(monkeypatch)
    ids, mask = prompt(rows=2, pad=6)
    (a, _), (b, cb) = both(model, ids, mask, kv=kv, do_sample=False, num_beams=3, max_new_tokens=30, return_dict_in_generate=True,
                           output_scores=True, output_logits=True)
    (decoder,) = made
    assert decoder.start.tolist() == [0, 0, 0, 6, 6, 6] and decoder.replayed == 29 and decoder.recorded == 1
    assert cb.paged.seals > 0 and cb.paged.num_blocks == 4
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.beam_indices, b.beam_indices)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-4)


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
