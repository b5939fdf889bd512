"""The symbolic memory model: liveness, per-step memory impact, and the peak.

For a program, an order of its top-level nodes and the arguments the caller
donates, every step's bytes are exact polynomials over the dims:

* arguments are live from the start and stay live (the caller holds them),
  unless donated, in which case they die after their last use;
* a node allocates all its outputs (an output nobody reads dies right after the
  node: dead on arrival), and frees each operand whose last use it was, unless
  the operand is a program output or a held argument;
* an output that aliases an operand (`ALIAS_RULES`) allocates nothing and keeps
  the operand's buffer alive as long as either is live;
* a control-flow node (scan, while, cond, shard_map) also needs its body's working set
  while it runs: the body's own modeled peak above the body's inputs
  (`Step.transient`); so does a random draw, whose counters XLA holds beside its
  result (`WORKING_SET_RULES`).

This is exactly what the reference executor does when it runs the program op by
op and deletes every array after its last use (DESIGN.md F7); tests check the
two agree. The peak is `max` over steps of `live_during`; which step attains it
can depend on the shape, so `Peak` keeps every step that is the maximum
somewhere in the allowed box, pruned with exact comparisons.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from jax_symmem._src import compare as compare_lib
from jax_symmem._src.poly import ZERO, Poly, product
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.ir import Const, Node, Program

# primitive name -> node -> {output index: index of the operand it aliases}.
# Measured in eager execution: `stop_gradient` returns its operand object and
# `random_wrap` / `random_unwrap` views share its buffer; reshape, transpose, copy
# and broadcast_in_dim allocate new buffers. `optimization_barrier` passes its
# operands through: XLA gives each output its operand's buffer (our fences copy
# nothing), and the reference executor runs it as that identity.
ALIAS_RULES: dict[str, Callable[[Node], Mapping[int, int]]] = {
    "stop_gradient": lambda node: {0: 0},
    "random_wrap": lambda node: {0: 0},
    "random_unwrap": lambda node: {0: 0},
    "optimization_barrier": lambda node: {k: k for k in range(len(node.outputs))},
    # Inside a shard_map: marks a value as varying over mesh axes, a type change only
    # (nothing is copied; XLA partitions it away).
    "pvary": lambda node: {k: k for k in range(len(node.outputs))},
}


# JAX's Threefry (`jax_threefry_partitionable`, the default since jax 0.5) draws each
# element from a pair of 32-bit counter words: XLA holds both counter arrays and the
# next round's pair while the draw runs (XLA:CPU: a rolled loop's state and its update;
# measured in the buffer assignment of a dropout step: tests/test_xla_buffers.py), 16
# bytes per element, of which the draw's result takes its own bytes.
DRAW_BYTES_PER_ELEMENT = 16


def elements_at(graph: ShapeGraph, value: int, env: Mapping[str, int]) -> int:
  """The number of elements of `value` at the complete dims `env`."""
  info = graph.values[value]
  return graph.bytes(value).evaluate(env) // info.itemsize if info.itemsize else 0


def _draw_working_set(graph: ShapeGraph, node: Node) -> Poly:
  (out,) = node.outputs
  elements = graph.constraints.reduce(product(graph.values[out].dims))
  return DRAW_BYTES_PER_ELEMENT * elements - graph.bytes(out)


# primitive -> bytes a plain op needs beside its operands and results while it runs, as
# XLA realizes it (a control-flow node's come from its bodies: `transients`).
WORKING_SET_RULES: dict[str, Callable[[ShapeGraph, Node], Poly]] = {
    "random_bits": _draw_working_set,
}


# Nodes whose bodies compute their results straight into the node's output buffers
# (XLA colocates them): a cond's branches, a shard_map's per-device body.
RESULTS_IN_OUTPUTS = frozenset({"cond", "shard_map"})


def has_working_set(node: Node) -> bool:
  """Whether a step of `node` needs bytes beyond its operands and results."""
  return bool(node.subprograms) or node.name in WORKING_SET_RULES


def working_nodes(program: Program) -> tuple[Node, ...]:
  """The nodes of `program` with a working set (`has_working_set`), in node order."""
  return tuple(n for n in program.nodes if has_working_set(n))


def aliased_operands(node: Node) -> Mapping[int, int]:
  """{output index: operand index} of the outputs that share an operand's buffer."""
  rule = ALIAS_RULES.get(node.name)
  if rule is None:
    return {}
  return {k: i for k, i in rule(node).items() if not isinstance(node.inputs[i], Const)}


