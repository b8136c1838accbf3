"""The command line: help, info, and one-line errors with exit code 2."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from longctx.cli import app
from longctx.eval import has_quanto

runner = CliRunner(env={"COLUMNS": "200"})  # rich wraps prose at 80 columns otherwise
runner80 = CliRunner(env={"COLUMNS": "80"})  # the width rich assumes off a terminal


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("eval", "bench", "info", "chat", "plan"):
        assert cmd in r.output


def test_info_json_reports_versions_and_backends():
    r = runner.invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["versions"]["torch"] and data["versions"]["python"]
    backends = {b["backend"]: b for b in data["backends"]}
    assert backends["reference"]["available"] and backends["reference"]["formats"] == [16, 8, 4, 2]
    if importlib.util.find_spec("flash_attn") is None:
        assert not backends["flash"]["available"] and "longctx[flash]" in backends["flash"]["why"]
    else:  # (flash-attn has no CPU kernels)
        assert backends["flash"]["available"] == torch.cuda.is_available()


def test_info_table():
    r = runner.invoke(app, ["info"])
    assert r.exit_code == 0 and "Attention backends" in r.output and "reference" in r.output
    if importlib.util.find_spec("flash_attn") is None:  # the install hint survives rich's markup
        assert "longctx[flash]" in r.output, r.output


def one_line_error(r, args):
    assert r.exit_code == 2, (args, r.output)
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Converting" not in line and "Loading" not in line]
    assert len(lines) == 1 and lines[0].startswith("error:"), (args, r.stderr)
    return lines[0]


def test_known_errors_are_one_line_with_exit_code_2():
    cases = [["eval", "quality", "--formats", "int9"], ["bench", "decode", "--contexts", "4x"], ["bench", "decode", "--formats", "int5"],
             ["bench", "decode", "--cases", "4k-1"], ["bench", "decode", "--cases", "4k:1", "--batch", "8"], ["bench", "decode", "--cases", "4k:0"],
             ["bench", "decode", "--contexts", "0"],
             ["bench", "e2e", "--formats", "int5"], ["bench", "prefill", "--formats", "int5"], ["bench", "prefill", "--paths", "fast"],
             ["bench", "prefill", "--chunks", "1"], ["bench", "seal", "--formats", "int5"], ["bench", "seal", "--layers", "0"],
             ["bench", "seal", "--context", "0"], ["bench", "e2e", "--context", "0"], ["bench", "e2e", "--chunk", "0"],
             ["bench", "e2e", "--new-tokens", "0"], ["bench", "e2e", "--layers", "0"], ["bench", "prefill", "--contexts", "0"],
             ["bench", "plan"], ["bench", "plan", "--weights-bits", "8"], ["bench", "plan", "--format", "k8v4"], ["bench", "plan", "--chunk", "0"],
             ["bench", "plan", "--budget-gib", "0"], ["bench", "plan", "--model", "llama-9"],
             ["bench", "offload", "--formats", "int5"], ["bench", "offload", "--contexts", "4k"], ["bench", "offload", "--steps", "0"],
             ["bench", "offload", "--budget", "0GiB"], ["chat", "--host-mem", "1GiB", "--device", "cpu"],
             ["chat", "--host-mem", "100000GiB", "--prompt", "hi"], ["plan", "--pcie-gbps", "0", "--host-mem", "8GiB"]]
    if not has_quanto():
        cases.append(["eval", "quality", "--quanto"])  # before the model loads or any format runs
    for args in cases:
        line = one_line_error(runner.invoke(app, args), args)
        if "--quanto" in args:
            assert "pip install optimum-quanto" in line, line
        if args[:2] == ["bench", "seal"] and args[2] in ("--layers", "--context"):  # checked before the CUDA check
            assert f"{args[2][2:]} must be at least 1" in line, line
        if args[:2] == ["bench", "e2e"] and args[2] != "--formats":  # before the CUDA check and the 16 GB model
            assert f"{args[2][2:].replace('-', '_')} must be at least 1, got 0" in line, line
        if args[:2] == ["chat", "--host-mem"] and "--device" not in args:  # refused before the model loads, naming both sizes
            assert "100,000.00 GiB of pinned host memory asked, but this machine has" in line, line
        if args[:3] == ["bench", "prefill", "--contexts"]:
            assert "contexts must be at least 1 token" in line, line
        if args == ["bench", "plan"]:  # the options are good: this machine has no GPU
            assert "needs a CUDA GPU" in line, line


HIDE_TRITON = """
import sys

class Hidden:  # every finder, with triton hidden from it: as on a machine without the package
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] == "triton" else self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
from longctx.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("args", [["bench", "decode", "--contexts", "4k"], ["bench", "prefill", "--contexts", "4k", "--chunks", "512"],
                                  ["bench", "seal", "--context", "4k"], ["bench", "e2e", "--context", "4k"], ["bench", "plan"], ["info"],
                                  ["plan", "--model", "llama-3.1-8b", "--gpu", "rtx-4090"], ["eval", "quality", "--print-config"]],
                         ids=lambda a: "-".join(a[:2]))
