"""The notebooks run headless on the embedded model (tools/run_notebooks.py, papermill), each
within CI's 3 minutes on 2 cores, and the committed ones hold their last run's outputs without
volatile metadata."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "tools"))


def outputs(path: Path) -> list[dict]:
    return [o for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def test_the_four_notebooks_are_committed_with_outputs_and_no_volatile_metadata(tmp_path):
    import shutil

    assert [p.name for p in NOTEBOOKS] == ["01_quality_per_bit.ipynb", "02_needle.ipynb", "03_capacity.ipynb", "04_speed.ipynb"]
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        params = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
        assert len(params) == 1, path.name  # one parameters cell, for papermill to inject after
        assert any("image/png" in o.get("data", {}) for o in outputs(path)), f"{path.name} has no chart from its last run"
        assert not [o for o in outputs(path) if o["output_type"] == "error"], path.name
        assert "papermill" not in nb["metadata"] and not any("papermill" in c["metadata"] or "execution" in c["metadata"] for c in nb["cells"])
    if importlib.util.find_spec("papermill") is not None:  # cleaning a clean notebook changes nothing
        from run_notebooks import clean

        copy = tmp_path / NOTEBOOKS[0].name
        shutil.copy(NOTEBOOKS[0], copy)
        clean(copy)
        assert json.loads(copy.read_text()) == json.loads(NOTEBOOKS[0].read_text())


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless_on_the_embedded_model(path, tmp_path):
    pytest.importorskip("papermill")
    from run_notebooks import run

    run(path, tmp_path / path.name, {}, timeout=180)  # raises on any cell error, or a cell past 3 minutes
    out = outputs(tmp_path / path.name)
    assert sum("image/png" in o.get("data", {}) for o in out) >= 1
    text = "".join(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", [])) for o in out)
    assert "ran on" in text
    if path.stem == "04_speed" and not text.count("ms, x"):  # no GPU: the shipped H100 JSON alone
        assert "the charts above are the shipped H100 run's" in text
