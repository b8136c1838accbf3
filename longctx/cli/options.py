"""Options every command shares: `--config FILE` and `--print-config` (the same YAML, out and
in), and the checks of option values that run before a model loads (a file's text, a least
value)."""

from __future__ import annotations

import contextvars
import functools
import inspect
from pathlib import Path

import typer

# the running command's name, its options (parameter -> (YAML key, type)) and their values,
# set by `configurable` for `print_config`
_RUN: contextvars.ContextVar[tuple[str, dict, dict]] = contextvars.ContextVar("longctx_cli_run")
_NOT_CONFIG = ("config", "show_config")  # the options that say what to do with a config, not part of one


def print_config_option():
    return typer.Option(False, "--print-config", help="print this command's options as YAML (what --config reads) and exit")


def _config_option() -> typer.models.OptionInfo:
    return typer.Option(None, "--config", help="read options from this YAML file (as --print-config writes it); options given here win",
                        show_default=False)


def _key(name: str, default) -> str:
    """The YAML key of a parameter: its long flag without the dashes (`--kv-bits` -> kv_bits,
    `--json` -> json, `--graphs/--no-graphs` -> graphs), else its name."""
    for decl in getattr(default, "param_decls", None) or ():
        if decl.startswith("--"):
            return decl.split("/")[0][2:].replace("-", "_")
    return name


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a file path"}


def _value(value, kind, key: str, path: Path):
    """A YAML value as the option's type: a number may stand for a string (`contexts: 131072`),
    a list of plain values for a comma-separated one (`formats: [int4, int8]`); anything else
    that is not the option's type is a one-line error naming the key and the file."""
    scalar = (int, float, str)
    if value is None:
        return None
    if kind is bool and isinstance(value, bool):
        return value
    if not isinstance(value, bool):
        if kind is int and isinstance(value, int):
            return value
        if kind is float and isinstance(value, (int, float)):
            return float(value)
        if kind is str and isinstance(value, scalar):
            return str(value)
        if kind is str and isinstance(value, list) and value and all(isinstance(v, scalar) and not isinstance(v, bool) for v in value):
            return ",".join(str(v) for v in value)
        if kind is Path and isinstance(value, str) and value:
            return Path(value)
    raise ValueError(f"{path}: {key} must be {_KINDS[kind]}{' (or a list of plain values)' if kind is str else ''}, got {value!r}")


def read_config(path: Path, options: dict[str, tuple[str, type]], command: str) -> dict:
    """The option values of a `--config` YAML file, by parameter: a mapping of keys as
    `--print-config` writes them; an unknown key or a value of the wrong type is a one-line
    error naming it and the file."""
    import yaml

    try:
        data = yaml.safe_load(read_text_file(path, "--config"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of options (key: value), not {type(data).__name__}")
    by_key = {key: (name, kind) for name, (key, kind) in options.items()}
    values = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in by_key:
            raise ValueError(f"{path}: unknown key {key!r} for longctx {command}; its keys: {', '.join(by_key)}")
        name, kind = by_key[k]
        values[name] = _value(value, kind, str(key), path)
    return values


def configurable(fn, command: str):
    """`fn` (a typer command) with `--config FILE`: the file's options fill those not given on
    the command line; `print_config` then prints every option's value."""
    sig = inspect.signature(fn, eval_str=True)
    options = {name: (_key(name, p.default), p.annotation) for name, p in sig.parameters.items() if name not in _NOT_CONFIG}

    @functools.wraps(fn)
    def wrapper(cli_context: typer.Context, config: Path | None = None, **kwargs):
        if config is not None:
            for name, value in read_config(config, options, command).items():
                source = cli_context.get_parameter_source(name)
                if source is None or source.name != "COMMANDLINE":
                    kwargs[name] = value
        token = _RUN.set((command, options, kwargs))
        try:
            return fn(**kwargs)
        finally:
            _RUN.reset(token)

    params = [inspect.Parameter("cli_context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context), *sig.parameters.values()]
    params.insert(len(params) - ("show_config" in sig.parameters), inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_config_option(), annotation=Path))
    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {**{p.name: p.annotation for p in params}, "return": None}
    return wrapper


def print_config(details: dict | None = None, **resolved) -> None:
    """Echo the running command's options as YAML, in its order, keyed as `--config` reads them:
    each value as given, or as the command resolved it (`resolved`, by parameter: a default
    filled in, names as a list); then `details` (what the options resolve to, e.g. the KV
    formats' fields) as YAML comments, a line each, not read back. The command then returns
    before it loads a model or touches a GPU."""
    from ..config import config_yaml, flow_yaml, plain_config

    command, options, values = _RUN.get()
    unknown = set(resolved) - set(options)
    assert not unknown, f"print_config: {command} has no options {sorted(unknown)}"
    text = f"# longctx {command}: --config FILE reads this back\n"
    text += config_yaml(**{key: resolved.get(name, values.get(name)) for name, (key, _) in options.items()})

    if details:
        text += "# what these resolve to (not read back):\n"
        for key, value in plain_config(details).items():
            if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
                text += f"#   {key}:\n" + "".join(f"#     {k}: {flow_yaml(v)}\n" for k, v in value.items())
            else:
                text += f"#   {key}: {flow_yaml(value)}\n"
    typer.echo(text, nl=False)


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
