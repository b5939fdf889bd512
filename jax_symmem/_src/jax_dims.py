"""The one bridge between JAX's symbolic dimensions and `Poly`.

This module (with `tracing.py`) is where jax_symmem touches private JAX
internals: `_DimExpr` is a sum of `_DimTerm`s, each a product of `_DimFactor`s
(a variable, or an operation floordiv/mod/max/min over `_DimExpr`s). If JAX
changes that layout, `tests/test_jax_dims.py` fails loudly here rather than a
size going wrong somewhere downstream.
"""

from __future__ import annotations

from typing import Any, Union

import jax
from jax import export
from jax._src import core as _jax_core
from jax._src.export import shape_poly

from jax_symmem._src import parse as parse_lib
from jax_symmem._src import poly as poly_lib
from jax_symmem._src.poly import Poly

DimExpr = shape_poly._DimExpr
# shape_poly raises subclasses of it; jax.errors exports it from jax 0.10 on.
InconclusiveDimensionOperation = _jax_core.InconclusiveDimensionOperation
# A dim that is not among the traced arguments' (one kept from another trace).
UnexpectedDimVar = shape_poly.UnexpectedDimVar

DimLike = Union[Poly, int, str, Any]


def is_symbolic(d: Any) -> bool:
  return isinstance(d, DimExpr)


def scope_constraints(d: Any) -> tuple[str, ...]:
  """The constraints of a JAX symbolic dim's scope (`jax.export.symbolic_shape(...,
  constraints=...)`), as their strings; () for anything else."""
  if not isinstance(d, DimExpr):
    return ()
  return tuple(c.debug_str for c in d.scope._explicit_constraints)


def _factor_to_poly(f) -> Poly:
  if f.var is not None:
    return Poly.var(f.var)
  if f.operation not in poly_lib.OPERATIONS:
    raise NotImplementedError(f"unknown JAX dimension operation {f.operation!r}")
  ops = [to_poly(o) for o in f.operands]
  if len(ops) != 2:
    raise NotImplementedError(f"dimension operation {f.operation} with {len(ops)} operands")
  return poly_lib._operation(f.operation, ops[0], ops[1])


def to_poly(d: DimLike) -> Poly:
  """Converts a JAX dimension (`_DimExpr` or int), a jax.export expression string, or a Poly."""
  if isinstance(d, Poly):
    return d
  if isinstance(d, str):
    return parse(d)
  if isinstance(d, DimExpr):
    # One dict of monomials, sorted once (Poly arithmetic per factor re-sorts every step).
    out: dict = {}
    for term, coeff in d._sorted_terms:
      t = {(): coeff}
      for factor, exp in term._factors:
        if factor.var is not None:
          f_terms = ((((poly_lib.Var(factor.var), exp),), 1),)
        else:
          f_terms = (_factor_to_poly(factor) ** exp).terms
        t = poly_lib._mul_terms(t.items(), f_terms)
      for m, c in t.items():
        out[m] = out.get(m, 0) + c
    return Poly.from_dict(out)
  return Poly.lift(d)


def parse(expr: str) -> Poly:
  """Parses a dimension expression in jax.export syntax ("4*b*s^2", "floordiv(s, 2)").

  Plain polynomials take the fast parser (`parse.py`, the same Poly); in a
  polynomial over operation calls ("4*b*floordiv(s, 2)") each call is read on
  its own, by `parse.parse_operation` where its operands are plain and its
  result is known, else by jax.export; anything else, errors included, goes
  through jax.export with the whole string.
  """
  if not isinstance(expr, str):
    raise TypeError(f"expected a string, got {expr!r}")
  fast = parse_lib.parse_polynomial(expr) if "(" not in expr else None   # "(": never plain
  if fast is not None:
    return fast
  split = parse_lib.split_operations(expr)
  if split is not None:   # a polynomial in operation calls: jax.export parses each call
    template, calls = split
    outer = parse_lib.parse_polynomial(template)
    if outer is not None:
      try:
        inner = {poly_lib.Var(name): _parse_call(call) for name, call in calls.items()}
      except Exception:  # noqa: BLE001 - the whole string through jax.export raises its own error
        inner = None
      if inner is not None:
        return outer.substitute(inner)
  return parse_with_jax(expr)


def _parse_call(call: str) -> Poly:
  """One operation call "op(A, B)": the fast route where it applies, else jax.export."""
  fast = parse_lib.parse_operation(call)
  return fast if fast is not None else parse_with_jax(call)


def parse_with_jax(expr: str) -> Poly:
  """`parse` through jax.export alone (the reference the fast parser is tested against)."""
  try:
    dims = export.symbolic_shape(expr)
  except Exception as e:  # JAX raises ValueError with its own parse message.
    raise ValueError(f"cannot parse dimension expression {expr!r}: {e}") from None
  if len(dims) != 1:
    raise ValueError(f"expected one dimension expression, got {len(dims)} in {expr!r}")
  return to_poly(dims[0])


def dims_of(tree) -> set[str]:
  """The dimension variables in the shapes of a pytree of arrays or specs."""
  names: set[str] = set()
  for leaf in jax.tree_util.tree_leaves(tree):
    for d in getattr(leaf, "shape", ()):
      if is_symbolic(d):
        names |= to_poly(d).variables()
  return names


def shape_to_polys(shape) -> tuple[Poly, ...]:
  return tuple(to_poly(d) for d in shape)
