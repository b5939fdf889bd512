"""Whether general inequality constraints can hold at all within their bounds."""

from __future__ import annotations

from jax_symmem._src import poly as poly_lib
from jax_symmem._src.compare_box import BoxProblem
from jax_symmem._src.compare_kernel import to_dict
from jax_symmem._src.compare_ordering import EQ, LE
from jax_symmem._src.compare_solver import PROBES, Solver, compare_polys, has_ops
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.poly import Poly


def feasibility(cons: Constraints) -> tuple[bool | None, str | None]:
  """(True, None) if a feasible point is found, (False, why) if none can exist, else (None, None)."""
  if not cons.inequalities:
    return True, None
  solver = Solver(poly_lib.ZERO, poly_lib.ZERO, cons)
  if any(solver.complete(env) is not None for env in solver.samples(solver.free_vars, PROBES)):
    return True, None
  for g in cons.inequalities:
    if _never_holds(solver, g, ()):
      return False, f"{g} >= 0 can never hold"
  for g in cons.inequalities:
    if _never_holds(solver, g, tuple(h for h in cons.inequalities if h != g)):
      return False, f"{g} >= 0 can never hold together with the other inequalities"
  return None, None


def _never_holds(solver: Solver, g: Poly, others: tuple[Poly, ...]) -> bool:
  """Proves g <= -1 wherever the box and the other inequalities hold."""
  if has_ops(g):
    return compare_polys(g, Poly.const(-1), Constraints(bounds=solver.cons.bounds)).kind in (LE, EQ)
  others = [h for h in others if not has_ops(h)]
  names = sorted(g.variables().union(*(h.variables() for h in others)))
  box = [solver.bound(v) for v in names]
  P = to_dict(g + 1, names)
  if not P:
    return False
  gs = [to_dict(h, names) for h in others]
  # The others may prove it (s <= t - 1 and t <= s - 1: t - s <= -1 and >= 1), as they
  # prove comparisons: else a comparison under them would prove anything, vacuously.
  return BoxProblem(solver.search, P, names, box, gs, None, multipliers=True).decide(False, True).le
