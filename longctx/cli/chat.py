"""`longctx chat`: chat with a model over a paged, quantized KV cache."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .options import at_least, print_config, print_config_option, read_text_file

HELP = ("Commands: /stats (cache and speed), /reset (forget the conversation), /save\u00a0FILE (transcript as Markdown), "
        "/save-kv\u00a0FILE (the cache and conversation, for --load-kv), /help, /exit. Ctrl-C stops the current answer.")


def _stats_table(session) -> Table:
    t = Table(title="Cache and speed", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    report = session.cache.memory_report()
    t.add_row("tokens", f"{report.tokens:,}")
    t.add_row("blocks (sink / quantized / 16-bit)", f"{report.blocks['sink']} / {report.blocks['quantized']} / {report.blocks['dense']}")
    for kind, n in report.bytes_by_kind.items():
        t.add_row(f"bytes: {kind}", f"{n:,}")
    for tier, n in report.bytes_by_tier.items():
        t.add_row(f"bytes on {report.device if tier == 'device' else tier}", f"{n:,}")
    t.add_row("bytes/token (vs bf16)", f"{report.bytes_per_token:,.0f} ({report.ratio_to_bf16:.3f}x)" if report.tokens else "-")
    s = session.last
    t.add_row("last turn prefill", f"{s.prompt_tokens} tokens, {s.prefill_tok_s:,.1f} tok/s")
    t.add_row("last turn decode", f"{s.new_tokens} tokens, {s.decode_tok_s:,.1f} tok/s")
    return t


def chat(
    model: str = typer.Option(None, "--model", help="hub id, local dir or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    kv_bits: int = typer.Option(4, "--kv-bits", help="16, 8, 4 or 2: the formats bf16, int8, int4, int2+rot (longctx/configs/kv.yaml)"),
    k_bits: int = typer.Option(None, "--k-bits", help="override the bits of keys"),
    v_bits: int = typer.Option(None, "--v-bits", help="override the bits of values"),
    rotate: bool = typer.Option(None, "--rotate/--no-rotate", help="Hadamard rotation (default: the format's; int2+rot rotates)"),
    block_size: int = typer.Option(None, "--block-size", help="tokens per page (default: the format's, 64)"),
    load_in_4bit: bool = typer.Option(False, "--load-in-4bit/--no-load-in-4bit", help="bitsandbytes 4-bit weights (CUDA)"),
    load_in_8bit: bool = typer.Option(False, "--load-in-8bit/--no-load-in-8bit", help="bitsandbytes 8-bit weights (CUDA)"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    device_map: str = typer.Option(None, "--device-map", help="auto: split the model over the visible GPUs by decoder layers, "
                                   "balanced for the KV cache (longctx plan --gpus); balanced or sequential: transformers' splits"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="most tokens an answer takes (default: the model's generation config, else 256)"),
    temperature: float = typer.Option(None, "--temperature", help="0 for greedy (default: the model's generation config, else greedy)"),
    top_p: float = typer.Option(None, "--top-p", help="nucleus sampling (default: the model's generation config, else 1)"),
    seed: int = typer.Option(0, "--seed", help="sampling seed"),
    system: str = typer.Option(None, "--system", help="system prompt"),
    file: Path = typer.Option(None, "--file", help="a document to place into the context (prefilled in chunks)"),
    prompt: str = typer.Option(None, "--prompt", help="answer this once and exit (for scripts)"),
    max_context: int = typer.Option(None, "--max-context", help="refuse turns that would exceed this many tokens; also sizes the cache once (see longctx plan)"),
    chunk: int = typer.Option(512, "--chunk", help="prefill chunk in tokens"),
    host_mem: str = typer.Option(None, "--host-mem", help="a host tier of this much pinned host memory (64GiB, 64GB): the oldest pages spill there when the GPU is full (CUDA)"),
    graphs: bool = typer.Option(None, "--graphs/--no-graphs", help="decode from CUDA graphs (default: where they serve: CUDA, triton backend)"),
    save_kv: Path = typer.Option(None, "--save-kv", help="after the document is read, save the cache and conversation to this file (.kvc)"),
    load_kv: Path = typer.Option(None, "--load-kv", help="continue a conversation saved with --save-kv or /save-kv: its document is not read again"),
    show_config: bool = print_config_option(),
) -> None:
    """Chat with a model; the KV cache is kept across turns (only new tokens are prefilled).

    Examples:
      longctx chat
      longctx chat --prompt "What is the capital of France?"
      longctx chat --model ./Llama-3.1-8B-Instruct --load-in-4bit --kv-bits 4 --file report.txt
      longctx chat --model ./Llama-3.1-8B-Instruct --load-in-4bit --device-map auto --file book.txt
      longctx chat --file book.txt --save-kv book.kvc
      longctx chat --load-kv book.kvc
    """
    import torch

    from ..chat import ChatSession, SamplingConfig
    from ..config import bits_format
    from ..errors import LongCtxError
    from ..integrations.transformers import LongCtxCache
    from ..models import load_model

    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device_map is not None:
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"--device-map must be auto, balanced, balanced_low_0 or sequential, got {device_map!r}")
        if device != "auto":
            raise ValueError(f"--device-map {device_map} places the model on the GPUs itself; drop --device {device}")
    doc = read_text_file(file, "--file") if file is not None else None
    saved = None  # the --load-kv file's header, read before the model loads (a missing, foreign or damaged file is refused there)
    if load_kv is not None:
        from ..persist import read_info

        if file is not None or system is not None:
            raise ValueError("--load-kv continues a saved conversation, its system prompt and document included; drop --file and --system")
        saved = read_info(load_kv)
    if save_kv is not None and save_kv.is_dir():
        raise ValueError(f"--save-kv {save_kv} is a directory; give a file name such as book.kvc")
    at_least(chunk, 1, "--chunk")
    if max_new_tokens is not None:
        at_least(max_new_tokens, 1, "--max-new-tokens")
    if temperature is not None:
        at_least(temperature, 0, "--temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if max_context is not None and max_context < 1:
        raise ValueError(f"--max-context must be a positive number of tokens, got {max_context}")
    host_bytes = 0
    if host_mem is not None:
        from ..plan import parse_size_gib

        host_bytes = int(parse_size_gib(host_mem) * 2**30)
        if device == "cpu":
            raise ValueError("--host-mem holds pages off a CUDA GPU's memory; drop it with --device cpu")
    given_kv = {k: v for k, v in dict(k_bits=k_bits, v_bits=v_bits, rotate=rotate, block_size=block_size).items() if v is not None}
    kv = bits_format(kv_bits, **given_kv)
    # --max-context also sizes the page pools once (no doubling and copying as the chat grows)
    if max_context:
        kv = dataclasses.replace(kv, max_blocks=-(-max_context // kv.block_size))
    given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    if show_config:  # group_size null: the model's head_dim sets it when the cache is built; sampling null: the model's
        return print_config(details={"kv": kv})
    if host_bytes:  # (this machine's memory: a printed config may be meant for another)
        from ..offload import check_host_budget

        check_host_budget(host_bytes, "--host-mem")
    err = Console(stderr=True)
    out = Console(highlight=False)
    if saved is not None:  # the file's format, sized by --max-context and --host-mem as a new cache would be
        from ..persist import load_config

        fmt = load_config(saved, None)
        kv = dataclasses.replace(fmt, max_blocks=-(-max_context // fmt.block_size) if max_context else None)
    with err.status("loading model..."):  # (--device-map auto splits the layers for kv's format)
        mdl, tok = load_model(model, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit, device=None if device == "auto" else device,
                              device_map=device_map, kv=kv, chunk=chunk)
    sampling = SamplingConfig.for_model(mdl, **given)
    if host_bytes:
        from ..offload import offload_config

        kv = offload_config(kv, mdl, host_bytes, chunk)
    if doc is not None:
        system = ((system + "\n\n") if system else "") + f"Document ({file.name}):\n\n{doc}"
    if load_kv is not None:
        with err.status(f"loading {load_kv}..."):
            t0 = time.perf_counter()
            session = ChatSession.load_kv(mdl, tok, load_kv, kv, chunk=chunk, max_context=max_context, graphs=graphs)
        err.print(f"{load_kv.name}: {len(session.cached_ids):,} tokens of {kv.describe()} cache loaded in {time.perf_counter() - t0:.1f} s")
    else:
        session = ChatSession(mdl, tok, LongCtxCache(mdl, kv), system=system, chunk=chunk, max_context=max_context, graphs=graphs)
    gen = torch.Generator(device=mdl.device).manual_seed(seed)

    class Bar:
        """A prefill progress bar with tokens/s, shown only for long prefills."""

        def __init__(self):
            self.progress = Progress(TextColumn("prefill"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} tokens"),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err, transient=True)
            self.task, self.t0 = None, time.perf_counter()

        def __call__(self, done: int, total: int) -> None:
            if total < 2 * chunk:
                return
            if self.task is None:
                self.progress.start()
                self.task = self.progress.add_task("prefill", total=total, rate="")
            self.progress.update(self.task, completed=done, rate=f"{done / max(1e-9, time.perf_counter() - self.t0):,.0f} tok/s")

        def close(self) -> None:
            if self.task is not None:
                self.progress.stop()

    if file is not None:
        trained = getattr(getattr(mdl, "config", None), "max_position_embeddings", None)

        def warn_past_trained(n: int) -> None:
            if trained and n > trained:
                err.print(f"[yellow]warning:[/] {file.name} makes the context {n:,} tokens, past the model's trained context "
                          f"({trained:,} positions): expect answers that ignore or garble the document", highlight=False)

        bar = Bar()
        try:
            n = session.preload(on_prefill=bar, on_context=warn_past_trained)
        finally:
            bar.close()
        err.print(f"{file.name}: {n:,} tokens in the context ({session.last.prefill_tok_s:,.0f} tok/s)")
    if save_kv is not None:
        if not session.cached_ids:
            session.preload()
        n = session.save_kv(save_kv)
        err.print(f"saved {len(session.cached_ids):,} tokens to {save_kv} ({n / 2**20:,.1f} MiB)")

    def answer(text: str, echo: bool = False) -> None:
        """One turn; `echo` (piped input) first prints the question as "> question", and a blank
        line ends the answer, so that a transcript of several answers reads as pairs."""
        if echo:
            out.print(f"> {text}", markup=False)
        bar = Bar()
        try:
            session.send(text, sampling, on_token=lambda piece: out.print(piece, end="", soft_wrap=True, markup=False), on_prefill=bar,
                         generator=gen)
        except KeyboardInterrupt:
            out.print("\n(interrupted: the answer so far is kept)", style="yellow", markup=False)
        finally:
            bar.close()
        out.print()
        if session.last.stopped:
            err.print(f"(stopped: {session.last.stopped})", style="yellow", markup=False)
        if echo:
            out.print()

    if prompt is not None:
        answer(prompt)
        return
    interactive = sys.stdin.isatty()
    if interactive:
        out.print(f"longctx chat: {kv.describe()} KV cache. {HELP}", style="dim")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            out.print()
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            match cmd:
                case "/exit" | "/quit":
                    break
                case "/help":
                    out.print(HELP)
                case "/reset":
                    session.reset()
                    out.print("conversation reset")
                case "/stats":
                    out.print(_stats_table(session))
                case "/save":
                    if not arg.strip():
                        out.print("usage: /save FILE", style="red")
                        continue
                    try:
                        Path(arg.strip()).write_text(session.transcript_markdown(), encoding="utf-8")
                    except OSError as e:  # a bad path must not end the chat (and lose it)
                        out.print(f"could not save to {arg.strip()}: {e.strerror or e}; the chat goes on", style="red", markup=False)
                        continue
                    out.print(f"saved to {arg.strip()}")
                case "/save-kv":
                    if not arg.strip():
                        out.print("usage: /save-kv FILE", style="red")
                        continue
                    try:
                        n = session.save_kv(arg.strip())
                    except (OSError, ValueError) as e:  # a bad path must not end the chat (and lose it)
                        out.print(f"could not save to {arg.strip()}: {getattr(e, 'strerror', None) or e}; the chat goes on", style="red", markup=False)
                        continue
                    out.print(f"saved {len(session.cached_ids):,} tokens and the conversation to {arg.strip()} ({n / 2**20:,.1f} MiB)")
                case _:
                    out.print(f"unknown command {cmd}; {HELP}", style="red")
            continue
        try:
            answer(text, echo=not interactive)
        except (ValueError, LongCtxError) as e:  # e.g. --max-context reached: say so, keep chatting
            out.print(f"error: {e}", style="red")
