"""Compile every Triton kernel a GPU test run compiles, again for the GPUs users have.

The tests run on an H200 (sm_90), but longctx is for RTX 3090 (sm_86) and 4090 (sm_89) cards
too, and an A100 (sm_80). PTX that an sm_90 compile takes can be refused for those (bf16x2
arithmetic other than FMA needs sm_90), and a kernel's shared memory may pass sm_90's 227 KiB
a block and not their 99 KiB. As a pytest plugin this module wraps `triton.compiler.compile`:
each kernel variant the run compiles for the device is compiled once more per target in
LONGCTX_ARCHS (default 80,86,89), without loading it, and the outcome (error, or shared memory
against the target's limit) is written to $ARCH_REPORT (a folder, one JSON file a process) after
each test. The tests themselves run as before.

  ARCHS=80,86,89 OUT=$OUT/gt bash scripts/gpu_tests.sh tests/ops     # (gpu_tests.sh loads it)
  python3 scripts/arch_compile.py $OUT/gt/arch                        # the summary

LONGCTX_SHARED_LIMIT=101376 (bytes) also runs the launchers as on a card with that much shared
memory a block (TUNE["shared_limit"]: fewer stages where a kernel needs more), so that the
report shows what those cards compile.

Launches with programmatic dependent launch (TUNE["pdl"]) are not compiled for targets below
sm_90: the launcher asks for it only on sm_90 and later.
"""

import json
import os
import re
import sys
from pathlib import Path

# What CUDAOptions derives from the target: dropped, so that each target derives its own.
ARCH_DEPENDENT = ("arch", "supported_fp8_dtypes", "deprecated_fp8_dot_operand_dtypes", "max_num_imprecise_acc_default", "ptx_version")
# Shared memory one block may opt in to (CUDA's sharedMemPerBlockOptin), bytes.
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

_records: dict = {}
_test = None  # the test running (its node id)


def _constexprs(src) -> dict:
    """The compile's constexpr arguments by name (scalars as text), where the source says."""
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    out = {}
    for k, v in getattr(src, "constants", {}).items():
        i = k[0] if isinstance(k, tuple) and len(k) == 1 else None
        if names is not None and isinstance(i, int) and i < len(names) and names[i].isupper():
            out[names[i]] = v if isinstance(v, (bool, int, float, type(None))) else str(v)
    return out


def archs() -> list[int]:
    return [int(a) for a in os.environ.get("LONGCTX_ARCHS", "80,86,89").split(",") if a.strip()]


def install() -> None:
    """Wrap triton.compiler.compile (JITFunction takes it from there when it first runs on a device)."""
    import triton.compiler as C
    from triton.backends.compiler import GPUTarget

    real = C.compile
    if getattr(real, "also_for", None):
        return

    def compile(src, target=None, options=None, _env_vars=None):
        kernel = real(src, target=target, options=options, _env_vars=_env_vars)
        if target is None or target.backend != "cuda":
            return kernel
        opts = {k: v for k, v in (options or {}).items() if k not in ARCH_DEPENDENT}
        for arch in archs():
            key = f"{kernel.hash}:{arch}"
            if arch == target.arch or key in _records:
                continue
            rec = {"kernel": kernel.name, "arch": arch, "num_warps": opts.get("num_warps"), "num_stages": opts.get("num_stages"),
                   "device_shared": kernel.metadata.shared, "shared": None, "limit": SHARED_LIMIT.get(arch), "error": None, "skipped": None,
                   "test": _test, "constexprs": _constexprs(src)}
            if opts.get("launch_pdl") and arch < 90:
                rec["skipped"] = "programmatic dependent launch: sm_90 and later only"
            else:
                try:
                    rec["shared"] = real(src, target=GPUTarget("cuda", arch, target.warp_size), options=opts).metadata.shared
                except Exception as e:  # noqa: BLE001 (recorded, not raised: the test goes on)
                    rec["error"] = f"{type(e).__name__}: {e}"[-3000:]
            _records[key] = rec
        return kernel

    compile.also_for = archs()
    C.compile = compile


def pytest_configure(config):
    import torch

    if torch.cuda.is_available():
        install()
        if os.environ.get("LONGCTX_SHARED_LIMIT"):  # launch as on a card with this much shared memory a block
            from longctx.ops.paged_attention.triton import TUNE

            TUNE["shared_limit"] = int(os.environ["LONGCTX_SHARED_LIMIT"])


_written = 0


def _write() -> None:
    global _written
    if len(_records) == _written:
        return
    out = Path(os.environ.get("ARCH_REPORT", "arch_compile"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"arch-{os.getpid()}.json").write_text(json.dumps(list(_records.values()), indent=1))
    _written = len(_records)


def pytest_runtest_logstart(nodeid, location):
    global _test
    _test = nodeid


def pytest_runtest_logfinish(nodeid, location):
    _write()  # after each test, so that a run stopped by a time limit keeps what it compiled


def pytest_sessionfinish(session, exitstatus):
    _write()


def summary(folder: Path) -> int:
    """Print what the run's reports say; 1 if any variant failed or passed a limit."""
    recs = {}
    for f in sorted(folder.glob("arch-*.json")):
        for r in json.loads(f.read_text()):
            recs.setdefault((r["kernel"], r["arch"], r["num_warps"], r["num_stages"], r["device_shared"], r["error"], r["shared"]), r)
    bad = 0
    for arch in sorted({r["arch"] for r in recs.values()}):
        rs = [r for r in recs.values() if r["arch"] == arch]
        errors = [r for r in rs if r["error"]]
        over = [r for r in rs if r["shared"] is not None and r["limit"] is not None and r["shared"] > r["limit"]]
        skipped = [r for r in rs if r["skipped"]]
        top = max((r["shared"] for r in rs if r["shared"] is not None), default=0)
        print(f"sm_{arch}: {len(rs)} variants, {len(errors)} failed to compile, {len(over)} over {SHARED_LIMIT.get(arch)} bytes of "
              f"shared memory, {len(skipped)} skipped; most shared memory {top} bytes")
        firsts = {}
        for r in errors:
            lines = r["error"].splitlines() or [""]
            line = next((ln for ln in lines if re.search(r"error\s+:", ln)), next((ln for ln in lines if "rror" in ln), lines[0]))
            firsts.setdefault((r["kernel"], line.strip()[:200]), 0)
            firsts[(r["kernel"], line.strip()[:200])] += 1
        for (kernel, line), n in sorted(firsts.items()):
            print(f"  FAILED {kernel} ({n} variants): {line}")
        for r in over:
            print(f"  SHARED {r['kernel']} warps {r['num_warps']} stages {r['num_stages']}: {r['shared']} bytes (sm_90: {r['device_shared']}), "
                  f"first in {r.get('test')}: {r.get('constexprs')}")
        bad += len(errors) + len(over)
    if not recs:
        print(f"no reports in {folder}")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "arch_compile")))
