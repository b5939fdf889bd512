"""Progress of long planning, logged through absl at INFO.

Planning a large step (tracing, the shape graph, schedule candidates at several
shapes of interest, up to `max_rounds` remat rounds) can take minutes; silence
looks like a hang. Stages call `update(stage, count, total, **extra)`; inside a
`planning(name)` block, a line is logged once planning has run for `after`
seconds, then at most every `every` seconds (a change of stage is logged at most
every `every / 4`). Outside a block, `update` does nothing. The caller logs the
total (`analysis.analyze_function`).
"""

from __future__ import annotations

import contextlib
import threading
import time

from absl import logging

AFTER_S = 2.0    # quiet for plans faster than this
EVERY_S = 5.0    # at most one line per this many seconds (stage changes: a quarter)

_local = threading.local()


class _Planning:

  def __init__(self, name: str, after: float, every: float):
    self.name, self.after, self.every = name, after, every
    self.start = time.monotonic()
    self.last_log = None
    self.last_stage = None
    self.logged = 0

  def update(self, stage: str, count: int | None, total: int | None, at_most: bool,
             extra) -> None:
    now = time.monotonic()
    if now - self.start < self.after:
      self.last_stage = stage
      return
    gap = self.every / 4 if stage != self.last_stage else self.every
    if self.last_log is not None and now - self.last_log < gap:
      return
    self.last_log, self.last_stage = now, stage
    self.logged += 1
    what = stage + (f" {count}" if count is not None else "") + (
        f" of {'at most ' if at_most else ''}{total}" if total is not None else "")
    details = "".join(f", {k} {_fmt(v)}" for k, v in extra.items())
    logging.info("jax_symmem: planning %s: %s%s (%.1f s so far)", self.name, what, details,
                 now - self.start)


def _fmt(v) -> str:
  if isinstance(v, int) and v >= 2**20:
    return f"{v / 2**20:.1f} MiB"
  return str(v)


@contextlib.contextmanager
def planning(name: str, after: float | None = None, every: float | None = None):
  """Reports `update`s made inside the block (nested blocks report to the outer one);
  `after` and `every` default to AFTER_S and EVERY_S."""
  after = AFTER_S if after is None else after
  every = EVERY_S if every is None else every
  outer = getattr(_local, "current", None)
  if outer is not None:
    yield outer
    return
  _local.current = p = _Planning(name, after, every)
  try:
    yield p
  finally:
    _local.current = None


def update(stage: str, count: int | None = None, total: int | None = None, *,
           at_most: bool = False, **extra) -> None:
  """Records that planning reached `stage`: item `count` of `total` (of at most
  `total` where the stage may stop early), with `extra` figures (bytes as MiB)."""
  p = getattr(_local, "current", None)
  if p is not None:
    p.update(stage, count, total, at_most, extra)
