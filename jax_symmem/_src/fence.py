"""Imposing an order on XLA: chain memory-significant nodes through optimization barriers.

XLA ignores the order of a jaxpr (DESIGN.md F4): its scheduler reorders freely.
The one handle we have is data dependence. `ordered_function` evaluates a
(specialized) program in a given order and, before each significant node, passes
its operands together with the previous significant node's results through
`lax.optimization_barrier`, so node k cannot start before node k-1 has finished.
XLA:CPU removes barriers early unless its `cse_barrier_expander` pass is
disabled (F1), so compile with `FENCE_COMPILER_OPTIONS`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax

from jax_symmem._src import interpret
from jax_symmem._src.ir import Const, Program

FENCE_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def ordered_function(program: Program, order: Sequence[int],
                     significant: Iterable[int]) -> Callable[..., list[Any]]:
  """`fn(*flat_args) -> flat outputs` that runs `program` with `order` fenced on `significant` nodes."""
  significant = frozenset(significant)

  def fn(*flat_args):
    env = dict(zip(program.inputs, flat_args))
    read = lambda x: x.value if isinstance(x, Const) else env[x]
    previous: tuple = ()
    for i in order:
      node = program.nodes[i]
      args = [read(x) for x in node.inputs]
      if i in significant and previous:
        fenced, _ = jax.lax.optimization_barrier((args, previous))
        args = list(fenced)
      outs = interpret.bind(node, args)
      env.update(zip(node.outputs, outs))
      if i in significant:
        previous = tuple(outs)
    return [read(x) for x in program.outputs]

  return fn


def significant_nodes(sizes: dict[int, int], program: Program, min_bytes: int) -> set[int]:
  """Nodes whose results take at least `min_bytes` (at the shape being compiled)."""
  return {n.index for n in program.nodes
          if sum(sizes.get(o, 0) for o in n.outputs) >= min_bytes}
