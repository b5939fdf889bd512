"""Rematerialization planning: eviction candidates and their regeneration subgraphs.

On a scheduled program, a candidate is a value that is live across the peak but
not used there: produced before the peak step, next used after it. Its
regeneration subgraph recomputes it, right before that later use, from anchors:
values that are live at that point anyway (held arguments, constants, values
whose own lifetime spans the use and that are never evicted). Evicting it saves
its bytes across the peak, at the cost of the subgraph's FLOPs; both are exact
polynomials over the dims. A regeneration may cost at most its share, by bytes, of
the step's FLOPs (no node count: `plan`). Regions are ranked by FLOPs per byte saved.

`apply_regions` rewrites the program: the evicted value's later uses read a
recomputed copy, computed by cloned nodes whose anchors first pass through an
optimization barrier together with a trigger, so XLA cannot hoist the
recomputation back next to the original or merge the two (with
`cse_barrier_expander` disabled, DESIGN.md F1). As JAX's own remat fences a
layer's recomputation with the cotangent flowing into it, the trigger is a value
the backward computes late (the deepest one still read from the consumer on), and
those later reads take its fenced copy, so XLA's simplifier cannot drop it. Where a
later round leaves that copy read by dead code only (the producer of a value it
evicts), the fence takes a new trigger (`_revive_triggers`).
Regions with the same consumer share one barrier and one recomputation: a node
two of them need is recomputed once.

A layer's residuals are offered as one candidate (`RegionGroup`, unless `LAYER_GROUPS`
is off), in place of each alone: regenerated together behind one fence from the layer's
input, as `jax.checkpoint` on the layer does (experiments/RESULTS.md, "Models as people write
them"). So a round evicts a whole layer or values outside any layer, and its recomputation is per-layer
checkpointing's on the layers it evicts. The layers' inputs stay while a layer is left to
evict whole; then each is offered alone, regenerated through its layer.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import fractions
import functools
import os
from typing import Iterable, Mapping, Sequence

from jax import lax
import numpy as np

from jax_symmem._src import body_remat
from jax_symmem._src import collector
from jax_symmem._src import loop_remat
from jax_symmem._src import memory
from jax_symmem._src import progress
from jax_symmem._src import schedule as schedule_lib
from jax_symmem._src import tracing
from jax_symmem._src.decider import Decider, DecisionCounts
from jax_symmem._src.flops import FLOP_RULES, at_dims, flops, scan_length  # noqa: F401  (re-exported)
from jax_symmem._src.poly import ZERO, Poly
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.ir import Const, Node, Program, layer_scope, live_nodes, source_label
from jax_symmem._src.layers import layer_calls

# --- per-primitive rules ------------------------------------------------------------

# Never recomputed: effects, collectives, stateful randomness, and control flow (its
# bodies are not cloned here). JAX's functional random ops (random_bits, threefry2x32,
# the key ops) are recomputed: the same key gives the same bits, as under
# jax.checkpoint, so a dropout mask is regenerated from its key rather than kept.
# rng_bit_generator stays out, as in loop_remat.NOT_REPLAYABLE.
NOT_RECOMPUTABLE = frozenset({
    "rng_bit_generator", "rng_uniform",
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
    "psum_scatter", "axis_index", "scan", "while", "cond", "io_callback", "pure_callback",
    "debug_callback", "optimization_barrier", "custom_call",
})


def recomputable(node: Node) -> bool:
  return not node.effects and node.name not in NOT_RECOMPUTABLE and not node.subprograms


# --- plan -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Region:
  """Evict `value` after its last use before the peak; regenerate it before `consumer`."""
  value: int
  consumer: int                 # node index of the first use after the peak
  nodes: tuple[int, ...]        # regeneration subgraph, in topological order
  anchors: tuple[int, ...]      # values it reads, live at the consumer anyway
  saved: Poly                   # bytes no longer live across the peak
  cost: Poly                    # FLOPs of the regeneration
  source: str                   # where the value was produced

  def describe(self, graph: ShapeGraph, **dims: int) -> str:
    at = at_dims(graph, self.saved, self.cost, dims)
    info = graph.values[self.value]
    where = source_label(self.source, info.primitive)
    return (f"evict {info.shape_str()} from {where}: "
            f"saves {self.saved} B, recompute {len(self.nodes)} op(s) = {self.cost} FLOPs" + at)


@dataclasses.dataclass(frozen=True)
class RegionGroup:
  """A layer's residuals evicted together: its regions share one consumer (the layer's
  first use after the peak), so `apply_regions` recomputes the layer once, behind one
  fence, from values kept live there (its input, its weights), as `jax.checkpoint` on the
  layer does. Ranked as one candidate: the bytes of all, the FLOPs of their union."""
  regions: tuple[Region, ...]   # or body_remat.BodyEviction: a layer of a scan body
  saved: Poly
  cost: Poly
  layer: str                    # the layer's scope (`ir.layer_scope`)

  def describe(self, graph: ShapeGraph, **dims: int) -> str:
    at = at_dims(graph, self.saved, self.cost, dims)
    return (f"evict layer {self.layer} ({len(self.regions)} values), recomputed once: "
            f"saves {self.saved} B, recompute {self.cost} FLOPs" + at)


# Candidates whose members (`.regions`) are chosen together or not at all.
GROUPS = (RegionGroup, loop_remat.ResidualGroup)

# Whether the rounds offer a layer's residuals as one `RegionGroup` in place of each alone.
# Alone, each regenerated for its own consumer, the unrolled decoders' rounds were dominated
# by per-layer checkpointing (experiments/round_cost.py: GPT-2's first round within 1.25 x its
# footprint recomputed 1.34 x its FLOPs; with groups 0.55 x). Offered beside the values
# alone, the groups ranked behind them (the model credits values XLA fuses away) and the
# Llama never took one. JAX_SYMMEM_LAYER_GROUPS=0 turns them off (the plans before ff9f0e9).
LAYER_GROUPS = os.environ.get("JAX_SYMMEM_LAYER_GROUPS", "1") != "0"
# A fence whose trigger copy only dead code reads takes a new trigger (`_revive_triggers`);
# JAX_SYMMEM_REVIVE_TRIGGERS=0 leaves it as chosen (the plans before 5a34ec7).
REVIVE_TRIGGERS = os.environ.get("JAX_SYMMEM_REVIVE_TRIGGERS", "1") != "0"
# The rounds after the last one that lowered the peak at a shape it was planned for are
# dropped once planning ends (`plan_rounds`); JAX_SYMMEM_DROP_STALE_ROUNDS=0 keeps them.
DROP_STALE_ROUNDS = os.environ.get("JAX_SYMMEM_DROP_STALE_ROUNDS", "1") != "0"


@dataclasses.dataclass(frozen=True)
class RematPlan:
  regions: tuple[Region, ...]       # ranked: cheapest FLOPs per byte saved first
  order: tuple[int, ...]            # the schedule the plan was made for
  peak_position: int                # the peak step at the shape of interest
  counts: DecisionCounts            # how the ranking's comparisons were decided
  # The bound every region meets at the shape of interest: cost <= this x saved bytes
  # (the step's FLOPs per evictable byte there; see `plan`).
  max_flops_per_byte: fractions.Fraction


def plan(graph: ShapeGraph, order: Sequence[int], *, program: Program | None = None,
         shape_of_interest: Mapping[str, int] | None = None,
         min_fraction: float = 0.002, donated: Iterable[int] = (),
         loops: Mapping[int, "loop_remat.LoopState"] | None = None,
         node_flops: "NodeFlops | None" = None, descend: bool = True,
         layer_groups: bool = False) -> RematPlan:
  """Finds eviction candidates across the peak and their regeneration subgraphs.

  Args:
    graph: the shape graph (extended with `program`'s values if it is a rewrite).
    order: the schedule of `program`.
    program: default the traced top-level program.
    shape_of_interest: where the peak step is located and DEPENDS rankings are
      resolved (default: the largest allowed dims).
    min_fraction: ignore values smaller than this fraction of the peak there.
    node_flops: a node's FLOPs at the shape of interest, cached across the rounds
      of one `plan_rounds` (default: a fresh cache).
    loops: scan pairs (`loop_remat.scan_pairs`) whose stacked residuals are also
      candidates (`loop_remat.LoopEviction`), ranked with the regions.
    descend: where the peak is inside the body of a scan that is not such a pair
      (gradient accumulation), plan that body too (`body_remat.BodyEviction`s).
    layer_groups: offer each layer's residuals as one `RegionGroup`, in place of each
      alone (a value no group takes, outside any layer, is still offered alone).
  """
  program = graph.traced.program if program is None else program
  order = tuple(order)
  tight = dict(shape_of_interest or graph.max_dims())
  env = graph.constraints.complete(tight)
  peak_pos, peak = memory.peak_step(graph, env, program, order, donated)

  # Where each value is made and read, as positions in `order` (numpy: every round
  # plans a whole program afresh, 10^4 nodes for a 1B-parameter step).
  nodes = program.nodes
  node_pos = np.empty(len(order), np.int64)
  node_pos[np.asarray(order, np.int64)] = np.arange(len(order))
  read_node, read_val = program.reads
  write_node, write_val = program.writes
  ids = max(int(read_val.max(initial=-1)), int(write_val.max(initial=-1)),
            max(program.inputs, default=-1)) + 1
  read_pos = node_pos[read_node]
  last_use = np.full(ids, -1, np.int64)
  np.maximum.at(last_use, read_val, read_pos)
  later = read_pos > peak_pos
  next_use = np.full(ids, len(order), np.int64)        # the first use after the peak
  np.minimum.at(next_use, read_val[later], read_pos[later])
  born = np.full(ids, -1, np.int64)
  born[write_val] = node_pos[write_node]
  pos = node_pos.tolist()
  producer = dict(zip(write_val.tolist(), write_node.tolist()))
  inputs = set(program.inputs)
  outputs = {x for x in program.outputs if not isinstance(x, Const)}
  at_peak = set(nodes[order[peak_pos]].operands) if order else set()

  size_at = memory.order_tables(graph, env, program, donated).size_of   # bytes at env
  # Made before the peak, read after it, not read at it (nor a program output): live
  # but unused across the peak. Candidates keep the program's value order.
  spans = (born[write_val] < peak_pos) & (next_use[write_val] < len(order))
  candidates = {v: int(next_use[v]) for v in write_val[spans].tolist()
                if v not in at_peak and v not in outputs
                and size_at(v) >= min_fraction * peak}

  def live_at(v, u) -> bool:
    if v not in producer:   # an argument: held by the caller
      return v in inputs
    return born[v] < u and last_use[v] >= u

  # The bound on a regeneration's cost, in place of a node count: its share, by bytes
  # saved, of the whole step's FLOPs among the values evictable here. Evicting every
  # candidate at its bound would recompute at most one step (the FLOPs at most double;
  # per-layer checkpointing recomputes one forward, about a third: F14). It scales with
  # the step, not with how many ops a model writes: a long chain of cheap ops passes
  # (HF Llama's attention probabilities, 73 ops with the rotary gathers and the mask),
  # a layer's input regenerated through the layers before it soon costs more.
  if node_flops is None or node_flops.env != env:
    node_flops = NodeFlops(env)
  step = node_flops.total(graph, program)
  evictable = sum(size_at(v) for v in candidates)
  through = fenced_originals(program)
  forward = read_pos <= peak_pos
  layers = (_layer_reads(program, candidates, producer, read_node[forward], read_val[forward])
            if layer_groups else None)
  groups = (_layer_groups(graph, program, order, candidates, producer, live_at, inputs, layers,
                          node_flops) if layers is not None else [])
  # While a layer is left to evict whole, the layers' inputs stay, as jax.checkpoint on
  # each layer keeps them; after, each is offered alone (a layer's output regenerated
  # through its layer: checkpoints further apart).
  kept = layers.layer_inputs if groups else frozenset()
  regions = []
  for v, u in candidates.items():
    if v in kept:
      continue
    limit = size_at(v) // 2
    def anchor(a, prefer_recompute):
      """Whether the regeneration of v reads `a` instead of recomputing it."""
      if a in inputs:
        return True
      if not live_at(a, u):
        return False
      if a in kept:
        return True   # it stays: a recomputed copy would only sit beside it
      return not prefer_recompute or size_at(a) <= limit
    sub = _regeneration(program, producer, v, anchor,
                        lambda i: node_flops(graph, program.nodes[i]),
                        size_at(v) * step // max(evictable, 1),   # exact: FLOPs are integers
                        through)
    if sub is None:
      continue
    nodes, anchors = sub
    cost = node_flops.cost(graph, [program.nodes[i] for i in nodes])
    regions.append(Region(v, order[u], tuple(sorted(nodes, key=pos.__getitem__)), anchors,
                          graph.bytes(v), cost, program.nodes[producer[v]].source))
  if groups:
    grouped = {r.value for g in groups for r in g.regions}
    regions = [r for r in regions if r.value not in grouped] + groups
  regions += _loop_candidates(graph, pos, read_val, read_pos, peak_pos, loops or {}, env,
                              min_fraction * peak, inputs, last_use)
  counts = DecisionCounts()
  if descend and order:
    inner, counts = _body_candidates(graph, program, order[peak_pos], tight, env, loops or {},
                                     node_flops, layer_groups)
    regions += inner
  decider = Decider(graph.constraints, env)
  ranked = tuple(_rank(regions, decider))
  return RematPlan(ranked, order, peak_pos, counts + decider.counts,
                   fractions.Fraction(step, max(evictable, 1)))


class NodeFlops:
  """A node's FLOPs, as a polynomial and at one shape, cached by node identity: the
  rounds of a plan share most nodes (a rewrite replaces only the nodes it renames)."""

  def __init__(self, env: Mapping[str, int]):
    self.env, self._cache = dict(env), {}
    self._last: tuple[tuple[Node, ...], int] = ((), 0)   # a program's nodes, their total
    self._costs: dict[tuple[int, ...], tuple[tuple[Node, ...], Poly]] = {}

  def _get(self, graph: ShapeGraph, node: Node) -> tuple[Node, Poly, int]:
    hit = self._cache.get(id(node))
    if hit is None or hit[0] is not node:   # the node is kept: its id is never reused
      f = flops(graph, node)
      hit = self._cache[id(node)] = (node, f, f.evaluate(self.env))
    return hit

  def __call__(self, graph: ShapeGraph, node: Node) -> int:
    return self._get(graph, node)[2]

  def poly(self, graph: ShapeGraph, node: Node) -> Poly:
    return self._get(graph, node)[1]

  def cost(self, graph: ShapeGraph, nodes: Sequence[Node]) -> Poly:
    """The FLOPs of `nodes` together as a polynomial, cached by the nodes' identities: a
    candidate's regeneration is mostly the same nodes round after round."""
    key = tuple(map(id, nodes))
    hit = self._costs.get(key)
    if hit is None:   # the nodes are kept: their ids are never reused
      hit = self._costs[key] = (tuple(nodes), sum((self.poly(graph, n) for n in nodes), ZERO))
    return hit[1]

  def total(self, graph: ShapeGraph, program: Program) -> int:
    """The FLOPs of all of `program`'s nodes: the last program's total, corrected where
    the nodes differ (a round differs from the one before in a few nodes)."""
    before, total = self._last
    for a, b in zip(before, program.nodes):
      if a is not b:
        total += self(graph, b) - self(graph, a)
    total += sum(self(graph, n) for n in program.nodes[len(before):])
    total -= sum(self(graph, n) for n in before[len(program.nodes):])
    self._last = (program.nodes, total)
    return total


@dataclasses.dataclass(frozen=True)
class _LayerReads:
  """Which layer each forward node belongs to, and the candidates other layers read."""
  layer: collections.abc.Callable[[int], str | None]   # node index -> layer, or None
  original: frozenset[int]         # forward nodes not made by a recomputation
  read_elsewhere: frozenset[int]   # candidates a forward node of another layer (or none) reads
  layer_inputs: frozenset[int]     # candidates a layer's forward reads, made outside that layer


def _layer_reads(program, candidates, producer, forward_node, forward_val) -> _LayerReads:
  """The layers of the forward pass (`ir.layer_scope`, or `layers.layer_calls` where one
  scope runs once per layer or none names them) and what crosses between them.

  A value a layer's forward reads and another layer made, or none (a UNet's concatenated
  skip, an embedding), is that layer's input: per-layer checkpointing keeps it, and evicted
  on its own (a layer's output regenerated through the whole layer) while layers are left
  to evict whole, it leaves their regenerations nothing to start from but the layers before
  (the record: "A later layer's input stays"; "A diffusion UNet's reach")."""
  nodes = program.nodes
  original = frozenset(i for i in set(forward_node.tolist())
                       if not nodes[i].source.endswith(RECOMPUTED))
  calls = layer_calls(nodes, original, {producer[v] for v in candidates})
  layer = lambda i: calls.get(i) or layer_scope(nodes[i].source)
  read_elsewhere, layer_inputs = set(), set()
  for i, v in zip(forward_node.tolist(), forward_val.tolist()):
    if v not in candidates:
      continue
    reader, made_in = layer(i), layer(producer[v])
    if reader != made_in:
      read_elsewhere.add(v)
      if reader is not None and i in original:
        layer_inputs.add(v)
  return _LayerReads(layer, original, frozenset(read_elsewhere), frozenset(layer_inputs))


def _layer_groups(graph, program, order, candidates, producer, live_at, inputs,
                  layers: _LayerReads, node_flops) -> list[RegionGroup]:
  """Each layer's candidates as one `RegionGroup`: the values a layer's forward makes that
  are live across the peak and read by no other layer's forward (what a later layer reads
  is its input and stays, as `jax.checkpoint` on the layer keeps it), each regenerated
  from arguments and values live at the layer's first use after the peak that no group
  evicts, without a cost bound (the layer's forward bounds it).

  The last layer before the peak forms no group, and values a recomputation made join none:
  its backward comes first, right after the peak, so regenerated whole it would be live again
  there, its values back where they were evicted (a one-layer model's peak is in that
  backward); evicted alone, each comes back right before its own use. Once a round has
  evicted a layer whole, its regenerated values are likewise evicted one at a time."""
  nodes = program.nodes
  position = {n: k for k, n in enumerate(order)}
  layer, other_readers = layers.layer, layers.read_elsewhere
  forward = [i for i in layers.original if layer(i) is not None]
  last = layer(max(forward, key=position.__getitem__)) if forward else None
  members: dict[str, list[int]] = {}
  for v in candidates:
    scope = layer(producer[v])
    if scope not in (None, last) and v not in other_readers \
        and not nodes[producer[v]].source.endswith(RECOMPUTED):
      members.setdefault(scope, []).append(v)
  evicted = {v for vs in members.values() for v in vs}
  groups = []
  for scope, values in members.items():
    if len(values) < 2:
      continue
    u = min(candidates[v] for v in values)
    anchor = lambda a, prefer_recompute, u=u: a in inputs or (a not in evicted and live_at(a, u))
    regions, union = [], set()
    for v in values:
      found = _walk_back(program, producer, v, anchor, lambda i: 0, 0)
      if found is None:   # something it needs is neither recomputable nor kept
        break
      sub, anchors = found
      union.update(sub)
      regions.append(Region(v, order[u], tuple(sorted(sub, key=position.__getitem__)), anchors,
                            graph.bytes(v), node_flops.cost(graph, [nodes[i] for i in sub]),
                            nodes[producer[v]].source))
    else:
      cost = node_flops.cost(graph, [nodes[i] for i in sorted(union)])
      groups.append(RegionGroup(tuple(regions), sum((r.saved for r in regions), ZERO), cost,
                                scope))
  return groups


def _loop_candidates(graph, pos, read_val, read_pos, peak_pos, loops, env, min_bytes,
                     inputs, last_use):
  """Stacked residuals of scan pairs (outputs of forward conds) that are live at the peak
  and read by nothing but their backward scan (cond)."""
  def live(state, v):   # at the backward node anyway: an argument, or read there or later
    return v in inputs or last_use[v] >= pos[state.backward.index]
  def spans_peak(e):   # and read by nothing but its backward
    state = loops[e.forward]
    f, b = pos[state.forward.index], pos[state.backward.index]
    return f <= peak_pos <= b and not np.any(read_pos[read_val == e.value] != b)
  out = []
  for e in loop_remat.candidates(graph, loops, env, live):
    if isinstance(e, loop_remat.ResidualGroup):
      if all(map(spans_peak, e.regions)) and e.saved.evaluate(env) >= min_bytes:
        out.append(e)
    elif spans_peak(e) and graph.bytes(e.value).evaluate(env) >= min_bytes:
      out.append(e)
  return out


def _body_candidates(graph, program, index, tight, env, loops, node_flops, layer_groups):
  """The regions of the body of the scan at node `index` as `BodyEviction`s, where
  the peak step is that scan and its body's working set is part of the peak."""
  node = program.nodes[index]
  paired = {i for s in loops.values() for i in (s.forward.index, s.backward.index)}
  if not body_remat.plannable(node, paired) or memory.transient_at(graph, node, env) <= 0:
    return [], DecisionCounts()
  body = node.subprograms[0]
  # The body's own forward/backward scan pairs too (accumulation over a scanned model, a
  # scanned model under a data-parallel shard_map): derived afresh from the body as it
  # stands, so a pair rewritten in an earlier round offers its remaining residuals.
  inner = plan(graph, range(len(body.nodes)), program=body, shape_of_interest=tight,
               node_flops=node_flops, descend=False, layer_groups=layer_groups,
               loops=loop_remat.pairs(body))
  trips = scan_length(node) if node.name == "scan" else Poly.const(1)
  def in_body(r):
    if isinstance(r, GROUPS):   # members ranked as one
      members = tuple(body_remat.BodyEviction(index, x, trips) for x in r.regions)
      return dataclasses.replace(r, regions=members, cost=r.cost * trips)
    return body_remat.BodyEviction(index, r, trips)
  return [in_body(r) for r in inner.regions], inner.counts


def fenced_originals(program: Program) -> dict[int, int]:
  """Each value our fences (`apply_regions`) output -> the value it copies. A recomputed
  value reads its anchors' fenced copies, which die there; regenerating it again later
  (once a layer evicted whole is live again in its backward) reads the originals, which
  the backward keeps (an optimization barrier is the identity)."""
  return {o: i for n in program.nodes if n.name == "optimization_barrier"
          and n.source.startswith(FENCE_SOURCE) for i, o in zip(n.inputs, n.outputs)}


def _regeneration(program: Program, producer, value, anchor, cost_of, max_cost, through=None):
  """(nodes, anchors) recomputing `value`, or None.

  Walks back from `value`: a small value that is live at the use (or an
  argument) becomes an anchor; a large one is recomputed while the subgraph
  costs at most `max_cost` FLOPs and its producer may be recomputed, and read
  as an anchor otherwise. Where that finds no way back within the cost (a value
  neither live nor recomputable within it), it walks again reading every value
  that is live at the use: a layer's residuals then regenerate from the
  residuals that stay, as with per-layer checkpointing, instead of not at all.
  A fenced copy (`through`: `fenced_originals`) that is not live is read as its original.
  """
  found = _walk_back(program, producer, value, anchor, cost_of, max_cost, through)
  if found is None:
    def live(a, prefer_recompute):
      del prefer_recompute   # any live value will do
      return anchor(a, prefer_recompute=False)
    found = _walk_back(program, producer, value, live, cost_of, max_cost, through)
  return found


def _walk_back(program: Program, producer, value, anchor, cost_of, max_cost, through=None):
  through = through or {}
  nodes: list[int] = []
  cost, taken = 0, set()
  anchors: set[int] = set()
  stack, seen = [value], set()
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    if v != value and anchor(v, prefer_recompute=True):
      anchors.add(v)
      continue
    if v != value and v in through:   # a fenced copy: itself where live, else the original
      if anchor(v, prefer_recompute=False):
        anchors.add(v)
      else:
        stack.append(through[v])
      continue
    node = program.nodes[producer[v]] if v in producer else None
    if node is not None and recomputable(node) and (
        node.index in taken or cost + cost_of(node.index) <= max_cost):
      if node.index not in taken:
        taken.add(node.index)
        nodes.append(node.index)
        cost += cost_of(node.index)
      stack.extend(node.operands)
    elif v != value and anchor(v, prefer_recompute=False):
      anchors.add(v)
    else:
      return None
  return nodes, tuple(sorted(anchors))


def compatible(active: Sequence[Region], region: Region) -> bool:
  """A region may join `active` if no anchor is evicted and its value anchors nobody."""
  evicted = {r.value for r in active}
  anchors = {a for r in active for a in r.anchors}
  return not (set(region.anchors) & evicted) and region.value not in anchors \
      and region.value not in evicted


@functools.lru_cache(maxsize=1 << 14)
def _times(a: Poly, b: Poly) -> Poly:
  """a * b, remembered: the rounds of one plan rank mostly the same regions again."""
  return a * b


def _rank(regions: list[Region], decider: Decider) -> list[Region]:
  """Sort by FLOPs per byte saved: a before b iff cost_a * saved_b <= cost_b * saved_a.

  Where the comparison cannot decide (UNKNOWN), the fallback is the order at the
  shape of interest, as for DEPENDS.
  """

  def cmp(a: Region, b: Region) -> int:
    lhs, rhs = _times(a.cost, b.saved), _times(b.cost, a.saved)
    d = decider.decide(lhs, rhs)
    return decider.sign_at(lhs, rhs) if d.sign is None else d.sign
  return sorted(regions, key=functools.cmp_to_key(cmp))


# --- rewrite ----------------------------------------------------------------------------


# The mark on a recomputed node's source (a clone `apply_regions` makes), and the start of
# the source of its fences.
RECOMPUTED = " [recomputed]"
FENCE_SOURCE = "jax_symmem remat fence"

# Never a trigger: XLA duplicates these into each consumer instead of materializing
# them, so fencing one would force a buffer XLA never needs.
NOT_A_TRIGGER = frozenset({
    "broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims", "convert_element_type",
})


@dataclasses.dataclass(frozen=True)
class Block:
  """Where a region landed in a rewritten program."""
  region: Region
  barrier: int                  # node index of the fence (shared by a consumer's regions)
  clones: tuple[int, ...]       # node indices of the recomputation, one per region node
  regenerated: int              # the value that replaces `region.value` from the consumer on


class _Triggers:
  """Picks the value a fence waits for (`at`): among the values made before the
  consumer and read at it or later, the one with the longest chain back to the inputs
  (late in the backward pass: XLA cannot compute it early, as JAX's remat waits for
  the cotangent); the first such in `order` on a tie. Positions are in `order`, which
  inserting blocks never reorders; `at` is asked about positions up to `end` only.
  `live` (per node): count only the reads of nodes XLA keeps (`_revive_triggers`)."""

  def __init__(self, program: Program, order: Sequence[int], end: int,
               live: np.ndarray | None = None):
    # Where each value is last read (numpy), its depth (the longest chain of nodes
    # back to the program's inputs: one pass in order, up to `end`: a value made later
    # is never a trigger there), and the values a trigger may be.
    n = len(order)
    node_pos = np.empty(n, np.int64)
    node_pos[np.asarray(order, np.int64)] = np.arange(n)
    read_node, read_val = program.reads
    if live is not None:
      read_node, read_val = read_node[live[read_node]], read_val[live[read_node]]
    write_node, write_val = program.writes
    ids = max(int(read_val.max(initial=-1)), int(write_val.max(initial=-1)),
              max(program.inputs, default=-1)) + 1
    last_read = np.full(ids, -1, np.int64)
    np.maximum.at(last_read, read_val, node_pos[read_node])
    depth = [0] * ids
    get = depth.__getitem__
    nodes = program.nodes
    for i in order[:end]:
      node = nodes[i]
      d = max(map(get, node.operands), default=0) + 1
      for o in node.outputs:
        depth[o] = d
    born = node_pos[write_node]
    # In order of position, as the values were made (a node's outputs in their order).
    made = np.lexsort((np.arange(len(write_val)), born))
    made = made[(born[made] < end) & (last_read[write_val[made]] >= 0)]
    made = made[np.fromiter((nodes[i].primitive.name not in NOT_A_TRIGGER
                             for i in write_node[made].tolist()), bool, len(made))]
    self.values = write_val[made]
    self.born = born[made]
    self.last_read = last_read[write_val[made]]
    self.depth = np.asarray(depth, np.int64)[write_val[made]]

  def at(self, k: int, skip: Iterable[int]) -> int | None:
    """The trigger for a consumer at position k, never one of `skip`."""
    if not len(self.values):
      return None
    depth = np.where((self.born < k) & (self.last_read >= k), self.depth, -1)
    depth[np.isin(self.values, np.fromiter(skip, np.int64))] = -1
    j = int(np.argmax(depth))   # the first of the deepest
    return int(self.values[j]) if depth[j] >= 0 else None


def _readers(program: Program, values: set[int]) -> dict[int, list[int]]:
  """The nodes that read each of `values`, in node order (once per read)."""
  read_node, read_val = program.reads
  hit = np.isin(read_val, np.fromiter(values, np.int64, len(values)))
  readers: dict[int, list[int]] = {}
  for i, x in zip(read_node[hit].tolist(), read_val[hit].tolist()):
    readers.setdefault(x, []).append(program.nodes[i].index)
  return readers


def apply_regions(program: Program, order: Sequence[int], regions: Sequence[Region]
                  ) -> tuple[Program, tuple[int, ...], tuple[Block, ...]]:
  """The program with `regions` applied, its order (recomputation right before each
  consumer), and where each region landed.

  Regions with the same consumer share one fence and one recomputation. The fence
  passes their anchors and a trigger (`_Triggers`) through one optimization
  barrier; every read of the trigger from the consumer on takes its fenced copy,
  so XLA keeps the barrier whole and cannot start the recomputation before the
  trigger exists (experiments/flat_reach.py measures what XLA makes of it).
  """
  nodes = list(program.nodes)
  avals = dict(program.avals)
  next_id = program.max_id() + 1
  through = fenced_originals(program)
  position = {i: k for k, i in enumerate(order)}
  groups: dict[int, list[Region]] = {}
  for r in regions:
    groups.setdefault(r.consumer, []).append(r)
  consumers = sorted(groups, key=position.__getitem__)
  triggers_of = _Triggers(program, order, max((position[c] for c in consumers), default=0))
  evicted_here = {r.value for r in regions}   # never a trigger: their later reads are renamed
  trigger_of = {c: triggers_of.at(position[c], {a for r in groups[c] for a in r.anchors}
                                  | evicted_here) for c in consumers}
  readers = _readers(program, {r.value for r in regions}
                     | {t for t in trigger_of.values() if t is not None})
  order = list(order)
  rename: dict[int, dict[int, int]] = {}   # node -> {value: the copy it reads instead}
  fenced: dict[int, int] = {}              # trigger -> its latest fenced copy
  blocks = []
  for consumer in consumers:
    group = groups[consumer]
    k = order.index(consumer)
    evicted = {r.value for r in group}
    anchors = sorted({a for r in group for a in r.anchors})
    trigger = trigger_of[consumer]
    # Inside a shard_map body a barrier takes operands that vary over the same mesh
    # axes only: those of the trigger's kind (the first anchor's without one) are fenced;
    # the rest (a replicated weight beside a batch shard) are read as they are, and the
    # recomputation still waits through the others.
    kind = _varying(avals, trigger if trigger is not None else (anchors or [None])[0])
    anchors = [a for a in anchors if _varying(avals, a) == kind]
    # 1. The barrier: anchors and the trigger (as last fenced) pass through together.
    fenced_in = anchors + ([] if trigger is None else [fenced.get(trigger, trigger)])
    fenced_out = []
    for a in fenced_in:
      avals[next_id] = avals[a]
      fenced_out.append(next_id)
      next_id += 1
    barrier = Node(index=len(nodes), primitive=lax.optimization_barrier_p, params={},
                   inputs=tuple(fenced_in), outputs=tuple(fenced_out),
                   source=f"{FENCE_SOURCE} for values {sorted(evicted)}")
    nodes.append(barrier)
    new_order = [barrier.index]
    mapping = dict(zip(anchors, fenced_out))

    def read(x):
      """What a clone reads for `x`: a fenced anchor, a clone's output, or a fenced copy
      of an earlier fence read through to its original (`fenced_originals`)."""
      y = x
      while y not in mapping and y in through:
        y = through[y]
      return mapping.get(y, x)
    # 2. Clones of the regeneration subgraphs read the fenced anchors; a node two
    # regions of the group recompute is cloned once.
    clone_of: dict[int, int] = {}
    for r in group:
      for i in r.nodes:
        if i in clone_of:
          continue
        old = program.nodes[i]
        outs = []
        for o in old.outputs:
          avals[next_id] = avals[o]
          mapping[o] = next_id
          outs.append(next_id)
          next_id += 1
        clone = dataclasses.replace(
            old, index=len(nodes), outputs=tuple(outs),
            inputs=tuple(x if isinstance(x, Const) else read(x) for x in old.inputs),
            source=old.source if old.source.endswith(RECOMPUTED) else old.source + RECOMPUTED)
        nodes.append(clone)
        new_order.append(clone.index)
        clone_of[i] = clone.index
    order[k:k] = new_order
    # 3. From the consumer on, every read of an evicted value takes the regenerated
    # copy and every read of the trigger its fenced copy.
    later = lambda v: (i for i in readers.get(v, ()) if position[i] >= position[consumer])
    for r in group:
      blocks.append(Block(r, barrier.index, tuple(clone_of[i] for i in r.nodes),
                          mapping[r.value]))
      for i in later(r.value):
        rename.setdefault(i, {})[r.value] = mapping[r.value]
    if trigger is not None:
      fenced[trigger] = fenced_out[-1]
      for i in later(trigger):
        rename.setdefault(i, {})[trigger] = fenced_out[-1]
  for i, ren in rename.items():
    n = nodes[i]
    nodes[i] = dataclasses.replace(n, inputs=tuple(
        x if isinstance(x, Const) else ren.get(x, x) for x in n.inputs))
  rewritten = Program(program.inputs, tuple(nodes), program.outputs, avals)
  if REVIVE_TRIGGERS:
    rewritten = _revive_triggers(rewritten, order)
  return rewritten, tuple(order), tuple(blocks)


def _varying(avals, v) -> frozenset:
  """The mesh axes value `v` varies over inside a shard_map body (none elsewhere)."""
  return frozenset() if v is None else tracing.aval_varying_axes(avals[v])


def _revive_triggers(program: Program, order: Sequence[int]) -> Program:
  """`program` with a new trigger for each fence whose trigger copy no live node reads.

  A later round can evict the value a fence's trigger copy was read for: its producer
  is then dead code, XLA's algebraic simplifier drops the unread element of the
  optimization barrier, and the fence, left with anchors the forward pass makes, lets
  XLA run the recomputation as early as it likes and hold its result (transformers'
  BERT at s=512: a 16 MiB probability tensor held from the forward pass to the
  backward, 78.1 MiB by XLA where the prediction said 61.0). Such a fence takes one
  more element: the trigger `_Triggers` picks there among the reads of live nodes,
  whose later live reads take the new copy. The old element stays (dead nodes may
  still name it; XLA drops it)."""
  live = live_nodes(program)
  fences = [n for n in program.nodes if live[n.index] and n.name == "optimization_barrier"
            and n.source.startswith(FENCE_SOURCE)]
  if not fences:
    return program
  read_node, read_val = program.reads
  last = np.fromiter((f.outputs[-1] for f in fences), np.int64, len(fences))
  read = set(read_val[np.isin(read_val, last) & live[read_node]].tolist())
  position = np.empty(len(program.nodes), np.int64)
  position[np.asarray(order, np.int64)] = np.arange(len(order))
  for b in sorted((f.index for f in fences if f.outputs[-1] not in read),
                  key=position.__getitem__):   # in order: each sees the copies made before
    fence, k = program.nodes[b], position[b]
    v = _Triggers(program, order, len(order), live).at(k, fence.operands)
    if v is None or _varying(program.avals, v) != _varying(program.avals, fence.operands[-1]):
      continue
    copy = program.max_id() + 1
    read_node, read_val = program.reads
    later = set(read_node[(read_val == v) & live[read_node] & (position[read_node] > k)].tolist())
    nodes = list(program.nodes)
    nodes[b] = dataclasses.replace(fence, inputs=fence.inputs + (v,),
                                   outputs=fence.outputs + (copy,))
    for r in later:
      nodes[r] = dataclasses.replace(nodes[r], inputs=tuple(
          copy if x == v else x for x in nodes[r].inputs))
    program = Program(program.inputs, tuple(nodes), program.outputs,
                      {**program.avals, copy: program.avals[v]})
  return program


# --- rounds: evict at the peak, re-plan at the new peak -----------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Round:
  """The program after the first k rounds of eviction."""
  regions: tuple[Region, ...]     # regions added in this round (empty for round 0)
  blocks: tuple[Block, ...]       # where they landed in `program`
  program: Program
  order: tuple[int, ...]
  graph: ShapeGraph
  loops: Mapping[int, loop_remat.LoopState] = dataclasses.field(default_factory=dict)
  as_written: bool = False        # the user's own jax.checkpoint regions, not a plan of ours

  def __repr__(self) -> str:
    return (f"Round({len(self.regions)} regions added, {len(self.program.nodes)} nodes"
            + (", as written" if self.as_written else "") + ")")

  def peak_at(self, dims: Mapping[str, int]) -> int:
    return memory.peak_at(self.graph, dims, self.program, self.order)


def _copies(program: Program, blocks: Sequence[Block]) -> dict[int, int]:
  """Each value a fence or a block added -> the value it copies: a fence's outputs are
  its inputs (every fence's: `_revive_triggers` may extend an earlier round's), a
  clone's outputs are the originals' (for `ShapeGraph.extended`)."""
  copies = fenced_originals(program)
  for b in blocks:
    for i, j in zip(b.clones, b.region.nodes):   # clones in the region's node order
      copies.update(zip(program.nodes[i].outputs, program.nodes[j].outputs))
  for v in copies:   # a trigger fenced twice in one round: a copy of the original
    while copies[v] in copies:
      copies[v] = copies[copies[v]]
  return copies


def first_round(graph: ShapeGraph, order: Sequence[int]) -> Round:
  """Round 0: the traced program in `order`, nothing evicted."""
  return Round((), (), graph.traced.program, tuple(order), graph,
               loop_remat.pairs(graph.traced.program))


def apply_round(last: Round, chosen: Sequence[Region | loop_remat.LoopEviction |
                                              body_remat.BodyEviction]) -> Round:
  """The round after `last` that evicts `chosen`: scan residuals are rewritten into
  their loop pair (`loop_remat.rewrite`), regions of a scan body applied to the body
  and the scan rebuilt (`body_remat.rebuild`), flat regions applied (`apply_regions`).
  Planning and replaying a stored plan (plan_cache.py) both build rounds here."""
  program, loops = last.program, dict(last.loops)
  inside = [r for r in chosen if isinstance(r, body_remat.BodyEviction)]
  for index in sorted({r.node for r in inside}):
    items = [r.item for r in inside if r.node == index]
    node = program.nodes[index]
    with (tracing.inside_shard_map(node.params) if node.name == "shard_map"
          else contextlib.nullcontext()):
      body = _evict_residuals(node.subprograms[0],
                              [r for r in items if isinstance(r, loop_remat.LoopEviction)])
    new_body, body_order, _ = apply_regions(
        body, range(len(body.nodes)), [r for r in items if isinstance(r, Region)])
    program = body_remat.rebuild(program, index, new_body, body_order)
  evictions = [r for r in chosen if isinstance(r, loop_remat.LoopEviction)]
  for fi in sorted({r.forward for r in evictions}):
    evicted = loops[fi].evicted | {r.output for r in evictions if r.forward == fi}
    program, loops[fi] = loop_remat.rewrite(program, loops[fi], evicted)
  flat = [r for r in chosen if isinstance(r, Region)]
  rewritten, new_order, blocks = apply_regions(program, last.order, flat)
  loops = {fi: s.renamed(program, rewritten) for fi, s in loops.items()}
  return Round(tuple(chosen), blocks, rewritten, new_order,
               last.graph.extended(rewritten, _copies(rewritten, blocks)), loops)


def _evict_residuals(body: Program, evictions: Sequence[loop_remat.LoopEviction]) -> Program:
  """`body` (of a scan) with its scan pairs rewritten to regenerate `evictions`; the pairs
  as they stand in `body` (one rewritten in an earlier round is rewritten again)."""
  for fi in sorted({e.forward for e in evictions}):
    state = loop_remat.pairs(body)[fi]
    body, _ = loop_remat.rewrite(body, state, frozenset(e.output for e in evictions
                                                        if e.forward == fi))
  return body


def last_planned(rounds: Sequence[Round]) -> int:
  """The index of the planner's last round: the step as written (`as_written`), where
  kept as a round, comes after it and may need more memory than the rounds before."""
  if isinstance(rounds, ReplayedRounds):
    return rounds.last_planned
  k = len(rounds) - 1
  while k > 0 and rounds[k].as_written:
    k -= 1
  return k


class ReplayError(ValueError):
  """Stored decisions that do not rebuild a valid round of the traced program."""


class ReplayedRounds(collections.abc.Sequence):
  """The rounds of a plan made before (`plan_rounds`), from each round's chosen items.

  Round k is rebuilt (`apply_round` on round k-1, then checked to be a valid order of
  its program) the first time it is read, so a restarted job pays only for the rounds
  its shapes need: round 0 alone while the budget holds. `extra` rounds (the step as
  written) follow the replayed ones as they are.
  """

  def __init__(self, graph: ShapeGraph, order: Sequence[int],
               chosen: Sequence[Sequence[Region | loop_remat.LoopEviction]],
               extra: Sequence[Round] = (), origin: str = "a stored plan"):
    self._graph, self._order, self._origin = graph, tuple(order), origin
    self._chosen = tuple(tuple(items) for items in chosen)
    self._extra = tuple(extra)
    self._built = [first_round(graph, order)]

  def __len__(self) -> int:
    return 1 + len(self._chosen) + len(self._extra)

  @property
  def last_planned(self) -> int:
    """The planner's last round (without rebuilding any): the extras follow it."""
    return len(self._chosen)

  def __getitem__(self, k):
    if isinstance(k, slice):
      return tuple(self[j] for j in range(*k.indices(len(self))))
    if k < 0:
      k += len(self)
    if not 0 <= k < len(self):
      raise IndexError(f"round {k} of a plan with {len(self)} rounds")
    if k > len(self._chosen):
      return self._extra[k - len(self._chosen) - 1]
    while len(self._built) <= k:
      j = len(self._built)
      try:
        r = apply_round(self._built[-1], self._chosen[j - 1])
      except (KeyError, IndexError, ValueError, TypeError) as e:
        raise ReplayError(f"round {j} of {self._origin} does not apply to the traced "
                          f"program ({type(e).__name__}: {e}); delete the file to plan "
                          "again") from e
      if not schedule_lib.is_valid_order(r.program, r.order):
        raise ReplayError(f"round {j} of {self._origin} does not replay to a valid "
                          "program; delete the file to plan again")
      self._built.append(r)
    return self._built[k]

  def __add__(self, more: Sequence[Round]) -> ReplayedRounds:
    return ReplayedRounds(self._graph, self._order, self._chosen, self._extra + tuple(more),
                          self._origin)

  @property
  def built(self) -> int:
    """How many planned rounds (round 0 included) have been rebuilt so far."""
    return len(self._built)


@collector.paused()
def plan_rounds(graph: ShapeGraph, order: Sequence[int], *,
                shape_of_interest: Mapping[str, int] | None = None,
                later_shapes: Sequence[Mapping[str, int]] | None = None, max_rounds: int = 24,
                per_round: int = 4, patience: int = 3,
                layer_groups: bool | None = None,
                drop_stale: bool | None = None) -> tuple[tuple[Round, ...], dict]:
  """Repeatedly evicts the best-ranked regions across the current peak, as the paper does.

  Each round plans on the program as rewritten so far (so the peak it attacks is
  the real one after earlier evictions) and adds the best-ranked compatible
  regions: `per_round` of them, and more while together they save less than
  1/`max_rounds` of the current peak at the shape of interest. Rounds are spaced
  by memory, not by count: a layer under `lax.cond` outputs twenty-odd residuals,
  many of them weight-sized, and four at a time left a 4-layer GPT-2 with
  LayerDrop far from per-layer checkpointing after `max_rounds` rounds. Stops
  when no region is left or the peak at the shape of interest has not improved
  for `patience` rounds; then goes on, within `max_rounds` in all, at each of
  `later_shapes` in turn (by default, when planning for every shape, i.e. without
  a `shape_of_interest`: the dims' midpoint, then the geometric mean of their
  bounds). A peak at a smaller shape can hold values the largest shape's peak
  never spans (a GPT-2's b*s MLP activations, where at the longest sequence the
  b*s^2 attention probabilities decide), and the rounds are a ladder for every
  shape the step sees. Round k is a complete program: at run time, the smallest
  k that fits the budget is dispatched. `layer_groups` (default `LAYER_GROUPS`): offer
  each layer's residuals as one candidate (`RegionGroup`), not each alone.
  `drop_stale` (default `DROP_STALE_ROUNDS`): end the ladder at the last round that lowered
  the peak at the shape it was planned for. The rounds after it, kept while planning in
  case a later one lowers it (a peak that several equal values hold falls only once all
  are evicted), only recompute more: transformers' Mistral (b=4, s=512) ended with three
  rounds evicting 32 KiB AdamW values, one regenerated through 355 ops, that XLA put at
  108.3 / 104.3 / 94.8 MiB against 77.6 for the round before them.
  """
  if layer_groups is None:
    layer_groups = LAYER_GROUPS
  if drop_stale is None:
    drop_stale = DROP_STALE_ROUNDS
  tight = dict(shape_of_interest or graph.max_dims())
  if later_shapes is None:
    later_shapes = [] if shape_of_interest else _smaller_shapes(graph, tight)
  rounds = [first_round(graph, order)]
  counts = DecisionCounts()
  improved = 1   # the rounds up to the last that lowered the peak where it was planned
  for at in [tight, *map(dict, later_shapes)]:
    env = graph.constraints.complete(at)
    node_flops = NodeFlops(env)
    best, stale = rounds[-1].peak_at(at), 0
    while len(rounds) <= max_rounds:
      progress.update("remat round", len(rounds), max_rounds, at_most=True, peak=best)
      last = rounds[-1]
      p = plan(last.graph, last.order, program=last.program, shape_of_interest=at,
               loops=last.loops, node_flops=node_flops, layer_groups=layer_groups)
      counts += p.counts
      chosen: list[Region] = []
      saved, step = 0, best // max_rounds
      for r in p.regions:
        items = r.regions if isinstance(r, GROUPS) else (r,)
        if all(compatible(chosen + list(items[:j]), x) for j, x in enumerate(items)):
          chosen.extend(items)
          saved += r.saved.evaluate(env)
        if len(chosen) >= per_round and saved >= step:
          break
      if not chosen:
        break
      rounds.append(apply_round(last, chosen))
      peak = rounds[-1].peak_at(at)
      best, stale = (peak, 0) if peak < best else (best, stale + 1)
      if not stale:
        improved = len(rounds)
      if stale >= patience:
        break
  if drop_stale:
    del rounds[improved:]
  return tuple(rounds), dict(counts.as_dict(), rounds=len(rounds) - 1)


def _smaller_shapes(graph: ShapeGraph, tight: Mapping[str, int]) -> list[dict[str, int]]:
  """The allowed dims at the midpoint and at the geometric mean of their bounds; first,
  where general inequalities cut off the box's largest corner (`tight`, which then no
  call can have: "b*s <= 8192"), the largest allowed points along the cut
  (`Constraints.cut_corners`: a long sequence in a small batch, many short ones).

  The box's corner stays the main shape: there every value that grows with any dim is
  largest, and the rounds planned there evict them in an order that serves the allowed
  shapes too (a tiny Llama under b <= 64, s <= 256, b*s <= 2048: its floor at (8, 256)
  39.4 MiB planned at the corner, 43.5 planned at (8, 256) itself); the cut's corners
  extend the ladder where those shapes' peaks lie (experiments/token_budget.py, b*s <=
  8192: GPT-2's floors at (64, 128) / (8, 1024) 753.8 / 975.7 -> 617.8 / 967.6 MiB).
  """
  largest = graph.constraints.complete(tight)
  out = [c for c in map(graph.constraints.complete, graph.constraints.cut_corners())
         if c != largest]
  for level in ("mid", "geo"):
    env = graph.constraints.complete(schedule_lib.bounds_level(graph, tight, level))
    if env != largest and env not in out and graph.constraints.violation(env) is None:
      out.append(env)
  return out
