"""What a comparison answers: an `Ordering` of a `Kind`, with exact sign `Piece`s.

The leaf of the comparison modules (`compare.py` is the public entry point):
everything else there builds these values, nothing here computes them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

from jax_symmem._src.poly import Poly


class Kind(str, enum.Enum):
  """How `lhs` compares to `rhs` over every allowed point.

  A `str` that prints, formats, hashes and compares as its name, so
  `ordering.kind == "LE"`, `{"LE": ...}[ordering.kind]`, f-strings, JSON and
  `repr` see the same plain strings as before the enum (on every Python).
  """
  GE = "GE"            # proof: lhs >= rhs everywhere
  LE = "LE"            # proof: lhs <= rhs everywhere
  EQ = "EQ"            # proof: lhs == rhs everywhere
  DEPENDS = "DEPENDS"  # two verified witnesses: lhs > rhs at one, lhs < rhs at the other
  UNKNOWN = "UNKNOWN"  # out of budget or of methods; never a claim

  def __str__(self) -> str:
    return self.value

  def __format__(self, spec: str) -> str:
    return format(self.value, spec)

  def __repr__(self) -> str:
    return repr(self.value)

  @property
  def proven(self) -> bool:
    """GE, LE or EQ: a claim about every allowed point."""
    return self in _PROVEN


GE, LE, EQ, DEPENDS, UNKNOWN = Kind.GE, Kind.LE, Kind.EQ, Kind.DEPENDS, Kind.UNKNOWN
_PROVEN = frozenset({GE, LE, EQ})


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
  kind: Kind
  lhs: Poly
  rhs: Poly
  witness_gt: Mapping[str, int] | None = None
  witness_lt: Mapping[str, int] | None = None
  dim: str | None = None
  pieces: tuple[Piece, ...] = ()
  method: str = ""

  def __post_init__(self):
    if not isinstance(self.kind, Kind):   # Ordering("LE", ...) by hand: the same Kind
      object.__setattr__(self, "kind", Kind(self.kind))

  @classmethod
  def of(cls, kind: Kind, lhs: Poly, rhs: Poly, witness_gt, witness_lt, dim, pieces,
         method: str) -> "Ordering":
    """Every field given, `kind` a Kind: the solver's constructor, one C call where
    the frozen dataclass's __init__ makes one per field (tests check they agree)."""
    o = object.__new__(cls)
    o.__dict__.update(kind=kind, lhs=lhs, rhs=rhs, witness_gt=witness_gt, witness_lt=witness_lt,
                      dim=dim, pieces=pieces, method=method)
    return o

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


class FrozenEnv(dict):
  """A read-only dict (witnesses are shared through the cache); pickles and JSON-dumps as a dict."""

  def _read_only(self, *args, **kwargs):
    raise TypeError("a witness assignment is read-only; copy it with dict(...)")

  __setitem__ = __delitem__ = __ior__ = _read_only
  clear = pop = popitem = setdefault = update = _read_only

  def __reduce__(self):
    return (FrozenEnv, (dict(self),))


def _fmt_env(env: Mapping[str, int] | None) -> str:
  return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) if env else "-"
