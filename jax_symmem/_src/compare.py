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
over a box that contains every allowed point (see `_Solver._atoms`); general
inequality constraints prune boxes. Neither ever makes a claim unsound: proofs
hold on a superset, witnesses are checked on the original expressions.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import random
from typing import Callable, Iterable, Mapping, Sequence

from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import poly as poly_lib
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.errors import ConstraintError
from jax_symmem._src.poly import OpAtom, Poly, Var

GE = "GE"
LE = "LE"
EQ = "EQ"
DEPENDS = "DEPENDS"
UNKNOWN = "UNKNOWN"

# Boxes (Bernstein evaluations, univariate splits) one comparison may spend.
_BOX_BUDGET = 4000
# max/min atoms split into cases at most this deep; deeper ones are relaxed.
_MAX_CASE_DEPTH = 6
# Random probes of the original expression when the proofs leave a sign open.
_PROBES = 48
# Points one box problem passes on as witness candidates (relaxed ones rarely verify).
_REPORTS = 16
# Upper cap on the finite part of an unbounded dimension's range.
_MAX_CAP = 1 << 40


@dataclasses.dataclass(frozen=True)
class Piece:
  """A maximal run of integers `lo..hi` of one dimension where sign(lhs - rhs) is `sign`."""
  lo: int
  hi: int | None   # None: unbounded above
  sign: int        # -1, 0 or +1

  def contains(self, x: int) -> bool:
    return self.lo <= x and (self.hi is None or x <= self.hi)

  def describe(self, dim: str) -> str:
    rel = {1: "lhs > rhs", 0: "lhs == rhs", -1: "lhs < rhs"}[self.sign]
    if self.hi is None:
      return f"{rel} for {dim} >= {self.lo}"
    if self.lo == self.hi:
      return f"{rel} at {dim} = {self.lo}"
    return f"{rel} for {dim} in [{self.lo}, {self.hi}]"


@dataclasses.dataclass(frozen=True)
class Ordering:
  """The answer of `compare`: how `lhs` and `rhs` are ordered over all allowed dims.

  `kind` is GE, LE, EQ (proofs), DEPENDS (two verified witnesses) or UNKNOWN.
  Witnesses are full assignments (eliminated dimensions included) that satisfy
  the constraints; DEPENDS always has both, GE/LE have one when it was found on
  the way. When one dimension alone decides the sign (the others divide out),
  `dim` names it and `pieces` gives the exact sign on every integer of its range.
  """
  kind: str
  lhs: Poly
  rhs: Poly
  witness_gt: Mapping[str, int] | None = None
  witness_lt: Mapping[str, int] | None = None
  dim: str | None = None
  pieces: tuple[Piece, ...] = ()
  method: str = ""

  @property
  def decided(self) -> bool:
    return self.kind != UNKNOWN

  @property
  def breakpoints(self) -> tuple[int, ...]:
    """The first integer of every piece but the first: where sign(lhs - rhs) changes."""
    return tuple(p.lo for p in self.pieces[1:])

  def sign_at(self, value: int) -> int | None:
    """sign(lhs - rhs) at `dim = value`, from the pieces (None if not covered)."""
    for p in self.pieces:
      if p.contains(value):
        return p.sign
    return None

  def __str__(self) -> str:
    if self.pieces and self.kind != UNKNOWN:
      return f"{self.kind}: " + "; ".join(p.describe(self.dim) for p in self.pieces)
    if self.kind == DEPENDS:
      return (f"DEPENDS: lhs > rhs at {_fmt_env(self.witness_gt)}; "
              f"lhs < rhs at {_fmt_env(self.witness_lt)}")
    if self.kind == UNKNOWN:
      return f"UNKNOWN: cannot decide {self.lhs} vs {self.rhs} ({self.method})"
    rel = {GE: ">=", LE: "<=", EQ: "=="}[self.kind]
    return f"{self.kind}: {self.lhs} {rel} {self.rhs} for all allowed dimensions"


class _FrozenEnv(dict):
  """A read-only dict (witnesses are shared through the cache); pickles and JSON-dumps as a dict."""

  def _read_only(self, *args, **kwargs):
    raise TypeError("a witness assignment is read-only; copy it with dict(...)")

  __setitem__ = __delitem__ = __ior__ = _read_only
  clear = pop = popitem = setdefault = update = _read_only

  def __reduce__(self):
    return (_FrozenEnv, (dict(self),))


def _fmt_env(env: Mapping[str, int] | None) -> str:
  return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) if env else "-"


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------
def compare(lhs, rhs, *, constraints: constraints_lib.ConstraintsLike = ()) -> Ordering:
  """Compares two dimension expressions over all dims allowed by `constraints`.

  `lhs`, `rhs`: a Poly, an int, a JAX symbolic dimension, or a string in
  jax.export syntax ("4*b*s*11008", "b*s^2", "floordiv(s, 2)").
  `constraints`: strings such as ("s <= 4096", "s == 128*k") or a `Constraints`.
  """
  lp, rp = _as_poly(lhs), _as_poly(rhs)
  cons = _as_constraints(constraints, lp.variables() | rp.variables())
  return compare_polys(lp, rp, cons)


@functools.lru_cache(maxsize=1 << 16)
def compare_polys(lhs: Poly, rhs: Poly, constraints: Constraints) -> Ordering:
  """The memoized core of `compare` (all arguments hashable, already normalized)."""
  return _Solver(lhs, rhs, constraints).run()


def is_feasible(constraints: constraints_lib.ConstraintsLike) -> bool | None:
  """True if some assignment satisfies `constraints`, False if none can, None if undecided."""
  return _feasibility(_as_constraints(constraints, ()))[0]


def check_feasible(constraints: constraints_lib.ConstraintsLike) -> None:
  """Raises ConstraintError when a general inequality can never hold within the bounds.

  Bounds and equalities are checked by `parse_constraints` already; this catches
  e.g. "b*s >= 100000" with b <= 64 and s <= 1024, which would otherwise make
  every comparison vacuously true.
  """
  cons = _as_constraints(constraints, ())
  ok, why = _feasibility(cons)
  if ok is False:
    box = ", ".join(f"{lo} <= {v}" + (f" <= {hi}" if hi is not None else "")
                    for v, lo, hi in cons.bounds)
    raise ConstraintError(
        f"{why} within the bounds {box} (constraints: {', '.join(cons.source)}); "
        "relax the constraint or widen the bounds")


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


# --------------------------------------------------------------------------
# Polynomial kernel: {exponent tuple: int} over an ordered var list
# --------------------------------------------------------------------------
def _to_dict(p: Poly, names: Sequence[str]) -> dict[tuple[int, ...], int]:
  index = {n: i for i, n in enumerate(names)}
  out = {}
  for mono, c in p.terms:
    e = [0] * len(names)
    for atom, k in mono:
      e[index[atom.name]] = k
    out[tuple(e)] = c
  return out


def _eval(P: Mapping[tuple[int, ...], int], x: Sequence[int]) -> int:
  total = 0
  for e, c in P.items():
    for xi, ei in zip(x, e):
      if ei:
        c *= xi ** ei
    total += c
  return total


