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


# ---------------------------------------------------------------------- chat (embedded model)
def run_cli(args, stdin=None):
    return subprocess.run([sys.executable, "-m", "longctx", *args], input=stdin, capture_output=True, text=True, timeout=600)


def test_chat_prompt_answers_once():
    p = run_cli(["chat", "--prompt", "What is the capital of France?"])
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_chat_interactive_through_stdin(tmp_path):
    transcript = tmp_path / "t.md"
    script = f"Hello! Who are you?\n/stats\n/save {transcript}\n/reset\n/stats\nName a color.\n/exit\nnot read\n"
    p = run_cli(["chat", "--temperature", "0", "--max-new-tokens", "16", "--kv-bits", "4", "--block-size", "16"], stdin=script)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("Cache and speed") == 2
    assert "conversation reset" in p.stdout
    text = transcript.read_text()
    assert "Hello! Who are you?" in text and "**assistant**" in text
    assert "Name a color" not in text  # saved before the second question
    tables = p.stdout.split("Cache and speed")
    assert "16 tokens" in tables[1]  # the first turn decoded 16 tokens


def test_chat_bad_inputs_are_one_line_errors(tmp_path):
    for args in (["chat", "--kv-bits", "3", "--prompt", "x"], ["chat", "--file", str(tmp_path / "missing.txt")],
                 ["chat", "--model", str(tmp_path / "none.gguf"), "--prompt", "x"], ["chat", "--device", "tpu"]):
        p = run_cli(args)
        assert p.returncode == 2, (args, p.stderr)
        lines = [line for line in p.stderr.splitlines() if line.strip() and "Converting" not in line and "Loading" not in line]
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, p.stderr)