def buffers(program: Program) -> dict[int, int]:
  """Each value id -> the buffer it lives in: its own id, or the buffer of the operand
  it aliases (`ALIAS_RULES`). Liveness is per buffer."""
  buffer: dict[int, int] = {v: v for v in program.value_ids()}
  buffer.update(_aliases(program))
  return buffer


def _aliases(program: Program) -> dict[int, int]:
  """The values that alias an operand -> the buffer they live in (`buffers`, less the
  values that own theirs: most of a program)."""
  parent: dict[int, int] = {}   # nodes are not listed in dataflow order (rewrites append)
  for node in program.nodes:
    if node.primitive.name in ALIAS_RULES:   # (not `node.name`: a call per node, every round)
      for k, i in aliased_operands(node).items():
        parent[node.outputs[k]] = node.inputs[i]
  roots = {}
  for o in parent:
    root = o
    while root in parent:
      root = parent[root]
    roots[o] = root
  return roots


@dataclasses.dataclass(frozen=True)
class Step:
  """One node in the order and its memory effect (bytes as polynomials)."""
  node: int
  live_before: Poly
  allocated: Poly
  transients: tuple[Poly, ...]   # the node's working set (`transients`): the max of these
  freed: Poly

  @property
  def transient(self) -> Poly:
    """The working set as one polynomial (exact: nested max atoms)."""
    return _max_atom(self.transients)

  @property
  def live_during(self) -> Poly:
    return self.live_before + self.allocated + self.transient

  def live_during_pieces(self) -> tuple[Poly, ...]:
    """`live_during` as polynomials whose max it is, without max atoms."""
    base = self.live_before + self.allocated
    return tuple(base + t for t in self.transients) or (base,)

  @property
  def live_after(self) -> Poly:
    return self.live_before + self.allocated - self.freed

  @property
  def impact(self) -> Poly:
    """Bytes allocated minus bytes freed: the scheduler's memory impact."""
    return self.allocated - self.freed


def _max_atom(polys: Sequence[Poly]) -> Poly:
  if not polys:
    return ZERO
  return functools.reduce(lambda a, b: a.max(b), polys)


@dataclasses.dataclass(frozen=True, eq=False)
class Peak:
  """max over candidate steps of their live bytes: exact, piecewise over the dims."""
  candidates: tuple[tuple[int, Poly], ...]   # (position in order, live bytes)
  graph: ShapeGraph

  def evaluate(self, **dims: int) -> int:
    return self.argmax(**dims)[1]

  def argmax(self, **dims: int) -> tuple[int, int]:
    """(position in the order, bytes) of the peak at concrete dims."""
    env = self.graph.constraints.complete(dims)
    vals = [(pos, p.evaluate(env)) for pos, p in self.candidates]
    return max(vals, key=lambda pv: (pv[1], -pv[0]))

  def __str__(self) -> str:
    if len(self.candidates) == 1:
      return str(self.candidates[0][1])
    # A step may stand more than once (one piece per control-flow working set).
    return "max(" + ", ".join(str(p) for _, p in self.candidates) + ")"


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryProfile:
  """Liveness and memory of one order of a program."""
  graph: ShapeGraph
  program: Program
  order: tuple[int, ...]
  arguments: Poly           # bytes live before the first step
  steps: tuple[Step, ...]

  @functools.cached_property
  def peak(self) -> Peak:
    return _peak(self.graph, [(i, p) for i, s in enumerate(self.steps)
                              for p in s.live_during_pieces()] or [(0, self.arguments)])

  def peak_bytes(self, *, include_transients: bool = True, **dims: int) -> int:
    """Exact modeled peak at concrete dims.

    `include_transients=False` leaves out control-flow bodies' working sets:
    the op-level figure that the reference executor tracks (it runs a scan or
    cond as one dispatch and sees only its operands and results).
    """
    return max([self.arguments.evaluate(self.graph.constraints.complete(dims))] +
               self.live_bytes(include_transients=include_transients, **dims))

  def live_bytes(self, *, include_transients: bool = True, **dims: int) -> list[int]:
    """Live bytes while each step runs, at concrete dims."""
    env = self.graph.constraints.complete(dims)
    return [(s.live_during if include_transients else s.live_before + s.allocated).evaluate(env)
            for s in self.steps]

  def timeline(self, **dims: int) -> str:
    """A readable table: step, op, source line, live bytes at those dims."""
    env = self.graph.constraints.complete(dims)
    peak = self.peak_bytes(**dims)
    rows = [f"{'step':>5}  {'op':<22} {'live MiB':>10}  {'alloc MiB':>10}  source"]
    for k, (i, s) in enumerate(zip(self.order, self.steps)):
      node = self.program.nodes[i]
      live = s.live_during.evaluate(env)
      mark = "  <- peak" if live == peak else ""
      rows.append(f"{k:>5}  {node.name:<22} {live / 2**20:>10.2f}  "
                  f"{s.allocated.evaluate(env) / 2**20:>10.2f}  {node.source}{mark}")
    return "\n".join(rows)