def test_commands_without_triton_are_one_line_errors_or_work(args):
    """On a machine without triton (its import hidden in a fresh process) every command either
    works or says in one line what it lacks (a bench: triton or a CUDA GPU), never a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", HIDE_TRITON, *args], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert "Traceback" not in p.stderr, (args, p.stderr[-3000:])
    if p.returncode:
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (args, p.stderr)
        assert "triton" in lines[0] or "CUDA" in lines[0], lines
    if args == ["info"]:
        assert "needs the triton package" in " ".join(p.stdout.split()), p.stdout


def test_bench_decode_cases_parse_into_context_batch_pairs():
    from longctx.cli.bench import parse_cases

    assert parse_cases("4k:1, 128k:1,512k:1,32k:8") == [(4096, 1), (131072, 1), (524288, 1), (32768, 8)]
    for bad in ("4k", "4k:", ":8", "4k:1,", "4k:1:2"):
        with pytest.raises(ValueError, match="bad case|bad size"):
            parse_cases(bad)


def test_every_command_prints_its_config_as_yaml_without_loading_a_model(monkeypatch):
    """`--print-config`: the command's options as YAML keyed as `--config` reads them, the values
    it resolved (defaults filled in, sizes in tokens), and what they resolve to as comments (the
    KV formats' fields), exit 0, before a model loads or a GPU is asked for (this machine has
    none)."""
    import yaml

    import longctx.models
    from longctx import KVConfig

    def no_model(*a, **k):
        raise AssertionError("--print-config loaded a model")

    monkeypatch.setattr(longctx.models, "load_model", no_model)

    def printed(*args):
        r = runner.invoke(app, [*args, "--print-config"])
        assert r.exit_code == 0, (args, r.output)
        resolved = yaml.safe_load("\n".join(line[4:] for line in r.stdout.splitlines() if line.startswith("#   ")))
        return yaml.safe_load(r.stdout), resolved

    chat, kv = printed("chat", "--kv-bits", "2", "--rotate", "--max-context", "1000", "--temperature", "0")
    assert list(chat) == ["model", "kv_bits", "k_bits", "v_bits", "rotate", "block_size", "load_in_4bit", "load_in_8bit", "device",
                          "device_map", "max_new_tokens", "temperature", "top_p", "seed", "system", "file", "prompt", "max_context", "chunk", "host_mem", "graphs",
                          "save_kv", "load_kv"]
    assert (chat["kv_bits"], chat["rotate"], chat["max_context"], chat["temperature"], chat["model"]) == (2, True, 1000, 0.0, None)
    assert KVConfig(**kv["kv"]) == KVConfig(bits=2, rotate=True, k_span=16, max_blocks=16)  # kv.yaml's int2+rot
    chat, kv = printed("chat", "--kv-bits", "2")  # (rotated as the named format is, with no --rotate)
    assert chat["rotate"] is None and chat["block_size"] is None and KVConfig(**kv["kv"]) == KVConfig(bits=2, rotate=True, k_span=16)
    chat, kv = printed("chat", "--kv-bits", "4", "--block-size", "128", "--no-rotate")
    assert KVConfig(**kv["kv"]) == KVConfig(bits=4, block_size=128)
    decode, resolved = printed("bench", "decode", "--cases", "128k:1,32k:8", "--formats", "int8")
    assert decode["cases"] == "131072:1,32768:8" and decode["formats"] == ["int8"] and resolved["shape"]["kv_heads"] == 8
    assert KVConfig(**resolved["formats"]["int8"]) == KVConfig(bits=8, group_size=128)  # resolved at the bench's head_dim
    seal, resolved = printed("bench", "seal", "--shape", "smollm2-135m")
    assert seal["layers"] == 30 and resolved["formats"]["int4"]["group_size"] == 64
    quality, resolved = printed("eval", "quality", "--formats", "int4,int2+rot")
    assert quality["formats"] == ["int4", "int2+rot"] and quality["mode"] == "both"
    assert KVConfig(**resolved["formats"]["int2+rot"]) == KVConfig(bits=2, rotate=True, k_span=16)
    passkey, _ = printed("eval", "passkey", "--depths", "0.5")
    assert passkey["depths"] == [0.5] and passkey["tokens"] == 3600
    plan, resolved = printed("plan", "--gpu", "rtx-3090", "--kv-bits", "4")
    assert plan["gpu"] == "rtx-3090" and plan["kv_bits"] == [4] and resolved["gpu"]["memory_gib"] == 24.0
    offload, _ = printed("bench", "offload", "--prefill", "384k", "--budget", "16GiB")
    assert offload["prefill"] == 393216 and offload["budget"] == "16GiB"
    for args in (["chat", "--kv-bits", "3"], ["bench", "decode", "--cases", "4k:0"], ["eval", "quality", "--text", "missing.txt"]):
        one_line_error(runner.invoke(app, [*args, "--print-config"]), args)  # still checked


# every command with --print-config, with options away from their defaults
CONFIGURED = [["chat", "--kv-bits", "2", "--rotate", "--max-context", "4096", "--temperature", "0.7", "--system", "be brief\nplease: yes",
               "--host-mem", "8GiB", "--no-graphs", "--load-in-4bit"],
              ["plan", "--gpu-mem", "22.5GiB", "--weights-bits", "4", "--kv-bits", "8,4", "--host-mem", "64GiB", "--context", "1024k", "--json"],
              ["eval", "quality", "--formats", "int4,k8v4", "--mode", "decode", "--decode-tokens", "64", "--chunk", "32", "--device", "cpu"],
              ["eval", "passkey", "--formats", "int2+rot", "--tokens", "1200", "--depths", "0.25,0.75"],
              ["eval", "needle", "--lengths", "1k,3k", "--depths", "0.5", "--plot", "needle.png"],
              ["bench", "decode", "--contexts", "4k,32k", "--batch", "1,8", "--formats", "int4,int2+rot", "--graph", "--no-peers"],
              ["bench", "prefill", "--contexts", "8k", "--chunks", "1k", "--paths", "kernel", "--shape", "smollm2-135m"],
              ["bench", "seal", "--context", "32k", "--layers", "1", "--block-size", "128"],
              ["bench", "e2e", "--context", "16k", "--layers", "4", "--no-compiled", "--json", "e2e.json"],
              ["bench", "plan", "--format", "int2+rot", "--weights-bits", "4", "--budget-gib", "16", "--max-tokens", "65536"],
              ["bench", "offload", "--contexts", "1024k", "--formats", "int4", "--no-full-gpu", "--steps", "4", "--prefill", "384k"],
              ["bench", "disk", "--contexts", "32k", "--formats", "int4,int2+rot", "--decode", "4"]]


@pytest.mark.parametrize("args", CONFIGURED, ids=lambda a: "-".join(a[:2]))
def test_print_config_reads_back_through_config(args, tmp_path):
    """`longctx X ... --print-config > f.yaml && longctx X --config f.yaml --print-config` prints
    the same YAML, so the file carried every option away from its default; an option given on
    the command line wins over the file."""
    import yaml

    command = args[:2] if args[0] in ("eval", "bench") else args[:1]
    first = runner.invoke(app, [*args, "--print-config"])
    assert first.exit_code == 0, (args, first.output)
    f = tmp_path / "f.yaml"
    f.write_text(first.stdout)
    again = runner.invoke(app, [*command, "--config", str(f), "--print-config"])
    assert again.exit_code == 0, (args, again.output)
    assert again.stdout == first.stdout
    assert again.stdout != runner.invoke(app, [*command, "--print-config"]).stdout  # (the file's values took effect)
    key, value, want = {"chat": ("--seed", "7", 7), "plan": ("--batch", "2", 2), "eval": ("--device", "cuda", "cuda"),
                        "bench": ("--json", "x.json", "x.json")}[command[0]]
    over = runner.invoke(app, [*command, "--config", str(f), key, value, "--print-config"])
    assert over.exit_code == 0, over.output
    data = yaml.safe_load(over.stdout)
    assert data[key[2:]] == want and {k: v for k, v in data.items() if k != key[2:]} == \
        {k: v for k, v in yaml.safe_load(first.stdout).items() if k != key[2:]}


def test_every_preset_in_configs_loads():
    """Each file in configs/ names its command on its first line (`# longctx X: ...`, as
    `--print-config` writes it) and loads there: the command prints its config with every key of
    the file taking effect, and that print reads back the same."""
    from pathlib import Path

    import yaml

    presets = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(presets) >= 6, presets
    commands = set()
    for path in presets:
        head = path.read_text().splitlines()[0]
        assert head.startswith("# longctx ") and ":" in head, (path, head)
        command = head[len("# longctx "):head.index(":")].split()
        commands.add(command[0])
        r = runner.invoke(app, [*command, "--config", str(path), "--print-config"])
        assert r.exit_code == 0, (path, r.output)
        preset, printed = yaml.safe_load(path.read_text()), yaml.safe_load(r.stdout)
        for key, value in preset.items():
            assert key in printed and (printed[key] == value or isinstance(value, str)), (path, key, value, printed.get(key))
        again = runner.invoke(app, [*command, "--config", str(path), "--print-config"])
        assert again.stdout == r.stdout
    assert commands == {"chat", "plan", "eval", "bench"}, commands


def test_bad_config_files_are_one_line_errors_naming_the_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    for text, words in [("kv_bits: 4\nkv_bitz: 2\n", ["'kv_bitz'", "longctx chat", str(f)]),
                        ("kv_bits: four\n", ["kv_bits must be an integer", "'four'", str(f)]),
                        ("rotate: 1\n", ["rotate must be true or false", str(f)]),
                        ("temperature: hot\n", ["temperature must be a number", str(f)]),
                        ("system: {a: 1}\n", ["system must be a string", str(f)]),
                        ("kv_bits: [4\n", ["not valid YAML", "line 2", str(f)]),
                        ("- kv_bits\n", ["must hold a mapping", str(f)]),
                        ("\n", ["is empty", str(f)])]:
        f.write_text(text)
        line = one_line_error(runner.invoke(app, ["chat", "--config", str(f), "--print-config"]), text)
        assert all(w in line for w in words), (text, line)
    f.write_text("formats: int4\nlengths: [1k, 2k]\ndepth: 0.5\n")
    line = one_line_error(runner.invoke(app, ["eval", "needle", "--config", str(f)]), "depth")
    assert "'depth'" in line and "depths" in line
    one_line_error(runner.invoke(app, ["plan", "--config", str(tmp_path / "none.yaml")]), "no such file")


def test_main_entry_point_exits_2_on_known_errors():
    p = subprocess.run([sys.executable, "-m", "longctx", "plan", "--gpu", "rtx-4009"], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: unknown GPU") and "\n" not in p.stderr.strip()


# ---------------------------------------------------------------------- plan
def test_plan_table_and_json_match_the_library():
    from longctx import KVConfig
    from longctx.plan import model_shape, offload_step_ms, plan

    r = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--weights-bits", "4", "--host-mem", "16GiB"])
    assert r.exit_code == 0, r.output
    lib = plan(model_shape("llama-3.1-8b"), "rtx-4090", 24, weights_bits=4, host_gib=16)
    for row in lib.rows:
        assert f"{row.max_tokens:,}" in r.stdout and f"{row.max_tokens_offload:,}" in r.stdout and row.format in r.stdout
        assert f"{row.offload_step_ms:,.0f} ms" in r.stdout
    assert "fragmentation reserve" in r.stdout and "predicted at 25 GB/s" in r.stdout
    r = runner.invoke(app, ["plan", "--gpu", "rtx-4090", "--weights-bits", "4", "--host-mem", "64GB", "--pcie-gbps", "12.5", "--json"])
    data = json.loads(r.stdout)
    assert data["pcie_gbps"] == 12.5 and abs(data["host_gib"] - 64e9 / 2**30) < 1e-9
    one_line_error(runner.invoke(app, ["plan", "--host-mem", "lots"]), "--host-mem lots")
    one_line_error(runner.invoke(app, ["plan", "--context", "1024k"]), "--context without --host-mem")
    r = runner.invoke(app, ["plan", "--gpu-mem", "24GiB", "--weights-bits", "4", "--kv-bits", "4", "--host-mem", "100GiB", "--context", "1024k",
                            "--pcie-gbps", "50"])
    row = plan(model_shape("llama-3.1-8b"), "24GiB budget", 24, weights_bits=4, kv_bits=(4,), host_gib=100, pcie=50).rows[0]
    expect = offload_step_ms(model_shape("llama-3.1-8b"), KVConfig(bits=4), 1 << 20, row.offload_max_blocks, 50)
    assert "step at 1,048,576" in r.stdout and f"{expect:,.0f} ms" in r.stdout, r.stdout
    j = runner.invoke(app, ["plan", "--model", "smollm2-135m", "--gpu-mem", "4GiB", "--kv-bits", "16", "--json"])
    data = json.loads(j.stdout)
    assert data["rows"][0]["max_tokens"] == 124_884  # the case computed by hand in tests/test_plan.py
    assert data["budget"]["for_kv"] == 3_005_882_548


def test_plan_bad_inputs_are_one_line_errors(tmp_path):
    cases = {("plan", "--model", "lama-3.1-8b"): "did you mean llama-3.1-8b", ("plan", "--gpu", "rtx4090"): "did you mean rtx-4090",
             ("plan", "--kv-bits", "3"): "16, 8, 4 or 2", ("plan", "--kv-bits", "four"): "bad --kv-bits",
             ("plan", "--weights-bits", "2"): "--weights-bits", ("plan", "--gpu-mem", "lots"): "bad memory size",
             ("plan", "--gpu", "rtx-4090", "--gpu-mem", "12GB"): "give --gpu (a catalog card, 'rtx-4090') or --gpu-mem",
             ("plan", "--model", str(tmp_path / "missing")): "no model directory"}
    for args, expect in cases.items():
        assert expect in one_line_error(runner.invoke(app, list(args)), args)


def _command_paths(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _command_paths(cmd, path + (name,))
        else:
            yield path + (name,)


def test_every_help_text_wraps_its_prose_evenly_at_80_columns():
    """Each prose paragraph of a command's help is wrapped by rich, not by the docstring's own
    line breaks: no line could have taken the next line's first word (greedy wrapping). Example
    paragraphs keep one command a line, and nothing of the docstring is lost."""
    import inspect

    import typer

    from longctx.cli import _reflowed

    paths = list(_command_paths(typer.main.get_command(app)))
    assert ("bench", "seal") in paths and ("chat",) in paths and len(paths) >= 9
    for path in paths:
        out = runner80.invoke(app, [*path, "--help"]).stdout
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
        end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
        text = "\n".join(line.strip() for line in lines[start:end]).strip()
        for paragraph in text.split("\n\n"):
            if paragraph.startswith("Example"):  # each command begins a line, as in the docstring
                rows = [row.removeprefix("Example: ") for row in paragraph.splitlines()]
                assert sum(row.startswith("longctx ") for row in rows) == paragraph.count("longctx "), (path, paragraph)
                continue
            rows = paragraph.splitlines()
            for row, after in zip(rows, rows[1:]):
                assert len(row) + 1 + len(after.split()[0]) > 78, (path, row, after)
        callback = typer.main.get_command(app)
        for name in path:
            callback = callback.commands[name]
        doc = _reflowed(inspect.getdoc(callback.callback))
        assert " ".join(text.split()) == " ".join(doc.split()), path


def test_plan_says_why_no_context_fits_and_what_to_try():
    def cells(out, fmt):
        return [c.strip() for c in next(line for line in out.splitlines() if line.startswith(f"│ {fmt} ")).split("│")[1:-1]]

    fits = runner.invoke(app, ["plan", "--gpu-mem", "24GiB"])
    assert fits.exit_code == 0 and "No context fits" not in fits.stdout and "To size the cache" in fits.stdout
    for bits, fix in ((16, "--weights-bits 4"), (4, "a smaller model or a larger GPU")):
        r = runner.invoke(app, ["plan", "--gpu-mem", "3GiB", "--weights-bits", str(bits)])
        assert r.exit_code == 0, r.output
        text = " ".join(r.stdout.split())
        assert "No context fits: the weights (" in text and "take more than the 3 GiB budget" in text and fix in text, text
        assert "To size the cache" not in text and ("--weights-bits 4" in text) == (bits == 16)
        assert "(0 tokens)" not in text  # (no activation rows for formats where nothing fits)
        for fmt in ("bf16", "int8", "int4", "int2+rot"):
            per_token, tokens = cells(r.stdout, fmt)[1:3]
            assert tokens == "0"  # the format's bytes a token are still shown, as where it fits
            assert abs(int(per_token.replace(",", "")) / int(cells(fits.stdout, fmt)[1].replace(",", "")) - 1) < 0.01


def test_plan_reads_a_gguf_files_shape_as_chat_loads_it():
    """plan --model FILE.gguf (chat accepts one, plan refused it): the shape from the file's
    header gives the catalog entry's plan for the same model; a damaged file is one line."""
    from longctx.models import embedded_gguf

    gguf = runner.invoke(app, ["plan", "--model", str(embedded_gguf()), "--gpu", "rtx-4060-ti-16gb", "--json"])
    catalog = runner.invoke(app, ["plan", "--model", "smollm2-135m", "--gpu", "rtx-4060-ti-16gb", "--json"])
    assert gguf.exit_code == catalog.exit_code == 0, gguf.output
    a, b = json.loads(gguf.stdout), json.loads(catalog.stdout)
    assert a["params"] == b["params"] and a["max_context"] == b["max_context"] == 8192
    assert [r["max_tokens"] for r in a["rows"]] == [r["max_tokens"] for r in b["rows"]]


