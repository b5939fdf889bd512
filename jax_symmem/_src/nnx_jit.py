"""`symmem.nnx_jit`: `symmem.jit` for Flax NNX steps that update their objects in place.

An NNX training step is written `train_step(model, optimizer, *batch)`: it mutates the
model and the optimizer (and `nnx.Rngs` counters) and returns the loss. `jax.jit` and
`symmem.jit` run it, but what it writes into the objects stays inside the trace, so
the parameters never change; `nnx.jit` splits the objects into a graph definition and
a state, jits a pure function of the state, and writes the new state back. This does
the same around `symmem.jit`: one symbolic trace and memory plan of the pure function
`(state, *batch) -> (new state, outputs)` per graph definition.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import jax

from jax_symmem._src import jit as jit_lib
from jax_symmem._src import tracing
from jax_symmem._src.errors import ShapeSpecError

_UNSUPPORTED = ("in_shardings", "out_shardings")


class _Hole:
  """Where an NNX object was among the arguments: an empty pytree node, so the arguments'
  other leaves keep their places (and shape specs) in the pure step's."""


class _Ref:
  """An output that is one of the step's NNX objects (by its index among them): the
  caller gets that object back, as from nnx.jit, not a copy."""

  def __init__(self, index: int):
    self.index = index


jax.tree_util.register_pytree_node(_Hole, lambda h: ((), None), lambda aux, children: _Hole())
jax.tree_util.register_pytree_node(_Ref, lambda r: ((), r.index),
                                   lambda index, children: _Ref(index))


def _is_hole(x) -> bool:
  return isinstance(x, _Hole)


def _with_refs(out, objects):
  """`out` with each of `objects` it returns replaced by a `_Ref` to it."""
  from flax import nnx

  def ref(x):
    for i, o in enumerate(objects):
      if x is o:
        return _Ref(i)
    return x
  return jax.tree_util.tree_map(ref, out, is_leaf=nnx.graph.is_graph_node)


class NnxFunction:
  """The function returned by `symmem.nnx_jit`."""

  def __init__(self, fun: Callable, *, polymorphic_shapes, static_argnums=(),
               static_argnames=(), donate_argnums=(), donate_argnames=(), **jit_kwargs):
    unsupported = sorted(set(jit_kwargs) & set(_UNSUPPORTED))
    if unsupported:
      raise TypeError(f"symmem.nnx_jit does not take {', '.join(unsupported)}; use symmem.jit "
                      "on a pure step over nnx.split's state for those")
    functools.update_wrapper(self, fun)
    self.__name__ = tracing.function_name(fun)   # a partial has none of its own
    self._fun = fun
    self._signature = jit_lib.signature(fun)
    self._shapes = tuple(polymorphic_shapes)
    # As symmem.jit reads them (jax.jit's errors for names and positions the step lacks).
    self._static_argnums, self._static_argnames = jit_lib._positions_and_names(
        fun, static_argnums, static_argnames)
    self._donate, _ = jit_lib._positions_and_names(fun, donate_argnums, donate_argnames,
                                                   "donate")
    self._jit_kwargs = jit_kwargs
    self._steps: dict[Any, jit_lib.SymmemFunction] = {}
    self.jitted: jit_lib.SymmemFunction | None = None   # that of the most recent call

  def __repr__(self) -> str:
    return f"<NnxFunction of {self._fun!r} (polymorphic_shapes={self._shapes!r})>"

  def __get__(self, instance, owner=None):
    """A method binds its instance (an NNX module, say) as its first argument."""
    return self if instance is None else types.MethodType(self, instance)

  def __call__(self, *args, **kwargs):
    if jax.config.jax_disable_jit:   # as under nnx.jit: the step runs as Python, op by op
      return self._fun(*args, **kwargs)
    if kwargs:   # each dynamic one at its parameter's position, as symmem.jit binds them
      args, kwargs = jit_lib.bind_keywords(self._signature, args, kwargs,
                                           self._static_argnums, self._static_argnames)
    shapes = self._shapes_for(len(args))
    from flax import nnx   # imported here: `import jax_symmem` does not pay for flax
    is_node = nnx.graph.is_graph_node
    # NNX objects anywhere in the arguments (a dict or tuple of them too), as nnx.jit finds them.
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_node)
    objects = tuple(x for x in leaves if is_node(x))
    if not objects:
      raise TypeError(f"{self.__name__}: no NNX object (module, optimizer, Rngs) among the "
                      "arguments; use symmem.jit for pure steps")
    holding = tuple(i for i, a in enumerate(args)
                    if any(map(is_node, jax.tree_util.tree_leaves(a, is_leaf=is_node))))
    specced = [i for i in holding if is_node(args[i]) and shapes[i] is not None]
    if specced:
      raise ShapeSpecError(f"{self.__name__}: arguments {specced} are NNX objects, whose "
                           "shapes are fixed: give None for them in polymorphic_shapes")
    holed = jax.tree_util.tree_unflatten(treedef, [_Hole() if is_node(x) else x for x in leaves])
    graphdef, state = nnx.split(objects)
    key = (graphdef, treedef)
    step = self._steps.get(key)
    if step is None:
      step = self._steps[key] = self._jit(graphdef, holding, shapes)
    self.jitted = step
    new_state, out = step(state, *holed, **kwargs)
    nnx.update(objects, new_state)
    return jax.tree_util.tree_map(lambda x: objects[x.index] if isinstance(x, _Ref) else x,
                                  out, is_leaf=lambda x: isinstance(x, _Ref))

  def _shapes_for(self, nargs: int) -> tuple:
    """The specs of a call's `nargs` positional arguments, as symmem.jit reads them: one
    per argument; or one per positional parameter, those the call passes by keyword or
    leaves at their defaults dropped; or the dynamic arguments' own (None for statics)."""
    shapes = self._shapes
    if len(shapes) == nargs:
      return shapes
    params = len(shapes) if self._signature is None else jit_lib.positional_count(self._signature)
    if nargs < len(shapes) <= params:
      return shapes[:nargs]
    static = [i for i in self._static_argnums if i < nargs]
    if static and len(shapes) == nargs - len(static):
      given = iter(shapes)
      return tuple(None if i in static else next(given) for i in range(nargs))
    raise ShapeSpecError(f"{self.__name__}: polymorphic_shapes has {len(shapes)} entries for "
                         f"{nargs} positional arguments")

  def _jit(self, graphdef, holding: tuple[int, ...], shapes: tuple) -> jit_lib.SymmemFunction:
    """symmem.jit of the pure step `(state, *arguments with holes) -> (new state, outputs)`:
    the objects' state first, then the step's own positions shifted by one."""
    from flax import nnx
    fun = self._fun

    def pure_step(state, *holed, **static_kwargs):
      objects = nnx.merge(graphdef, state)
      each = iter(objects)   # in the order the holes flatten in, as they were made
      args = jax.tree_util.tree_map(lambda x: next(each) if _is_hole(x) else x, holed,
                                    is_leaf=_is_hole)
      out = fun(*args, **static_kwargs)
      return nnx.state(objects), _with_refs(out, objects)

    pure_step.__name__ = pure_step.__qualname__ = self.__name__
    # Their state goes with the objects: donated only where every argument holding one is.
    donated = set(self._donate) & set(holding)
    if donated and donated != set(holding):
      raise TypeError(
          f"{self.__name__}: NNX objects' state is donated together: donate every argument "
          f"that holds NNX objects (positions {list(holding)}) or none of them")
    donate = ((0,) if donated else ()) + tuple(i + 1 for i in self._donate)
    return jit_lib.jit(pure_step, polymorphic_shapes=(None,) + shapes,
                       static_argnums=tuple(i + 1 for i in self._static_argnums),
                       static_argnames=self._static_argnames, donate_argnums=donate,
                       **self._jit_kwargs)

  def cache_info(self) -> dict:
    """`SymmemFunction.cache_info()` summed over the graph definitions seen."""
    total: dict[str, int] = {}
    for step in self._steps.values():
      for k, v in step.cache_info().items():
        total[k] = total.get(k, 0) + v
    return total

  def clear_cache(self) -> None:
    """`SymmemFunction.clear_cache()` for each graph definition seen."""
    for step in self._steps.values():
      step.clear_cache()

  def variants(self) -> list[dict]:
    """`SymmemFunction.variants()` of each graph definition seen, in turn."""
    return [v for step in self._steps.values() for v in step.variants()]

  def compiled(self, **dims: int) -> list:
    """`SymmemFunction.compiled(**dims)` of each graph definition seen, in turn."""
    return [v for step in self._steps.values() for v in step.compiled(**dims)]

  def calibration(self) -> list[dict[int, float]]:
    """`SymmemFunction.calibration()` of each graph definition seen, in turn."""
    return [c for step in self._steps.values() for c in step.calibration()]

  def speed_trial_results(self) -> list[dict]:
    """`SymmemFunction.speed_trial_results()` of each graph definition seen, in turn."""
    return [r for step in self._steps.values() for r in step.speed_trial_results()]

  @property
  def last_call(self) -> dict | None:
    return None if self.jitted is None else self.jitted.last_call


