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

import bisect
import collections
import dataclasses
import functools
import itertools
import operator
from typing import Callable, Mapping, Sequence

import numpy as np

from jax_symmem._src import collector
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

  def __repr__(self) -> str:   # orders of a 1B-parameter step are 9,330 indices each
    return (f"Schedule({self.mode}, {len(self.order)} nodes, main order {self.source!r}, "
            f"{len(self.candidates)} candidates)")

  def order_for(self, graph: ShapeGraph, dims: Mapping[str, int],
                program: Program | None = None) -> tuple[int, ...]:
    """The candidate with the lowest modeled peak at `dims` (which order is best can
    depend on the shape, and at run time the shape is known), after the sink moves
    judged at exactly those dims: a fraction of a second for a 1B-parameter step, where
    the compile a new shape costs anyway takes many seconds (at b=4, s=1024 it takes
    that step's modeled peak from 1.0104 to 0.9962 x the static planner's)."""
    orders = [self.order] + [o for o in self.candidates.values() if o != self.order]
    best = min(orders, key=lambda o: memory.peak_at(graph, dims, program, o))
    if self.mode == "static":   # planned at exact dims already
      return best
    return tuple(sink(graph, best, dims, program)[0])


def _edges(program: Program):
  """(before, after) node pairs: a node runs after its operands' producers, and effects
  keep their trace order."""
  producer = {o: n.index for n in program.nodes for o in n.outputs}
  last_effect = None
  for n in program.nodes:
    for x in n.operands:
      if x in producer:
        yield producer[x], n.index
    if n.effects:
      if last_effect is not None:
        yield last_effect, n.index
      last_effect = n.index


def dependencies(program: Program) -> list[set[int]]:
  """preds[i]: nodes that must run before node i (data and effect order)."""
  preds: list[set[int]] = [set() for _ in program.nodes]
  for before, after in _edges(program):
    preds[after].add(before)
  return preds


def dependency_edges(program: Program) -> tuple[np.ndarray, np.ndarray]:
  """`dependencies` as two index arrays (before, after): what `is_valid_order` checks,
  built once where several orders of one program are checked."""
  edges = np.fromiter(itertools.chain.from_iterable(_edges(program)), np.int64)
  return edges[0::2], edges[1::2]


