"""`bench disk`: loading a saved cache against prefilling the same tokens again.

A random-initialized model of a catalog model's shape (bf16 weights) prefills `context` random
token ids in chunks into LongCtxCache; the cache is saved (`LongCtxCache.save`), greedy tokens
are decoded from it, and then it is loaded from the file just written (in the page cache, as
when a document is reopened) and the same tokens are decoded from the loaded one. The row
gives prefill, save and load seconds, the file's bytes against `memory_report()`'s and how
many greedy tokens the two caches agree on.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import BackendUnavailableError
from ..config import bits_format
from ..plan import model_shape
from .common import greedy_steps
from .plan import FORMATS, random_model


@dataclass
class DiskRow:
    model: str
    format: str
    context: int
    prefill_s: float
    save_s: float
    load_s: float
    file_bytes: int
    report_bytes: int  # memory_report().total_bytes of the saved cache
    same_tokens: int  # leading greedy tokens the loaded cache decodes as the saved one did
    decoded: int

    @property
    def load_speedup(self) -> float:
        return self.prefill_s / self.load_s

    @property
    def bytes_ratio(self) -> float:
        return self.file_bytes / self.report_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "load_speedup": self.load_speedup, "bytes_ratio": self.bytes_ratio}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_disk(contexts=(131072, 434176), formats=("int4",), model: str = "llama-3.1-8b", chunk: int = 8192, decode: int = 16,
               directory: str | Path | None = None, device: str = "cuda", progress=None) -> list[DiskRow]:
    """A row per (context, format); progress(row) follows each. `directory` holds the files
    (default: the temporary directory), each deleted after its row."""
    from ..generate import prefill
    from ..integrations.transformers import LongCtxCache

    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"bench disk: unknown format {bad[0]!r}; choose from {', '.join(FORMATS)}")
    if not contexts or min(contexts) < 2:
        raise ValueError(f"bench disk: contexts must be at least 2 tokens, got {list(contexts)}")
    if chunk < 1 or decode < 1:
        raise ValueError(f"bench disk: chunk and decode must be at least 1, got {chunk} and {decode}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("bench disk needs a CUDA GPU; this machine has none")
    shape = model_shape(model)
    net = random_model(shape, max(contexts) + decode + 16, device)
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    rows = []
    for context in contexts:
        ids = torch.randint(0, shape.vocab, (1, context), generator=torch.Generator().manual_seed(context)).to(device)
        for fmt in formats:
            path = folder / f"longctx-bench-{model}-{fmt}-{context}.kvc"

            try:
                cache = LongCtxCache(net, bits_format(FORMATS[fmt]))
                with torch.inference_mode():
                    _sync(device)
                    t0 = time.perf_counter()
                    logits = prefill(net, cache, ids, chunk=chunk, all_logits=False)
                    _sync(device)
                    prefill_s = time.perf_counter() - t0
                first = logits.argmax(-1, keepdim=True).reshape(1, 1)
                report = cache.memory_report().total_bytes
                t0 = time.perf_counter()
                size = cache.save(path, ids)
                save_s = time.perf_counter() - t0
                with torch.inference_mode():
                    want = list(greedy_steps(net, cache, first, decode))
                cache.detach()
                cache = logits = None
                gc.collect()
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()
                _sync(device)
                t0 = time.perf_counter()
                loaded, _ = LongCtxCache.load(net, path)
                _sync(device)
                load_s = time.perf_counter() - t0
                with torch.inference_mode():
                    got = list(greedy_steps(net, loaded, first, decode))
                loaded.detach()
                loaded = None
            finally:
                path.unlink(missing_ok=True)
            same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
            row = DiskRow(model, fmt, context, prefill_s, save_s, load_s, size, report, same, decode)
            rows.append(row)
            if progress is not None:
                progress(row)
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return rows
