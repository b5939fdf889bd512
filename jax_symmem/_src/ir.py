"""The program IR every stage after tracing works on: frozen, free of JAX internals.

A `Program` is a flat list of `Node`s (one primitive application each, in trace
order) over integer value ids that are unique across a whole program tree; a
control-flow node keeps its bodies as nested `Program`s (`Node.subprograms`).
`tracing.py` builds them from jaxprs; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Any, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class Const:
  """A literal or closed-over constant used as an operand."""
  value: Any
  aval: Any


Operand = Any  # int (a value id) | Const


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
  """One primitive application. Value ids are unique across a whole Program tree."""
  index: int
  primitive: Any                # a jax Primitive
  params: Mapping[str, Any]
  inputs: tuple[Operand, ...]
  outputs: tuple[int, ...]
  source: str                   # "path:line:col (function) @ scope" (tracing._source)
  effects: frozenset = frozenset()
  subprograms: tuple["Program", ...] = ()

  @property
  def name(self) -> str:
    return self.primitive.name

  @functools.cached_property
  def operands(self) -> tuple[int, ...]:
    """The value ids among `inputs` (constants left out), in order, repeats kept:
    what liveness and dataflow read, on every planning round's hot path."""
    return tuple(x for x in self.inputs if not isinstance(x, Const))


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A flat program: inputs, nodes in trace order, outputs, and every value's aval."""
  inputs: tuple[int, ...]
  nodes: tuple[Node, ...]
  outputs: tuple[Operand, ...]
  avals: Mapping[int, Any]

  def __repr__(self) -> str:   # the nodes of a 1B-parameter step would be megabytes
    return (f"Program({len(self.nodes)} nodes, {len(self.inputs)} inputs, "
            f"{len(self.outputs)} outputs)")

  def value_ids(self) -> tuple[int, ...]:
    """The inputs, then every node's outputs (each planning round reads them a few times)."""
    return self._value_ids

  @functools.cached_property
  def _value_ids(self) -> tuple[int, ...]:
    return self.inputs + tuple(self.writes[1].tolist())

  @functools.cached_property
  def reads(self) -> tuple[np.ndarray, np.ndarray]:
    """(node index, value id) of every operand read, in node order, repeats kept: the
    planner's per-round tables of a program are built from these with numpy."""
    return _per_node_table([n.operands for n in self.nodes])

  @functools.cached_property
  def writes(self) -> tuple[np.ndarray, np.ndarray]:
    """(node index, value id) of every node output, in node order."""
    return _per_node_table([n.outputs for n in self.nodes])

  @functools.cached_property
  def control_flow(self) -> tuple[Node, ...]:
    """The nodes with subprograms (scan, while, cond), in node order."""
    return tuple(n for n in self.nodes if n.subprograms)

  def walk(self):
    """Yields (program, node) for this program and every nested subprogram."""
    for n in self.nodes:
      yield self, n
      for sub in n.subprograms:
        yield from sub.walk()

  def max_id(self) -> int:
    """The largest value id here or in any subprogram (-1 if none): a rewrite's new
    values start above it."""
    return max(max(self.inputs, default=-1), int(self.writes[1].max(initial=-1)),
               *(sub.max_id() for n in self.control_flow for sub in n.subprograms))


