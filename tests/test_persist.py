"""A cache on disk (longctx.persist): a loaded cache continues exactly as the saved one would
(greedy tokens and logits), keeps its pages shared and its tiers, reuses a prompt's saved
prefix and nothing past it, and every damaged or foreign file is a one-line error that leaves
the file and the caller's cache as they were."""

import pytest
import torch

from longctx import CacheFullError, KVConfig, LongCtxCache
from longctx.config import kv_preset
from longctx.eval import default_text
from longctx.generate import prefill
from longctx.integrations.transformers import cache_kwargs
from longctx.persist import CacheFileError, read_info, reuse_prefix

FORMATS = {"bf16": KVConfig(bits=16), "int4": KVConfig(bits=4), "int2+rot": kv_preset("int2+rot")}  # (spans of K scales in pages of 64)


@pytest.fixture(scope="module")
def smol():
    from longctx.models import load_model

    model, tok = load_model()
    ids = tok(default_text(), return_tensors="pt").input_ids[:, :600]
    return model, ids


def forward(model, cache, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]


def greedy(model, cache, first, n=10):
    """n greedy tokens a row after feeding `first` (int [rows, 1]); returns ([rows, n], the first logits)."""
    tok, out, first_logits = first, [], None
    for _ in range(n):
        logits = forward(model, cache, tok)
        first_logits = logits if first_logits is None else first_logits
        tok = logits.argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1), first_logits


def filled(model, ids, cfg):
    cache = LongCtxCache(model, cfg)
    with torch.inference_mode():
        prefill(model, cache, ids, chunk=128, all_logits=False)
    return cache


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_loaded_cache_continues_as_the_saved_one(smol, tmp_path, name):
    model, ids = smol
    path = tmp_path / "doc.kvc"
    cache = filled(model, ids[:, :-1], FORMATS[name])
    size = cache.save(path, ids[:, :-1])
    report = cache.memory_report()
    assert report.total_bytes <= size <= report.total_bytes * 1.02 + 64 * 1024  # (the header, ids and tables beside the pages)
    want, want_logits = greedy(model, cache, ids[:, -1:])
    cache.detach()
    loaded, saved_ids = LongCtxCache.load(model, path)
    assert torch.equal(saved_ids, ids[:, :-1]) and loaded.paged.seq_len() == ids.shape[1] - 1
    assert loaded.kv_config.describe() == FORMATS[name].describe()
    got, got_logits = greedy(model, loaded, ids[:, -1:])
    loaded.detach()
    assert torch.equal(got, want) and torch.equal(got_logits, want_logits)
    info = read_info(path)
    assert (info.tokens, info.rows, info.file_bytes) == (ids.shape[1] - 1, 1, size) and info.model["layers"] == 30


def test_beams_keep_their_shared_pages(smol, tmp_path):
    model, ids = smol
    cache = filled(model, ids[:, :300], KVConfig(bits=4, block_size=16))
    cache.batch_repeat_interleave(3)
    rows = ids[:, :300].repeat(3, 1)
    step = torch.tensor([[11], [12], [13]])
    for _ in range(40):  # the beams' own tokens, past several blocks
        forward(model, cache, step)
        rows = torch.cat([rows, step], 1)
        step = step + 3
    paged = cache.paged
    sealed = paged.memory_report().blocks["quantized"]
    cache.save(tmp_path / "beams.kvc", rows)
    want, _ = greedy(model, cache, step)
    cache.detach()
    loaded, saved_ids = LongCtxCache.load(model, tmp_path / "beams.kvc")
    assert torch.equal(saved_ids, rows)
    loaded.paged.tables.check()
    assert loaded.paged.memory_report().blocks["quantized"] == sealed < 3 * (loaded.paged.num_blocks - 1)  # the prompt's pages once
    got, _ = greedy(model, loaded, step)
    loaded.detach()
    assert torch.equal(got, want)


def test_host_tier_pages_save_and_load_into_either_tier(smol, tmp_path):
    model, ids = smol
    tiered = KVConfig(bits=4, block_size=16, max_blocks=8, host_blocks=64, stage_blocks=4)
    cache = filled(model, ids[:, :-1], tiered)
    assert cache.paged.tables.host_columns > 0
    cache.save(tmp_path / "t.kvc", ids[:, :-1])
    want, _ = greedy(model, cache, ids[:, -1:])
    cache.detach()
    for cfg in (None, tiered):  # all on the device, then the oldest pages in the host tier again
        loaded, _ = LongCtxCache.load(model, tmp_path / "t.kvc", cfg)
        assert (loaded.paged.tables.host_columns > 0) == (cfg is not None)
        loaded.paged.tables.check()
        got, _ = greedy(model, loaded, ids[:, -1:])
        loaded.detach()
        assert torch.equal(got, want), cfg
    with pytest.raises(CacheFullError, match="no host tier: give host_blocks"):
        LongCtxCache.load(model, tmp_path / "t.kvc", KVConfig(bits=4, block_size=16, max_blocks=8))
    with pytest.raises(CacheFileError, match="holds int4 pages"):
        LongCtxCache.load(model, tmp_path / "t.kvc", KVConfig(bits=8, block_size=16))


