"""`longctx bench`: decode attention latency of each KV format against peer kernels (GPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console

from .options import at_least, print_config, print_config_option
from .tables import show_table

app = typer.Typer(help="Measure speed on a GPU (same-process peers, ratios to SDPA dense bf16).", no_args_is_help=True)


def _names(text: str) -> list[str]:
    """"int4, int8" -> ["int4", "int8"] (unknown names are the bench's to reject)."""
    return [f.strip() for f in text.split(",")]


def parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1024 if p.endswith("k") else 1
        try:
            out.append(int(p.rstrip("k")) * mult)
        except ValueError:
            raise ValueError(f"bad size {part!r}: use numbers like 4096 or 32k") from None
    return out


def _print_bench_config(formats: str, block_size: int = 64, shape: str = "llama-3-8b", shape_layers: int | None = None, **resolved) -> None:
    """`--print-config` of a bench: its options (`resolved` as the bench resolved them), then, as
    comments, its shape (with `shape_layers` where the bench sets its own) and the formats'
    configs as that shape resolves them (group_size filled in)."""
    from ..bench import bench_configs

    cfgs, dims = bench_configs(_names(formats), block_size, shape)
    print_config(details=dict(shape={"name": shape, **dims, **({} if shape_layers is None else {"layers": shape_layers})},
                              formats={name: cfg.resolve(dims["layers"], dims["head_dim"]) for name, cfg in cfgs.items()}),
                 formats=list(cfgs), **resolved)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"128k:1, 32k:8" -> [(131072, 1), (32768, 8)]."""
    out = []
    for part in text.split(","):
        context, sep, batch = part.partition(":")
        if not sep or not context.strip() or not batch.strip():
            raise ValueError(f"bad case {part.strip()!r}: use CONTEXT:BATCH like 128k:1")
        out.append((parse_sizes(context)[0], parse_sizes(batch)[0]))
    return out


@app.command()
def decode(
    contexts: str = typer.Option(None, help="context lengths, e.g. 4k,32k,128k (default 4k,32k,128k,512k)"),
    batch: str = typer.Option(None, help="batch sizes, e.g. 1,8; each context runs at each (default 1)"),
    cases: str = typer.Option(None, help="CONTEXT:BATCH pairs instead of --contexts x --batch, e.g. 4k:1,128k:1,512k:1,32k:8"),
    formats: str = typer.Option("int4,int8,bf16", help="longctx formats: bf16,int8,k8v4,int4,int4+rot,int2+rot (int2 for short; longctx/configs/kv.yaml)"),
    shape: str = typer.Option("llama-3-8b", help="model shape: llama-3-8b or smollm2-135m"),
    block_size: int = typer.Option(64, help="tokens per page"),
    no_peers: bool = typer.Option(False, "--no-peers", help="skip the peers (SDPA dense bf16, FlexAttention, flash-attn where it imports, dequantize-all then SDPA)"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    graph: bool = typer.Option(False, "--graph", help="time CUDA-graph replays (GPU time without launch overhead), peers too"),
    plot: Path = typer.Option(None, "--plot", help="also draw time per context to this PNG (needs matplotlib)"),
    show_config: bool = print_config_option(),
) -> None:
    """Per-layer decode attention time, effective bandwidth and ratio to SDPA dense bf16.

    Example: longctx bench decode --contexts 4k,128k --batch 1,8 --formats int4,int8 --graph
    """
    from ..bench import bench_decode, decode_cases

    if cases is not None and (contexts is not None or batch is not None):
        raise ValueError("give --cases or --contexts/--batch, not both")
    pairs = decode_cases(parse_sizes("4k,32k,128k,512k" if contexts is None else contexts), parse_sizes("1" if batch is None else batch),
                         parse_cases(cases) if cases is not None else None)
    if plot is not None:
        _need_matplotlib()
    if show_config:
        return _print_bench_config(formats, block_size, shape, contexts=None, batch=None, cases=",".join(f"{c}:{b}" for c, b in pairs))

    console = Console()

    def show(case):
        for r in case:
            timed = f"{r.ms:8.4f} ms  {r.tb_per_s:5.2f} TB/s  x{r.ratio_to_sdpa:5.2f}" if r.ms == r.ms else r.note
            console.print(f"  {r.name:34s} ctx {r.context:>7d} B{r.batch}: {timed}", highlight=False, soft_wrap=True)

    rows = bench_decode(formats=_names(formats), shape=shape, block_size=block_size, peers=not no_peers, progress=show, graph=graph, cases=pairs)
    notes = any(r.note for r in rows)  # why a row has no time (out of GPU memory, a peer that failed)
    show_table(f"Decode attention per layer ({shape}), median{', CUDA-graph replays' if graph else ''}",
               ("kernel", "context", "batch", "ms", "TB/s", "vs SDPA bf16") + (("note",) if notes else ()),
               [(r.name, f"{r.context:,}", str(r.batch), _fig(r.ms, ".4f"), _fig(r.tb_per_s, ".2f"), _fig(r.ratio_to_sdpa, ".2f", "x"),
                 *((r.note,) if notes else ())) for r in rows], left=("kernel", "note"), console=console)
    _write_json(as_json, rows)
    if plot is not None:
        from ..plots import decode_figure

        decode_figure(rows, f"Decode attention per layer ({shape}){', CUDA graphs' if graph else ''}").savefig(plot, dpi=120)


def _fig(x: float, fmt: str, unit: str = "") -> str:
    """A table cell: `x` formatted with its unit, or empty where the row has no such figure (nan)."""
    return "" if x != x else format(x, fmt) + unit


def _write_json(path: Path | None, rows) -> None:
    """The rows as JSON to `path` (when given): a value that is not a number (nan, a figure
    the row does not have) is null, so that any JSON reader takes the file."""
    if path is None:
        return

    def clean(d: dict) -> dict:
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}

    path.write_text(json.dumps([clean(r.as_dict()) for r in rows], indent=1, allow_nan=False))


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None


@app.command()
def prefill(
    contexts: str = typer.Option("32k,128k", help="tokens in the cache after the measured chunk"),
    chunks: str = typer.Option("512,16k", help="prefill chunk lengths (tokens), comma-separated"),
    formats: str = typer.Option("int4,int8", help="longctx formats"),
    paths: str = typer.Option("kernel,staged", help="prefill paths: kernel (pages read in place), staged (dense past + SDPA)"),
    shape: str = typer.Option("llama-3-8b", help="model shape: llama-3-8b or smollm2-135m"),
    block_size: int = typer.Option(64, help="tokens per page"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    show_config: bool = print_config_option(),
) -> None:
    """Per-layer time of a prompt's last prefill chunk, by each path (sealing included) vs SDPA (flash) over dense bf16.

    Example: longctx bench prefill --contexts 32k,128k --chunks 512,16k
    """
    from ..bench import bench_prefill

    if show_config:
        return _print_bench_config(formats, block_size, shape, contexts=parse_sizes(contexts), chunks=parse_sizes(chunks), paths=_names(paths))
    rows = bench_prefill(parse_sizes(contexts), parse_sizes(chunks), _names(formats), shape, block_size, paths=_names(paths))
    show_table(f"Prefill chunk per layer ({shape}), median", ("kernel", "context", "chunk", "ms", "tokens/s", "vs SDPA bf16"),
               [(r.name, f"{r.context:,}", f"{r.chunk:,}", f"{r.ms:.3f}", f"{r.tok_per_s:,.0f}", f"{r.ratio_to_sdpa:.2f}x") for r in rows],
               left=("kernel",))
    _write_json(as_json, rows)


@app.command()
def seal(
    context: str = typer.Option("128k", help="tokens in the cache"),
    formats: str = typer.Option("int4", help="longctx formats"),
    shape: str = typer.Option("llama-3-8b", help="model shape: llama-3-8b or smollm2-135m"),
    layers: int = typer.Option(None, help="layers a step runs (default: the shape's, 32 for llama-3-8b); 1 charges a seal's per-step host work to one layer"),
    block_size: int = typer.Option(64, help="tokens per page"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    show_config: bool = print_config_option(),
) -> None:
    """What sealing adds to a decode step (append one token and attend in every layer of a real
    cache, one seal of every layer every block_size steps), and what appending adds to attention.

    Steps are timed one by one on the GPU timeline (median steps; the sealing steps' mean).
    "sealing adds" is the sealing step's excess over the median step spread over the
    block_size steps between seals. The model's projections and MLP are left out, so it is an
    upper bound of sealing's share of a whole model's step (`bench e2e` measures that).

    Example: longctx bench seal --context 128k --formats int4,int8
    """
    from ..bench import SHAPES, bench_seal

    if show_config:
        return _print_bench_config(formats, block_size, shape, context=parse_sizes(context)[0],
                                   layers=SHAPES[shape]["layers"] if layers is None and shape in SHAPES else layers)
    rows = bench_seal(parse_sizes(context)[0], _names(formats), shape, block_size=block_size, layers=layers)
    L = rows[0].layers if rows else layers
    show_table(f"Decode step ({shape}, {L} layers): append + attend, with one seal every {block_size} steps",
               ("format", "context", "attend ms", "step ms (no seal)", "sealing step ms", "sealing adds", "appending adds"),
               [(r.name, f"{r.context:,}", f"{r.attend_ms:.4f}", f"{r.step_ms:.4f}", f"{r.sealing_step_ms:.4f}", f"{r.overhead_pct:+.1f} %",
                 f"{r.append_pct:+.1f} %") for r in rows], left=("format",))
    _write_json(as_json, rows)


@app.command()
def e2e(
    context: str = typer.Option("128k", help="prompt length"),
    formats: str = typer.Option("int4,int8", help="longctx formats"),
    new_tokens: int = typer.Option(64, help="tokens decoded and timed after the prompt (after 2 untimed warm-up steps)"),
    chunk: int = typer.Option(16384, help="prefill chunk (tokens)"),
    layers: int = typer.Option(32, help="decoder layers of the Llama-3-8B-shaped model"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="also time LongCtxCache's decode from CUDA graphs (a row each)"),
    compiled: bool = typer.Option(True, "--compiled/--no-compiled",
                                  help="also time StaticCache + torch.compile(mode='reduce-overhead'), the strongest stock decode (compiles ~1 min)"),
    device_map: str = typer.Option(None, "--device-map", help="auto: LongCtxCache on one GPU against the model split over every visible GPU"),
    show_config: bool = print_config_option(),
) -> None:
    """End to end, random-initialized Llama-3-8B-shaped model: DynamicCache + SDPA vs LongCtxCache.

    Prefill in chunks, then greedy decode; bf16 weights, batch 1. For LongCtxCache, "sealing
    step +ms" is what the step that seals every layer's full tail takes over the median step
    (GPU timeline), and "sealing adds" that excess spread over the block_size steps between
    seals, in % of the median step; for the CUDA-graph row, a step that records a new graph
    counts as sealing too (graphs outlive seals; they are recorded anew when the graph table is
    full or the pools grow). "StaticCache + torch.compile" is transformers' static cache
    with the decode step compiled into CUDA graphs; "compile s" is its untimed warm-up.

    With --device-map auto: each format on one GPU, then on the model split over every visible
    GPU by decoder layers (as `longctx plan --gpus` splits it); the split rows' ratios are
    against the one-GPU eager row, and their note gives each card's peak and whether the greedy
    tokens equal the one-GPU run's. A split model decodes eagerly (no CUDA-graph row).

    Example: longctx bench e2e --context 128k --formats int4
    """
    from ..bench import bench_e2e

    if device_map not in (None, "auto"):
        raise ValueError(f"--device-map must be auto, got {device_map!r}")
    if show_config:
        return _print_bench_config(formats, shape_layers=layers, context=parse_sizes(context)[0])
    console = Console()

    def show(r):
        figures = f"prefill {r.prefill_s:.1f} s, decode {r.decode_ms_per_token:.1f} ms/token" if not r.note else r.note
        console.print(f"  {r.name}: {figures}, peak {r.peak_gib:.1f} GiB", highlight=False, soft_wrap=True)

    rows = bench_e2e(parse_sizes(context)[0], _names(formats), new_tokens, chunk, layers, graphs=graphs, compiled=compiled, progress=show,
                     device_map=device_map)
    notes = any(r.note for r in rows)  # a cache that ran out of GPU memory, and where
    base = "one GPU's eager" if device_map else "Dynamic"
    show_table(f"End to end, Llama-3-8B shape, {layers} layers, bf16 weights, batch 1",
               ("cache", "context", "prefill s", "decode ms/token", "decode tok/s", "peak GiB", f"decode vs {base}", f"prefill vs {base}",
                "sealing step +ms", "sealing adds", "compile s") + (("note",) if notes else ()),
               [(r.name, f"{r.context:,}", _fig(r.prefill_s, ".1f"), _fig(r.decode_ms_per_token, ".1f"), _fig(1e3 / r.decode_ms_per_token, ".1f"),
                 f"{r.peak_gib:.1f}", _fig(r.ratio_decode, ".2f", "x"), _fig(r.ratio_prefill, ".2f", "x"), _fig(r.seal_extra_ms, "+.2f"),
                 _fig(r.seal_pct, "+.2f", " %"), _fig(r.compile_s, ".0f"), *((r.note,) if notes else ())) for r in rows],
               left=("cache", "note"), console=console)
    _write_json(as_json, rows)


@app.command("plan")
def plan_check(
    model: str = typer.Option("llama-3.1-8b", help="a catalog model (longctx plan's); a random model of its shape is measured"),
    kv_format: str = typer.Option("int4", "--format", help="KV format: bf16, int8, int4 or int2+rot (plan's, blocks of 64 tokens)"),
    weights_bits: int = typer.Option(16, help="16 (bf16) or 4 (bitsandbytes NF4, needs bitsandbytes)"),
    budget_gib: float = typer.Option(None, help="GPU memory to plan for and cap the process at, GiB (default: the whole GPU)"),
    chunk: int = typer.Option(2048, help="prefill chunk (tokens), as plan assumes"),
    decode: int = typer.Option(8, help="tokens decoded after the prompt"),
    max_tokens: int = typer.Option(None, help="prefill at most this many tokens (a shorter run; plan's prediction follows)"),
    gpus: int = typer.Option(1, "--gpus", help="split the model over this many GPUs by plan's layers a card, each capped at the budget"),
    as_json: Path = typer.Option(None, "--json", help="also write the row as JSON to this file"),
    show_config: bool = print_config_option(),
) -> None:
    """`longctx plan` against a measured peak on this GPU: the context plan says fits the budget,
    prefilled and decoded through a random model of the catalog model's shape, the process
    capped at the budget; plan's weights + KV + activations beside the allocator's peak. With
    --gpus N, the model split over N cards as `plan --gpus N` splits it, each card's peak beside
    its prediction.

    Example: longctx bench plan --weights-bits 4 --budget-gib 24
             longctx bench plan --weights-bits 4 --budget-gib 24 --gpus 2
    """
    from ..bench.plan import bench_plan, check_plan_options

    check_plan_options(kv_format, weights_bits, budget_gib, chunk, decode, max_tokens, gpus)
    if show_config:
        return print_config()
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("prefill", total=None)
        r = bench_plan(model, kv_format, weights_bits, budget_gib, chunk, decode, max_tokens,
                       progress=lambda done, total: bar.update(task, completed=done, total=total), gpus=gpus)
    show_table(f"plan against the measured peak: {r.model}, {r.weights_bits}-bit weights, {r.format} KV, {r.budget_gib:.1f} GiB",
               ("tokens", "planned tokens", "predicted GiB", "peak GiB", "peak / predicted", "weights GiB (plan / measured)", "seconds", "note"),
               [(f"{r.tokens:,}", f"{r.planned_tokens:,}", f"{r.predicted_gib:.2f}", f"{r.peak_gib:.2f}", f"{r.peak_over_predicted:.3f}",
                 f"{r.weights_predicted_gib:.2f} / {r.weights_measured_gib:.2f}", f"{r.seconds:.0f}", r.note or "fits")], left=("note",))
    if r.gpus > 1:
        show_table(f"each card ({r.budget_gib:.1f} GiB)", ("card", "layers", "predicted GiB", "peak GiB", "peak / predicted"),
                   [(f"cuda:{d}", str(n), f"{p:.2f}", f"{m:.2f}", f"{m / p:.3f}")
                    for d, (n, p, m) in enumerate(zip(r.layers_per_gpu, r.predicted_by_gpu_gib, r.peak_by_gpu_gib))])
    _write_json(as_json, [r])


@app.command()
def offload(
    model: str = typer.Option("llama-3.1-8b", help="a catalog model (longctx plan's); a random model of its shape is measured"),
    contexts: str = typer.Option("256k,512k,1024k", help="contexts of the host-tier rows"),
    formats: str = typer.Option("int4,int2+rot", help="KV formats: int4, int2+rot, int8, bf16 (plan's, blocks of 64 tokens)"),
    weights_bits: int = typer.Option(4, help="4 (bitsandbytes NF4) or 16 (bf16)"),
    budget: str = typer.Option("24GiB", help="GPU memory the process may use: 24GiB, 16GiB, or 24GB (10^9 bytes)"),
    peer_contexts: str = typer.Option("128k,256k", help="contexts of transformers' offloaded cache's rows (ours beside them)"),
    steps: int = typer.Option(8, help="timed decode steps a row (after two untimed)"),
    full_gpu: bool = typer.Option(True, "--full-gpu/--no-full-gpu", help="also each format with no budget, all on the GPU"),
    prefill: str = typer.Option(None, "--prefill", help="instead: a real prefill of this many tokens (e.g. 384k) under the budget "
                                "against the same with no budget, the first format, then 64 greedy tokens compared"),
    chunk: int = typer.Option(8192, help="prefill chunk (tokens), with --prefill"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    show_config: bool = print_config_option(),
) -> None:
    """Decode with a cache larger than the GPU budget: the host tier against the same cache all on
    the GPU, transformers' DynamicCache(offloading=True) and the PCIe floor (host bytes a step
    over the pinned host-to-device bandwidth measured in the same run). The caches are filled
    with random keys and values appended directly (no prefill), then decoded through the model.

    Examples:
      longctx bench offload --budget 24GiB --contexts 256k,512k,1024k
      longctx bench offload --prefill 384k --budget 16GiB --formats int4
    """
    from ..bench.offload import bench_offload, bench_offload_prefill, check_offload_options
    from ..plan import parse_size_gib

    ctx, peers, fmts = parse_sizes(contexts), parse_sizes(peer_contexts), _names(formats)
    budget_gib = parse_size_gib(budget)
    check_offload_options(fmts, ctx, peers, weights_bits, budget_gib, steps)
    at_least(chunk, 1, "--chunk")
    prefill_tokens = parse_sizes(prefill)[0] if prefill is not None else None
    if show_config:
        return print_config(details={"budget_gib": budget_gib}, contexts=ctx, formats=fmts, peer_contexts=peers, prefill=prefill_tokens)
    console = Console()
    weights = "NF4" if weights_bits == 4 else "bf16"
    if prefill_tokens is not None:
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("prefill", total=prefill_tokens)
            rows = bench_offload_prefill(model, prefill_tokens, fmts[0], weights_bits, budget_gib, chunk,
                                         progress=lambda done, total: bar.update(task, completed=done, total=total))
        show_table(f"Prefill past the GPU: {model} shape, {weights} weights, chunks of {chunk:,}, then 64 greedy tokens",
                   ("cache", "context", "prefill s", "x uncapped", "peak GiB", "budget GiB", "host GiB", "greedy tokens equal", "note"),
                   [(r.name, f"{r.context:,}", _fig(r.prefill_s, ".1f"), _fig(r.ratio, ".3f", "x"), f"{r.peak_gib:.2f}", _fig(r.budget_gib, "g"),
                     f"{r.host_gib:.2f}", "" if r.same_tokens < 0 else f"{r.same_tokens} of 64", r.note) for r in rows],
                   left=("cache", "note"), console=console)
        return _write_json(as_json, rows)

    def show(r) -> None:
        figures = f"{r.step_ms:,.1f} ms a step" if r.step_ms == r.step_ms else r.note
        console.print(f"  {r.context:,}: {r.name}: {figures}", highlight=False, soft_wrap=True)

    rows = bench_offload(model, ctx, fmts, weights_bits, budget_gib, peers, steps, full_gpu, progress=show)
    show_table(f"Decode past the GPU: {model} shape, {weights} weights, {budget_gib:g} GiB budget for the host-tier rows",
               ("cache", "context", "ms a step", "tok/s", "host GiB a step", "x PCIe floor", "x faster than transformers offloaded",
                "plan's step ms", "peak GiB", "fill s", "host part on the CPU, ms a step", "note"),
               [(r.name, f"{r.context:,}", _fig(r.step_ms, ",.1f"), _fig(1e3 / r.step_ms, ".2f"), f"{r.host_gib:.2f}" if r.host_gib else "",
                 _fig(r.over_floor, ".3f", "x"), _fig(r.speedup, ".1f", "x"), _fig(r.plan_ms, ",.1f"), _fig(r.peak_gib, ".1f"), _fig(r.fill_s, ".0f"),
                 _fig(r.cpu_ms, ",.0f"), r.note) for r in rows], left=("cache", "note"), console=console)
    _write_json(as_json, rows)


@app.command()
def disk(
    contexts: str = typer.Option("128k,424k", help="tokens prefilled, saved and loaded"),
    formats: str = typer.Option("int4", help="KV formats: bf16, int8, int4, int2+rot (plan's, blocks of 64 tokens)"),
    model: str = typer.Option("llama-3.1-8b", help="a catalog model (longctx plan's); a random bf16 model of its shape is measured"),
    chunk: int = typer.Option(8192, help="prefill chunk (tokens)"),
    decode: int = typer.Option(16, help="greedy tokens decoded from the saved and from the loaded cache, compared"),
    directory: Path = typer.Option(None, "--dir", help="where the files go (default: the temporary directory); each is deleted after its row"),
    as_json: Path = typer.Option(None, "--json", help="also write the rows as JSON to this file"),
    show_config: bool = print_config_option(),
) -> None:
    """Load a saved cache against prefilling its tokens again: prefill, save and load seconds, the
    file's bytes against memory_report()'s, and the greedy tokens both caches decode.

    Example: longctx bench disk --contexts 128k,424k --formats int4
    """
    from ..bench.disk import bench_disk

    ctx, fmts = parse_sizes(contexts), _names(formats)
    at_least(chunk, 1, "--chunk")
    at_least(decode, 1, "--decode")
    if directory is not None and not directory.is_dir():
        raise ValueError(f"--dir {directory} is not a directory")
    if show_config:
        return print_config(contexts=ctx, formats=fmts)
    console = Console()

    def show(r) -> None:
        console.print(f"  {r.context:,} {r.format}: prefill {r.prefill_s:.1f} s, load {r.load_s:.2f} s ({r.load_speedup:.1f}x)",
                      highlight=False, soft_wrap=True)

    rows = bench_disk(ctx, fmts, model, chunk, decode, directory, progress=show)
    show_table(f"A saved cache against prefilling again: {model} shape, bf16 weights, chunks of {chunk:,}",
               ("format", "context", "prefill s", "save s", "load s", "load vs prefill", "file GiB", "file / memory_report", "greedy tokens equal"),
               [(r.format, f"{r.context:,}", f"{r.prefill_s:.1f}", f"{r.save_s:.1f}", f"{r.load_s:.2f}", f"{r.load_speedup:.1f}x faster",
                 f"{r.file_bytes / 2**30:.2f}", f"{r.bytes_ratio:.4f}", f"{r.same_tokens} of {r.decoded}") for r in rows],
               left=("format",), console=console)
    _write_json(as_json, rows)