def nnx_jit(fun: Callable | None = None, *, polymorphic_shapes=jit_lib._NO_SHAPES,
            constraints=(), memory_budget=None, **jit_kwargs):
  """`symmem.jit` for Flax NNX steps that update modules and optimizers in place, as
  `nnx.jit` does: `step = symmem.nnx_jit(train_step, polymorphic_shapes=(None, None,
  "b, s", "b, s"))`, then `loss = step(model, optimizer, tokens, mask)`.

  NNX objects (modules, `nnx.Optimizer`, `nnx.Rngs`), as arguments or inside a dict or
  tuple argument, are found as nnx.jit finds them; an argument that is one takes None in
  `polymorphic_shapes`. Their state is the traced function's first argument and is
  written back after each call, and an object the step returns is the caller's own.
  `static_argnums` / `static_argnames` and `donate_argnums` / `donate_argnames` are as in
  nnx.jit (the objects' state is donated as one: every argument holding objects, or
  none). Other arguments, `constraints`, `memory_budget` and the remaining keywords
  (`impose_schedule`, `plan_cache_dir`, `speed_trials`) are as in `symmem.jit`;
  `last_call`, `cache_info()`, `variants()`, `compiled()`, `calibration()`,
  `speed_trial_results()` and `jitted` (the `SymmemFunction` of the latest call) report
  on it.
  """
  if polymorphic_shapes is jit_lib._NO_SHAPES:
    raise TypeError(
        "symmem.nnx_jit needs polymorphic_shapes: for each positional argument, which of its "
        "axes change between calls, None for NNX objects, e.g. polymorphic_shapes=(None, "
        "None, 'b, s', 'b, s') for a step (model, optimizer, tokens, mask) whose batch and "
        "length vary; then constraints such as ('s <= 4096', 'b <= 64')")
  if fun is None:
    return functools.partial(nnx_jit, polymorphic_shapes=polymorphic_shapes,
                             constraints=constraints, memory_budget=memory_budget, **jit_kwargs)
  return NnxFunction(fun, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                     memory_budget=memory_budget, **jit_kwargs)
