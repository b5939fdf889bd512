"""A forward/backward shard_map pair with nothing between them, merged into one shard_map.

A step whose whole loss runs under one `jax.shard_map` (data parallelism with explicit
collectives) differentiates into a forward shard_map that outputs every residual and a
backward one that reads them, with only the cotangent's seed between (`1.0`, resharded).
As a pair (`loop_remat`) the residuals can only be regenerated from the forward body's
inputs, and nothing runs between the two halves while they are held. XLA partitions both
away, so per device the step is one flat forward and backward pass; merged into one
shard_map whose body runs the forward body, the seed and the backward body, it is that
flat program, and the planner plans its body as it plans a flat step
(`body_remat`): values regenerated from what the backward pass still holds, where the
backward pass needs them.

Merged only where that is the same computation on every device: what runs between the
two reads nothing but literals and results the forward body made replicated
(`out_specs` P()), computes elementwise or moves no data (`BETWEEN`), and the backward
shard_map reads it replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jax_symmem._src import interpret
from jax_symmem._src import loop_remat
from jax_symmem._src import tracing
from jax_symmem._src.ir import Const, Node, Program

# What may run between the halves and move into the merged body: the cotangent's seed
# and its scaling. `reshard` / `sharding_constraint` only place a replicated value: the
# identity inside a shard_map body.
IDENTITY = frozenset({"reshard", "sharding_constraint"})
BETWEEN = IDENTITY | frozenset({
    "broadcast_in_dim", "convert_element_type", "mul", "div", "add", "sub", "neg",
    "reshape", "squeeze", "expand_dims"})


def _replicated(spec) -> bool:
  return all(entry is None for entry in spec)


def merge(program: Program) -> Program:
  """`program` with each forward/backward shard_map pair that nothing but its cotangent's
  seed separates merged into one shard_map; the pair's outputs keep their ids."""
  for fi, state in sorted(loop_remat.shard_map_pairs(program).items()):
    merged = _merge_pair(program, state.forward, state.backward)
    if merged is not None:
      return merge(merged)   # indices moved: find the pairs again
  return program


def _merge_pair(program: Program, f: Node, b: Node) -> Program | None:
  between = program.nodes[f.index + 1:b.index]
  made = set(f.outputs)
  replicated = {o for j, o in enumerate(f.outputs) if _replicated(f.params["out_specs"][j])}
  producer = {o: n for n in between for o in n.outputs}
  # The nodes between that the backward reads, directly or through each other, move in.
  moved_ids: set[int] = set()
  stack = [x for x in b.operands if x in producer]
  while stack:
    n = producer[stack.pop()]
    if n.index not in moved_ids:
      moved_ids.add(n.index)
      stack.extend(x for x in n.operands if x in producer)
  moved = [n for n in between if n.index in moved_ids]
  inside = {o for n in moved for o in n.outputs}
  for n in moved:
    if (n.name not in BETWEEN or n.effects or n.subprograms
        or not set(n.operands) <= (replicated | inside)):
      return None
  for k, x in enumerate(b.inputs):
    if not isinstance(x, Const) and x in inside and not _replicated(b.params["in_specs"][k]):
      return None
  readers = loop_remat._uses(program)   # value -> [(node, operand position)]
  returned = {x for x in program.outputs if not isinstance(x, Const)}
  def read_outside(v) -> bool:
    return v in returned or any(r is not b and r.index not in moved_ids
                                for r, _ in readers.get(v, ()))
  if any(map(read_outside, inside)):
    return None   # a moved value is read outside too
  outer = list(dict.fromkeys(x for x in b.operands if x not in made and x not in inside))
  f_keep = [j for j, o in enumerate(f.outputs) if read_outside(o)]
  in_specs = (list(f.params["in_specs"])
              + [b.params["in_specs"][b.inputs.index(x)] for x in outer])
  out_specs = [f.params["out_specs"][j] for j in f_keep] + list(b.params["out_specs"])
  f_jaxpr, b_jaxpr = f.params["jaxpr"], b.params["jaxpr"]

  def body(*ops):
    f_ops, outer_ops = ops[:len(f.inputs)], ops[len(f.inputs):]
    f_out = tracing.eval_jaxpr(f_jaxpr, (), f_ops)
    env: dict[int, Any] = dict(zip(f.outputs, f_out))
    env.update(zip(outer, outer_ops))
    read = lambda x: x.value if isinstance(x, Const) else env[x]
    for node in moved:
      args = [read(x) for x in node.inputs]
      env.update(zip(node.outputs, args[:1] if node.name in IDENTITY
                     else interpret.bind(node, args)))
    b_out = tracing.eval_jaxpr(b_jaxpr, (), [read(x) for x in b.inputs])
    return [f_out[j] for j in f_keep] + list(b_out)

  operands = list(f.inputs) + outer
  avals = [x.aval if isinstance(x, Const) else program.avals[x] for x in operands]
  fun = tracing.shard_map_like(f.params, body, in_specs, out_specs)
  node, sub = tracing.node_from_function(fun, avals, program.max_id() + 1)
  wanted = [f.outputs[j] for j in f_keep] + list(b.outputs)
  node, forwarded = loop_remat._rebind(node, sub, operands, wanted, b.index)
  new_avals = dict(program.avals)
  new_avals.update((v, sub.avals[o]) for v, o in zip(wanted, sub.outputs)
                   if not isinstance(o, Const))
  # The merged node runs where the forward did, after what ran between that it reads
  # (nothing there reads the forward's results: those either moved in or come after).
  depends = set(made)
  late, early = [], []
  for n in between:
    if n.index in moved_ids:
      continue
    if set(n.operands) & depends:
      late.append(n)
      depends.update(n.outputs)
    else:
      early.append(n)
  nodes = (list(program.nodes[:f.index]) + early + [node] + late
           + list(program.nodes[b.index + 1:]))
  return _renumbered(program, nodes, forwarded, new_avals)


def _renumbered(program: Program, nodes: Sequence[Node], forwarded, avals) -> Program:
  """`nodes` as a program, indexed in their order, reading what the merged node forwarded."""
  rename = lambda x: x if isinstance(x, Const) else forwarded.get(x, x)
  out = tuple(dataclasses.replace(n, index=k, inputs=tuple(rename(x) for x in n.inputs))
              for k, n in enumerate(nodes))
  return Program(program.inputs, out, tuple(rename(x) for x in program.outputs), avals)
