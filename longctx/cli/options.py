"""Options every command shares: `--print-config`, and the checks of option values that run
before a model loads (a file's text, a least value)."""

from __future__ import annotations

from pathlib import Path

import typer


def print_config_option():
    return typer.Option(False, "--print-config", help="print the configuration this command would run with, as YAML, and exit")


def print_config(**sections) -> None:
    """Echo `sections` as YAML (`longctx.config.config_yaml`): the command then returns
    before it loads a model or touches a GPU."""
    from ..config import config_yaml

    typer.echo(config_yaml(**sections), nl=False)


def read_text_file(path: Path, option: str) -> str:
    """The UTF-8 text of `path`, given as `option`, or a one-line error saying why not: no such
    file, a directory, empty, binary (NUL bytes), or not UTF-8. Read before any model loads."""
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory, not a text file")
    if not path.exists():
        raise FileNotFoundError(f"{option}: no such file {path}")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{option} {path} is empty" + (" (white space only)" if data else ""))
    if b"\0" in data[:65536]:
        raise ValueError(f"{option} {path} is not text: it holds NUL bytes (a binary file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{option} {path} is not UTF-8 text ({e.reason} at byte {e.start:,})") from None


def at_least(value: int | float, least: int | float, option: str) -> None:
    """A one-line error where `option`'s value is below `least` (checked before any model loads)."""
    if value < least:
        raise ValueError(f"{option} must be at least {least}, got {value}")
