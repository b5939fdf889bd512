"""The symbolic shape graph: every value's dims and bytes as exact polynomials.

Built from a `TracedProgram`: each value's shape becomes a tuple of `Poly`, its
size in bytes `itemsize * prod(dims)`. Op semantics add relations between dims
(a reshape keeps the element count, a dot_general's contracting dims are equal,
a concatenate sums its inputs along the axis, ...), collected by per-primitive
rules in `RELATION_RULES`. JAX's shape inference already states most of them as
identities; a relation that is not an identity under the user's constraints is a
new fact and is added to the graph's constraints, as the paper's shape graph does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from jax_symmem._src import compare as compare_lib
from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import sharding
from jax_symmem._src.poly import Poly, product
from jax_symmem._src.ir import Const, Node, Program
from jax_symmem._src.tracing import TracedProgram


def itemsize(aval: Any) -> int:
  """Bytes per element of an aval; tokens and other non-arrays take none."""
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return 0
  impl = getattr(dtype, "_impl", None)   # extended dtypes, e.g. PRNG keys
  if impl is not None and hasattr(impl, "key_shape"):
    return int(np.prod(impl.key_shape)) * 4
  return int(np.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class ValueInfo:
  id: int
  dims: tuple[Poly, ...]
  dtype: str
  bytes: Poly
  primitive: str | None   # producer primitive; None for program inputs
  source: str             # producer's source line ("" for inputs)
  itemsize: int = 0       # bytes per element

  def shape_str(self) -> str:
    return f"{self.dtype}[{', '.join(str(d) for d in self.dims)}]"


@dataclasses.dataclass(frozen=True)
class Relation:
  """`lhs == rhs` implied by a node's semantics."""
  kind: str
  lhs: Poly
  rhs: Poly
  source: str


# --- relation rules: (node, input dims, output dims) -> [(kind, lhs, rhs)] ---------

RelationRule = Callable[[Node, Sequence[tuple[Poly, ...] | None], Sequence[tuple[Poly, ...]]],
                        Iterable[tuple[str, Poly, Poly]]]
RELATION_RULES: dict[str, RelationRule] = {}


def _rule(*names: str):
  def register(fn):
    for n in names:
      RELATION_RULES[n] = fn
    return fn
  return register


@_rule("reshape")
def _reshape(node, ins, outs):
  yield "reshape keeps the element count", product(ins[0]), product(outs[0])


@_rule("broadcast_in_dim")
def _broadcast(node, ins, outs):
  for i, j in enumerate(node.params["broadcast_dimensions"]):
    if ins[0][i] != Poly.const(1):
      yield "broadcast keeps mapped dims", ins[0][i], outs[0][j]


@_rule("concatenate")
def _concatenate(node, ins, outs):
  axis = node.params["dimension"]
  yield "concatenate sums the axis", sum((d[axis] for d in ins), Poly.const(0)), outs[0][axis]


@_rule("dot_general")
def _dot_general(node, ins, outs):
  (lc, rc), (lb, rb) = node.params["dimension_numbers"]
  for i, j in zip(lc, rc):
    yield "dot_general contracting dims are equal", ins[0][i], ins[1][j]
  for i, j in zip(lb, rb):
    yield "dot_general batch dims are equal", ins[0][i], ins[1][j]


@_rule("transpose")
def _transpose(node, ins, outs):
  for j, i in enumerate(node.params["permutation"]):
    yield "transpose permutes dims", ins[0][i], outs[0][j]


@_rule("slice")
def _slice(node, ins, outs):
  starts, limits = node.params["start_indices"], node.params["limit_indices"]
  strides = node.params["strides"] or (1,) * len(starts)
  for d, (a, b, k) in enumerate(zip(starts, limits, strides)):
    length = jax_dims.to_poly(b) - jax_dims.to_poly(a)
    yield "slice length", (length + (k - 1)).floordiv(k), outs[0][d]


