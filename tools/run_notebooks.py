"""Run the notebooks headless (papermill) and keep their outputs without volatile metadata.

    python tools/run_notebooks.py                       # every notebook, outputs written back in place
    python tools/run_notebooks.py --out /tmp/nb 02_needle.ipynb -p lengths "[512, 1024]"

Each notebook runs from notebooks/ (so `data/` resolves) with its parameters cell's defaults,
or `-p NAME VALUE` (VALUE read as YAML) injected after it. A cell error stops the run with exit
code 1 naming the notebook and the cell; a notebook past `--timeout` seconds in one cell fails
the same way. Written notebooks drop papermill's timings and paths, the execution timestamps
and the Python version, so a rerun changes only what the cells print.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
import papermill
import yaml

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def clean(path: Path) -> None:
    """Strip what changes on every run, and nothing the cells printed."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("papermill", None)
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def run(notebook: Path, out: Path, parameters: dict, timeout: int) -> float:
    t0 = time.perf_counter()
    papermill.execute_notebook(str(notebook), str(out), parameters=parameters, cwd=str(NOTEBOOKS), kernel_name="python3",
                               execution_timeout=timeout, progress_bar=False, log_output=False)
    clean(out)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="names under notebooks/ (default: all)")
    ap.add_argument("--out", type=Path, help="write the executed notebooks here instead of in place")
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"), help="a parameter (VALUE as YAML)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may run")
    args = ap.parse_args(argv)
    names = args.notebooks or sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    parameters = {name: yaml.safe_load(value) for name, value in args.p}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        notebook = NOTEBOOKS / name
        if not notebook.is_file():
            print(f"error: no notebook {notebook}", file=sys.stderr)
            return 2
        out = (args.out / name) if args.out is not None else notebook
        try:
            seconds = run(notebook, out, parameters, args.timeout)
        except papermill.PapermillExecutionError as e:
            print(f"error: {name}, cell {e.exec_count}: {e.ename}: {e.evalue}", file=sys.stderr)
            return 1
        print(f"{name}: {seconds:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