def _value_bytes(graph: ShapeGraph, v) -> Poly:
  return ZERO if isinstance(v, Const) else graph.bytes(v)


def profile(graph: ShapeGraph, program: Program | None = None, order: Sequence[int] | None = None,
            donated: Iterable[int] = ()) -> MemoryProfile:
  """The memory profile of `program` (default: the traced program) in `order`.

  Args:
    graph: the shape graph that gives every value's bytes.
    program: a program or subprogram of `graph.traced`.
    order: a permutation of node indices (default: trace order).
    donated: positions of arguments the caller donates (freed after last use).
  """
  program = graph.traced.program if program is None else program
  order = _check_order(program, order)
  arguments, raw = _simulate(program, order, donated, graph.bytes, ZERO,
                             lambda node: transients(graph, node))
  steps = tuple(Step(i, live, alloc, trans, freed) for i, live, alloc, trans, freed in raw)
  return MemoryProfile(graph, program, order, arguments, steps)


def peak_at(graph: ShapeGraph, env: Mapping[str, int], program: Program | None = None,
            order: Sequence[int] | None = None, donated: Iterable[int] = ()) -> int:
  """`profile(...).peak_bytes(**env)` computed with integers: fast enough for search.

  The scheduler's local search calls this thousands of times per program with
  the same (graph, program, dims) and a different order, so everything that does
  not depend on the order is evaluated once (`_IntTables`) and cached.
  """
  program = graph.traced.program if program is None else program
  return order_tables(graph, env, program, donated).peak(_check_order(program, order))


def peak_step(graph: ShapeGraph, env: Mapping[str, int], program: Program | None = None,
              order: Sequence[int] | None = None, donated: Iterable[int] = ()) -> tuple[int, int]:
  """(position in the order, bytes) of the first step at the peak at concrete dims,
  as `profile(...).peak.argmax` locates it, computed with integers."""
  program = graph.traced.program if program is None else program
  tables, order = order_tables(graph, env, program, donated), _check_order(program, order)
  if not order:
    return 0, tables.arguments
  steps = tables.step_bytes(order)
  k = int(np.argmax(steps)) if isinstance(steps, np.ndarray) else steps.index(max(steps))
  return k, int(steps[k])


def order_tables(graph: ShapeGraph, env: Mapping[str, int], program: Program | None = None,
                 donated: Iterable[int] = ()) -> "_IntTables":
  """The order-independent integer tables behind `peak_at` (for incremental searches)."""
  program = graph.traced.program if program is None else program
  return _int_tables(graph, program, graph.constraints.complete(dict(env)), frozenset(donated))


