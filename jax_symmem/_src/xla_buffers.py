"""XLA's footprint predicted from the model's live ranges: its buffer assignment, emulated.

The memory model (`memory.py`) counts the bytes live at each step, which is what the
reference executor holds. XLA's `memory_analysis()` counts allocations, and its buffer
assigner (the same on CPU and GPU) lays them out so that the two part ways by whole
buffers: it takes values biggest first (a program output before a temporary of the
same size) and

* gives each program output an allocation of exactly its size, held for the whole run
  (an output may reuse only an allocation of its own size that nothing live occupies,
  so never another output's);
* puts a temporary into the first existing allocation at least as large that no value
  live at the same time occupies (typically an output's, before the output is made);
* packs the other temporaries into one heap, as large as their live sum at its peak
  (XLA's heap simulator; measured equal on the steps of `experiments.bench_models`).

Before that, XLA fuses: a cheap elementwise value (`FUSIBLE`) whose every reader can take
it into its own loop (`FUSES_INTO`) is computed inside its readers and never stored, and
what it reads stays live until its last reader runs; an expensive one (`EXPENSIVE`: exp,
tanh, divide...) with several readers is stored once instead of computed in each (XLA's
instruction fusion does not duplicate it). `fusion=False` lays out every value.

So a step whose new parameters and optimizer state are made after its peak still pays
for them at the peak, less what temporaries fit into their buffers before; and GPT-2's
GELU intermediates and broadcast masks, which the op-by-op model holds, are not there
(README, "What the memory model measures", for the figures). Fusion inside a loop body
is not modeled (a scan's working set is the model's), nor fusion that keeps a value
longer than the jaxpr does (T5's shared position-bias gradient, fused across layers).

Arguments are allocated apart (entry parameters); an output the caller receives in a
donated argument's buffer allocates nothing of its own (paired by size, as JAX aliases
them). Control-flow working sets join the heap at their step.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Mapping, Sequence

import numpy as np

from jax_symmem._src import memory
from jax_symmem._src.ir import Const, Program
from jax_symmem._src.shape_graph import ShapeGraph

# Elementwise primitives XLA computes inside the loop of the op that reads them. (Not the
# ones whose output shares its operand's buffer, `memory.ALIAS_RULES`: they run no loop.)
FUSIBLE = frozenset("""
    abs add and broadcast_in_dim ceil clamp convert_element_type copy copy_p cos div eq erf
    erf_inv exp exp2 expand_dims expm1 floor ge gt integer_pow iota is_finite le log log1p logistic
    lt max min mul ne neg not or pow reduce_precision rem reshape round rsqrt select_n sign sin
    sqrt square squeeze sub tanh xor""".split())
# Those XLA does not compute twice: with several readers, stored once.
EXPENSIVE = frozenset("cos div erf erf_inv exp exp2 expm1 log log1p logistic pow rsqrt sin sqrt "
                      "tanh".split())
# Readers whose loop can compute a fused operand: elementwise ops, reductions, data movement.
FUSES_INTO = FUSIBLE | frozenset("""
    argmax argmin concatenate dynamic_slice dynamic_update_slice pad reduce_and reduce_max
    reduce_min reduce_or reduce_prod reduce_sum scatter-add slice transpose""".split())


def footprint_at(graph: ShapeGraph, env: Mapping[str, int], program: Program,
                 order: Sequence[int], donated: Iterable[int] = (), fusion: bool = True) -> int:
  """XLA's footprint of `program` run in `order` at concrete dims: arguments, every
  output's own allocation and the heap of the temporaries that fit in none (the values
  XLA fuses away left out, unless `fusion` is False)."""
  env = graph.constraints.complete(dict(env))
  size = graph.bytes_at(env, program.value_ids())
  arguments = sum(size[v] for v in program.inputs)
  owned, start, end, is_output = _live_ranges(program, order, fusion)
  if not len(owned):
    return arguments
  sizes = np.asarray([size[v] for v in owned], np.int64)
  spare = sorted(size[program.inputs[k]] for k in frozenset(donated))   # donated buffers outputs reuse
  # Biggest first; at equal size an output first; then by when it is made.
  by_xla = np.lexsort((start, ~is_output, -sizes))
  heap = np.zeros(len(order) + 1, np.int64)
  allocations = _Allocations()
  for i in by_xla.tolist():
    s, d, e = int(sizes[i]), int(start[i]), int(end[i])
    if is_output[i]:
      k = bisect.bisect_left(spare, s)
      if k < len(spare) and spare[k] == s:
        del spare[k]
      else:   # outputs all live to the end: none can share another's allocation
        allocations.new(s, d, e)
    elif not allocations.place_temporary(d, e):
      heap[d] += s
      heap[e + 1] -= s
  live = np.cumsum(heap)[:len(order)]
  if program.control_flow:
    pos = np.empty(len(order), np.int64)
    pos[np.asarray(order, np.int64)] = np.arange(len(order))
    for node in program.control_flow:
      live[pos[node.index]] += memory.transient_at(graph, node, env)
  return arguments + allocations.total + int(live.max(initial=0))


def _live_ranges(program: Program, order: Sequence[int], fusion: bool):
  """(value ids, first step, last step, is an output) of every buffer a node makes and XLA
  stores, in positions of `order`; an output lives to the end, as XLA keeps it."""
  n = len(order)
  pos = np.empty(n, np.int64)
  pos[np.asarray(order, np.int64)] = np.arange(n)
  fused = fused_values(program) if fusion else {}
  stored: dict[int, tuple[int, ...]] = {}   # a fused value -> the stored values it reads

  def reads(x: int) -> tuple[int, ...]:
    if x not in fused:
      return (x,)
    if x not in stored:
      stored[x] = tuple(dict.fromkeys(y for o in fused[x] for y in reads(o)))
    return stored[x]

  alias = memory._aliases(program)   # noqa: SLF001 (the model's own buffers)
  root = lambda x: alias.get(x, x)
  last: dict[int, int] = {}
  for node in program.nodes:
    p = int(pos[node.index])
    for x in node.operands:
      for y in reads(x):
        y = root(y)
        if last.get(y, -1) < p:
          last[y] = p
  outputs = {root(x) for x in program.outputs if not isinstance(x, Const)}
  owned, start, end = [], [], []
  for node in program.nodes:
    d = int(pos[node.index])
    for o in node.outputs:
      if o not in fused and root(o) == o:
        owned.append(o)
        start.append(d)
        end.append(n - 1 if o in outputs else max(d, last.get(o, d)))
  is_output = np.fromiter((o in outputs for o in owned), bool, len(owned))
  return owned, np.asarray(start, np.int64), np.asarray(end, np.int64), is_output


def fused_values(program: Program) -> dict[int, tuple[int, ...]]:
  """The values XLA computes inside their readers -> the values they read."""
  readers: dict[int, list[str]] = {}
  for node in program.nodes:
    for x in set(node.operands):
      readers.setdefault(x, []).append(node.name)
  results = {x for x in program.outputs if not isinstance(x, Const)}
  fused = {}
  for node in program.nodes:
    if node.name not in FUSIBLE or len(node.outputs) != 1:
      continue
    (v,) = node.outputs
    names = readers.get(v)
    if (v in results or not names or not FUSES_INTO.issuperset(names)
        or (node.name in EXPENSIVE and len(names) > 1)):
      continue
    fused[v] = node.operands
  return fused


class _Allocations:
  """The allocations outputs own, with the live ranges of every value placed in each.

  Values arrive biggest first, so every allocation made so far is at least as large as
  the value being placed: a temporary fits any whose occupants are not live with it."""

  def __init__(self):
    self.made: list[int] = []             # when each allocation's output is made
    self.ranges: list[list[tuple[int, int]]] = []
    self.total = 0
    self._made = np.zeros(0, np.int64)

  def new(self, size: int, start: int, end: int) -> None:
    self.made.append(start)
    self.ranges.append([(start, end)])
    self.total += size
    self._made = np.asarray(self.made, np.int64)

  def place_temporary(self, start: int, end: int) -> bool:
    # An output holds its allocation from when it is made: only those made after the
    # temporary dies can take it, in the order they were made. (The 1B step places
    # ~10^4 values over ~10^3 allocations: the overlap test is inlined.)
    key, left = (start, end), bisect.bisect_left
    for k in np.flatnonzero(self._made > end).tolist():
      ranges = self.ranges[k]
      j = left(ranges, key)
      if (j and ranges[j - 1][1] >= start) or ranges[j][0] <= end:   # j < len: the output's
        continue
      ranges.insert(j, key)
      return True
    return False
