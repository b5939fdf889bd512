"""Per-device sizes of a sharded step: how many ways each dim of each value is split.

`jax.jit` with `in_shardings` (or committed, sharded arguments) runs one SPMD
program per device; XLA's partitioner decides the sharding of every
intermediate. The memory model needs each value's bytes *per device*, so this
module propagates, forward through the program, a divisor per dim (the number of
shards it is split into) from the arguments' `NamedSharding`s, with one rule per
primitive in `SHARDING_RULES`, as GSPMD's forward propagation would:

* a dot_general keeps its operands' batch and free-dim splits (a split
  contracting dim becomes a partial sum, all-reduced: not split);
* reductions drop the reduced dims, transposes permute, broadcasts map dims;
* a reshape keeps a split on the major dim of a merged or split group;
* any other op whose output dim equals an operand's dim (elementwise ops,
  slices on other dims, ...) keeps that operand's split;
* a `shard_map`'s outputs are split as its `out_specs` say (its body is per device
  already: each value there is one device's shard);
* a scan's, while's or cond's body is propagated from the node's operands (a scan's
  scanned slices without their leading dim); a carry keeps the split it enters with
  where the body keeps it (`BODY_RULES`), a scan's stacked results their body value's
  split under a whole leading dim, a cond's results the least split over its branches;
* everything else is assumed replicated: an over-estimate, never an under-estimate of
  a value the model cannot place.

`with_sharding_constraint` sets the split it names. A dim of size n split d ways
takes ceil(n / d) per device.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

from jax_symmem._src import jax_dims
from jax_symmem._src.poly import Poly
from jax_symmem._src.ir import Const, Node, Program

Divisors = tuple[int, ...]   # per dim of a value: how many shards it is split into


def spec_divisors(sharding: Any, ndim: int) -> Divisors:
  """Per-dim split counts of a `NamedSharding` (anything else: replicated)."""
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None:
    return (1,) * ndim
  return mesh_divisors(mesh, spec, ndim)


def mesh_divisors(mesh: Any, spec: Any, ndim: int) -> Divisors:
  """Per-dim split counts of a `PartitionSpec` over `mesh`."""
  out = []
  for k in range(ndim):
    entry = spec[k] if k < len(spec) else None
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    d = 1
    for a in axes:
      d *= mesh.shape[a]
    out.append(d)
  return tuple(out)


def is_sharded(divisors: Mapping[int, Divisors]) -> bool:
  return any(d > 1 for ds in divisors.values() for d in ds)


# --- propagation -----------------------------------------------------------------------

Rule = Callable[[Node, Sequence[Divisors], Sequence[tuple[Poly, ...]],
                 Sequence[tuple[Poly, ...]]], list[Divisors]]
SHARDING_RULES: dict[str, Rule] = {}


def runs_shard_map(program: Program) -> bool:
  """Whether `program` runs a `shard_map` anywhere (in a scan's body too): its figures
  are per device then, whatever the arguments' shardings."""
  return any(n.name == "shard_map" or any(runs_shard_map(b) for b in n.subprograms)
             for n in program.nodes)


def propagate(program: Program, inputs: Sequence[Divisors] | None, dims_of,
              known: Mapping[int, Divisors] | None = None) -> dict[int, Divisors]:
  """Divisors of every value of `program`; `dims_of(value_id)` gives its dims (Polys).

  `inputs` None: the arguments have no sharding of their own, and XLA shards each as
  the first `shard_map` that reads it needs (a batch split over "data"; also one in a
  loop's body, through the loop's operand); the rest whole.
  `known`: the divisors of an earlier version of `program` (before a rewrite added
  nodes): a node whose outputs all have theirs there is not propagated again."""
  if inputs is None:
    read = _shard_map_splits(program, dims_of)
    inputs = [read.get(v, (1,) * len(dims_of(v))) for v in program.inputs]
  divisors: dict[int, Divisors] = dict(known or {})
  _run(program, inputs, divisors, dims_of, skip_known=known is not None)
  return divisors


def _shard_map_splits(program: Program, dims_of) -> dict[int, Divisors]:
  """Each value of `program` a shard_map reads -> the split its in_spec gives it, the
  first such reader's; a shard_map in a scan's, while's or cond's body reads the node's
  operand that feeds it (a scanned slice: under a whole leading dim)."""
  out: dict[int, Divisors] = {}
  for node in reversed(program.nodes):
    if node.name == "shard_map":
      out.update((x, mesh_divisors(node.params["mesh"], spec, len(dims_of(x))))
                 for x, spec in zip(node.inputs, node.params["in_specs"])
                 if not isinstance(x, Const))
    elif node.name in BODY_OPERANDS:
      for body, feeds in BODY_OPERANDS[node.name](node):
        inner = _shard_map_splits(body, dims_of)
        for k, j, sliced in feeds:
          x, v = node.inputs[k], body.inputs[j]
          if v in inner and not isinstance(x, Const):
            out[x] = (1, *inner[v]) if sliced else inner[v]
  return out


def _run(program: Program, inputs: Sequence[Divisors], divisors: dict[int, Divisors],
         dims_of, skip_known: bool = False) -> list[Divisors]:
  """Propagates through `program` whose inputs are split as `inputs`, into `divisors`;
  returns its outputs' splits."""
  divisors.update(zip(program.inputs, inputs))
  for node in program.nodes:
    if skip_known and _known(node, divisors):
      continue
    in_dims = [_dims(x, dims_of) for x in node.inputs]
    in_div = [divisors.get(x) if not isinstance(x, Const) else None for x in node.inputs]
    in_div = [d if d is not None else (1,) * len(n) for d, n in zip(in_div, in_dims)]
    out_dims = [dims_of(o) for o in node.outputs]
    if node.name in BODY_RULES:
      outs = BODY_RULES[node.name](node, in_div, lambda body, ins: _run(
          body, ins, divisors, dims_of, skip_known))
    else:
      rule = SHARDING_RULES.get(node.name, None if node.subprograms else _same_dims)
      outs = rule(node, in_div, in_dims, out_dims) if rule is not None else []
    for o, dims, d in zip(node.outputs, out_dims, outs or [None] * len(node.outputs)):
      divisors[o] = d if d is not None else (1,) * len(dims)
  return [(None if isinstance(x, Const) else divisors.get(x)) or (1,) * len(_dims(x, dims_of))
          for x in program.outputs]


def _known(node: Node, divisors: Mapping[int, Divisors]) -> bool:
  """Whether every value `node` makes, in its bodies too, has its divisors already (a
  rewritten scan keeps its outputs' ids, not its body's)."""
  return all(o in divisors for o in node.outputs) and all(
      _known(n, divisors) for body in node.subprograms for n in body.nodes)


def _dims(x, dims_of) -> tuple[Poly, ...]:
  return jax_dims.shape_to_polys(x.aval.shape) if isinstance(x, Const) else dims_of(x)


def _same_dims(node, in_div, in_dims, out_dims) -> list[Divisors]:
  """Each output dim keeps the largest split of an operand dim of the same size and position."""
  outs = []
  for dims in out_dims:
    ds = []
    for k, n in enumerate(dims):
      ds.append(max([d[k] for d, idims in zip(in_div, in_dims)
                     if len(idims) == len(dims) and idims[k] == n] or [1]))
    outs.append(tuple(ds))
  return outs


def _dot_general(node, in_div, in_dims, out_dims):
  (lc, rc), (lb, rb) = node.params["dimension_numbers"]
  ld, rd = in_div[0], in_div[1]
  batch = [max(ld[a], rd[b]) for a, b in zip(lb, rb)]
  lfree = [ld[k] for k in range(len(ld)) if k not in lc and k not in lb]
  rfree = [rd[k] for k in range(len(rd)) if k not in rc and k not in rb]
  return [tuple(batch + lfree + rfree)]


def _reduce(node, in_div, in_dims, out_dims):
  axes = set(node.params["axes"])
  d = in_div[0]
  return [tuple(x for k, x in enumerate(d) if k not in axes)] * len(out_dims)


def _transpose(node, in_div, in_dims, out_dims):
  d = in_div[0]
  return [tuple(d[p] for p in node.params["permutation"])]


def _broadcast_in_dim(node, in_div, in_dims, out_dims):
  d = in_div[0]
  out = [1] * len(out_dims[0])
  for k, target in enumerate(node.params["broadcast_dimensions"]):
    if in_dims[0][k] == out_dims[0][target]:   # a size-1 dim broadcast up is not split
      out[target] = d[k]
  return [tuple(out)]


def _squeeze(node, in_div, in_dims, out_dims):
  d = in_div[0]
  gone = {k % len(d) for k in node.params["dimensions"]}
  return [tuple(x for k, x in enumerate(d) if k not in gone)]


def _reshape(node, in_div, in_dims, out_dims):
  """Groups input and output dims whose products match; a group keeps the split of
  its major input dim on its major output dim (row-major layout stays contiguous)."""
  src, dst = list(in_dims[0]), list(out_dims[0])
  d = in_div[0]
  out = [1] * len(dst)
  i = j = 0
  while i < len(src) and j < len(dst):
    gi, gj = i + 1, j + 1
    pi, pj = src[i], dst[j]
    for _ in range(len(src) + len(dst)):
      if pi == pj:
        break
      # grow the side whose product is "smaller": compare by degree then value at 2
      if _grows_first(pi, pj) and gi < len(src):
        pi, gi = pi * src[gi], gi + 1
      elif gj < len(dst):
        pj, gj = pj * dst[gj], gj + 1
      elif gi < len(src):
        pi, gi = pi * src[gi], gi + 1
      else:
        break
    if pi != pj:
      break   # no exact grouping: leave the rest replicated
    if d[i] > 1:
      out[j] = d[i]
    i, j = gi, gj
  return [tuple(out)]


def _grows_first(a: Poly, b: Poly) -> bool:
  probe = {v: 2 for v in a.variables() | b.variables()}
  return a.evaluate(probe) < b.evaluate(probe)


def _carry(out: list[int], dims, pairs, div: Divisors, src_dims) -> None:
  """For each (k, j) in `pairs`: output dim k takes `div[j]`, the split of a source dim
  j of the same size, where it is larger."""
  for k, j in pairs:
    if dims[k] == src_dims[j]:
      out[k] = max(out[k], div[j])


def _gather(node, in_div, in_dims, out_dims):
  """An output dim outside `offset_dims` indexes the start indices' dims in order (the
  last, the index vector, aside), so it takes their split where the sizes match: the
  rows a batched lookup (`take_along_axis`, an embedding) reads are split as its indices.
  An offset dim that spans its operand dim (the k-th not collapsed) keeps that split."""
  dn = node.params["dimension_numbers"]
  (out,) = _same_dims(node, in_div, in_dims, out_dims)
  out, dims = list(out), out_dims[0]
  (operand_div, index_div), (operand_dims, index_dims) = in_div[:2], in_dims[:2]
  skipped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
  sliced = [d for d in range(len(operand_dims)) if d not in skipped]
  _carry(out, dims, zip(dn.offset_dims, sliced), operand_div, operand_dims)
  batch = [k for k in range(len(out)) if k not in set(dn.offset_dims)]
  _carry(out, dims, zip(batch, range(len(index_dims) - 1)), index_div, index_dims)
  return [tuple(out)]


def _scatter(node, in_div, in_dims, out_dims):
  """The output is the operand updated in place: its split, or that of the matching dims
  of the indices (`operand_batching_dims`: each batch row scatters into its own row, as
  the gradient of `take_along_axis` does) or of the updates (a window dim that spans the
  operand's dim)."""
  dn = node.params["dimension_numbers"]
  (out,) = _same_dims(node, in_div[:1], in_dims[:1], out_dims)
  out, dims = list(out), out_dims[0]
  (index_div, update_div), (index_dims, update_dims) = in_div[1:3], in_dims[1:3]
  _carry(out, dims, zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims),
         index_div, index_dims)
  skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
  windows = [k for k in range(len(dims)) if k not in skipped]
  _carry(out, dims, zip(windows, dn.update_window_dims), update_div, update_dims)
  return [tuple(out)]