def _per_node_table(ids_per_node: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
  """(node index, value id) arrays of every id listed per node, in node order."""
  node_of = np.repeat(np.arange(len(ids_per_node), dtype=np.int64),
                      np.fromiter(map(len, ids_per_node), np.int64, len(ids_per_node)))
  ids = np.fromiter(itertools.chain.from_iterable(ids_per_node), np.int64, len(node_of))
  return node_of, ids


# A layer's scope: the scope up to its first component ending in an index, as Flax and
# HF name repeated layers ("encoder/layer_0/attn" -> "encoder/layer_0", "h_1",
# "encoder/block/2/layer/0" -> "encoder/block/2").
_LAYER_SCOPE = re.compile(r"^((?:[^/]*/)*?[^/]*?\d+)(?:/|$)")


def layer_scope(source: str) -> str | None:
  """The layer a node's `source` ("path:line (fn) @ scope") belongs to, or None."""
  _, _, scope = source.partition(" @ ")
  m = _LAYER_SCOPE.match(scope) if scope else None
  return m.group(1) if m else None


def layer_calls(nodes, forward, residual_makers=()) -> dict[int, str]:
  """Where one layer scope runs the same ops several times over in its forward, which
  run each of its nodes belongs to: {node index: "scope (call k)"}.

  One module called once per layer (its weights shared across the layers: ALBERT,
  weight-tied "universal" transformers) gives every layer the same scope. Its calls
  trace the same ops from the same lines, so in program order the scope's ops
  (primitive and source) start with a run that repeats with a period; each period is
  a call. A split is kept only where the run holds every one of the scope's
  `forward` nodes (a node index set) but for the last call's tail; elsewhere the
  scope is one layer, as `layer_scope` reads it, and is not in the result.

  Where no forward node has a layer scope, the layers are read from the longest run
  of repeated ops before the last of `residual_makers` (the nodes whose values are
  live across the peak), each whole period a call: "repeated layer (call k)".
  """
  members: dict[str, list[int]] = {}
  for i, n in enumerate(nodes):
    scope = layer_scope(n.source)
    if scope is not None:
      members.setdefault(scope, []).append(i)
  out: dict[int, str] = {}
  for scope, idx in members.items():
    length, p = _periodic_prefix([(nodes[i].name, nodes[i].source) for i in idx])
    last_forward = max((k for k, i in enumerate(idx) if i in forward), default=-1)
    if not p or last_forward >= length + p:
      continue
    for k, i in enumerate(idx[:length + p]):
      if k < length or i in forward:   # past the run: the last call's forward tail
        out[i] = f"{scope} (call {min(k, length - 1) // p})"
  if not any(layer_scope(nodes[i].source) for i in forward):
    # No scope names a layer (Flax NNX and Equinox modules push none): the layers are
    # the longest run of ops that repeats, in program order up to the last node that
    # makes a residual (all nodes up to there: which of a layer's ops run before the
    # peak depends on the schedule, and the last layer's differ; the optimizer's
    # scalar steps may run before it anywhere).
    idx = range(max(residual_makers or forward, default=-1) + 1)
    codes: dict[tuple[str, str], int] = {}
    seq = np.fromiter((codes.setdefault((nodes[i].name, nodes[i].source), len(codes))
                       for i in idx), np.int64, len(idx))
    start, length, p = _tandem_repeat(seq.tobytes())
    for k in range(length - length % p):   # whole periods: a part of one is the head's
      out[idx[start + k]] = f"repeated layer (call {k // p})"   # norm, the layers' code
  return out


@functools.lru_cache(maxsize=64)
def _tandem_repeat(codes: bytes) -> tuple[int, int, int]:
  """(start, n, p): the run codes[start:start + n] that repeats with period p
  (codes[i] == codes[i + p] for start <= i < start + n - p) covering the most
  elements in at least two whole periods, the smallest such p on ties; (0, 0, 1)
  if none. int64 codes, as bytes to be cached across a plan's rounds."""
  seq = np.frombuffer(codes, np.int64)
  best = (0, 0, 1)
  for p in range(1, len(seq) // 2 + 1):
    same = np.concatenate(([False], seq[:-p] == seq[p:], [False]))
    edges = np.flatnonzero(same[1:] != same[:-1])   # run starts and ends, in pairs
    if not len(edges):
      continue
    runs = edges[1::2] - edges[::2]
    j = int(runs.argmax())
    covered = int(runs[j]) + p
    if runs[j] >= p and covered > best[1]:
      best = (int(edges[2 * j]), covered, p)
  return best


def _periodic_prefix(seq) -> tuple[int, int]:
  """(n, p): the longest prefix seq[:n] with seq[i] == seq[i - p] for p <= i < n that
  holds at least two whole periods, p its smallest period; (0, 0) if none (KMP's
  prefix function: the smallest period of seq[:n] is n - border[n - 1])."""
  border = [0] * len(seq)
  k = 0
  for i in range(1, len(seq)):
    while k and seq[i] != seq[k]:
      k = border[k - 1]
    if seq[i] == seq[k]:
      k += 1
    border[i] = k
  for n in range(len(seq), 1, -1):
    p = n - border[n - 1]
    if 2 * p <= n:
      return n, p
  return 0, 0


def source_label(source: str, primitive: str = "") -> str:
  """A node's `source` for messages: the file without its directory
  ("model.py:41:8 (__call__) @ Block_3/LayerNorm_0"), or the primitive where JAX
  produced the value with no user frame."""
  label = re.sub(r"^\S*/(?=[^/\s]+:\d+)", "", source)
  if not label or label.startswith(" "):
    label = f"{primitive} (no user source line){label}"
  return label