class _IntTables:
  """Order-independent integer data of `_simulate` for one (graph, program, dims, donated).

  `peak(order)` is then a few numpy passes: a buffer is freed at the last
  position that reads it (unless pinned), an output nobody reads is freed where
  it is made, and live bytes are a running sum. Sizes are int64; a program whose
  bytes could overflow that is simulated with Python integers instead.
  """

  def __init__(self, graph: ShapeGraph, program: Program, env: Mapping[str, int],
               donated: frozenset):
    layout = _buffer_layout(program, donated)
    # Python ints of every value and control-flow node; no reference to `graph` is
    # kept (the graph reaches the traced call and its arrays), so the cache below never
    # keeps a traced call alive.
    value_bytes = graph.bytes_at(env, program.value_ids())
    node_trans = {n.index: transient_at(graph, n, env) for n in layout.working}
    self.program, self.donated, self.layout = program, donated, layout
    self.size_of = value_bytes.__getitem__
    self.trans_of = lambda node: node_trans.get(node.index, 0)
    self.arguments = sum(self.size_of(v) for v in program.inputs)
    owned = [value_bytes[o] for o in layout.owned_value]
    self.exact = (self.arguments + sum(owned) + sum(node_trans.values())
                  < 2**62)   # int64 cannot overflow
    if self.exact:
      n = len(program.nodes)
      self.use_node, self.use_buf = layout.use_node, layout.use_buf
      self.buf_size = np.asarray([value_bytes[b] for b in layout.read_buffers], np.int64)
      self.alloc, self.doa, self.trans = (np.zeros(n, np.int64) for _ in range(3))
      np.add.at(self.alloc, layout.owned_node, owned)
      np.add.at(self.doa, layout.dead_node, [value_bytes[o] for o in layout.dead_value])
      for i, t in node_trans.items():
        self.trans[i] = t

  def peak(self, order: Sequence[int]) -> int:
    """max(arguments, live + allocated + transient at every step), as `_simulate` counts."""
    if not order:
      return self.arguments
    steps = self.step_bytes(order)
    return int(max(self.arguments, steps.max() if isinstance(steps, np.ndarray) else max(steps)))

  def step_bytes(self, order: Sequence[int]) -> Sequence[int]:
    """Live + allocated + transient bytes while each step of `order` runs."""
    if not self.exact:
      _, raw = _simulate(self.program, order, self.donated, self.size_of, 0,
                         lambda node: (self.trans_of(node),))
      return [live + alloc + trans[0] for _, live, alloc, trans, _ in raw]
    n = len(order)
    order = np.asarray(order, np.int64)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    last = np.zeros(len(self.buf_size), np.int64)
    np.maximum.at(last, self.use_buf, pos[self.use_node])
    freed = np.zeros(n, np.int64)
    np.add.at(freed, last, self.buf_size)
    alloc = self.alloc[order]
    live_after = self.arguments + np.cumsum(alloc - freed - self.doa[order])
    live_before = np.concatenate([[self.arguments], live_after[:-1]])
    return live_before + alloc + self.trans[order]


@dataclasses.dataclass(frozen=True)
class _BufferLayout:
  """What `_IntTables` needs of a program that no dims change: which node reads which
  unpinned buffer, which outputs own a buffer, which die where they are made."""
  read_buffers: tuple[int, ...]     # unpinned buffers some node reads, by index
  use_node: np.ndarray              # (node, buffer index) of every read
  use_buf: np.ndarray
  owned_node: np.ndarray            # (node, value) of every output owning a buffer
  owned_value: tuple[int, ...]
  dead_node: np.ndarray             # (node, value) of those that nothing reads
  dead_value: tuple[int, ...]
  working: tuple[Node, ...]         # nodes with a working set (`has_working_set`)
  num_nodes: int

  @functools.cached_property
  def reads(self) -> tuple[tuple[int, ...], ...]:
    """node -> the indices of the unpinned buffers it reads."""
    reads: list[list[int]] = [[] for _ in range(self.num_nodes)]
    for i, b in zip(self.use_node.tolist(), self.use_buf.tolist()):
      reads[i].append(b)
    return tuple(map(tuple, reads))


def _buffer_layout(program: Program, donated: frozenset) -> _BufferLayout:
  key = (id(program), donated)
  hit = _LAYOUTS.get(key)
  if hit is not None and hit[0] is program:
    return hit[1]
  # Each planning round lays out its program afresh (10^4 nodes for a 1B step): its
  # reads are deduplicated and numbered with numpy.
  alias = _aliases(program)
  root = alias.get
  nodes = program.nodes
  pinned = {root(x, x) for x in program.outputs if not isinstance(x, Const)}
  pinned |= {root(v, v) for k, v in enumerate(program.inputs) if k not in donated}
  node_of, buf = program.reads
  if alias:
    buf = _map_ids(buf, alias)
  if pinned:
    keep = ~np.isin(buf, np.fromiter(pinned, np.int64, len(pinned)))
    node_of, buf = node_of[keep], buf[keep]
  read_buffers, use_buf = np.unique(buf, return_inverse=True)
  use_buf = use_buf.reshape(-1)
  # One (node, buffer) pair per buffer a node reads, however often it reads it.
  pair = np.unique(node_of * len(read_buffers) + use_buf)
  use_node, use_buf = pair // max(len(read_buffers), 1), pair % max(len(read_buffers), 1)
  out_node, out_val = program.writes
  own = out_val == _map_ids(out_val, alias) if alias else slice(None)
  owned_node, owned_value = out_node[own], out_val[own]
  dead = ~np.isin(owned_value, read_buffers)   # read_buffers are unpinned: leave out pinned
  if pinned:
    dead &= ~np.isin(owned_value, np.fromiter(pinned, np.int64, len(pinned)))
  layout = _BufferLayout(tuple(read_buffers.tolist()), use_node, use_buf,
                         owned_node, tuple(owned_value.tolist()),
                         owned_node[dead], tuple(owned_value[dead].tolist()),
                         working_nodes(program), len(nodes))
  _remember(_LAYOUTS, key, (program, layout))
  return layout