def test_version_and_help_lines():
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"longctx {version('longctx')}"
    from longctx.cli.chat import HELP

    assert "/save\u00a0FILE" in HELP  # (a terminal's wrap never parts the command from its argument)


def test_plan_list_and_help():
    r = runner.invoke(app, ["plan", "--list"])
    assert r.exit_code == 0 and "llama-3.1-8b" in r.stdout and "rtx-4090" in r.stdout
    h = runner.invoke(app, ["plan", "--help"])
    assert h.exit_code == 0 and "Examples" in h.stdout and "longctx plan --model" in h.stdout


# ---------------------------------------------------------------------- chat (embedded model)
@pytest.fixture(scope="module")
def loaded():
    from longctx.models import load_model

    return load_model(None, device="cpu")


@pytest.fixture
def reuse_model(loaded, monkeypatch):
    """The chat command loads the embedded model through load_model: hand it the loaded one."""
    import longctx.models

    monkeypatch.setattr(longctx.models, "load_model", lambda *a, **k: loaded)
    return loaded


def test_chat_prompt_answers_once():
    r = runner.invoke(app, ["chat", "--prompt", "What is the capital of France?"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout


def test_repeating_answers_are_caught_and_sampling_follows_the_model():
    """The loop guard: a span repeated 3 times over at least 24 tokens (or one token 24 times)
    ends an answer; lists, a few repeats and short runs do not. The sampling defaults: the
    model's generation config where it samples, else greedy with 256 new tokens; options win."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from longctx.chat import SamplingConfig, repeating

    assert repeating([5] * 24) and not repeating([5] * 23)
    assert repeating([1, 2, 3, 4, 5, 6, 7, 8] * 3) and not repeating([1, 2, 3, 4, 5, 6, 7, 8] * 2)
    assert repeating([9, 9] + [1, 2, 3] * 8) and not repeating([9, 9] + [1, 2, 3] * 7)
    assert not repeating(list(range(100))) and not repeating([1, 2] * 11)
    assert repeating(list(range(40)) + list(range(64)) * 3)  # (the longest span looked for)
    greedy = SimpleNamespace(generation_config=GenerationConfig(bos_token_id=1, eos_token_id=2))
    assert SamplingConfig.for_model(greedy) == SamplingConfig(max_new_tokens=256, temperature=0.0, top_p=1.0)
    sampling = SimpleNamespace(generation_config=GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, max_new_tokens=100))
    assert SamplingConfig.for_model(sampling) == SamplingConfig(max_new_tokens=100, temperature=0.6, top_p=0.95)
    assert SamplingConfig.for_model(sampling, temperature=0, max_new_tokens=None) == SamplingConfig(100, 0.0, 0.95)


def test_piped_chat_answers_read_as_pairs(reuse_model):
    """Piped questions: each answer follows its question as "> question" and ends with a blank
    line, greedy by default (the embedded model's generation config does not sample)."""
    r = runner.invoke(app, ["chat", "--max-new-tokens", "12"], input="What is the capital of France?\nName a color.\n")
    assert r.exit_code == 0, r.output
    blocks = [b for b in r.stdout.split("\n\n") if b.strip()]
    assert [b.splitlines()[0] for b in blocks] == ["> What is the capital of France?", "> Name a color."], r.stdout
    assert "Paris" in blocks[0]


def test_chat_interactive_through_stdin(tmp_path, reuse_model):
    transcript = tmp_path / "t.md"
    script = f"Hello! Who are you?\n/stats\n/save {transcript}\n/reset\n/stats\nName a color.\n/exit\nnot read\n"
    r = runner.invoke(app, ["chat", "--temperature", "0", "--max-new-tokens", "16", "--kv-bits", "4", "--block-size", "16"], input=script)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("Cache and speed") == 2
    assert "conversation reset" in r.stdout
    text = transcript.read_text()
    assert "Hello! Who are you?" in text and "**assistant**" in text
    assert "Name a color" not in text  # saved before the second question
    tables = r.stdout.split("Cache and speed")
    assert "16 tokens" in tables[1]  # the first turn decoded 16 tokens
    assert "0 tokens, 0.0 tok/s" in tables[2] and "16 tokens" not in tables[2]  # after /reset: no figures of the forgotten turn
    assert "bytes on cpu" in tables[1] and "gpu" not in tables[1]  # (tiers by device)


def test_chat_saves_a_read_document_and_continues_from_it(tmp_path, reuse_model):
    """--file book --save-kv f, then --load-kv f: the same greedy answer without reading the
    document again (only the question is prefilled); /save-kv mid-chat keeps the turns too;
    `info f` says what a file holds; a damaged file is refused before the model loads."""
    import json as json_

    doc, kvc = tmp_path / "doc.txt", tmp_path / "doc.kvc"
    doc.write_text(" ".join(["The lighthouse keeper lit the lamp at dusk and wrote the ships in his log."] * 12), encoding="utf-8")
    ask = ["--prompt", "Who lit the lamp?", "--temperature", "0", "--max-new-tokens", "12"]
    first = runner.invoke(app, ["chat", "--file", str(doc), "--save-kv", str(kvc), *ask])
    assert first.exit_code == 0, first.output
    assert "saved" in first.stderr and kvc.exists()
    again = runner.invoke(app, ["chat", "--load-kv", str(kvc), *ask])
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout and "loaded in" in again.stderr
    info = json_.loads(runner.invoke(app, ["info", str(kvc), "--json"]).stdout)
    assert info["KV format"] == "int4" and info["conversation"] == "system" and info["tokens"] > 100
    turns = tmp_path / "turns.kvc"
    r = runner.invoke(app, ["chat", "--load-kv", str(kvc), "--temperature", "0", "--max-new-tokens", "6"],
                      input=f"Who lit the lamp?\n/save-kv {turns}\n/save-kv {tmp_path}\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "and the conversation to" in r.stdout and "could not save to" in r.stdout
    assert json_.loads(runner.invoke(app, ["info", str(turns), "--json"]).stdout)["conversation"] == "system, user, assistant"
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(kvc.read_bytes()[:-100])
    for args in (["chat", "--load-kv", str(bad)], ["chat", "--load-kv", str(kvc), "--file", str(doc)], ["info", str(bad)],
                 ["chat", "--save-kv", str(tmp_path), "--prompt", "hi"]):
        one_line_error(runner.invoke(app, args), args)


def test_chat_save_to_a_bad_path_says_so_and_the_chat_goes_on(tmp_path, reuse_model):
    transcript = tmp_path / "t.md"
    script = f"Hi.\n/save {tmp_path / 'no' / 'such' / 'dir.md'}\n/save {tmp_path}\nName a color.\n/save {transcript}\n/exit\n"
    r = runner.invoke(app, ["chat", "--temperature", "0", "--max-new-tokens", "6"], input=script)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("could not save to") == 2 and "the chat goes on" in r.stdout
    text = transcript.read_text()
    assert "Hi." in text and "Name a color." in text and text.count("**assistant**") == 2


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_conversation(tmp_path, reuse_model, monkeypatch):
    import longctx.chat

    real_sample, calls = longctx.chat.sample, {"n": 0}

    def sample_then_interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # Ctrl-C while the first answer streams
            raise KeyboardInterrupt
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(longctx.chat, "sample", sample_then_interrupt)
    transcript = tmp_path / "t.md"
    script = f"Tell me a long story about a dragon.\nName a color.\n/save {transcript}\n/exit\n"
    r = runner.invoke(app, ["chat", "--temperature", "0", "--max-new-tokens", "12"], input=script)
    assert r.exit_code == 0, r.output
    assert "(interrupted: the answer so far is kept)" in r.stdout
    text = transcript.read_text()
    answers = text.split("**assistant**")[1:]
    assert len(answers) == 2 and answers[0].strip()  # the cut answer (4 tokens) is kept
    assert "Name a color." in text and answers[1].strip()  # and the chat went on


def test_chat_max_context_refuses_what_does_not_fit_before_prefilling_it(tmp_path, reuse_model, monkeypatch):
    """A document longer than --max-context is refused before any of it is prefilled (one line,
    exit 2); in a chat, a turn that would not fit is refused, the cache keeps what it held, and
    the chat goes on."""
    import longctx.chat

    real_prefill, fed = longctx.chat.prefill, []

    def counting_prefill(model, cache, ids, **kwargs):
        fed.append(ids.shape[1])
        return real_prefill(model, cache, ids, **kwargs)

    monkeypatch.setattr(longctx.chat, "prefill", counting_prefill)
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(["the long report goes on"] * 600), encoding="utf-8")
    args = ["chat", "--file", str(doc), "--max-context", "2000", "--prompt", "Summarize."]
    line = one_line_error(runner.invoke(app, args), args)
    assert "--max-context is 2,000" in line and "document" in line and fed == []

    long_turn = " ".join(["and then"] * 200)
    script = f"Hi.\n{long_turn}\n/stats\nName a color.\n/exit\n"
    r = runner.invoke(app, ["chat", "--temperature", "0", "--max-new-tokens", "8", "--max-context", "200"], input=script)
    assert r.exit_code == 0, r.output
    assert "error: this turn needs" in r.stdout and "--max-context is 200" in r.stdout
    assert len(fed) == 2 and max(fed) < 100  # the two short turns, not the long one
    history = int(r.stdout.split("(history ")[1].split(",")[0])
    tokens_row = next(line for line in r.stdout.split("Cache and speed")[1].splitlines() if "│ tokens " in line)
    assert history == fed[0] + 8 and tokens_row.split("│")[2].strip() == str(history)  # the refusal changed nothing


def test_chat_warns_of_a_document_past_the_trained_context(tmp_path, reuse_model, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(["the long report goes on"] * 30), encoding="utf-8")
    args = ["chat", "--file", str(doc), "--prompt", "Summarize.", "--max-new-tokens", "2", "--temperature", "0"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    monkeypatch.setattr(reuse_model[0].config, "max_position_embeddings", 100)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    warning = " ".join(r.stderr.split())
    n = int(warning.split("makes the context ")[1].split(" tokens")[0].replace(",", ""))
    assert n > 150 and "past the model's trained context (100 positions)" in warning
    assert f"doc.txt: {n:,} tokens in the context" in warning  # the warning's count is what preload fed


def test_eval_passkey_table_json_and_what_it_says_of_the_prompt(reuse_model, monkeypatch):
    """The table prints whole at 80 columns and names the prompts' real length; --json gives every
    (format, depth); a length too short for a prompt is a one-line error; prompts past the model's
    trained context are run, with a warning."""
    args = ["eval", "passkey", "--tokens", "10"]
    assert "at least" in one_line_error(runner.invoke(app, args), args)

    r = runner80.invoke(app, ["eval", "passkey", "--tokens", "400", "--formats", "int4,int2+rot"])  # five depths
    assert r.exit_code == 0, r.output
    assert "exact (DynamicCache)" in r.stdout and "…" not in r.stdout and "warning" not in r.stderr
    title = next(line for line in r.stdout.splitlines() if "Passkey retrieval" in line)
    n = int(title.split("prompts of ")[1].split(" tokens")[0].replace(",", ""))
    assert 300 < n <= 400
    body = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in body] == ["exact (DynamicCache)", "int4", "int2+rot"]
    assert all(len(line.split("│")) == 8 for line in body)  # a cell a depth, none wrapped onto a second line

    monkeypatch.setattr(reuse_model[0].config, "max_position_embeddings", 200)
    r = runner.invoke(app, ["eval", "passkey", "--tokens", "400", "--depths", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    assert "past the model's trained context (200 positions)" in " ".join(r.stderr.split())
    rows = json.loads(r.stdout)
    assert [row["format"] for row in rows] == ["exact (DynamicCache)", "int4"] and all(row["prompt_tokens"] == n for row in rows)
    assert all(row["found"] == (row["key"] in row["answer"]) and row["depth"] == 0.5 for row in rows)


def test_files_and_options_are_checked_before_any_model_loads(tmp_path, monkeypatch):
    """`--file` and `--text` that are empty, binary, not UTF-8 or a directory, and option values
    no run could use, are one-line errors that say which, before a model is loaded."""
    import longctx.models

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(longctx.models, "load_model", no_model)
    empty, blank, binary, latin = (tmp_path / n for n in ("empty.txt", "blank.txt", "binary.bin", "latin.txt"))
    empty.write_bytes(b"")
    blank.write_bytes(b"  \n\n ")
    binary.write_bytes(bytes(range(256)) * 80)  # 20 KB with NUL bytes
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    cases = []
    for option, command in (("--file", ["chat", "--prompt", "hi"]), ("--text", ["eval", "quality"])):
        cases += [(command + [option, str(empty)], f"{option} {empty} is empty"),
                  (command + [option, str(blank)], "is empty (white space only)"),
                  (command + [option, str(binary)], "is not text: it holds NUL bytes"),
                  (command + [option, str(latin)], "is not UTF-8 text (invalid continuation byte at byte 3)"),
                  (command + [option, str(tmp_path)], f"{option} {tmp_path} is a directory"),
                  (command + [option, str(tmp_path / "missing.txt")], "no such file")]
    cases += [(["chat", "--prompt", "hi", "--chunk", "0"], "--chunk must be at least 1, got 0"),
              (["chat", "--prompt", "hi", "--temperature", "-1"], "--temperature must be at least 0"),
              (["chat", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
              (["eval", "quality", "--chunk", "0"], "--chunk must be at least 1, got 0"),
              (["eval", "quality", "--mode", "fast"], "--mode must be chunked, decode or both, got 'fast'"),
              (["eval", "quality", "--decode-tokens", "0"], "--decode-tokens must be at least 1, got 0"),
              (["eval", "passkey", "--tokens", "-5"], "--tokens must be at least 1, got -5")]
    for args, says in cases:
        line = one_line_error(runner.invoke(app, args), args)
        assert says in line, (args, line)


def test_eval_quality_refuses_a_text_it_could_not_measure_on(tmp_path, reuse_model):
    short, binary, enough = tmp_path / "short.txt", tmp_path / "binary.txt", tmp_path / "enough.txt"
    short.write_text("Hello world.", encoding="utf-8")
    binary.write_bytes(b"\xff\xfe not text")
    enough.write_text(" ".join(["The grass is green and the sky is blue."] * 20), encoding="utf-8")
    args = ["eval", "quality", "--text", str(short), "--formats", "int4"]
    assert "within one chunk of 128" in one_line_error(runner.invoke(app, args), args)
    args = ["eval", "quality", "--text", str(binary)]
    assert f"--text {binary} is not UTF-8 text" in one_line_error(runner.invoke(app, args), args)
    args = ["eval", "quality", "--text", str(enough), "--formats", "int4", "--chunk", "32"]
    assert "decode mode scores its last --decode-tokens 256" in one_line_error(runner.invoke(app, args), args)
    png = tmp_path / "quality.png"
    r = runner.invoke(app, [*args, "--decode-tokens", "16", "--plot", str(png), "--json"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(row["format"], row["mode"]) for row in rows] == [("exact (DynamicCache)", "chunked"), ("int4", "chunked"),
                                                              ("exact (DynamicCache)", "decode"), ("int4", "decode")]
    assert rows[1]["tokens"] > 32 and rows[1]["delta_pct"] != 0.0 and rows[1]["kl_mean"] > 0  # the pages were read back
    assert rows[0]["kl_max"] == 0 and rows[0]["top1"] == 1 and rows[3]["scored"] == 16 and 0 < rows[3]["top1"] <= 1
    md = runner.invoke(app, [*args, "--decode-tokens", "16", "--markdown"])  # README's table: the same figures
    assert md.exit_code == 0, md.output
    lines = [line for line in md.stdout.splitlines() if line.startswith("| int4 |")]
    assert [line.split(" | ")[1] for line in lines] == ["chunked", "decode"]
    for line, row in zip(lines, (rows[1], rows[3])):
        assert f"| {row['ppl']:.3f} | {row['delta_pct']:+.2f} % | {row['kl_mean']:.4f} |" in line, (line, row)
    assert "give --json or --markdown" in one_line_error(runner.invoke(app, [*args, "--json", "--markdown"]), args)


def test_eval_needle_grid_is_passkey_at_each_length_and_plots(tmp_path, reuse_model):
    """Each cell of the needle map is `eval passkey`'s run at that length and depth (the same
    key, the same answer); --plot draws a PNG heatmap."""
    png = tmp_path / "needle.png"
    r = runner.invoke(app, ["eval", "needle", "--formats", "int4", "--lengths", "300,600", "--depths", "0.25,0.75", "--plot", str(png), "--json"])
    assert r.exit_code == 0, r.output
    grids = json.loads(r.stdout)
    assert [g["format"] for g in grids] == ["exact (DynamicCache)", "int4"] and grids[1]["lengths"] == [300, 600]
    for i, n in enumerate((300, 600)):
        p = runner.invoke(app, ["eval", "passkey", "--formats", "int4", "--tokens", str(n), "--depths", "0.25,0.75", "--json"])
        assert p.exit_code == 0, p.output
        rows = json.loads(p.stdout)
        for g in grids:
            mine = [row for row in rows if row["format"] == g["format"]]
            assert [row["found"] for row in mine] == g["found"][i] and [row["answer"] for row in mine] == g["answers"][i]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    assert 0 <= grids[0]["accuracy"] <= 1
    one_line_error(runner.invoke(app, ["eval", "needle", "--depths", "2"]), "--depths 2")
    one_line_error(runner.invoke(app, ["eval", "needle", "--lengths", "4x"]), "--lengths 4x")


def test_chat_bad_inputs_are_one_line_errors(tmp_path):
    for args in (["chat", "--kv-bits", "3", "--prompt", "x"], ["chat", "--file", str(tmp_path / "missing.txt")],
                 ["chat", "--model", str(tmp_path / "none.gguf"), "--prompt", "x"], ["chat", "--device", "tpu"]):
        one_line_error(runner.invoke(app, args), args)


@pytest.mark.parametrize("fmt", [dict(bits=4), dict(bits=16), dict(k_bits=8, v_bits=4, rotate=True)])
def test_bench_copies_of_a_view_hold_its_values_in_their_own_memory(fmt):
    """The bench times a view's copies in turn to defeat the L2 cache: each must hold the same
    pages, sinks, table and tail, in memory of its own."""
    from longctx import KVConfig
    from longctx.bench import copy_view, synthetic_view, view_bytes, view_nbytes
    from longctx.ops.paged_attention import paged_attention

    one = synthetic_view(2, 300, 2, 64, KVConfig(block_size=16, **fmt), "cpu")
    two = copy_view(one)
    a = {**one.pages.tensors(), "sink_k": one.sink_k, "sink_v": one.sink_v, "table": one.block_table, "tail_k": one.tail_k, "tail_v": one.tail_v}
    b = {**two.pages.tensors(), "sink_k": two.sink_k, "sink_v": two.sink_v, "table": two.block_table, "tail_k": two.tail_k, "tail_v": two.tail_v}
    assert a.keys() == b.keys() and len(a) >= 7
    for name in a:
        assert torch.equal(a[name], b[name]) and a[name].data_ptr() != b[name].data_ptr(), name
    assert (two.n_sink, two.pages.fmt, view_bytes(two)) == (one.n_sink, one.pages.fmt, view_bytes(one))
    # what the bench sizes its copies by: a view's memory, known before it is drawn
    sized = synthetic_view(2, 300, 2, 64, KVConfig(block_size=16, **fmt), "meta")
    assert view_nbytes(sized) == view_nbytes(two) == sum(t.nbytes for t in b.values()) and view_bytes(sized) == view_bytes(one)
    q = torch.randn(2, 6, 1, 64, dtype=torch.bfloat16)
    assert torch.equal(paged_attention(q, two, backend="reference")[0], paged_attention(q, one, backend="reference")[0])


def _fake_gpu(monkeypatch, free: int, fail_at: int = 0, error=None) -> list[int]:
    """`bench decode` on this machine: a CUDA check that passes, `free` bytes of GPU memory, and
    timers that return 0.5 ms without running the kernels, recording how many copies each row
    timed; the `fail_at`-th timing raises `error` instead."""
    import longctx.bench.decode as bench

    copies: list[int] = []

    def timer(fn, n, reps):
        copies.append(n)
        if len(copies) == fail_at:
            raise error
        return 0.5

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "free_bytes", lambda device: free)
    monkeypatch.setattr(bench, "time_calls", timer)
    monkeypatch.setattr(bench, "time_graph", timer)
    return copies


def test_bench_decode_flash_attn_peer_meets_its_contract_and_reports_failures(monkeypatch):
    """`bench decode`'s flash-attn peer on this machine, with flash-attn's torch stand-in as the
    module: every copy's call passes the contract's checks (pages of 256 tokens, an int32 block
    table and lengths) and attends over the row's 300 tokens; a flash-attn that fails to run
    or to import gets a row that says so, with no time."""
    import sys
    import types

    import longctx.bench.decode as bench
    from longctx.testing import flash_kvcache_standin

    calls = []

    def fa(q, k, v, **kw):
        calls.append((tuple(k.shape), tuple(kw["block_table"].shape), tuple(kw["cache_seqlens"].tolist())))
        return flash_kvcache_standin(q, k, v, **kw)

    def timer(fn, n, reps):
        for i in range(n):
            assert fn(i).shape == (1, 1, 4, 64)
        return 0.5

    monkeypatch.setattr(bench, "free_bytes", lambda device: 1 << 40)
    q = torch.randn(1, 4, 1, 64).bfloat16()
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_with_kvcache=fa))
    row = bench._flash_attn_row(q, 300, 1, 2, 64, timer, 1)
    assert (row.name, row.ms, row.note, row.kv_bytes) == ("flash-attn paged bf16", 0.5, "", 2 * 300 * 2 * 64 * 2)
    assert len(calls) == 32 and set(calls) == {((2, 256, 2, 64), (1, 2), (300,))}

    def broken(*args, **kw):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_with_kvcache=broken))
    row = bench._flash_attn_row(q, 300, 1, 2, 64, timer, 1)
    assert row.ms != row.ms and row.note == "failed (RuntimeError: no kernel image is available for execution on the device)"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # (an ImportError, as from a build whose binding does not load)
    row = bench._flash_attn_row(q, 300, 1, 2, 64, timer, 1)
    assert row.ms != row.ms and row.note.startswith("failed (ImportError: "), row.note


def test_bench_decode_rows_that_do_not_fit_say_so_and_the_rest_are_timed(monkeypatch):
    """A row whose copies do not fit in the GPU's free memory is timed on fewer copies, or, when
    not even the fewest fit, has no time and a note of what it needed; the bench goes on with
    the rows after it, and the CLI shows the note and writes JSON nulls for the missing figures."""
    from longctx import KVConfig
    from longctx.bench import SLACK, bench_decode, synthetic_view, view_nbytes

    H, D, mib = 3, 64, 1024**2
    free = SLACK + 100 * mib
    copies = _fake_gpu(monkeypatch, free)
    cases = [(1024, 1), (1 << 20, 1), (65536, 1), (2048, 2)]
    rows = bench_decode(formats=("int4", "int8"), shape="smollm2-135m", cases=cases, graph=True, device="cpu")
    names = ["SDPA dense bf16", "longctx int4", "dequantize-all then SDPA (int4)", "longctx int8"]
    assert [(r.name, r.context, r.batch) for r in rows] == [(n, T, B) for T, B in cases for n in names]
    timed = [r for r in rows if r.ms == r.ms]
    assert [r.context for r in rows if r not in timed] == [1 << 20] * 4  # 768 MiB dense, 216 MiB int4: not in 100 MiB
    for r in rows:
        if r in timed:
            assert r.ms == 0.5 and r.note == "" and r.ratio_to_sdpa == 1.0
        else:
            assert r.ms != r.ms and r.ratio_to_sdpa != r.ratio_to_sdpa and r.note.startswith("out of GPU memory: needs ")
            assert r.note.endswith(f"{free / 1024**3:.1f} GiB free"), r.note
    assert rows[4].note.startswith("out of GPU memory: needs 1 copy of 0.8 GiB")  # one copy of a 768 MiB dense K/V would do
    assert rows[5].note.startswith("out of GPU memory: needs 2 copies of 0.2 GiB")
    assert len(copies) == len(timed)

    def need(r, n):  # the memory a timed row held: its copies, and one call's dense K/V for the dequantizing peer
        dense = 2 * r.batch * r.context * H * D * 2
        if r.name.startswith("SDPA"):
            return n * dense
        cfg = KVConfig(bits=4 if "int4" in r.name else 8, block_size=64)
        return n * view_nbytes(synthetic_view(r.batch, r.context, H, D, cfg, "meta")) + (dense if r.name.startswith("dequantize") else 0)

    for r, n in zip(timed, copies, strict=True):
        assert need(r, n) <= free - SLACK and (n == 32 or need(r, n + 1) > free - SLACK), (r.name, r.context, n)
    at_64k = [n for r, n in zip(timed, copies, strict=True) if r.context == 65536]
    assert at_64k[0] == 2 and all(n < 32 for n in at_64k), at_64k  # 2 copies of the 48 MiB dense K/V fit, not 32
    assert at_64k[2] < at_64k[1]  # the dequantizing peer: fewer int4 copies, beside one call's dense K/V
    # one copy of a K/V far beyond L2 is timed alone; the peer's int4 copies and its dense temporaries do not fit
    copies = _fake_gpu(monkeypatch, free := SLACK + 800 * mib)
    rows = bench_decode(formats=("int4",), shape="smollm2-135m", cases=[(1 << 20, 1)], graph=True, device="cpu")
    assert [r.ms == r.ms for r in rows] == [True, True, False] and copies == [1, 3], copies
    assert rows[2].note == f"out of GPU memory: needs 2 copies of 0.2 GiB + 0.8 GiB of temporaries + 0.5 GiB of workspace, {free / 1024**3:.1f} GiB free"


def test_bench_decode_goes_on_after_the_gpu_runs_out_of_memory(monkeypatch):
    """Out of memory while a row runs (also as the error a CUDA graph's capture ends in after a
    failed allocation): that row says so, the next are timed; any other error is raised."""
    from longctx.bench import bench_decode

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904 - as capture_end raises
    except RuntimeError as e:
        unwound = e
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), unwound, torch.OutOfMemoryError()):  # (no message)
        _fake_gpu(monkeypatch, 1 << 40, fail_at=3, error=error)  # SDPA, FlexAttention, then longctx int4
        rows = bench_decode(formats=("int4", "int8"), shape="smollm2-135m", cases=[(1024, 1), (2048, 1)], device="cpu")
        assert [r.ms == r.ms for r in rows] == [True, True, False, True, True] + [True] * 5
        assert rows[2].name == "longctx int4" and rows[2].note.startswith("out of GPU memory (") and type(error).__name__ in rows[2].note
    _fake_gpu(monkeypatch, 1 << 40, fail_at=3, error=RuntimeError("an error of the kernel's"))
    with pytest.raises(RuntimeError, match="of the kernel's"):
        bench_decode(formats=("int4",), shape="smollm2-135m", cases=[(1024, 1)], device="cpu")


def test_bench_decode_cli_shows_why_a_row_has_no_time(monkeypatch, tmp_path):
    import functools

    import longctx.bench as bench

    _fake_gpu(monkeypatch, bench.SLACK + 100 * 1024**2)
    monkeypatch.setattr(bench, "bench_decode", functools.partial(bench.bench_decode, device="cpu"))
    out = tmp_path / "rows.json"
    r = runner80.invoke(app, ["bench", "decode", "--cases", "1k:1,1024k:1", "--formats", "int8", "--shape", "smollm2-135m", "--graph", "--json", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for name, copies in (("SDPA dense bf16", "1 copy of 0.8 GiB"), ("longctx int8", "2 copies of 0.4 GiB")):
        note = f"out of GPU memory: needs {copies} + 0.5 GiB of workspace, 0.6 GiB free"
        assert any(line.startswith(f"  {name} ") and line.endswith("ctx 1048576 B1: " + note) for line in lines), r.stdout  # progress: one line
        assert any(line.startswith(f"│ {name} ") and "1,048,576" in line and note in line for line in lines), r.stdout  # the table's row, whole
    text = out.read_text()
    assert "NaN" not in text
    rows = json.loads(text)
    assert [(d["context"], d["ms"] is None) for d in rows] == [(1024, False), (1024, False), (1 << 20, True), (1 << 20, True)]
    assert rows[2]["note"].startswith("out of GPU memory") and rows[2]["tb_per_s"] is None and rows[0]["ratio_to_sdpa"] == 1.0


def test_bench_e2e_goes_on_after_a_cache_runs_out_of_memory(monkeypatch):
    """`bench e2e` where DynamicCache runs the GPU out of memory in its prefill (on a 24 GB card at
    128k): its row has no figures and says where it stopped, LongCtxCache's rows are measured
    (no ratio to a DynamicCache time that does not exist), and the CLI shows the note. Here on
    the CPU: a tiny model, CUDA's clock and memory calls stood in for, the out-of-memory error
    raised by DynamicCache's update past 400 tokens."""
    import time

    from transformers import DynamicCache

    import longctx.bench as bench
    import longctx.bench.e2e as e2e
    from longctx.testing import tiny_llama

    class Event:  # CUDA events on the host's clock
        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(e2e, "llama3_8b_shaped", lambda layers, max_positions, device: tiny_llama(layers=layers, heads=4, kv_heads=2, head_dim=64))
    update = DynamicCache.update
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    def full_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.get_seq_length(layer_idx) + key_states.shape[-2] > 400:
            raise error
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "update", full_update)
    kw = dict(context=640, formats=("int4", "int8"), new_tokens=6, chunk=128, layers=2, device="cpu", warmup=1, graphs=False, compiled=False)
    rows = bench.bench_e2e(**kw)
    assert [r.name for r in rows] == ["DynamicCache + SDPA", "LongCtxCache int4", "LongCtxCache int8"]
    dyn = rows[0]
    assert dyn.note == "out of GPU memory in prefill, at token 384 of 640", dyn.note  # chunks of 128: 384 + 128 > 400
    assert all(x != x for x in (dyn.prefill_s, dyn.decode_ms_per_token, dyn.ratio_decode, dyn.ratio_prefill)) and dyn.peak_gib == 3
    for r in rows[1:]:
        assert r.note == "" and r.prefill_s > 0 and r.decode_ms_per_token > 0 and r.ratio_decode != r.ratio_decode
    # another error is no shortage of memory: raised, not a note
    error = ValueError("a bug of the cache's")
    with pytest.raises(ValueError, match="a bug of the cache's"):
        bench.bench_e2e(**kw)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
    real = bench.bench_e2e
    monkeypatch.setattr(bench, "bench_e2e", lambda *a, **k: real(*a, **{**k, "device": "cpu", "warmup": 1}))
    r = runner80.invoke(app, ["bench", "e2e", "--context", "640", "--chunk", "128", "--layers", "2", "--new-tokens", "6", "--formats", "int4",
                              "--no-graphs", "--no-compiled"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "  DynamicCache + SDPA: out of GPU memory in prefill, at token 384 of 640, peak 3.0 GiB" in lines, r.stdout
    row = next(line for line in lines if line.startswith("│ DynamicCache + SDPA "))  # the table's row: every cell whole at 80 columns
    assert [c.strip() for c in row.strip("│").split("│")] == ["DynamicCache + SDPA", "640"] + [""] * 3 + ["3.0"] + [""] * 5 + [dyn.note], row
    assert "note" in r.stdout and "nan" not in r.stdout


def test_wide_tables_print_every_cell_whole_at_80_columns():
    """Rich fits a table to the console by cutting cells ("Dyn…"); at 80 columns (a narrow
    terminal, or any pipe, where rich assumes 80) bench e2e's eleven columns were all cut.
    `show_table` prints a table whole off a terminal, on its side on a terminal too narrow for
    it, and as rich does where it fits or where neither way fits."""
    import io

    from rich.console import Console

    from longctx.cli.tables import _table, show_table

    cols = ("cache",) + tuple(f"figure {i}" for i in range(10))
    rows = [(name,) + tuple(f"{k + i * 1.5:.2f}x" for i in range(10)) for k, name in enumerate(("DynamicCache + SDPA", "LongCtxCache int4 + CUDA graphs"))]

    def printed(show, rows=rows, terminal=True, width=80):
        f = io.StringIO()
        show(Console(file=f, width=width, force_terminal=terminal, color_system=None), rows)
        return f.getvalue()

    def ours(console, rows):
        show_table("bench", cols, rows, left=("cache",), console=console)

    def rich(console, rows):
        console.print(_table("bench", cols, rows, ("cache",)))

    def cells(line):
        return [c.strip() for c in line.strip("│").split("│")]

    assert "…" in printed(rich) and "…" in printed(rich, terminal=False)  # what rich alone does at 80 columns
    lines = printed(ours, terminal=False).splitlines()  # off a terminal: a line a row, at the table's width
    for row in rows:
        assert cells(next(line for line in lines if line.startswith("│ " + row[0]))) == list(row)
    lines = printed(ours).splitlines()  # a terminal: on its side, within 80 columns
    assert "…" not in "".join(lines) and max(map(len, lines)) <= 80
    for i, col in enumerate(cols[1:], 1):
        assert cells(next(line for line in lines if line.startswith(f"│ {col} "))) == [col] + [row[i] for row in rows]
    assert printed(ours, width=300) == printed(rich, width=300)  # it fits: as rich prints it
    many = [(f"a kernel of a long name {k}",) + row[1:] for k in range(12) for row in rows[:1]]
    assert printed(ours, many) == printed(rich, many)  # neither way fits 80 columns: rich's own


def test_sealing_share_spreads_the_sealing_steps_excess_over_a_block():
    from longctx.bench import sealing_share

    steps = [10.0, 10.2, 9.8, 10.0, 16.4, 10.1, 9.9]  # the fifth step sealed
    sealed = [False, False, False, False, True, False, False]
    extra, pct = sealing_share(steps, sealed, 64)
    assert extra == pytest.approx(6.4) and pct == pytest.approx(100 * 6.4 / (64 * 10.0))
    extra, pct = sealing_share(steps[:4] + [16.0, 18.0], sealed[:4] + [True, True], 16)  # two seals: their mean
    assert extra == pytest.approx(7.0) and pct == pytest.approx(100 * 7.0 / (16 * 10.0))
    assert all(math.isnan(x) for x in sealing_share(steps, [False] * 7, 64))  # no seal in the window
    assert all(math.isnan(x) for x in sealing_share([12.0], [True], 64))  # nothing to compare with
    with pytest.raises(ValueError):
        sealing_share(steps, sealed[:3], 64)  # one flag per step


def test_bench_decode_flash_backend_row(monkeypatch):
    """Where flash-attn imports, each quantized format gets a row of the `flash` backend over the
    same copies as its triton row (here flash-attn's torch stand-in on the CPU): every copy's call
    goes through the backend and gives the reference's output; a backend that fails to run gets
    a row that says so, with no time."""
    from longctx import KVConfig
    from longctx.bench import synthetic_view
    import longctx.bench.decode as bench
    from longctx.ops.paged_attention import api, flash, paged_attention
    from longctx.testing import flash_kvcache_standin

    calls = []

    def fa(*args, **kw):
        calls.append(kw.get("block_table") is not None)
        return flash_kvcache_standin(*args, **kw)

    monkeypatch.setattr(flash, "_kvcache_fn", lambda: fa)
    monkeypatch.setattr(api, "resolve_backend", lambda backend, q, d: backend)  # (the dispatch takes only CUDA tensors to flash)
    q = torch.randn(1, 4, 1, 64).half()
    views = [synthetic_view(1, 600, 2, 64, KVConfig(bits=2, rotate=True, k_span=16), "cpu", torch.float16, seed=s) for s in range(3)]
    want = [paged_attention(q, v, backend="reference", return_lse=False)[0] for v in views]

    def timer(fn, n, reps):
        for i in range(n):
            assert torch.allclose(fn(i)[0].float(), want[i].float(), atol=3e-3), i
        return 0.25

    row = bench._flash_backend_row(q, views, "longctx int2+rot", 600, 1, 1000, 1 << 20, 1 << 40, timer, 4)
    assert (row.name, row.ms, row.note) == ("longctx int2+rot, flash backend", 0.25, "") and calls.count(True) == 3

    def broken(*args, **kw):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(flash, "_kvcache_fn", lambda: broken)
    row = bench._flash_backend_row(q, views, "longctx int2+rot", 600, 1, 1000, 1 << 20, 1 << 40, timer, 4)
    assert row.ms != row.ms and row.note == "failed (RuntimeError: no kernel image is available for execution on the device)"
