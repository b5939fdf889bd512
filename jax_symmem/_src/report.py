"""Human-readable reports of a shape graph."""

from __future__ import annotations

from jax_symmem._src import budget as budget_lib
from jax_symmem._src.ir import source_label
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.tracing import TracedProgram


def _graph_of(x) -> ShapeGraph:
  """The shape graph of a ShapeGraph, an Analysis (`.graph`) or a TracedProgram."""
  if isinstance(x, ShapeGraph):
    return x
  if isinstance(getattr(x, "graph", None), ShapeGraph):
    return x.graph
  if isinstance(x, TracedProgram):
    return ShapeGraph(x)
  raise TypeError(f"expected a ShapeGraph, TracedProgram or Analysis, got {type(x).__name__}")


def _mib(n: int) -> str:
  return f"{n / 2**20:,.1f} MiB"


def shape_report(graph, top: int = 8) -> str:
  """Dims, constraints, graph statistics, the largest values and how their sizes compare.

  `graph`: a `ShapeGraph`, or the `TracedProgram` / `Analysis` it comes from."""
  graph = _graph_of(graph)
  tp = graph.traced
  at = graph.report_dims()
  at_str = ", ".join(f"{k}={v}" for k, v in at.items())
  lines = [f"jax_symmem symbolic analysis of {tp.fun_name}",
           f"  dims:        {', '.join(tp.dims)}",
           f"  constraints: {graph.constraints}"]
  stats = graph.stats()
  lines.append("  graph:       " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in stats.items()))
  lines.append(f"\nlargest values (ranked at {at_str}):")
  rows = [("bytes (exact polynomial)", f"at {at_str}", "shape", "op", "source")]
  seen, largest = set(), []
  for v in graph.largest(len(graph.values), **at):
    size = graph.bytes(v.id)
    if size in seen:
      continue
    seen.add(size)
    largest.append(v)
    src = source_label(v.source, v.primitive) if v.primitive else "(argument)"
    rows.append((str(size), _mib(graph.evaluate(size, **at)), v.shape_str(), v.primitive or "input", src))
    if len(largest) == top:
      break
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  for r in rows:
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
  lines.append("\nexact comparisons between the largest sizes:")
  for i in range(min(len(largest), 4)):
    for j in range(i + 1, min(len(largest), 4)):
      a, b = graph.bytes(largest[i].id), graph.bytes(largest[j].id)
      lines.append(f"  {a}  vs  {b}:  {graph.compare(a, b)}")
  return "\n".join(lines)


def memory_report(analysis, shapes, budget=budget_lib.ANALYSIS_BUDGET) -> str:
  """Modeled peaks per shape: trace order, scheduled, and the round the op-by-op model
  picks under `budget` (bytes or a size such as '200MiB', None for none; default the
  analysis's own; `symmem.jit` picks by its prediction of XLA's figure: `peak_bytes`)."""
  import dataclasses
  from jax_symmem._src.errors import BudgetError
  budget = (analysis.memory_budget if budget is budget_lib.ANALYSIS_BUDGET
            else budget_lib.bytes_only(budget))
  a = dataclasses.replace(analysis, memory_budget=budget)
  head = "model's pick" + (f" (budget {_mib(budget)})" if budget else " (no budget)")
  lines = ["modeled peak memory per shape (jaxpr-level model, MiB):",
           f"  {'dims':<18} {'trace order':>12} {'scheduled':>12} {head:>34} {'round':>6}"]
  for dims in shapes:
    base = a.baseline_peak_bytes(**dims) / 2**20
    sched = a.round_peak(0, dims) / 2**20
    try:
      k = a.choose_round(dims, budget)
      disp, round_str = f"{a.round_peak(k, dims) / 2**20:>12.1f}", str(k)
    except BudgetError:
      disp, round_str = "over budget", "-"
    dims_str = ", ".join(f"{k}={v}" for k, v in dims.items())
    lines.append(f"  {dims_str:<18} {base:>12.1f} {sched:>12.1f} {disp:>34} {round_str:>6}")
  return "\n".join(lines)
