"""Modeled peak memory over many shapes: the curves behind a memory-vs-length plot.

    curves = symmem.memory_curves(analysis, symmem.sweep(b=4, s=range(16, 1025, 16)),
                                  budget=160 * 2**20)
    plt.plot(curves.x("s"), curves.mib("baseline"))

Every figure is the jaxpr-level memory model's (see README: what the memory
model measures), computed with the same calls as `Analysis.baseline_peak_bytes`,
`Analysis.round_peak(0, ...)`, `Analysis.peak_bytes` and
`Analysis.static_peak_bytes`; nothing is compiled or run.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Iterable, Mapping

from jax_symmem._src import budget as budget_lib
from jax_symmem._src.errors import BudgetError


CURVES = ("baseline", "scheduled", "dispatched", "static")


def sweep(**dims: int | Iterable[int]) -> list[dict[str, int]]:
  """Every combination of the given dim values, last keyword varying fastest.

  `sweep(b=4, s=range(16, 65, 16))` -> [{'b': 4, 's': 16}, ..., {'b': 4, 's': 64}].
  """
  values = []
  for name, v in dims.items():
    if isinstance(v, numbers.Integral):   # NumPy integers too
      values.append([int(v)])
      continue
    items = list(v) if isinstance(v, Iterable) and not isinstance(v, (str, bytes)) else None
    if items is None or not all(isinstance(x, numbers.Integral) for x in items):
      raise TypeError(f"sweep({name}=...): give an int or an iterable of ints, got {v!r}")
    values.append([int(x) for x in items])
  names = list(dims)
  return [dict(zip(names, combo)) for combo in itertools.product(*values)]


@dataclasses.dataclass(frozen=True)
class MemoryCurves:
  """Modeled peaks (bytes) at each of `shapes`.

  baseline:   trace order, no rematerialization (`baseline_peak_bytes`).
  scheduled:  round 0, the symbolic schedule planned once, no rematerialization.
  dispatched: the peak of the round the op-by-op model picks under `budget`
              (`peak_bytes`, `choose_round`); None where no round fits the budget.
              `symmem.jit` picks by its prediction of XLA's figure and can run an
              earlier round (`Analysis.peak_bytes`).
  rounds:     that round (0: nothing evicted); None where no round fits.
  static:     the same pipeline planned at each exact shape (`static_peak_bytes`);
              None unless asked for (it replans per shape, seconds each).
  """
  shapes: tuple[Mapping[str, int], ...]
  budget: int | None
  baseline: tuple[int, ...]
  scheduled: tuple[int, ...]
  dispatched: tuple[int | None, ...]
  rounds: tuple[int | None, ...]
  static: tuple[int, ...] | None = None

  def x(self, dim: str) -> list[int]:
    """The values of one dim along the shapes (the x axis of a plot)."""
    return [shape[dim] for shape in self.shapes]

  def mib(self, curve: str) -> list[float]:
    """A curve in MiB, NaN where it has no value (a gap in a matplotlib line)."""
    if curve not in CURVES:
      raise ValueError(f"unknown curve {curve!r}; one of {CURVES}")
    values = getattr(self, curve)
    if values is None:
      return [float("nan")] * len(self.shapes)
    return [float("nan") if v is None else v / 2**20 for v in values]

  def round_changes(self) -> list[tuple[Mapping[str, int], int | None]]:
    """(shape, round) at the first shape and wherever the dispatched round changes."""
    changes = []
    for i, (shape, k) in enumerate(zip(self.shapes, self.rounds)):
      if i == 0 or k != self.rounds[i - 1]:
        changes.append((shape, k))
    return changes

  def __str__(self) -> str:
    head = "model's pick" + (f" ({self.budget / 2**20:.1f} MiB budget)" if self.budget else "")
    lines = ["modeled peak memory (jaxpr-level model, MiB)",
             f"  {'dims':<20} {'trace order':>12} {'scheduled':>10} {head:>30} {'round':>5}"
             + (f" {'static':>10}" if self.static is not None else "")]
    for i, shape in enumerate(self.shapes):
      dims = ", ".join(f"{k}={v}" for k, v in shape.items())
      disp = "over budget" if self.dispatched[i] is None else f"{self.dispatched[i] / 2**20:.1f}"
      k = "-" if self.rounds[i] is None else str(self.rounds[i])
      line = (f"  {dims:<20} {self.baseline[i] / 2**20:>12.1f} {self.scheduled[i] / 2**20:>10.1f} "
              f"{disp:>30} {k:>5}")
      if self.static is not None:
        line += f" {self.static[i] / 2**20:>10.1f}"
      lines.append(line)
    return "\n".join(lines)


def memory_curves(analysis, shapes: Iterable[Mapping[str, int]], *,
                  budget=budget_lib.ANALYSIS_BUDGET,
                  static: bool = False) -> MemoryCurves:
  """Modeled peaks of `analysis` at every shape in `shapes` (e.g. from `sweep`).

  budget: bytes or a size such as '200MiB', or None for no budget; default: the
  analysis's own `memory_budget`. With the analysis's budget, `dispatched[i]` equals
  `analysis.peak_bytes(**shapes[i])` (None where that raises BudgetError).
  static: also compute `static_peak_bytes` at every shape (slow: it replans).
  """
  shapes = tuple(dict(s) for s in shapes)
  if budget is budget_lib.ANALYSIS_BUDGET:
    budget = analysis.memory_budget
  else:
    budget = budget_lib.bytes_only(budget)
  baseline, scheduled, dispatched, rounds = [], [], [], []
  for dims in shapes:
    baseline.append(analysis.baseline_peak_bytes(**dims))
    scheduled.append(analysis.round_peak(0, dims))
    try:
      k = analysis.choose_round(dims, budget)
    except BudgetError:
      dispatched.append(None)
      rounds.append(None)
    else:
      dispatched.append(analysis.round_peak(k, dims))
      rounds.append(k)
  static_peaks = None
  if static:
    at_budget = (analysis if budget == analysis.memory_budget
                 else dataclasses.replace(analysis, memory_budget=budget))
    static_peaks = tuple(at_budget.static_peak_bytes(**dims) for dims in shapes)
  return MemoryCurves(shapes, budget, tuple(baseline), tuple(scheduled), tuple(dispatched),
                      tuple(rounds), static_peaks)
