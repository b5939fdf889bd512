"""`.ci/run` runs the README's test command verbatim, then the slow tier."""

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
