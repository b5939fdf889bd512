"""Probes of device memory: what the run-time guards read (DESIGN.md F6)."""

from __future__ import annotations

import jax


def device_memory() -> tuple[int | None, int | None]:
  """(bytes in use, bytes limit) of the default device, or Nones where unknown (CPU)."""
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return None, None
  return stats.get("bytes_in_use"), stats.get("bytes_limit")


def live_bytes() -> int:
  """Bytes held by live arrays: the allocator's figure where the backend has one,
  otherwise the sum over `jax.live_arrays()` (about 10 us at 10 arrays)."""
  in_use, _ = device_memory()
  if in_use is not None:
    return in_use
  return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
