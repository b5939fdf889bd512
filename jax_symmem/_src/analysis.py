"""The compile-time pipeline: trace -> shape graph -> schedule -> remat rounds -> Analysis.

An `Analysis` holds everything symbolic about a training step, made once for
all shapes; `choose_round(dims, budget)` is the run-time decision: the first round
of evictions on the `ladder` (by the recomputation each adds) whose modeled peak fits
the budget at those dims. `symmem.jit` decides by `round_footprint` instead: XLA's
footprint predicted from the model's live ranges (`xla_buffers`), the figure it then
checks with XLA's own.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from absl import logging

from jax_symmem._src import budget as budget_lib
from jax_symmem._src import collector
from jax_symmem._src import fence
from jax_symmem._src import memory
from jax_symmem._src import plan_cache
from jax_symmem._src import progress
from jax_symmem._src.decider import DecisionCounts
from jax_symmem._src.device import live_bytes as _live_bytes
from jax_symmem._src import remat
from jax_symmem._src import schedule as schedule_lib
from jax_symmem._src import shard_map_merge
from jax_symmem._src import sharding as sharding_lib
from jax_symmem._src import xla_buffers
from jax_symmem._src.budget import sizes
from jax_symmem._src.errors import BudgetError, PlanningError, SymmemError
from jax_symmem._src.ir import Program
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.tracing import TracedProgram, integer_dims


def first_round(peaks: Sequence[int], fits: Callable[[int], bool]) -> tuple[int, bool]:
  """(round, whether it fits): the first round whose predicted peak fits, else the one
  with the smallest predicted peak (the earliest of equals). `peaks` is read in order
  and only up to the first that fits."""
  for k, peak in enumerate(peaks):
    if fits(peak):
      return k, True
  return min(range(len(peaks)), key=lambda k: (peaks[k], k)), False


# symmem.jit decides by XLA's footprint predicted from the model (`xla_buffers`: values
# XLA fuses left out, outputs in buffers of their own); JAX_SYMMEM_XLA_BUFFERS=0 makes it
# decide by the op-by-op modeled peak, as before.
PREDICT_XLA_BUFFERS = os.environ.get("JAX_SYMMEM_XLA_BUFFERS", "1") != "0"


class InOrder(Sequence[int]):
  """`values` (indexed by round) read in the order `order` gives the rounds: the search
  for a fitting round (`variants.search_rounds`, `refine_round`, `first_round`) walks
  positions on `Analysis.ladder`, and callers map positions back to rounds."""

  def __init__(self, values: Sequence[int], order: Sequence[int]):
    self._values, self._order = values, order

  def __len__(self) -> int:
    return len(self._order)

  def __getitem__(self, p):
    return self._values[self._order[p]]


class RoundPeaks(Sequence[int]):
  """Every round's modeled peak at dims, or with `predicted` its `dispatch_figure` (times
  `scale[k]` where given), each computed when first read (the analysis caches them): a
  step whose first round fits never models the others."""

  def __init__(self, analysis: "Analysis", dims: Mapping[str, int],
               scale: Mapping[int, float] | None = None, predicted: bool = False):
    self._analysis, self._dims, self._scale = analysis, dims, scale or {}
    self._figure = analysis.dispatch_figure if predicted else analysis.round_peak

  def __len__(self) -> int:
    return len(self._analysis.rounds)

  def __getitem__(self, k):
    k = range(len(self))[k]
    return int(self._figure(k, self._dims) * self._scale.get(k, 1.0))


class Planning:
  """An analysis' schedule, rematerialization rounds and planner statistics: made by
  `make` on first use, once. `symmem.jit` without a budget runs each shape as the user
  wrote it, which reads none of them, so it defers them (`analyze_function(lazy=True)`):
  a job that never needs a round never pays for planning one (seconds at 1B parameters).
  `annotated`: whether the rounds end with the step as written (its jax.checkpoint
  regions), which `Analysis.is_as_written` needs to know without planning."""

  def __init__(self, make: Callable[[], tuple], annotated: bool):
    self._make, self.annotated = make, annotated
    self._value: tuple | None = None
    self._lock = threading.Lock()

  @property
  def done(self) -> bool:
    return self._value is not None

  def get(self) -> tuple[schedule_lib.Schedule, Sequence[remat.Round], Mapping[str, int]]:
    with self._lock:   # symmem.jit may be called from several threads
      if self._value is None:
        self._value = self._make()
        self._make = None
      return self._value


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
  """Symbolic analysis of a step: its graph, schedule and rematerialization rounds."""
  traced: TracedProgram
  graph: ShapeGraph
  planning: Planning
  memory_budget: int | None
  origin: str = "planned"   # or the plan cache file whose decisions were replayed
  # `memory_budget` is the device's memory limit (symmem.jit given no memory_budget).
  device_limit: bool = False
  # Wall seconds of `analyze_function`: "trace" (JAX tracing the step, which jax.jit
  # pays as well) and "plan" (all after it: planning, or replaying a cached plan; a
  # lazy `Planning` adds its time when it runs).
  seconds: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)
  _round0_orders: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _round_peaks: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _round_footprints: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _round_scratch: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _unplanned_footprints: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  _ladders: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  @property
  def schedule(self) -> schedule_lib.Schedule:
    return self.planning.get()[0]

  @property
  def rounds(self) -> Sequence[remat.Round]:   # a tuple, or remat.ReplayedRounds (built on demand)
    return self.planning.get()[1]

  @property
  def remat_stats(self) -> Mapping[str, int]:
    return self.planning.get()[2]

  def __repr__(self) -> str:   # `print(analysis.plan)` shows the plan itself
    budget = ("no budget" if self.memory_budget is None else
              f"{'device limit' if self.device_limit else 'budget'} {self.memory_budget:,} B")
    return (f"Analysis({self.traced.fun_name}: dims {', '.join(self.traced.dims) or 'none'}, "
            f"{len(self.traced.program.nodes)} nodes, {len(self.rounds) - 1} rounds of "
            f"eviction, {budget}, {self.origin})")

  # -- run-time decision --
  def choose_round(self, dims: Mapping[str, int], budget: int | None,
                   reserved: int = 0, scale: Mapping[int, float] | None = None, *,
                   device_limit: bool = False) -> int:
    """The first round on the `ladder` whose predicted peak (plus `reserved` bytes held by
    others) fits.

    The prediction is the modeled peak, times `scale[k]` where the caller has
    calibrated round k against what XLA reported for compiled variants.
    Raises BudgetError, naming the smallest achievable peak, when none fits by the
    model (`symmem.jit` instead asks XLA before refusing: `best_round`); `device_limit`:
    the budget is the device's memory limit, and the error says so.
    """
    dims, budget = integer_dims(dims), budget_lib.bytes_only(budget)
    k, fits = self.best_round(dims, budget, reserved, scale)
    if fits:
      return k
    best = int(self.round_peak(k, dims) * (scale or {}).get(k, 1.0))
    budget_str, best_str, *reserved_str = sizes(budget, best, *((reserved,) if reserved else ()))
    bound = (f"the device's {budget_str} memory limit" if device_limit
             else f"memory budget {budget_str}")
    advice = budget_lib.refusal_advice(device_limit)
    raise BudgetError(
        f"{bound} is below the smallest achievable peak at "
        f"{dict(dims)}: {best_str} " + ("predicted" if scale else "modeled")
        + (f" plus {reserved_str[0]} held by other live arrays" if reserved else "")
        + f"; {advice} (this is the op-by-op model's verdict: symmem.jit refuses only after "
        "XLA's memory_analysis() says no variant fits, and XLA, which fuses ops, can need "
        "less)")

  def best_round(self, dims: Mapping[str, int], budget: int | None, reserved: int = 0,
                 scale: Mapping[int, float] | None = None,
                 predicted: bool = False) -> tuple[int, bool]:
    """(round, whether it fits): the first round on the `ladder` predicted to fit, else
    the round with the smallest predicted peak. The ladder orders the rounds by the
    recomputation they add, so the first that fits is the one that recomputes least.
    Without a budget (and no device limit): the step as the user wrote it, with their
    jax.checkpoint regions if any."""
    if budget is None:
      return self.as_written_round, True
    if type(budget) is not int:   # a size string such as '200MiB'
      budget = budget_lib.bytes_only(budget)
    order = self.ladder(dims)
    p, fits = first_round(InOrder(RoundPeaks(self, dims, scale, predicted), order),
                          lambda peak: peak + reserved <= budget)
    return order[p], fits

  def ladder(self, dims: Mapping[str, int]) -> tuple[int, ...]:
    """Every round, in the order `symmem.jit` tries them at dims: by the recomputation
    each adds. The planner's rounds come in that order (each evicts more than the one
    before); an annotated step's round as written (the user's jax.checkpoint regions)
    goes before the first planned round that recomputes more FLOPs than it at dims, so
    that wherever the step as written fits, no round recomputing more runs in its place
    (transformers' BERT with gradient_checkpointing, s=512: a planned round recomputing
    1.13 x its FLOPs by XLA's cost_analysis, in as much memory, ran 1.17 x its time;
    experiments/third_party.py).
    Without jax.checkpoint regions: the rounds in index order."""
    dims = integer_dims(dims)
    key = tuple(sorted(dims.items()))
    if key not in self._ladders:
      self.check_dims(dims)
      rounds, written = self.rounds, self.as_written_round
      order = list(range(len(rounds)))
      if written:
        last = remat.last_planned(rounds)
        node_flops = remat.NodeFlops(self.graph.constraints.complete(dict(dims)))
        flops = lambda k: node_flops.total(rounds[k].graph, rounds[k].program)
        target = flops(written)
        at = next((k for k in range(1, last + 1) if flops(k) > target), last + 1)
        order.remove(written)
        order.insert(at, written)
      self._ladders[key] = tuple(order)
    return self._ladders[key]

  def floor_round(self, dims: Mapping[str, int]) -> int:
    """The planner's least-memory round at dims: the first whose predicted footprint
    (`dispatch_figure`) is the least of the planned rounds'. The rounds planned at smaller
    dims (step 3 of README's "What happens on a call") follow those planned at the
    largest, and at the largest dims they add recomputation without a predicted saving:
    a Flax ResNet's last round at 128 pixels took 243 GFLOP in 231 MiB by XLA's figure,
    where round 16 took 97 GFLOP in 122 MiB (`experiments.round_cost --workloads resnet`).
    What a speed trial times against the dispatched round."""
    last = remat.last_planned(self.rounds)
    return min(range(last + 1), key=lambda k: (self.dispatch_figure(k, dims), k))

  def is_as_written(self, k: int) -> bool:
    """Whether round k is the step as the user wrote it (`as_written_round`), answered
    without planning where it is round 0 (with jax.checkpoint regions round 0 is the
    step without them, and their round follows the planner's)."""
    if not self.planning.annotated:
      return k == 0
    return k > 0 and k == self.as_written_round

  def round_program(self, k: int) -> Program:
    """Round k's program; round 0's is the traced program, read without planning."""
    return self.rounds[k].program if k else self.graph.traced.program

  @property
  def as_written_round(self) -> int:
    """The round that is the step exactly as the user wrote it: an annotated step's round
    as written (with its jax.checkpoint regions), else round 0. It follows the planner's
    last round; the rounds before are not read (a stored plan rebuilds them lazily)."""
    if not self.planning.annotated:
      return 0
    rounds = self.rounds
    return next((k for k in range(remat.last_planned(rounds) + 1, len(rounds))
                 if rounds[k].as_written), 0)

  def round_peak(self, k: int, dims: Mapping[str, int]) -> int:
    """Modeled peak of round k at dims; round 0 takes the best candidate order there."""
    dims = integer_dims(dims)   # before the cache: 4.0 would find 4's entry
    key = (k, tuple(sorted(dims.items())))
    if key not in self._round_peaks:   # the run-time decision asks for these often
      self.check_round(k)
      self.check_dims(dims)
      r = self.rounds[k]
      self._round_peaks[key] = memory.peak_at(r.graph, dims, r.program, self.round_order(k, dims))
    return self._round_peaks[key]

  def round_footprint(self, k: int, dims: Mapping[str, int]) -> int:
    """XLA's footprint of round k at dims, predicted from the model's live ranges
    (`xla_buffers.footprint_at`: values XLA's fusion computes inside their readers left
    out, each output in an allocation of its own held to the end; a planned round's
    large random draws pinned and their masks stored, as `variants` compiles them)."""
    dims = integer_dims(dims)
    key = (k, tuple(sorted(dims.items())))
    if key not in self._round_footprints:
      self.check_round(k)
      self.check_dims(dims)
      r = self.rounds[k]
      pinned = frozenset() if self.is_as_written(k) else fence.pinned_draws(
          r.graph, r.program, self.graph.constraints.complete(dims), fence.MIN_BYTES)
      # XLA schedules each round itself, within the fences, taking the least memory of
      # its schedulers'. Round 0 has no fences, and one of them follows the dataflow (the
      # trace's order). A later round's order is round 0's with its regenerations
      # inserted (`remat.apply_regions`); XLA runs what reads a regenerated value last
      # as soon as its operands exist where that frees memory, as `schedule.hoist` does
      # (experiments/RESULTS.md, "Why Gemma's tightest budget took 9 compiles").
      order = self.round_order(k, dims)
      if k:
        hoisted, moves = schedule_lib.hoist(r.graph, order, dims, r.program)
        orders = [order, hoisted] if moves else [order]
      else:
        orders = [order, range(len(r.program.nodes))]
      kept = fence.kept_values(r.program, pinned).values()
      self._round_footprints[key] = min(
          xla_buffers.footprint_at(r.graph, dims, r.program, order, pinned=pinned, kept=kept)
          for order in orders)
    return self._round_footprints[key]

  def round_scratch(self, k: int, dims: Mapping[str, int]) -> int:
    """Bytes round k holds at dims outside XLA's buffers (`xla_buffers.convolution_scratch`):
    `symmem.jit` adds them to XLA's figure and to `round_footprint` (`dispatch_figure`)."""
    dims = integer_dims(dims)
    key = (k, tuple(sorted(dims.items())))
    if key not in self._round_scratch:   # a walk over every node: asked per round and shape
      self.check_round(k)
      self.check_dims(dims)
      self._round_scratch[key] = xla_buffers.convolution_scratch(
          self.graph.constraints.complete(dict(dims)), self.round_program(k))
    return self._round_scratch[key]

  def unplanned_footprint(self, dims: Mapping[str, int], donated: Iterable[int] = ()) -> int:
    """Round 0's XLA footprint at dims predicted without planning (`round_footprint` reads
    the schedule): the model's live ranges in the trace's order, which XLA does not follow
    anyway (DESIGN.md F4), plus the scratch XLA leaves out. `donated`: the flat argument
    positions whose buffers outputs may reuse. What `symmem.jit` under a device's limit
    reads before compiling the step as written (XLA's figure was 0.98-1.14 x it on four
    third-party steps at three lengths: experiments/RESULTS.md, "The step as written,
    predicted before planning")."""
    dims = integer_dims(dims)
    key = (tuple(sorted(dims.items())), tuple(sorted(donated)))
    if key not in self._unplanned_footprints:
      self.check_dims(dims)
      program = self.graph.traced.program
      self._unplanned_footprints[key] = self.round_scratch(0, dims) + xla_buffers.footprint_at(
          self.graph, dims, program, range(len(program.nodes)), donated=key[1])
    return self._unplanned_footprints[key]

  def dispatch_figure(self, k: int, dims: Mapping[str, int]) -> int:
    """What `symmem.jit` compares with a budget before compiling: `round_footprint`, or
    the modeled peak where `PREDICT_XLA_BUFFERS` is off; with the scratch XLA's figure
    leaves out (`round_scratch`), which `symmem.jit` adds to XLA's figure too."""
    return self.round_scratch(k, dims) + (
        self.round_footprint(k, dims) if PREDICT_XLA_BUFFERS else self.round_peak(k, dims))

  def round_order(self, k: int, dims: Mapping[str, int]) -> tuple[int, ...]:
    """Round k's order at dims; round 0 picks the best scheduler candidate there."""
    if k:
      return self.rounds[k].order
    key = tuple(sorted(dims.items()))
    if key not in self._round0_orders:
      self._round0_orders[key] = self.schedule.order_for(self.graph, dims)
    return self._round0_orders[key]

  # -- the guarded rewrite --
  def guarded_function(self, dims: Mapping[str, int], budget: int | None = None) -> Callable:
    """The last round's program with every region behind a host-decided `lax.cond`.

    Returns `fn(*flat_args) -> flat outputs` for arguments of shape `dims`. Each
    region's recomputation runs under `lax.cond(pred, regenerate, keep)`, where
    `pred` comes from an `io_callback` that reads live memory and asks
    `choose_round` whether that region's round is needed. It computes the same
    numbers under plain `jax.jit`, but inside one executable XLA must keep what
    either branch reads, so it saves no memory (DESIGN.md F5); `symmem.jit`
    resolves the same guards on the host before dispatch instead.
    """
    import jax
    from jax.experimental import io_callback
    from jax_symmem._src import tracing
    env = self.graph.constraints.complete(dict(dims))
    last = [r for r in self.rounds if not r.as_written][-1]
    program = tracing.specialize_program(last.program, env)
    # A block's recomputation runs as one guarded unit where its last node stands
    # (its fence runs unguarded, in place: later nodes read the fenced trigger).
    # Blocks whose intermediates other nodes read (a later region anchored on them, a
    # recomputation shared with another region of the same consumer) stay
    # unguarded: always recomputed, still exact.
    blocks = [(j, b) for j, r in enumerate(self.rounds) for b in r.blocks]
    members: dict[int, list] = {}
    for _, b in blocks:
      for n in b.clones:
        members.setdefault(n, []).append(b)
    readers: dict[int, set[int]] = {}
    for n in program.nodes:
      for x in n.inputs:
        if not isinstance(x, tracing.Const):
          readers.setdefault(x, set()).add(n.index)
    kept = {b.region.value for _, b in blocks}   # what each block's `keep` branch reads
    def self_contained(b):
      if any(members[n] != [b] for n in b.clones):
        return False
      inner = {o for n in b.clones for o in program.nodes[n].outputs} - {b.regenerated}
      return not inner & kept and all(members.get(r) == [b] for o in inner
                                      for r in readers.get(o, ()))
    guarded = {b.clones[-1]: (j, b) for j, b in blocks if b.clones and self_contained(b)}
    skip = {n for _, b in guarded.values() for n in b.clones[:-1]}

    argument_bytes = sum(self.graph.bytes(v).evaluate(env) for v in self.traced.program.inputs)

    def needed(j: int) -> bool:
      reserved = max(0, _live_bytes() - argument_bytes) if budget is not None else 0
      try:
        return self.choose_round(dims, budget, reserved) >= j
      except BudgetError:   # nothing fits: evict all there is
        return True

    def run_nodes(values, indices):
      read = lambda x: x.value if isinstance(x, tracing.Const) else values[x]
      for i in indices:
        node = program.nodes[i]
        values.update(zip(node.outputs, tracing.bind(
            node.primitive, [read(x) for x in node.inputs], node.params)))

    def fn(*flat_args):
      values = dict(zip(program.inputs, flat_args))
      for i in last.order:
        if i in skip:
          continue
        if i not in guarded:
          run_nodes(values, [i])
          continue
        j, block = guarded[i]
        def regenerate(_, block=block):
          local = dict(values)
          run_nodes(local, block.clones)
          return local[block.regenerated]
        keep = lambda _, block=block: values[block.region.value]
        pred = io_callback(functools.partial(needed, j), jax.ShapeDtypeStruct((), bool))
        values[block.regenerated] = jax.lax.cond(pred, regenerate, keep, 0)
      return [x.value if isinstance(x, tracing.Const) else values[x] for x in program.outputs]
    return fn

  # -- reports --
  def check_round(self, k: int) -> None:
    """Raises unless k names one of the plan's rounds (no negative index from the end)."""
    valid = not isinstance(k, bool) and hasattr(k, "__index__") and (
        k == 0 or 0 < k < len(self.rounds))   # round 0 always is: known without planning
    if not valid:
      raise ValueError(f"round {k!r}: {self.traced.fun_name}'s plan has rounds 0 to "
                       f"{len(self.rounds) - 1}")

  def check_dims(self, dims: Mapping[str, int]) -> None:
    """Raises unless `dims` names every dim of the step, no other, and meets the
    constraints: the plan holds within them only (`TracedProgram.check_dims`)."""
    self.traced.check_dims(dims)

  def peak_bytes(self, **dims: int) -> int:
    """Modeled peak of the round the op-by-op model picks at these dims under the budget
    (`choose_round`). `symmem.jit` picks by its prediction of XLA's figure
    (`best_round(dims, budget, predicted=True)`) and then XLA's own, so it can run an
    earlier round (`step.last_call["round"]`) whose modeled peak is above the budget."""
    dims = integer_dims(dims)
    return self.round_peak(self.choose_round(dims, self.memory_budget,
                                             device_limit=self.device_limit), dims)

  def baseline_peak_bytes(self, **dims: int) -> int:
    """Modeled peak in trace order without rematerialization."""
    dims = integer_dims(dims)
    self.check_dims(dims)
    return memory.peak_at(self.graph, dims)

  def static_peak_bytes(self, **dims: int) -> int:
    """The same pipeline planned with exact shapes (the paper's static anchor). Without a
    budget, that of the step as written, as `peak_bytes` (an annotated step's
    jax.checkpoint regions kept)."""
    dims = integer_dims(dims)
    self.check_dims(dims)
    if self.memory_budget is None and self.as_written_round:
      graph = self.rounds[self.as_written_round].graph
      return memory.peak_at(graph, dims, order=schedule_lib.schedule(graph, dims=dims).order)
    sched, rounds, _ = _plan(self.graph, dims)
    peaks = [memory.peak_at(self.graph, dims, order=sched.order)] + [
        r.peak_at(dims) for r in rounds[1:]]
    if self.memory_budget is None:
      return peaks[0]
    fitting = [p for p in peaks if p <= self.memory_budget]
    return fitting[0] if fitting else min(peaks)

  @property
  def stats(self) -> dict[str, int]:
    s = self.schedule.stats
    r = self.remat_stats
    both = DecisionCounts.from_stats(s) + DecisionCounts.from_stats(r)
    return {
        **both.as_dict(),
        "schedule_comparisons": s["comparisons"],
        "remat_comparisons": r["comparisons"],
        "remat_rounds": r["rounds"],
        "regions": sum(len(x.regions) for x in self.rounds),
    }

  @property
  def plan(self) -> str:
    """Each round's regions: value, source line, bytes saved, cost, guard, and its peak by
    the op-by-op model (cheap for every round). `symmem.jit` compares the footprint it
    predicts (`dispatch_figure`: the same live ranges laid out as XLA's buffer assigner
    lays them out) with a budget; the two can part ways (a round's recomputation that the
    model counts above round 0 where XLA's layout puts it below), and the prediction costs
    a layout per round (seconds for every round of a 1B-parameter step), so the plan's
    header names it rather than printing it."""
    at = self.graph.report_dims()
    lines = [f"rematerialization plan for {self.traced.fun_name} "
             f"({len(self.rounds) - 1} rounds; schedule from the {self.schedule.source} candidate; "
             "peaks by the op-by-op model: symmem.jit decides by the footprint "
             "analysis.dispatch_figure(k, dims) predicts)"]
    for k, r in enumerate(self.rounds[1:], start=1):
      what = " (the step as written, with its jax.checkpoint regions)" if r.as_written else ""
      lines.append(f" round {k}{what}: guard 'modeled peak of round {k - 1} + live bytes > "
                   f"budget'; modeled peak at {at} -> {r.peak_at(at) / 2**20:.1f} MiB")
      for region in r.regions:
        lines.append("   " + region.describe(r.graph, **at))
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.plan


def _plan(graph: ShapeGraph, dims: Mapping[str, int] | None):
  """(schedule, rounds, remat stats) planned at `dims` (None: symbolically)."""
  sched = schedule_lib.schedule(graph, dims=dims)
  rounds, stats = remat.plan_rounds(graph, sched.order, shape_of_interest=dims)
  return sched, rounds, stats


def _graph(traced: TracedProgram, argument_divisors) -> ShapeGraph:
  progress.update("shape graph", values=len(traced.program.avals))
  graph = ShapeGraph(traced)
  split = argument_divisors is not None and any(d > 1 for ds in argument_divisors for d in ds)
  if split or sharding_lib.runs_shard_map(traced.program):
    graph = graph.per_device(sharding_lib.propagate(traced.program, argument_divisors,
                                                    lambda v: graph.values[v].dims))
  return graph


def analyze_traced(traced: TracedProgram, memory_budget: int | None = None,
                   argument_divisors: Sequence[Sequence[int]] | None = None,
                   annotated: TracedProgram | None = None,
                   decisions: plan_cache.Decisions | None = None,
                   origin: str = "a stored plan", *, lazy: bool = False,
                   then: Callable[[tuple, float], None] | None = None) -> Analysis:
  """Plans `traced` for every shape; `argument_divisors` (per argument leaf, per dim: how
  many shards it is split into) makes every figure per device (sharding.py).

  `annotated`: the same step traced with the user's `jax.checkpoint` regions, where
  `traced` was traced saving everything (`tracing.trace(save_everything=True)`). The
  rounds then start from the step without the user's recomputation (short batches
  that fit run without it) and end with the step as the user wrote it.

  `decisions`: a plan made before for this same program and settings (plan_cache.py):
  its schedule and rounds are replayed instead of planned (`origin` names it in
  errors); each round is rebuilt the first time it is read (`remat.ReplayedRounds`).

  `lazy`: the shape graph now, the schedule and rounds when first read (`Planning`);
  `then(planned, seconds)` is called once they are made.
  """
  traced = dataclasses.replace(traced, program=shard_map_merge.merge(traced.program))
  graph = _graph(traced, argument_divisors)

  def make() -> tuple:
    start = time.perf_counter()
    with progress.planning(traced.fun_name):
      if decisions is None:
        try:
          sched, rounds, stats = _plan(graph, None)
        except SymmemError:
          raise
        except Exception as e:   # the trace succeeded: a failure now is the planner's
          raise _planner_error(traced.fun_name, e) from e
      else:
        sched, rounds, stats = _replay(traced, graph, decisions, origin)
      if annotated is not None:
        rounds += (_as_written_round(annotated, argument_divisors, decisions),)
    planned = (sched, rounds, stats)
    if then is not None:
      then(planned, time.perf_counter() - start)
    return planned

  planning = Planning(make, annotated=annotated is not None)
  if not lazy:
    planning.get()
  return Analysis(traced, graph, planning, memory_budget)


def _planner_error(name: str, e: Exception) -> PlanningError:
  return PlanningError(f"planning {name} failed ({type(e).__name__}: {e}); please report it "
                       "with the step")


def _replay(traced: TracedProgram, graph: ShapeGraph, decisions: plan_cache.Decisions,
            origin: str) -> tuple:
  """(schedule, rounds, stats) of a stored plan, checked against the traced program."""
  sched, stats = decisions.schedule, dict(decisions.remat_stats)
  edges = schedule_lib.dependency_edges(traced.program)
  for order in {sched.order, *sched.candidates.values()}:
    if not schedule_lib.is_valid_order(traced.program, order, edges):
      raise ValueError("a stored schedule is not an order of the traced program")
  # Rounds are rebuilt when first read (a restart pays for the rounds its shapes
  # need); the file's checksum (plan_cache.load) already vouches for the items.
  return sched, remat.ReplayedRounds(graph, sched.order, decisions.rounds, origin=origin), stats


def _as_written_round(annotated: TracedProgram, argument_divisors,
                      decisions: plan_cache.Decisions | None) -> remat.Round:
  """The step as the user wrote it (with their jax.checkpoint regions), as a round."""
  as_written = _graph(annotated, argument_divisors)
  if decisions is None:
    order = schedule_lib.schedule(as_written).order
  elif (order := decisions.as_written_order) is None or not schedule_lib.is_valid_order(
      annotated.program, order):
    raise ValueError("a stored plan lacks a valid order of the annotated step")
  return remat.Round((), (), annotated.program, order, as_written, as_written=True)


def decisions_of(analysis: Analysis) -> plan_cache.Decisions:
  """What `analysis` decided: its schedule and each round's chosen items."""
  return _decisions(analysis.planning.get())


def _decisions(planned: tuple) -> plan_cache.Decisions:
  sched, rounds, stats = planned
  planned_rounds = [r for r in rounds[1:] if not r.as_written]
  written = [r for r in rounds if r.as_written]
  return plan_cache.Decisions(sched, tuple(r.regions for r in planned_rounds), dict(stats),
                              written[0].order if written else None)


@collector.paused()
def _warn_unbounded(name: str, constraints) -> None:
  """Says so where a dim has no upper bound, declared or implied (`planning_bounds`):
  the plan is then made at its lower bound (`ShapeGraph.max_dims`), where a step may
  need nothing recomputed (a tiny Llama under only 's >= 2': planned at b=1, s=2, no
  round at all), so a budget has little or nothing to choose from at larger calls."""
  free = [(v, lo) for v, lo, hi in constraints.planning_bounds() if hi is None]
  if free:
    logging.warning(
        "jax_symmem: %s: no upper bound on %s in the constraints, so the memory plan is "
        "made at %s, where the step may need nothing recomputed: under the budget, larger "
        "calls have few rounds to choose from, or none; bound each by the largest value "
        "the step is called with, e.g. constraints=(..., '%s <= 4096')", name,
        ", ".join(repr(v) for v, _ in free), ", ".join(f"{v} = {lo}" for v, lo in free),
        free[0][0])


def analyze_function(fun: Callable, *args, polymorphic_shapes, constraints=(),
                     memory_budget: int | None = None,
                     argument_divisors: Sequence[Sequence[int]] | None = None,
                     undo_checkpoints: bool = True,
                     plan_cache_dir: str | os.PathLike | None = None,
                     lazy: bool = False) -> Analysis:
  """Traces `fun` with symbolic dims and plans it (`analyze_traced`). A step with
  `jax.checkpoint` / `nn.remat` / `nnx.remat` regions is traced a second time without
  them (`undo_checkpoints`): per shape, the run time may then skip the recomputation
  the annotation asks for where memory allows, or keep it (the last round).

  `plan_cache_dir` (default $JAX_SYMMEM_PLAN_CACHE; unset: no cache): where plans are
  kept across processes (plan_cache.py). A plan stored for the same program, settings
  and versions is replayed onto the fresh trace instead of planned again.

  `lazy`: plan when the schedule or rounds are first read (`Planning`; a step without
  jax.checkpoint regions), not now. `seconds["plan"]` then grows by the planning time
  when it happens; the plan is stored in the cache then too."""
  from jax_symmem._src import tracing
  start = time.perf_counter()
  name = getattr(fun, "__name__", type(fun).__name__)
  with progress.planning(name):
    progress.update("tracing")
    kw = dict(polymorphic_shapes=polymorphic_shapes, constraints=constraints)
    traced = tracing.trace(fun, *args, **kw)
    annotated = None
    if undo_checkpoints and tracing.has_checkpoints(traced.closed_jaxpr):
      annotated, traced = traced, tracing.trace(fun, *args, save_everything=True, **kw)
    traced_at = time.perf_counter()
    if memory_budget is not None:
      _warn_unbounded(name, traced.constraints)

    cache_dir = plan_cache.directory(plan_cache_dir)
    key = None if cache_dir is None else plan_cache.fingerprint(
        [t.closed_jaxpr for t in (traced, annotated) if t is not None],
        traced.constraints.source, memory_budget, argument_divisors,
        {"undo_checkpoints": undo_checkpoints})
    seconds = {"trace": traced_at - start}
    if key is not None and (decisions := plan_cache.load(cache_dir, key)) is not None:
      path = plan_cache.path_for(cache_dir, key)
      try:
        result = analyze_traced(traced, memory_budget, argument_divisors, annotated, decisions,
                                origin=path)
        logging.info("jax_symmem: plan for %s replayed from %s in %.2f s (%.2f s of it "
                     "tracing)", name, path, time.perf_counter() - start, traced_at - start)
        seconds["plan"] = time.perf_counter() - traced_at
        return dataclasses.replace(result, origin=path, seconds=seconds)
      except Exception as e:  # a plan that does not fit the trace is never trusted
        logging.warning("jax_symmem: ignoring plan cache file %s (it does not replay: "
                        "%s: %s); planning again", path, type(e).__name__, e)
    # The round as written is numbered after the planner's rounds: an annotated step
    # has no round to name without them.
    lazy = lazy and annotated is None

    def planned(value: tuple, elapsed: float) -> None:
      if lazy:   # planned on first use, after analyze_function returned
        seconds["plan"] += elapsed
      saved = None if key is None else plan_cache.save(cache_dir, key, _decisions(value))
      if saved or lazy or elapsed >= progress.AFTER_S:
        logging.info("jax_symmem: planned %s in %.2f s%s%s", name, elapsed,
                     " on first use" if lazy else "",
                     f"; plan stored in {saved}" if saved else "")

    try:
      result = analyze_traced(traced, memory_budget, argument_divisors, annotated,
                              lazy=lazy, then=planned)
    except SymmemError:
      raise
    except Exception as e:   # the trace succeeded: a failure now is the planner's
      raise _planner_error(name, e) from e
    seconds["plan"] = time.perf_counter() - traced_at
    return dataclasses.replace(result, seconds=seconds)
