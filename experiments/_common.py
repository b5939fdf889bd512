"""What the experiments share, one home each: units, the bytes of a tree, XLA's memory
figures, the real peak of DESIGN.md F3 and the budget rules built on it.

Imports only the standard library at module level (jax and jax_symmem load on first
use), so a driver that only starts measuring processes stays light.
"""

from __future__ import annotations

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


# --- budgets ------------------------------------------------------------------------------------


def budget_between(lo: int, hi: int, frac: float = 0.5) -> int:
  """The budget `frac` of the way from `lo` up to `hi` bytes, rounded down (halfway by default)."""
  return int(lo + frac * (hi - lo))


def budget_limit(budget: int) -> float:
  """The most a budgeted step's real (F3) peak may read and still count as within `budget`:
  budget x 1.05 + 8 MiB, the criterion of bench_remat, bench_models, soak and table1."""
  return budget * 1.05 + 8 * MiB
