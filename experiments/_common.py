"""What the experiments share, one home each: units, the bytes of a tree, XLA's memory
figures, the real peak of DESIGN.md F3 and the budget rules built on it, calling a
symmem.jit step until its refinements are done and comparing its outputs, boolean flags,
and the envelope every results file is written in (`write_results`).

Flags are spelled as absl spells them, with underscores (`--max_len`, `--budget_mib`,
`--repeats`); a boolean flag `--x` is turned off with `--nox` (`add_bool_flag`).

Imports only the standard library at module level (jax and jax_symmem load on first
use), so a driver that only starts measuring processes stays light.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

MiB = 2**20

# Per-layer jax.checkpoint baselines compile with these options: without them XLA:CPU
# merges the recomputation back into the forward pass (DESIGN.md F1).
REMAT_FENCE_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


# --- bytes --------------------------------------------------------------------------------------


def tree_bytes(tree) -> int:
  """Bytes of the arrays (or ShapeDtypeStructs) in `tree`; leaves without a dtype count 0."""
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
                 if hasattr(x, "dtype")))


def xla_memory(compiled) -> dict:
  """XLA's `memory_analysis()` of a compiled executable, in bytes, with its footprint
  (arguments + outputs + temp - alias); {} where XLA reports none."""
  ma = compiled.memory_analysis()
  if ma is None:
    return {}
  return {"temp": ma.temp_size_in_bytes, "arguments": ma.argument_size_in_bytes,
          "outputs": ma.output_size_in_bytes, "alias": ma.alias_size_in_bytes,
          "footprint": (ma.argument_size_in_bytes + ma.output_size_in_bytes
                        + ma.temp_size_in_bytes - ma.alias_size_in_bytes)}


# --- the real peak (DESIGN.md F3) ---------------------------------------------------------------


def real_peak(spec: str, **kwargs) -> dict:
  """The real peak of workload `spec` ("module:function"), measured in a fresh process.

  The workload (run there by `jax_symmem.measure`) returns `(fn, args, extra)` with
  `extra["argument_bytes"] = tree_bytes(args)`. Returns its `extra` plus `peak_delta`
  (VmHWM - VmRSS around the warm call) and `real` = peak_delta + the argument bytes,
  which are resident before the call.
  """
  from jax_symmem import measure
  m = measure.measure(spec, **kwargs)
  return dict(m.extra, peak_delta=m.peak_delta, real=m.peak_delta + m.extra["argument_bytes"])


# --- calling a step -----------------------------------------------------------------------------


RTOL, ATOL = 1e-5, 1e-6   # trees_close's tolerance, which deviation counts elements against


def trees_close(a, b) -> bool:
  """Whether two pytrees of arrays agree leaf by leaf (rtol 1e-5, atol 1e-6; a NaN where
  the other has one too): the experiments' test of "equal to jax.jit's"."""
  import jax
  import numpy as np
  return all(np.allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL, equal_nan=True)
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def deviation(a, b) -> dict:
  """How far pytree `a` is from `b`, where `trees_close` says no: the largest |a - b| of
  a leaf over that leaf's largest |b| (worst leaf), the elements outside trees_close's
  tolerance and the largest difference among them; and the worst leaf among optax's
  first moments (leaves under a `mu` field): after one step from a fresh state they are
  (1 - b1) x the gradient, so they compare the gradients, before AdamW's update. That
  update is about lr x sign(gradient) on the first step: a gradient element near zero
  that rounds to the other sign moves its parameter by up to 2 x lr, so two correct
  programs that round differently (other kernels, other fusions) already differ there:
  jax.jit with XNNPACK's dots against without, scanned Llama at s=128 on this CPU, 216
  of 12.6 M elements, worst leaf 3.2e-3 (2026-12-04, ad hoc)."""
  import jax
  import numpy as np
  worst, off, total, largest, worst_mu = 0.0, 0, 0, 0.0, None
  paths = jax.tree_util.tree_flatten_with_path(b)[0]
  for x, (path, y) in zip(jax.tree_util.tree_leaves(a), paths):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    # NaN in both counts as equal (as in trees_close), NaN in one as infinitely far.
    d = np.where(np.isnan(x) & np.isnan(y), 0.0, np.abs(x - y))
    d[np.isnan(d)] = np.inf
    if d.size:
      leaf = float(d.max()) / (float(np.nanmax(np.abs(y), initial=0.0)) or 1.0)
      worst = max(worst, leaf)
      if any(getattr(k, "name", None) == "mu" for k in path):
        worst_mu = max(worst_mu or 0.0, leaf)
    outside = d > RTOL * np.nan_to_num(np.abs(y)) + ATOL
    off, total = off + int(outside.sum()), total + d.size
    largest = max(largest, float(d[outside].max()) if outside.any() else 0.0)
  return {"worst_leaf": worst, "elements_off": off, "elements": total, "largest_off": largest,
          "first_moment_worst_leaf": worst_mu}