def _sign(v: int) -> int:
  return (v > 0) - (v < 0)


@functools.lru_cache(maxsize=4096)
def _expansion(e: int, a: int, s: int) -> tuple[int, ...]:
  """Coefficients of y^k in (a + s*y)^e."""
  return tuple(math.comb(e, k) * a ** (e - k) * s ** k for k in range(e + 1))


def _shift(P, origin: Sequence[int], signs: Sequence[int]):
  """P(origin + signs*y) as a polynomial in y (an exact Taylor shift)."""
  out: dict[tuple[int, ...], int] = {}
  for e, c in P.items():
    parts = [((), c)]
    for ej, a, s in zip(e, origin, signs):
      if ej == 0:
        parts = [(t + (0,), v) for t, v in parts]
      else:
        ex = _expansion(ej, a, s)
        parts = [(t + (k,), v * f) for t, v in parts for k, f in enumerate(ex) if f]
    for t, v in parts:
      out[t] = out.get(t, 0) + v
  return {t: v for t, v in out.items() if v}


@functools.lru_cache(maxsize=1 << 14)
def _bmatrix(n: int, a: int, w: int) -> tuple[tuple[int, ...], ...]:
  """Row i: the degree-n Bernstein coefficient i of x^e on [a, a+w], times n! (exact ints)."""
  f = [math.factorial(k) * math.factorial(n - k) for k in range(n + 1)]
  return tuple(
      tuple(sum(math.comb(e, k) * a ** (e - k) * w ** k * math.comb(i, k) * f[k]
                for k in range(min(i, e) + 1)) for e in range(n + 1))
      for i in range(n + 1))


class _Dense:
  """A polynomial as a flat coefficient tensor, for Bernstein coefficients on boxes."""

  def __init__(self, P, degs: Sequence[int]):
    self.degs = tuple(degs)
    self.strides, self.size, self.corner_index = _layout(self.degs)
    self.coeffs = [0] * self.size
    for e, c in P.items():
      self.coeffs[sum(map(operator.mul, e, self.strides))] = c

  def bernstein(self, box: Sequence[tuple[int, int]]) -> list[int]:
    """Bernstein coefficients on `box` (a positive multiple: signs are exact)."""
    t = self.coeffs
    for (lo, hi), n, stride in zip(box, self.degs, self.strides):
      t = _apply_axis(t, _bmatrix(n, lo, hi - lo), n, stride, self.size)
    return t

  def split_axis(self, B: list[int], box) -> int:
    """The axis along which the Bernstein coefficients vary most (a splittable one).

    Splitting there shrinks the coefficient range fastest; splitting the widest
    axis instead wastes boxes when a narrow axis (b <= 64 vs s <= 4096) carries
    the sign change.
    """
    best, best_j = -1, None
    for j, (n, stride) in enumerate(zip(self.degs, self.strides)):
      if box[j][1] - box[j][0] < 1:
        continue
      period = stride * (n + 1)
      var = max((abs(B[i + stride] - B[i]) for i in range(self.size) if i % period < stride * n),
                default=0)
      if var > best:
        best, best_j = var, j
    return best_j


@functools.lru_cache(maxsize=256)
def _layout(degs: tuple[int, ...]):
  """Strides, size and corner entries ((bits, flat index), ...) of a tensor with these degrees."""
  strides = []
  size = 1
  for d in reversed(degs):
    strides.append(size)
    size *= d + 1
  strides.reverse()
  corners = tuple((bits, sum(st * d for b, st, d in zip(bits, strides, degs) if b))
                  for bits in itertools.product((0, 1), repeat=len(degs)))
  return tuple(strides), size, corners


def _apply_axis(t: list[int], M, n: int, stride: int, size: int) -> list[int]:
  """Multiplies every fiber of the flat tensor `t` along one axis by the matrix M."""
  out = [0] * size
  block = stride * (n + 1)
  mul = operator.mul
  for base in range(0, size, block):
    for start in range(base, base + stride):
      vec = t[start:start + block:stride]
      if any(vec):
        out[start:start + block:stride] = [sum(map(mul, row, vec)) for row in M]
  return out


# --------------------------------------------------------------------------
# Univariate: exact integer sign pieces
# --------------------------------------------------------------------------
def _horner(c: Sequence[int], x: int) -> int:
  v = 0
  for a in reversed(c):
    v = v * x + a
  return v


