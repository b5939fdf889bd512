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

_UNSUPPORTED = ("static_argnums", "static_argnames", "donate_argnums", "in_shardings",
                "out_shardings")


class NnxFunction:
  """The function returned by `symmem.nnx_jit`."""

  def __init__(self, fun: Callable, *, polymorphic_shapes, **jit_kwargs):
    unsupported = sorted(set(jit_kwargs) & set(_UNSUPPORTED))
    if unsupported:
      raise TypeError(f"symmem.nnx_jit does not take {', '.join(unsupported)}; use symmem.jit "
                      "on a pure step over nnx.split's state for those")
    functools.update_wrapper(self, fun)
    self.__name__ = tracing.function_name(fun)   # a partial has none of its own
    self._fun = fun
    self._signature = jit_lib.signature(fun)
    self._shapes = tuple(polymorphic_shapes)
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
    if kwargs:   # each at its parameter's position, as symmem.jit binds them
      args, _ = jit_lib.bind_keywords(self._signature, args, kwargs)
    if len(args) != len(self._shapes):
      raise ShapeSpecError(f"{self.__name__}: polymorphic_shapes has {len(self._shapes)} "
                           f"entries for {len(args)} positional arguments")
    from flax import nnx   # imported here: `import jax_symmem` does not pay for flax
    nodes = tuple(i for i, a in enumerate(args) if nnx.graph.is_graph_node(a))
    if not nodes:
      raise TypeError(f"{self.__name__}: no NNX object (module, optimizer, Rngs) among the "
                      "arguments; use symmem.jit for pure steps")
    specced = [i for i in nodes if self._shapes[i] is not None]
    if specced:
      raise ShapeSpecError(f"{self.__name__}: arguments {specced} are NNX objects, whose "
                           "shapes are fixed: give None for them in polymorphic_shapes")
    objects = tuple(args[i] for i in nodes)
    graphdef, state = nnx.split(objects)
    key = (graphdef, nodes)
    step = self._steps.get(key)
    if step is None:
      step = self._steps[key] = self._jit(graphdef, nodes)
    self.jitted = step
    new_state, out = step(state, *(a for i, a in enumerate(args) if i not in nodes))
    nnx.update(objects, new_state)
    return out

  def _jit(self, graphdef, nodes: tuple[int, ...]) -> jit_lib.SymmemFunction:
    from flax import nnx
    fun = self._fun

    def pure_step(state, *rest):
      objects = nnx.merge(graphdef, state)
      args = list(rest)
      for i, obj in zip(nodes, objects):   # ascending: each lands at its own position
        args.insert(i, obj)
      out = fun(*args)
      return nnx.state(objects), out

    pure_step.__name__ = pure_step.__qualname__ = self.__name__
    shapes = (None,) + tuple(s for i, s in enumerate(self._shapes) if i not in nodes)
    return jit_lib.jit(pure_step, polymorphic_shapes=shapes, **self._jit_kwargs)

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

  @property
  def last_call(self) -> dict | None:
    return None if self.jitted is None else self.jitted.last_call


def nnx_jit(fun: Callable | None = None, *, polymorphic_shapes=jit_lib._NO_SHAPES,
            constraints=(), memory_budget=None, **jit_kwargs):
  """`symmem.jit` for Flax NNX steps that update modules and optimizers in place, as
  `nnx.jit` does: `step = symmem.nnx_jit(train_step, polymorphic_shapes=(None, None,
  "b, s", "b, s"))`, then `loss = step(model, optimizer, tokens, mask)`.

  Positional arguments that are NNX objects (modules, `nnx.Optimizer`, `nnx.Rngs`) take
  None in `polymorphic_shapes`; their state is the traced function's first argument
  and is written back after each call. Other arguments, `constraints`,
  `memory_budget` and the remaining keywords (`impose_schedule`, `plan_cache_dir`,
  `speed_trials`) are as in `symmem.jit`; `last_call`, `cache_info()` and `jitted` (the
  `SymmemFunction` of the latest call) report on it.
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
