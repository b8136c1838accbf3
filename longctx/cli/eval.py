"""`longctx eval`: quality of KV formats on a real model (perplexity, passkey retrieval)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..config import kv_preset, kv_preset_names
from .options import print_config, print_config_option

app = typer.Typer(help="Measure the quality of KV formats on a model.", no_args_is_help=True)

FORMATS = kv_preset_names()  # longctx/configs/kv.yaml


def _formats(names: str):
    return [(name, kv_preset(name)) for name in [n.strip() for n in names.split(",") if n.strip()]]


@app.command()
def quality(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    formats: str = typer.Option("int8,int4,int4+rot,int2+rot", help=f"comma-separated, from: {', '.join(FORMATS)}"),
    text: Path = typer.Option(None, "--text", help="UTF-8 text file (default: the English text shipped with longctx)"),
    chunk: int = typer.Option(128, help="tokens fed per forward; earlier chunks are read back from the cache"),
    quanto: bool = typer.Option(False, "--quanto", help="also measure Hugging Face's QuantizedCache (quanto int4; needs optimum-quanto)"),
    device: str = typer.Option(None, help="cpu or cuda (default: cuda when available)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    show_config: bool = print_config_option(),
) -> None:
    """Perplexity change of each KV format against an exact DynamicCache.

    Example: longctx eval quality --formats int8,int4 --quanto
    """
    from ..eval import perplexity, quanto_cache
    from ..models import load_model

    kv_specs = _formats(formats)
    specs = kv_specs + ([("HF quanto int4", quanto_cache(4))] if quanto else [])  # (checks optimum-quanto first)
    if text is not None and not text.is_file():
        raise FileNotFoundError(f"no text file at {text}")
    if show_config:  # group_size null: the model's head_dim sets it when the cache is built
        return print_config(eval="quality", model=model or "embedded SmolLM2-135M-Instruct", formats=dict(kv_specs),
                            text=text, chunk=chunk, quanto=quanto, device=device)
    body = text.read_text(encoding="utf-8") if text else None
    console = Console(stderr=True)
    with console.status("loading model..."):
        mdl, tok = load_model(model, device=device)
    runs = [("exact (DynamicCache)", None)] + specs
    results = []
    for name, spec in runs:
        with console.status(f"perplexity: {name}..."):
            results.append((name, perplexity(mdl, tok, body, kv=spec, chunk=chunk)))
    base = results[0][1]
    if as_json:
        rows = [dict(format=n, ppl=r.ppl, delta_pct=r.delta_pct(base), tokens=r.tokens, chunk=r.chunk, seconds=r.seconds,
                     bytes_per_token=r.bytes_per_token, ratio_to_bf16=r.ratio_to_bf16) for n, r in results]
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"Perplexity, {base.tokens} tokens fed in chunks of {chunk}")
    for col in ("format", "perplexity", "change", "bytes/token vs bf16", "seconds"):
        table.add_column(col, justify="left" if col == "format" else "right")
    for name, r in results:
        ratio = f"{r.ratio_to_bf16:.3f}" if r.ratio_to_bf16 is not None else "-"
        table.add_row(name, f"{r.ppl:.4f}", f"{r.delta_pct(base):+.3f} %", ratio, f"{r.seconds:.1f}")
    Console().print(table)


@app.command("passkey")
def passkey_cmd(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    formats: str = typer.Option("int4", help=f"comma-separated, from: {', '.join(FORMATS)}"),
    tokens: int = typer.Option(3600, help="prompt length in tokens"),
    depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="where the key is hidden, as fractions"),
    device: str = typer.Option(None, help="cpu or cuda (default: cuda when available)"),
    show_config: bool = print_config_option(),
) -> None:
    """Hide a 5-digit key in filler text; does each format still retrieve it?

    Example: longctx eval passkey --formats int4,int2+rot --tokens 3600
    """
    from ..eval import passkey
    from ..models import load_model

    specs = _formats(formats)
    try:
        ds = tuple(float(d) for d in depths.split(","))
    except ValueError:
        raise ValueError(f"--depths must be comma-separated numbers, got {depths!r}") from None
    if not all(0.0 <= d <= 1.0 for d in ds):
        raise ValueError(f"--depths must lie in [0, 1], got {depths!r}")
    if show_config:
        return print_config(eval="passkey", model=model or "embedded SmolLM2-135M-Instruct", formats=dict(specs), tokens=tokens, depths=ds,
                            device=device)
    console = Console(stderr=True)
    with console.status("loading model..."):
        mdl, tok = load_model(model, device=device)
    table = Table(title=f"Passkey retrieval, ~{tokens} tokens")
    table.add_column("format")
    for d in ds:
        table.add_column(f"depth {d:.1f}", justify="center")
    for name, spec in [("exact (DynamicCache)", None)] + specs:
        with console.status(f"passkey: {name}..."):
            res = passkey(mdl, tok, kv=spec, depths=ds, n_tokens=tokens)
        table.add_row(name, *[("[green]found[/]" if r.found else f"[red]{r.answer[:12]!r}[/]") for r in res])
    Console().print(table)