def settle(step, args) -> dict:
  """Calls a symmem.jit step until its shape has nothing pending (`last_call["pending"]`),
  and returns the first call's record (with its compiles): a shape's later calls may
  compile rounds that recompute less (the refinement, one compile per call, at most
  MAX_RECOMPILES), and with `speed_trials=True` time two rounds in turn. Each output is
  dropped before the next call: held, it would count as other live arrays (reserved
  bytes), which a training loop's replaced state does not."""
  import jax
  from jax_symmem._src import speed_trial
  from jax_symmem._src import variants
  jax.block_until_ready(step(*args))
  first = dict(step.last_call, compiles=step.cache_info()["compiles"])
  for _ in range(variants.MAX_RECOMPILES + 3 + 2 * speed_trial.TIMED_CALLS):
    if not step.last_call.get("pending"):
      break
    jax.block_until_ready(step(*args))
  return first


def time_interleaved(fns: Mapping[str, Callable], args, passes: int) -> tuple[dict, dict]:
  """(median, min) seconds per step over `passes` interleaved passes, each step first
  warmed (compiled; a symmem.jit step `settle`d: its refinements done). The minimum is
  the figure least disturbed by other processes on a shared machine (noise only adds).
  Each pass starts one step later than the pass before: timed first in every pass, a
  step read 1.21 x jax.jit where timed last it read 1.05 (GPT-2 with LayerDrop, s=128,
  2026-12-03, ad hoc)."""
  import jax
  for fn in fns.values():
    if hasattr(fn, "cache_info"):
      settle(fn, args)
    else:
      jax.block_until_ready(fn(*args))
      jax.block_until_ready(fn(*args))
  times = {k: [] for k in fns}
  names = list(fns)
  for i in range(passes):
    for k in names[i % len(names):] + names[:i % len(names)]:
      fn = fns[k]
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t)
  return ({k: statistics.median(v) for k, v in times.items()},
          {k: min(v) for k, v in times.items()})


# --- budgets ------------------------------------------------------------------------------------


def budget_between(lo: int, hi: int, frac: float = 0.5) -> int:
  """The budget `frac` of the way from `lo` up to `hi` bytes, rounded down (halfway by default)."""
  return int(lo + frac * (hi - lo))


def model_near_xla(model: int, xla: int) -> bool:
  """Whether a modeled peak is within 10 % + 8 MiB of XLA's `memory_analysis()` footprint:
  issue 10's criterion, of bench_models and model_vs_xla."""
  return abs(model - xla) <= 0.1 * xla + 8 * MiB


def budget_limit(budget: int) -> float:
  """The most a budgeted step's real (F3) peak may read and still count as within `budget`:
  budget x 1.05 + 8 MiB, the criterion of bench_remat, bench_models, soak and table1."""
  return budget * 1.05 + 8 * MiB


# --- flags --------------------------------------------------------------------------------------


def add_bool_flag(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
  """`--name` and `--noname`, absl's spelling of a boolean flag; the last one given wins."""
  parser.add_argument(f"--{name}", dest=name, action="store_true", default=default,
                      help=f"{help} (default: {'on' if default else 'off'})")
  parser.add_argument(f"--no{name}", dest=name, action="store_false", default=default,
                      help=f"turn --{name} off")


# --- results files ------------------------------------------------------------------------------


def package_version(package: str) -> str | None:
  """The installed version of `package` (without importing it); None if absent."""
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def python_speed_us() -> float:
  """Microseconds this machine takes for a fixed pure-Python loop, as `python3 -m timeit
  -n 200 "sum(i*i for i in range(10000))"` reports it (best of 5): the same code's
  timings move with it, though not in proportion. This 2-core machine read 516 us one
  morning and 574-852 us that afternoon (2026-12-01), when the comparisons ran about 2.2x
  slower than the day before; later it read 476-498 us, and the comparisons still ran
  about 1.6x slower than the day before (experiments/bench_compare.py: 153 vs 96 us). A
  rough gauge, recorded beside every result: a figure far from an earlier one on a
  machine whose gauge moved is not a regression until an interleaved run says so."""
  import timeit
  loop = timeit.Timer("sum(i*i for i in range(10000))")
  return round(min(loop.repeat(repeat=5, number=200)) / 200 * 1e6, 1)


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages() -> bool:
  """Whether glibc's malloc in this process asks for transparent huge pages."""
  return HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def restart_with_huge_pages() -> None:
  """Restarts this process (same command line) with glibc's malloc asking the kernel for
  transparent huge pages, unless it does already or the kernel offers none.

  For step timings on the CPU: XLA:CPU allocates a step's large temporaries afresh on
  every call, glibc maps each from the kernel and the kernel zeroes it 4 KiB page by page
  on first touch, so with the default a step's time grows with its memory (the unrolled
  Llama at b=4, s=512: jax.jit 390-531 ms a step in three fresh processes, per-layer
  checkpointing 369-459; with huge pages 306-357 and 336-386, as their FLOPs order them;
  experiments/RESULTS.md, "Huge pages"). A device's pool allocator pays no such cost.
  Real peaks are measured without it (jax_symmem.measure drops the setting)."""
  mode = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
  if huge_pages() or not mode.exists() or "[never]" in mode.read_text():
    return
  tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES_TUNABLE]))
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  argv = ([sys.executable, "-m", spec.name] if spec is not None
          else [sys.executable, sys.argv[0]]) + sys.argv[1:]
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, argv, dict(os.environ, GLIBC_TUNABLES=tunables))


