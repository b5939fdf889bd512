"""The polynomial kernel of the comparison: integer polynomials as {exponent tuple: coeff}.

Over an ordered variable list, with exact Python ints throughout: conversion
from `Poly`, evaluation, Taylor shifts, pinning coordinates, and Bernstein
coefficients on boxes (`Dense`, a flat coefficient tensor).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Mapping, Sequence

from jax_symmem._src.poly import Poly


def to_dict(p: Poly, names: Sequence[str]) -> dict[tuple[int, ...], int]:
  index = {n: i for i, n in enumerate(names)}
  out = {}
  for mono, c in p.terms:
    e = [0] * len(names)
    for atom, k in mono:
      e[index[atom.name]] = k
    out[tuple(e)] = c
  return out


def evaluate(P: Mapping[tuple[int, ...], int], x: Sequence[int]) -> int:
  total = 0
  for e, c in P.items():
    total += c * math.prod(map(pow, x, e))   # x^0 == 1: zero exponents cost a C call, not a branch
  return total


def sign_of(v: int) -> int:
  return (v > 0) - (v < 0)


@functools.lru_cache(maxsize=4096)
def _expansion(e: int, a: int, s: int) -> tuple[int, ...]:
  """Coefficients of y^k in (a + s*y)^e."""
  return tuple(math.comb(e, k) * a ** (e - k) * s ** k for k in range(e + 1))


def shift(P, origin: Sequence[int], signs: Sequence[int]):
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


def top_degree_signs(P) -> set[int]:
  """The signs of P's coefficients of top total degree.

  A Taylor shift P(x0 + y) keeps them: every other term of the expansion of
  x^e has a lower degree, so only e itself reaches y^e at the top degree.
  """
  top = max(map(sum, P))
  return {1 if c > 0 else -1 for e, c in P.items() if c and sum(e) == top}


@functools.lru_cache(maxsize=1 << 14)
def bmatrix(n: int, a: int, w: int) -> tuple[tuple[int, ...], ...]:
  """Row i: the degree-n Bernstein coefficient i of x^e on [a, a+w], times n! (exact ints)."""
  f = [math.factorial(k) * math.factorial(n - k) for k in range(n + 1)]
  return tuple(
      tuple(sum(math.comb(e, k) * a ** (e - k) * w ** k * math.comb(i, k) * f[k]
                for k in range(min(i, e) + 1)) for e in range(n + 1))
      for i in range(n + 1))


class Dense:
  """A polynomial as a flat coefficient tensor, for Bernstein coefficients on boxes."""

  def __init__(self, P, degs: Sequence[int]):
    self.degs = tuple(degs)
    self.strides, self.size, self.corner_index, self.neighbours = _layout(self.degs)
    self.coeffs = [0] * self.size
    for e, c in P.items():
      self.coeffs[sum(map(operator.mul, e, self.strides))] = c

  def bernstein(self, box: Sequence[tuple[int, int]]) -> list[int]:
    """Bernstein coefficients on `box` (a positive multiple: signs are exact)."""
    t = self.coeffs
    for (lo, hi), n, stride in zip(box, self.degs, self.strides):
      t = _apply_axis(t, bmatrix(n, lo, hi - lo), n, stride, self.size)
    return t

  def split_axis(self, B: list[int], box) -> int:
    """The axis along which the Bernstein coefficients vary most (a splittable one).

    Splitting there shrinks the coefficient range fastest; splitting the widest
    axis instead wastes boxes when a narrow axis (b <= 64 vs s <= 4096) carries
    the sign change.
    """
    best, best_j = -1, None
    for j, (below, above) in enumerate(self.neighbours):
      if box[j][1] - box[j][0] < 1:
        continue
      var = max(map(abs, map(operator.sub, above(B), below(B)))) if below else 0
      if var > best:
        best, best_j = var, j
    return best_j


@functools.lru_cache(maxsize=256)
def _layout(degs: tuple[int, ...]):
  """The shape of a flat tensor with these degrees.

  Strides, size, corner entries ((bits, flat index), ...), and per axis a pair
  of getters: the entries below the top along that axis, and the entries one
  step up from them (what `Dense.split_axis` differences); (None, None) for an
  axis of degree 0.
  """
  strides = []
  size = 1
  for d in reversed(degs):
    strides.append(size)
    size *= d + 1
  strides.reverse()
  corners = tuple((bits, sum(st * d for b, st, d in zip(bits, strides, degs) if b))
                  for bits in itertools.product((0, 1), repeat=len(degs)))
  neighbours = []
  for n, stride in zip(degs, strides):
    below = [i for i in range(size) if i % (stride * (n + 1)) < stride * n]
    neighbours.append((_getter(below), _getter([i + stride for i in below])) if below else (None, None))
  return tuple(strides), size, corners, tuple(neighbours)


def _getter(indices: list[int]):
  """A function giving the tuple of entries at `indices` (itemgetter gives a bare entry for one)."""
  if len(indices) == 1:
    i, = indices
    return lambda t: (t[i],)
  return operator.itemgetter(*indices)


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



def pin(P, values: Mapping[int, int]):
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

