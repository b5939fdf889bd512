"""Exact integer sign pieces of a univariate polynomial over an integer range.

Bernstein coefficients count sign changes (none: one sign throughout; one: a
single root, found by binary search on the integers), else the range is split;
an unbounded range is cut at Cauchy's root bound.
"""

from __future__ import annotations

from typing import Callable, Sequence

from jax_symmem._src.compare_kernel import bmatrix, sign_of


def _horner(c: Sequence[int], x: int) -> int:
  v = 0
  for a in reversed(c):
    v = v * x + a
  return v


def univariate_pieces(c: list[int], lo: int, hi: int | None, spend: Callable[[], bool]
                       ) -> list[tuple[int, int | None, int]] | None:
  """Exact (lo, hi, sign) runs of sum(c[k] x^k) over the integers of [lo, hi].

  An unbounded range is cut at Cauchy's root bound: beyond it the leading
  coefficient decides. Returns None when `spend` runs out of budget.
  """
  while len(c) > 1 and c[-1] == 0:
    c = c[:-1]
  if len(c) == 1:
    return [(lo, hi, sign_of(c[0]))]
  out: list[tuple[int, int | None, int]] = []
  if hi is None:
    lead = abs(c[-1])
    cauchy = 1 + -(-max(abs(a) for a in c[:-1]) // lead)
    top = max(lo, cauchy)
    if not _finite_pieces(c, lo, top, out, spend):
      return None
    out.append((top + 1, None, sign_of(c[-1])))
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
    out.append((a, a, sign_of(_horner(c, a))))
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
  M = bmatrix(n, a, b - a)
  B = [sum(M[i][e] * c[e] for e in range(n + 1)) for i in range(n + 1)]
  nz = [sign_of(x) for x in B if x]
  changes = sum(1 for u, v in zip(nz, nz[1:]) if u != v)
  if changes == 0:   # Bernstein basis > 0 inside: same sign on all of [a, b]
    out.append((a, b, sign_of(fa)))
    return True
  if changes == 1:   # exactly one real root in (a, b): binary search the integers
    sa = sign_of(fa)
    lo_, hi_ = a, b   # sign(P(lo_)) == sa, sign(P(hi_)) != sa
    while hi_ - lo_ > 1:
      mid = (lo_ + hi_) // 2
      if sign_of(_horner(c, mid)) == sa:
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
    out.append((a, a, sign_of(fa)))
    out.append((b, b, sign_of(fb)))
    return True
  m = (a + b) // 2
  return _finite_pieces(c, a, m, out, spend) and _finite_pieces(c, m + 1, b, out, spend)