def _sharding_constraint(node, in_div, in_dims, out_dims):
  return [spec_divisors(node.params["sharding"], len(out_dims[0]))]


def _shard_map(node, in_div, in_dims, out_dims):
  """Each output is split as its `out_specs` entry says (its body made one shard per
  device; an output the body reduced over an axis is whole on each device)."""
  mesh = node.params["mesh"]
  return [mesh_divisors(mesh, spec, len(dims))
          for spec, dims in zip(node.params["out_specs"], out_dims)]


# --- control flow: rules that propagate through a node's bodies --------------------------

Run = Callable[[Program, Sequence[Divisors]], list[Divisors]]   # a body's outputs' splits


def _least(a: Sequence[Divisors], b: Sequence[Divisors]) -> list[Divisors]:
  return [tuple(map(min, x, y)) for x, y in zip(a, b)]


def _loop_carry(carry: list[Divisors], run_body: Callable[[list[Divisors]], list[Divisors]]
                ) -> tuple[list[Divisors], list[Divisors]]:
  """(the carry's split, the body's outputs): the split the carry enters with, less where
  the body's results drop it, the body propagated again from that (a second pass settles
  what a first dropped; the carry then takes the least of all, an over-estimate)."""
  outs = run_body(carry)
  for _ in range(2):
    fewer = _least(carry, outs)
    if fewer == carry:
      break
    carry = fewer
    outs = run_body(carry)
  return _least(carry, outs), outs


