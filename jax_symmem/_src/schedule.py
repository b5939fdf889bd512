"""Memory-aware list scheduling with exact symbolic comparisons (the paper's op scheduling).

Among the ready nodes, pick the one whose memory impact (bytes it allocates
minus bytes it frees if run now) is smallest. Impacts are polynomials over the
dims and are compared exactly:

* GE / LE / EQ decide for every shape ("decided");
* DEPENDS is resolved at the shape where memory is tight — the largest allowed
  dims, or a user-given shape of interest ("depends");
* UNKNOWN falls back to a topology heuristic that ignores sizes: the node that
  ends more buffer lifetimes than it starts goes first, then trace order
  ("fallback").

That policy and its counts are `decider.Decider`'s (shared with the remat
ranking); `Schedule.passes` has the counts of every list pass.

`symbolic=False` is the ablation: every choice by the fallback. `dims=` runs the
same scheduler on exact shapes (integers), the static anchor. Effects keep their
trace order, and every node runs after its operands' producers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Mapping, Sequence

from jax_symmem._src import memory
from jax_symmem._src import progress
from jax_symmem._src.decider import Decider, DecisionCounts
from jax_symmem._src.poly import ZERO, Poly
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.ir import Const, Program


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The main order, and every candidate order (all valid) for per-shape choice."""
  order: tuple[int, ...]
  mode: str                       # "symbolic", "fallback" (ablation) or "static"
  stats: Mapping[str, int]        # choices, comparisons, decided, depends, fallback, peaks
  source: str = "trace"           # which candidate is the main order
  candidates: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  # How each list pass decided its comparisons ("forward", "backward", then the same
  # "@dims" at the other shapes of interest); their sum is the counts in `stats`.
  # Empty for a schedule read back from the plan cache, which ran no pass.
  passes: Mapping[str, DecisionCounts] = dataclasses.field(default_factory=dict, compare=False)

  def order_for(self, graph: ShapeGraph, dims: Mapping[str, int],
                program: Program | None = None) -> tuple[int, ...]:
    """The candidate with the lowest modeled peak at `dims`: which order is best
    can depend on the shape, and at run time the shape is known."""
    orders = [self.order] + [o for o in self.candidates.values() if o != self.order]
    return min(orders, key=lambda o: memory.peak_at(graph, dims, program, o))


def dependencies(program: Program) -> list[set[int]]:
  """preds[i]: nodes that must run before node i (data and effect order)."""
  producer = {o: n.index for n in program.nodes for o in n.outputs}
  preds: list[set[int]] = [set() for _ in program.nodes]
  last_effect = None
  for n in program.nodes:
    for x in n.inputs:
      if not isinstance(x, Const) and x in producer:
        preds[n.index].add(producer[x])
    if n.effects:
      if last_effect is not None:
        preds[n.index].add(last_effect)
      last_effect = n.index
  return preds


def is_valid_order(program: Program, order: Sequence[int],
                   preds: Sequence[set[int]] | None = None) -> bool:
  """A permutation of the nodes that respects data and effect dependencies
  (`preds`: `dependencies(program)`, where the caller checks several orders)."""
  if sorted(order) != list(range(len(program.nodes))):
    return False
  pos = {i: k for k, i in enumerate(order)}
  preds = dependencies(program) if preds is None else preds
  return all(pos[p] < pos[i] for i, ps in enumerate(preds) for p in ps)