def _univariate_pieces(c: list[int], lo: int, hi: int | None, spend: Callable[[], bool]
                       ) -> list[tuple[int, int | None, int]] | None:
  """Exact (lo, hi, sign) runs of sum(c[k] x^k) over the integers of [lo, hi].

  An unbounded range is cut at Cauchy's root bound: beyond it the leading
  coefficient decides. Returns None when `spend` runs out of budget.
  """
  while len(c) > 1 and c[-1] == 0:
    c = c[:-1]
  if len(c) == 1:
    return [(lo, hi, _sign(c[0]))]
  out: list[tuple[int, int | None, int]] = []
  if hi is None:
    lead = abs(c[-1])
    cauchy = 1 + -(-max(abs(a) for a in c[:-1]) // lead)
    top = max(lo, cauchy)
    if not _finite_pieces(c, lo, top, out, spend):
      return None
    out.append((top + 1, None, _sign(c[-1])))
  elif not _finite_pieces(c, lo, hi, out, spend):
    return None
  merged: list[tuple[int, int | None, int]] = []
  for a, b, s in out:
    if merged and merged[-1][2] == s:
      merged[-1] = (merged[-1][0], b, s)
    else:
      merged.append((a, b, s))
  return merged


def _finite_pieces(c, a: int, b: int, out: list, spend) -> bool:
  """Appends the sign runs of the integers of [a, b], left to right."""
  if not spend():
    return False
  if a == b:
    out.append((a, a, _sign(_horner(c, a))))
    return True
  fa, fb = _horner(c, a), _horner(c, b)
  if fa == 0:   # peel exact roots at the ends so the inner test sees strict signs
    out.append((a, a, 0))
    return _finite_pieces(c, a + 1, b, out, spend)
  if fb == 0:
    if not _finite_pieces(c, a, b - 1, out, spend):
      return False
    out.append((b, b, 0))
    return True
  n = len(c) - 1
  M = _bmatrix(n, a, b - a)
  B = [sum(M[i][e] * c[e] for e in range(n + 1)) for i in range(n + 1)]
  nz = [_sign(x) for x in B if x]
  changes = sum(1 for u, v in zip(nz, nz[1:]) if u != v)
  if changes == 0:   # Bernstein basis > 0 inside: same sign on all of [a, b]
    out.append((a, b, _sign(fa)))
    return True
  if changes == 1:   # exactly one real root in (a, b): binary search the integers
    sa = _sign(fa)
    lo_, hi_ = a, b   # sign(P(lo_)) == sa, sign(P(hi_)) != sa
    while hi_ - lo_ > 1:
      mid = (lo_ + hi_) // 2
      if _sign(_horner(c, mid)) == sa:
        lo_ = mid
      else:
        hi_ = mid
    out.append((a, lo_, sa))
    if _horner(c, hi_) == 0:
      out.append((hi_, hi_, 0))
      out.append((hi_ + 1, b, -sa))  # hi_ < b since P(b) != 0
    else:
      out.append((hi_, b, -sa))
    return True
  if b - a == 1:
    out.append((a, a, _sign(fa)))
    out.append((b, b, _sign(fb)))
    return True
  m = (a + b) // 2
  return _finite_pieces(c, a, m, out, spend) and _finite_pieces(c, m + 1, b, out, spend)


# --------------------------------------------------------------------------
# Multivariate pure polynomials over a box
# --------------------------------------------------------------------------
@dataclasses.dataclass
class _Result:
  ge: bool          # proven: P >= 0 on every allowed point of the box
  le: bool          # proven: P <= 0
  method: str
  dim: str | None = None
  pieces: tuple[Piece, ...] = ()


OnPoint = Callable[[dict[str, int], int], None]


class _BoxProblem:
  """Decides the sign of an integer polynomial P over the integers of a box.

  `ineqs` (each g >= 0, over the same variables) only shrink the feasible set:
  boxes where some g < 0 throughout are dropped, and points violating one do
  not count as evidence. `on_point(env, sign)` is told every feasible point
  found with a nonzero sign, so the caller can verify it as a witness.
  """

  def __init__(self, solver: "_Solver", P, names, box, ineqs, on_point: OnPoint | None):
    self.solver = solver
    self.P, self.names, self.box = P, list(names), list(box)
    self.ineqs = list(ineqs)
    self.on_point = on_point
    self.fixed: dict[str, int] = {}
    self.found = {1: False, -1: False}
    self.points: dict[int, dict[str, int]] = {}   # the first feasible point of each sign
    self.reports = 0   # calls to on_point: each costs an exact evaluation of the original
    self.active = 0   # how many vars P really depends on (after _simplify)
    self.empty = False   # an inequality excludes the whole box (after _simplify)

  # --- evidence -------------------------------------------------------------
  def _feasible(self, x: Sequence[int]) -> bool:
    return all(_eval(g, x) >= 0 for g in self.ineqs)

  def _point(self, x: Sequence[int], value: int | None = None) -> None:
    """Records the sign of P at integer point x (when x is feasible)."""
    if value is None:
      value = _eval(self.P, x)
    s = _sign(value)
    if s == 0 or (self.ineqs and not self._feasible(x)):
      return
    self.found[s] = True
    report = (self.on_point is not None and self.solver.witness[s] is None
              and self.reports < _REPORTS)
    if s not in self.points or report:
      env = dict(self.fixed)
      env.update(zip(self.names, x))
      self.points.setdefault(s, env)
      if report:
        self.reports += 1
        self.on_point(env, s)

  # --- simplification -------------------------------------------------------
  def _simplify(self) -> None:
    """Fixes point-range vars, divides out the common monomial, drops absent vars.

    A var absent from P stays when an inequality links it to P's vars: it may
    be what makes part of the box infeasible (s >= 2 follows from b*s >= 6, b <= 5).
    """
    n = len(self.names)
    pinned = [j for j in range(n) if self.box[j][0] == self.box[j][1]]
    if pinned:
      self.fixed.update((self.names[j], self.box[j][0]) for j in pinned)
      self.P = _pin(self.P, {j: self.box[j][0] for j in pinned})
      self.ineqs = [_pin(g, {j: self.box[j][0] for j in pinned}) for g in self.ineqs]
    if not self.P:
      return
    exps = list(self.P)
    mins = [min(e[j] for e in exps) if self.box[j][0] >= 1 else 0 for j in range(n)]
    keep = {j for j in range(n) if j not in pinned and any(e[j] > mins[j] for e in exps)}
    self.active = len(keep)
    supports = [{j for e in g for j in range(n) if e[j]} for g in self.ineqs]
    grown = True
    while grown:
      grown = False
      for sup in supports:
        if sup & keep and not sup <= keep:
          keep |= sup
          grown = True
    # An inequality P does not see can still make the whole region empty
    # (a case of max/min that cannot happen); then every claim holds vacuously.
    self.empty = any(not sup & keep and self._never_holds(g)
                     for g, sup in zip(self.ineqs, supports))
    if len(keep) == n and not any(mins):
      return
    keep = sorted(keep)
    self.P = {tuple(e[j] - mins[j] for j in keep): c for e, c in self.P.items()}
    self.ineqs = [{tuple(e[j] for j in keep): c for e, c in g.items()}
                  for g, sup in zip(self.ineqs, supports) if sup <= set(keep)]
    self.names = [self.names[j] for j in keep]
    self.box = [self.box[j] for j in keep]

  def _never_holds(self, g) -> bool:
    """Proves g <= -1 on the box: no point satisfies g >= 0."""
    g1 = dict(g)
    zero = (0,) * len(self.names)
    g1[zero] = g1.get(zero, 0) + 1
    g1 = {e: c for e, c in g1.items() if c}
    if not g1:
      return False
    return _BoxProblem(self.solver, g1, self.names, self.box, (), None).decide(False, True).le

  # --- the procedure --------------------------------------------------------
  def decide(self, want_ge: bool = True, want_le: bool = True) -> _Result:
    self._simplify()
    P = self.P
    if not P or self.empty:
      return _Result(True, True, "constant")
    if not self.names:
      s = _sign(P[()])
      self._point(())
      return _Result(s >= 0, s <= 0, "coefficients")
    if self.active == 1:
      res = self._univariate()
      settled = (res.ge or not want_ge) and (res.le or not want_le)
      if settled or not self.ineqs or None not in self.solver.witness.values():
        return res
      self.found = {1: False, -1: False}   # inequalities may make some pieces infeasible
    ge = want_ge and self._same_sign(1)
    le = want_le and self._same_sign(-1)
    if ge or le:
      if all(lo >= 1 for lo, _ in self.box):   # then P is strictly one-signed
        return _Result(ge, le, "coefficients")
      return self._finish(ge, le, want_ge, want_le, "coefficients")
    self._probe_corners()
    if self.found[1] and self.found[-1]:
      return _Result(False, False, "witness")
    ge, le = self._shifted(want_ge and not self.found[-1], want_le and not self.found[1])
    if ge or le:
      return self._finish(ge, le, want_ge, want_le, "shifted")
    ge, le = self._subdivide(want_ge, want_le)
    return _Result(ge, le, "bernstein" if (ge or le or not self.solver.exhausted) else "budget")

  def _finish(self, ge, le, want_ge, want_le, method) -> _Result:
    """After one side is proven, settles the other (EQ has precedence) by search."""
    other = 1 if ge else -1
    if (ge != le) and (want_le if ge else want_ge) and not self.found[other]:
      self._probe_corners()
      if not self.found[other]:
        settled = self._subdivide(not ge, ge)
        ge, le = ge or settled[0], le or settled[1]
    return _Result(ge, le, method)

  def _univariate(self) -> _Result:
    """Exact sign pieces along the one var P depends on (others may be linked by inequalities)."""
    j = next(j for j in range(len(self.names)) if any(e[j] for e in self.P))
    lo, hi = self.box[j]
    c = [0] * (max(e[j] for e in self.P) + 1)
    for e, v in self.P.items():
      c[e[j]] = v
    runs = _univariate_pieces(c, lo, hi, self.solver.spend)
    if runs is None:
      return _Result(False, False, "budget")
    pieces = tuple(Piece(a, b, s) for a, b, s in runs)
    base = [lo_ for lo_, _ in self.box]
    for p in pieces:
      if p.sign:
        for x in _representatives(p):
          base[j] = x
          self._point(tuple(base), p.sign)
    signs = {p.sign for p in pieces}
    return _Result(-1 not in signs, 1 not in signs, "univariate", self.names[j], pieces)

  def _same_sign(self, s: int) -> bool:
    """All coefficients of one sign and all vars >= 0: every monomial has that sign."""
    return all(lo >= 0 for lo, _ in self.box) and all(c * s >= 0 for c in self.P.values())

  def _corner_values(self, j: int) -> tuple[int, ...]:
    lo, hi = self.box[j]
    return (lo, hi if hi is not None else max(lo + 1, self.solver.cap(self.P, j, lo)))

  def _probe_corners(self) -> None:
    """Evaluates P at the box corners: the cheapest way to two witnesses (DEPENDS)."""
    for x in itertools.product(*(self._corner_values(j) for j in range(len(self.names)))):
      self._point(x)
      if self.found[1] and self.found[-1]:
        return

  def _shifted(self, want_ge: bool, want_le: bool) -> tuple[bool, bool]:
    """Shifted-coefficient test at the lower corner: x = lo + y with y >= 0.

    If every coefficient of P(lo + y) has one sign, so has P wherever x >= lo,
    bounded or not. Shifts from other corners are not tried: on a finite box
    they imply nonnegative Bernstein coefficients, which the subdivision's first
    box checks anyway.
    """
    if not (want_ge or want_le) or not self.solver.spend():
      return False, False
    Q = _shift(self.P, [lo for lo, _ in self.box], [1] * len(self.box))
    return (want_ge and all(v >= 0 for v in Q.values()),
            want_le and all(v <= 0 for v in Q.values()))

  # --- Bernstein subdivision -----------------------------------------------
  def _subdivide(self, want_ge: bool, want_le: bool) -> tuple[bool, bool]:
    unbounded = [j for j, (_, hi) in enumerate(self.box) if hi is None]
    caps = {j: max(self.box[j][0], self.solver.cap(self.P, j, self.box[j][0])) for j in unbounded}
    finite = [(lo, caps[j] if hi is None else hi) for j, (lo, hi) in enumerate(self.box)]
    ge, le = self._subdivide_finite(finite, want_ge, want_le)
    if not (ge or le) or not unbounded:
      return ge, le
    self._probe_tails(caps)
    ge = ge and not self.found[-1]
    le = le and not self.found[1]
    for r in range(1, len(unbounded) + 1):
      for tail in itertools.combinations(unbounded, r):
        ge, le = self._tail(tail, caps, finite, ge, le)
        if not (ge or le):
          return False, False
    return ge, le

  def _subdivide_finite(self, box0, want_ge: bool, want_le: bool) -> tuple[bool, bool]:
    degs = [max(e[j] for e in self.P) for j in range(len(self.names))]
    dense = _Dense(self.P, degs)
    gdense = [_Dense(g, [max(e[j] for e in g) for j in range(len(self.names))]) for g in self.ineqs]
    cost = 1 + (dense.size + sum(g.size for g in gdense)) // 64
    stack = [list(box0)]
    while stack:
      open_ge = want_ge and not self.found[-1]
      open_le = want_le and not self.found[1]
      if not (open_ge or open_le):
        break
      if not self.solver.spend(cost):
        return False, False
      box = stack.pop()
      if any(max(g.bernstein(box)) < 0 for g in gdense):
        continue   # no feasible point in this box
      if all(hi - lo <= 1 for lo, hi in box):
        for x in itertools.product(*({lo, hi} for lo, hi in box)):
          self._point(x)
        continue
      B = dense.bernstein(box)
      for bits, idx in dense.corner_index:
        if B[idx]:
          self._point(tuple(hi if b else lo for b, (lo, hi) in zip(bits, box)), B[idx])
      if (open_ge and min(B) < 0) or (open_le and max(B) > 0):
        j = dense.split_axis(B, box)
        lo, hi = box[j]
        mid = (lo + hi) // 2
        stack.append(box[:j] + [(mid + 1, hi)] + box[j + 1:])
        stack.append(box[:j] + [(lo, mid)] + box[j + 1:])
    return want_ge and not self.found[-1], want_le and not self.found[1]

  def _probe_tails(self, caps: Mapping[int, int]) -> None:
    """Evaluates P far out along the unbounded vars (witnesses beyond the caps)."""
    axes = [(lo, hi) if hi is not None else (lo, caps[j] + 1, 2 * caps[j] + 1, caps[j] ** 2)
            for j, (lo, hi) in enumerate(self.box)]
    for x in itertools.product(*axes):
      self._point(x)

  def _tail(self, tail, caps, finite, ge: bool, le: bool) -> tuple[bool, bool]:
    """Proves the sign where every var in `tail` is beyond its cap.

    With x_j = cap_j + 1 + y_j (y_j >= 0) for j in `tail`, P is a polynomial in
    y whose coefficients are polynomials in the other (finite) vars: if each is
    >= 0 on their box, P >= 0 on the whole tail region.
    """
    n = len(self.names)
    origin = [caps[j] + 1 if j in tail else 0 for j in range(n)]
    Q = _shift(self.P, origin, [1] * n)
    rest = [j for j in range(n) if j not in tail]
    coeffs: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    for e, c in Q.items():
      coeffs.setdefault(tuple(e[j] for j in tail), {})[tuple(e[j] for j in rest)] = c
    names = [self.names[j] for j in rest]
    box = [finite[j] for j in rest]
    for C in coeffs.values():
      if not (ge or le):
        break
      sub = _BoxProblem(self.solver, C, names, box, (), None)
      res = sub.decide(ge, le)
      for s, proven in ((-1, res.ge), (1, res.le)):
        if not proven and s in sub.points:
          self._probe_ray(tail, caps, rest, finite, sub.points[s])
      ge, le = ge and res.ge, le and res.le
    return ge, le

  def _probe_ray(self, tail, caps, rest, finite, env: Mapping[str, int]) -> None:
    """Where a y-coefficient has the wrong sign, P often does too far out: look there."""
    x = [0] * len(self.names)
    for j in rest:
      x[j] = env.get(self.names[j], finite[j][0])
    for t in range(0, 64, 3):
      for j in tail:
        x[j] = caps[j] + 1 + (1 << t)
      self._point(tuple(x))


def _substitute_term(mono, c: int, subs, eliminated, cons: Constraints):
  """The terms of c * mono after the substitutions (fast when each is a monomial)."""
  slow = any((isinstance(a, Var) and a in subs and len(subs[a].terms) != 1)
             or (isinstance(a, OpAtom) and a.variables() & eliminated) for a, _ in mono)
  if slow:
    return cons.reduce(Poly(((mono, c),))).terms
  exps: dict = {}
  for a, e in mono:
    q = subs.get(a) if isinstance(a, Var) else None
    if q is None:
      exps[a] = exps.get(a, 0) + e
      continue
    (qm, qc), = q.terms
    c *= qc ** e
    for b, f in qm:
      exps[b] = exps.get(b, 0) + f * e
  return ((tuple(sorted(exps.items(), key=lambda ae: ae[0].sort_key)), c),)


def _pin(P, values: Mapping[int, int]):
  """Substitutes constants for some coordinates (they stay, with exponent 0)."""
  out: dict[tuple[int, ...], int] = {}
  for e, c in P.items():
    e2 = list(e)
    for j, v in values.items():
      if e[j]:
        c *= v ** e[j]
        e2[j] = 0
    t = tuple(e2)
    out[t] = out.get(t, 0) + c
  return {e: c for e, c in out.items() if c}


def _representatives(p: Piece) -> tuple[int, ...]:
  if p.hi is None:
    return (p.lo, 2 * p.lo + 1, p.lo + (1 << 20))
  return tuple(dict.fromkeys((p.lo, (p.lo + p.hi) // 2, p.hi)))


# --------------------------------------------------------------------------
# Interval arithmetic (for relaxing operation atoms to bounded fresh vars)
# --------------------------------------------------------------------------
_INF = math.inf


def _imul(x, y):
  c = [0 if (a == 0 or b == 0) else a * b for a in x for b in y]
  return min(c), max(c)


def _ipow(x, e: int):
  lo, hi = x
  vals = [lo ** e, hi ** e]
  if e % 2 == 0 and lo < 0 < hi:
    vals.append(0)
  return min(vals), max(vals)


def _poly_interval(p: Poly, bounds: Mapping[str, tuple[int, int | None]]):
  lo = hi = 0
  for mono, c in p.terms:
    iv = (c, c)
    for atom, e in mono:
      iv = _imul(iv, _ipow(_atom_interval(atom, bounds), e))
    lo, hi = lo + iv[0], hi + iv[1]
  return lo, hi


def _atom_interval(a, bounds):
  if isinstance(a, Var):
    lo, hi = bounds.get(a.name, (1, None))
    return lo, (_INF if hi is None else hi)
  x = _poly_interval(a.operands[0], bounds)
  y = _poly_interval(a.operands[1], bounds)
  if a.op == poly_lib.MAX:
    return max(x[0], y[0]), max(x[1], y[1])
  if a.op == poly_lib.MIN:
    return min(x[0], y[0]), min(x[1], y[1])
  if y[0] <= 0 <= y[1]:
    return -_INF, _INF
  if a.op == poly_lib.MOD:
    if y[0] > 0:
      return 0, (min(y[1] - 1, x[1]) if x[0] >= 0 else y[1] - 1)
    return y[0] + 1, 0
  if y[1] < 0:   # floordiv(p, q) == floordiv(-p, -q)
    x, y = (-x[1], -x[0]), (-y[1], -y[0])
  return _floordiv_interval(x, y)


def _fdiv(a, b):
  """floor(a / b) for b > 0, a and b possibly infinite (b = inf: the limit from a finite a)."""
  if b == _INF:
    return 0 if a >= 0 else -1
  if a in (_INF, -_INF):
    return a
  return a // b


def _floordiv_interval(x, y):
  (pl, ph), (ql, qh) = x, y   # ql > 0
  lo = _fdiv(pl, qh) if pl >= 0 else _fdiv(pl, ql)
  hi = _fdiv(ph, ql) if ph >= 0 else _fdiv(ph, qh)
  return lo, hi


# --------------------------------------------------------------------------
# The solver: reduction, atoms, witnesses
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Rewrite:
  """s = k*q + r, an exact rewrite for floordiv(s, k) / mod(s, k)."""
  var: str
  k: int
  q: str
  r: str


@dataclasses.dataclass(frozen=True)
class _Frame:
  """What a relaxed subproblem carries down the atom rewrites."""
  bounds: Mapping[str, tuple[int, int | None]]   # every var's box, fresh vars included
  ineqs: tuple[Poly, ...] = ()                   # g >= 0 on the region (prune only)
  rewrites: tuple[_Rewrite, ...] = ()            # to map points back to the original dims
  depth: int = 0                                 # max/min case splits so far
  want: tuple[bool, bool] = (True, True)         # which of ge / le are still worth proving

  def but(self, **changes) -> "_Frame":
    return dataclasses.replace(self, **changes)


class _Solver:
  """One comparison: holds the original expressions, the budget and the witnesses."""

  def __init__(self, lhs: Poly, rhs: Poly, cons: Constraints):
    self.lhs, self.rhs, self.cons = lhs, rhs, cons
    self.bounds = cons.bounds_map
    self.witness: dict[int, dict[str, int] | None] = {1: None, -1: None}
    self.budget = _BOX_BUDGET
    self.exhausted = False
    self.fresh = 0

  # --- budget ---------------------------------------------------------------
  def spend(self, cost: int = 1) -> bool:
    if self.budget <= 0:
      self.exhausted = True
      return False
    self.budget -= cost
    return True

  def cap(self, P, j: int, lo: int) -> int:
    """Where the finite part of an unbounded var's range ends (a root-bound heuristic).

    Soundness does not depend on it: beyond the cap the tail test proves or fails.
    """
    mags = [abs(c) for c in P.values()]
    return min(_MAX_CAP, max(lo + 1, 2 + max(mags) // min(mags)))

  # --- witnesses ------------------------------------------------------------
  def bound(self, v: str) -> tuple[int, int | None]:
    return self.bounds.get(v, (1, None))

  @functools.cached_property
  def free_vars(self) -> tuple[str, ...]:
    names = set(self.bounds) | self._constrained
    for p in (self.lhs, self.rhs):
      for mono, _ in p.terms:
        for a, _ in mono:
          names |= {a.name} if isinstance(a, Var) else a.variables()
    return tuple(sorted(names - self.cons.eliminated))

  @functools.cached_property
  def _difference(self) -> list[tuple[int, tuple[tuple[str, int], ...]]] | None:
    """The original lhs - rhs as (coeff, ((var, exp), ...)) terms; None if it has op atoms."""
    terms = [(c, m) for m, c in self.lhs.terms] + [(-c, m) for m, c in self.rhs.terms]
    if any(not isinstance(a, Var) for _, m in terms for a, _ in m):
      return None
    return [(c, tuple((a.name, e) for a, e in m)) for c, m in terms]

  def _value(self, env: Mapping[str, int]) -> int:
    """Exact value of the original lhs - rhs at a full assignment."""
    if self._difference is None:
      return self.lhs.evaluate(env) - self.rhs.evaluate(env)
    total = 0
    for c, mono in self._difference:
      for name, e in mono:
        c *= env[name] ** e
      total += c
    return total

  @functools.cached_property
  def _constrained(self) -> frozenset[str]:
    """Variables that general inequalities mention: completing them takes a search."""
    return frozenset().union(*(g.variables() for g in self.cons.inequalities))

  def probe(self, env: Mapping[str, int]) -> int | None:
    """Exact sign of the original lhs - rhs at a completed, feasible `env` (records witnesses)."""
    full = self._complete(env)
    if full is None:
      return None
    try:
      s = _sign(self._value(full))
    except ZeroDivisionError:
      return None
    if s and self.witness[s] is None:
      self.witness[s] = full
    return s

  def on_point(self, env: dict[str, int], sign: int) -> None:
    if self.witness[sign] is None:
      self.probe(env)

  def _complete(self, env: Mapping[str, int]) -> dict[str, int] | None:
    """Fills the free vars `env` lacks so that every constraint holds (small search)."""
    point = {v: int(env[v]) for v in self.free_vars if v in env}
    missing = [v for v in self.free_vars if v not in point]
    options = []
    for v in missing:
      lo, hi = self.bound(v)
      if v in self._constrained:
        top = hi if hi is not None else max(2 * lo, 1 << 16)
        options.append(tuple(dict.fromkeys((lo, top, (lo + top) // 2, lo + 1))))
      else:
        options.append((lo,))
    for combo in itertools.islice(itertools.product(*options), 256):
      trial = dict(point)
      trial.update(zip(missing, combo))
      try:
        full = self.cons.complete(trial)
        if self.cons.violation(full) is None:
          return full
      except ZeroDivisionError:
        pass
    return None

  def samples(self, names: Iterable[str], count: int) -> list[dict[str, int]]:
    """Corners, centre and seeded random points of the box of `names` (near lo, too)."""
    names = sorted(names)
    rng = random.Random(0)
    axes = []
    for v in names:
      lo, hi = self.bound(v)
      axes.append((lo, hi if hi is not None else max(2 * lo, 1 << 12)))
    points = list(itertools.islice(itertools.product(*axes), 16))
    points.append(tuple((a + b) // 2 for a, b in axes))
    points += [tuple(rng.randint(a, b) for a, b in axes) for _ in range(count)]
    points += [tuple(rng.randint(a, min(b, a + 8)) for a, b in axes) for _ in range(count // 2)]
    return [dict(zip(names, x)) for x in points]

  def probe_randomly(self, names: Iterable[str], count: int) -> None:
    for env in self.samples(names, count):
      if self.witness[1] is not None and self.witness[-1] is not None:
        return
      self.probe(env)

  # --- the procedure --------------------------------------------------------
  def run(self) -> Ordering:
    diff = self._reduced_difference()
    if all(not mono for mono in diff):
      return self._constant(diff.get((), 0))
    atoms = {a for mono in diff for a, _ in mono}
    if all(isinstance(a, Var) for a in atoms):
      ineqs = [g for g in self.cons.inequalities if not _has_ops(g)]
      names = sorted({a.name for a in atoms}.union(*(g.variables() for g in ineqs)))
      index = {n: i for i, n in enumerate(names)}
      P = {}
      for mono, c in diff.items():
        e = [0] * len(names)
        for a, k in mono:
          e[index[a.name]] = k
        P[tuple(e)] = c
      box = [self.bound(v) for v in names]
      gs = [_to_dict(g, names) for g in ineqs]
      res = _BoxProblem(self, P, names, box, gs, self.on_point).decide()
      return self._finish(res, names)
    d = Poly.from_dict(diff)
    self.probe_randomly(d.variables(), 4)
    if self.witness[1] is not None and self.witness[-1] is not None:
      return self._ordering(DEPENDS, "witness")
    frame = _Frame(bounds={v: self.bound(v) for v in d.variables()},
                   ineqs=tuple(g for g in self.cons.inequalities if not _has_ops(g)))
    res = self._atoms(d, frame)
    res.dim, res.pieces = None, ()
    return self._finish(res, d.variables())

  def _reduced_difference(self) -> dict:
    """reduce(lhs) - reduce(rhs) as {monomial: coeff}, skipping Poly's canonical sorting.

    A substitution by a monomial (s == 128*k, the usual divisibility constraint)
    is applied term by term here; anything else goes through `Constraints.reduce`.
    """
    diff = dict(self.lhs.terms)
    if not self.cons.substitutions:
      for mono, c in self.rhs.terms:
        diff[mono] = diff.get(mono, 0) - c
      return {mono: c for mono, c in diff.items() if c}
    subs = {Var(v): q for v, q in self.cons.substitutions}
    eliminated = self.cons.eliminated
    diff = {}
    for p, sign in ((self.lhs, 1), (self.rhs, -1)):
      for mono, c in p.terms:
        for m2, c2 in _substitute_term(mono, sign * c, subs, eliminated, self.cons):
          diff[m2] = diff.get(m2, 0) + c2
    return {mono: c for mono, c in diff.items() if c}

  def _constant(self, c: int) -> Ordering:
    s = _sign(c)
    if s == 0:
      return self._ordering(EQ, "constant")
    self.probe({})
    return self._ordering(GE if s > 0 else LE, "constant")

  def _finish(self, res: _Result, names: Iterable[str]) -> Ordering:
    if res.ge and res.le:
      kind = EQ
    elif res.ge:
      kind = GE
    elif res.le:
      kind = LE
    else:
      if self.witness[1] is None or self.witness[-1] is None:
        self.probe_randomly(names, _PROBES)
      if self.witness[1] is not None and self.witness[-1] is not None:
        method = res.method if res.method in ("univariate", "bernstein", "witness") else "witness"
        return self._ordering(DEPENDS, method, res)
      return self._ordering(UNKNOWN, res.method if res.method == "budget" else "unproven")
    # A verified counter-witness would mean a wrong proof: refuse rather than lie.
    if (kind in (GE, EQ) and self.witness[-1]) or (kind in (LE, EQ) and self.witness[1]):
      return self._ordering(UNKNOWN, "inconsistent")
    return self._ordering(kind, res.method, res)

  def _ordering(self, kind: str, method: str, res: _Result | None = None) -> Ordering:
    gt, lt = self.witness[1], self.witness[-1]
    if kind == EQ:
      gt = lt = None
    return Ordering(
        kind=kind, lhs=self.lhs, rhs=self.rhs,
        witness_gt=_FrozenEnv(gt) if gt else None,
        witness_lt=_FrozenEnv(lt) if lt else None,
        dim=res.dim if res is not None and res.pieces else None,
        pieces=res.pieces if res is not None else (),
        method=method)

  # --- operation atoms ------------------------------------------------------
  def _new_var(self, tag: str) -> str:
    self.fresh += 1
    return f"{tag}#{self.fresh}"   # '#' never occurs in a JAX dimension name

  def _atoms(self, d: Poly, f: _Frame) -> _Result:
    """Decides d by rewriting or relaxing its operation atoms until it is a plain polynomial.

    Every step keeps soundness for proofs: exact rewrites (s = k*q + r),
    identities with a bounded fresh var (floordiv(p, k) = (p - m)/k, scaled by
    |k|^E > 0; floordiv(p, q) = w with 0 <= p - q*w < q), case splits for
    max/min (each case on the region where it holds), interval relaxation
    otherwise. The relations a fresh var lost become inequalities, which only
    prune. The sets only grow, so points found here are mere candidates: they
    are mapped back to the original dims and verified before they count.
    """
    if d.is_constant():
      s = _sign(d.constant)
      return _Result(s >= 0, s <= 0, "constant")
    ops = sorted((a for a in d.atoms() if isinstance(a, OpAtom)), key=lambda a: a.sort_key)
    if not ops:
      return self._plain(d, f)
    # Cases first: their regions often become bounds (s >= 128) that the rewrites then use.
    for a in ops:
      if a.op in (poly_lib.MAX, poly_lib.MIN) and f.depth < _MAX_CASE_DEPTH:
        return self._cases(d, a, f)
    for a in ops:
      if a.op in (poly_lib.FLOORDIV, poly_lib.MOD) and _const_divisor(a):
        numer = a.operands[0]
        if _is_var(numer) and a.operands[1].constant > 0 and self._single_divisor(d, numer):
          return self._exact_divmod(d, a, f)
    for a in ops:
      if a.op in (poly_lib.FLOORDIV, poly_lib.MOD) and _const_divisor(a):
        return self._general_divmod(d, a, f)
    for a in ops:
      if a.op in (poly_lib.FLOORDIV, poly_lib.MOD):
        return self._division(d, a, f)
    return self._relax(d, ops[0], f)

  def _plain(self, d: Poly, f: _Frame) -> _Result:
    ineqs = [g for g in f.ineqs if not _has_ops(g)]
    names = sorted(d.variables().union(*(g.variables() for g in ineqs)))
    box = [f.bounds[v] if v in f.bounds else self.bound(v) for v in names]
    gs = [_to_dict(g, names) for g in ineqs]
    on_point = functools.partial(self._on_relaxed_point, rewrites=f.rewrites)
    return _BoxProblem(self, _to_dict(d, names), names, box, gs, on_point).decide(*f.want)

  def _on_relaxed_point(self, env: dict[str, int], sign: int, rewrites) -> None:
    """Maps a point of a relaxed problem back to the original dims and verifies it."""
    if self.witness[1] is not None and self.witness[-1] is not None:
      return
    env = dict(env)
    for rw in reversed(rewrites):
      if rw.q in env and rw.r in env:
        env[rw.var] = rw.k * env[rw.q] + env[rw.r]
    self.probe({v: x for v, x in env.items() if "#" not in v})

  def _single_divisor(self, d: Poly, numer: Poly) -> bool:
    ks = {a.operands[1].constant for a in d.atoms()
          if isinstance(a, OpAtom) and a.op in (poly_lib.FLOORDIV, poly_lib.MOD)
          and a.operands[0] == numer and _const_divisor(a)}
    return len(ks) == 1

  def _exact_divmod(self, d: Poly, a: OpAtom, f: _Frame) -> _Result:
    """floordiv(s, k), mod(s, k) with s a var: s = k*q + r, q, r fresh (exact on integers).

    s in [lo, hi] is exactly (q, r) in three boxes: the first quotient with
    r >= lo mod k, the full middle, the last quotient with r <= hi mod k. Each
    must hold; the middle one usually has q >= 1, which then divides out.
    """
    s = next(iter(a.operands[0].variables()))
    k = a.operands[1].constant
    q, r = self._new_var("q"), self._new_var("r")
    sv = Poly.var(s)
    atoms = {OpAtom(poly_lib.FLOORDIV, (sv, Poly.const(k))): Poly.var(q),
             OpAtom(poly_lib.MOD, (sv, Poly.const(k))): Poly.var(r)}
    repl = {Var(s): k * Poly.var(q) + Poly.var(r)}
    d = constraints_lib._substitute_deep(d.substitute(atoms), repl)
    inner = f.but(ineqs=tuple(constraints_lib._substitute_deep(g.substitute(atoms), repl)
                              for g in f.ineqs),
                  rewrites=f.rewrites + (_Rewrite(s, k, q, r),))
    ge, le = f.want
    method = "constant"
    for q_box, r_box in _quotient_boxes(*f.bounds[s], k):
      if not (ge or le):
        break
      res = self._atoms(d, inner.but(bounds={**f.bounds, q: q_box, r: r_box}, want=(ge, le)))
      ge, le = ge and res.ge, le and res.le
      method = res.method if method == "constant" else method   # the largest box's
    return _Result(ge, le, method)

  def _general_divmod(self, d: Poly, a: OpAtom, f: _Frame) -> _Result:
    """floordiv(p, k) = (p - m) / k and mod(p, k) = m with m fresh in the range of p mod k."""
    p, k = a.operands[0], a.operands[1].constant
    m = self._new_var("m")
    fd = OpAtom(poly_lib.FLOORDIV, (p, Poly.const(k)))
    md = OpAtom(poly_lib.MOD, (p, Poly.const(k)))
    big = max((e for mono, _ in d.terms for at, e in mono if at == fd), default=0)
    quotient = (p - Poly.var(m)) * (1 if k > 0 else -1)    # == |k| * floordiv(p, k)
    out = poly_lib.ZERO
    for mono, c in d.terms:
      t = Poly.const(c)
      ef = 0
      for at, e in mono:
        if at == fd:
          ef = e
        elif at == md:
          t = t * Poly.var(m) ** e
        else:
          t = t * Poly(((((at, e),), 1),))
      out = out + t * quotient ** ef * abs(k) ** (big - ef)
    # p - m is k * floordiv(p, k): keep it within k times the quotient's range.
    lo, hi = sorted(k * x for x in _atom_interval(fd, f.bounds))
    qk = p - Poly.var(m)
    band = tuple(g for g, bound in ((qk - _finite(lo), lo), (_finite(hi) - qk, hi))
                 if abs(bound) != _INF)
    bounds = {**f.bounds, m: (0, k - 1) if k > 0 else (k + 1, 0)}
    return self._atoms(out, f.but(bounds=bounds, ineqs=f.ineqs + band))

  def _division(self, d: Poly, a: OpAtom, f: _Frame) -> _Result:
    """floordiv(p, q) = w and mod(p, q) = p - q*w, w fresh, with the band q*w <= p < q*(w + 1)."""
    p, q = a.operands
    q_lo, q_hi = _poly_interval(q, f.bounds)
    fd, md = OpAtom(poly_lib.FLOORDIV, (p, q)), OpAtom(poly_lib.MOD, (p, q))
    lo, hi = _atom_interval(fd, f.bounds)
    if lo == -_INF or not (q_lo > 0 or q_hi < 0):
      return self._relax(d, a, f)
    w = self._new_var("w")
    W = Poly.var(w)
    rem = p - q * W
    band = (rem, q - 1 - rem) if q_lo > 0 else (rem - q - 1, -rem)
    bounds = {**f.bounds, w: (int(lo), None if hi == _INF else int(hi))}
    return self._atoms(d.substitute({fd: W, md: rem}), f.but(bounds=bounds, ineqs=f.ineqs + band))

  def _cases(self, d: Poly, a: OpAtom, f: _Frame) -> _Result:
    """max/min: each case on the region where the atom equals that operand.

    When d is visibly monotone in the atom, d(max(x, y)) = max(d(x), d(y)) (or
    the min), so for one side a single case on the whole box is enough: that
    settles max(b, s) >= s without looking at the region b >= s.
    """
    x, y = a.operands
    dx, dy = d.substitute({a: x}), d.substitute({a: y})
    inner = f.but(depth=f.depth + 1)
    upper = None   # d = max(d_x, d_y) (True) or min(d_x, d_y) (False) when monotone
    mono = _monotonicity(d, a, f.bounds)
    if mono:
      upper = (a.op == poly_lib.MAX) == (mono > 0)
    ge = le = False
    if upper is not None:   # the cheap route first: one case on the whole box
      side = (True, False) if upper else (False, True)
      if (f.want[0] if upper else f.want[1]):
        for dc in (dx, dy):
          r = self._atoms(dc, inner.but(want=side))
          if r.ge if upper else r.le:
            ge, le = ge or upper, le or not upper
            break
    want = (f.want[0] and not ge, f.want[1] and not le)
    gx = x - y if a.op == poly_lib.MAX else y - x   # >= 0 where the atom equals x
    for dc, g in ((dx, gx), (dy, -gx)):
      if not any(want):
        break
      r = self._on_region(dc, g, inner.but(want=want))
      want = (want[0] and r.ge, want[1] and r.le)
    ge, le = ge or want[0], le or want[1]
    return _Result(ge, le, "cases")

  def _on_region(self, d: Poly, g: Poly, f: _Frame) -> _Result:
    """Decides d where g >= 0; a g linear in one var narrows that var's bounds instead."""
    bound = _as_bound(g)
    if bound is None:
      return self._atoms(d, f.but(ineqs=f.ineqs + (g,)))
    v, lo, hi = bound
    old_lo, old_hi = f.bounds[v] if v in f.bounds else self.bound(v)
    lo = old_lo if lo is None else max(lo, old_lo)
    hi = old_hi if hi is None else (hi if old_hi is None else min(hi, old_hi))
    if hi is not None and lo > hi:
      return _Result(True, True, "constant")   # an empty region: nothing to prove
    return self._atoms(d, f.but(bounds={**f.bounds, v: (lo, hi)}))

  def _relax(self, d: Poly, a: OpAtom, f: _Frame) -> _Result:
    """Replaces an opaque atom by a fresh var bounded by interval arithmetic."""
    lo, hi = _atom_interval(a, f.bounds)
    if lo == -_INF:
      return _Result(False, False, "unproven")
    w = self._new_var("w")
    bounds = {**f.bounds, w: (int(lo), None if hi == _INF else int(hi))}
    return self._atoms(d.substitute({a: Poly.var(w)}), f.but(bounds=bounds))


def _quotient_boxes(lo: int, hi: int | None, k: int):
  """(q range, r range) boxes whose points k*q + r are exactly the integers of [lo, hi]."""
  q_lo, r_lo = divmod(lo, k)
  if hi is None:
    return [((q_lo, q_lo), (r_lo, k - 1)), ((q_lo + 1, None), (0, k - 1))]
  q_hi, r_hi = divmod(hi, k)
  if q_lo == q_hi:
    return [((q_lo, q_lo), (r_lo, r_hi))]
  middle = [((q_lo + 1, q_hi - 1), (0, k - 1))] if q_hi - q_lo > 1 else []
  return middle + [((q_lo, q_lo), (r_lo, k - 1)), ((q_hi, q_hi), (0, r_hi))]


def _as_bound(g: Poly) -> tuple[str, int | None, int | None] | None:
  """g >= 0 as (var, lo, hi) when g is a*v + c (one var, no atoms), else None."""
  if g.degree() != 1 or len(g.atoms()) != 1:
    return None
  (atom,) = g.atoms()
  if not isinstance(atom, Var):
    return None
  a, c = g.as_dict()[((atom, 1),)], g.constant
  if a > 0:
    return atom.name, -(c // a), None          # v >= ceil(-c / a)
  return atom.name, None, c // -a              # v <= floor(c / -a)


def _finite(x) -> int:
  return int(x) if abs(x) != _INF else 0


def _has_ops(p: Poly) -> bool:
  return any(isinstance(a, OpAtom) for a in p.atoms())


def _is_var(p: Poly) -> bool:
  return len(p.terms) == 1 and p.terms[0][1] == 1 and len(p.terms[0][0]) == 1 \
      and p.terms[0][0][0][1] == 1 and isinstance(p.terms[0][0][0][0], Var)


def _const_divisor(a: OpAtom) -> bool:
  return a.operands[1].is_constant() and a.operands[1].constant != 0


def _monotonicity(d: Poly, a: OpAtom, bounds) -> int:
  """+1 / -1 if d is visibly nondecreasing / nonincreasing in max/min atom a, else 0.

  Checked for values >= 0 only, so both operands must be >= 0: d(y) for a
  negative y says nothing about d(max(x, y)) when d = a^2.
  """
  if any(_poly_interval(o, bounds)[0] < 0 for o in a.operands):
    return 0
  signs = set()
  for mono, c in d.terms:
    if any(at == a for at, _ in mono):
      if any(at != a and _atom_interval(at, bounds)[0] < 0 for at, _ in mono):
        return 0
      signs.add(_sign(c))
  return signs.pop() if len(signs) == 1 else 0


# --------------------------------------------------------------------------
# Feasibility of general inequalities
# --------------------------------------------------------------------------
def _feasibility(cons: Constraints) -> tuple[bool | None, str | None]:
  """(True, None) if a feasible point is found, (False, why) if none can exist, else (None, None)."""
  if not cons.inequalities:
    return True, None
  solver = _Solver(poly_lib.ZERO, poly_lib.ZERO, cons)
  if any(solver._complete(env) is not None for env in solver.samples(solver.free_vars, _PROBES)):
    return True, None
  for g in cons.inequalities:
    if _never_holds(solver, g, ()):
      return False, f"{g} >= 0 can never hold"
  for g in cons.inequalities:
    if _never_holds(solver, g, tuple(h for h in cons.inequalities if h != g)):
      return False, f"{g} >= 0 can never hold together with the other inequalities"
  return None, None


def _never_holds(solver: _Solver, g: Poly, others: tuple[Poly, ...]) -> bool:
  """Proves g <= -1 wherever the box and the other inequalities hold."""
  if _has_ops(g):
    return compare_polys(g, Poly.const(-1), Constraints(bounds=solver.cons.bounds)).kind in (LE, EQ)
  others = [h for h in others if not _has_ops(h)]
  names = sorted(g.variables().union(*(h.variables() for h in others)))
  box = [solver.bound(v) for v in names]
  P = _to_dict(g + 1, names)
  if not P:
    return False
  gs = [_to_dict(h, names) for h in others]
  return _BoxProblem(solver, P, names, box, gs, None).decide(False, True).le
