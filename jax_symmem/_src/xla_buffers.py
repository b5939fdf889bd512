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
import dataclasses
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
  stored = _stored(program, fusion)
  if not stored.owned:
    return arguments
  pos = np.empty(len(order), np.int64)
  pos[np.asarray(order, np.int64)] = np.arange(len(order))
  start, end = stored.live_ranges(pos)
  sizes = np.asarray([size[v] for v in stored.owned], np.int64)
  spare = sorted(size[program.inputs[k]] for k in frozenset(donated))   # donated buffers outputs reuse
  # Biggest first; at equal size an output first; then by when it is made.
  by_xla = np.lexsort((start, ~stored.is_output, -sizes))
  heap = np.zeros(len(order) + 1, np.int64)
  allocations = _Allocations()
  for i in by_xla.tolist():
    s, d, e = int(sizes[i]), int(start[i]), int(end[i])
    if stored.is_output[i]:
      k = bisect.bisect_left(spare, s)
      if k < len(spare) and spare[k] == s:
        del spare[k]
      else:   # outputs all live to the end: none can share another's allocation
        allocations.new(s, d, e)
    elif not allocations.place_temporary(d, e):
      heap[d] += s
      heap[e + 1] -= s
  live = np.cumsum(heap)[:len(order)]
  for node in program.control_flow:
    live[pos[node.index]] += memory.transient_at(graph, node, env)
  return arguments + allocations.total + int(live.max(initial=0))


def stored_outputs(program: Program) -> frozenset[int]:
  """The buffers that hold the program's results (an output aliasing an operand lives in
  the operand's): XLA keeps each to the end of the run."""
  alias = memory._aliases(program)   # noqa: SLF001 (the model's own buffers)
  return frozenset(alias.get(x, x) for x in program.outputs if not isinstance(x, Const))


@dataclasses.dataclass(frozen=True, eq=False)
class _Stored:
  """The buffers XLA stores of a program and who reads them: independent of the order
  and the dims, so built once per program (a round is asked at many dims)."""
  owned: tuple[int, ...]        # the values with a buffer of their own
  made_by: np.ndarray           # the node that makes each
  is_output: np.ndarray         # which are program results
  read_by: np.ndarray           # (node, index into `owned`) of every read, fused reads
  read_value: np.ndarray        #   resolved to the stored values they compute from

  def live_ranges(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first step, last step) of each owned buffer, in positions of an order (`pos`:
    node -> position); an output lives to the end, as XLA keeps it."""
    start = pos[self.made_by]
    end = start.copy()
    np.maximum.at(end, self.read_value, pos[self.read_by])
    end[self.is_output] = len(pos) - 1
    return start, end


def _stored(program: Program, fusion: bool) -> _Stored:
  key = (id(program), fusion)
  hit = _STORED.get(key)
  if hit is not None and hit[0] is program:
    return hit[1]
  fused = fused_values(program) if fusion else {}
  via: dict[int, tuple[int, ...]] = {}   # a fused value -> the stored values it reads

  def reads(x: int) -> tuple[int, ...]:
    if x not in fused:
      return (x,)
    if x not in via:
      via[x] = tuple(dict.fromkeys(y for o in fused[x] for y in reads(o)))
    return via[x]

  alias = memory._aliases(program)   # noqa: SLF001 (the model's own buffers)
  index: dict[int, int] = {}
  made_by = []
  for node in program.nodes:
    for o in node.outputs:
      if o not in fused and o not in alias:
        index[o] = len(made_by)
        made_by.append(node.index)
  read_by, read_value = [], []
  for node in program.nodes:
    for k in {index.get(alias.get(y, y)) for x in node.operands for y in reads(x)}:
      if k is not None:
        read_by.append(node.index)
        read_value.append(k)
  outputs = stored_outputs(program)
  owned = tuple(index)
  stored = _Stored(owned, np.asarray(made_by, np.int64),
                   np.fromiter((o in outputs for o in owned), bool, len(owned)),
                   np.asarray(read_by, np.int64), np.asarray(read_value, np.int64))
  memory._remember(_STORED, key, (program, stored))   # noqa: SLF001
  return stored


_STORED: dict = {}


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
    self.ranges: list[list[tuple[int, int]]] = []
    self.total = 0
    self._made = np.zeros(16, np.int64)   # when each allocation's output is made (grown)

  def new(self, size: int, start: int, end: int) -> None:
    if len(self.ranges) == len(self._made):
      self._made = np.concatenate([self._made, np.zeros_like(self._made)])
    self._made[len(self.ranges)] = start
    self.ranges.append([(start, end)])
    self.total += size

  def place_temporary(self, start: int, end: int) -> bool:
    # An output holds its allocation from when it is made: only those made after the
    # temporary dies can take it, in the order they were made. (The 1B step places
    # ~10^4 values over ~10^3 allocations: the overlap test is inlined.)
    key, left = (start, end), bisect.bisect_left
    for k in np.flatnonzero(self._made[:len(self.ranges)] > end).tolist():
      ranges = self.ranges[k]
      j = left(ranges, key)
      if (j and ranges[j - 1][1] >= start) or ranges[j][0] <= end:   # j < len: the output's
        continue
      ranges.insert(j, key)
      return True
    return False