def schedule(graph: ShapeGraph, program: Program | None = None, *, symbolic: bool = True,
             dims: Mapping[str, int] | None = None,
             shape_of_interest: Mapping[str, int] | None = None,
             donated: Sequence[int] = ()) -> Schedule:
  """Orders `program`'s nodes for low peak memory.

  Runs the list scheduler forward (place the ready node with the smallest
  impact) and backward (from the outputs, place last the node whose inputs add
  the least), and keeps the trace order as a third candidate, as XLA's default
  memory scheduler keeps the best of several; the winner has the lowest modeled
  peak at the shape of interest (exact dims for `dims=`).

  Args:
    graph: the shape graph (sizes and constraints).
    program: default the traced top-level program.
    symbolic: False is the ablation (the size-blind fallback for every choice).
    dims: schedule for these exact dims instead (the static anchor).
    shape_of_interest: where DEPENDS comparisons are resolved (default: the
      largest allowed dims, where memory is tightest).
    donated: argument positions the caller donates.
  """
  program = graph.traced.program if program is None else program
  tight = graph.constraints.complete(dict(shape_of_interest or graph.max_dims()))
  exact_env = graph.constraints.complete(dict(dims)) if dims is not None else None
  mode = "static" if dims is not None else ("symbolic" if symbolic else "fallback")
  state = _State(program, donated)
  at = exact_env if exact_env is not None else tight
  # Where a comparison DEPENDS, the best choice depends on the shape: the list
  # schedules are also built with DEPENDS resolved at smaller shapes of interest,
  # and the run time picks the candidate with the lowest peak at its exact dims
  # (`order_for`). The ablation never reads a shape, so one point serves it.
  points = [at] if exact_env is not None or not symbolic else _points_of_interest(graph, tight)
  candidates, moves, passes, choices = {}, {}, {}, 0
  for k, point in enumerate(points):
    progress.update("schedule candidates at shape of interest", k + 1, len(points))
    suffix = "" if k == 0 else "@" + ",".join(f"{v}={point[v]}" for v in sorted(graph.dims)
                                                if v in point)
    listed = {}
    for name, list_pass in (("forward", _forward), ("backward", _backward)):
      chooser = _Chooser(graph, Decider(graph.constraints, point, mode))
      listed[name] = list_pass(state, chooser)
      key = name + suffix
      if key in passes:   # shapes of interest that differ only in a var no argument's shape has
        key += f"#{k}"
      passes[key] = chooser.decider.counts
      choices += chooser.choices
    if k == 0:
      listed["trace"] = tuple(range(len(program.nodes)))
    # Each list schedule, then the same after local sink moves judged at that point.
    for name, order in listed.items():
      sunk, moves[f"{name}+sink{suffix}"] = _sink(graph, state, order, point, donated)
      for cand_name, cand in ((name + suffix, order), (f"{name}+sink{suffix}", tuple(sunk))):
        if k == 0 or cand not in candidates.values():   # extra points: new orders only
          candidates[cand_name] = cand
  # The main order: lowest peak at the shape of interest among the candidates that
  # never lose to trace order on a grid over the box (trace order itself qualifies).
  grid = [at] if exact_env is not None else [at] + memory.sample_points(graph)
  def peaks(order):
    return [memory.peak_at(graph, p, program, order, donated) for p in grid]
  trace_peaks = peaks(candidates["trace"])
  scored = {name: peaks(order) for name, order in candidates.items()}
  best = min((name for name in candidates
              if all(a <= b for a, b in zip(scored[name], trace_peaks))),
             key=lambda name: (scored[name][0], name != "trace+sink", name != "trace"))
  counts = sum(passes.values(), DecisionCounts())
  stats = dict(choices=choices, **counts.as_dict(), sink_moves=moves.get(best, 0),
               **{f"peak_{k}": v[0] for k, v in scored.items() if "@" not in k})
  return Schedule(candidates[best], mode, stats, best, candidates, passes)