@_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
       "reduce_and", "reduce_or")
def _reduce(node, ins, outs):
  axes = set(node.params["axes"])
  kept = [d for i, d in enumerate(ins[0]) if i not in axes]
  for a, b in zip(kept, outs[0]):
    yield "reduction keeps other dims", a, b


def _elementwise(node, ins, outs):
  # Operands have the output's rank, or are scalars; a size-1 axis broadcasts.
  for shape in ins:
    if len(shape) == len(outs[0]):
      for a, b in zip(shape, outs[0]):
        if a != Poly.const(1):
          yield "elementwise operands share dims", a, b


for _name in ("add", "sub", "mul", "div", "max", "min", "select_n", "add_any", "pow",
              "atan2", "rem", "and", "or", "eq", "ne", "lt", "le", "gt", "ge"):
  RELATION_RULES[_name] = _elementwise


def _split(values: Mapping[int, "ValueInfo"], divisors: Mapping[int, Sequence[int]]
           ) -> dict[int, "ValueInfo"]:
  """`values` with each dim of size n that `divisors` splits d ways holding ceil(n / d)."""
  def split(n: Poly, d: int) -> Poly:
    if d == 1:
      return n
    coeffs = n.as_dict()
    if all(c % d == 0 for c in coeffs.values()):
      return Poly.from_dict({m: c // d for m, c in coeffs.items()})
    return (n + (d - 1)).floordiv(d)
  out = dict(values)
  for vid, ds in divisors.items():
    info = out.get(vid)
    if info is None or all(d == 1 for d in ds):
      continue
    dims = tuple(split(n, d) for n, d in zip(info.dims, ds))
    out[vid] = dataclasses.replace(info, dims=dims, bytes=Poly.const(info.itemsize) * product(dims))
  return out


# --- the graph -------------------------------------------------------------------------


_BYTES_AT_SHAPES = 4


class ShapeGraph:
  """Sizes of every value of a traced program, with exact comparison."""

  def __init__(self, traced: TracedProgram):
    self.traced = traced
    self.dims: tuple[str, ...] = traced.dims
    values: dict[int, ValueInfo] = {}
    relations: list[Relation] = []
    # (shape, dtype) -> (dims, dtype name, bytes, itemsize): a program has thousands of
    # values but few distinct avals (shared with the graphs `extended` derives).
    self._avals: dict[tuple, tuple] = {}
    # dims -> {value id: bytes there} (`bytes_at`); a graph `extended` derives starts
    # from a copy (it keeps every value of this one as it is, but two graphs extended
    # from one may give the same new id to different values).
    self._bytes_at: dict[tuple, dict[int, int]] = {}
    # kind -> node -> a figure derived from its values (`node_cache`).
    self._node_caches: dict[str, dict] = {}
    # A per-device graph (`per_device`): its arguments' splits, every value's dims before
    # the split and every value's split, for `extended` to split the values a rewrite adds.
    self._per_device: tuple[tuple, Mapping[int, ValueInfo], Mapping] | None = None
    self._collect(traced.program, values, relations)
    self.values: Mapping[int, ValueInfo] = values
    self.constraints, self.relations, self.implied = self._close(traced.constraints, relations)

  # -- construction --
  def _info(self, vid, aval, node: Node | None) -> ValueInfo:
    key = (getattr(aval, "shape", ()), getattr(aval, "dtype", type(aval).__name__))
    described = self._avals.get(key)
    if described is None:
      dims = jax_dims.shape_to_polys(key[0])
      size = Poly.const(itemsize(aval)) * product(dims)
      described = self._avals[key] = (dims, str(key[1]), size, itemsize(aval))
    dims, dtype, size, item = described
    return ValueInfo(vid, dims, dtype, size, node.name if node else None,
                     node.source if node else "", item)

  def _collect(self, program: Program, values, relations, known=()) -> None:
    """Adds the values of `program` not in `known` to `values`, and its relations
    to `relations` unless that is None."""
    for i in program.inputs:
      if i not in known:
        values[i] = self._info(i, program.avals[i], None)
    for node in program.nodes:   # a rewrite may read values of later-appended nodes
      for o in node.outputs:
        if o not in known:
          values[o] = self._info(o, program.avals[o], node)
    for node in program.nodes:
      rule = RELATION_RULES.get(node.name) if relations is not None else None
      if rule is not None:
        ins = [jax_dims.shape_to_polys(x.aval.shape) if isinstance(x, Const)
               else values[x].dims for x in node.inputs]
        outs = [values[o].dims for o in node.outputs]
        for kind, lhs, rhs in rule(node, ins, outs):
          relations.append(Relation(kind, lhs, rhs, node.source))
      for sub in node.subprograms:
        self._collect(sub, values, relations, known)

  @staticmethod
  def _close(cons: constraints_lib.Constraints, relations: list[Relation]):
    """Keeps relations; those that are not identities become constraints."""
    implied: list[Relation] = []
    for r in relations:
      if cons.reduce(r.lhs) != cons.reduce(r.rhs):
        implied.append(r)
    if implied:
      extra = tuple(f"{r.lhs} == {r.rhs}" for r in implied)
      cons = constraints_lib.parse_constraints(cons.source + extra,
                                               variables=[v for v, _, _ in cons.bounds])
    return cons, tuple(relations), tuple(implied)

  def extended(self, program: Program, copies: Mapping[int, int] | None = None) -> "ShapeGraph":
    """This graph plus the values of `program` (e.g. a rewrite that added nodes).

    `copies` maps a new value to the value it is a copy of (a recomputed clone, a
    fenced anchor): it takes that value's dims and bytes, so a per-device graph
    (`per_device`) keeps counting one shard of it.
    """
    new = object.__new__(ShapeGraph)
    new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_distinct_sizes"})
    values = dict(self.values)
    fresh: dict[int, ValueInfo] = {}
    new._collect(program, fresh, None, known=self.values)
    if self._per_device is not None and fresh:
      # Split as the program propagates them: a rewritten scan's new stacked results and
      # body values (a copy keeps its original's split below).
      arguments, whole, known = self._per_device
      whole = {**whole, **fresh}
      divisors = sharding.propagate(program, arguments, lambda v: whole[v].dims, known=known)
      fresh = _split(fresh, divisors)
      new._per_device = (arguments, whole, divisors)
    for vid, info in fresh.items():
      original = values.get((copies or {}).get(vid))
      values[vid] = info if original is None else dataclasses.replace(
          info, dims=original.dims, bytes=original.bytes)
    new.values = values
    new._bytes_at = {k: dict(v) for k, v in self._bytes_at.items()}
    return new

  def node_cache(self, kind: str) -> dict:
    """A cache of per-node figures derived from the values a node reads and writes (a
    control-flow node's working set, a loop body node's FLOPs), keyed by the node.
    Shared with the graphs `extended` derives, in which every node of this graph
    prices the same (its values are theirs too): the remat rounds extend a graph each
    round and re-read the same scans and conds. Not with `per_device`'s graph."""
    return self._node_caches.setdefault(kind, {})

  def bytes_at(self, env: Mapping[str, int], values: Iterable[int]) -> dict[int, int]:
    """{value id: its bytes at the complete dims `env`} for `values`, each distinct
    polynomial evaluated once. Remembered for the few most recently asked dims (the
    remat rounds ask at one shape 24 times, mostly for the same values)."""
    key = tuple(sorted(env.items()))
    known = self._bytes_at.pop(key, None)
    if known is None:
      known = {}
      while len(self._bytes_at) >= _BYTES_AT_SHAPES:
        self._bytes_at.pop(next(iter(self._bytes_at)))
    self._bytes_at[key] = known
    # id of a value's bytes as described (values of one aval share the object: a Poly's
    # hash is a Python call) -> those bytes at env
    evaluated: dict[int, int] = {}
    out = {}
    for v in values:
      x = known.get(v)
      if x is None:
        p = id(self.values[v].bytes)
        x = evaluated.get(p)
        if x is None:
          x = evaluated[p] = self.bytes(v).evaluate(env)
        known[v] = x
      out[v] = x
    return out

  def per_device(self, divisors: Mapping[int, Sequence[int]]) -> "ShapeGraph":
    """This graph with each value's bytes per device: a dim of size n split d ways
    (`divisors[value_id][dim]`, from `sharding.propagate`) holds ceil(n / d). The graphs
    it `extended`s split the values a rewrite adds as the program propagates them."""
    new = object.__new__(ShapeGraph)
    new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_distinct_sizes"})
    new._bytes_at = {}   # values' bytes change here
    new._node_caches = {}
    new.values = _split(self.values, divisors)
    inputs = self.traced.program.inputs
    new._per_device = (tuple(divisors.get(v, (1,) * len(self.values[v].dims)) for v in inputs),
                       self.values, dict(divisors))
    return new

  # -- queries --
  def bytes(self, value: int | Poly) -> Poly:
    """Symbolic bytes of a value id (reduced by the constraints)."""
    p = self.values[value].bytes if isinstance(value, int) else value
    return self.constraints.reduce(p)

  def compare(self, a: int | Poly | str, b: int | Poly | str) -> compare_lib.Ordering:
    """Compares two values' byte sizes (value ids) or two size expressions."""
    pa = self.bytes(a) if isinstance(a, int) and a in self.values else jax_dims.to_poly(a)
    pb = self.bytes(b) if isinstance(b, int) and b in self.values else jax_dims.to_poly(b)
    return compare_lib.compare_polys(pa, pb, self.constraints)

  def evaluate(self, p: int | Poly, **dims: int) -> int:
    """Exact value of a size (value id or Poly) at concrete dims."""
    poly = self.values[p].bytes if isinstance(p, int) else p
    env = self.constraints.complete(dims)
    return poly.evaluate(env)

  def largest(self, n: int = 10, **dims: int) -> list[ValueInfo]:
    """The n largest values at the given dims (default: the largest allowed dims), which
    must meet the constraints (`TracedProgram.check_dims`)."""
    if dims:
      self.traced.check_dims(dims)
    env = dims or self.max_dims()
    return sorted(self.values.values(), key=lambda v: -self.evaluate(v.bytes, **env))[:n]

  def max_dims(self) -> dict[str, int]:
    """The largest allowed value of every bounded dim, a bound that general inequalities
    imply included (`Constraints.planning_bounds`; unbounded dims: their lower bound).

    Where a general inequality cuts that corner off ("b*s <= 8192"), no call has it:
    the planner still plans there first (`remat._smaller_shapes`), reports use
    `report_dims`."""
    return {v: (hi if hi is not None else lo) for v, lo, hi in self.constraints.planning_bounds()}

  def report_dims(self) -> dict[str, int]:
    """The dims reports evaluate sizes at: `max_dims`, or where general inequalities cut
    it off, the allowed corner of the cut where the values take the most bytes in all."""
    corners = self.constraints.cut_corners()
    if not corners:
      return self.max_dims()
    ids = list(self.values)
    return max(corners, key=lambda c: sum(
        self.bytes_at(self.constraints.complete(c), ids).values()))

  @functools.cached_property
  def _distinct_sizes(self) -> int:
    return len({self.bytes(v.id) for v in self.values.values()})

  def stats(self) -> dict[str, int]:
    return {
        "values": len(self.values),
        "nodes": sum(1 for _ in self.traced.program.walk()),
        "symbols": len(self.dims),
        "constraints": len(self.traced.constraints.source),
        "relations": len(self.relations),
        "implied_relations": len(self.implied),
        "distinct_size_expressions": self._distinct_sizes,
    }