def _scan_body(node, in_div, run: Run) -> list[Divisors]:
  from jax_symmem._src import tracing   # (tracing imports this module)
  (body,) = node.subprograms
  n_consts, n_carry = tracing.scan_counts(node.params)
  consts, xs = in_div[:n_consts], [d[1:] for d in in_div[n_consts + n_carry:]]
  carry, outs = _loop_carry(list(in_div[n_consts:n_consts + n_carry]),
                            lambda c: run(body, [*consts, *c, *xs]))
  return [*carry, *((1, *d) for d in outs[n_carry:])]


def _while_body(node, in_div, run: Run) -> list[Divisors]:
  cond, body = node.subprograms
  n_cond, n_body = node.params["cond_nconsts"], node.params["body_nconsts"]
  body_consts = in_div[n_cond:n_cond + n_body]
  carry, _ = _loop_carry(list(in_div[n_cond + n_body:]),
                         lambda c: run(body, [*body_consts, *c]))
  run(cond, [*in_div[:n_cond], *carry])
  return carry


def _cond_branches(node, in_div, run: Run) -> list[Divisors]:
  outs = [run(branch, in_div[1:]) for branch in node.subprograms]   # (operand 0: the index)
  least = outs[0]
  for other in outs[1:]:
    least = _least(least, other)
  return least