def test_prefix_reuse_prefills_only_new_tokens_and_crops_at_a_divergence(smol, tmp_path):
    model, ids = smol
    doc = ids[:, :400]
    cache = filled(model, doc, KVConfig(bits=4))
    cache.save(tmp_path / "doc.kvc", doc)
    cache.detach()
    question = torch.tensor([[504, 2030, 314, 42, 7]])
    prompt = torch.cat([doc, question], 1)
    kept = filled(model, doc, KVConfig(bits=4))  # the same document never saved, the question after it
    with torch.inference_mode():
        prefill(model, kept, prompt[:, 400:-1], chunk=128, all_logits=False)
    want = forward(model, kept, prompt[:, -1:])
    kept.detach()
    loaded, saved = LongCtxCache.load(model, tmp_path / "doc.kvc")
    keep = reuse_prefix(loaded, saved, prompt)
    assert keep == 400  # the document is not prefilled again: only the question's 5 tokens
    with torch.inference_mode():
        prefill(model, loaded, prompt[:, keep:-1], chunk=128, all_logits=False)
    torch.testing.assert_close(forward(model, loaded, prompt[:, -1:]), want, rtol=0, atol=0)
    loaded.detach()
    other = doc.clone()
    other[0, 250] += 1  # a prompt that differs inside the saved part
    loaded, saved = LongCtxCache.load(model, tmp_path / "doc.kvc")
    assert reuse_prefix(loaded, saved, other) == 250 and loaded.paged.seq_len() == 250
    assert reuse_prefix(loaded, saved[:, :250], saved[:, :250]) == 249  # (the last token is fed again, for its logits)
    loaded.detach()


def damaged(tmp_path, src, name, change):
    data = bytearray(src.read_bytes())
    change(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def test_foreign_or_damaged_files_are_one_line_errors_and_change_nothing(smol, tmp_path):
    model, ids = smol
    good = tmp_path / "good.kvc"
    cache = filled(model, ids[:, :200], KVConfig(bits=4))
    cache.save(good, ids[:, :200])
    before = good.read_bytes()
    head = int.from_bytes(before[:8], "little")

    def flip_middle(d):
        d[len(d) // 2] ^= 0x10

    def version(d):
        from longctx.persist import VERSION

        i = d.index(b'"version":"%d"' % VERSION)
        d[i + 11] = ord("9")

    cases = {"flipped.kvc": (flip_middle, "checksum"), "short.kvc": (lambda d: d.__delitem__(slice(len(d) - 1000, None)), "cut short"),
             "version.kvc": (version, "format version 9"), "text.kvc": (lambda d: d.__setitem__(slice(None), b"hello " * 100), "cannot be read as a cache file")}
    for name, (change, words) in cases.items():
        bad = damaged(tmp_path, good, name, change)
        with pytest.raises(CacheFileError, match=words) as e:
            LongCtxCache.load(model, bad)
        assert "\n" not in str(e.value) and str(bad) in str(e.value), (name, e.value)
    with pytest.raises(FileNotFoundError):
        LongCtxCache.load(model, tmp_path / "missing.kvc")
    other = damaged(tmp_path, good, "other.kvc", lambda d: None)
    meta_at = before.index(b'fingerprint\\": \\"') + len(b'fingerprint\\": \\"')
    raw = bytearray(other.read_bytes())
    raw[meta_at] = ord("0") if raw[meta_at] != ord("0") else ord("1")
    other.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match="another model"):
        LongCtxCache.load(model, other)
    assert good.read_bytes() == before and head > 0
    # the caller's cache is untouched by a failed load, and a failed save leaves the old file
    assert torch.equal(greedy(model, cache, ids[:, 200:201], 3)[0], greedy(model, filled(model, ids[:, :200], KVConfig(bits=4)), ids[:, 200:201], 3)[0])


def test_an_interrupted_save_leaves_the_previous_file_whole(smol, tmp_path, monkeypatch):
    import longctx.persist as persist

    model, ids = smol
    path = tmp_path / "doc.kvc"
    cache = filled(model, ids[:, :200], KVConfig(bits=4))
    cache.save(path, ids[:, :200])
    before = path.read_bytes()
    real = persist._Checksum.add
    calls = [0]

    def fail_midway(self, data):
        calls[0] += 1
        if calls[0] == 20:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(persist._Checksum, "add", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path, ids[:, :200])
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(persist._Checksum, "add", real)
    with pytest.raises(ValueError, match="token ids are"):
        cache.save(path, ids[:, :150])
    assert read_info(path).tokens == 200


def test_bench_disk_loads_what_it_saved_and_counts_its_bytes(tmp_path):
    """`longctx bench disk`'s rows on the CPU (a random model of SmolLM2's shape): the loaded
    cache decodes the saved one's greedy tokens, the file is memory_report()'s bytes plus its
    header, and no file is left behind."""
    from longctx.bench.disk import bench_disk

    rows = bench_disk(contexts=(200,), formats=("int4",), model="smollm2-135m", chunk=64, decode=3, directory=tmp_path, device="cpu")
    (r,) = rows
    assert (r.context, r.format, r.decoded, r.same_tokens) == (200, "int4", 3, 3)
    assert 1.0 < r.bytes_ratio < 1.02 and r.prefill_s > 0 and r.load_s > 0
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="unknown format 'int5'"):
        bench_disk(contexts=(200,), formats=("int5",), device="cpu")
