"""Imposing an order on XLA: chain memory-significant nodes through optimization barriers.

XLA ignores the order of a jaxpr (DESIGN.md F4): its scheduler reorders freely.
The one handle we have is data dependence. `ordered_function` evaluates a
(specialized) program in a given order and, before each significant node, passes
its operands together with the previous significant node's results through
`lax.optimization_barrier`, so node k cannot start before node k-1 has finished.
XLA:CPU removes barriers early unless its `cse_barrier_expander` pass is
disabled (F1), so compile with `FENCE_COMPILER_OPTIONS`.

Under a budget, the rounds jax_symmem plans pin their large random draws this way
(`pinned_draws`), whatever the scheduler does with the rest, and store the mask each
draw makes from that fence (`kept_values`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import jax

from jax_symmem._src import interpret
from jax_symmem._src import memory
from jax_symmem._src import shape_graph
from jax_symmem._src import xla_buffers
from jax_symmem._src.ir import Const, Program
from jax_symmem._src.shape_graph import ShapeGraph

FENCE_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
# Nodes whose results (a draw: its counters) take less are left where XLA puts them.
MIN_BYTES = 2**20


def ordered_function(program: Program, order: Sequence[int], significant: Iterable[int],
                     pinned: Iterable[int] | None = None,
                     kept: Iterable[int] = ()) -> Callable[..., list[Any]]:
  """`fn(*flat_args) -> flat outputs` that runs `program` with `order` fenced on `significant` nodes.

  `pinned` (default: every significant node) are the nodes held in place: each waits for
  the results of the significant node before it, and the significant node after it waits
  for its results. Significant nodes that are not pinned only mark those positions.
  `kept`: values made from a pinned node's results after it (`kept_values`) that the
  next significant node waits for instead, and that every later reader reads from that
  barrier: XLA stores it there rather than recomputing it from the pinned node's results
  in each reader (which would keep those alive as long).
  """
  pinned = frozenset(significant) if pinned is None else frozenset(pinned)
  significant = frozenset(significant) | pinned
  kept = frozenset(kept)

  def fn(*flat_args):
    env = dict(zip(program.inputs, flat_args))
    read = lambda x: x.value if isinstance(x, Const) else env[x]
    previous: tuple = ()   # the last significant node's results
    pending: tuple = ()    # value ids the next significant node waits for
    for i in order:
      node = program.nodes[i]
      args = [read(x) for x in node.inputs]
      wait = previous if i in pinned else tuple(env[v] for v in pending) if i in significant else ()
      if wait:
        args, waited = jax.lax.optimization_barrier((args, wait))
        args = list(args)
        if i not in pinned:   # later readers read what was waited for from the barrier
          env.update(zip(pending, waited))
          pending = ()
      outs = interpret.bind(node, args)
      env.update(zip(node.outputs, outs))
      if i in significant:
        previous = tuple(outs)
        pending = tuple(node.outputs) if i in pinned else ()
      if kept.intersection(node.outputs):   # made after its pinned node: waited for instead
        pending = tuple(v for v in node.outputs if v in kept)
    return [read(x) for x in program.outputs]

  return fn


def kept_values(program: Program, pinned: Iterable[int]) -> dict[int, int]:
  """Each pinned draw -> the value its readers keep: along the values made from its
  result by an elementwise op that is their only reader (a uniform's bit tricks, a
  comparison with the rate), the smallest before the first value read twice or by
  anything else. For a dropout that is its boolean mask, which the forward and the
  backward both read; stored (`ordered_function`'s `kept`), it holds one byte per
  element where the draw's result, read by every reader that fuses the mask, holds four.
  """
  readers: dict[int, list] = {}
  for n in program.nodes:
    for x in set(n.operands):
      readers.setdefault(x, []).append(n)
  itemsize = lambda v: shape_graph.itemsize(program.avals[v])
  out = {}
  for i in pinned:
    v = best = program.nodes[i].outputs[0]
    while (len(rs := readers.get(v, ())) == 1 and rs[0].name in xla_buffers.IN_PLACE
           and len(rs[0].outputs) == 1):
      v = rs[0].outputs[0]
      if itemsize(v) <= itemsize(best):
        best = v
    out[i] = best
  return out


def pinned_draws(graph: ShapeGraph, program: Program, env: Mapping[str, int],
                 min_bytes: int) -> frozenset[int]:
  """The random draws of `program` (top level) whose Threefry counters take at least
  `min_bytes` while they run, at the complete dims `env`: the nodes to pin.

  A draw's first counters depend on its key alone, so XLA computes them as soon as the
  key is ready, often layers before its scheduler reaches the draw's loop, and holds
  them (two counter words per element) in between: in a GPT-2 step with dropout 0.1 at
  b=4, s=512, four attention-probability draws' counters were live at once at XLA's
  peak, 128 MiB. Pinned where the order puts them (`ordered_function`), the counters
  live only while the draw runs, and its result (one word) is stored for its readers.
  """
  return frozenset(
      n.index for n in program.nodes if n.name == "random_bits"
      and memory.DRAW_BYTES_PER_ELEMENT * memory.elements_at(graph, n.outputs[0], env)
      >= min_bytes)


def significant_nodes(sizes: dict[int, int], program: Program, min_bytes: int) -> set[int]:
  """Nodes whose results take at least `min_bytes` (at the shape being compiled)."""
  return {n.index for n in program.nodes
          if sum(sizes.get(o, 0) for o in n.outputs) >= min_bytes}