def _points_of_interest(graph: ShapeGraph, tight: Mapping[str, int]) -> list[dict[str, int]]:
  """The main shape of interest, then every bounded dim at its lower bound, geometric
  mean and midpoint together (lengths spread over orders of magnitude)."""
  points = [dict(tight)]
  for level in ("lo", "geo", "mid"):
    env = {}
    for v, lo, hi in graph.constraints.bounds:
      hi = tight.get(v, lo) if hi is None else hi
      env[v] = {"lo": lo, "geo": max(lo, round((lo * hi) ** 0.5)), "mid": (lo + hi) // 2}[level]
    env = graph.constraints.complete(env)
    if graph.constraints.violation(env) is None and env not in points:
      points.append(env)
  return points


def _sink(graph, state: _State, order: Sequence[int], at, donated):
  """Local improvement: move each node, last first, to just before its first consumer
  unless that raises the peak at the shape of interest (neutral moves open later gains)."""
  order = list(order)
  current = memory.peak_at(graph, at, state.program, order, donated)
  moves = 0
  for i in reversed(range(len(order))):
    if not state.succs[i]:
      continue
    rest = [j for j in order if j != i]
    first = min(rest.index(s) for s in state.succs[i])
    if first == order.index(i):
      continue
    cand = rest[:first] + [i] + rest[first:]
    new = memory.peak_at(graph, at, state.program, cand, donated)
    if new <= current:
      order, current, moves = cand, new, moves + 1
  return order, moves
@dataclasses.dataclass(frozen=True)
class _State:
  """Buffers, uses and pinned buffers of a program (aliases share a buffer)."""
  program: Program
  donated: Sequence[int]

  @functools.cached_property
  def buffer(self) -> dict[int, int]:
    return memory.buffers(self.program)

  def operand_buffers(self, i: int) -> collections.Counter:
    return collections.Counter(self.buffer[x] for x in self.program.nodes[i].inputs
                               if not isinstance(x, Const))

  def own_outputs(self, i: int) -> list[int]:
    return [o for o in self.program.nodes[i].outputs if self.buffer[o] == o]

  @functools.cached_property
  def held(self) -> set[int]:
    """Arguments the caller keeps: live throughout, never part of an impact."""
    donated = set(self.donated)
    return {self.buffer[v] for k, v in enumerate(self.program.inputs) if k not in donated}

  @functools.cached_property
  def outputs(self) -> set[int]:
    return {self.buffer[x] for x in self.program.outputs if not isinstance(x, Const)}

  @functools.cached_property
  def preds(self) -> list[set[int]]:
    return dependencies(self.program)

  @functools.cached_property
  def succs(self) -> list[list[int]]:
    succs: list[list[int]] = [[] for _ in self.program.nodes]
    for i, ps in enumerate(self.preds):
      for p in ps:
        succs[p].append(i)
    return succs


class _Chooser:
  """Picks the smallest impact among ready nodes (`decider` counts how each comparison went)."""

  def __init__(self, graph: ShapeGraph, decider: Decider):
    self.graph, self.decider = graph, decider
    self.choices = 0

  def pick(self, ready: Sequence[int], impact) -> int:
    """ready is in preference order for ties; impact(i) -> (bytes Poly, buffer count)."""
    self.choices += 1
    best = ready[0]
    if len(ready) > 1:
      best_impact = impact(best)
      for i in ready[1:]:
        cand = impact(i)
        if self._better(cand, best_impact):
          best, best_impact = i, cand
    return best

  def _better(self, candidate: tuple[Poly, int], best: tuple[Poly, int]) -> bool:
    (size, count), (best_size, best_count) = candidate, best
    d = self.decider.decide(size, best_size)
    if d.sign is None:   # undecidable: the size-blind rule, fewer net buffers started
      return count < best_count
    # Equal at every shape (or at the exact dims): fewer buffers wins; equal only at
    # the shape of interest (DEPENDS): the current best stays (`ready`'s preference).
    return d.sign < 0 or (d.sign == 0 and d.proven and count < best_count)


def _bytes(graph_bytes, buffers) -> Poly:
  return sum((graph_bytes(b) for b in buffers), ZERO)


def _forward(state: _State, chooser: _Chooser) -> tuple[int, ...]:
  """Place, first to last, the ready node that allocates least net of what it frees."""
  program, buffer, graph = state.program, state.buffer, chooser.graph
  remaining = collections.Counter()
  for i in range(len(program.nodes)):
    remaining.update(state.operand_buffers(i))
  keep = state.held | state.outputs

  def impact(i):
    new = state.own_outputs(i)
    ending = [b for b, k in state.operand_buffers(i).items() if remaining[b] == k and b not in keep]
    return _bytes(graph.bytes, new) - _bytes(graph.bytes, ending), len(new) - len(ending)

  waiting = [len(ps) for ps in state.preds]
  ready = [i for i, w in enumerate(waiting) if w == 0]
  order = []
  while ready:
    best = chooser.pick(ready, impact)
    order.append(best)
    ready.remove(best)
    remaining.subtract(state.operand_buffers(best))
    for s in state.succs[best]:
      waiting[s] -= 1
      if waiting[s] == 0:
        ready.append(s)
    ready.sort()
  if len(order) != len(program.nodes):
    raise ValueError("the program's dependencies have a cycle")
  return tuple(order)


def _backward(state: _State, chooser: _Chooser) -> tuple[int, ...]:
  """Place, last to first, the node whose operands add least net of the outputs it retires."""
  program, graph = state.program, chooser.graph
  live = set(state.outputs)

  def impact(i):
    added = [b for b in state.operand_buffers(i) if b not in live and b not in state.held]
    retired = [o for o in state.own_outputs(i) if o in live and o not in state.outputs]
    return _bytes(graph.bytes, added) - _bytes(graph.bytes, retired), len(added) - len(retired)

  waiting = [len(s) for s in state.succs]
  ready = sorted((i for i, w in enumerate(waiting) if w == 0), reverse=True)
  placed = []
  while ready:
    best = chooser.pick(ready, impact)
    placed.append(best)
    ready.remove(best)
    live -= set(state.own_outputs(best)) - state.outputs
    live |= set(state.operand_buffers(best))
    for p in state.preds[best]:
      waiting[p] -= 1
      if waiting[p] == 0:
        ready.append(p)
    ready.sort(reverse=True)
  if len(placed) != len(program.nodes):
    raise ValueError("the program's dependencies have a cycle")
  return tuple(reversed(placed))
