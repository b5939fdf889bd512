"""What a comparison answers: `Ordering`, its kinds, and the exact sign `Piece`s.

The leaf of the comparison modules (`compare.py` is the public entry point):
everything else there builds these values, nothing here computes them.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jax_symmem._src.poly import Poly

GE = "GE"
LE = "LE"
EQ = "EQ"
DEPENDS = "DEPENDS"
UNKNOWN = "UNKNOWN"


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
