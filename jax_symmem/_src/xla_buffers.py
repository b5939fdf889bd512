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

Before that, XLA fuses (the rules of its CPU instruction fusion, `cpu_instruction_fusion.cc`:
which producers its loop emitter can compute, which are expensive, which readers reuse
elements): a value made by an elementwise op, data movement or a reduction (`FUSIBLE`)
whose every reader can take it into its own loop (`FUSES_INTO`) is computed inside its
readers and never stored, and what it reads stays live until its last reader runs; an
expensive one (`EXPENSIVE`: exp, tanh, divide, a reduction...) only where one loop
computes it and that loop reads each element once (not a broadcast's: `REUSES`), since
XLA does not duplicate it. A value made from constants alone is also sunk into the loops
that read it. `fusion=False` lays out every value.

Loops (scan, while) are laid out the same way, one iteration at a time: a scan body's
per-iteration results are computed into their stacked buffers and its next state into
the loop's state (XLA updates both in place), so a cheap one is never stored on its own;
an iteration's slice of a stacked operand is stored where a reader (a dot) needs it.
A cond's branch computes its results into the cond's output buffers. The body's (or
branch's) buffers at its peak are temporaries at the loop's step, placed like any other
(into an output's allocation made after the loop, else the heap). So is a dot operand
XLA copies into the layout its dot emitter takes (`_copied_operands`: a weight gradient's
activations contracted over batch and sequence, attention operands whose batch dims do
not lead).

So a step whose new parameters and optimizer state are made after its peak still pays
for them at the peak, less what temporaries fit into their buffers before; and GPT-2's
GELU intermediates and broadcast masks, which the op-by-op model holds, are not there
(experiments/RESULTS.md, "What the memory model measures", for the figures); and T5's shared
position-bias gradient, a reduction per layer fused into the sum across layers at the end
of the backward pass, keeps each layer's operand of it live until then. An elementwise
op writes into the buffer of an operand of its size that dies at it (`IN_PLACE`; not a
dot's result XLA computed with merged free dims and reshaped, nor a loop body's result,
which is copied out later). Not modeled: XLA's own reordering, and fusions it declines for their cost
(duplicated code, minor-dimension concatenations).

On CPU a reduction over a dim of more than 32 elements is computed as a reduce-window and
a reduction of its result, and nothing fuses into the reduce-window: what it reduces is
stored (a softmax gradient's product, a norm's squares; `_tree_reductions`). A loop body's
temporaries go into the loop's state buffer where it is free, from the carry's last read
until the next carry is made (`_in_loop_state`).

XLA fuses a cheap value that reads at most one array of its rank into every reader that
can take it and stores it only for the others: a normalized activation read by a dot or a
convolution and by the backward pass's elementwise ops is stored until the dot, and the
backward pass recomputes it (`_fusion`). On CPU a convolution whose dims are not in its
kernel's order (a gradient's: batch and feature swapped) reads copies of its operands,
each made as soon as the operand is (`_canonicalized_convs`).

A random draw is stored as XLA stores it (`_with_counters`): Threefry's two counter words
per element, held until the readers that combine them (which fuse the combination and a
dropout's mask into their loops, so the mask is never stored), the next round's pair
beside them while it runs, and in a loop body the first counters, which XLA hoists out
of the loop. A draw a planned round pins (`fence.pinned_draws`) stores its one-word
result until its mask is made, and the mask (`fence.kept_values`) is stored.

Arguments are allocated apart (entry parameters); an output the caller receives in a
donated argument's buffer allocates nothing of its own (paired by size, as JAX aliases
them).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from jax_symmem._src import memory
from jax_symmem._src import sharding
from jax_symmem._src import tracing
from jax_symmem._src.ir import Const, Node, Operand, Program
from jax_symmem._src.poly import Poly
from jax_symmem._src.shape_graph import ShapeGraph

# Primitives XLA's CPU and GPU loop fusion computes inside the loop of the op that reads
# them: elementwise ops, data movement and reductions. (Not the ones whose output shares
# its operand's buffer, `memory.ALIAS_RULES`: they run no loop.)
FUSIBLE = frozenset("""
    abs add add_any and argmax argmin bitcast_convert_type broadcast_in_dim ceil clamp
    concatenate convert_element_type copy copy_p cos div dynamic_slice eq erf erf_inv exp exp2
    expand_dims expm1 floor gather ge gt integer_pow iota is_finite le log log1p logistic lt max
    min mul ne neg not or pad pow reduce_and reduce_max reduce_min reduce_or reduce_precision
    reduce_prod reduce_sum rem reshape rev round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin slice sqrt square squeeze sub tanh transpose xor""".split())
# Those XLA does not compute twice (with several readers they are stored once), nor in a
# reader that reads each element many times (`REUSES`).
EXPENSIVE = frozenset("""
    argmax argmin div erf erf_inv exp exp2 expm1 gather log log1p logistic pow reduce_and
    reduce_max reduce_min reduce_or reduce_prod reduce_sum rsqrt sqrt tanh""".split())
REUSES = frozenset("broadcast_in_dim gather".split())
# Those that read each operand element where they write it: XLA lets one write into the
# buffer of an operand of its size that dies there.
IN_PLACE = FUSIBLE - frozenset("""
    argmax argmin broadcast_in_dim concatenate dynamic_slice gather iota pad reduce_and
    reduce_max reduce_min reduce_or reduce_prod reduce_sum rev slice transpose""".split())
# Readers whose loop can compute a fused operand: the same ops, and in-place updates.
FUSES_INTO = FUSIBLE | frozenset("dynamic_update_slice scatter-add split".split())
# A value computed from constants alone (a broadcast literal, an iota) is also sunk into
# the loops that read it (XLA's while-loop constant sinking), to be fused there.
_SINK_CONSTANTS = frozenset({"scan", "while"})

# 16-bit floats on XLA:CPU: it computes bfloat16 / float16 ops in float32 and, allowed excess
# precision (its default), drops the conversions to 16 bits and back between them, so a
# value the program makes in 16 bits is stored as float32, but for its results and what it
# writes into a loop's buffers (their types are the program's). Dots have no 16-bit
# kernel: one reading a 16-bit argument reads a float32 copy of it (one copy for all such
# dots); its 16-bit result is made in float32 first (a temporary at the dot) and, where a
# loop reads it (attention scores read by the mask and the softmax), converted to 16 bits
# once and stored so; read by dots only, it stays float32. Measured against
# `memory_analysis()` on CPU (2026-12-04): exact on a chain of bfloat16 dots
# (`tests/test_xla_buffers.py`); on six Flax steps with bfloat16 compute, 36 rounds
# (`python -m experiments.bench_half_floats`), 0.65-1.28 x XLA's figure (mean |error|
# 0.094), all within 10 % + 8 MiB, where counting 16 bits read 0.61-1.11 (31 within).
# Over by 13-28 %: the unrolled steps' rounds that recompute at b=4, s=256. float16 (ad
# hoc): the dot chain exact; the scanned Flax step computing in float16, round 0 1.11-1.18
# x XLA (16 bits: 0.91-0.94), its last round 0.96-0.99 (0.87-0.97). XLA:GPU runs 16-bit
# ops as they are, and so does the XLA:CPU of jax 0.11 (its dots have bfloat16 kernels and
# the values between stay 16-bit). None: decided by the default backend, on CPU by the
# dot XLA compiles for two bfloat16 arguments (`stores_half_as_float32`).
HALF_FLOATS = frozenset({"bfloat16", "float16"})
HALF_AS_FLOAT32: bool | None = None
# XLA:CPU's convolutions: out of its kernel's order they copy their operands
# (`_canonicalized_convs`); with a dilated input they hold scratch `memory_analysis()`
# does not count (`convolution_scratch`). None: decided by the default backend
# (`canonicalizes_convolutions`).
CANONICAL_CONVOLUTIONS: bool | None = None
# XLA:CPU computes a reduction over a dim of more than 32 elements as a reduce-window of
# 32 followed by the reduction of its result (`TreeReductionRewriter`, for precision), and
# a reduce-window is no loop its producers fuse into (`CpuInstructionFusion`): the array
# reduced is stored, and the reduction ends its life (a softmax gradient's product, a
# norm's squares). Variadic reductions (argmax, argmin) are not split. None: decided by
# the default backend (`_tree_reductions`).
TREE_REDUCED = frozenset("reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum".split())
TREE_REDUCTION_WINDOW = 32
TREE_REDUCTIONS: bool | None = None


def _on_cpu(override: bool | None) -> bool:
  """`override` where set, else whether this process's default backend is XLA:CPU."""
  if override is not None:
    return override
  import jax
  return jax.default_backend() == "cpu"


def stores_half_as_float32() -> bool:
  """Whether XLA stores this process's 16-bit float values as float32 (on CPU)."""
  if HALF_AS_FLOAT32 is not None:
    return HALF_AS_FLOAT32
  return _on_cpu(None) and _cpu_dots_widen_bfloat16()


@functools.cache
def _cpu_dots_widen_bfloat16() -> bool:
  """Whether this XLA:CPU computes a dot of two bfloat16 arrays in float32 (jax 0.10: a
  float32 dot between conversions) rather than in bfloat16 (jax 0.11): read once per
  process from the optimized HLO of such a dot, which the version alone does not say."""
  import jax
  x = jax.ShapeDtypeStruct((8, 8), "bfloat16")
  text = jax.jit(lambda a, b: a @ b).lower(x, x).compile().as_text()
  dots = [line for line in text.splitlines() if " dot(" in line]
  return bool(dots) and not any("= bf16[" in line for line in dots)


def _tree_reductions(graph: ShapeGraph, env: Mapping[str, int], program: Program
                     ) -> tuple[dict[int, int], frozenset[int], frozenset[int]]:
  """({node: bytes}, split, stored) for the reductions of `program` (not its subprograms) that
  XLA:CPU splits at the complete dims `env` (`TREE_REDUCED`; none off CPU): the bytes of
  each one's first reduce-window result (a window of 32 elements per reduced dim: 1/32 as
  long there), a temporary beside the array it reduces (reduced again the same way while a
  dim is over 32, into space the reduced array leaves). A split reduction of a 16-bit
  value converted to float32 reads that value itself where XLA stores 16-bit values as
  float32 (the conversion is gone): the value is in `stored`, and the reduction takes the
  conversion into its loop; `split` holds the others, which store their operand."""
  if not _on_cpu(TREE_REDUCTIONS):
    return {}, frozenset(), frozenset()
  out, stored, through = {}, set(), set()
  for i, x, axes, half in _reductions(program):
    shape = [d.evaluate(env) if isinstance(d, Poly) else int(d) for d in (
        x.aval.shape if isinstance(x, Const) else graph.values[x].dims)]
    itemsize = (x.aval.dtype.itemsize if isinstance(x, Const) else graph.values[x].itemsize)
    if any(shape[a] > TREE_REDUCTION_WINDOW for a in axes):
      out[i] = itemsize * int(np.prod(
          [-(-d // TREE_REDUCTION_WINDOW) if a in axes else d for a, d in enumerate(shape)],
          dtype=np.int64))
      if half is not None and stores_half_as_float32():   # (probes XLA once: 16-bit steps only)
        stored.add(half)
        through.add(i)
  return out, frozenset(out) - through, frozenset(stored)


def _reductions(program: Program) -> tuple[tuple[int, Operand, tuple, int | None], ...]:
  """(node, operand, axes, the 16-bit value the operand converts to float32, or None) of
  each reduction of `TREE_REDUCED` in `program`: what `_tree_reductions` reads at every
  dims, found once per program (the planner asks a round at many dims)."""
  hit = _REDUCTIONS.get(id(program))
  if hit is not None and hit[0] is program:
    return hit[1]
  made = {o: node for node in program.nodes for o in node.outputs}
  found = []
  for node in program.nodes:
    if node.name in TREE_REDUCED:
      x, convert = node.inputs[0], made.get(node.inputs[0])
      half = (convert.inputs[0] if convert is not None
              and convert.name == "convert_element_type"
              and not isinstance(convert.inputs[0], Const)
              and _is_half(program.avals[convert.inputs[0]]) else None)
      found.append((node.index, x, tuple(node.params["axes"]), half))
  memory._remember(_REDUCTIONS, id(program), (program, tuple(found)))   # noqa: SLF001
  return tuple(found)


_REDUCTIONS: dict = {}


def footprint_at(graph: ShapeGraph, env: Mapping[str, int], program: Program,
                 order: Sequence[int], donated: Iterable[int] = (), fusion: bool = True,
                 pinned: Iterable[int] = (), kept: Iterable[int] = ()) -> int:
  """XLA's footprint of `program` run in `order` at concrete dims: arguments, every
  output's own allocation and the heap of the temporaries that fit in none (the values
  XLA fuses away left out, unless `fusion` is False). `pinned`: the random draws held
  in place by fences (`fence.pinned_draws`); `kept`: values a fence makes XLA store
  (`fence.kept_values`), never fused into their readers."""
  env = graph.constraints.complete(dict(env))
  program, order, moved = _without_shard_maps(program, order)
  pinned = [moved.get(i, i) for i in pinned]
  size = graph.bytes_at(env, program.value_ids())
  arguments = sum(size[v] for v in program.inputs)
  windows, split, reduced = (_tree_reductions(graph, env, program) if fusion
                             else ({}, frozenset(), frozenset()))
  stored = _stored(program, fusion, kept=frozenset(kept) | reduced, entry=True, split=split)
  size, draws = _with_counters(graph, stored, size, frozenset(pinned))
  size, upcasts = _with_float32_halves(program, stored, size)
  pos = np.empty(len(order), np.int64)
  pos[np.asarray(order, np.int64)] = np.arange(len(order))
  start, end = stored.live_ranges(pos)
  sizes = stored.shared(np.asarray([size[v] for v in stored.owned], np.int64), start, end)
  is_output = stored.is_output
  # A loop's working set, a dot's transposed operands, a draw's next counters:
  # temporaries at that node's step.
  parts = [(pos[node.index], b) for node in stored.working
           for b in (_working_parts(graph, node, env) if fusion
                     else (memory.transient_at(graph, node, env),))]
  parts += [(pos[i], size[x]) for i, x in stored.dot_copies if size[x]]
  parts += [(pos[i], b) for i, b in draws]
  parts += [(pos[i], b) for i, b in windows.items()]
  spans = [(p, p, b) for p, b in parts] + [
      (int(pos[list(nodes)].min()), int(pos[list(nodes)].max()), b) for nodes, b in upcasts]
  copies: dict[tuple, list[int]] = {}   # one per operand and order, to its last reader
  for i, x, made, perm in stored.conv_copies:   # (none where XLA makes none: `_stored`)
    if size[x]:
      span = copies.setdefault((x, perm), [int(pos[made]) if made >= 0 else 0, 0])
      span[1] = max(span[1], int(pos[i]))
  spans += [(first, last, size[x]) for (x, _), (first, last) in copies.items()]
  if spans:
    first, last, extra = (np.asarray(c, np.int64) for c in zip(*spans))
    sizes = np.concatenate([sizes, extra])
    start, end = np.concatenate([start, first]), np.concatenate([end, last])
    is_output = np.concatenate([is_output, np.zeros(len(extra), bool)])
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
    elif s and not allocations.place_temporary(d, e):
      heap[d] += s
      heap[e + 1] -= s
  # Several results are returned in a tuple: XLA allocates its table of pointers too.
  table = 8 * len(program.outputs) if len(program.outputs) > 1 else 0
  return arguments + allocations.total + table + int(np.cumsum(heap).max(initial=0))


def _without_shard_maps(program: Program, order: Sequence[int]
                        ) -> tuple[Program, Sequence[int], Mapping[int, int]]:
  """`program` with each top-level shard_map replaced by its body, in `order` (the body's
  nodes at the shard_map's step, in their own order; a loop's body the same way), the
  order in it, and each other node's new index by its old. XLA partitions a shard_map away: per device its body is
  ops like any other, which fuse with their readers outside it. Per device the body's
  values are its own sizes, and the shard_map's operands and results (split by its
  specs, `sharding.py`) the same bytes."""
  if not sharding.runs_shard_map(program):
    return program, order, {}
  rename: dict[int, Operand] = {}
  avals = dict(program.avals)
  read = lambda x: x if isinstance(x, Const) else rename.get(x, x)
  nodes: list[Node] = []
  moved: dict[int, int] = {}
  def add(node: Node) -> None:
    nodes.append(dataclasses.replace(node, index=len(nodes),
                                     inputs=tuple(read(x) for x in node.inputs)))
  for i in order:
    node = program.nodes[i]
    if node.name != "shard_map":
      moved[i] = len(nodes)
      if any(sharding.runs_shard_map(b) for b in node.subprograms):   # a scan of them
        node = dataclasses.replace(node, subprograms=tuple(
            _without_shard_maps(b, range(len(b.nodes)))[0] for b in node.subprograms))
      add(node)
      continue
    (body,) = node.subprograms
    avals.update(body.avals)
    rename.update(zip(body.inputs, (read(x) for x in node.inputs)))
    for inner in body.nodes:
      add(inner)
    rename.update(zip(node.outputs, (read(x) for x in body.outputs)))
  flat = Program(program.inputs, tuple(nodes), tuple(read(x) for x in program.outputs), avals)
  return flat, tuple(range(len(nodes))), moved


def working_set(graph: ShapeGraph, node: Node, env: Mapping[str, int]) -> int:
  """A loop's or cond's working set as XLA stores it at the complete dims `env`: one
  iteration's (one branch's) stored values at its peak, above what it receives and what
  goes into the cond's outputs (the largest body or branch; nested control flow's own
  working sets at their steps)."""
  return sum(_working_parts(graph, node, env))


def _working_parts(graph: ShapeGraph, node: Node, env: Mapping[str, int]) -> tuple[int, ...]:
  """The sizes of the buffers in `working_set` (the buffer assigner places each apart)."""
  if not node.subprograms:   # a draw: its next counters are `_with_counters`' parts
    return ()
  cache = graph.node_cache("xla working set at " + repr(sorted(env.items())))
  if node not in cache:
    best: tuple[int, ...] = ()
    writes_outputs = node.name in memory.RESULTS_IN_OUTPUTS
    for body in node.subprograms:
      streamed = carried = sliced = frozenset()
      if writes_outputs:   # results computed into the node's own output buffers
        streamed = frozenset(x for x in body.outputs if not isinstance(x, Const))
      elif node.name == "scan":
        n_consts, k = tracing.scan_counts(node.params)
        xs = n_consts + k
        carried = frozenset(x for x in body.outputs[:k] if not isinstance(x, Const))
        streamed = frozenset(x for x in body.outputs[k:] if not isinstance(x, Const))
        sliced = frozenset(body.inputs[xs:])
      n = len(body.nodes)
      if not n:
        continue
      windows, split, reduced = _tree_reductions(graph, env, body)
      stored = _stored(body, True, streamed, carried, sliced, kept=reduced, split=split)
      value_bytes = graph.bytes_at(env, body.value_ids())
      size, draws = _with_counters(graph, stored, value_bytes)
      size, upcasts = _with_float32_halves(body, stored, size)
      start, end = stored.live_ranges(np.arange(n))
      sizes = stored.shared(np.asarray([0 if writes_outputs and v in streamed else size[v]
                                        for v in stored.owned], np.int64), start, end)
      if node.name == "scan":
        sizes = _in_loop_state(body, stored, size, sizes, start, end, n_consts, k)
      if upcasts:   # in the body's order, which is its node order
        sizes = np.concatenate([sizes, [b for _, b in upcasts]])
        start = np.concatenate([start, [min(nodes) for nodes, _ in upcasts]])
        end = np.concatenate([end, [max(nodes) for nodes, _ in upcasts]])
      live = np.zeros(n + 1, np.int64)
      np.add.at(live, start, sizes)
      np.add.at(live, end + 1, -sizes)
      live = np.cumsum(live)[:n]
      inner = {i.index: _working_parts(graph, i, env) for i in body.control_flow}
      for i, b in [(i, size[x]) for i, x in stored.dot_copies] + draws + list(windows.items()):
        if b:
          inner[i] = inner.get(i, ()) + (b,)
      for i, parts in inner.items():
        live[i] += sum(parts)
      hoisted = (_hoisted_counters(graph, stored, value_bytes) if not writes_outputs else ())
      if node.name == "scan":   # XLA's table of pointers to the loop's state: the
        # counter, every operand (consts, carries, scanned inputs) and every stacked result
        hoisted += (8 * (1 + len(node.inputs) + len(body.outputs) - k),)
      live += sum(hoisted)
      p = int(live.argmax())
      if live[p] > sum(best):
        best = tuple(sizes[(start <= p) & (end >= p)].tolist()) + inner.get(p, ()) + hoisted
    cache[node] = best
  return cache[node]


def _in_loop_state(body: Program, stored: "_Stored", size: Mapping[int, int],
                   sizes: np.ndarray, start: np.ndarray, end: np.ndarray, n_consts: int,
                   k: int) -> np.ndarray:
  """`sizes` with the body's temporaries that XLA places in the loop's state left out.

  The loop's state is one buffer per carry, the body's carry input and next carry alike:
  from the input's last read until the next carry is made it holds nothing, and XLA puts
  body temporaries there as into any free allocation (largest first, where no occupant
  is live with them): a norm's squares between the layer's dot and its next state."""
  made = {o: node.index for node in body.nodes for o in node.outputs}
  where = {v: j for j, v in enumerate(stored.owned)}
  dataflow = _topological(body)
  def last_read(x) -> int:   # by a reader, or by one computing a value fused from x
    reach, last = {x}, -1
    for node in dataflow:
      if reach.intersection(node.operands):
        last = max(last, node.index)
        reach.update(o for o in node.outputs if o not in where)
    return last
  slots = []   # (bytes, first free step, last free step)
  for x, y in zip(body.inputs[n_consts:n_consts + k], body.outputs[:k]):
    if isinstance(y, Const) or y not in made or y in body.inputs:
      continue
    first = last_read(x) + 1
    # A stored next carry occupies the state from when it is made; a fused one is
    # computed into it by the node that makes it.
    free_to = (start[where[y]] if y in where else made[y]) - 1
    if free_to >= first:
      slots.append((size[x], first, free_to))
  if not slots:
    return sizes
  sizes = sizes.copy()
  occupants: list[list[tuple[int, int]]] = [[] for _ in slots]
  for j in sorted(np.flatnonzero(sizes).tolist(), key=lambda j: -sizes[j]):
    for (room, first, free_to), taken in zip(slots, occupants):
      if (sizes[j] <= room and first <= start[j] and end[j] <= free_to
          and all(end[j] < a or b < start[j] for a, b in taken)):
        taken.append((int(start[j]), int(end[j])))
        sizes[j] = 0
        break
  return sizes


def _with_counters(graph: ShapeGraph, stored: "_Stored", size: dict[int, int],
                   pinned: frozenset[int] = frozenset()
                   ) -> tuple[dict[int, int], list[tuple[int, int]]]:
  """(`size` with each random draw stored as XLA stores it, [(node, bytes)] of the
  temporaries each draw needs while it runs): JAX's Threefry makes each element from a
  pair of 32-bit counter words (`memory.DRAW_BYTES_PER_ELEMENT` with the next round's
  pair beside them while it runs). XLA keeps both counter arrays until the readers that
  combine them, which fuse the combination (and the mask a dropout makes of it) into
  their own loops; a draw `pinned` by a fence has its result made (one word per
  element) and stored for its readers instead, the counters gone when it ends."""
  if not stored.draws:
    return size, []
  size, parts = dict(size), []   # (bytes_at's dict is the graph's own)
  for i, v in stored.draws:
    word = 4 * _elements(graph, size, v)
    if i in pinned:
      parts += [(i, word), (i, word), (i, 2 * word - size[v])]
    else:
      size[v] = 2 * word
      parts += [(i, word), (i, word)]
  return size, parts


def _with_float32_halves(program: Program, stored: "_Stored", size: dict[int, int]
                         ) -> tuple[dict[int, int], list[tuple[tuple[int, ...], int]]]:
  """(`size` with the 16-bit values XLA stores as float32 doubled, [(nodes, bytes)] of the
  float32 temporaries of dots, each live from the first of its nodes to run to the last:
  an argument's copy, a 16-bit result's float32 original at its dot), where XLA stores
  16-bit floats as float32 (`stores_half_as_float32`); else (`size`, [])."""
  if not (stored.halves or stored.half_dots) or not stores_half_as_float32():
    return size, []
  copies: dict = {}   # an argument or constant (by id) -> (it, the dots that read it)
  for i, operands, _ in stored.half_dots:
    for x in operands:
      if isinstance(x, Const) or x not in stored.halves:
        copies.setdefault(id(x) if isinstance(x, Const) else x, (x, []))[1].append(i)
  spans = [(tuple(nodes), 2 * (int(x.aval.size) * x.aval.dtype.itemsize
                               if isinstance(x, Const) else size[x]))
           for x, nodes in copies.values()]
  spans += [((i,), 2 * size[o]) for i, _, results in stored.half_dots
            for o in results if o not in stored.halves]
  size = dict(size)   # (bytes_at's dict is the graph's own)
  for x in stored.halves:
    size[x] *= 2
  return size, spans


def _is_half(aval) -> bool:
  return str(aval.dtype) in HALF_FLOATS


def _float32_halves(program: Program, owned: Iterable[int], fixed: frozenset
                    ) -> frozenset[int]:
  """The `owned` 16-bit values XLA:CPU stores as float32 (`HALF_FLOATS`): not `fixed`
  (the program's results, what goes into a loop's buffers), nor a dot's result that a
  loop (not only dots) reads, which XLA converts to 16 bits once and stores so."""
  halves = {v for v in owned if v not in fixed and _is_half(program.avals[v])}
  if not halves:
    return frozenset()
  dot_results, read_by_loops = set(), set()
  for node in program.nodes:
    if node.name == "dot_general":
      dot_results.update(halves.intersection(node.outputs))
    else:
      read_by_loops.update(halves.intersection(node.operands))
  return frozenset(halves - (dot_results & read_by_loops))


def _half_dots(program: Program, alias: Mapping[int, int]
               ) -> tuple[tuple[int, tuple, tuple[int, ...]], ...]:
  """(node, 16-bit float operands (buffers, aliases resolved), 16-bit float results) of
  each dot that has any."""
  half = lambda x: _is_half(x.aval if isinstance(x, Const) else program.avals[x])
  out = []
  for node in program.nodes:
    if node.name != "dot_general":
      continue
    operands = tuple(dict.fromkeys(x if isinstance(x, Const) else alias.get(x, x)
                                   for x in node.inputs if half(x)))
    results = tuple(o for o in node.outputs if half(o))
    if operands or results:
      out.append((node.index, operands, results))
  return tuple(out)


def _hoisted_counters(graph: ShapeGraph, stored: "_Stored", size: dict[int, int]
                      ) -> tuple[int, ...]:
  """The buffers a loop body's draws read that XLA hoists out of the loop: a draw's
  first counters are an iota of each word, the same in every iteration, so XLA computes
  them once before the loop and stores them for its run, one pair per element count
  (equal ones are one computation). `size`: the values' own bytes."""
  counts = {_elements(graph, size, v) for _, v in stored.draws}
  return tuple(b for c in sorted(counts) for b in (4 * c, 4 * c))


def _elements(graph: ShapeGraph, size: Mapping[int, int], v: int) -> int:
  """The number of elements of value `v`, from its bytes in `size`."""
  return size[v] // graph.values[v].itemsize


def _free_dims(program: Program, node: Node) -> list[list[int]]:
  """A dot's free (neither batch nor contracting) dims of each operand."""
  (lc, rc), (lb, rb) = node.params["dimension_numbers"]
  ranks = [len((x.aval if isinstance(x, Const) else program.avals[x]).shape)
           for x in node.inputs]
  return [[d for d in range(r) if d not in c and d not in b]
          for r, c, b in zip(ranks, (lc, rc), (lb, rb))]


def _reshaped_dots(program: Program) -> frozenset[int]:
  """The results of dots XLA computes as a matrix product with merged free dims and
  reshapes after: such a buffer is the matrix's, which an elementwise reader cannot
  overwrite."""
  return frozenset(o for node in program.nodes if node.name == "dot_general"
                   and any(len(f) > 1 for f in _free_dims(program, node))
                   for o in node.outputs)


def _copied_operands(program: Program) -> tuple[tuple[int, int], ...]:
  """(node, operand) of the dot operands XLA copies into a canonical layout: its dot
  emitter takes one free and one contracting dim per operand in either order, behind
  leading batch dims; an operand with several free or contracting dims is transposed to
  [batch, free, contracting] (lhs) or [batch, contracting, free] (rhs), a copy unless its
  dims are in that order already, and one whose batch dims do not lead is copied."""
  out = []
  for node in program.nodes:
    if node.name != "dot_general":
      continue
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    for x, contract, batch, free, lhs in zip(node.inputs, (lc, rc), (lb, rb),
                                             _free_dims(program, node), (True, False)):
      if isinstance(x, Const):
        continue
      if list(batch) != list(range(len(batch))):
        copied = True
      elif len(free) <= 1 and len(contract) <= 1:
        copied = False
      else:
        order = list(batch) + (free + list(contract) if lhs else list(contract) + free)
        copied = order != sorted(order)
      if copied:
        out.append((node.index, x))
  return tuple(out)


def canonicalizes_convolutions() -> bool:
  """Whether XLA copies convolutions' operands into one layout here (on CPU)."""
  return _on_cpu(CANONICAL_CONVOLUTIONS)


def _canonicalized_convs(program: Program) -> tuple[tuple[int, int, int, tuple], ...]:
  """(convolution node, value, the node that makes the value or -1, the dims' order) of
  the convolution operands and results XLA:CPU copies: its convolution kernel takes the
  input as [batch, spatial..., feature], the kernel as [spatial..., in, out] and makes
  the output as the input, and XLA transposes any other order into that one
  (`ConvCanonicalization`, the program's top level only), the result made in that order
  and copied into its own. A gradient's convolutions are the ones out of order: the
  weight gradient's reads the activations and the output gradient with batch and feature
  swapped. XLA makes an operand's copy as soon as the operand is made (seen in its
  schedules: a forward activation's transposed copy is held to the backward pass beside
  it), one for all the convolutions that read it in the same order."""
  made_by = {o: node.index for node in program.nodes for o in node.outputs}
  return tuple((node.index, x, node.index if x in node.outputs else made_by.get(x, -1), order)
               for node in program.nodes if node.name == "conv_general_dilated"
               for x, order in _out_of_order(node, program.avals))


def _out_of_order(node: Node, avals) -> list[tuple[int, tuple]]:
  """(value, its dims in the kernel's order) of each of a convolution's input, kernel and
  result that is not in the order XLA:CPU's convolution kernel takes (size-1 dims aside)."""
  dn = node.params["dimension_numbers"]
  n = len(dn.lhs_spec) - 2
  wanted = ((dn.lhs_spec, (0, *range(2, n + 2), 1)),
            (dn.rhs_spec, (*range(2, n + 2), 1, 0)),
            (dn.out_spec, (0, *range(2, n + 2), 1)))
  out = []
  for x, (spec, positions) in zip((*node.inputs[:2], node.outputs[0]), wanted):
    if isinstance(x, Const):
      continue
    shape = avals[x].shape
    order = [spec[k] for k in positions]   # the dims in the kernel's order
    if [d for d in order if shape[d] != 1] != sorted(d for d in order if shape[d] != 1):
      out.append((x, tuple(order)))
  return out


# XLA:CPU's transposed-convolution kernel falls back to its generic one, which holds no
# scratch, where the scratch would exceed this (`kMaxConvMatrixSize` in XLA's
# convolution_thunk_internal.h; measured: 7.56 GiB held, 8.51 GiB not).
TRANSPOSED_CONV_MAX_SCRATCH = 8 << 30


def convolution_scratch(env: Mapping[str, int], program: Program) -> int:
  """Bytes the largest input-dilated convolution of `program` (a strided convolution's
  input gradient, a transposed convolution) holds while it runs, outside XLA's buffers
  and `memory_analysis()`, on XLA:CPU: its transposed-convolution kernel multiplies every
  input element by the kernel into batch x input spatial x kernel spatial x output
  features products before adding them up (measured with the real peak, DESIGN.md F3:
  36.0 MiB for b=16, 64 x 64 x 16 -> 129 x 129 x 16, 3 x 3; `experiments/conv_scratch.py`).
  Only where XLA runs that kernel (`_transposed_kernel_scratch`); 0 elsewhere. `env`:
  complete dims."""
  if not canonicalizes_convolutions():
    return 0
  dim = lambda d: tracing._concrete_dim(d, env)   # noqa: SLF001 (ours)
  return max((_transposed_kernel_scratch(node, avals, dim, top)
              for node, avals, top in _convolutions(program)), default=0)


def _convolutions(program: Program, top: bool = True):
  """(node, its program's avals, whether XLA puts it in its entry computation) of every
  convolution: the top level's and a shard_map body's there (XLA inlines the body after
  partitioning), a loop's or cond's not."""
  for node in program.nodes:
    if node.name == "conv_general_dilated":
      yield node, program.avals, top
    for sub in node.subprograms:
      yield from _convolutions(sub, top and node.name == "shard_map")


def _transposed_kernel_scratch(node: Node, avals, dim, top: bool) -> int:
  """The scratch of one convolution where XLA:CPU runs it with its transposed-convolution
  kernel, else 0. That kernel runs a convolution with a dilated input, no kernel
  dilation, unit strides and one feature group, of 1 or 2 spatial dims, in the kernel's
  order (XLA puts top-level ones in it, `_canonicalized_convs`; one in a loop body out of
  it runs elementwise), unless the scratch exceeds `TRANSPOSED_CONV_MAX_SCRATCH`. And not
  where XLA's algebraic simplifier swaps the operands first, which it does where the
  kernel's spatial product exceeds the input's (a size-1 input dim padded by the kernel
  counts as the kernel's size), as in a transposed convolution's weight gradient, whose
  kernel is the output gradient: the swapped one dilates the kernel instead (seen in the
  compiled HLO; measured, no scratch)."""
  p = node.params
  if (all(d == 1 for d in p["lhs_dilation"]) or any(d != 1 for d in p["rhs_dilation"])
      or any(s != 1 for s in p["window_strides"]) or p["feature_group_count"] != 1
      or len(p["lhs_dilation"]) > 2 or (not top and _out_of_order(node, avals))):
    return 0
  lhs, rhs = (x.aval if isinstance(x, Const) else avals[x] for x in node.inputs[:2])
  dn = p["dimension_numbers"]
  inputs = [dim(lhs.shape[d]) for d in dn.lhs_spec[2:]]
  kernel = [dim(rhs.shape[d]) for d in dn.rhs_spec[2:]]
  swapped = math.prod(k if n == 1 and tuple(map(dim, pad)) == (k - 1, k - 1) else n
                      for n, k, pad in zip(inputs, kernel, p["padding"]))
  if math.prod(kernel) > swapped:
    return 0
  scratch = (dim(lhs.shape[dn.lhs_spec[0]]) * math.prod(inputs) * math.prod(kernel)
             * dim(rhs.shape[dn.rhs_spec[0]]) * np.dtype(avals[node.outputs[0]].dtype).itemsize)
  return int(scratch) if scratch <= TRANSPOSED_CONV_MAX_SCRATCH else 0


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
  in_place: tuple[tuple[int, int], ...] = ()   # (value, an operand it may overwrite),
                                               #   indices into `owned`, in dataflow order
  dot_copies: tuple[tuple[int, int], ...] = ()   # (node, value id): `_copied_operands`
  conv_copies: tuple[tuple[int, int, int, tuple], ...] = ()   # `_canonicalized_convs`
  draws: tuple[tuple[int, int], ...] = ()        # (node, value id): random draws' results
  working: tuple[Node, ...] = ()                 # nodes with a working set (memory's)
  half_dots: tuple = ()                          # `_half_dots`, where `fusion`
  halves: frozenset = frozenset()                # 16-bit owned values not results or
                                                 #   written into a loop's buffers

  def live_ranges(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first step, last step) of each owned buffer, in positions of an order (`pos`:
    node -> position); an output lives to the end, as XLA keeps it."""
    start = pos[self.made_by]
    end = start.copy()
    np.maximum.at(end, self.read_value, pos[self.read_by])
    end[self.is_output] = len(pos) - 1
    return start, end

  def shared(self, sizes: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """`sizes` with each value that writes into a dying operand's buffer merged into that
    buffer: the value starts where the operand did, the operand takes no bytes of its own
    (`start` is updated in place)."""
    sizes = sizes.copy()
    for v, u in self.in_place:
      if (sizes[u] and sizes[u] == sizes[v] and end[u] == start[v]
          and not self.is_output[u]):
        start[v] = start[u]
        sizes[u] = 0
    return sizes


def _stored(program: Program, fusion: bool, streamed: frozenset = frozenset(),
            carried: frozenset = frozenset(), sliced: frozenset = frozenset(),
            kept: frozenset = frozenset(), entry: bool = False,
            split: frozenset = frozenset()) -> _Stored:
  """`streamed`: results the caller copies out as soon as they are made (a scan body's
  per-iteration outputs, which XLA writes into their stacked buffers): temporaries, unless
  also `carried` (the loop's next state), which live to the body's end when stored.
  `sliced`: inputs that are one iteration's slice of a stacked operand, stored (from
  their first reader to their last) where a reader cannot compute the slice itself.
  `entry`: the program XLA compiles (not a loop body or branch), whose convolutions XLA
  may copy operands of (`_canonicalized_convs`). `split`: the reductions XLA splits
  (`_tree_reductions`), which store what they reduce."""
  entry = entry and fusion and canonicalizes_convolutions()
  key = (id(program), fusion, streamed, carried, sliced, kept, entry, split)
  hit = _STORED.get(key)
  if hit is not None and hit[0] is program:
    return hit[1]
  convs = _canonicalized_convs(program) if entry else ()
  # A convolution reads the copies of its copied operands, not the operands themselves.
  copied = frozenset((i, x) for i, x, _, _ in convs if x not in program.nodes[i].outputs)
  fused, duplicated = (_fusion(program, streamed, carried, kept, copied, split) if fusion
                       else ({}, {}))
  dataflow = _topological(program) if fusion else []
  via: dict[int, tuple[int, ...]] = {}   # a value computed in a reader's loop -> the
  recomputed = {**fused, **duplicated}   #   stored values it reads
  if recomputed:   # in dataflow order: chains of fused values can be thousands long
    for node in dataflow:
      for v in node.outputs:
        if v in recomputed:
          via[v] = tuple(dict.fromkeys(y for o in recomputed[v] for y in via.get(o, (o,))))
  def reads(x, reader=None):   # what a reader's loop reads to compute operand x
    if x in duplicated and not (reader is not None and _takes(reader, x, copied, split)):
      return (x,)
    return via.get(x, (x,))

  alias = memory._aliases(program)   # noqa: SLF001 (the model's own buffers)
  index: dict[int, int] = {}
  made_by = []
  for node in program.nodes:
    for o in node.outputs:
      if o not in fused and o not in alias:
        index[o] = len(made_by)
        made_by.append(node.index)
  if sliced:
    first: dict[int, int] = {}
    for node in program.nodes:
      for x in sliced.intersection(y for x in node.operands for y in reads(x, node)):
        first[x] = min(first.get(x, node.index), node.index)
        if node.name not in FUSES_INTO or node.index in split:
          index.setdefault(x, -1)
    for x in [x for x, k in index.items() if k < 0]:
      index[x] = len(made_by)
      made_by.append(first[x])
  read_by, read_value = [], []
  for node in program.nodes:
    for k in {index.get(alias.get(y, y)) for x in node.operands if (node.index, x) not in copied
              for y in reads(x, node)}:
      if k is not None:
        read_by.append(node.index)
        read_value.append(k)
  outputs = stored_outputs(program) - (streamed - carried)
  owned = tuple(index)
  reshaped = _reshaped_dots(program)
  in_place = tuple((index[v], index[u]) for node in dataflow
                   if node.name in IN_PLACE and len(node.outputs) == 1
                   for v in node.outputs if v in index
                   for u in dict.fromkeys(node.operands)
                   if u in index and u not in streamed and u not in carried
                   and u not in reshaped)
  stored = _Stored(owned, np.asarray(made_by, np.int64),
                   np.fromiter((o in outputs for o in owned), bool, len(owned)),
                   np.asarray(read_by, np.int64), np.asarray(read_value, np.int64), in_place,
                   _copied_operands(program) if fusion else (),
                   convs,
                   tuple((n.index, n.outputs[0]) for n in program.nodes
                         if fusion and n.name == "random_bits" and n.outputs[0] in index),
                   memory.working_nodes(program),
                   _half_dots(program, alias) if fusion else (),
                   _float32_halves(program, owned, outputs | streamed | carried)
                   if fusion else frozenset())
  memory._remember(_STORED, key, (program, stored))   # noqa: SLF001
  return stored


_STORED: dict = {}


def fused_values(program: Program, streamed: frozenset = frozenset(),
                 carried: frozenset = frozenset(), kept: frozenset = frozenset(),
                 copied: frozenset = frozenset()) -> dict[int, tuple[int, ...]]:
  """The values XLA computes inside their readers -> the values they read.

  A loop body's `streamed` results (copied into their stacked buffers as they are made)
  and `carried` results (written into the loop's state) are read by that copy too, which
  can compute them. A cheap value fused into several readers is computed in each, so an
  expensive value it reads is computed once per reader's loop: read by more than one
  loop, it is stored. `kept` values are stored (a fence holds them). `copied`: (node,
  value) of the convolutions' operands XLA copies, whose copy can compute the value."""
  return _fusion(program, streamed, carried, kept, copied)[0]


def _takes(reader: Node, x: int, copied: frozenset, split: frozenset) -> bool:
  """Whether `reader`'s loop can compute its operand `x` (fused into it): an op of
  `FUSES_INTO` but a split reduction (`_tree_reductions`), or a convolution's copy."""
  return ((reader.name in FUSES_INTO and reader.index not in split)
          or (reader.index, x) in copied)


def _fusion(program: Program, streamed: frozenset = frozenset(),
            carried: frozenset = frozenset(), kept: frozenset = frozenset(),
            copied: frozenset = frozenset(), split: frozenset = frozenset()
            ) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
  """(`fused_values`, the cheap values XLA both stores and duplicates -> what they read).

  XLA fuses a cheap producer into every reader that can take it and stores it only for
  the others (a dot, a convolution), which read the stored buffer: the readers that
  recompute it read what it reads, so the stored buffer dies at its last other reader
  (a normalized activation read by the next layer's convolution and by the backward
  pass's elementwise ops is held only until that convolution). Only a producer that
  reads at most one array of its own rank (`_at_most_unary`) is duplicated so; any
  other is computed in its readers only where all of them can (XLA's
  `ComputeGloballyUnfusible`: duplicating it would read more than it writes). A reduction
  in `split` (`_tree_reductions`) takes no operand into its loop and is stored itself."""
  readers: dict[int, list[Node]] = {}
  made: dict[int, Node] = {}
  for node in program.nodes:
    for x in set(node.operands):
      readers.setdefault(x, []).append(node)
    for o in node.outputs:
      made[o] = node
  results = {x for x in program.outputs if not isinstance(x, Const)} - streamed - carried
  fused: dict[int, tuple[int, ...]] = {}
  duplicated: dict[int, tuple[int, ...]] = {}
  loops: dict[int, int] = {}   # a value -> how many loops compute or read it
  for node in reversed(_topological(program)):   # a value's readers are decided first
    if len(node.outputs) != 1:
      continue
    (v,) = node.outputs
    rs = readers.get(v, ())
    takes = [_takes(r, v, copied, split) or (not node.operands and r.name in _SINK_CONSTANTS)
             for r in rs]
    computing = lambda r: (loops[r.outputs[0]] if r.outputs and (
        r.outputs[0] in fused or r.outputs[0] in duplicated) else 1)
    loops[v] = (v in streamed) + (v in carried) + sum(
        computing(r) if take else 1 for r, take in zip(rs, takes))
    if (node.name not in FUSIBLE or node.index in split or v in results or v in kept
        or not loops[v]
        or (node.name in EXPENSIVE and (loops[v] > 1 or any(r.name in REUSES for r in rs)))):
      continue
    if all(takes):
      fused[v] = node.operands
    elif any(takes) and node.name not in EXPENSIVE and _at_most_unary(program, node, made):
      duplicated[v] = node.operands
      loops[v] = (v in streamed) + (v in carried) + 1 + sum(
          computing(r) for r, take in zip(rs, takes) if take)
  return fused, duplicated


def _at_most_unary(program: Program, node: Node, made: Mapping[int, Node]) -> bool:
  """Whether `node` reads at most one array of its result's rank (XLA's
  `EffectivelyAtMostUnary`): broadcasts, iotas, constants and lower-rank arrays aside,
  dims of size 1 not counted."""
  def rank(aval) -> int:
    return sum(1 for d in aval.shape if not (isinstance(d, int) and d == 1))
  out = rank(program.avals[node.outputs[0]])
  return sum(1 for x in node.operands
             if made.get(x) is None or made[x].name not in ("broadcast_in_dim", "iota")
             if rank(program.avals[x]) >= out) <= 1


def _topological(program: Program) -> list[Node]:
  """The nodes, each after the producers of its operands (a rewritten program lists
  appended nodes last, not in dataflow order)."""
  producer = {o: node.index for node in program.nodes for o in node.outputs}
  seen: set[int] = set()
  out: list[Node] = []
  for root in program.nodes:
    stack = [(root.index, False)]
    while stack:
      i, expanded = stack.pop()
      if expanded:
        out.append(program.nodes[i])
        continue
      if i in seen:
        continue
      seen.add(i)
      stack.append((i, True))
      stack.extend((producer[x], False) for x in program.nodes[i].operands
                   if x in producer and producer[x] not in seen)
  return out


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
