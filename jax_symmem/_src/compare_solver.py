"""The solver of one comparison: reduction, operation atoms, witnesses.

`Solver(lhs, rhs, constraints).run()` reduces lhs - rhs by the constraints'
substitutions, hands a plain polynomial to a `BoxProblem`, and rewrites or
relaxes floordiv/mod/max/min atoms into plain polynomials over a box that
contains every allowed point first (exact rewrites s = k*q + r, bounded fresh
vars, case splits, interval relaxation). Proofs hold on that superset;
witnesses are completed to full assignments and verified on the original
expressions before they count. `compare_polys` is its memoized entry point.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from typing import Iterable, Iterator, Mapping

from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import poly as poly_lib
from jax_symmem._src.compare_box import BoxProblem, Result, Search
from jax_symmem._src.compare_interval import INF, atom_interval, poly_interval
from jax_symmem._src.compare_kernel import sign_of, to_dict
from jax_symmem._src.compare_ordering import (DEPENDS, EQ, GE, LE, UNKNOWN, FrozenEnv, Kind,
                                               Ordering)
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.poly import OpAtom, Poly, Var, cached

# Boxes (Bernstein evaluations, univariate splits) one comparison may spend.
BOX_BUDGET = 4000
# max/min atoms split into cases at most this deep; deeper ones are relaxed.
_MAX_CASE_DEPTH = 6
# Random probes of the original expression when the proofs leave a sign open.
PROBES = 48
# floordiv/mod of one var by several constants (s/3 vs s/4): s = L*q + r with L their
# least common multiple, one case per remainder r, for L up to this.
_MAX_REMAINDER_CASES = 64


@functools.lru_cache(maxsize=1 << 16)
def compare_polys(lhs: Poly, rhs: Poly, constraints: Constraints) -> Ordering:
  """The memoized core of `compare` (all arguments hashable, already normalized)."""
  return Solver(lhs, rhs, constraints).run()


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


class Solver:
  """One comparison: holds the original expressions, the budget and the witnesses.

  `budget`: boxes (Bernstein evaluations, univariate splits) it may spend
  before answering UNKNOWN.
  """

  def __init__(self, lhs: Poly, rhs: Poly, cons: Constraints, budget: int = BOX_BUDGET):
    self.lhs, self.rhs, self.cons = lhs, rhs, cons
    self.bounds = cons.bounds_map
    self.search = Search(budget)           # shared with every box problem of this comparison
    self.witness = self.search.witness     # sign -> verified full assignment, or None
    self.fresh = 0

  # --- witnesses ------------------------------------------------------------
  def bound(self, v: str) -> tuple[int, int | None]:
    return self.bounds.get(v, (1, None))

  @cached
  def free_vars(self) -> tuple[str, ...]:
    names = set(self.bounds) | self._constrained | self.lhs.variables() | self.rhs.variables()
    names.difference_update([v for v, _ in self.cons.substitutions])
    return tuple(sorted(names))

  @cached
  def _operations(self) -> list[tuple[OpAtom, bool]]:
    """Each operation atom of the difference, and whether its operands are plain."""
    atoms = {a for p in (self.lhs, self.rhs) for m, _ in p.terms for a, _ in m if type(a) is not Var}
    return [(a, _all_vars(a.operands[0]) and _all_vars(a.operands[1])) for a in atoms]

  def _value(self, env: Mapping[str, int]) -> int:
    """Exact value of the original lhs - rhs at a full assignment."""
    ops = {}   # each operation atom once (it may occur on both sides)
    for a, plain in self._operations:
      ops[a] = (poly_lib.apply_operation(a.op, _evaluate(a.operands[0], env), _evaluate(a.operands[1], env))
                if plain else a.evaluate(env))
    return _evaluate(self.lhs, env, ops) - _evaluate(self.rhs, env, ops)

  @cached
  def _constrained(self) -> frozenset[str]:
    """Variables that general inequalities mention: completing them takes a search."""
    ineqs = self.cons.inequalities
    return frozenset().union(*[g.variables() for g in ineqs]) if ineqs else frozenset()

  def probe(self, env: Mapping[str, int]) -> int | None:
    """Exact sign of the original lhs - rhs at a completed, feasible `env` (records witnesses)."""
    full = self.complete(env)
    if full is None:
      return None
    try:
      s = sign_of(self._value(full))
    except ZeroDivisionError:
      return None
    if s and self.witness[s] is None:
      self.witness[s] = full
    return s

  def on_point(self, env: dict[str, int], sign: int) -> None:
    if self.witness[sign] is None:
      self.probe(env)

  def on_exact_point(self, env: dict[str, int], sign: int) -> None:
    """`on_point` where the box problem's polynomial is the difference itself: its sign
    there is the original's (the vars it lacks are absent from the difference, or a
    common factor >= 1 divided out), so the point needs completing, not evaluating."""
    if self.witness[sign] is None:
      full = self.complete(env)
      if full is not None:
        self.witness[sign] = full

  def complete(self, env: Mapping[str, int]) -> dict[str, int] | None:
    """Fills the free vars `env` lacks so that every constraint holds (small search)."""
    free = self.free_vars
    point = {v: int(env[v]) for v in free if v in env}
    if len(point) == len(free):   # the usual case: the search below has one trial, `point`
      return self._checked(point)
    missing = [v for v in free if v not in point]
    if self._constrained.isdisjoint(missing):   # one trial: each at its lower bound
      point.update((v, self.bound(v)[0]) for v in missing)
      return self._checked(point)
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
      full = self._checked(trial)
      if full is not None:
        return full
    return None

  def _checked(self, trial: dict[str, int]) -> dict[str, int] | None:
    """`trial` with the eliminated vars filled in, if that satisfies every constraint."""
    try:
      full = self.cons.complete(trial)
      if self.cons.violation(full) is None:
        return full
    except ZeroDivisionError:
      pass
    return None

  def samples(self, names: Iterable[str], count: int) -> Iterator[dict[str, int]]:
    """Corners, centre and seeded random points of the box of `names` (near lo, too).

    Drawn lazily: callers stop at the first points that settle what they look for.
    """
    names = sorted(names)
    rng = random.Random(0)
    axes = []
    for v in names:
      lo, hi = self.bound(v)
      axes.append((lo, hi if hi is not None else max(2 * lo, 1 << 12)))
    points = itertools.chain(
        itertools.islice(itertools.product(*axes), 16),
        (tuple((a + b) // 2 for a, b in axes),),
        (tuple(rng.randint(a, b) for a, b in axes) for _ in range(count)),
        (tuple(rng.randint(a, min(b, a + 8)) for a, b in axes) for _ in range(count // 2)))
    return (dict(zip(names, x)) for x in points)

  def probe_randomly(self, names: Iterable[str], count: int) -> None:
    for env in self.samples(names, count):
      if self.witness[1] is not None and self.witness[-1] is not None:
        return
      self.probe(env)

  # --- the procedure --------------------------------------------------------
  def run(self) -> Ordering:
    plain = self._plain_difference()
    if plain is not None:   # the usual case, without building monomials of Vars
      names, P = plain
      if not names:   # no variable left: P is {(): c} or empty
        return self._constant(P.get((), 0))
      return self._decide_plain(names, P, exact=True)
    diff = self.reduced_difference()
    if all(not mono for mono in diff):
      return self._constant(diff.get((), 0))
    atoms = {a for mono in diff for a, _ in mono}
    if all(isinstance(a, Var) for a in atoms):
      names = sorted(a.name for a in atoms)
      index = {n: i for i, n in enumerate(names)}
      P = {}
      for mono, c in diff.items():
        e = [0] * len(names)
        for a, k in mono:
          e[index[a.name]] = k
        P[tuple(e)] = c
      return self._decide_plain(names, P)
    d = Poly.from_dict(diff)
    self.probe_randomly(d.variables(), 4)
    if self.witness[1] is not None and self.witness[-1] is not None:
      return self._ordering(DEPENDS, "witness")
    frame = _Frame(bounds={v: self.bound(v) for v in d.variables()},
                   ineqs=tuple(g for g in self.cons.inequalities if not has_ops(g)))
    res = self._atoms(d, frame)
    res.dim, res.pieces = None, ()
    return self._finish(res, d.variables())

  def _decide_plain(self, names: list[str], P: dict[tuple[int, ...], int],
                    exact: bool = False) -> Ordering:
    """Decides P (exponents over the sorted `names`) with the inequalities that have no atoms.

    Their variables join `names` (they may cut the box), with exponent 0 in P.
    `exact`: P is lhs - rhs itself, with the substitutions applied, so its sign at a
    point is the original's at that point completed (`on_exact_point`).
    """
    ineqs = [g for g in self.cons.inequalities if not has_ops(g)]
    gs = []
    if ineqs:
      wider = sorted(set(names).union(*(g.variables() for g in ineqs)))
      if len(wider) > len(names):
        cols = [wider.index(n) for n in names]
        P = {_spread(e, cols, len(wider)): c for e, c in P.items()}
        names = wider
      gs = [to_dict(g, names) for g in ineqs]
    box = [self.bound(v) for v in names]
    on_point = self.on_exact_point if exact else self.on_point
    res = BoxProblem(self.search, P, names, box, gs, on_point, multipliers=True).decide()
    return self._finish(res, names)

  def _plain_difference(self) -> tuple[list[str], dict[tuple[int, ...], int]] | None:
    """(names, P): the reduced lhs - rhs as {exponents over the sorted `names`: coeff}.

    The fast route of `run`, for the usual case: no operation atoms, and every
    substitution a monomial (s == 128*k). Reducing, subtracting and converting
    to exponents are then one pass over the terms, with dicts keyed by exponent
    tuples rather than by monomials of Vars (whose hashes are Python calls).
    `names` are the variables left after cancellation, as `reduced_difference`
    leaves them, and P's keys come in its order. None: take the general route.
    """
    lhs, rhs = self.lhs, self.rhs
    if not (_all_vars(lhs) and _all_vars(rhs)):
      return None
    subs = {}
    for v, q in self.cons.substitutions:
      if len(q.terms) != 1 or not _all_vars(q):
        return None
      (qm, qc), = q.terms
      subs[v] = (qc, tuple((a.name, f) for a, f in qm))
    variables = lhs.variables() | rhs.variables()
    if subs:
      for v in variables & subs.keys():
        variables = variables.union(n for n, _ in subs[v][1])
      variables = variables - subs.keys()
    names = sorted(variables)
    index = {n: i for i, n in enumerate(names)}
    zero = [0] * len(names)
    P: dict[tuple[int, ...], int] = {}
    for p, sign in ((lhs, 1), (rhs, -1)):
      for mono, c in p.terms:
        e = zero.copy()
        c *= sign
        for a, k in mono:
          q = subs.get(a.name) if subs else None
          if q is None:
            e[index[a.name]] += k
          else:   # v^k with v == qc * prod(w^f): qc^k * prod(w^(f*k))
            c *= q[0] ** k
            for w, f in q[1]:
              e[index[w]] += f * k
        key = tuple(e)
        P[key] = P.get(key, 0) + c
    P = {e: c for e, c in P.items() if c}
    used = [j for j, col in enumerate(zip(*P)) if any(col)]
    if len(used) < len(names):   # variables that cancelled out
      names = [names[j] for j in used]
      P = {tuple([e[j] for j in used]): c for e, c in P.items()}
    return names, P

  def reduced_difference(self) -> dict:
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
    s = sign_of(c)
    if s == 0:
      return self._ordering(EQ, "constant")
    self.probe({})
    return self._ordering(GE if s > 0 else LE, "constant")

  def _finish(self, res: Result, names: Iterable[str]) -> Ordering:
    if res.ge and res.le:
      kind = EQ
    elif res.ge:
      kind = GE
    elif res.le:
      kind = LE
    else:
      if self.witness[1] is None or self.witness[-1] is None:
        self.probe_randomly(names, PROBES)
      if self.witness[1] is not None and self.witness[-1] is not None:
        method = res.method if res.method in ("univariate", "bernstein", "witness") else "witness"
        return self._ordering(DEPENDS, method, res)
      return self._ordering(UNKNOWN, res.method if res.method == "budget" else "unproven")
    # A verified counter-witness would mean a wrong proof: refuse rather than lie.
    if (kind in (GE, EQ) and self.witness[-1]) or (kind in (LE, EQ) and self.witness[1]):
      return self._ordering(UNKNOWN, "inconsistent")
    return self._ordering(kind, res.method, res)

  def _ordering(self, kind: Kind, method: str, res: Result | None = None) -> Ordering:
    gt, lt = self.witness[1], self.witness[-1]
    if kind == EQ:
      gt = lt = None
    return Ordering.of(
        kind, self.lhs, self.rhs,
        witness_gt=FrozenEnv(gt) if gt else None,
        witness_lt=FrozenEnv(lt) if lt else None,
        dim=res.dim if res is not None and res.pieces else None,
        pieces=res.pieces if res is not None else (),
        method=method)

  # --- operation atoms ------------------------------------------------------
  def _new_var(self, tag: str) -> str:
    self.fresh += 1
    return f"{tag}#{self.fresh}"   # '#' never occurs in a JAX dimension name

  def _atoms(self, d: Poly, f: _Frame) -> Result:
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
      s = sign_of(d.constant)
      return Result(s >= 0, s <= 0, "constant")
    ops = sorted((a for a in d.atoms() if isinstance(a, OpAtom)), key=lambda a: a.sort_key)
    if not ops:
      return self._plain(d, f)
    # Cases first: their regions often become bounds (s >= 128) that the rewrites then use.
    for a in ops:
      if a.op in (poly_lib.MAX, poly_lib.MIN) and f.depth < _MAX_CASE_DEPTH:
        return self._cases(d, a, f)
    for a in ops:   # divisions of one var s (of a*s + c) by positive constants
      lin = _linear(a.operands[0]) if a.op in (poly_lib.FLOORDIV, poly_lib.MOD) else None
      divisions = _divisions_of(d, lin[0]) if lin else ()
      if not divisions:
        continue
      if len({(x, y, z) for _, x, y, z in divisions}) == 1 and divisions[0][1:3] == (1, 0):
        return self._exact_divmod(d, divisions[0][0], f)   # of s itself, by one k
      if math.lcm(*(k for *_, k in divisions)) <= _MAX_REMAINDER_CASES:
        return self._remainder_cases(d, lin[0], divisions, f)
    for a in ops:
      if a.op in (poly_lib.FLOORDIV, poly_lib.MOD) and _const_divisor(a):
        return self._general_divmod(d, a, f)
    for a in ops:
      if a.op in (poly_lib.FLOORDIV, poly_lib.MOD):
        return self._division(d, a, f)
    return self._relax(d, ops[0], f)

  def _plain(self, d: Poly, f: _Frame) -> Result:
    ineqs = [g for g in f.ineqs if not has_ops(g)]
    names = sorted(d.variables().union(*(g.variables() for g in ineqs)))
    box = [f.bounds[v] if v in f.bounds else self.bound(v) for v in names]
    gs = [to_dict(g, names) for g in ineqs]
    on_point = functools.partial(self._on_relaxed_point, rewrites=f.rewrites)
    # The cases of max/min are exact: their regions' inequalities may prove, as the user's.
    exact = not f.rewrites and not any("#" in v for v in names)
    return BoxProblem(self.search, to_dict(d, names), names, box, gs, on_point,
                      multipliers=exact).decide(*f.want)

  def _on_relaxed_point(self, env: dict[str, int], sign: int, rewrites) -> None:
    """Maps a point of a relaxed problem back to the original dims and verifies it."""
    if self.witness[1] is not None and self.witness[-1] is not None:
      return
    env = dict(env)
    for rw in reversed(rewrites):
      if rw.q in env and rw.r in env:
        env[rw.var] = rw.k * env[rw.q] + env[rw.r]
    self.probe({v: x for v, x in env.items() if "#" not in v})

  def _remainder_cases(self, d: Poly, s: str, divisions, f: _Frame) -> Result:
    """floordiv / mod of a*s + c by several constants k (`_divisions_of`): s = L*q + r with
    L the least common multiple of the k, and one exact case per remainder r:
    floordiv(a*s + c, k) = (a*L/k)*q + floordiv(a*r + c, k), mod(a*s + c, k) =
    mod(a*r + c, k). So floordiv(s, 3) >= floordiv(s, 4) and floordiv(5*s, 4) >= s are
    proven, where relaxing each division alone loses what ties them to s. r stays a var,
    fixed per case, for the rewrite that maps points back."""
    L = math.lcm(*(k for *_, k in divisions))
    q, r = self._new_var("q"), self._new_var("r")
    Q = Poly.var(q)
    repl = {Var(s): L * Q + Poly.var(r)}
    inner = f.but(rewrites=f.rewrites + (_Rewrite(s, L, q, r),))
    ge, le = f.want
    method = "constant"
    for q_box, r_box in _quotient_boxes(*f.bounds[s], L):
      for rv in range(r_box[0], r_box[1] + 1):
        if not (ge or le):
          return Result(False, False, method)
        atoms = {atom: (a * L // k) * Q + (a * rv + c) // k if atom.op == poly_lib.FLOORDIV
                 else Poly.const((a * rv + c) % k) for atom, a, c, k in divisions}
        case = lambda p: constraints_lib._substitute_deep(p.substitute(atoms), repl)
        res = self._atoms(case(d), inner.but(
            bounds={**f.bounds, q: q_box, r: (rv, rv)},
            ineqs=tuple(case(g) for g in f.ineqs), want=(ge, le)))
        ge, le = ge and res.ge, le and res.le
        method = res.method if method == "constant" else method
    return Result(ge, le, method)

  def _exact_divmod(self, d: Poly, a: OpAtom, f: _Frame) -> Result:
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
    return Result(ge, le, method)

  def _general_divmod(self, d: Poly, a: OpAtom, f: _Frame) -> Result:
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
    lo, hi = sorted(k * x for x in atom_interval(fd, f.bounds))
    qk = p - Poly.var(m)
    band = tuple(g for g, bound in ((qk - _finite(lo), lo), (_finite(hi) - qk, hi))
                 if abs(bound) != INF)
    bounds = {**f.bounds, m: (0, k - 1) if k > 0 else (k + 1, 0)}
    return self._atoms(out, f.but(bounds=bounds, ineqs=f.ineqs + band))

  def _division(self, d: Poly, a: OpAtom, f: _Frame) -> Result:
    """floordiv(p, q) = w and mod(p, q) = p - q*w, w fresh, with the band q*w <= p < q*(w + 1)."""
    p, q = a.operands
    q_lo, q_hi = poly_interval(q, f.bounds)
    fd, md = OpAtom(poly_lib.FLOORDIV, (p, q)), OpAtom(poly_lib.MOD, (p, q))
    lo, hi = atom_interval(fd, f.bounds)
    if lo == -INF or not (q_lo > 0 or q_hi < 0):
      return self._relax(d, a, f)
    w = self._new_var("w")
    W = Poly.var(w)
    rem = p - q * W
    band = (rem, q - 1 - rem) if q_lo > 0 else (rem - q - 1, -rem)
    bounds = {**f.bounds, w: (int(lo), None if hi == INF else int(hi))}
    return self._atoms(d.substitute({fd: W, md: rem}), f.but(bounds=bounds, ineqs=f.ineqs + band))

  def _cases(self, d: Poly, a: OpAtom, f: _Frame) -> Result:
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
    return Result(ge, le, "cases")

  def _on_region(self, d: Poly, g: Poly, f: _Frame) -> Result:
    """Decides d where g >= 0; a g linear in one var narrows that var's bounds instead."""
    bound = _as_bound(g)
    if bound is None:
      return self._atoms(d, f.but(ineqs=f.ineqs + (g,)))
    v, lo, hi = bound
    old_lo, old_hi = f.bounds[v] if v in f.bounds else self.bound(v)
    lo = old_lo if lo is None else max(lo, old_lo)
    hi = old_hi if hi is None else (hi if old_hi is None else min(hi, old_hi))
    if hi is not None and lo > hi:
      return Result(True, True, "constant")   # an empty region: nothing to prove
    return self._atoms(d, f.but(bounds={**f.bounds, v: (lo, hi)}))

  def _relax(self, d: Poly, a: OpAtom, f: _Frame) -> Result:
    """Replaces an opaque atom by a fresh var bounded by interval arithmetic."""
    lo, hi = atom_interval(a, f.bounds)
    if lo == -INF:
      return Result(False, False, "unproven")
    w = self._new_var("w")
    bounds = {**f.bounds, w: (int(lo), None if hi == INF else int(hi))}
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


