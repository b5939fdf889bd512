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

So a step whose new parameters and optimizer state are made after its peak still pays
for them at the peak, less what temporaries fit into their buffers before. On the
unrolled Llama of `bench_models` at b=4, s=512, 14 of its rounds 5-20 model 6-18 % under
XLA's figure, and this reads within 1.3 % (README, "What the memory model measures").
What it does not see is fusion: values XLA never materializes, or keeps longer, still
count as the model counts them (GPT-2's rounds read 13-22 % over XLA's figure).

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


def footprint_at(graph: ShapeGraph, env: Mapping[str, int], program: Program,
                 order: Sequence[int], donated: Iterable[int] = ()) -> int:
  """XLA's footprint of `program` run in `order` at concrete dims: arguments, every
  output's own allocation and the heap of the temporaries that fit in none."""
  env = graph.constraints.complete(dict(env))
  donated = frozenset(donated)
  size = graph.bytes_at(env, program.value_ids())
  arguments = sum(size[v] for v in program.inputs)
  owned, start, end, is_output = _live_ranges(program, order, donated)
  if not len(owned):
    return arguments
  sizes = np.asarray([size[v] for v in owned], np.int64)
  spare = sorted(size[program.inputs[k]] for k in donated)   # donated buffers outputs reuse
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
    pos[np.asarray(order)] = np.arange(len(order))
    for node in program.control_flow:
      live[pos[node.index]] += memory.transient_at(graph, node, env)
  return arguments + allocations.total + int(live.max(initial=0))


def _live_ranges(program: Program, order: Sequence[int], donated: frozenset):
  """(value ids, first step, last step, is an output) of every buffer a node makes, in
  positions of `order`; an output lives to the end, as XLA keeps it."""
  layout = memory._buffer_layout(program, donated)   # noqa: SLF001 (the model's own tables)
  n = len(order)
  if not len(layout.owned_value):
    return (), (), (), ()
  pos = np.empty(n, np.int64)
  pos[np.asarray(order)] = np.arange(n)
  last_read = np.full(len(layout.read_buffers), -1, np.int64)
  np.maximum.at(last_read, layout.use_buf, pos[layout.use_node])
  read_at = dict(zip(layout.read_buffers, last_read.tolist()))
  alias = memory._aliases(program)   # noqa: SLF001
  outputs = frozenset(alias.get(x, x) for x in program.outputs if not isinstance(x, Const))
  owned = layout.owned_value
  start = pos[layout.owned_node]
  is_output = np.fromiter((v in outputs for v in owned), bool, len(owned))
  end = np.fromiter((read_at.get(v, -1) for v in owned), np.int64, len(owned))
  end = np.where(is_output, n - 1, np.maximum(end, start))
  return owned, start, end, is_output


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