def _map_ids(ids: np.ndarray, mapping: Mapping[int, int]) -> np.ndarray:
  """`ids` with each id that is a key of `mapping` replaced by its value."""
  keys = np.fromiter(mapping, np.int64, len(mapping))
  sort = np.argsort(keys)
  keys, values = keys[sort], np.fromiter(mapping.values(), np.int64, len(mapping))[sort]
  at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
  return np.where(keys[at] == ids, values[at], ids)


_LAYOUTS: dict = {}
_INT_TABLES: dict = {}
_INT_TABLES_MAX = 64


def _int_tables(graph: ShapeGraph, program: Program, env: Mapping[str, int],
                donated: frozenset) -> _IntTables:
  key = (id(graph), id(program), tuple(sorted(env.items())), donated)
  hit = _INT_TABLES.pop(key, None)
  if hit is None or hit[0]() is not graph or hit[1] is not program:
    hit = (weakref.ref(graph), program, _IntTables(graph, program, env, donated))
  _remember(_INT_TABLES, key, hit)
  return hit[2]


def _remember(cache: dict, key, value) -> None:
  """Stores `value` as the most recently used entry, dropping the oldest past the limit."""
  cache[key] = value
  while len(cache) > _INT_TABLES_MAX:
    cache.pop(next(iter(cache)))


def _check_order(program: Program, order) -> tuple[int, ...]:
  order = tuple(range(len(program.nodes))) if order is None else tuple(order)
  if sorted(order) != list(range(len(program.nodes))):
    raise ValueError("order must be a permutation of the program's node indices")
  return order


def _simulate(program: Program, order: Sequence[int], donated: Iterable[int], size, zero,
              transient_of):
  """Liveness simulation, generic in the number type (Poly or int)."""
  donated = frozenset(donated)
  buffer = buffers(program)
  # A buffer dies at the last position where any value on it is used.
  last_use: dict[int, int] = {}
  for pos, i in enumerate(order):
    for x in program.nodes[i].operands:
      last_use[buffer[x]] = pos
  pinned = {buffer[x] for x in program.outputs if not isinstance(x, Const)}
  pinned |= {buffer[v] for k, v in enumerate(program.inputs) if k not in donated}

  arguments = sum((size(v) for v in program.inputs), zero)
  live, steps = arguments, []
  for pos, i in enumerate(order):
    node = program.nodes[i]
    allocated = sum((size(o) for o in node.outputs if buffer[o] == o), zero)
    dying = {buffer[x] for x in node.operands
             if last_use.get(buffer[x]) == pos and buffer[x] not in pinned}
    dying |= {o for o in node.outputs if buffer[o] == o and o not in last_use and o not in pinned}
    freed = sum((size(b) for b in sorted(dying)), zero)
    steps.append((i, live, allocated, transient_of(node), freed))
    live = live + allocated - freed
  return arguments, steps


def transients(graph: ShapeGraph, node: Node) -> tuple[Poly, ...]:
  """A control-flow node's working set above its bodies' inputs, as the polynomials
  whose max it is (pruned: each is the largest somewhere); a plain op's by
  `WORKING_SET_RULES` (a random draw's counters), else ().

  One iteration's temporaries at a time: XLA runs a loop body in place, so the
  working set is the body's own peak above what the body receives, whichever
  body (scan/while body, while condition, cond branch) is largest. A cond
  branch computes its results into the cond's output buffers (XLA colocates
  them), which the cond's step already allocates: they count once, there.
  """
  if not has_working_set(node):
    return ()
  cache = graph.node_cache("transients")
  if node not in cache and not node.subprograms:
    cache[node] = (WORKING_SET_RULES[node.name](graph, node),)
  if node not in cache:
    pieces = []
    for body in node.subprograms:
      prof = profile(graph, body)
      made = _made_so_far(graph.bytes, ZERO, node, body)
      steps = [p - made[k] for k, s in enumerate(prof.steps) for p in s.live_during_pieces()]
      pieces += [p - prof.arguments for p in steps or [prof.arguments]]
    cache[node] = tuple(p for _, p in _prune(graph, list(enumerate(pieces))))
  return cache[node]


