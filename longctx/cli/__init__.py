"""The `longctx` command line: a typer app, one module per command group.

`main()` turns the errors longctx raises on purpose (and bad input) into one readable line
on stderr with exit code 2, instead of a traceback.
"""

from __future__ import annotations

import functools
import inspect

import typer

from .bench import app as bench_app
from .chat import chat
from .eval import app as eval_app
from .info import info
from .options import configurable
from .plan import plan

app = typer.Typer(
    name="longctx",
    help="Paged int8/int4/int2 KV caches for long contexts on one GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"longctx {version('longctx')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print longctx's version and exit")) -> None:
    """Paged int8/int4/int2 KV caches for long contexts on one GPU."""


app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
app.command("info")(info)
app.command("chat")(chat)
app.command("plan")(plan)


# optional packages a command may need, and how to get each
OPTIONAL = {
    "triton": "pip install 'longctx[gpu]' (a CUDA build of torch brings its own)",
    "flash_attn": "pip install 'longctx[flash]' (PyPI has flash-attn as source only: tools/pack_flash_attn.sh builds it)",
    "bitsandbytes": "pip install 'longctx[bnb]'",
    "optimum": "pip install 'longctx[quanto]'",
    "matplotlib": "pip install matplotlib",
}


def _one_line_errors(fn):
    """Known errors (LongCtxError, bad values, missing files, a missing optional package) print
    one line on stderr and exit with code 2, inside the app, so that `main()` and test runners
    see the same."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rich.console import Console
        from rich.markup import escape

        from ..errors import LongCtxError

        try:
            return fn(*args, **kwargs)
        except (LongCtxError, ValueError, FileNotFoundError, ModuleNotFoundError) as e:
            package = (getattr(e, "name", None) or "").split(".")[0]
            if isinstance(e, ModuleNotFoundError) and package not in OPTIONAL:
                raise
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, ModuleNotFoundError):
                line = f"this command needs {package}, which is not installed: {OPTIONAL[package]}"
            Console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


def _reflowed(doc: str | None) -> str | None:
    """A command's docstring as its help: each prose paragraph on one line, so that rich wraps it
    to the terminal (typer keeps a paragraph's line breaks after the first, which left the
    source's breaks in the middle of rich's lines). Paragraphs that begin with "Example" keep
    their lines: one command a line."""
    if not doc:
        return doc
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.startswith("Example") else " ".join(p.split()) for p in paragraphs)


for _group, _typer in (("", app), ("eval ", eval_app), ("bench ", bench_app)):
    for _cmd in _typer.registered_commands:
        _cmd.help = _cmd.help or _reflowed(inspect.getdoc(_cmd.callback))
        _name = _group + (_cmd.name or _cmd.callback.__name__.replace("_", "-"))
        _cmd.callback = _one_line_errors(configurable(_cmd.callback, _name))


def main(argv: list[str] | None = None) -> None:
    app(args=argv, standalone_mode=True)

