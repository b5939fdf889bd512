"""Evaluates a `Program` primitive by primitive, in a given order.

The basis of the reference executor and of the rewrite (which re-traces this
interpreter under `jax.make_jaxpr`). Control-flow nodes are bound whole, with
their original params, so their bodies run as JAX would run them.
"""

from __future__ import annotations

from typing import Any, Sequence

from jax_symmem._src import tracing
from jax_symmem._src.ir import Const, Node, Program


def bind(node: Node, args: Sequence[Any]) -> list[Any]:
  return tracing.bind(node.primitive, args, node.params)


def run(program: Program, flat_args: Sequence[Any], order: Sequence[int] | None = None
        ) -> list[Any]:
  """Runs `program` on flat arguments; `order` is a permutation of node indices."""
  if len(flat_args) != len(program.inputs):
    raise ValueError(f"expected {len(program.inputs)} arguments, got {len(flat_args)}")
  env: dict[int, Any] = dict(zip(program.inputs, flat_args))
  read = lambda x: x.value if isinstance(x, Const) else env[x]
  for i in (range(len(program.nodes)) if order is None else order):
    node = program.nodes[i]
    env.update(zip(node.outputs, bind(node, [read(x) for x in node.inputs])))
  return [read(x) for x in program.outputs]