BODY_RULES: dict[str, Callable[[Node, Sequence[Divisors], Run], list[Divisors]]] = {
    "scan": _scan_body, "while": _while_body, "cond": _cond_branches,
}


Feeds = list[tuple[int, int, bool]]   # (operand, body input it becomes, sliced by a scan)


def _scan_feeds(node) -> list[tuple[Program, Feeds]]:
  from jax_symmem._src import tracing   # (tracing imports this module)
  (body,) = node.subprograms
  scanned = sum(tracing.scan_counts(node.params))
  return [(body, [(k, k, k >= scanned) for k in range(len(node.inputs))])]


def _while_feeds(node) -> list[tuple[Program, Feeds]]:
  cond, body = node.subprograms
  n_cond, n_body = node.params["cond_nconsts"], node.params["body_nconsts"]
  carry = range(n_cond + n_body, len(node.inputs))
  return [(cond, [(k, k, False) for k in range(n_cond)]
           + [(k, n_cond + i, False) for i, k in enumerate(carry)]),
          (body, [(k, k - n_cond, False) for k in range(n_cond, n_cond + n_body)]
           + [(k, n_body + i, False) for i, k in enumerate(carry)])]


def _cond_feeds(node) -> list[tuple[Program, Feeds]]:
  return [(b, [(k, k - 1, False) for k in range(1, len(node.inputs))]) for b in node.subprograms]


# How a node's operands become its bodies' inputs.
BODY_OPERANDS = {"scan": _scan_feeds, "while": _while_feeds, "cond": _cond_feeds}


SHARDING_RULES.update({
    "dot_general": _dot_general,
    "reduce_sum": _reduce, "reduce_max": _reduce, "reduce_min": _reduce, "reduce_prod": _reduce,
    "argmax": _reduce, "argmin": _reduce, "reduce_and": _reduce, "reduce_or": _reduce,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "sharding_constraint": _sharding_constraint,
    "shard_map": _shard_map,
    "gather": _gather,
    **{name: _scatter for name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul",
                                   "scatter-min", "scatter-max")},
})


def argument_divisors(in_shardings, dyn_args) -> list[Divisors] | None:
  """Per-leaf divisors of the dynamic arguments: `in_shardings` (a prefix tree of the
  arguments, as in `jax.jit`) where given, otherwise each array's own sharding; None
  where neither names a mesh (a shard_map in the step then splits what it reads:
  `propagate`)."""
  leaves = jax.tree_util.tree_leaves(tuple(dyn_args))
  if in_shardings is None:
    shardings = [getattr(x, "sharding", None) for x in leaves]
    if not any(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
      return None
  else:
    shardings = broadcast_prefix(in_shardings, tuple(dyn_args))
  return [spec_divisors(s, len(getattr(x, "shape", ()))) for s, x in zip(shardings, leaves)]


def broadcast_prefix(prefix, tree) -> list:
  """One entry of the prefix tree `prefix` per leaf of `tree` (jax.jit's rule)."""
  is_sharding = lambda x: x is None or isinstance(x, jax.sharding.Sharding)
  prefix_leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=is_sharding)
  subtrees = prefix_def.flatten_up_to(tree)
  out = []
  for p, sub in zip(prefix_leaves, subtrees):
    out.extend([p] * len(jax.tree_util.tree_leaves(sub)))
  return out
