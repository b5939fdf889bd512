"""Rematerialization inside a body that holds a whole forward and backward pass.

Gradient accumulation scans over microbatches: each iteration runs the model's
forward and backward pass (`value_and_grad` inside the body) and adds the gradients
to the carry. The step's peak is then inside that body (one microbatch's activations,
`memory.transients`), where the top-level planner finds nothing to evict: a scan is
one node, and its body is not a forward/backward scan pair (`loop_remat`).

So the flat planner also runs on the body itself, in the body's order, when the peak
step is such a scan (`remat.plan`); each region it finds there becomes a
`BodyEviction` of the scan, ranked with the top-level candidates by FLOPs (times the
trip count: the recomputation runs every iteration) per byte saved. Applying them
rewrites the body with the same fences and clones as at the top level
(`remat.apply_regions`) and rebuilds the scan around it (`rebuild`), so the
recomputation runs inside the loop. The next round plans on the rebuilt body.

A shard_map that runs a whole forward and backward pass (a data-parallel step with its
loss under `jax.shard_map`, merged by `shard_map_merge`) is planned the same way: its
body is the step per device, run once; a scan pair inside it (layers under `nn.scan`) is
rewritten as the shard_map traces its body, with the mesh axes bound
(`tracing.inside_shard_map`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jax import lax

from jax_symmem._src import interpret
from jax_symmem._src import loop_remat
from jax_symmem._src import tracing
from jax_symmem._src.flops import at_dims
from jax_symmem._src.ir import Const, Node, Program, source_label
from jax_symmem._src.poly import Poly
from jax_symmem._src.shape_graph import ShapeGraph


@dataclasses.dataclass(frozen=True)
class BodyEviction:
  """A flat region (`remat.Region`) of the body of the scan (or shard_map) at node `node`."""
  node: int          # node index of the scan: the same in every round
  item: Any          # the region, in the body as it stands in the round it was planned on
  trips: Poly        # the scan's length: the regeneration runs once per iteration

  # Value ids are unique across a program tree, so `remat.compatible` can compare a
  # body region's value and anchors with the top-level ones as they are.
  @property
  def value(self) -> int:
    return self.item.value

  @property
  def anchors(self) -> tuple[int, ...]:
    return self.item.anchors

  @property
  def saved(self) -> Poly:
    return self.item.saved

  @property
  def cost(self) -> Poly:
    return self.item.cost * self.trips

  @property
  def source(self) -> str:
    return self.item.source

  def describe(self, graph: ShapeGraph, **dims: int) -> str:
    info = graph.values[self.value]
    where = source_label(self.source, info.primitive)
    if isinstance(self.item, loop_remat.LoopEviction):   # a residual of a pair inside
      kind = loop_remat.kind(info.primitive)
      what = f"{kind} residual {info.shape_str()}"
      how = f"regenerated in the backward {kind}; recompute"
    else:
      what, how = info.shape_str(), f"recompute {len(self.item.nodes)} op(s) ="
    # (The node's index is the same in every round, the traced program's included.)
    inside = ("inside the shard_map's body"
              if graph.traced.program.nodes[self.node].name == "shard_map"
              else f"inside a scan body (each of its {self.trips} iterations)")
    return (f"evict {what} from {where} {inside}: saves {self.saved} B, {how} {self.cost} "
            "FLOPs" + at_dims(graph, self.saved, self.cost, dims))


def plannable(node: Node, paired: set[int]) -> bool:
  """Whether the body of `node` is planned as a flat program: a scan, or a shard_map
  (one that runs a whole forward and backward pass: `shard_map_merge`), that is not
  half of a forward/backward pair (those are `loop_remat`'s)."""
  return (node.name in ("scan", "shard_map") and node.index not in paired
          and len(node.subprograms) == 1)


def rebuild(program: Program, index: int, body: Program, order: Sequence[int]) -> Program:
  """`program` with the scan at node `index` running `body` (a rewrite of its body with
  the same inputs and outputs) in `order`. The node keeps its index and output ids;
  its new body is re-traced with value ids above every id in `program`."""
  node = program.nodes[index]
  p = node.params
  if node.name == "shard_map":
    def shard_map_fn(*operands):
      return interpret.run(body, list(operands), order)
    fun = tracing.shard_map_like(p, shard_map_fn, p["in_specs"], p["out_specs"])
    return _replace(program, index, node, fun, body, order)
  n_consts, n_carry = tracing.scan_counts(p)

  def scan_fn(*operands):
    consts, init, xs = (operands[:n_consts], operands[n_consts:n_consts + n_carry],
                        operands[n_consts + n_carry:])
    def step(carry, x):
      outs = interpret.run(body, [*consts, *carry, *x], order)
      return outs[:n_carry], outs[n_carry:]
    # The length comes from the scanned operands where there are any: lax.scan wants
    # an int, and a loop over a dynamic dim (microbatches "m") has a symbolic one.
    carry, ys = lax.scan(step, list(init), list(xs), length=None if xs else p["length"],
                         reverse=p["reverse"], unroll=loop_remat.REWRITTEN_UNROLL)
    return [*carry, *ys]

  return _replace(program, index, node, scan_fn, body, order)


def _replace(program: Program, index: int, node: Node, fun, body: Program, order) -> Program:
  """`program` with `node` (at `index`) replaced by the one node `fun` traces to."""
  avals = [x.aval if isinstance(x, Const) else program.avals[x] for x in node.inputs]
  new, sub = tracing.node_from_function(fun, avals, program.max_id() + 1)
  new = _with_sources(new, [body.nodes[i] for i in order])
  new, forwarded = loop_remat._rebind(new, sub, list(node.inputs), list(node.outputs), index)
  avals = dict(program.avals)
  avals.update((v, sub.avals[o]) for v, o in zip(node.outputs, sub.outputs)
               if not isinstance(o, Const))
  return loop_remat.replace_nodes(program, {index: new}, forwarded, avals)


def _with_sources(node: Node, ran: Sequence[Node]) -> Node:
  """The re-traced scan with its body's nodes citing the source lines of the nodes they
  ran (re-tracing binds them from here); unchanged where the two do not line up."""
  (new_body,) = node.subprograms
  if [n.name for n in new_body.nodes] != [n.name for n in ran]:
    return node
  nodes = tuple(dataclasses.replace(n, source=r.source) for n, r in zip(new_body.nodes, ran))
  return dataclasses.replace(node, subprograms=(dataclasses.replace(new_body, nodes=nodes),))
