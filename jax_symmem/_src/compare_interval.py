"""Interval arithmetic over polynomials with floordiv/mod/max/min atoms.

The solver relaxes an operation atom to a fresh variable bounded by its
interval (a superset of its values: proofs stay sound), and reads the sign of a
divisor or of a max/min operand from it. Unbounded ends are +-INF.
"""

from __future__ import annotations

import math
from typing import Mapping

from jax_symmem._src import poly as poly_lib
from jax_symmem._src.poly import Poly, Var

INF = math.inf


def _imul(x, y):
  c = [0 if (a == 0 or b == 0) else a * b for a in x for b in y]
  return min(c), max(c)


def _ipow(x, e: int):
  lo, hi = x
  vals = [lo ** e, hi ** e]
  if e % 2 == 0 and lo < 0 < hi:
    vals.append(0)
  return min(vals), max(vals)


def poly_interval(p: Poly, bounds: Mapping[str, tuple[int, int | None]]):
  lo = hi = 0
  for mono, c in p.terms:
    iv = (c, c)
    for atom, e in mono:
      iv = _imul(iv, _ipow(atom_interval(atom, bounds), e))
    lo, hi = lo + iv[0], hi + iv[1]
  return lo, hi


def atom_interval(a, bounds):
  if isinstance(a, Var):
    lo, hi = bounds.get(a.name, (1, None))
    return lo, (INF if hi is None else hi)
  x = poly_interval(a.operands[0], bounds)
  y = poly_interval(a.operands[1], bounds)
  if a.op == poly_lib.MAX:
    return max(x[0], y[0]), max(x[1], y[1])
  if a.op == poly_lib.MIN:
    return min(x[0], y[0]), min(x[1], y[1])
  if y[0] <= 0 <= y[1]:
    return -INF, INF
  if a.op == poly_lib.MOD:
    if y[0] > 0:
      return 0, (min(y[1] - 1, x[1]) if x[0] >= 0 else y[1] - 1)
    return y[0] + 1, 0
  if y[1] < 0:   # floordiv(p, q) == floordiv(-p, -q)
    x, y = (-x[1], -x[0]), (-y[1], -y[0])
  return _floordiv_interval(x, y)


def _fdiv(a, b):
  """floor(a / b) for b > 0, a and b possibly infinite (b = inf: the limit from a finite a)."""
  if b == INF:
    return 0 if a >= 0 else -1
  if a in (INF, -INF):
    return a
  return a // b


def _floordiv_interval(x, y):
  (pl, ph), (ql, qh) = x, y   # ql > 0
  lo = _fdiv(pl, qh) if pl >= 0 else _fdiv(pl, ql)
  hi = _fdiv(ph, ql) if ph >= 0 else _fdiv(ph, qh)
  return lo, hi
