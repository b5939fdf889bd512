"""Memory budgets as users write them, and byte counts as messages print them."""

from __future__ import annotations

import numbers
import re

FORMS = ("bytes (a positive int), a fraction of device memory (a float in (0, 1]), or a size "
         "such as '200MiB' or '6 GiB' (units B, KiB, MiB, GiB, TiB)")
_BINARY_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class _AnalysisBudget:
  def __repr__(self) -> str:
    return "<the analysis's memory_budget>"


# The default `budget` of the reports (memory_curves, memory_report): the analysis's own.
ANALYSIS_BUDGET = _AnalysisBudget()


def parse(memory_budget):
  """None, a fraction (float in (0, 1]) or bytes (int; a size string as bytes). Checks
  without asking the device (symmem.jit may be built before jax.distributed.initialize),
  so a malformed budget fails where it is given."""
  if memory_budget is None:
    return None
  if isinstance(memory_budget, str):
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]iB|B)\s*", memory_budget)
    if not m:   # binary units only: whether 'MB' means 10**6 or 2**20 bytes is a guess
      raise ValueError(f"memory_budget={memory_budget!r}: give {FORMS}")
    memory_budget = int(float(m.group(1)) * _BINARY_UNITS[m.group(2)])
  if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
    raise TypeError(f"memory_budget must be {FORMS}; got {type(memory_budget).__name__}")
  if isinstance(memory_budget, numbers.Integral):   # NumPy integers too
    if memory_budget <= 0:
      raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    return int(memory_budget)
  if not 0 < memory_budget <= 1:
    # A float above 1 is most likely bytes computed with float arithmetic (2e9, a peak
    # times 1.25): say how to pass it rather than guess that it is one.
    hint = (f" (bytes as a float? pass int({memory_budget!r}))"
            if memory_budget > 1 and memory_budget == int(memory_budget) else "")
    raise ValueError(f"a fractional memory_budget must be in (0, 1], got {memory_budget}"
                     f"{hint}; give {FORMS}")
  return float(memory_budget)


def bytes_only(memory_budget) -> int | None:
  """`parse`, for places with no device to take a fraction of (reports of a model)."""
  parsed = parse(memory_budget)
  if isinstance(parsed, float):
    raise ValueError(f"budget={memory_budget!r} is a fraction of device memory; give bytes "
                     "or a size such as '200MiB' here")
  return parsed


def sizes(*nbytes: int) -> tuple[str, ...]:
  """Byte counts for one message, compared with each other: MiB to one decimal, all in
  bytes where two would read the same; a count under 0.05 MiB (it would read 0.0) in
  bytes."""
  mib = tuple(f"{n / 2**20:.1f} MiB" for n in nbytes)
  if len(set(mib)) < len(mib):
    return tuple(f"{n:,} bytes" for n in nbytes)
  return tuple(f"{n:,} bytes" if n < 2**20 / 20 else m for n, m in zip(nbytes, mib))


def refusal_advice(device_limit: bool) -> str:
  """What a BudgetError advises: under the device's own limit (no memory_budget was
  given) there is no budget to raise."""
  return ("use shorter/smaller batches or a device with more memory" if device_limit
          else "raise the budget or use shorter/smaller batches")
