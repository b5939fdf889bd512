"""Exact comparison of dimension polynomials over integer boxes.

`compare(lhs, rhs, constraints=...)` decides the sign of `lhs - rhs` at every
integer assignment allowed by the constraints (every dimension >= 1):

* GE / LE / EQ are proofs, never guesses: each comes from a sound test over a
  box that contains every allowed point (dividing out a common monomial,
  same-sign coefficients, exact univariate sign pieces, shifted coefficients,
  Bernstein coefficients with subdivision at integer midpoints);
* DEPENDS comes with two witnesses: full assignments that satisfy every
  constraint, at which the *original* `lhs - rhs` was evaluated exactly;
* UNKNOWN means out of budget or out of methods; it is never a claim.

Everything is Python int arithmetic (DESIGN.md F9: sympy's Mod/floor
simplification is wrong in places, JAX's `_evaluate` wraps at int32). The
order of the tests is by cost, so a scheduler can call this in its inner loop
(DESIGN.md F10, experiments/bench_compare.py): on realistic byte sizes about
half the pairs are settled by two witnesses among the box corners, most of the
rest by the coefficient tests or one box of Bernstein coefficients.

Operation atoms (floordiv/mod/max/min) are rewritten into plain polynomials
over a box that contains every allowed point (see `compare_solver.Solver._atoms`);
general inequality constraints prune boxes, and on plain polynomials also prove
(lhs - rhs minus a multiple of one, `BoxProblem._by_multipliers`). Neither ever
makes a claim unsound: proofs hold on a superset, witnesses are checked on the
original expressions.

This module is the public entry point and input normalization; the procedure
lives in one-way layers below it:

  compare_ordering     Ordering, its Kind, Piece (what an answer is)
  compare_kernel       integer polynomials as {exponents: coeff}: shifts, Bernstein
  compare_univariate   exact integer sign pieces in one variable
  compare_interval     interval arithmetic over operation atoms
  compare_box          BoxProblem: the sign of a pure polynomial over a box
  compare_solver       Solver: reduction, atoms, witnesses; compare_polys (memoized)
  compare_feasibility  whether general inequalities can hold at all
"""

from __future__ import annotations

import functools
from typing import Iterable

from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import jax_dims
from jax_symmem._src.compare_feasibility import feasibility
from jax_symmem._src.compare_ordering import DEPENDS, EQ, GE, LE, UNKNOWN, Kind, Ordering, Piece
from jax_symmem._src.compare_solver import compare_polys
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.errors import InfeasibleConstraintsError
from jax_symmem._src.poly import Poly

__all__ = [
    "DEPENDS", "EQ", "GE", "LE", "UNKNOWN", "Kind", "Ordering", "Piece", "check_feasible",
    "clear_caches", "compare", "compare_polys", "is_feasible",
]


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------
def compare(lhs, rhs, *, constraints: constraints_lib.ConstraintsLike = ()) -> Ordering:
  """Compares two dimension expressions over all dims allowed by `constraints`.

  `lhs`, `rhs`: a Poly, an int, a JAX symbolic dimension, or a string in
  jax.export syntax ("4*b*s*11008", "b*s^2", "floordiv(s, 2)"). A JAX dimension's
  scope brings its constraints along (`jax.export.symbolic_shape(..., constraints=...)`).
  `constraints`: strings such as ("s <= 4096", "s == 128*k") or a `Constraints`;
  ConstraintError where they allow no dims at all.
  """
  lp, rp = _as_poly(lhs), _as_poly(rhs)
  scoped = jax_dims.scope_constraints(lhs) + jax_dims.scope_constraints(rhs)
  if scoped:   # as JAX decides for the dim: within its scope's constraints
    given = constraints.source if isinstance(constraints, Constraints) else tuple(constraints or ())
    constraints = tuple(dict.fromkeys(given + scoped))
  cons = _as_constraints(constraints, lp.variables() | rp.variables())
  # No allowed dims at all would make any answer vacuously true: refused where known.
  feasible = _feasible_or_raise(cons) if cons.inequalities else True
  o = compare_polys(lp, rp, cons)
  if feasible is None and o.method == "multipliers":
    # Proved from inequalities that may allow no point at all: perhaps only vacuously.
    return Ordering.of(UNKNOWN, lp, rp, None, None, None, (), "unproven")
  return o


def is_feasible(constraints: constraints_lib.ConstraintsLike) -> bool | None:
  """True if some assignment satisfies `constraints`, False if none can, None if undecided.
  Constraints that cannot be parsed raise ConstraintError."""
  try:
    cons = _as_constraints(constraints, ())
  except InfeasibleConstraintsError:   # bounds or equalities that contradict each other
    return False
  return feasibility(cons)[0]


def check_feasible(constraints: constraints_lib.ConstraintsLike) -> None:
  """Raises ConstraintError when a general inequality can never hold within the bounds.

  Bounds and equalities are checked by `parse_constraints` already; this catches
  e.g. "b*s >= 100000" with b <= 64 and s <= 1024, which would otherwise make
  every comparison vacuously true.
  """
  _feasible_or_raise(_as_constraints(constraints, ()))


def _feasible_or_raise(cons: Constraints) -> bool | None:
  """`feasibility`'s verdict: True, or None (undecided); InfeasibleConstraintsError for False."""
  ok, why = feasibility(cons)
  if ok is False:
    box = ", ".join(f"{lo} <= {v}" + (f" <= {hi}" if hi is not None else "")
                    for v, lo, hi in cons.bounds)
    raise InfeasibleConstraintsError(
        f"{why} within the bounds {box} (constraints: {', '.join(cons.source)}); "
        "relax the constraint or widen the bounds")
  return ok


# --------------------------------------------------------------------------
# Input normalization (cached; plain polynomials skip jax.export, see parse.py)
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=1 << 12)
def _parse_cached(expr: str) -> Poly:
  return jax_dims.parse(expr)


def _as_poly(x) -> Poly:
  return _parse_cached(x) if isinstance(x, str) else jax_dims.to_poly(x)


def _as_constraints(c: constraints_lib.ConstraintsLike, variables: Iterable[str]) -> Constraints:
  # A Constraints object is used as given: variables it does not bound are
  # in [1, inf) by `Constraints.lower/upper`, exactly what re-parsing would add.
  if isinstance(c, Constraints):
    return c
  # Normalization is cached by the constraint strings (constraints.normalize).
  return constraints_lib.parse_constraints(() if c is None else c, variables=variables)


def clear_caches() -> None:
  """Empties every cache on the way from strings to an answer (for fresh timings and tests)."""
  compare_polys.cache_clear()
  _parse_cached.cache_clear()
  constraints_lib.normalize.cache_clear()
