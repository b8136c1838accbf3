"""The command line: help, info, and one-line errors with exit code 2."""

import json
import subprocess
import sys

from typer.testing import CliRunner

from longctx.cli import app

runner = CliRunner()


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("eval", "bench", "info"):
        assert cmd in r.output


def test_info_json_reports_versions_and_backends():
    r = runner.invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["versions"]["torch"] and data["versions"]["python"]
    backends = {b["backend"]: b for b in data["backends"]}
    assert backends["reference"]["available"] and backends["reference"]["formats"] == [16, 8, 4, 2]
    assert "flash" in backends and not backends["flash"]["available"]


def test_info_table():
    r = runner.invoke(app, ["info"])
    assert r.exit_code == 0 and "Attention backends" in r.output and "reference" in r.output


def test_known_errors_are_one_line_with_exit_code_2():
    for args in (["eval", "quality", "--formats", "int9"], ["bench", "decode", "--contexts", "4x"]):
        p = subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True)
        assert p.returncode == 2, (args, p.stderr)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
