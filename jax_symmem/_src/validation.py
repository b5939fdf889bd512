"""Argument validation for `symmem.jit`: clear errors on the error paths only.

The hot path compares dtypes and nothing else; these run when a call is already
known to be wrong (or a shape failed to bind) and say what to do about it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

from jax_symmem._src import jax_dims
from jax_symmem._src.errors import ShapeError
from jax_symmem._src.poly import Poly, Var


class Caller(NamedTuple):
  """What the messages name: the step, which positions are static, its constraints."""
  name: str
  static_argnums: tuple[int, ...]
  constraints: tuple[str, ...]


def where(caller: Caller, path) -> str:
  """`args[i]...` with i the positional index the caller used (static arguments counted)."""
  i, seen = -1, -1
  while seen < path[0].idx:
    i += 1
    seen += i not in caller.static_argnums
  return f"args[{i}]{jax.tree_util.keystr(path[1:])}"


def check_arrays(caller: Caller, dyn_args) -> None:
  """TypeError for a leaf that is not an array (jax.jit raises TypeError for a str too)."""
  for path, x in jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      continue
    raise TypeError(
        f"{caller.name}: argument {where(caller, path)} of type {type(x).__name__} ({x!r:.40}) "
        "is not an array; mark it static with static_argnums/static_argnames")


def explain_shape_error(caller: Caller, traced, dyn_args) -> None:
  """A clearer ShapeError for an axis traced static whose size changed, or a size that
  is no multiple its spec declares (e.g. 8*k from 's == 8*k')."""
  paths = jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]
  for (path, x), spec in zip(paths, jax.tree_util.tree_leaves(traced.in_specs)):
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != len(spec.shape):
      continue
    for axis, (d, n) in enumerate(zip(spec.shape, shape)):
      at = (f"{traced.fun_name}: argument {where(caller, path)} has shape {shape}, "
            f"but axis {axis}")
      if isinstance(d, int):
        if d != n:
          raise ShapeError(
              f"{at} was traced as a constant {d} (polymorphic_shapes gives it '_', a number "
              "or None); a size that changes between calls must be a symbolic dim in "
              "polymorphic_shapes, e.g. 'b, s'")
        continue
      p = jax_dims.to_poly(d)
      if n == 0 or len(p.variables()) != 1 or p.degree() != 1:   # empty: `is_empty_batch`
        continue
      (v,) = p.variables()
      coeff = p.as_dict().get(((Var(v), 1),))
      rest = (p - coeff * Poly.var(v)).evaluate({})
      if coeff and ((n - rest) % coeff or (n - rest) // coeff < 1):
        declared = [c for c in caller.constraints if re.search(rf"\b{v}\b", c)]
        raise ShapeError(f"{at} must be {p} for some integer {v} >= 1 (constraints: "
                         f"{', '.join(declared) or 'none'}), and {n} is not")


def empty_batch_dims(traced, dyn_args) -> dict[str, int]:
  """The dims an empty batch's arguments show where an axis is one dim alone ('b', not
  '2*k'), as `bind_dims` would read them were 0 allowed: what `last_call` reports."""
  dims = {}
  specs = jax.tree_util.tree_leaves(traced.in_specs)
  for x, spec in zip(jax.tree_util.tree_leaves(tuple(dyn_args)), specs):
    for d, n in zip(spec.shape, getattr(x, "shape", ())):
      p = jax_dims.to_poly(d) if jax_dims.is_symbolic(d) else None
      if p is not None and len(p.variables()) == 1:
        (name,) = p.variables()
        if p == Poly.var(name):
          dims.setdefault(name, n)
  return dict(sorted(dims.items()))


def is_empty_batch(traced, dyn_args) -> bool:
  """Whether some axis of a symbolic dim has size 0 (an empty batch) where every argument
  has its spec's rank and static sizes."""
  paths = jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]
  specs = jax.tree_util.tree_leaves(traced.in_specs)
  if len(paths) != len(specs):
    return False
  empty = False
  for (_, x), spec in zip(paths, specs):
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != len(spec.shape) or any(
        isinstance(d, int) and d != n for d, n in zip(spec.shape, shape)):
      return False
    empty = empty or any(n == 0 and not isinstance(d, int) for d, n in zip(spec.shape, shape))
  return empty
