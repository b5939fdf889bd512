"""One policy for choosing between two symbolic sizes, and the counts of how each choice was made.

The scheduler (which ready node allocates least) and the remat ranking (which
region costs the fewest FLOPs per byte saved) both ask how two polynomials over
the dims compare, and both answer the same way (DESIGN.md §1, "what reviewers
doubted": how often the comparison decides, and how often the fallback does):

* GE / LE / EQ from `compare` hold at every allowed shape ("decided");
* DEPENDS is resolved at a shape of interest, where memory is tight ("depends");
* otherwise (UNKNOWN, or the size-blind ablation) the caller's own rule decides
  ("fallback": the scheduler's topology rule, the remat ranking's value at the
  shape of interest).

`DecisionCounts` adds up, and converts to the `{"comparisons", "decided",
"depends", "fallback"}` dict that `Schedule.stats`, `Analysis.stats`, the plan
cache and the experiments' JSON use.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping, NamedTuple

from jax_symmem._src import compare as compare_lib
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.poly import Poly

MODES = ("symbolic", "fallback", "static")

_SIGN = {compare_lib.GE: 1, compare_lib.LE: -1, compare_lib.EQ: 0}


@dataclasses.dataclass
class DecisionCounts:
  """How many comparisons were made, and how each was decided."""
  comparisons: int = 0
  decided: int = 0      # GE / LE / EQ: a proof for every shape
  depends: int = 0      # DEPENDS, resolved at the shape of interest
  fallback: int = 0     # UNKNOWN or the ablation: the caller's rule

  def __add__(self, other: DecisionCounts) -> DecisionCounts:
    return DecisionCounts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                    dataclasses.astuple(other))))

  def as_dict(self) -> dict[str, int]:
    """{"comparisons", "decided", "depends", "fallback"}, in that order."""
    return dataclasses.asdict(self)

  @classmethod
  def from_stats(cls, stats: Mapping[str, int]) -> DecisionCounts:
    """The four counts in a stats dict (other keys ignored, a missing one is 0)."""
    return cls(**{f.name: int(stats.get(f.name, 0)) for f in dataclasses.fields(cls)})


class Decision(NamedTuple):
  """sign(lhs - rhs) as the policy decided it."""
  sign: int | None   # -1, 0, +1; None: undecidable here, the caller falls back
  proven: bool       # the sign holds at every allowed shape (or the dims are exact)


_FALL_BACK = Decision(None, False)


class Decider:
  """Compares sizes exactly, resolves DEPENDS at `at`, and counts each outcome in `counts`.

  `mode` as `Schedule.mode`: "symbolic" compares; "fallback" (the ablation)
  never does, so every comparison falls back; "static" means `at` are the exact
  dims, so sizes are evaluated there and nothing is counted.

  Sizes are interned (`intern`; `lookup` and `count` on the ids): a list pass meets the
  same few hundred impacts millions of times, so each pair is decided once and
  every call after that is a lookup (and still counted).
  """

  def __init__(self, constraints: Constraints, at: Mapping[str, int], mode: str = "symbolic"):
    if mode not in MODES:
      raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    self.constraints, self.at, self.mode = constraints, at, mode
    self.counts = DecisionCounts()
    self._ids: dict[Poly, int] = {}
    self._polys: list[Poly] = []
    self._memo: dict[tuple[int, int], tuple[str | None, Decision]] = {}

  def intern(self, size: Poly) -> int:
    """A small integer naming `size` for `lookup`."""
    k = self._ids.get(size)
    if k is None:
      k = self._ids[size] = len(self._polys)
      self._polys.append(size)
    return k

  def decide(self, lhs: Poly, rhs: Poly) -> Decision:
    """How lhs compares with rhs, counted."""
    outcome, decision = self.lookup(self.intern(lhs), self.intern(rhs))
    self.count((outcome,))
    return decision

  def lookup(self, lhs: int, rhs: int) -> tuple[str | None, Decision]:
    """(which count the comparison adds to, its decision) for interned sizes, not counted."""
    try:
      return self._memo[lhs, rhs]
    except KeyError:
      hit = self._memo[lhs, rhs] = self._decide(self._polys[lhs], self._polys[rhs])
      return hit

  def count(self, outcomes: Iterable[str | None] | Mapping[str | None, int]) -> None:
    """Adds comparisons with these `lookup` outcomes (or outcome: how many) to `counts`
    (None: static, uncounted)."""
    counts = self.counts
    # (a dict is the scheduler's hot path; Counter takes any other Mapping's counts as given)
    tally = outcomes if isinstance(outcomes, dict) else collections.Counter(outcomes)
    for outcome, n in tally.items():
      if outcome is not None:
        counts.comparisons += n
        setattr(counts, outcome, getattr(counts, outcome) + n)

  def _decide(self, lhs: Poly, rhs: Poly) -> tuple[str | None, Decision]:
    """(which count it adds to, the decision)."""
    if self.mode == "static":
      return None, Decision(self.sign_at(lhs, rhs), True)
    kind = (compare_lib.compare_polys(lhs, rhs, self.constraints).kind
            if self.mode == "symbolic" else None)
    if kind in _SIGN:
      return "decided", Decision(_SIGN[kind], True)
    if kind == compare_lib.DEPENDS:
      return "depends", Decision(self.sign_at(lhs, rhs), False)
    return "fallback", _FALL_BACK

  def sign_at(self, lhs: Poly, rhs: Poly) -> int:
    """sign(lhs - rhs) at the shape of interest (exact Python ints)."""
    x, y = lhs.evaluate(self.at), rhs.evaluate(self.at)
    return (x > y) - (x < y)
