"""Probes of device memory: what the run-time guards read (DESIGN.md F6)."""

from __future__ import annotations

import collections
import math

import jax


def device_memory() -> tuple[int | None, int | None]:
  """(bytes in use, bytes limit) of the default device, or Nones where unknown (CPU)."""
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return None, None
  return stats.get("bytes_in_use"), stats.get("bytes_limit")


def live_bytes() -> int:
  """Bytes held by live arrays on the fullest device: the allocator's figure where the
  backend has one, otherwise from `jax.live_arrays()` (about 10 us at 10 arrays); a
  sharded array counts its shard on each device that holds one."""
  in_use, _ = device_memory()
  if in_use is not None:
    return in_use
  arrays = [a for a in jax.live_arrays() if not a.is_deleted()]
  if jax.device_count() == 1:
    return sum(a.nbytes for a in arrays)
  per_device: collections.Counter = collections.Counter()
  for a in arrays:
    shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    for d in a.sharding.device_set:
      per_device[d] += shard
  return max(per_device.values(), default=0)