def _evaluate(p: Poly, env: Mapping[str, int], ops: Mapping | None = None) -> int:
  """p's exact value: each var's from `env` by name, each operation atom's from `ops`."""
  total = 0
  for m, c in p.terms:
    for a, e in m:
      c *= (env[a.name] if type(a) is Var else ops[a]) ** e
    total += c
  return total


def _linear(p: Poly) -> tuple[str, int, int] | None:
  """(s, a, c) where p is a*s + c for one var s (a != 0, integers), else None."""
  if len(p.terms) > 2 or not _all_vars(p) or p.degree() != 1 or len(p.variables()) != 1:
    return None
  (s,) = p.variables()
  return s, p.as_dict()[((Var(s), 1),)], p.constant


def _divisions_of(d: Poly, s: str):
  """(atom, a, c, k) for each floordiv/mod atom of d over a*s + c by a constant k > 0
  (the rest stay atoms, over s rewritten)."""
  out = []
  for atom in d.atoms():
    if isinstance(atom, OpAtom) and atom.op in (poly_lib.FLOORDIV, poly_lib.MOD) \
        and _const_divisor(atom) and atom.operands[1].constant > 0:
      lin = _linear(atom.operands[0])
      if lin is not None and lin[0] == s:
        out.append((atom, lin[1], lin[2], atom.operands[1].constant))
  return sorted(out, key=lambda x: x[0].sort_key)


def _all_vars(p: Poly) -> bool:
  """No operation atoms in p (a scan of the terms: cheaper than p.atoms() on a fresh Poly)."""
  for mono, _ in p.terms:
    for a, _ in mono:
      if type(a) is not Var:
        return False
  return True


def _spread(e: tuple[int, ...], cols: list[int], n: int) -> tuple[int, ...]:
  """Exponents e over a sub-list of names, placed at `cols` of n names (0 elsewhere)."""
  out = [0] * n
  for j, x in zip(cols, e):
    out[j] = x
  return tuple(out)


def _finite(x) -> int:
  return int(x) if abs(x) != INF else 0


def has_ops(p: Poly) -> bool:
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
  if any(poly_interval(o, bounds)[0] < 0 for o in a.operands):
    return 0
  signs = set()
  for mono, c in d.terms:
    if any(at == a for at, _ in mono):
      if any(at != a and atom_interval(at, bounds)[0] < 0 for at, _ in mono):
        return 0
      signs.add(sign_of(c))
  return signs.pop() if len(signs) == 1 else 0


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

