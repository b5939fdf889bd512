"""Which layer each node of a flat program belongs to, where scopes alone don't say.

`ir.layer_scope` reads a layer from a node's scope ("encoder/layer_3"). Two ways models
are written leave that short: one module called once per layer (weights shared
across layers) gives every layer one scope, and Flax NNX and Equinox push no scopes
at all. In both the layers' code repeats, so the layers are read from the program's
ops in order (`layer_calls`), each repetition a call.
"""

from __future__ import annotations

import functools

import numpy as np

from jax_symmem._src.ir import layer_scope


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
