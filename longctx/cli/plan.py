"""`longctx plan`: the longest context that fits a model on a GPU, per KV format."""

from __future__ import annotations

import json

import typer
from rich.console import Console

from .options import print_config, print_config_option
from .tables import show_table

GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def plan(
    model: str = typer.Option("llama-3.1-8b", "--model", help="catalog name (llama-3.1-8b, mistral-7b, qwen2.5-7b, smollm2-135m, ...), a local dir with config.json, or a hub id"),
    gpu: str = typer.Option(None, "--gpu", help="catalog GPU (rtx-4090, rtx-3060-12gb, a100-80gb, ...); default rtx-4090 unless --gpu-mem"),
    gpu_mem: str = typer.Option(None, "--gpu-mem", help="memory budget instead of --gpu: 22.5GiB, or 24GB (10^9 bytes)"),
    weights_bits: int = typer.Option(16, "--weights-bits", help="16 (bf16), 8 or 4 (bitsandbytes)"),
    kv_bits: str = typer.Option("16,8,4,2", "--kv-bits", help="KV formats to plan, from 16,8,4,2 (2 = int2 with rotation)"),
    host_mem: str = typer.Option(None, "--host-mem", help="pinned host memory for the host tier: 64GiB, or 64GB (10^9 bytes)"),
    context: str = typer.Option(None, "--context", help="with --host-mem: also the decode step predicted at this many tokens (e.g. 1024k)"),
    pcie_gbps: float = typer.Option(None, "--pcie-gbps", help="the link's pinned host-to-device GB/s for the host tier's speed (default: the card's PCIe generation)"),
    gpus: int = typer.Option(1, "--gpus", help="cards of --gpu each, the model split over them by decoder layers (chat --device-map auto)"),
    batch: int = typer.Option(1, "--batch", help="rows decoded together"),
    block_size: int = typer.Option(64, "--block-size", help="tokens per page"),
    prefill_chunk: int = typer.Option(2048, "--prefill-chunk", help="tokens per prefill forward"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    list_catalog: bool = typer.Option(False, "--list", help="list the catalog's models and GPUs and exit"),
    show_config: bool = print_config_option(),
) -> None:
    """The longest context that fits, per KV format, and the budget behind it.

    Examples:
      longctx plan --model llama-3.1-8b --gpu rtx-4090 --weights-bits 4
      longctx plan --model llama-3.1-8b --gpu rtx-4090 --weights-bits 4 --host-mem 64GiB
      longctx plan --model llama-3.1-8b --gpu rtx-3090 --gpus 2 --weights-bits 4
      longctx plan --model ./Qwen2.5-7B-Instruct --gpu rtx-3060-12gb --json
    """
    from ..config import bits_format
    from ..plan import catalog_gpus, catalog_models, gpu_memory, model_shape, offload_step_ms, parse_size_gib
    from ..plan import plan as make_plan

    if list_catalog:
        typer.echo("models: " + ", ".join(catalog_models()))
        typer.echo("gpus:   " + ", ".join(catalog_gpus()))
        return
    try:
        bits = [int(b) for b in kv_bits.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"bad --kv-bits {kv_bits!r}: use numbers from 16,8,4,2 such as 8,4") from None
    if weights_bits not in (16, 8, 4):
        raise ValueError(f"--weights-bits must be 16, 8 or 4, got {weights_bits}")
    if gpu and gpu_mem:
        raise ValueError(f"give --gpu (a catalog card, {gpu!r}) or --gpu-mem (a budget, {gpu_mem!r}), not both")
    if gpus < 1:
        raise ValueError(f"--gpus must be 1 or more, got {gpus}")
    if pcie_gbps is not None and pcie_gbps <= 0:
        raise ValueError(f"--pcie-gbps must be more than 0, got {pcie_gbps}")
    host_gib = parse_size_gib(host_mem) if host_mem else 0.0
    at = None
    if context is not None:
        from .bench import parse_sizes

        at = parse_sizes(context)[0]
        if not host_gib or at < 1:
            raise ValueError(f"--context {context} needs --host-mem and a positive number of tokens")
    shape = model_shape(model)
    label, gib = gpu_memory(gpu if gpu or gpu_mem else "rtx-4090", gpu_mem)
    if show_config:
        return print_config(details=dict(model=shape, gpu={"name": label, "memory_gib": gib}, host_gib=host_gib), gpu=gpu or (None if gpu_mem else label),
                            kv_bits=bits, context=at)
    p = make_plan(shape, label, gib, weights_bits=weights_bits, kv_bits=bits, batch=batch, block_size=block_size,
                  prefill_chunk=prefill_chunk, host_gib=host_gib, pcie=pcie_gbps, gpus=gpus)
    if as_json:
        typer.echo(json.dumps(p.as_dict(), indent=1))
        return
    console = Console()
    limit = f"{p.max_context:,}" if p.max_context else "unknown"
    cards = f"{gpus} x {label} ({gib:g} GiB each)" if gpus > 1 else f"{label} ({gib:g} GiB)"
    console.print(f"{p.model} ({p.params / 1e9:.2f}B params, {weights_bits}-bit weights) on {cards}, batch {batch}",
                  highlight=False, soft_wrap=True)
    host = ["with host tier", "host pinned", "decode step"] + ([f"step at {at:,}"] if at else []) if host_gib else []
    cols = ["KV format", "KV bytes/token", "max tokens (GPU)"] + host + [f"model limit {limit}"]
    rows = []
    for b, r in zip(bits, p.rows):
        if r.unavailable:
            rows.append([r.format, *["n/a"] * (len(cols) - 1)])
            continue
        cells = [r.format, f"{r.kv_bytes_per_token:,.0f}", f"{r.max_tokens:,}"]
        if host_gib:
            if r.max_tokens_offload is None:
                cells += ["no room", "", ""] + ([""] if at else [])
            else:
                cells += [f"{r.max_tokens_offload:,}", _gib(r.host_bytes), f"{r.offload_step_ms:,.0f} ms"]
                if at:
                    fits = at <= r.max_tokens_offload
                    cfg = bits_format(b, block_size=block_size)
                    cells.append(f"{offload_step_ms(shape, cfg, at, r.offload_max_blocks, p.pcie_gbps, batch):,.0f} ms" if fits else "does not fit")
        cells.append("fits" if r.fits_model_limit else "short")
        rows.append(cells)
    show_table("Longest context per KV format", cols, rows, left=("KV format",), console=console)
    b = p.budget
    items = [("GPU memory", _gib(b.total)), ("weights", _gib(b.weights)), ("runtime overhead (CUDA context, workspaces)", _gib(b.overhead)),
             ("fragmentation reserve (5 %)", _gib(b.reserve)), ("left for KV + activations", _gib(b.for_kv))]
    items += [(f"activations at a {min(prefill_chunk, r.max_tokens):,}-token chunk, {r.format} ({r.max_tokens:,} tokens)", _gib(r.activations))
              for r in p.rows if not r.unavailable and r.max_tokens]
    if gpus > 1:  # the budget is a card's; the weights and KV split by layers, per format
        items = items[:1] + items[2:4]
        split = [[r.format, " / ".join(map(str, r.layers_per_gpu)), " / ".join(_gib(n) for n in r.gpu_peak_bytes)]
                 for r in p.rows if not r.unavailable and r.layers_per_gpu]
        if split:
            show_table("Split by decoder layers (embeddings on the first card, LM head on the last)",
                       ("KV format", "layers a card", "each card's peak (weights + KV + activations)"), split, left=("KV format",), console=console)
    show_table("Budget" + (" of each card" if gpus > 1 else ""), ("item", "bytes"), items, left=("item",), console=console)
    available = [r for r in p.rows if not r.unavailable]
    if available and not any(r.max_tokens for r in available):
        if gpus > 1:
            why = (f"split by layers, the weights ({_gib(b.weights)} in all), each card's runtime overhead and reserve and one "
                   f"{prefill_chunk:,}-token chunk's activations take more than {gpus} cards of {gib:g} GiB")
            fix = "more cards, 4-bit weights (--weights-bits 4) or a smaller --prefill-chunk"
        elif b.for_kv <= 0:
            why = (f"the weights ({_gib(b.weights)}) with the runtime overhead and reserve ({_gib(b.overhead + b.reserve)}) "
                   f"take more than the {gib:g} GiB budget")
            fix = "4-bit weights (--weights-bits 4, bitsandbytes), a smaller model or a larger GPU" if weights_bits != 4 else \
                  "a smaller model or a larger GPU"
        else:
            why = f"the activations of one {prefill_chunk:,}-token prefill chunk take more than the {_gib(b.for_kv)} left"
            fix = "a smaller --prefill-chunk"
        console.print(f"[bold red]No context fits:[/] {why}. Try {fix}.", highlight=False)
    for r in p.rows:
        if r.unavailable:
            console.print(f"{r.format} is not available for this model: {r.unavailable}", highlight=False, markup=False)
    if any(r.max_tokens for r in available):
        console.print("[dim]To size the cache for a planned context once (no growth copies): longctx chat --max-context N, "
                      "or KVConfig(max_blocks=...) from --json.[/]")
    if host_gib:
        console.print(f"[dim]with host tier: the oldest sealed pages in {host_gib:g} GiB of pinned host memory; every decode step reads "
                      f"them across the link, predicted at {p.pcie_gbps:g} GB/s (--pcie-gbps to give yours; longctx bench offload "
                      "measures it). KVConfig(max_blocks=..., host_blocks=...) from --json; longctx chat --host-mem.[/]", highlight=False)
        for r in p.rows:
            if not r.unavailable and r.max_tokens_offload is None:
                console.print(f"{r.format}: no room for the host tier's device part (staging and a chunk's pages)", highlight=False)
