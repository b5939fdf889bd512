"""The program IR every stage after tracing works on: frozen, free of JAX internals.

A `Program` is a flat list of `Node`s (one primitive application each, in trace
order) over integer value ids that are unique across a whole program tree; a
control-flow node keeps its bodies as nested `Program`s (`Node.subprograms`).
`tracing.py` builds them from jaxprs; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Any, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class Const:
  """A literal or closed-over constant used as an operand."""
  value: Any
  aval: Any


Operand = Any  # int (a value id) | Const


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
  """One primitive application. Value ids are unique across a whole Program tree."""
  index: int
  primitive: Any                # a jax Primitive
  params: Mapping[str, Any]
  inputs: tuple[Operand, ...]
  outputs: tuple[int, ...]
  source: str                   # "path:line:col (function) @ scope" (tracing._source)
  effects: frozenset = frozenset()
  subprograms: tuple["Program", ...] = ()

  @property
  def name(self) -> str:
    return self.primitive.name

  @functools.cached_property
  def operands(self) -> tuple[int, ...]:
    """The value ids among `inputs` (constants left out), in order, repeats kept:
    what liveness and dataflow read, on every planning round's hot path."""
    return tuple(x for x in self.inputs if not isinstance(x, Const))


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A flat program: inputs, nodes in trace order, outputs, and every value's aval."""
  inputs: tuple[int, ...]
  nodes: tuple[Node, ...]
  outputs: tuple[Operand, ...]
  avals: Mapping[int, Any]

  def __repr__(self) -> str:   # the nodes of a 1B-parameter step would be megabytes
    return (f"Program({len(self.nodes)} nodes, {len(self.inputs)} inputs, "
            f"{len(self.outputs)} outputs)")

  def value_ids(self) -> tuple[int, ...]:
    """The inputs, then every node's outputs (each planning round reads them a few times)."""
    return self._value_ids

  @functools.cached_property
  def _value_ids(self) -> tuple[int, ...]:
    return self.inputs + tuple(self.writes[1].tolist())

  @functools.cached_property
  def reads(self) -> tuple[np.ndarray, np.ndarray]:
    """(node index, value id) of every operand read, in node order, repeats kept: the
    planner's per-round tables of a program are built from these with numpy."""
    return _per_node_table([n.operands for n in self.nodes])

  @functools.cached_property
  def writes(self) -> tuple[np.ndarray, np.ndarray]:
    """(node index, value id) of every node output, in node order."""
    return _per_node_table([n.outputs for n in self.nodes])

  @functools.cached_property
  def control_flow(self) -> tuple[Node, ...]:
    """The nodes with subprograms (scan, while, cond, shard_map), in node order."""
    return tuple(n for n in self.nodes if n.subprograms)

  def walk(self):
    """Yields (program, node) for this program and every nested subprogram."""
    for n in self.nodes:
      yield self, n
      for sub in n.subprograms:
        yield from sub.walk()

  def max_id(self) -> int:
    """The largest value id here or in any subprogram (-1 if none): a rewrite's new
    values start above it."""
    return max(max(self.inputs, default=-1), int(self.writes[1].max(initial=-1)),
               *(sub.max_id() for n in self.control_flow for sub in n.subprograms))


def live_nodes(program: Program) -> np.ndarray:
  """Whether each top-level node contributes to the outputs or has effects: what XLA
  keeps (it removes the rest before it lays out memory)."""
  producer = {o: n for n in program.nodes for o in n.outputs}
  live = np.zeros(len(program.nodes), bool)
  stack = [x for x in program.outputs if not isinstance(x, Const)]
  stack += [x for n in program.nodes if n.effects for x in n.operands]
  for n in program.nodes:
    if n.effects:
      live[n.index] = True
  while stack:
    n = producer.get(stack.pop())
    if n is not None and not live[n.index]:
      live[n.index] = True
      stack.extend(n.operands)
  return live


def without_dead_code(program: Program) -> Program:
  """`program` less the top-level nodes `live_nodes` drops: the memory model must not
  count them (a jaxpr keeps, e.g., the primal results `jax.grad` discards: a training
  step's logits-sized cast among them). Value ids stay; nodes are renumbered in order."""
  live = live_nodes(program)
  if live.all():
    return program
  kept = [n for n in program.nodes if live[n.index]]
  dead = {o for n in program.nodes if not live[n.index] for o in n.outputs}
  return Program(program.inputs, tuple(dataclasses.replace(n, index=i) for i, n in enumerate(kept)),
                 program.outputs, {v: a for v, a in program.avals.items() if v not in dead})


def _per_node_table(ids_per_node: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
  """(node index, value id) arrays of every id listed per node, in node order."""
  node_of = np.repeat(np.arange(len(ids_per_node), dtype=np.int64),
                      np.fromiter(map(len, ids_per_node), np.int64, len(ids_per_node)))
  ids = np.fromiter(itertools.chain.from_iterable(ids_per_node), np.int64, len(node_of))
  return node_of, ids


# A layer's scope: the scope up to its first component ending in an index, as Flax and
# HF name repeated layers ("encoder/layer_0/attn" -> "encoder/layer_0", "h_1",
# "encoder/block/2/layer/0" -> "encoder/block/2").
_LAYER_SCOPE = re.compile(r"^((?:[^/]*/)*?[^/]*?\d+)(?:/|$)")


def layer_scope(source: str) -> str | None:
  """The layer a node's `source` ("path:line (fn) @ scope") belongs to, or None."""
  _, _, scope = source.partition(" @ ")
  m = _LAYER_SCOPE.match(scope) if scope else None
  return m.group(1) if m else None


def source_label(source: str, primitive: str = "") -> str:
  """A node's `source` for messages: the file without its directory
  ("model.py:41:8 (__call__) @ Block_3/LayerNorm_0"), or the primitive where JAX
  produced the value with no user frame."""
  label = re.sub(r"^\S*/(?=[^/\s]+:\d+)", "", source)
  if not label or label.startswith(" "):
    label = f"{primitive} (no user source line){label}"
  return label
