import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before any
    # @triton.jit function is defined, so before longctx's kernels are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

# no test reaches out: a hub request goes to a closed local port and fails at once
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")

# converted GGUF models are kept for the session in a folder of its own, not the user's cache
# (the first load converts, the others read the copy)
if "LONGCTX_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LONGCTX_CACHE"] = tempfile.mkdtemp(prefix="longctx-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LONGCTX_CACHE"], True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