def is_valid_order(program: Program, order: Sequence[int],
                   edges: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
  """A permutation of the nodes that respects data and effect dependencies
  (`edges`: `dependency_edges(program)`, where the caller checks several orders)."""
  n = len(program.nodes)
  order = np.asarray(order, np.int64)
  if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
    return False
  before, after = dependency_edges(program) if edges is None else edges
  pos = np.empty(n, np.int64)
  pos[order] = np.arange(n)
  return bool(np.all(pos[before] < pos[after]))


@collector.paused()
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
  net_bytes = _NetBytes(graph)
  for k, point in enumerate(points):
    progress.update("schedule candidates at shape of interest", k + 1, len(points))
    suffix = "" if k == 0 else "@" + ",".join(f"{v}={point[v]}" for v in sorted(graph.dims)
                                                if v in point)
    listed = {}
    for name, list_pass in (("forward", _forward), ("backward", _backward)):
      chooser = _Chooser(Decider(graph.constraints, point, mode), net_bytes)
      listed[name] = list_pass(state, chooser)
      key = name + suffix
      if key in passes:   # shapes of interest that differ only in a var no argument's shape has
        key += f"#{k}"
      passes[key] = chooser.decider.counts
      choices += chooser.choices
    listed["trace"] = tuple(range(len(program.nodes)))
    # Each list schedule, then the same after local sink moves judged at that point.
    # At the other points only trace order is sunk (its sunk forms differ most across
    # shapes); a list order there gains as much from the sink at the run-time dims
    # (`order_for`): sinking them too changed no sampled peak in
    # experiments/bench_plan_time.py, not sinking trace order raised one by 0.56 %.
    for name, order in listed.items():
      found = [(name + suffix, order)]
      if k == 0 or name == "trace":
        sunk, moves[f"{name}+sink{suffix}"] = _sink(graph, state, order, point, donated)
        found.append((f"{name}+sink{suffix}", tuple(sunk)))
      for cand_name, cand in found:
        if k == 0 or cand not in candidates.values():   # extra points: new orders only
          candidates[cand_name] = cand
  # The main order: lowest peak at the shape of interest among the candidates that
  # never lose to trace order on a grid over the box (trace order itself qualifies).
  grid = [at] if exact_env is not None else [at] + memory.sample_points(graph)
  def peaks(order):
    return [memory.peak_at(graph, p, program, order, donated) for p in grid]
  # Only the schedules built at the shape of interest compete: the remat rounds are
  # planned on the main order there, and an order sunk at another shape can be lower
  # at this one yet leave the rounds less to evict (the small Llama's last round at
  # b=4, s=1024, modeled: 676 vs 449 MiB). The others serve round 0 where they are best.
  main = [name for name in candidates if "@" not in name]
  scored = {name: peaks(candidates[name]) for name in main}
  trace_peaks = scored["trace"]
  best = min((name for name in main
              if all(a <= b for a, b in zip(scored[name], trace_peaks))),
             key=lambda name: (scored[name][0], name != "trace+sink", name != "trace"))
  counts = sum(passes.values(), DecisionCounts())
  stats = dict(choices=choices, **counts.as_dict(), sink_moves=moves.get(best, 0),
               **{f"peak_{k}": v[0] for k, v in scored.items()})
  return Schedule(candidates[best], mode, stats, best, candidates, passes)


def bounds_level(graph: ShapeGraph, tight: Mapping[str, int], level: str) -> dict[str, int]:
  """Every bounded dim at its lower bound ("lo"), the geometric mean of its bounds
  ("geo") or their midpoint ("mid"); an unbounded one's top is its value in `tight`."""
  env = {}
  for v, lo, hi in graph.constraints.bounds:
    hi = tight.get(v, lo) if hi is None else hi
    env[v] = {"lo": lo, "geo": max(lo, round((lo * hi) ** 0.5)), "mid": (lo + hi) // 2}[level]
  return env


def _points_of_interest(graph: ShapeGraph, tight: Mapping[str, int]) -> list[dict[str, int]]:
  """The main shape of interest; every bounded dim at its lower bound, geometric mean and
  midpoint together (lengths spread over orders of magnitude); then each dim at its
  largest value with the others at their lower bounds (a long sequence in a small batch
  is where a list schedule judged at the largest batch falls furthest behind)."""
  points = [dict(tight)]
  def add(env):
    env = graph.constraints.complete(env)
    if graph.constraints.violation(env) is None and env not in points:
      points.append(env)
  for level in ("lo", "geo", "mid"):
    add(bounds_level(graph, tight, level))
  for top in graph.constraints.bounds:
    add({v: tight.get(v, lo) if v == top[0] else lo for v, lo, _ in graph.constraints.bounds})
  return points


def sink(graph: ShapeGraph, order: Sequence[int], at: Mapping[str, int],
         program: Program | None = None, donated: Sequence[int] = ()) -> tuple[list[int], int]:
  """`order` after the scheduler's local sink moves judged at dims `at`, and the moves made."""
  program = graph.traced.program if program is None else program
  return _sink(graph, _State(program, tuple(donated)), order, graph.constraints.complete(dict(at)),
               donated)


def _sink(graph, state: _State, order: Sequence[int], at, donated):
  """Local improvement: move each node, last first, to just before its first consumer
  unless that raises the peak at the shape of interest (neutral moves open later gains).

  A move of node i from position p to just before its first consumer at q changes
  the live-bytes profile only at positions p..q-1, so each trial move is judged
  from that window and the maxima of the profile before and after it
  (`_Profile`), not by simulating the whole order again.
  """
  tables = memory.order_tables(graph, at, state.program, donated)
  profile = _Profile(tables, order) if tables.exact else None
  order = list(order)
  current = memory.peak_at(graph, at, state.program, order, donated)
  moves = 0
  for i in reversed(range(len(order))):
    succs = state.succs[i]
    if not succs:
      continue
    if profile is not None:
      pos = profile.pos
      p = int(pos[i])
      q = int(min(map(pos.__getitem__, succs)))
      if q == p + 1:
        continue
      new = profile.trial(i, q)
      if new <= current:
        profile.accept()
        current, moves = new, moves + 1
      continue
    rest = [j for j in order if j != i]
    first = min(rest.index(s) for s in state.succs[i])
    if first == order.index(i):
      continue
    cand = rest[:first] + [i] + rest[first:]
    new = memory.peak_at(graph, at, state.program, cand, donated)
    if new <= current:
      order, current, moves = cand, new, moves + 1
  return (profile.order.tolist() if profile is not None else order), moves


def hoist(graph: ShapeGraph, order: Sequence[int], at: Mapping[str, int],
          program: Program | None = None, donated: Sequence[int] = ()) -> tuple[list[int], int]:
  """`order` after moving nodes earlier, each to just after its last predecessor, where
  that lowers the peak at dims `at`; and the moves made.

  The mirror of the sink: a node that reads a value last frees it sooner when it runs
  sooner. A remat round's order is the previous round's with each regeneration inserted
  before its consumer (`remat.apply_regions`), and the nodes after it kept their places,
  which suited values that were live anyway: on transformers' Flax Gemma (b=4, s=512)
  the value gradient's dot of a regenerated attention ran after the score gradient's,
  so the regenerated probabilities stayed live across it where XLA's scheduler runs
  that dot first (experiments/RESULTS.md, "Why Gemma's tightest budget took 9 compiles").
  `Analysis.round_footprint` predicts a round in the better of its order and this one.
  Judged with the sink's incremental profile, one pass first to last.
  """
  program = graph.traced.program if program is None else program
  tables = memory.order_tables(graph, graph.constraints.complete(dict(at)), program, donated)
  if not tables.exact or not order:
    return list(order), 0
  preds = dependencies(program)
  profile = _Profile(tables, order)
  current = max(profile.arguments, int(profile.step.max()))   # memory.peak_at's figure
  moves = 0
  for i in list(order):
    r = 1 + max((int(profile.pos[j]) for j in preds[i]), default=-1)
    if r >= profile.pos[i]:
      continue
    new = profile.trial_earlier(i, r)
    if new < current:
      profile.accept_earlier()
      current, moves = new, moves + 1
  return profile.order.tolist(), moves


class _Profile:
  """The live-bytes profile of an order under `memory.order_tables`' integer tables,
  updated in place when a node moves later (the sink) or earlier (the hoist).

  Moving node i from position p to just before position q shifts the nodes in
  between one step earlier and runs them before i: their live bytes lose i's net
  allocation, and gain the bytes of the buffers whose last read passes to i. So a
  trial move reads a few maxima of slices of the current profile, and an accepted
  one shifts a slice of it (`trial_earlier` is the mirror). Only the bytes while each
  step runs are kept (`step`); the bytes live before a step are those minus what it
  allocates.
  """

  def __init__(self, tables, order: Sequence[int]):
    t = tables
    n = len(order)
    self.arguments = t.arguments
    self.order = np.asarray(order, np.int64)
    self.pos = np.empty(n, np.int64)                          # node -> its position
    self.pos[self.order] = np.arange(n)
    self.reads = t.layout.reads                               # node -> buffers it reads
    self.size = t.buf_size.tolist()
    last_pos = np.full(len(t.buf_size), -1, np.int64)
    np.maximum.at(last_pos, t.use_buf, self.pos[t.use_node])
    last = self.order[last_pos]
    self.last = last.tolist()                                 # buffer -> its last reader
    self.running = (t.alloc + t.trans).tolist()               # node -> bytes it adds while it runs
    self.keep = (t.alloc - t.doa).tolist()                    # allocated and still live after
    freed = np.zeros(n, np.int64)
    np.add.at(freed, last, t.buf_size)
    self.freed = freed.tolist()                               # node -> bytes freed there
    seq = self.order
    net = t.alloc[seq] - t.doa[seq] - np.asarray(self.freed, np.int64)[seq]
    before = t.arguments + np.concatenate(([0], np.cumsum(net[:-1])))
    self.step = before + t.alloc[seq] + t.trans[seq]
    self._top = int(np.argmax(self.step)) if n else 0      # a position of the profile's max
    self._positions = np.arange(n)
    self._use = (t.use_buf, t.use_node)

  @functools.cached_property
  def readers(self) -> list[list[int]]:
    """buffer -> the nodes that read it (what an earlier move hands a buffer's last read to)."""
    readers: list[list[int]] = [[] for _ in self.size]
    for b, node in zip(*(a.tolist() for a in self._use)):
      readers[b].append(node)
    return readers

  def trial(self, i: int, q: int) -> int:
    """The peak if node i moved to just before position q (its first consumer)."""
    p, pos, last, size = int(self.pos[i]), self.pos, self.last, self.size
    net = self.keep[i] - self.freed[i]
    # Buffers i reads whose last read falls before q are now last read by i: freed later.
    handed = []
    for b in self.reads[i]:
      j = last[b]
      if j != i:
        at = pos[j]
        if at < q:
          handed.append((int(at), size[b], b))
    if len(handed) > 1:
      handed.sort()
    # The window's largest step after the move: the nodes between, one step earlier,
    # then i itself.
    step, parts, held, start = self.step, [], 0, p + 1
    for at, bytes_, _ in handed:
      if at >= start:
        parts.append(int(step[start:at + 1].max()) + held - net)
        start = at + 1
      held += bytes_
    if start < q:
      parts.append(int(step[start:q].max()) + held - net)
    i_before = int(step[q]) - self.running[int(self.order[q])] - net + held
    window = max(i_before + self.running[i], *parts)
    peak = max(self.arguments, window)
    top = self._top
    if not p <= top < q:          # the max lies outside the window: nothing else can beat it
      peak = max(peak, int(step[top]))
    else:
      if p > 0:
        peak = max(peak, int(step[:p].max()))
      if q < len(step):
        peak = max(peak, int(step[q:].max()))
    self._pending = (i, p, q, net, handed, i_before, window)
    return peak

  def accept(self):
    """Applies the last trial move."""
    i, p, q, net, handed, i_before, window = self._pending
    step, order = self.step, self.order
    if net:
      np.subtract(step[p + 1:q], net, out=step[p:q - 1])
    else:
      step[p:q - 1] = step[p + 1:q]
    for at, bytes_, _ in handed:   # the steps after the old last reader keep the buffer too
      step[at:q - 1] += bytes_
    step[q - 1] = i_before + self.running[i]
    if p <= self._top < q:
      self._top = int(step.argmax())
    elif window > step[self._top]:
      self._top = p + int(step[p:q].argmax())
    last, freed = self.last, self.freed
    for _, bytes_, b in handed:   # i is their last reader now
      freed[last[b]] -= bytes_
      freed[i] += bytes_
      last[b] = i
    order[p:q - 1] = order[p + 1:q]
    order[q - 1] = i
    self.pos[order[p:q]] = self._positions[p:q]

  def trial_earlier(self, i: int, r: int) -> int:
    """The peak if node i moved earlier, to position r (just after its last predecessor).

    The nodes from r to i's old position p run one step later, holding i's outputs
    (`keep`); each buffer i read last is freed earlier: where i now runs, or after its
    other last reader in that window.
    """
    p, pos, last, size = int(self.pos[i]), self.pos, self.last, self.size
    keep = self.keep[i]
    freed_at = []   # (the old position after which it is freed, bytes, buffer)
    for b in self.reads[i]:
      if last[b] == i:
        other = max((int(pos[j]) for j in self.readers[b] if j != i), default=-1)
        freed_at.append((max(other, r - 1), size[b], b))
    if len(freed_at) > 1:
      freed_at.sort()
    step, parts, released, start = self.step, [], 0, r
    for at, bytes_, _ in freed_at:
      end = min(at, p - 1)
      if end >= start:
        parts.append(int(step[start:end + 1].max()) + keep - released)
        start = end + 1
      released += bytes_
    if start < p:
      parts.append(int(step[start:p].max()) + keep - released)
    i_step = int(step[r]) - self.running[int(self.order[r])] + self.running[i]
    peak = max(self.arguments, i_step, *parts)
    top = self._top
    if not r <= top <= p:         # the max lies outside the window: nothing else can beat it
      peak = max(peak, int(step[top]))
    else:
      if r > 0:
        peak = max(peak, int(step[:r].max()))
      if p + 1 < len(step):
        peak = max(peak, int(step[p + 1:].max()))
    self._pending_earlier = (i, p, r, keep, freed_at, i_step)
    return peak

  def accept_earlier(self):
    """Applies the last `trial_earlier` move."""
    i, p, r, keep, freed_at, i_step = self._pending_earlier
    step, order = self.step, self.order
    released = np.zeros(p - r, np.int64)
    for at, bytes_, _ in freed_at:
      if at + 1 - r < p - r:
        released[at + 1 - r:] += bytes_
    step[r + 1:p + 1] = step[r:p] + keep - released
    step[r] = i_step
    last, freed = self.last, self.freed
    for at, bytes_, b in freed_at:   # another reader in the window now reads it last
      if at >= r:
        j = int(order[at])
        last[b] = j
        freed[j] += bytes_
        freed[i] -= bytes_
    order[r + 1:p + 1] = order[r:p].copy()
    order[r] = i
    self.pos[order[r:p + 1]] = self._positions[r:p + 1]
    self._top = int(step.argmax())


@dataclasses.dataclass(frozen=True)
class _State:
  """Buffers, uses and pinned buffers of a program (aliases share a buffer)."""
  program: Program
  donated: Sequence[int]

  @functools.cached_property
  def buffer(self) -> dict[int, int]:
    return memory.buffers(self.program)

  @functools.cached_property
  def operands(self) -> list[collections.Counter]:
    """node -> Counter of the buffers it reads (a buffer read twice counts twice)."""
    return [collections.Counter(self.buffer[x] for x in n.operands)
            for n in self.program.nodes]

  @functools.cached_property
  def own(self) -> list[list[int]]:
    """node -> the outputs that own a buffer (not aliases of an operand)."""
    return [[o for o in n.outputs if self.buffer[o] == o] for n in self.program.nodes]

  @functools.cached_property
  def read_count(self) -> collections.Counter:
    """buffer -> how many times the nodes read it (every forward pass starts from it)."""
    count = collections.Counter()
    for ops in self.operands:
      count.update(ops)
    return count

  @functools.cached_property
  def readers(self) -> dict[int, list[int]]:
    """buffer -> the nodes that read it."""
    readers = collections.defaultdict(list)
    for i, ops in enumerate(self.operands):
      for b in ops:
        readers[b].append(i)
    return readers

  @functools.cached_property
  def producer(self) -> dict[int, int]:
    """buffer -> the node whose own output it is."""
    return {o: i for i, outs in enumerate(self.own) for o in outs}

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


class _NetBytes:
  """Net bytes of allocating some buffers and freeing others, as polynomials, shared by
  every list pass of one `schedule` (they do not depend on the shape of interest).
  Keyed by the buffers' sizes, not their ids: a model's layers repeat a few sizes."""

  def __init__(self, graph: ShapeGraph):
    self.graph = graph
    self._size_id: dict[int, int] = {}      # buffer -> index of its size in _sizes
    self._ids: dict[Poly, int] = {}
    self._sizes: list[Poly] = []
    self._net: dict[tuple, Poly] = {}
    self._keys: dict[tuple, tuple] = {}    # (allocated, freed) buffers -> key

  def key(self, allocated, freed) -> tuple:
    buffers = (tuple(allocated), tuple(freed))
    key = self._keys.get(buffers)
    if key is None:
      key = self._keys[buffers] = (tuple(sorted(map(self._size_of, allocated))),
                                   tuple(sorted(map(self._size_of, freed))))
    return key

  def _size_of(self, b: int) -> int:
    k = self._size_id.get(b)
    if k is None:
      size = self.graph.bytes(b)
      k = self._ids.get(size)
      if k is None:
        k = self._ids[size] = len(self._sizes)
        self._sizes.append(size)
      self._size_id[b] = k
    return k

  def __call__(self, key: tuple) -> Poly:
    net = self._net.get(key)
    if net is None:
      allocated, freed = key
      total = ZERO
      for k in allocated:
        total = total + self._sizes[k]
      for k in freed:
        total = total - self._sizes[k]
      net = self._net[key] = total
    return net


class _Chooser:
  """Picks the smallest impact among ready nodes (`decider` counts how each comparison went).

  An impact is a small integer naming (interned net bytes, net buffer count).
  """

  def __init__(self, decider: Decider, net_bytes: _NetBytes):
    self.decider = decider
    self.choices = 0
    self._net_bytes = net_bytes
    self._impacts: dict[tuple, int] = {}           # net-bytes key -> impact
    self._pairs: list[tuple[int, int]] = []        # impact -> (interned bytes, buffer count)
    self._beats: dict[int, dict[int, tuple]] = {}  # best -> impact -> (outcome, better)

  def impact(self, allocated, freed) -> int:
    """The impact of allocating buffers `allocated` and freeing `freed`."""
    key = self._net_bytes.key(allocated, freed)
    k = self._impacts.get(key)
    if k is None:
      pair = (self.decider.intern(self._net_bytes(key)), len(allocated) - len(freed))
      k = self._impacts[key] = len(self._pairs)
      self._pairs.append(pair)
    return k

  def _beat(self, impact: int, best: int) -> tuple:
    """(which count comparing `impact` with `best` adds to, whether it beats `best`)."""
    (bytes_, count), (best_bytes, best_count) = self._pairs[impact], self._pairs[best]
    outcome, decision = self.decider.lookup(bytes_, best_bytes)
    return outcome, impact != best and _better(decision, count, best_count)

  def pick(self, ready: "_Ready") -> int:
    """The node a scan of the ready nodes in preference order would pick: the first
    whose impact beats the best so far becomes the best.

    Ready nodes sharing an impact are one group, and a scan is a few steps over the
    groups (a 1B-parameter step has ~125 ready nodes in ~5 groups): from the current
    best, the next best is the earliest node after it in a group that beats it. Every
    node the scan would compare is counted, with its group's outcome against the best
    it would meet.
    """
    self.choices += 1
    best = ready.first()
    if len(ready.impact_of) == 1:
      return best
    bisect_right = bisect.bisect_right
    outcomes: dict[str | None, int] = {}
    best_key, best_impact = ready.sign * best, ready.impact_of[best]
    # Per group with nodes after the best: [impact, sorted keys, how many of them come
    # before or at the best] (at first, the best is the most preferred node).
    scan = []
    for impact, keys in ready.groups.items():
      k = int(impact == best_impact)
      if k < len(keys):
        scan.append([impact, keys, k])
    while True:
      row = self._beats.get(best_impact)
      if row is None:
        row = self._beats[best_impact] = {}
      next_key = None
      for impact, keys, k in scan:
        verdict = row.get(impact)
        if verdict is None:
          verdict = row[impact] = self._beat(impact, best_impact)
        if verdict[1] and (next_key is None or keys[k] < next_key):
          next_key = keys[k]
      if next_key is None:   # nothing after the best beats it: all the rest meet it
        for impact, keys, k in scan:
          outcome = row[impact][0]
          outcomes[outcome] = outcomes.get(outcome, 0) + len(keys) - k
        break
      # The nodes after the best up to the next best meet the best; a group whose
      # nodes all come before the next best drops out of the scan.
      left = []
      for entry in scan:
        impact, keys, k = entry
        if keys[k] > next_key:
          left.append(entry)
          continue
        hi = bisect_right(keys, next_key, k)
        outcome = row[impact][0]
        outcomes[outcome] = outcomes.get(outcome, 0) + hi - k
        if hi < len(keys):
          entry[2] = hi
          left.append(entry)
      scan = left
      best_key = next_key
      best_impact = ready.impact_of[ready.sign * best_key]
    self.decider.count(outcomes)
    return ready.sign * best_key


class _Ready:
  """The ready nodes, grouped by impact (`impact(i)`, computed when a node becomes
  ready); each group's preference keys sorted.

  Forward passes prefer low node indices, backward passes high ones: node i's key is
  `sign * i` (sign -1 for a backward pass), and the lowest key is the most preferred.
  A waiting node's impact may change when another node is placed: `stale(i)`
  marks it, and it is recomputed and regrouped before the next pick.
  """

  def __init__(self, impact: Callable[[int], int], descending: bool):
    self.impact, self.sign = impact, -1 if descending else 1
    self.groups: dict[int, list[int]] = {}
    self.impact_of: dict[int, int] = {}
    self._stale: set[int] = set()

  def add(self, i: int) -> None:
    impact = self.impact_of[i] = self.impact(i)
    bisect.insort(self.groups.setdefault(impact, []), self.sign * i)

  def remove(self, i: int) -> None:
    impact = self.impact_of.pop(i)
    keys = self.groups[impact]
    del keys[bisect.bisect_left(keys, self.sign * i)]
    if not keys:
      del self.groups[impact]

  def stale(self, i: int) -> None:
    if i in self.impact_of:
      self._stale.add(i)

  def first(self) -> int:
    """The most preferred ready node (after regrouping stale ones)."""
    for i in self._stale:
      self.remove(i)
      self.add(i)
    self._stale.clear()
    return self.sign * min(map(operator.itemgetter(0), self.groups.values()))


def _better(decision, count: int, best_count: int) -> bool:
  """Whether an impact with `count` net buffers beats the best's, given how their bytes compare."""
  if decision.sign is None:   # undecidable: the size-blind rule, fewer net buffers started
    return count < best_count
  # Equal at every shape (or at the exact dims): fewer buffers wins; equal only at
  # the shape of interest (DEPENDS): the current best stays (`ready`'s preference).
  return decision.sign < 0 or (decision.sign == 0 and decision.proven and count < best_count)


def _list_pass(state: _State, chooser: _Chooser, impact: Callable[[int], int],
               descending: bool, blockers: Sequence[Sequence[int]],
               unblocks: Sequence[Sequence[int]], placed: Callable[[int, _Ready], None]
               ) -> list[int]:
  """A list scheduler: a node is ready once its `blockers` are placed; the chooser picks
  among the ready by `impact`; `placed(node, ready)` updates the pass's own state and
  marks stale the ready nodes whose impact it changed. Returns the nodes in placement order."""
  ready = _Ready(impact, descending)
  waiting = [len(b) for b in blockers]
  for i, w in enumerate(waiting):
    if w == 0:
      ready.add(i)
  order = []
  while ready.impact_of:
    best = chooser.pick(ready)
    order.append(best)
    ready.remove(best)
    placed(best, ready)
    for j in unblocks[best]:
      waiting[j] -= 1
      if waiting[j] == 0:
        ready.add(j)
  if len(order) != len(state.program.nodes):
    raise ValueError("the program's dependencies have a cycle")
  return order


def _forward(state: _State, chooser: _Chooser) -> tuple[int, ...]:
  """Place, first to last, the ready node that allocates least net of what it frees."""
  remaining = collections.Counter(state.read_count)
  keep = state.held | state.outputs

  def impact(i):
    new = state.own[i]
    ending = [b for b, k in state.operands[i].items() if remaining[b] == k and b not in keep]
    return chooser.impact(new, ending)

  def placed(best, ready):
    for b, k in state.operands[best].items():
      left = remaining[b] = remaining[b] - k
      if left:                         # a buffer's last reader now ends it: its impact drops
        for r in state.readers[b]:
          if state.operands[r][b] == left:
            ready.stale(r)
  return tuple(_list_pass(state, chooser, impact, False, state.preds, state.succs, placed))


def _backward(state: _State, chooser: _Chooser) -> tuple[int, ...]:
  """Place, last to first, the node whose operands add least net of the outputs it retires."""
  live = set(state.outputs)

  def impact(i):
    added = [b for b in state.operands[i] if b not in live and b not in state.held]
    retired = [o for o in state.own[i] if o in live and o not in state.outputs]
    return chooser.impact(added, retired)

  def placed(best, ready):
    nonlocal live
    retired = set(state.own[best]) - state.outputs
    added = set(state.operands[best]) - live
    live -= retired
    live |= added
    for b in retired | added:          # the impacts of nodes touching them may have changed
      for r in state.readers.get(b, ()):
        ready.stale(r)
      if b in state.producer:
        ready.stale(state.producer[b])
  return tuple(reversed(_list_pass(state, chooser, impact, True, state.succs, state.preds,
                                   placed)))
