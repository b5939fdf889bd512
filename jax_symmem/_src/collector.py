"""Tracing and planning with Python's cyclic garbage collector paused.

Both allocate millions of short-lived tuples, lists, dicts and polynomials while the
traced program holds a few hundred thousand long-lived objects, so the collector
keeps running collections, full ones walking every object, that find nothing to free
(reference counting frees the planner's objects): for llama2_1b, ~1.0 s of the
stages' 11 s of CPU, and ~0.4 s once paused (the collection that runs when the
collector resumes). A `gc.collect()` after a whole plan finds no unreachable object.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
  """Disables the collector inside the block (also as a decorator), and enables it again
  after unless it was disabled before: nested blocks, and callers who manage the
  collector themselves, are left as they were."""
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
