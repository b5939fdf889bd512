"""The notebooks run headless (small configuration) and show their plots, plans and results.

notebooks/explore_step.ipynb: a flat step's shape graph, curves, plan and breakpoints;
notebooks/structured_models.ipynb: a scanned, an encoder-decoder and an annotated step.
The saved outputs are written by the same code path:

    python -m tests.test_notebook --write [structured_models.ipynb]
"""

import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "explore_step.ipynb"
STRUCTURED = NOTEBOOKS / "structured_models.ipynb"


@contextlib.contextmanager
def _environ(**values: str):
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
  """Runs `nb` in place, small configuration, on a kernel of this very interpreter.

  The "python3" kernel spec is written to a temporary JUPYTER_PATH entry (first
  in Jupyter's search order) with `sys.executable`, so the kernel runs this
  environment's Python whatever other kernels the machine has installed.
  """
  import nbclient
  from ipykernel import kernelspec
  with tempfile.TemporaryDirectory() as tmp:
    kernelspec.write_kernel_spec(os.path.join(tmp, "kernels", "python3"))
    jupyter_path = os.pathsep.join(p for p in (tmp, os.environ.get("JUPYTER_PATH")) if p)
    # The kernel runs in notebooks/: the checkout stays importable even if not pip-installed.
    python_path = os.pathsep.join(p for p in (str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH")) if p)
    with _environ(JUPYTER_PATH=jupyter_path, PYTHONPATH=python_path, JAX_SYMMEM_NOTEBOOK_SMALL="1",
                  MPLBACKEND="Agg"):
      client = nbclient.NotebookClient(
          nb, kernel_name="python3", timeout=timeout, record_timing=False,
          resources={"metadata": {"path": str(NOTEBOOK.parent)}})
      client.execute()
  return nb


def _text(cell) -> str:
  parts = []
  for out in cell.get("outputs", []):
    if out.output_type == "stream":
      parts.append(out.text)
    elif "data" in out:
      parts.append(out.data.get("text/plain", ""))
  return "".join(parts)


def _checked_code_cells(nb: nbformat.NotebookNode) -> list:
  """The code cells of the executed `nb`, each checked to have run, none with an error."""
  code_cells = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code_cells), "a code cell did not run"
  errors = [o for c in code_cells for o in c.outputs if o.output_type == "error"]
  assert not errors, errors
  return code_cells


def _images(code_cells) -> list:
  return [o for c in code_cells for o in c.outputs if "image/png" in o.get("data", {})]


@pytest.mark.slow   # a Jupyter kernel in a subprocess; the library calls it makes are tested fast
def test_notebook_runs_headless():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable); print(sys.prefix)"))
  start = time.perf_counter()
  execute(nb)
  elapsed = time.perf_counter() - start

  code_cells = _checked_code_cells(nb)
  executable, prefix = _text(code_cells[-1]).split()
  assert (executable, prefix) == (sys.executable, sys.prefix), "kernel ran another Python"

  text = "".join(_text(c) for c in code_cells)
  assert "SMALL=True" in text
  assert "largest values" in text                                  # the shape report
  assert "modeled peak memory" in text                             # the curves table
  assert "rematerialization plan for train_step" in text           # the plan
  assert "guard 'modeled peak of round 0" in text                  # ... with its guards
  assert "compare(scores, hidden): DEPENDS" in text and "for s in [" in text
  assert len(_images(code_cells)) == 2, "expected the memory plot and the breakpoint plot"
  assert elapsed < 120, f"notebook took {elapsed:.0f} s"


@pytest.mark.slow   # a kernel, three models traced and planned, two compiles
def test_structured_models_notebook_runs_headless():
  nb = nbformat.read(STRUCTURED, as_version=4)
  execute(nb)

  code_cells = _checked_code_cells(nb)
  text = "".join(_text(c) for c in code_cells)
  # 1. The scan pair's stacked residuals are in the plan, ranked by an exact DEPENDS.
  assert "evict scan residual" in text and "regenerated in the backward scan" in text
  assert re.search(r"compare\(probabilities, activation\): DEPENDS: .* for s in \[", text)
  # 2. Two lengths: undecided over the box, decided once s >= t is added.
  assert "compare(cross, self): DEPENDS" in text
  assert re.search(r"at least as long as targets: GE: ", text)
  # 3. Under the budget the short batch skips the user's recomputation, the long one
  # evicts, XLA's footprint of each stays within the budget, and the results are jax.jit's.
  budget = float(re.search(r"^budget ([0-9.]+) MiB", text, re.M).group(1))
  runs = re.findall(r"s=\s*(\d+): round (\d+)[^,]*, XLA footprint ([0-9.]+) MiB .*?; "
                    r"loss ([0-9.]+) \(jax.jit ([0-9.]+)\), largest difference of the updated "
                    r"state ([0-9.e+-]+)", text)
  assert [(int(s), int(k) > 0) for s, k, *_ in runs] == [(32, False), (512, True)], runs
  for _, _, xla_mib, loss, want_loss, diff in runs:
    assert float(xla_mib) <= budget
    assert float(loss) == pytest.approx(float(want_loss), abs=2e-6)
    assert float(diff) <= 1e-3   # AdamW's learning rate: see the notebook
  assert "'fallback_calls': 0" in text
  assert len(_images(code_cells)) == 2, "expected the rounds plot and the (s, t) maps"


def main(argv):
  if argv[1:2] != ["--write"]:
    sys.exit("usage: python -m tests.test_notebook --write [NAME.ipynb ...]   (re-executes and "
             "saves the notebooks named, default all)")
  for path in [NOTEBOOKS / name for name in argv[2:]] or [NOTEBOOK, STRUCTURED]:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    execute(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"executed and saved {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main(sys.argv)
