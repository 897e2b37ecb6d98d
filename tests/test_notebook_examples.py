"""The shipped notebooks run top to bottom in a real Jupyter kernel (nbclient) with 2 CPU replicas."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
# jupyter_client imports ipykernel.kernelspec when it starts its first kernel; ipykernel 6 imports
# debugpy there, which sets PYDEVD_USE_FRAME_EVAL in this (the test) process. Imported before any
# test, so the hygiene fixture does not take that for a variable the test leaked.
pytest.importorskip("ipykernel.kernelspec")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECORD = (
    "import phalanx as _px\n"
    "open(os.path.join({out!r}, f'replica_{{_px.interactive.replica_id()}}_of_{{_px.interactive.num_replicas()}}'), "
    "'w').close()"
)


def _execute(name: str, tmp_path: Path, monkeypatch) -> tuple[list, set[str]]:
    """Runs examples/<name> with one extra cell at the end in which every replica records itself."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    out = tmp_path / "out"
    out.mkdir()
    nb.cells.insert(
        len(nb.cells) - 1 if name == "custom_loop.ipynb" else len(nb.cells),
        nbformat.v4.new_code_cell(RECORD.format(out=str(out))),
    )
    for key, value in {
        "PHALANX_LOG_ROOT": str(tmp_path / "logs"),
        "OMP_NUM_THREADS": "1",
        "KERAS_BACKEND": "torch",
        "CHECKPOINT_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return nb.cells, {p.name for p in out.iterdir()}


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def test_seed_notebook(tmp_path, monkeypatch):
    cells, recorded = _execute("seed_notebook.ipynb", tmp_path, monkeypatch)
    assert recorded == {"replica_0_of_2", "replica_1_of_2"}
    text = [_stdout(c) for c in cells if c.cell_type == "code"]
    distributed = next(t for t in text if "Time taken by distributed training" in t)
    normal = next(t for t in text if "Time taken by normal training" in t)
    for output in (distributed, normal):
        assert float(re.search(r"training : ([0-9.]+)", output).group(1)) > 0
        # Output appears once: each epoch's progress bar is shown once (replica 1's is in its log).
        assert [output.count(f"Epoch {e}/10") for e in range(1, 11)] == [1] * 10, output
        # Both models learn the digits: the seed's `y_train = y_train/255.0` (labels all 0 for the
        # loss, so a 10% accuracy) is gone.
        accuracy = float(re.findall(r"sparse_categorical_accuracy: ([0-9.]+(?:e[-+][0-9]+)?)", output)[-1])
        assert accuracy > 0.8, output
    started = [o.get("text", "") for c in cells for o in c.get("outputs", []) if o.get("name") == "stderr"]
    assert sum("phalanx: started replicas 1..1" in t for t in started) == 1


def test_custom_loop_notebook(tmp_path, monkeypatch):
    cells, recorded = _execute("custom_loop.ipynb", tmp_path, monkeypatch)
    assert recorded == {"replica_0_of_2", "replica_1_of_2"}
    text = "".join(_stdout(c) for c in cells if c.cell_type == "code")
    assert "replicas in sync: 2" in text and "restored: True" in text
    losses = [float(x) for x in re.findall(r"mean loss ([0-9.]+)", text)]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert float(re.search(r"training accuracy ([0-9.]+)", text).group(1)) > 0.9
    assert not any(p.name.startswith("replica") for p in (tmp_path / "logs").rglob("control"))