def environment(python_loop_us: float | None = None) -> dict:
  """Versions, platform, CPUs, load average and Python speed (`python_speed_us`, measured
  here unless given) of this machine (no host name), whether the planner evicts layers
  whole (`remat.LAYER_GROUPS`: JAX_SYMMEM_LAYER_GROUPS=0 turns it off) and whether malloc
  asks for huge pages (`restart_with_huge_pages`)."""
  from jax_symmem._src import remat
  return {"python": platform.python_version(), "jax": package_version("jax"),
          "jaxlib": package_version("jaxlib"), "flax": package_version("flax"),
          "platform": platform.platform(), "machine": platform.machine(),
          "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
          "python_loop_us": python_speed_us() if python_loop_us is None else python_loop_us,
          "layer_groups": remat.LAYER_GROUPS, "huge_pages": huge_pages()}


def command() -> str:
  """The command line this process runs (`python -m <module> ...` when run as a module)."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
  return shlex.join(head + sys.argv[1:])


def _git(*args: str, checkout=None) -> str | None:
  """`git args...`'s output in `checkout` (default: the one the experiments run from);
  None outside git."""
  try:
    out = subprocess.run(["git", *args], cwd=checkout or pathlib.Path(__file__).parent,
                         capture_output=True, text=True, check=False)
  except OSError:
    return None
  return out.stdout if out.returncode == 0 else None


def git_revision(checkout=None) -> str | None:
  """HEAD of `checkout` (default: the one the experiments run from); None outside git."""
  return (_git("rev-parse", "HEAD", checkout=checkout) or "").strip() or None


def uncommitted(checkout=None) -> list[str]:
  """Tracked files that differ from HEAD in `checkout` (default: the one the experiments run
  from), as `git status` lists them: a result measured with these is not HEAD's."""
  out = _git("status", "--porcelain", "--untracked-files=no", checkout=checkout) or ""
  return [line[3:] for line in out.splitlines()]


def run_python(code: str, args: list[str], env: Mapping[str, str] | None = None,
               cwd=None) -> dict:
  """Runs `python -c code *args` in a fresh process; its last line of output, as JSON.
  (`python -c` puts `cwd` first on sys.path.)"""
  out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd,
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"python -c ... {args} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def envelope(result: Mapping[str, Any]) -> dict:
  """`result` with the keys every results file shares in front: environment (with the
  result's own "environment" entries merged in), command, git_revision and date (UTC)."""
  own = result.get("environment", {})   # a benchmark that printed its speed gauge passes it
  head = {"environment": {**environment(own.get("python_loop_us")), **own},
          "command": command(), "git_revision": git_revision(),
          "uncommitted_changes": uncommitted(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  clash = (set(head) - {"environment"}) & set(result)
  if clash:
    raise ValueError(f"the result already has the envelope's keys {sorted(clash)}")
  return {**head, **{k: v for k, v in result.items() if k != "environment"}}


def write_results(path, result: Mapping[str, Any]) -> pathlib.Path:
  """Writes `envelope(result)` as JSON to `path` (making its directory); returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(envelope(result), indent=1, default=str) + "\n")
  return path


def run_workloads(names: str, run: Callable[[str], dict], out, **extra) -> list[dict]:
  """`run(name)` for each comma-separated name, rewriting `out` after each (a long run keeps
  what it measured) as {**extra, "results": [...]}; returns the results."""
  results = []
  for name in names.split(","):
    results.append(run(name))
    write_results(out, {**extra, "results": results})
  print(f"wrote {out}")
  return results
