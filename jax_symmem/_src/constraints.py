"""User constraints on dimension variables, normalized for the decision procedure.

Constraints are written as jax.export writes them: `"s <= 4096"`, `"b >= 2"`,
`"s == 128*k"` (plus `<` and `>` for convenience). They normalize to

* `substitutions`: equalities `var == poly` that eliminate `var` everywhere
  (how a divisibility such as "s is a multiple of 128" is declared);
* `bounds`: an integer interval per remaining variable, always within [1, inf);
* `inequalities`: what is left, each `p >= 0`, checked on witnesses and used by
  the decision procedure only soundly (a proof over the bounds box holds on any
  subset of it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Iterable, Mapping, Sequence, Union

from jax_symmem._src import jax_dims
from jax_symmem._src import parse as parse_lib
from jax_symmem._src.errors import ConstraintError, InfeasibleConstraintsError
from jax_symmem._src.poly import Poly, Var

_RELATION = re.compile(r"(==|>=|<=|>|<)")
# "var REL int" written plainly: what the parsing and `_simple_bound` would give, directly.
_VAR_REL_INT = re.compile(r" *([A-Za-z_][A-Za-z0-9_]*) *(<=|>=|<|>) *([1-9][0-9]*|0) *")
# "var == int*var", a declared multiple.
_VAR_EQ_MULTIPLE = re.compile(r" *([A-Za-z_][A-Za-z0-9_]*) *== *([1-9][0-9]*) *\* *([A-Za-z_][A-Za-z0-9_]*) *")


@dataclasses.dataclass(frozen=True)
class Constraints:
  """Normalized constraints; hashable so that comparisons can be cached."""
  bounds: tuple[tuple[str, int, int | None], ...] = ()
  substitutions: tuple[tuple[str, Poly], ...] = ()
  inequalities: tuple[Poly, ...] = ()
  source: tuple[str, ...] = ()

  @property
  def bounds_map(self) -> dict[str, tuple[int, int | None]]:
    return {v: (lo, hi) for v, lo, hi in self.bounds}

  def lower(self, var: str) -> int:
    return self.bounds_map.get(var, (1, None))[0]

  def upper(self, var: str) -> int | None:
    return self.bounds_map.get(var, (1, None))[1]

  @property
  def eliminated(self) -> frozenset[str]:
    return frozenset(v for v, _ in self.substitutions)

  def reduce(self, p: Poly) -> Poly:
    """Rewrites `p` with the substitutions (eliminated variables disappear)."""
    if not self.substitutions:
      return p
    mapping = {Var(v): q for v, q in self.substitutions}
    return _substitute_deep(p, mapping)

  def complete(self, env: Mapping[str, int]) -> dict[str, int]:
    """Adds the values of eliminated variables to an assignment of the others."""
    out = dict(env)
    for v, q in self.substitutions:
      if v not in out:
        out[v] = q.evaluate(out)
    return out

  def violation(self, env: Mapping[str, int]) -> str | None:
    """The first constraint that `env` violates, or None."""
    for v, lo, hi in self.bounds:
      if v in env and (env[v] < lo or (hi is not None and env[v] > hi)):
        hi_s = "inf" if hi is None else hi
        return f"{v} = {env[v]} is outside [{lo}, {hi_s}]" + self._origin(v)
    for v, q in self.substitutions:
      if v in env and q.variables() <= env.keys() and env[v] != q.evaluate(env):
        return f"{v} = {env[v]} but the constraint says {v} == {q} = {q.evaluate(env)}"
    for p in self.inequalities:
      if p.variables() <= env.keys() and p.evaluate(env) < 0:
        return f"{p} >= 0 fails ({p.evaluate(env)})" + self._origin(None)
    return None

  def allows(self, env: Mapping[str, int]) -> bool:
    """Whether `env` (the free dims) with its eliminated dims filled in meets every constraint."""
    try:
      return self.violation(self.complete(env)) is None
    except ZeroDivisionError:
      return False

  def planning_bounds(self) -> tuple[tuple[str, int, int | None], ...]:
    """`bounds`, with an upper bound that general inequalities imply for a dim without
    one ("b*s <= 8192" and s >= 2: b <= 4096), for choosing the shapes to plan at.

    The implied bound is the largest value allowed with the other dims at their lower
    bounds, or at their upper bounds where they have them, whichever is larger (b <= s
    caps b at s's upper bound, b*s <= n at n over s's lower bound). A heuristic, never a
    proof: comparisons use `bounds` alone. None where nothing caps the dim below 2**40.
    """
    if not self.inequalities:
      return self.bounds
    low = {v: lo for v, lo, _ in self.bounds}
    high = {v: (lo if hi is None else hi) for v, lo, hi in self.bounds}
    out = []
    for v, lo, hi in self.bounds:
      if hi is None:
        caps = [c for c in (self._largest(v, {**low, v: lo}, 2**40),
                            self._largest(v, {**high, v: lo}, 2**40)) if c is not None]
        hi = max(caps) if caps and max(caps) < 2**40 else None
      out.append((v, lo, hi))
    return tuple(out)

  def _largest(self, v: str, point: Mapping[str, int], top: int) -> int | None:
    """The largest value of v in [point[v], top] allowed with the other dims of `point`
    (bisection: exact where v's allowed values, the others fixed, run from point[v]
    up), or None where point[v] itself is not allowed."""
    lo, hi = point[v], top
    if not self.allows(point):
      return None
    while lo < hi:   # `lo` stays allowed
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if self.allows({**point, v: mid}) else (lo, mid - 1)
    return lo

  def cut_corners(self) -> list[dict[str, int]]:
    """Where general inequalities cut off the box's largest corner ("b*s <= 8192" with
    b <= 64 and s <= 1024: no batch of 64 sequences of 1024): for each bounded dim, the
    point with it as large as allowed and each other bounded dim after it, in turn, as
    large as then allowed ((64, 128) and (8, 1024)); [] where the corner is allowed. The
    box is `planning_bounds`' (a bound the inequalities imply counts).

    Each dim's largest value is found by bisection, which is exact where the allowed
    values of a dim, the others fixed, run from its lower bound up (as under bounds on
    products and sums); elsewhere it is an allowed value, not always the largest.
    """
    bounds = self.planning_bounds()
    bounded = [(v, lo, hi) for v, lo, hi in bounds if hi is not None]
    floor = {v: lo for v, lo, _ in bounds}
    if self.allows({**floor, **{v: hi for v, _, hi in bounded}}):
      return []
    corners: list[dict[str, int]] = []
    for i in range(len(bounded)):
      point = dict(floor)
      for v, _, hi in bounded[i:] + bounded[:i]:
        largest = self._largest(v, point, hi)
        if largest is None:
          break
        point[v] = largest
      if self.allows(point) and point not in corners:
        corners.append(point)
    return corners

  def _origin(self, var: str | None) -> str:
    # A dim's bounds also come from the dims it defines: with h == 8*k, h <= 128 bounds k.
    names = {var} | {v for v, q in self.substitutions if var in q.variables()}
    srcs = [s for s in self.source
            if var is None or any(re.search(rf"\b{re.escape(n)}\b", s) for n in names)]
    return f" (constraints: {', '.join(srcs)})" if srcs else " (every dimension is >= 1)"

  def __str__(self) -> str:
    parts = [f"{lo} <= {v}" + (f" <= {hi}" if hi is not None else "") for v, lo, hi in self.bounds]
    parts += [f"{v} == {q}" for v, q in self.substitutions]
    parts += [f"{p} >= 0" for p in self.inequalities]
    return ", ".join(parts) or "(none)"


ConstraintsLike = Union[Constraints, Sequence[str], str, None]


def _substitute_deep(p: Poly, mapping: Mapping[Var, Poly]) -> Poly:
  """Substitutes variables, also inside operation atoms."""
  from jax_symmem._src.poly import _operation
  atom_map = {}
  for a in p.atoms():
    if isinstance(a, Var):
      if a in mapping:
        atom_map[a] = mapping[a]
    elif a.variables() & {v.name for v in mapping}:
      ops = [_substitute_deep(o, mapping) for o in a.operands]
      atom_map[a] = _operation(a.op, ops[0], ops[1])
  return p.substitute(atom_map) if atom_map else p


def for_jax_export(source: Sequence[str]) -> tuple[str, ...]:
  """The constraints as jax.export parses them: it takes '==', '>=' and '<=' only, so
  a strict one over integers becomes 'lhs <= rhs - 1' ('b < 64' is 'b <= 63')."""
  out = []
  for c in source:
    parts = _RELATION.split(c)
    if len(parts) == 3 and parts[1] in ("<", ">"):
      lhs, rel, rhs = parts
      c = f"{lhs.strip()} {rel}= {rhs.strip()} {'-' if rel == '<' else '+'} 1"
    out.append(c)
  return tuple(out)


def _split(c: str) -> tuple[Poly, str, Poly]:
  parts = _RELATION.split(c)
  if len(parts) != 3:
    raise ConstraintError(
        f"cannot parse constraint {c!r}: write one relation such as 's <= 4096', "
        "'b >= 2' or 's == 128*k'")
  lhs, rel, rhs = parts
  try:
    return jax_dims.parse(lhs.strip()), rel, jax_dims.parse(rhs.strip())
  except ValueError as e:
    hint = (" (for a multiple, write 's == 8*k' with a new dim k, or declare the axis as "
            "'8*k' in polymorphic_shapes)" if "%" in c else "")
    raise ConstraintError(f"cannot parse constraint {c!r}{hint}: {e}") from None


def _solve_for_var(diff: Poly, prefer: Sequence[str]) -> tuple[str, Poly] | None:
  """For `diff == 0`, finds `var = poly` with var appearing once, linearly, coefficient +-1."""
  for name in list(prefer) + sorted(diff.variables()):
    v = Var(name)
    mono = ((v, 1),)
    coeff = diff.as_dict().get(mono)
    if coeff not in (1, -1):
      continue
    rest = diff - Poly.from_dict({mono: coeff})
    if name in rest.variables():
      continue
    return name, (-rest if coeff == 1 else rest)
  return None


def parse_constraints(constraints: ConstraintsLike, variables: Iterable[str] = ()) -> Constraints:
  """Normalizes user constraints over `variables` (each implicitly >= 1).

  The normalization depends on the constraint strings alone and is cached by
  them; `variables` only adds `1 <= v` bounds for dims the constraints do not
  mention.
  """
  if isinstance(constraints, Constraints):
    if not variables:
      return constraints
    source = constraints.source
  elif constraints is None:
    source = ()
  elif isinstance(constraints, str):
    raise ConstraintError(
        f"constraints must be a sequence of strings, got the string {constraints!r}; "
        f"write constraints=({constraints!r},)")
  else:
    source = tuple(constraints)
  for c in source:
    if not isinstance(c, str):
      raise ConstraintError(f"each constraint must be a string, got {c!r}")
  return _with_variables(normalize(source), variables)


def check_variables(constraints: Sequence[str], dims: Iterable[str]) -> None:
  """Raises ConstraintError for a constraint on a dim that is neither one of `dims` (the
  arguments' dims) nor tied to them by equalities such as 's == 128*k': such a
  constraint bounds nothing the arguments have (a typo, 'sl <= 512' for 's <= 512',
  would silently drop the bound)."""
  relations = []
  for c in constraints:
    lhs, rel, rhs = _split(c)
    relations.append((c, rel, lhs.variables() | rhs.variables()))
  known, grew = set(dims), True
  while grew:   # equalities define new dims from known ones (or known ones from new)
    grew = False
    for _, rel, names in relations:
      if rel == "==" and names & known and not names <= known:
        known |= names
        grew = True
  for c, _, names in relations:
    if not names <= known:
      unknown = ", ".join(repr(v) for v in sorted(names - known))
      raise ConstraintError(
          f"constraint {c!r} names {unknown}, which no argument's shape has (their dims: "
          f"{', '.join(sorted(dims)) or 'none'}); fix the name, or tie a dim of its own to "
          "them with an equality such as 's == 128*k'")


def _with_variables(cons: Constraints, variables: Iterable[str]) -> Constraints:
  """`cons` with the bound [1, inf) for each of `variables` it does not mention."""
  extra = set(variables)
  if not extra:
    return cons
  extra.difference_update(v for v, _, _ in cons.bounds)
  extra.difference_update(v for v, _ in cons.substitutions)
  if not extra:
    return cons
  bounds = tuple(sorted(cons.bounds + tuple((v, 1, None) for v in extra)))
  return dataclasses.replace(cons, bounds=bounds)


def _greater_equal_zero(lhs: Poly, rel: str, rhs: Poly) -> Poly:
  """`lhs rel rhs` as `p >= 0` (integers: `>` is `>= 1`)."""
  if rel == ">=":
    return lhs - rhs
  if rel == ">":
    return lhs - rhs - 1
  if rel == "<=":
    return rhs - lhs
  return rhs - lhs - 1


def _linear_in_one_var(p: Poly) -> tuple[str, int, int] | None:
  """(v, a, c0) if p == a*v + c0 for one variable v, else None."""
  terms = p.terms
  if not terms or len(terms) > 2 or (len(terms) == 2 and terms[1][0]):
    return None
  mono, a = terms[0]
  if len(mono) != 1 or mono[0][1] != 1 or not isinstance(mono[0][0], Var):
    return None
  return mono[0][0].name, a, (terms[1][1] if len(terms) == 2 else 0)


def _simple_bound(lhs: Poly, rel: str, rhs: Poly) -> tuple[str, int, int] | None:
  """For `var rel int` or `int rel var`: (var, a, c0) with the relation `a*var + c0 >= 0`, a = +-1."""
  for var_side, const_side, sign in ((lhs, rhs, 1), (rhs, lhs, -1)):
    if len(var_side.terms) != 1 or not const_side.is_constant():
      continue
    mono, coeff = var_side.terms[0]
    if coeff != 1 or len(mono) != 1 or mono[0][1] != 1 or not isinstance(mono[0][0], Var):
      continue
    n = const_side.constant
    if rel in ("<=", "<"):
      sign = -sign
    # sign * (var - n) >= 0, and one more for a strict relation
    return mono[0][0].name, sign, -sign * n - (rel in (">", "<"))
  return None


def _shortcut(source: tuple[str, ...]) -> Constraints | None:
  """`normalize` for the common sources, else None: 'var REL int' bounds and at most
  one declared multiple 'v == n*w' (then the first equality, so v is eliminated).

  The same arithmetic as `normalize`'s steps 1-2 (each bound as a*v + c0 >= 0,
  a bound on v moved to w, v >= 1 kept as a bound on w) without its
  bookkeeping: comparisons normalize their constraints on every fresh call. A
  contradiction returns None, so that the general route words the error.
  """
  relations: list[tuple[str, int, int]] = []   # (var, a, c0): a*var + c0 >= 0
  multiple = None
  reserved = parse_lib.RESERVED
  for c in source:
    m = _VAR_REL_INT.fullmatch(c)
    if m is not None:
      v, rel, n = m.groups()
      if v not in reserved:
        a = 1 if rel[0] == ">" else -1
        relations.append((v, a, -a * int(n) - (len(rel) == 1)))
        continue
    m = _VAR_EQ_MULTIPLE.fullmatch(c)
    if (m is None or multiple is not None or m.group(1) == m.group(3)
        or reserved.intersection(m.group(1, 3))):
      return None
    multiple = m.group(1), int(m.group(2)), m.group(3)
  substitutions = ()
  if multiple is not None:
    v, n, w = multiple
    relations.append((v, 1, -1))   # v is a dimension too
    relations = [(w, a * n, c0) if x == v else (x, a, c0) for x, a, c0 in relations]
    substitutions = ((v, Poly(((((Var(w), 1),), n),))),)
  lo: dict[str, int] = {}
  hi: dict[str, int | None] = {}
  for x, a, c0 in relations:
    if a > 0:   # a*x + c0 >= 0  ->  x >= ceil(-c0 / a)
      bound = -(c0 // a)
      if bound > lo.get(x, 1):
        lo[x] = bound
    else:       # x <= floor(c0 / -a)
      bound = c0 // -a
      if x not in hi or bound < hi[x]:
        hi[x] = bound
  bounds = []
  for x in sorted({x for x, _, _ in relations}):
    l, h = lo.get(x, 1), hi.get(x)
    if h is not None and l > h:
      return None
    bounds.append((x, l, h))
  return Constraints(bounds=tuple(bounds), substitutions=substitutions, source=source)


@functools.lru_cache(maxsize=1 << 12)
def normalize(source: tuple[str, ...]) -> Constraints:
  """The normalized form of the constraint strings `source` (cached by the strings)."""
  fast = _shortcut(source)
  if fast is not None:
    return fast
  relations = []
  all_vars: set[str] = set()
  for c in source:
    m = _VAR_REL_INT.fullmatch(c)
    if m and m.group(1) not in parse_lib.RESERVED:   # "s <= 4096": no parsing, no algebra
      relations.append((c, None, m.group(2), m.group(1, 3)))
      all_vars.add(m.group(1))
      continue
    m = _VAR_EQ_MULTIPLE.fullmatch(c)
    if m and m.group(1) != m.group(3) and not parse_lib.RESERVED.intersection(m.group(1, 3)):
      relations.append((c, None, "==", m.group(1, 2, 3)))   # "s == 128*k"
      all_vars.update(m.group(1, 3))
    else:
      lhs, rel, rhs = _split(c)
      relations.append((c, lhs, rel, rhs))
      all_vars |= lhs.variables() | rhs.variables()

  # 1. Equalities become substitutions, applied to each other as they come.
  subs: dict[str, Poly] = {}
  def reduce(p: Poly) -> Poly:
    return _substitute_deep(p, {Var(v): q for v, q in subs.items()}) if subs else p
  ineqs: list[tuple[str, Poly]] = []
  for c, lhs, rel, rhs in relations:
    multiple = None   # (v, n) of 'v == n*w'
    if lhs is None and rel == "==":
      v, n, w = rhs
      if not subs:   # v == n*w, the first equality: what _solve_for_var gives for v - n*w
        subs[v] = Poly(((((Var(w), 1),), int(n)),))
        continue
      lhs, rhs, multiple = Poly.var(v), int(n) * Poly.var(w), (v, int(n))
    if lhs is None:
      name, n = rhs
      sign = 1 if rel[0] == ">" else -1
      ineqs.append((c, (name, sign, -sign * int(n) - (len(rel) == 1))))
    elif rel == "==":
      diff = reduce(lhs - rhs)
      if diff.is_constant():
        if diff.constant != 0:
          raise InfeasibleConstraintsError(
              f"constraint {c!r} contradicts the others: it reduces to {diff} == 0")
        continue
      prefer = [lhs.variables().__iter__().__next__()] if len(lhs.terms) == 1 and lhs.degree() == 1 and lhs.variables() else []
      solved = _solve_for_var(diff, prefer)
      earlier = subs.get(multiple[0]) if multiple else None
      if solved is None and earlier is not None and len(earlier.terms) == 1:
        (((u, _),), m), = earlier.terms   # v == m*u declared before: one multiple of both
        v, n = multiple
        raise ConstraintError(
            f"{v} is declared a multiple twice ('{v} == {m}*{u.name}' and {c!r}): declare "
            f"their least common multiple once, '{v} == {math.lcm(m, n)}*{u.name}'")
      if solved is None:
        raise ConstraintError(
            f"cannot use equality {c!r}: write it as 'var == expression' with the variable "
            "appearing once on the left, e.g. 's == 128*k'")
      v, q = solved
      if q.is_constant() and q.constant < 1:   # s == 2*t and s == 3*t: t == 0
        raise InfeasibleConstraintsError(
            f"constraint {c!r} contradicts the others: with them it says {v} == {q.constant}, "
            "and every dimension is >= 1")
      subs = {w: _substitute_deep(p, {Var(v): q}) for w, p in subs.items()}
      subs[v] = q
    else:
      ineqs.append((c, _simple_bound(lhs, rel, rhs) or _greater_equal_zero(lhs, rel, rhs)))
  # Every original dimension is >= 1. For one that stays free that is the
  # starting bound below; an eliminated one constrains its substitute.
  for v in sorted(all_vars):
    if v in subs:
      ineqs.append((f"{v} >= 1", (v, 1, -1)))

  # 2. Inequalities linear in one variable become bounds; the rest stay general.
  free_vars = sorted((all_vars - subs.keys()) | {w for q in subs.values() for w in q.variables()})
  lo: dict[str, int] = {v: 1 for v in free_vars}
  hi: dict[str, int | None] = {v: None for v in free_vars}
  general: list[Poly] = []
  for c, p in ineqs:
    linear = None
    if isinstance(p, tuple):   # a*v + c0 >= 0 with a = +-1: no algebra needed
      v, a, c0 = p
      q = subs.get(v)
      if q is None:
        linear = p
      elif (w := _linear_in_one_var(q)) is not None:   # v == alpha*w + beta
        linear = (w[0], a * w[1], a * w[2] + c0)
      else:
        p = a * Poly.var(v) + c0
    if linear is None:
      p = reduce(p)
      if p.is_constant():
        if p.constant < 0:
          raise InfeasibleConstraintsError(f"constraint {c!r} can never hold (it reduces to {p} >= 0)")
        continue
      linear = _linear_in_one_var(p)
    if linear is not None:
      v, a, c0 = linear
      if a > 0:   # a*v + c0 >= 0  ->  v >= ceil(-c0 / a)
        lo[v] = max(lo[v], -((c0) // a))
      else:       # v <= floor(c0 / -a)
        bound = c0 // (-a)
        hi[v] = bound if hi[v] is None else min(hi[v], bound)
    else:
      general.append(p)
  for v in free_vars:
    if hi[v] is not None and lo[v] > hi[v]:
      srcs = [c for c in source if re.search(rf"\b{re.escape(v)}\b", c)]
      raise InfeasibleConstraintsError(
          f"constraints on {v!r} contradict each other: they require {lo[v]} <= {v} <= {hi[v]}"
          + (f" (from {', '.join(repr(s) for s in srcs)})" if srcs else ""))
  bounds = tuple((v, lo[v], hi[v]) for v in free_vars)
  return Constraints(bounds=bounds, substitutions=tuple(sorted(subs.items())),
                     inequalities=tuple(dict.fromkeys(general)), source=source)