def transient_at(graph: ShapeGraph, node: Node, env: Mapping[str, int]) -> int:
  """`transient(graph, node)` at the complete dims `env`, computed with integers
  (the remat rounds price every rewritten scan and cond at one shape)."""
  if not has_working_set(node):
    return 0
  cache = graph.node_cache("transient at " + repr(sorted(env.items())))
  if node not in cache and not node.subprograms:
    cache[node] = transients(graph, node)[0].evaluate(env)
  if node not in cache:
    working = []
    for body in node.subprograms:
      tables = order_tables(graph, env, body)
      steps = tables.step_bytes(tuple(range(len(body.nodes))))
      made = _made_so_far(tables.size_of, 0, node, body)
      working += [int(b) - m - tables.arguments for b, m in zip(steps, made)] or [0]
    cache[node] = max(working)
  return cache[node]


def _made_so_far(size, zero, node: Node, body: Program) -> list:
  """Per step of a control-flow `body` in trace order, the bytes of its results made
  up to there that the node's own outputs already hold: a cond branch's or a
  shard_map body's results (results that own a buffer; an operand passed through is
  the caller's). Zero for loop bodies, whose results are the next iteration's operands."""
  if node.name not in RESULTS_IN_OUTPUTS:
    return [zero] * len(body.nodes)
  buffer = buffers(body)
  results = {x for x in body.outputs if not isinstance(x, Const) and buffer[x] == x}
  results -= set(body.inputs)
  made, total = [], zero
  for n in body.nodes:
    total = total + sum((size(o) for o in n.outputs if o in results), zero)
    made.append(total)
  return made


def transient(graph: ShapeGraph, node: Node) -> Poly:
  """`transients` as one polynomial (exact, with max atoms); 0 for plain ops."""
  return _max_atom(transients(graph, node))


def sample_points(graph: ShapeGraph) -> list[dict[str, int]]:
  cons = graph.constraints
  axes = []
  for v, lo, hi in cons.bounds:
    top = hi if hi is not None else max(lo, 4096)
    axes.append([(v, x) for x in sorted({lo, (lo + top) // 2, top, max(lo, top // 8)})])
  points = [dict(p) for p in itertools.product(*axes)]
  return [cons.complete(p) for p in points if cons.allows(p)] or [
      cons.complete({v: lo for v, lo, _ in cons.bounds})]


def _prune(graph: ShapeGraph, candidates: list[tuple[int, Poly]]) -> list[tuple[int, Poly]]:
  """Drops candidates proven <= another candidate; keeps the rest (the peak's pieces)."""
  unique: dict[Poly, int] = {}
  for pos, p in candidates:
    unique.setdefault(p, pos)
  cands = [(pos, p) for p, pos in unique.items()]
  if len(cands) <= 1:
    return cands
  points = sample_points(graph)
  values = {p: [p.evaluate(env) for env in points] for _, p in cands}
  leaders: dict[Poly, int] = {}
  for k in range(len(points)):
    pos, p = max(cands, key=lambda c: (values[c[1]][k], -c[0]))
    leaders[p] = pos
  kept = [(pos, p) for p, pos in leaders.items()]
  # q can dominate p only if q >= p at every allowed sample point (compare is
  # sound): checking that first skips most exact comparisons, same result.
  allowed = [k for k, env in enumerate(points) if graph.constraints.violation(env) is None]
  def may_dominate(q, p):
    vq, vp = values[q], values[p]
    return all(vq[k] >= vp[k] for k in allowed)
  for pos, p in cands:
    if p in leaders:
      continue
    dominated = any(may_dominate(q, p) and compare_lib.compare_polys(q, p, graph.constraints).kind
                    in (compare_lib.GE, compare_lib.EQ)
                    for _, q in kept)
    if not dominated:
      kept.append((pos, p))
  return sorted(kept, key=lambda c: c[0])


def _peak(graph: ShapeGraph, candidates: list[tuple[int, Poly]]) -> Peak:
  return Peak(tuple(_prune(graph, candidates)), graph)
