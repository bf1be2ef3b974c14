"""``examples/notebooks/quickstart.ipynb`` runs from top to bottom (nbclient, the ``python3`` kernel of the
environment running the tests) and shows what it promises: the hidden true reward rises under RLOO and
under PPO against the reward model it trains. The committed file carries no outputs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbclient  # nbclient, nbformat and ipykernel come with the `test` extra
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "quickstart.ipynb"
RESULT = re.compile(r"^(RLOO|PPO): hidden true reward before ([+-]\d\.\d+) -> after ([+-]\d\.\d+)$", re.M)


def test_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, (
            f"outputs left in cell:\n{cell.source[:200]}"
        )
    assert notebook.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.slow
def test_notebook_runs_and_the_true_reward_rises(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",  # jupyter_client starts it with this interpreter (sys.executable)
        timeout=600,  # per cell
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    seconds = time.perf_counter() - started
    printed = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream" and output.name == "stdout"
    )
    results = {name: (float(before), float(after)) for name, before, after in RESULT.findall(printed)}
    assert set(results) == {"RLOO", "PPO"}, printed[-2000:]
    for name, (before, after) in results.items():
        # 20 updates against the trained reward model: about 0.0 -> 0.5 (RLOO) and 0.0 -> 0.8 (PPO)
        assert after - before >= 0.2, (name, before, after)
    assert re.search(r"held-out pair accuracy 0\.9\d\d", printed), printed[:2000]
    print(f"notebook executed in {seconds:.1f} s: {results}")
