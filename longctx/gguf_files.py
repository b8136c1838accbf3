"""GGUF files: a check of the header and sizes before transformers reads one, and a converted
copy (safetensors, with the tokenizer) kept in the user's cache directory, keyed by the file's
hash, so that only a file's first load pays for the conversion.

`check_gguf` reads the header itself (magic, version, metadata, tensor infos) and compares the
size the tensor infos describe with the file on disk: a damaged file is one line that says
what is wrong (truncated, and where; or which value of the header is corrupt), where
transformers' reader stops on a struct error or a failed reshape.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import struct
from pathlib import Path

from safetensors.torch import save_model

from .errors import ModelNotFoundError

MAGIC = b"GGUF"
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}  # GGUFValueType
STRING, ARRAY = 8, 9
LIMIT = 1 << 24  # more entries than any real file holds in one header list: the count is corrupt
CACHE_MAX_BYTES = 2 << 30  # GGUF files converted and kept: those whose fp32 copy stays under this


class DamagedModelFileError(ModelNotFoundError):
    """A model file that is truncated or corrupt (the message says which, and where)."""


class _Header:
    """A bounds-checked reader of a GGUF file's header."""

    def __init__(self, path: Path):
        self.path, self.size = path, path.stat().st_size
        self.f = path.open("rb")
        self.pos = 0

    def read(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise DamagedModelFileError(f"{self.path.name} is truncated or corrupt: its header needs {what} at byte {self.pos:,} "
                                        f"({n:,} bytes), and the file has {self.size:,}")
        data = self.f.read(n)
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def count(self, what: str) -> int:
        n = self.scalar("<Q", what)
        if n > LIMIT:
            raise DamagedModelFileError(f"{self.path.name} is corrupt: its header gives {n:,} {what} at byte {self.pos - 8:,}")
        return n

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        if n > self.size:
            raise DamagedModelFileError(f"{self.path.name} is corrupt: {what} at byte {self.pos - 8:,} is {n:,} bytes long, more than the file")
        return self.read(n, what).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind in SCALARS:
            return self.scalar(SCALARS[kind], f"the value of {key!r}")
        if kind == STRING:
            return self.string(f"the value of {key!r}")
        if kind == ARRAY:
            item = self.scalar("<I", f"the item type of {key!r}")
            n = self.count(f"items of {key!r}")
            if item in SCALARS:  # (a block: token scores and types are 49k entries)
                self.read(n * struct.calcsize(SCALARS[item]), f"the items of {key!r}")
                return None
            return [self.value(item, key) for _ in range(n)] if item in (STRING, ARRAY) else self.value(item, key)
        raise DamagedModelFileError(f"{self.path.name} is corrupt: metadata {key!r} holds a value of type {kind} at byte {self.pos - 4:,} "
                                    f"(GGUF's types are 0 to 12)")


def check_gguf(path: Path) -> tuple[dict, list[str], int]:
    """Raises DamagedModelFileError, in one line, where `path` is not a whole GGUF file: a wrong
    magic, a header that ends early or holds impossible values, or tensor data that the header
    places past the end of the file (naming the first tensor cut). Returns the header's
    metadata (arrays of numbers as None, arrays of strings as lists), the tensors' names and
    their elements in all."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    h = _Header(path)
    try:
        if h.read(4, "the magic") != MAGIC:
            raise DamagedModelFileError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
        version = h.scalar("<I", "the version")
        if version not in (2, 3):
            raise DamagedModelFileError(f"{path.name} is corrupt or of an unknown GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = h.count("tensors"), h.count("metadata entries")
        metadata = {}
        for _ in range(n_kv):
            key = h.string("a metadata key")
            metadata[key] = h.value(h.scalar("<I", f"the type of {key!r}"), key)
        alignment = metadata.get("general.alignment")
        alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
        tensors = []
        for _ in range(n_tensors):
            name = h.string("a tensor name")
            dims = h.scalar("<I", f"the dimensions of {name!r}")
            if dims > 8:
                raise DamagedModelFileError(f"{path.name} is corrupt: tensor {name!r} has {dims} dimensions")
            shape = [h.scalar("<Q", f"the shape of {name!r}") for _ in range(dims)]
            kind = h.scalar("<I", f"the type of {name!r}")
            offset = h.scalar("<Q", f"the offset of {name!r}")
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise DamagedModelFileError(f"{path.name} is corrupt: tensor {name!r} has type {kind}, which GGUF does not define") from None
            elements = 1
            for d in shape:
                elements *= d
            tensors.append((offset, elements // block * block_bytes, name, elements))
    finally:
        h.f.close()
    start = -(-h.pos // alignment) * alignment
    need = max((start + off + n for off, n, _, _ in tensors), default=start)
    if need > h.size:
        cut = sorted(t for t in tensors if start + t[0] + t[1] > h.size)
        raise DamagedModelFileError(f"{path.name} is truncated: its header describes {need:,} bytes and the file has {h.size:,} "
                                    f"(tensor {cut[0][2]!r} and {len(cut) - 1} after it are cut)")
    return metadata, [t[2] for t in tensors], sum(t[3] for t in tensors)


def gguf_shape_config(path: Path) -> dict:
    """A transformers-style config (num_hidden_layers, hidden_size, heads, ...) from a GGUF
    file's header, for `longctx plan`; the file is checked as check_gguf does."""
    meta, tensors, _ = check_gguf(path)
    arch = meta.get("general.architecture")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelNotFoundError(f"{path.name}: its header has no {arch}.{key}, which plan needs")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    return {"model_type": arch, "num_hidden_layers": get("block_count"), "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": get("attention.head_count_kv", heads), "head_dim": get("attention.key_length", hidden // heads),
            "intermediate_size": get("feed_forward_length"), "vocab_size": get("vocab_size", len(tokens) if tokens else None),
            "max_position_embeddings": meta.get(f"{arch}.context_length"),
            "tie_word_embeddings": "output.weight" not in tensors}  # (a tied LM head has no tensor of its own)


def cache_dir() -> Path:
    """Where converted models are kept: $LONGCTX_CACHE, else $XDG_CACHE_HOME/longctx, else
    ~/.cache/longctx."""
    root = os.environ.get("LONGCTX_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "longctx")
    return Path(root)


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def copy_folder(path: Path) -> Path | None:
    """Where `path`'s converted copy is or would be kept, keyed by the file's hash; None for a
    file too large to keep one (a GGUF never holds more bytes than its fp32 copy, so one over
    CACHE_MAX_BYTES is not hashed at all: a 7B model's file takes seconds to hash)."""
    if path.stat().st_size > CACHE_MAX_BYTES:
        return None
    return cache_dir() / "gguf" / file_hash(path)[:32]


def converted_copy(path: Path) -> Path | None:
    """The folder of `path`'s converted copy (config, safetensors weights, tokenizer) if one is
    kept, else None."""
    folder = copy_folder(path)
    return folder if folder is not None and (folder / "complete").is_file() else None


def keep_converted(folder: Path, path: Path, model, tokenizer) -> Path | None:
    """Save a just-converted GGUF model (fp32, from `path`) and its tokenizer as `folder`
    (`copy_folder`'s): into a temporary folder renamed when complete, so that an interrupted
    save leaves nothing to load. Nothing is kept where the cache directory is not writable.
    Returns the folder, or None."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # (save_pretrained refuses a model transformers dequantized from GGUF: its config and
        # weights are written as a plain model's, shared tensors once)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").write_text(path.name + "\n", encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return folder
