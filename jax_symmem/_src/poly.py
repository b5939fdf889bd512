"""Exact integer polynomials over dimension atoms.

A `Poly` is a sum of integer-coefficient monomials; a monomial is a product of
atoms raised to positive powers. An atom is either a dimension variable (`Var`)
or an operation over polynomials (`OpAtom`: floordiv, mod, max, min) that stays
opaque to the algebra but evaluates exactly.

Everything here is plain Python ints: no overflow (JAX's `_evaluate` wraps at
int32 for realistic byte sizes) and no rewriting of floordiv/mod beyond constant
folding (sympy 1.14 simplifies `Mod` wrongly; see DESIGN.md F9). sympy is used
for display only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Union

FLOORDIV = "floordiv"
MOD = "mod"
MAX = "max"
MIN = "min"
OPERATIONS = (FLOORDIV, MOD, MAX, MIN)


class cached:
  """`functools.cached_property` without its lock (Python 3.11 takes it on every first read)."""

  def __init__(self, fn):
    self.fn = fn
    self.name = fn.__name__

  def __get__(self, obj, owner=None):
    if obj is None:
      return self
    value = obj.__dict__[self.name] = self.fn(obj)
    return value


@dataclasses.dataclass(frozen=True, order=False)
class Var:
  """A dimension variable, an integer >= 1 unless constraints say more."""
  name: str

  def __hash__(self) -> int:   # cheaper than the generated hash((name,)); equality is by name
    return hash(self.name)

  @cached
  def sort_key(self) -> tuple:
    return (0, self.name)

  def evaluate(self, env: Mapping[str, int]) -> int:
    try:
      return int(env[self.name])
    except KeyError:
      raise KeyError(f"no value given for dimension {self.name!r}") from None

  def variables(self) -> frozenset[str]:
    return frozenset((self.name,))

  def __str__(self) -> str:
    return self.name


@dataclasses.dataclass(frozen=True, order=False)
class OpAtom:
  """`op(operands...)` for op in floordiv/mod/max/min, opaque to the algebra."""
  op: str
  operands: tuple["Poly", ...]

  def __post_init__(self):
    if self.op not in OPERATIONS:
      raise ValueError(f"unknown dimension operation {self.op!r}")

  def __hash__(self) -> int:
    # The generated hash((op, operands)), once: atoms key the dicts of Poly arithmetic.
    try:
      return self.__dict__["_hash"]
    except KeyError:
      h = hash((self.op, self.operands))
      object.__setattr__(self, "_hash", h)
      return h

  def __getstate__(self) -> dict:
    # The fields only: the cached hash depends on the process's string-hash seed.
    return {"op": self.op, "operands": self.operands}

  @cached
  def sort_key(self) -> tuple:
    return (1, self.op, tuple(o.sort_key for o in self.operands))

  def evaluate(self, env: Mapping[str, int]) -> int:
    vals = [o.evaluate(env) for o in self.operands]
    return apply_operation(self.op, *vals)

  def variables(self) -> frozenset[str]:
    return self._variables

  @cached
  def _variables(self) -> frozenset[str]:
    return frozenset().union(*(o.variables() for o in self.operands))

  def __str__(self) -> str:
    return f"{self.op}({', '.join(str(o) for o in self.operands)})"


Atom = Union[Var, OpAtom]
# A monomial: ((atom, exponent), ...) sorted by atom.sort_key; () is the constant 1.
Monomial = tuple[tuple[Atom, int], ...]


def apply_operation(op: str, a: int, b: int) -> int:
  """op(a, b) on integers, as an OpAtom evaluates it (ZeroDivisionError for a zero divisor)."""
  if op == FLOORDIV:
    if b == 0:
      raise ZeroDivisionError("floordiv by zero in a dimension expression")
    return a // b
  if op == MOD:
    if b == 0:
      raise ZeroDivisionError("mod by zero in a dimension expression")
    return a % b
  if op == MAX:
    return max(a, b)
  return min(a, b)


_MONO_KEYS: dict = {}


def _mono_key(m: Monomial) -> tuple:
  # Higher degree first, then atoms; gives the familiar "s^2 + 3*s + 1" order.
  # The constant monomial () sorts last. Memoized: sorting terms is most of Poly arithmetic.
  try:
    return _MONO_KEYS[m]
  except KeyError:
    if len(_MONO_KEYS) >= 1 << 16:
      _MONO_KEYS.clear()
    k = _MONO_KEYS[m] = (-sum(e for _, e in m), tuple((a.sort_key, -e) for a, e in m))
    return k


def _mono_mul(m1: Monomial, m2: Monomial) -> Monomial:
  if not m1:
    return m2
  if not m2:
    return m1
  exps: dict[Atom, int] = dict(m1)
  for a, e in m2:
    exps[a] = exps.get(a, 0) + e
  return tuple(sorted(exps.items(), key=lambda ae: ae[0].sort_key))


def _power(cache: dict, a, terms, e: int):
  """terms**e (e >= 1) as unsorted terms; cache[a] keeps the powers found so far."""
  found = cache.setdefault(a, [terms])
  while len(found) < e:
    found.append(tuple(_mul_terms(found[-1], terms).items()))
  return found[e - 1]


def _mul_terms(t1, t2) -> dict[Monomial, int]:
  d: dict[Monomial, int] = {}
  for m1, c1 in t1:
    for m2, c2 in t2:
      m = _mono_mul(m1, m2)
      d[m] = d.get(m, 0) + c1 * c2
  return d


@dataclasses.dataclass(frozen=True, eq=True)
class Poly:
  """An exact polynomial with integer coefficients over dimension atoms.

  `terms` is canonical: sorted, no zero coefficients, so equal polynomials are
  equal (and hash equally) as Python objects.
  """
  terms: tuple[tuple[Monomial, int], ...]

  def __hash__(self) -> int:
    # Polys are dictionary keys everywhere (comparison caches, dedup): hash once.
    try:
      return self.__dict__["_hash"]
    except KeyError:
      h = hash(self.terms)
      object.__setattr__(self, "_hash", h)
      return h

  def __getstate__(self) -> dict:
    # Only the terms: the cached hash depends on the process's string-hash seed.
    return {"terms": self.terms}

  # --- constructors -------------------------------------------------------
  @staticmethod
  def from_dict(coeffs: Mapping[Monomial, int]) -> "Poly":
    items = [(m, int(c)) for m, c in coeffs.items() if c != 0]
    if len(items) > 1:
      items.sort(key=lambda mc: _mono_key(mc[0]))
    return Poly(tuple(items))

  @staticmethod
  def const(c: int) -> "Poly":
    return Poly((((), int(c)),)) if c != 0 else ZERO

  @staticmethod
  def var(name: str) -> "Poly":
    return Poly.atom(Var(name))

  @staticmethod
  def atom(a: Atom) -> "Poly":
    return Poly(((((a, 1),), 1),))

  @staticmethod
  def lift(x: "PolyLike") -> "Poly":
    if isinstance(x, Poly):
      return x
    if isinstance(x, bool):
      raise TypeError("a bool is not a dimension size")
    if isinstance(x, int) or hasattr(x, "__index__"):
      return Poly.const(int(x))
    raise TypeError(f"cannot use {x!r} of type {type(x).__name__} as a dimension polynomial")

  # --- queries ------------------------------------------------------------
  @cached
  def sort_key(self) -> tuple:
    return tuple((_mono_key(m), c) for m, c in self.terms)

  def as_dict(self) -> dict[Monomial, int]:
    return dict(self.terms)

  def is_constant(self) -> bool:
    return all(not m for m, _ in self.terms)

  @property
  def constant(self) -> int:
    """The constant term (the value if `is_constant()`)."""
    for m, c in self.terms:
      if not m:
        return c
    return 0

  # atoms() and variables() are cached on the instance; a fresh Poly (one per
  # parsed string) misses once, so the miss path avoids raising an exception.
  def atoms(self) -> frozenset[Atom]:
    out = self.__dict__.get("_atoms")
    if out is None:
      out = frozenset([a for m, _ in self.terms for a, _ in m])
      object.__setattr__(self, "_atoms", out)
    return out

  def variables(self) -> frozenset[str]:
    """All dimension variable names, including those inside operation atoms."""
    out = self.__dict__.get("_variables")
    if out is None:
      names: set[str] = set()
      for m, _ in self.terms:   # names straight from the terms: Var hashes are Python calls
        for a, _ in m:
          if type(a) is Var:
            names.add(a.name)
          else:
            names |= a.variables()
      out = frozenset(names)
      object.__setattr__(self, "_variables", out)
    return out

  def degree(self) -> int:
    return max((sum(e for _, e in m) for m, _ in self.terms), default=0)

  def evaluate(self, env: Mapping[str, int]) -> int:
    """Exact value at concrete dims (Python ints, never overflows)."""
    total = 0
    ops: dict[Atom, int] = {}   # each operation atom evaluated once
    for m, c in self.terms:
      v = c
      for a, e in m:
        if type(a) is Var:
          try:
            x = int(env[a.name])
          except KeyError:
            raise KeyError(f"no value given for dimension {a.name!r}") from None
        else:
          x = ops.get(a)
          if x is None:
            x = ops[a] = a.evaluate(env)
        v *= x if e == 1 else x ** e
      total += v
    return total

  def substitute(self, mapping: Mapping[Atom, "Poly"]) -> "Poly":
    """Replaces atoms by polynomials (atoms not in `mapping` stay).

    A replacement by a monomial (another atom, a constant, 128*k: most of
    them) only moves exponents and scales the coefficient; the others are
    multiplied out.
    """
    monomials = {a: q.terms[0] for a, q in mapping.items() if len(q.terms) == 1}
    powers: dict[Atom, list] = {}   # the other replacements' powers, as unsorted terms
    out: dict[Monomial, int] = {}
    for m, c in self.terms:
      exps: dict[Atom, int] = {}
      rest = None   # the product of the other replacements, as terms
      for a, e in m:
        if a not in mapping:
          exps[a] = exps.get(a, 0) + e
        elif a in monomials:
          qm, qc = monomials[a]
          c *= qc ** e
          for b, f in qm:
            exps[b] = exps.get(b, 0) + f * e
        else:
          factor = _power(powers, a, mapping[a].terms, e)
          rest = factor if rest is None else tuple(_mul_terms(rest, factor).items())
      mono = tuple(sorted(exps.items(), key=lambda ae: ae[0].sort_key))
      if rest is None:
        out[mono] = out.get(mono, 0) + c
      else:
        for m2, c2 in _mul_terms(((mono, c),), rest).items():
          out[m2] = out.get(m2, 0) + c2
    return Poly.from_dict(out)

  # --- arithmetic ---------------------------------------------------------
  def __add__(self, other: "PolyLike") -> "Poly":
    other = Poly.lift(other)
    if not other.terms:
      return self
    if not self.terms:
      return other
    if len(other.terms) == 1 and not other.terms[0][0]:   # + constant: the last term
      return self._plus_constant(other.terms[0][1])
    if len(self.terms) == 1 and not self.terms[0][0]:
      return other._plus_constant(self.terms[0][1])
    d = dict(self.terms)
    for m, c in other.terms:
      d[m] = d.get(m, 0) + c
    return Poly.from_dict(d)

  __radd__ = __add__

  def _plus_constant(self, k: int) -> "Poly":
    # The constant monomial () sorts last (see _mono_key): no re-sort needed.
    terms = self.terms
    if terms[-1][0]:
      return Poly(terms + (((), k),))
    c = terms[-1][1] + k
    return Poly(terms[:-1] + ((((), c),) if c else ()))

  def __neg__(self) -> "Poly":
    return Poly(tuple((m, -c) for m, c in self.terms))

  def __sub__(self, other: "PolyLike") -> "Poly":
    return self + (-Poly.lift(other))

  def __rsub__(self, other: "PolyLike") -> "Poly":
    return Poly.lift(other) - self

  def __mul__(self, other: "PolyLike") -> "Poly":
    other = Poly.lift(other)
    for x, y in ((self, other), (other, self)):
      if len(y.terms) == 1 and not y.terms[0][0]:   # times a nonzero constant: same order
        k = y.terms[0][1]
        return x if k == 1 else Poly(tuple((m, c * k) for m, c in x.terms))
    return Poly.from_dict(_mul_terms(self.terms, other.terms))

  __rmul__ = __mul__

  def __pow__(self, k: int) -> "Poly":
    if not isinstance(k, int) or k < 0:
      raise ValueError(f"exponent must be a non-negative int, got {k!r}")
    out = ONE
    for _ in range(k):
      out = out * self
    return out

  # --- operations (constant-folded, otherwise opaque atoms) -----------------
  def floordiv(self, other: "PolyLike") -> "Poly":
    return _operation(FLOORDIV, self, other)

  def mod(self, other: "PolyLike") -> "Poly":
    return _operation(MOD, self, other)

  def max(self, other: "PolyLike") -> "Poly":
    return _operation(MAX, self, other)

  def min(self, other: "PolyLike") -> "Poly":
    return _operation(MIN, self, other)

  # --- display ------------------------------------------------------------
  def __str__(self) -> str:
    if not self.terms:
      return "0"
    parts = []
    for i, (m, c) in enumerate(self.terms):
      mono = "*".join(str(a) if e == 1 else f"{a}^{e}" for a, e in m)
      mag = abs(c)
      body = mono if (mono and mag == 1) else (f"{mag}*{mono}" if mono else str(mag))
      if i == 0:
        parts.append(("-" if c < 0 else "") + body)
      else:
        parts.append((" - " if c < 0 else " + ") + body)
    return "".join(parts)

  def __repr__(self) -> str:
    return f"Poly({self})"

  def to_sympy(self):
    """A sympy expression for display (never used for decisions)."""
    import sympy
    def atom_expr(a: Atom):
      if isinstance(a, Var):
        return sympy.Symbol(a.name, integer=True, positive=True)
      return sympy.Function(a.op)(*(o.to_sympy() for o in a.operands))
    return sympy.Add(*(c * sympy.Mul(*(atom_expr(a) ** e for a, e in m)) for m, c in self.terms))


PolyLike = Union[Poly, int]
ZERO = Poly(())
ONE = Poly((((), 1),))


def _operation(op: str, a: PolyLike, b: PolyLike) -> Poly:
  a, b = Poly.lift(a), Poly.lift(b)
  if a.is_constant() and b.is_constant():
    return Poly.const(apply_operation(op, a.constant, b.constant))
  if op in (FLOORDIV, MOD) and b.is_constant():
    k = b.constant
    if k == 0:
      raise ZeroDivisionError(f"{op} by zero in a dimension expression")
    if k == 1:
      return a if op == FLOORDIV else ZERO
    # Exact only when every coefficient is a multiple of k: (k*p) // k == p, (k*p) % k == 0.
    if all(c % k == 0 for _, c in a.terms):
      return Poly.from_dict({m: c // k for m, c in a.terms}) if op == FLOORDIV else ZERO
  if op in (MAX, MIN) and a == b:
    return a
  return Poly.atom(OpAtom(op, (a, b)))


def total(polys: Iterable[Poly]) -> Poly:
  """`sum(polys, ZERO)`, adding the terms up once: each `+` builds and sorts a new
  polynomial (a cond's FLOPs add up a thousand nodes' of a layer, every remat round)."""
  out: dict[Monomial, int] = {}
  for p in polys:
    for m, c in p.terms:
      out[m] = out.get(m, 0) + c
  return Poly.from_dict(out)


def product(polys: Iterable[PolyLike]) -> Poly:
  out = ONE
  for p in polys:
    out = out * Poly.lift(p)
  return out


def gcd_of_coefficients(p: Poly) -> int:
  return math.gcd(*(c for _, c in p.terms)) if p.terms else 0
