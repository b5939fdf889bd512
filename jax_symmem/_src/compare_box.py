"""The sign of a pure integer polynomial over the integers of a box.

`BoxProblem` runs the tests of `compare` by cost: common monomial and pinned
vars divided out, exact univariate pieces, same-sign coefficients, corner
witnesses, shifted coefficients, then Bernstein coefficients with subdivision
at integer midpoints (and tail tests for unbounded vars). It never calls back
into the solver: what it shares with the rest of one comparison is a `Search`
(the box budget and the witnesses in hand), and points worth verifying go to
the `on_point` callback it is given.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Callable, Mapping, Sequence

from jax_symmem._src.compare_kernel import Dense, evaluate, pin, shift, sign_of, top_degree_signs
from jax_symmem._src.compare_ordering import Piece
from jax_symmem._src.compare_univariate import univariate_pieces

# Points one box problem passes on as witness candidates (relaxed ones rarely verify).
_REPORTS = 16
# Upper cap on the finite part of an unbounded dimension's range.
_MAX_CAP = 1 << 40
# Inequality multipliers (`_by_multipliers`): how many, one after another, and how many
# candidate products each step tries.
_MULTIPLIER_DEPTH = 3
_MULTIPLIER_CANDIDATES = 4


class Search:
  """What the box problems of one comparison share: the box budget and the witnesses.

  `witness[s]` is a verified full assignment where the original lhs - rhs has
  sign s (None until found). The solver fills it, through the `on_point`
  callbacks it hands to box problems; a box problem only reads it, to stop
  looking for evidence that is already in hand.
  """

  def __init__(self, budget: int):
    self.budget = budget
    self.exhausted = False
    self.witness: dict[int, dict[str, int] | None] = {1: None, -1: None}

  def spend(self, cost: int = 1) -> bool:
    if self.budget <= 0:
      self.exhausted = True
      return False
    self.budget -= cost
    return True


def _cap(P, lo: int) -> int:
  """Where the finite part of an unbounded var's range ends (a root-bound heuristic).

  Soundness does not depend on it: beyond the cap the tail test proves or fails.
  """
  mags = [abs(c) for c in P.values()]
  return min(_MAX_CAP, max(lo + 1, 2 + max(mags) // min(mags)))


@dataclasses.dataclass
class Result:
  """What a box problem (or the solver, over a relaxed one) proved, and how."""
  ge: bool          # proven: P >= 0 on every allowed point of the box
  le: bool          # proven: P <= 0
  method: str
  dim: str | None = None
  pieces: tuple[Piece, ...] = ()


OnPoint = Callable[[dict[str, int], int], None]


class BoxProblem:
  """Decides the sign of an integer polynomial P over the integers of a box.

  `ineqs` (each g >= 0, over the same variables) shrink the feasible set: boxes
  where some g < 0 throughout are dropped, and points violating one do not count
  as evidence; with `multipliers` they also prove (`_by_multipliers`).
  `on_point(env, sign)` is told every feasible point found with a nonzero sign, so
  the caller can verify it as a witness.
  """

  def __init__(self, search: Search, P, names, box, ineqs, on_point: OnPoint | None,
               multipliers: bool = False):
    self.search = search
    self.multipliers = multipliers   # the inequalities may prove, not only prune (the user's)
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
    return all(evaluate(g, x) >= 0 for g in self.ineqs)

  def _reporting(self, s: int) -> bool:
    """Whether a feasible point of sign s goes to `on_point` (a witness of s is still wanted)."""
    return (self.on_point is not None and self.search.witness[s] is None
            and self.reports < _REPORTS)

  def _news(self, s: int) -> bool:
    """Whether a point of sign s can change anything `_point` records."""
    return not self.found[s] or self._reporting(s)

  def _point(self, x: Sequence[int], value: int | None = None) -> None:
    """Records the sign of P at integer point x (when x is feasible)."""
    if value is None:
      value = evaluate(self.P, x)
    if not value:
      return
    s = 1 if value > 0 else -1
    report = self._reporting(s)
    if self.found[s] and not report:
      return   # nothing new to learn here: skip the feasibility check
    if self.ineqs and not self._feasible(x):
      return
    self.found[s] = True
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
    box = self.box
    pinned = {j: box[j][0] for j in range(n) if box[j][0] == box[j][1]}
    if pinned:
      self.fixed.update((self.names[j], x) for j, x in pinned.items())
      self.P = pin(self.P, pinned)
      # One that pinning made constant (b*b <= 1 at b = 1: 0 >= 0) holds everywhere, or
      # nowhere: then no point of the box is allowed.
      ineqs = []
      for g in (pin(g, pinned) for g in self.ineqs):
        if any(map(any, g)):
          ineqs.append(g)
        elif sum(g.values()) < 0:
          self.empty = True
      self.ineqs = ineqs
    if not self.P:
      return
    columns = list(zip(*self.P))   # each var's exponents over P's terms
    mins = [min(col) if box[j][0] >= 1 else 0 for j, col in enumerate(columns)]
    keep = {j for j, col in enumerate(columns) if j not in pinned and max(col) > mins[j]}
    self.active = len(keep)
    supports = [{j for e in g for j in range(n) if e[j]} for g in self.ineqs]
    if supports:
      self._keep_linked(keep, supports)
    if len(keep) == n:   # the common monomial divides out (when some min is > 0)
      if any(mins):
        self.P = {tuple(map(operator.sub, e, mins)): c for e, c in self.P.items()}
      return
    keep = sorted(keep)
    self.P = {tuple([e[j] - mins[j] for j in keep]): c for e, c in self.P.items()}
    self.ineqs = [{tuple(e[j] for j in keep): c for e, c in g.items()}
                  for g, sup in zip(self.ineqs, supports) if sup <= set(keep)]
    self.names = [self.names[j] for j in keep]
    self.box = [self.box[j] for j in keep]

  def _keep_linked(self, keep: set[int], supports: list[set[int]]) -> None:
    """Adds to `keep` the vars inequalities link to it; sets `empty` if one never holds."""
    grown = True
    while grown:
      grown = False
      for sup in supports:
        if sup & keep and not sup <= keep:
          keep |= sup
          grown = True
    # An inequality P does not see can still make the whole region empty
    # (a case of max/min that cannot happen); then every claim holds vacuously.
    self.empty = self.empty or any(not sup & keep and self._never_holds(g)
                                   for g, sup in zip(self.ineqs, supports))

  def _never_holds(self, g) -> bool:
    """Proves g <= -1 on the box: no point satisfies g >= 0."""
    g1 = dict(g)
    zero = (0,) * len(self.names)
    g1[zero] = g1.get(zero, 0) + 1
    g1 = {e: c for e, c in g1.items() if c}
    if not g1:
      return False
    return BoxProblem(self.search, g1, self.names, self.box, (), None).decide(False, True).le

  # --- the procedure --------------------------------------------------------
  def decide(self, want_ge: bool = True, want_le: bool = True) -> Result:
    self._simplify()
    P = self.P
    if not P or self.empty:
      return Result(True, True, "constant")
    if not self.names:
      s = sign_of(P[()])
      self._point(())
      return Result(s >= 0, s <= 0, "coefficients")
    if self.active == 1:
      res = self._univariate()
      settled = (res.ge or not want_ge) and (res.le or not want_le)
      if settled or not self.ineqs or None not in self.search.witness.values():
        return res
      self.found = {1: False, -1: False}   # inequalities may make some pieces infeasible
    ge = want_ge and self._same_sign(1)
    le = want_le and self._same_sign(-1)
    if ge or le:
      if all(lo >= 1 for lo, _ in self.box):   # then P is strictly one-signed
        return Result(ge, le, "coefficients")
      return self._finish(ge, le, want_ge, want_le, "coefficients")
    self._probe_corners()
    if self.found[1] and self.found[-1]:
      return Result(False, False, "witness")
    ge, le = self._shifted(want_ge and not self.found[-1], want_le and not self.found[1])
    if ge or le:
      return self._finish(ge, le, want_ge, want_le, "shifted")
    if self.multipliers and self.ineqs:
      ge = want_ge and not self.found[-1] and self._by_multipliers(self.P, _MULTIPLIER_DEPTH)
      le = want_le and not self.found[1] and self._by_multipliers(
          {e: -c for e, c in self.P.items()}, _MULTIPLIER_DEPTH)
      if ge or le:
        return self._finish(ge, le, want_ge, want_le, "multipliers")
    ge, le = self._subdivide(want_ge, want_le)
    return Result(ge, le, "bernstein" if (ge or le or not self.search.exhausted) else "budget")

  def _finish(self, ge, le, want_ge, want_le, method) -> Result:
    """After one side is proven, settles the other (EQ has precedence) by search."""
    other = 1 if ge else -1
    if (ge != le) and (want_le if ge else want_ge) and not self.found[other]:
      self._probe_corners()
      if not self.found[other]:
        settled = self._subdivide(not ge, ge)
        ge, le = ge or settled[0], le or settled[1]
    return Result(ge, le, method)

  def _univariate(self) -> Result:
    """Exact sign pieces along the one var P depends on (others may be linked by inequalities)."""
    j = next(j for j in range(len(self.names)) if any(e[j] for e in self.P))
    lo, hi = self.box[j]
    c = [0] * (max(e[j] for e in self.P) + 1)
    for e, v in self.P.items():
      c[e[j]] = v
    runs = univariate_pieces(c, lo, hi, self.search.spend)
    if runs is None:
      return Result(False, False, "budget")
    pieces = tuple(Piece(a, b, s) for a, b, s in runs)
    base = [lo_ for lo_, _ in self.box]
    for p in pieces:
      if p.sign:
        for x in _representatives(p):
          base[j] = x
          self._point(tuple(base), p.sign)
    signs = {p.sign for p in pieces}
    return Result(-1 not in signs, 1 not in signs, "univariate", self.names[j], pieces)

  def _same_sign(self, s: int) -> bool:
    """All coefficients of one sign and all vars >= 0: every monomial has that sign."""
    if not all(lo >= 0 for lo, _ in self.box):
      return False
    return min(self.P.values()) >= 0 if s > 0 else max(self.P.values()) <= 0

  def _corner_values(self, j: int) -> tuple[int, ...]:
    lo, hi = self.box[j]
    return (lo, hi if hi is not None else max(lo + 1, _cap(self.P, lo)))

  def _probe_corners(self) -> None:
    """Evaluates P at the box corners: the cheapest way to two witnesses (DEPENDS)."""
    for x in itertools.product(*[self._corner_values(j) for j in range(len(self.names))]):
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
    if not (want_ge or want_le) or not self.search.spend():
      return False, False
    signs = top_degree_signs(self.P)   # kept by the shift: a wrong one fails that side
    want_ge = want_ge and -1 not in signs
    want_le = want_le and 1 not in signs
    if not (want_ge or want_le):
      return False, False
    Q = shift(self.P, [lo for lo, _ in self.box], [1] * len(self.box))
    return (want_ge and all(v >= 0 for v in Q.values()),
            want_le and all(v <= 0 for v in Q.values()))

  # --- inequality multipliers ---------------------------------------------
  def _by_multipliers(self, R, depth: int) -> bool:
    """Proves R >= 0 on the allowed points as a*R = Q + c*m*g: g >= 0 an inequality, m a
    monomial (>= 0 on the box), a, c > 0, and Q >= 0 on the whole box.

    Where an inequality holds with equality at allowed points (4*b*s vs 32768 under
    b*s <= 8192; t*s vs s^2 under t <= s), R is 0 there and negative just outside, so
    no test over a box sees its sign, and subdivision never ends along that boundary.
    Each step cancels a negative term of R by a negative term of some g that divides
    it (R's highest degrees first), up to `depth` steps; Q is then tested by its
    coefficients, and where no step is left, as a box problem of its own.
    """
    if not self.search.spend():
      return False
    lows = [lo for lo, _ in self.box]
    if all(v >= 0 for v in shift(R, lows, [1] * len(lows)).values()):
      return True   # R(lo + y) has no negative coefficient: R >= 0 wherever x >= lo
    steps = []
    if depth:
      for t in sorted((e for e, c in R.items() if c < 0), key=lambda e: -sum(e)):
        for g in self.ineqs:
          for u, cu in g.items():
            m = tuple(map(operator.sub, t, u))
            if cu < 0 and min(m) >= 0 and not any(k and lo < 0 for k, lo in zip(m, lows)):
              steps.append((t, g, -cu, m))
    for t, g, a, m in steps[:_MULTIPLIER_CANDIDATES]:
      Q = {e: a * v for e, v in R.items()}
      for w, cw in g.items():
        e = tuple(map(operator.add, w, m))
        Q[e] = Q.get(e, 0) + R[t] * cw
      if self._by_multipliers({e: v for e, v in Q.items() if v}, depth - 1):
        return True
    if steps or depth == _MULTIPLIER_DEPTH:   # R itself: what `decide` is already doing
      return False
    return BoxProblem(self.search, R, self.names, self.box, (), None).decide(True, False).ge

  # --- Bernstein subdivision -----------------------------------------------
  def _subdivide(self, want_ge: bool, want_le: bool) -> tuple[bool, bool]:
    unbounded = [j for j, (_, hi) in enumerate(self.box) if hi is None]
    caps = {j: max(self.box[j][0], _cap(self.P, self.box[j][0])) for j in unbounded}
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
    dense = Dense(self.P, [max(col) for col in zip(*self.P)])
    gdense = [Dense(g, [max(e[j] for e in g) for j in range(len(self.names))]) for g in self.ineqs]
    cost = 1 + (dense.size + sum(g.size for g in gdense)) // 64
    stack = [list(box0)]
    while stack:
      open_ge = want_ge and not self.found[-1]
      open_le = want_le and not self.found[1]
      if not (open_ge or open_le):
        break
      if not self.search.spend(cost):
        return False, False
      box = stack.pop()
      if any(max(g.bernstein(box)) < 0 for g in gdense):
        continue   # no feasible point in this box
      if all(hi - lo <= 1 for lo, hi in box):
        for x in itertools.product(*({lo, hi} for lo, hi in box)):
          self._point(x)
        continue
      B = dense.bernstein(box)
      for bits, idx in dense.corner_index:   # corner coefficients are P at the corners
        if B[idx] and self._news(sign_of(B[idx])):
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
    Q = shift(self.P, origin, [1] * n)
    rest = [j for j in range(n) if j not in tail]
    coeffs: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    for e, c in Q.items():
      coeffs.setdefault(tuple(e[j] for j in tail), {})[tuple(e[j] for j in rest)] = c
    names = [self.names[j] for j in rest]
    box = [finite[j] for j in rest]
    for C in coeffs.values():
      if not (ge or le):
        break
      sub = BoxProblem(self.search, C, names, box, (), None)
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



def _representatives(p: Piece) -> tuple[int, ...]:
  if p.hi is None:
    return (p.lo, 2 * p.lo + 1, p.lo + (1 << 20))
  return tuple(dict.fromkeys((p.lo, (p.lo + p.hi) // 2, p.hi)))
