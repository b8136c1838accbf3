"""A cache on disk: save a `PagedKVCache` to a safetensors file and load it back.

The file is plain safetensors (no pickle: loading it runs no code). It holds the pages every
row references once each (the device's and the host tier's alike, shared pages once), the sink
pages, the tails, each row's table of those pages and the token ids the cache holds; its
header names the format version, the `KVConfig`, the model the cache came from (its shape and a
fingerprint of its embedding) and a checksum of every tensor:

    token_ids      int64 [rows, tokens]
    tables         int32 [rows, blocks]: logical block -> saved sink (j < sink_blocks) or page
    sinks.k/.v     [layers, sinks, kv_heads, block_size, head_dim]
    tails.k/.v     [layers, rows, kv_heads, tail tokens, head_dim]
    layers.L.NAME  layer L's pool field NAME (k_codes, k_scale, ..., or k/v for 16-bit layers),
                   [pages, ...]: the saved pages, oldest first

Saving streams one slice of pages at a time to a temporary file beside the target and renames
it at the end, so an interrupted save leaves no half file under the final name. Loading
memory-maps the file and copies slices of pages straight into their tier (the device pools,
or the host tier's pinned pools for the oldest pages when the device part cannot hold them),
checking each tensor's checksum on the way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import KVConfig
from .errors import CacheFullError, LongCtxError

FORMAT = "longctx-kv"
VERSION = 2  # 2: K scales [pages, kv_heads, block_size / k_span, head_dim]
SLICE_BYTES = 64 << 20  # pages moved at a time, saving and loading (bounds the extra memory)
_MOD = 65521  # checksum weights: (byte offset mod _MOD) + 1
_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_FORMAT_FIELDS = ("bits", "k_bits", "v_bits", "block_size", "k_span", "group_size", "sink_blocks", "rotate", "layers_16bit")


class CacheFileError(LongCtxError, ValueError):
    """A cache file that cannot be loaded here: not one, another version, another model, or
    damaged. Nothing was changed."""


@dataclass
class CacheFileInfo:
    """What a cache file holds (its header), read without loading a page."""

    path: Path
    version: int
    config: KVConfig
    model: dict  # architecture, layers, kv_heads, head_dim, vocab, fingerprint
    tokens: int  # per row
    rows: int
    pages: int  # saved pages (shared ones once), sinks aside
    dtype: str
    file_bytes: int
    ids_sha256: str
    extra: dict  # what the saver added (longctx chat: the conversation's messages)


# ---------------------------------------------------------------------- identity
def model_identity(model) -> dict:
    """The model a cache belongs to: its decoder shape and a fingerprint (SHA-256 of the first
    rows of its input embedding, as bfloat16: the same checkpoint loaded in bf16 or fp32 gives the
    same one; another checkpoint of the same shape does not)."""
    from .integrations.transformers import decoder_shape

    layers, kv_heads, head_dim = decoder_shape(model.config)
    emb = model.get_input_embeddings().weight
    rows = emb[: min(16, emb.shape[0])].detach().to("cpu", torch.bfloat16).contiguous()
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return dict(architecture=archs[0], layers=layers, kv_heads=kv_heads, head_dim=head_dim, vocab=int(emb.shape[0]),
                fingerprint=hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest()[:16])


def _ids_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------- checksums
def _weighted_sum(data: torch.Tensor, offset: int) -> int:
    """sum(byte * ((offset + i) mod _MOD + 1)) over the bytes of `data` (on its device): a byte
    changed anywhere, or two swapped, changes it."""
    b = data.reshape(-1).view(torch.uint8)
    total, step = 0, 1 << 24  # (255 * _MOD * 2**24 stays far inside int64)
    for i in range(0, b.numel(), step):
        part = b[i : i + step]
        w = torch.arange(offset + i, offset + i + part.numel(), device=b.device, dtype=torch.int64).remainder_(_MOD).add_(1)
        total += int((part.to(torch.int64) * w).sum())
    return total


class _Checksum:
    def __init__(self):
        self.total, self.offset = 0, 0

    def add(self, data: torch.Tensor) -> None:
        self.total += _weighted_sum(data, self.offset)
        self.offset += data.numel() * data.element_size()

    def hex(self) -> str:
        return f"{self.total % 2**64:016x}"


# ---------------------------------------------------------------------- layout
def _saved_pages(cache) -> tuple[list[int], list[tuple[str, int]]]:
    """(the saved sinks' ids, the saved pages as (tier, id)), each in the order its first
    reference appears walking the columns: oldest first, so the host tier's pages lead."""
    t = cache.tables
    sinks: dict[int, None] = {}
    pages: dict[tuple[str, int], None] = {}
    for j in range(t.num_blocks):
        for row in t.rows:
            if j < t.sink_blocks:
                sinks.setdefault(row[j])
            else:
                pages.setdefault(("host" if j < t.host_upto else "device", row[j]))
    return list(sinks), list(pages)


def _fields(cache) -> list[tuple[int, str, tuple, torch.dtype]]:
    return [(layer, name, shape[1:], dtype) for layer, fmt in enumerate(cache.formats) for name, shape, dtype in cache.pool_fields(fmt, 0)]


def _per_slice(row_bytes: int) -> int:
    return max(1, SLICE_BYTES // max(1, row_bytes))


# ---------------------------------------------------------------------- save
def save(cache, path: str | os.PathLike, token_ids, model=None, identity: dict | None = None, extra: dict | None = None) -> int:
    """Write `cache` (a PagedKVCache between forwards) and the token ids it holds (int [rows,
    tokens], or one list for one row) to `path`; returns the bytes written. `model` (or its
    `identity`, `model_identity(model)`) is recorded for the check when loading; `extra`
    (plain JSON values) is kept in the header for the caller (`read_info(path).extra`)."""
    path = Path(path)
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
    if ids.dim() == 1:
        ids = ids[None]
    if not cache.initialized or cache.batch_size == 0:
        raise ValueError("save: the cache holds nothing yet; prefill it first")
    if len(set(cache.tail_len)) != 1:
        raise RuntimeError("save: the layers hold different lengths (a forward is under way); save between forwards")
    cache.seal()  # (full tail blocks as pages, as the next forward would: what memory_report counts)
    for device in cache.devices:  # (a spill's copies to the host tier run on a side stream)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows, tokens = cache.batch_size, cache.seq_len()
    if tuple(ids.shape) != (rows, tokens):
        raise ValueError(f"save: the cache holds {rows} row(s) of {tokens:,} tokens, the token ids are {tuple(ids.shape)}")
    if identity is None:
        if model is None:
            raise ValueError("save: give the model (or its identity) the cache belongs to")
        identity = model_identity(model)
    sinks, pages = _saved_pages(cache)
    sink_index = {bid: i for i, bid in enumerate(sinks)}
    page_index = {key: i for i, key in enumerate(pages)}
    t = cache.tables
    table = torch.tensor([[sink_index[bid] if j < t.sink_blocks else page_index["host" if j < t.host_upto else "device", bid]
                           for j, bid in enumerate(row)] for row in t.rows], dtype=torch.int32).reshape(rows, t.num_blocks)
    tail = cache.tail_len[0]
    L, H, P, D = cache.num_layers, cache.num_kv_heads, cache.block_size, cache.head_dim
    segs = cache.segments  # (layer-major: each segment's layers in turn)
    sink_ids = torch.tensor(sinks, dtype=torch.int64)
    entries = [("token_ids", torch.int64, tuple(ids.shape), lambda: [ids]),
               ("tables", torch.int32, tuple(table.shape), lambda: [table]),
               ("sinks.k", cache.dtype, (L, len(sinks), H, P, D), lambda: [s.sink_k.index_select(1, sink_ids.to(s.device)) for s in segs]),
               ("sinks.v", cache.dtype, (L, len(sinks), H, P, D), lambda: [s.sink_v.index_select(1, sink_ids.to(s.device)) for s in segs]),
               ("tails.k", cache.dtype, (L, rows, H, tail, D), lambda: [s.tail_k[:, :, :, :tail] for s in segs]),
               ("tails.v", cache.dtype, (L, rows, H, tail, D), lambda: [s.tail_v[:, :, :, :tail] for s in segs])]
    for layer, name, shape, dtype in _fields(cache):
        entries.append((f"layers.{layer}.{name}", dtype, (len(pages), *shape), _page_slices(cache, pages, layer, name)))
    metadata = {"format": FORMAT, "version": str(VERSION), "config": json.dumps(dataclasses.asdict(cache.config)),
                "model": json.dumps(identity), "tokens": str(tokens), "rows": str(rows), "pages": str(len(pages)),
                "dtype": str(cache.dtype).removeprefix("torch."), "ids_sha256": _ids_hash(ids), "extra": json.dumps(extra or {})}
    return _write(path, entries, metadata)


def _page_slices(cache, pages: list[tuple[str, int]], layer: int, name: str):
    """The saved pages of one pool field, a slice at a time, each gathered from its tier."""

    def slices():
        pool = getattr(cache.pages[layer], name)
        host = getattr(cache.host.pages[layer], name) if cache.host is not None and cache.host.pages else None
        step = _per_slice(pool[0].numel() * pool.element_size() if pool.shape[0] else 1)
        for a in range(0, len(pages), step):
            part = pages[a : a + step]
            out = torch.empty((len(part), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
            for tier, src in (("device", pool), ("host", host)):
                at = [i for i, (t, _) in enumerate(part) if t == tier]
                if at:
                    ids = torch.tensor([part[i][1] for i in at], dtype=torch.int64, device=src.device)
                    out[torch.tensor(at, device=pool.device)] = src.index_select(0, ids).to(pool.device)
            yield out

    return slices


def _write(path: Path, entries, metadata: dict) -> int:
    """A safetensors file written a slice at a time: the header first with room for the
    checksums, the tensors' bytes, then the header again with them. Into `path`.tmp, renamed
    onto `path` when complete."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n

    def encode(checksums: dict) -> bytes:
        text = json.dumps({"__metadata__": {**metadata, "checksums": json.dumps(checksums)}, **header}, separators=(",", ":")).encode()
        return text + b" " * (-len(text) % 8)

    sums = {name: "0" * 16 for name, *_ in entries}
    head = encode(sums)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for name, dtype, shape, parts in entries:
                check, written = _Checksum(), 0
                for part in parts():
                    part = part.contiguous()
                    check.add(part)
                    data = part.reshape(-1).view(torch.uint8).cpu().numpy()
                    f.write(memoryview(data))
                    written += data.nbytes
                lo, hi = header[name]["data_offsets"]
                if written != hi - lo:
                    raise RuntimeError(f"save: {name} wrote {written:,} bytes, {hi - lo:,} expected")
                sums[name] = check.hex()
            final = encode(sums)
            assert len(final) == len(head)  # (checksums are 16 hex digits each)
            f.seek(8)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# ---------------------------------------------------------------------- read
def _open(path: Path):
    from safetensors import safe_open

    if not path.exists():
        raise FileNotFoundError(f"no such cache file {path}")
    if path.is_dir():
        raise CacheFileError(f"{path} is a directory, not a cache file")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # (safetensors raises its own error type for a file it cannot parse)
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CacheFileError(f"{path} cannot be read as a cache file (cut short, damaged, or another kind of file): {detail}") from None


def read_info(path: str | os.PathLike) -> CacheFileInfo:
    """The header of the cache file at `path`: what it holds, checked to be one this longctx
    reads (CacheFileError otherwise)."""
    path = Path(path)
    with _open(path) as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise CacheFileError(f"{path} is not a longctx cache file (a safetensors file without the {FORMAT!r} header)")
    if meta.get("version") != str(VERSION):
        raise CacheFileError(f"{path} is a longctx cache file of format version {meta.get('version')}; this longctx reads version {VERSION}")
    try:
        cfg = KVConfig(**json.loads(meta["config"]))
        return CacheFileInfo(path, VERSION, cfg, json.loads(meta["model"]), int(meta["tokens"]), int(meta["rows"]), int(meta["pages"]),
                             meta["dtype"], path.stat().st_size, meta["ids_sha256"], json.loads(meta.get("extra", "{}")))
    except (KeyError, ValueError, TypeError) as e:
        raise CacheFileError(f"{path}: its header is damaged ({type(e).__name__}: {e})") from None


def check_model(info: CacheFileInfo, model) -> None:
    """CacheFileError unless the file was saved from `model` (its shape and fingerprint)."""
    here = model_identity(model)
    for key in ("architecture", "layers", "kv_heads", "head_dim", "vocab", "fingerprint"):
        if info.model.get(key) != here[key]:
            raise CacheFileError(f"{info.path} was saved from another model ({key}: {info.model.get(key)} there, {here[key]} here); "
                                 "a cache loads only into the model that made it")


def load_config(info: CacheFileInfo, config: KVConfig | None) -> KVConfig:
    """The config to load `info`'s cache with: its own, or `config`, whose format must be the
    file's (its capacity fields, max_blocks, host_blocks, stage_blocks, and backend, may differ)."""
    if config is None:
        return dataclasses.replace(info.config, max_blocks=None, host_blocks=0, stage_blocks=None)
    saved = info.config
    for name in _FORMAT_FIELDS:
        a, b = getattr(saved, name), getattr(config, name)
        if name == "group_size" and b is None:
            continue
        if (tuple(a) if name == "layers_16bit" else a) != (tuple(b) if name == "layers_16bit" else b):
            raise CacheFileError(f"{info.path} holds {saved.describe()} pages ({name}={a!r}); the config asks {name}={b!r}. "
                                 "Load with the file's format (config=None) or one that differs only in max_blocks, host_blocks, "
                                 "stage_blocks or backend")
    return config


def load_into(cache, info: CacheFileInfo, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Fill `cache` (a new, empty PagedKVCache of the file's format) from the file `info`
    (`read_info`) describes, on `device` with tails, sinks and scales in `dtype`; returns the
    token ids it holds (int64 [rows, tokens], on the CPU). The oldest pages go to the host tier
    when the device part (`max_blocks`) cannot hold them all. On any error the cache is left
    empty."""
    path = info.path
    try:
        with _open(path) as f:
            meta = f.metadata()
            sums = json.loads(meta["checksums"])

            def read(name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
                return f.get_slice(name)[lo:hi] if lo is not None else f.get_tensor(name)

            ids, table = read("token_ids"), read("tables")
            _verify(path, "token_ids", ids, sums)
            _verify(path, "tables", table, sums)
            if tuple(ids.shape) != (info.rows, info.tokens) or _ids_hash(ids) != info.ids_sha256:
                raise CacheFileError(f"{path}: its token ids do not match their hash in the header; the file is damaged")
            _restore(cache, path, info, read, table, sums, torch.device(device), dtype)
        return ids
    except BaseException:
        cache.reset()
        raise


def _verify(path: Path, name: str, data: torch.Tensor, sums: dict) -> None:
    check = _Checksum()
    check.add(data.contiguous())
    if sums.get(name) != check.hex():
        raise CacheFileError(f"{path}: {name} does not match its checksum; the file is damaged (a changed or missing byte)")


def _restore(cache, path: Path, info: CacheFileInfo, read, table: torch.Tensor, sums: dict, device: torch.device, dtype) -> None:
    t, cfg = cache.tables, cache.config
    rows, nb = table.shape
    S = cfg.sink_blocks
    cols = [table[:, j].tolist() for j in range(nb)]
    # the host tier takes the oldest columns when the device part cannot hold every page
    unique = [len(set(c)) for c in cols]
    device_pages, host_cols = sum(unique[S:]), 0
    if cfg.max_blocks is not None:
        while device_pages > cfg.max_blocks and S + host_cols < nb:
            device_pages -= unique[S + host_cols]
            host_cols += 1
        if device_pages > cfg.max_blocks:
            raise CacheFullError(f"{path} holds {sum(unique[S:]):,} pages; no split fits max_blocks={cfg.max_blocks:,}")
    host_pages = sum(unique[S : S + host_cols])
    if host_cols and cache.host is None:
        raise CacheFullError(f"{path} holds {sum(unique[S:]):,} pages ({info.tokens:,} tokens a row); max_blocks={cfg.max_blocks:,} "
                             f"on the device and no host tier: give host_blocks (chat --host-mem) for the other {host_pages:,}, "
                             "or a larger max_blocks")
    if host_cols and host_pages > cfg.host_blocks:
        raise CacheFullError(f"{path} needs {host_pages:,} pages in the host tier beside max_blocks={cfg.max_blocks:,} on the device; "
                             f"host_blocks={cfg.host_blocks:,}")
    cache.start(dtype, device, rows)
    # the tables, column by column: rows holding the same saved page share one new id
    t.host_upto = S + host_cols
    sink_new, page_new = {}, {}  # saved index -> new id
    for j, col in enumerate(cols):
        groups: dict[int, list[int]] = {}
        for r, saved in enumerate(col):
            groups.setdefault(saved, []).append(r)
        ids = t.allocator_for(j).allocate(len(groups))
        for saved, bid in zip(groups, ids):
            (sink_new if j < S else page_new)[saved] = ("device" if j >= S + host_cols or j < S else "host", bid)
        t.push(list(groups.values()), ids)
    cache.grow_pools()
    if host_cols:
        cache.host.prepare()
    # sinks and tails
    sinks = sorted(sink_new.items())
    if sinks:
        k, v = read("sinks.k"), read("sinks.v")
        _verify(path, "sinks.k", k, sums)
        _verify(path, "sinks.v", v, sums)
        at = torch.tensor([bid for _, (_, bid) in sinks])
        for seg in cache.segments:
            layers = slice(seg.layers.start, seg.layers.stop)
            seg.sink_k[:, at.to(seg.device)] = k[layers].to(seg.device, dtype)
            seg.sink_v[:, at.to(seg.device)] = v[layers].to(seg.device, dtype)
    k, v = read("tails.k"), read("tails.v")
    _verify(path, "tails.k", k, sums)
    _verify(path, "tails.v", v, sums)
    cache.set_tails(k.to(dtype=dtype), v.to(dtype=dtype))
    # the pages, a slice at a time, into their tier
    order = [page_new[i] for i in range(len(page_new))]
    for layer, name, shape, fdtype in _fields(cache):
        key = f"layers.{layer}.{name}"
        pool = getattr(cache.pages[layer], name)
        host = getattr(cache.host.pages[layer], name) if host_cols else None
        step = _per_slice(torch.Size(shape).numel() * pool.element_size())
        check = _Checksum()
        for a in range(0, len(order), step):
            part = read(key, a, min(len(order), a + step))  # (the file's bytes: the checksum's)
            if (part.dtype == torch.uint8) != (fdtype == torch.uint8):
                raise CacheFileError(f"{path}: {key} holds {part.dtype}, not this format's {fdtype}; the file is damaged")
            dev = part.to(pool.device)
            check.add(dev)
            for tier, dst, src in (("device", pool, dev), ("host", host, part)):
                at = [i for i, (t_, _) in enumerate(order[a : a + step]) if t_ == tier]
                if at:
                    ids = torch.tensor([order[a + i][1] for i in at], dtype=torch.int64, device=dst.device)
                    dst.index_copy_(0, ids, src.index_select(0, torch.tensor(at, device=src.device)).to(dst.device, dst.dtype))
        if sums.get(key) != check.hex():
            raise CacheFileError(f"{path}: {key} does not match its checksum; the file is damaged (a changed or missing byte)")
    cache.tables_changed()


# ---------------------------------------------------------------------- prefix reuse
def common_prefix(saved: Sequence[int], ids: Sequence[int]) -> int:
    """The number of leading tokens `saved` and `ids` hold alike."""
    n = 0
    for a, b in zip(saved, ids):
        if a != b:
            break
        n += 1
    return n


def reuse_prefix(cache, saved_ids, ids) -> int:
    """How many leading tokens of `ids` (one row: a list or int tensor) the cache, holding
    `saved_ids`, can keep: their common prefix, less one where `ids` holds nothing more (a
    forward needs a token to give logits). The cache is cropped to that length, so that what
    follows it is never read from the saved tokens past the first difference. Prefill
    ids[returned:] next."""
    saved = torch.as_tensor(saved_ids).reshape(-1).tolist()
    new = torch.as_tensor(ids).reshape(-1).tolist()
    keep = common_prefix(saved, new)
    if keep == len(new):
        keep -= 1
    keep = max(0, keep)
    if keep < len(saved):
        cache.crop(keep)
    return keep
