"""Speed trials: which of two compiled rounds of one shape runs faster, timed on real calls.

The rounds are ordered by memory, and the model ranks them by the FLOPs they
recompute: fewer is faster, by that measure. XLA does not always agree. On a
scanned Equinox GPT (`examples/gpt_equinox.py`, b=4, s=512, CPU) the round that
recomputes every layer from its input ran 1.04 x per-layer checkpointing's time
while round 0, which recomputes nothing, ran 1.16 x and rounds 1 and 3 1.29 and 1.22 x
(interleaved timings, 5 passes, all compiled with the budget's options): stacking a scan's residuals
and reading them back costs more there than recomputing them. Only a clock
settles that, so when a shape comes back under `symmem.jit(..., speed_trials=True)`
its dispatched round and the last round (the least memory: it fits whenever the
dispatched one does) run in turn on the caller's own calls, each timed from its
inputs ready to its outputs ready, and the shape keeps the faster by each one's
fastest call. Not by the median: right after the challenger's compile the next calls
run slow, whichever round they run (the unrolled Llama at b=4, s=128, CPU: round 0's
three timed calls 0.110 / 0.163 / 0.055 s, the last round's 0.071 / 0.074 / 0.083,
where, run in turn later, they took 0.056 / 0.069 s, medians of six; ad hoc,
2026-12-04): by medians that trial kept the slower round. Noise on a shared host only
adds time, so the fastest of a few calls is the estimate least disturbed by it.

A `SpeedTrial` is the bookkeeping of one such comparison; `symmem.jit` owns the
executables, the clock and the lock.
"""

from __future__ import annotations

import dataclasses

# Timed calls per candidate (after the challenger's first, untimed call: a fresh
# executable's first run allocates and warms caches).
TIMED_CALLS = 3
# The challenger replaces the incumbent only when its fastest call is at least this much
# faster: two variants within noise keep the one the memory plan chose.
MARGIN = 0.03


@dataclasses.dataclass
class SpeedTrial:
  """Alternating timed calls of two rounds of one shape (`incumbent`: the one dispatched)."""
  incumbent: int
  challenger: int
  times: dict[int, list[float]] = dataclasses.field(default_factory=dict)
  warmed: bool = False

  def next_round(self) -> int:
    """The round the next call runs: the challenger's warm-up, then turns, fewest first."""
    if not self.warmed:
      return self.challenger
    a, b = (len(self.times.get(r, ())) for r in (self.incumbent, self.challenger))
    return self.incumbent if a <= b else self.challenger

  def record(self, k: int, seconds: float) -> None:
    if k == self.challenger and not self.warmed:
      self.warmed = True   # untimed
      return
    self.times.setdefault(k, []).append(seconds)

  def done(self) -> bool:
    return all(len(self.times.get(r, ())) >= TIMED_CALLS for r in (self.incumbent, self.challenger))

  def fastest(self) -> dict[int, float]:
    """Each round's fastest timed call, in seconds."""
    return {r: min(t) for r, t in self.times.items()}

  def winner(self, seconds: dict[int, float] | None = None) -> int:
    """The round to keep, by `seconds` per round (default this process's: `fastest()`)."""
    m = self.fastest() if seconds is None else seconds
    return self.challenger if m[self.challenger] < (1 - MARGIN) * m[self.incumbent] else self.incumbent
