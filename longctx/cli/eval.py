"""`longctx eval`: quality of KV formats on a real model (perplexity, KL divergence, top-1
agreement, passkey retrieval)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import kv_preset, kv_preset_names
from .options import at_least, print_config, print_config_option, read_text_file
from .tables import show_table

app = typer.Typer(help="Measure the quality of KV formats on a model.", no_args_is_help=True)

FORMATS = kv_preset_names()  # longctx/configs/kv.yaml


def _formats(names: str):
    return [(name, kv_preset(name)) for name in [n.strip() for n in names.split(",") if n.strip()]]


def _depths(text: str) -> tuple[float, ...]:
    """"0.1,0.5" -> (0.1, 0.5): where a key is hidden, as fractions in [0, 1]."""
    try:
        ds = tuple(float(d) for d in text.split(","))
    except ValueError:
        raise ValueError(f"--depths must be comma-separated numbers, got {text!r}") from None
    if not all(0.0 <= d <= 1.0 for d in ds):
        raise ValueError(f"--depths must lie in [0, 1], got {text!r}")
    return ds


@app.command()
def quality(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    formats: str = typer.Option("int8,int4,int4+rot,int2+rot", help=f"comma-separated, from: {', '.join(FORMATS)}"),
    text: Path = typer.Option(None, "--text", help="UTF-8 text file (default: the English text shipped with longctx)"),
    chunk: int = typer.Option(128, help="tokens fed per forward; earlier chunks are read back from the cache"),
    mode: str = typer.Option("both", help="chunked (the text in chunks, every token scored), decode (its last --decode-tokens "
                             "fed one a step) or both"),
    decode_tokens: int = typer.Option(256, "--decode-tokens", help="tokens scored one a step in decode mode"),
    quanto: bool = typer.Option(False, "--quanto/--no-quanto", help="also measure Hugging Face's QuantizedCache (quanto int4; needs optimum-quanto)"),
    plot: Path = typer.Option(None, "--plot", help="also draw perplexity change and mean KL per format and mode to this PNG (needs matplotlib)"),
    device: str = typer.Option(None, help="cpu or cuda (default: cuda when available)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    markdown: bool = typer.Option(False, "--markdown", help="print the table as GitHub Markdown (README's quality table)"),
    show_config: bool = print_config_option(),
) -> None:
    """Perplexity change, KL divergence from the exact cache (DynamicCache, run once beside the
    formats) and top-1 agreement of each KV format, in chunked and decode mode.

    Example: longctx eval quality --formats int8,int4 --mode decode --quanto
    """
    from ..eval import MODES, default_text, quality as measure, quanto_cache
    from ..models import load_model

    kv_specs = _formats(formats)
    specs = kv_specs + ([("HF quanto int4", quanto_cache(4))] if quanto else [])  # (checks optimum-quanto first)
    body = read_text_file(text, "--text") if text is not None else None
    at_least(chunk, 1, "--chunk")
    at_least(decode_tokens, 1, "--decode-tokens")
    if mode not in (*MODES, "both"):
        raise ValueError(f"--mode must be chunked, decode or both, got {mode!r}")
    if as_json and markdown:
        raise ValueError("give --json or --markdown, not both")
    modes = MODES if mode == "both" else (mode,)
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")
    if show_config:  # group_size null: the model's head_dim sets it when the cache is built
        return print_config(details={"formats": dict(kv_specs)}, formats=[name for name, _ in kv_specs])
    console = Console(stderr=True)
    with console.status("loading model..."):
        mdl, tok = load_model(model, device=device)
    n = len(tok(body if body is not None else default_text()).input_ids)
    if body is not None and n <= chunk:
        raise ValueError(f"--text is {n} tokens, within one chunk of {chunk}: no chunk would read the cache back, so every format "
                         "would score as the exact cache. Use a longer text or a smaller --chunk")
    if "decode" in modes and n < decode_tokens + 2:
        raise ValueError(f"the text is {n} tokens; decode mode scores its last --decode-tokens {decode_tokens} one a step after at "
                         f"least one other, so it needs {decode_tokens + 2}: use a longer text, fewer --decode-tokens or --mode chunked")
    results = []
    with Progress(TextColumn("{task.fields[run]}"), BarColumn(), MofNCompleteColumn(), TextColumn("forwards"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        for m in modes:
            task = bar.add_task("quality", total=None, run=f"{m} mode, {len(specs) + 1} caches")
            results += measure(mdl, tok, specs, body, mode=m, chunk=chunk, decode_tokens=decode_tokens,
                               on_progress=lambda done, total, task=task: bar.update(task, completed=done, total=total))
            bar.remove_task(task)
    base = {r.mode: r for r in results if r.name.startswith("exact")}
    if plot is not None:
        from ..plots import quality_figure

        quality_figure(results).savefig(plot, dpi=120)
    if as_json:
        rows = [dict(format=r.name, mode=r.mode, ppl=r.ppl, delta_pct=r.delta_pct(base[r.mode]), kl_mean=r.kl_mean, kl_p99=r.kl_p99,
                     kl_max=r.kl_max, top1=r.top1, scored=r.scored, tokens=r.tokens, chunk=r.chunk, seconds=r.seconds,
                     bytes_per_token=r.bytes_per_token, ratio_to_bf16=r.ratio_to_bf16) for r in results]
        typer.echo(json.dumps(rows, indent=2))
        return
    r0 = results[0]
    how = " and ".join(f"{m} ({base[m].scored:,} tokens scored)" for m in modes)
    if markdown:
        typer.echo(f"{r0.tokens:,} tokens, chunks of {chunk}: {how}.\n")
        typer.echo("| format | mode | perplexity | change | KL mean | KL p99 | top-1 agreement | bytes/token vs bf16 |\n|---|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            exact = r.name.startswith("exact")
            typer.echo(f"| {r.name} | {r.mode} | {r.ppl:.3f} | {'' if exact else f'{r.delta_pct(base[r.mode]):+.2f} %'} | "
                       f"{'' if exact else f'{r.kl_mean:.4f}'} | {'' if exact else f'{r.kl_p99:.3f}'} | {'' if exact else f'{100 * r.top1:.1f} %'} | "
                       f"{f'{r.ratio_to_bf16:.3f}' if r.ratio_to_bf16 is not None else ''} |")
        return
    show_table(f"Quality against the exact cache, {r0.tokens:,} tokens, chunks of {chunk}: {how}",
               ("format", "mode", "perplexity", "change", "KL mean", "KL p99", "KL max", "top-1 agree", "bytes/token vs bf16", "seconds"),
               [(r.name, r.mode, f"{r.ppl:.4f}", f"{r.delta_pct(base[r.mode]):+.3f} %", f"{r.kl_mean:.5f}", f"{r.kl_p99:.4f}", f"{r.kl_max:.4f}",
                 f"{100 * r.top1:.2f} %", f"{r.ratio_to_bf16:.3f}" if r.ratio_to_bf16 is not None else "-", f"{r.seconds:.1f}")
                for r in results], left=("format", "mode"))


@app.command("passkey")
def passkey_cmd(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    formats: str = typer.Option("int4", help=f"comma-separated, from: {', '.join(FORMATS)}"),
    tokens: int = typer.Option(3600, help="prompt length in tokens"),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="where the key is hidden, as fractions"),
    device: str = typer.Option(None, help="cpu or cuda (default: cuda when available)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    show_config: bool = print_config_option(),
) -> None:
    """Hide a 5-digit key in filler text; does each format still retrieve it?

    Example: longctx eval passkey --formats int4,int2+rot --tokens 3600
    """
    from ..eval import passkey, passkey_prompt
    from ..models import load_model

    specs = _formats(formats)
    ds = _depths(depths)
    at_least(tokens, 1, "--tokens")
    if show_config:
        return print_config(details={"formats": dict(specs)}, formats=[name for name, _ in specs], depths=list(ds))
    console = Console(stderr=True)
    with console.status("loading model..."):
        mdl, tok = load_model(model, device=device)
    prompt_tokens = passkey_prompt(tok, tokens, 0.5, "00000").shape[1]  # (refuses a length too short for a prompt)
    trained = getattr(getattr(mdl, "config", None), "max_position_embeddings", None)
    if trained and prompt_tokens > trained:
        console.print(f"[yellow]warning:[/] the prompts are ~{prompt_tokens:,} tokens, past the model's trained context "
                      f"({trained:,} positions): expect misses for every format, the exact cache's too", highlight=False)
    runs = [("exact (DynamicCache)", None)] + specs
    results = []
    with Progress(TextColumn("passkey {task.fields[run]}"), BarColumn(), MofNCompleteColumn(), TextColumn("depths"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("passkey", total=len(runs) * len(ds), run=runs[0][0])
        for name, spec in runs:
            bar.update(task, run=name)
            results.append((name, passkey(mdl, tok, kv=spec, depths=ds, n_tokens=tokens, on_result=lambda _: bar.advance(task))))
    if as_json:
        typer.echo(json.dumps([dict(format=name, depth=r.depth, key=r.key, answer=r.answer, found=r.found, prompt_tokens=r.prompt_tokens)
                               for name, res in results for r in res], indent=2))
        return
    lengths = sorted({r.prompt_tokens for _, res in results for r in res})
    span = f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}-{lengths[-1]:,}"
    show_table(f"Passkey retrieval, prompts of {span} tokens", ["format"] + [f"depth {d:.1f}" for d in ds],
               [[name] + [("[green]found[/]" if r.found else f"[red]{r.answer[:12]!r}[/]") for r in res] for name, res in results],
               left=("format",))


@app.command("needle")
def needle_cmd(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    formats: str = typer.Option("int4,int2+rot", help=f"comma-separated, from: {', '.join(FORMATS)}"),
    lengths: str = typer.Option("1k,2k,4k", help="prompt lengths in tokens, e.g. 1k,4k,16k (up to the model's context)"),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="where the key is hidden, as fractions"),
    plot: Path = typer.Option(None, "--plot", help="also draw the maps as a heatmap PNG (needs matplotlib)"),
    device: str = typer.Option(None, help="cpu or cuda (default: cuda when available)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    show_config: bool = print_config_option(),
) -> None:
    """A needle map per format: a 5-digit key hidden at each depth of prompts of each length
    (the exact cache's map first); each cell is `eval passkey`'s run at that length and depth.

    Example: longctx eval needle --formats int4,int2+rot --lengths 1k,2k,4k,8k --plot needle.png
    """
    from ..eval import needle, passkey_prompt
    from ..models import load_model
    from .bench import parse_sizes

    specs = _formats(formats)
    ns = parse_sizes(lengths)
    ds = _depths(depths)
    for n in ns:
        at_least(n, 1, "--lengths")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")
    if show_config:
        return print_config(details={"formats": dict(specs)}, formats=[name for name, _ in specs], lengths=ns, depths=list(ds))
    console = Console(stderr=True)
    with console.status("loading model..."):
        mdl, tok = load_model(model, device=device)
    for n in ns:
        passkey_prompt(tok, n, 0.5, "00000")  # (refuses a length too short for a prompt, before any run)
    trained = getattr(getattr(mdl, "config", None), "max_position_embeddings", None)
    if trained and max(ns) > trained:
        console.print(f"[yellow]warning:[/] prompts of up to {max(ns):,} tokens pass the model's trained context ({trained:,} positions): "
                      "expect misses for every format, the exact cache's too", highlight=False)
    runs = [("exact (DynamicCache)", None)] + specs
    grids = []
    with Progress(TextColumn("needle {task.fields[run]}"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("needle", total=len(runs) * len(ns) * len(ds), run=runs[0][0])
        for name, spec in runs:
            bar.update(task, run=name)
            grid = needle(mdl, tok, spec, lengths=ns, depths=ds, on_result=lambda _: bar.advance(task))
            grid.name = name
            grids.append(grid)
    if plot is not None:
        from ..plots import needle_figure

        needle_figure(grids).savefig(plot, dpi=120)
    if as_json:
        typer.echo(json.dumps([dict(format=g.name, accuracy=g.accuracy, lengths=g.lengths, depths=g.depths,
                                    found=[[r.found for r in row] for row in g.results],
                                    answers=[[r.answer for r in row] for row in g.results],
                                    prompt_tokens=[[r.prompt_tokens for r in row] for row in g.results]) for g in grids], indent=2))
        return
    for g in grids:
        show_table(f"Needle map, {g.name}: {100 * g.accuracy:.0f} % found", ["length"] + [f"depth {d:.1f}" for d in ds],
                   [[f"{n:,}"] + [("[green]found[/]" if r.found else f"[red]{r.answer[:12]!r}[/]") for r in row] for n, row in zip(ns, g.results)],
                   left=("length",))
