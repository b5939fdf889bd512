"""FLOPs of a node as an exact polynomial over the dims: what a recomputation costs."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from jax_symmem._src import jax_dims
from jax_symmem._src.poly import ZERO, Poly, product, total
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.ir import Const, Node


@functools.lru_cache(maxsize=1 << 12)
def _elements(dims: tuple[Poly, ...]) -> Poly:
  """The number of elements of a shape (a model has few distinct shapes, and each
  remat round asks again for the nodes it rewrote)."""
  return product(dims)


def _dot_flops(node: Node, ins: Sequence[tuple[Poly, ...]], outs: Sequence[tuple[Poly, ...]]) -> Poly:
  (lc, _), _ = node.params["dimension_numbers"]
  return 2 * _elements(outs[0]) * _elements(tuple(ins[0][i] for i in lc))


def _reduction_flops(node, ins, outs) -> Poly:
  return _elements(ins[0])


# Threefry-2x32 (JAX's default PRNG) per 32-bit word it generates: 20 rounds of an add,
# a rotation (two shifts and an or) and a xor on each word, and the key injections.
THREEFRY_OPS_PER_WORD = 110


def _random_bits_flops(node, ins, outs) -> Poly:
  words = max(1, node.params.get("bit_width", 32) // 32)
  return THREEFRY_OPS_PER_WORD * words * _elements(outs[0])


def _threefry_flops(node, ins, outs) -> Poly:
  return THREEFRY_OPS_PER_WORD * sum((_elements(o) for o in outs), ZERO)


# primitive -> (node, input dims, output dims) -> FLOPs; default: one per output element.
FLOP_RULES: dict[str, Callable[..., Poly]] = {
    "dot_general": _dot_flops,
    "random_bits": _random_bits_flops, "threefry2x32": _threefry_flops,
    "reduce_sum": _reduction_flops, "reduce_max": _reduction_flops,
    "reduce_min": _reduction_flops, "argmax": _reduction_flops, "argmin": _reduction_flops,
}


def flops(graph: ShapeGraph, node: Node) -> Poly:
  if node.subprograms:   # control flow: its bodies' FLOPs (a scan's times its length,
    # which is a symbolic dim when the loop runs over one, e.g. microbatches "m")
    body = total(flops(graph, n) for sub in node.subprograms for n in sub.nodes)
    return scan_length(node) * body if node.name == "scan" else body
  ins = [graph.values[x].dims if not isinstance(x, Const) else () for x in node.inputs]
  outs = [graph.values[o].dims for o in node.outputs]
  rule = FLOP_RULES.get(node.name)
  return rule(node, ins, outs) if rule else sum((_elements(o) for o in outs), ZERO)


def scan_length(scan: Node) -> Poly:
  """A scan's trip count: an int, or a dim when the loop runs over one."""
  return jax_dims.to_poly(scan.params["length"])


def at_dims(graph: ShapeGraph, saved: Poly, cost: Poly, dims) -> str:
  """" [x MiB, y MFLOP at dims]": an eviction's saving and cost, for plan descriptions."""
  if not dims:
    return ""
  env = graph.constraints.complete(dims)
  return (f" [{saved.evaluate(env) / 2**20:.2f} MiB, "
          f"{cost.evaluate(env) / 1e6:.2f} MFLOP at {dims}]")
