"""Probes of device memory: what the run-time guards read (DESIGN.md F6)."""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np


def device_memory() -> tuple[int | None, int | None]:
  """(bytes in use, bytes limit) of this process's first device, or Nones where unknown
  (CPU). With several processes `jax.devices()[0]` is another process's device, whose
  memory_stats() raise."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats:
    return None, None
  return stats.get("bytes_in_use"), stats.get("bytes_limit")


def array_bytes(a) -> int:
  """An array's bytes, global (not per shard). Not `a.nbytes`: that goes through numpy,
  3x slower (635 vs 204 us at 700 arrays), and it is summed on every budgeted call."""
  return math.prod(a.shape) * a.dtype.itemsize


def live_bytes() -> int:
  """Bytes held by live arrays on the fullest device: the allocator's figure where the
  backend has one, otherwise from `jax.live_arrays()` (about 10 us at 10 arrays); a
  sharded array counts its shard on each device that holds one, and each buffer counts
  once: what `jax.device_get`, `np.asarray` or printing leave of a sharded array (live
  arrays of one shard each, over its buffers) adds nothing."""
  in_use, _ = device_memory()
  if in_use is not None:
    return in_use
  arrays = [a for a in jax.live_arrays() if not a.is_deleted()]
  if jax.device_count() == 1:
    return sum(map(array_bytes, arrays))
  from jax_symmem._src import tracing   # JAX internals live there; imported when needed
  per_device: collections.Counter = collections.Counter()
  seen = set()
  for a in arrays:
    for x in tracing.shard_arrays(a):
      (d,) = x.sharding.device_set
      key = (d, x.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        per_device[d] += array_bytes(x)
  return max(per_device.values(), default=0)


# --- several processes (jax.distributed) -------------------------------------------------
#
# A step whose arrays span the devices of several processes is one SPMD program:
# every process must dispatch the same executable (eviction round, compile options)
# at the same call, or the program deadlocks or diverges. The live-bytes probe is
# local (another process may hold other arrays), and so, in principle, is XLA's
# memory_analysis() of a compiled variant (e.g. GPU autotuning per process), so
# each is replaced by the largest reading over the processes: one small all-gather
# over the devices (`multihost_utils.process_allgather`), done only when the
# arguments span several processes. With one process nothing is exchanged.

_LOW_BITS = 30   # ints travel as two int32 halves: exact below 2**61 without x64


def spans_processes(args: Sequence[Any]) -> bool:
  """Whether any argument array has shards on devices of another process."""
  if jax.process_count() == 1:
    return False
  return any(not a.is_fully_addressable for a in args if isinstance(a, jax.Array))


def all_processes(values: Sequence[int]) -> list[tuple[int, ...]]:
  """Every process's non-negative `values`, in process order (the same list in each)."""
  halves = np.array([h for v in values for h in (v >> _LOW_BITS, v & ((1 << _LOW_BITS) - 1))],
                    np.int32)
  rows = multihost_utils.process_allgather(halves)
  return [tuple((int(row[2 * i]) << _LOW_BITS) + int(row[2 * i + 1]) for i in range(len(values)))
          for row in rows]


def agreed_reserved(reserved: int, budget: int, args: Sequence[Any]) -> int:
  """`reserved` (bytes other arrays hold per device) as every process of the step
  agrees on it: the largest reading, so the chosen variant fits on every process.
  Raises the same ValueError in every process if their budgets differ."""
  if not spans_processes(args):
    return reserved
  rows = all_processes((reserved, budget))
  if len({b for _, b in rows}) > 1:
    raise ValueError(f"memory_budget resolves to different bytes across processes "
                     f"({sorted({b for _, b in rows})}); give it in bytes")
  return max(r for r, _ in rows)


def agreed_footprint(footprint: int, args: Sequence[Any]) -> int:
  """XLA's footprint of a compiled variant as every process of the step agrees on it
  (the largest), so the recompile loop takes the same branch everywhere."""
  if not spans_processes(args):
    return footprint
  return max(r for (r,) in all_processes((footprint,)))


def agreed_seconds(seconds: dict[int, float], args: Sequence[Any]) -> dict[int, float]:
  """Per-round step times as every process of the step agrees on them (the slowest
  process's, which an SPMD step waits for), so each keeps the same round."""
  if not spans_processes(args):
    return seconds
  rounds = sorted(seconds)
  rows = all_processes([round(seconds[r] * 1e6) for r in rounds])
  return {r: max(row[i] for row in rows) / 1e6 for i, r in enumerate(rounds)}
