"""`.ci/run` runs the README's test command verbatim, then the slow tier, then the fast tests
of what reads JAX internals on the oldest and on the newest jax that pyproject.toml allows."""

from pathlib import Path
import re

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
  readme = (ROOT / "README.md").read_text()
  (command,) = re.findall(r"The tests:\n\n```bash\n(.*)\n```", readme)
  assert "python -m pytest -q" in command
  ci = (ROOT / ".ci" / "run").read_text()
  lines = [line for line in ci.splitlines() if line and not line.startswith("#")]
  readme_at = next(i for i, line in enumerate(lines) if command in line)
  slow_at = next(i for i, line in enumerate(lines) if "python -m pytest -q -m slow" in line)
  assert readme_at < slow_at


def test_ci_runs_the_jax_range_tests_on_the_oldest_and_newest_jax_pyproject_allows():
  pyproject = (ROOT / "pyproject.toml").read_text()
  ((oldest, below),) = re.findall(r'"jax>=([0-9.]+),<([0-9.]+)"', pyproject)
  assert f'"jaxlib>={oldest},<{below}"' in pyproject
  ci = (ROOT / ".ci" / "run").read_text()
  (line,) = [line for line in ci.splitlines() if f'"jax=={oldest}"' in line]
  assert f'"jaxlib=={oldest}"' in line and line.endswith("python -m pytest -q $JAX_RANGE_TESTS'")
  assert "tier bash .ci/newest_jax.sh $JAX_RANGE_TESTS" in ci.splitlines()
  # The tests of the modules that read JAX internals (README: Layout) are among them.
  (tests,) = re.findall(r'^JAX_RANGE_TESTS="([^"]+)"$', ci, re.M)
  assert {f"tests/test_{m}.py" for m in ("jax_dims", "tracing", "parse")} <= set(tests.split())
  assert all((ROOT / t).exists() for t in tests.split())
  # Its default is a release of the newest minor version the pin allows.
  (newest,) = re.findall(r"JAX_VERSION=\$\{JAX_VERSION:-([0-9.]+)\}",
                         (ROOT / ".ci" / "newest_jax.sh").read_text())
  major, minor = (int(x) for x in below.split(".")[:2])
  assert newest.startswith(f"{major}.{minor - 1}.")


def _anchors(text: str) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
  headings = re.findall(r"^#+ (.*)$", text, re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_docs_links_resolve():
  # README.md summarizes and links into experiments/RESULTS.md (the record) and back: a
  # section renamed or moved in one must not leave a dead link in the other.
  for doc in (ROOT / "README.md", ROOT / "experiments" / "RESULTS.md"):
    text = doc.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, doc
    for link in links:
      if link.startswith(("http://", "https://")):
        continue
      path, _, anchor = link.partition("#")
      target = (doc.parent / path).resolve() if path else doc
      assert target.exists(), f"{doc.name}: {link}"
      if anchor:
        assert anchor in _anchors(target.read_text()), f"{doc.name}: {link}"
